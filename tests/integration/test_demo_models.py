"""The demo-model maker against real MLX and mlx-lm (no mocks), on the tiny model only."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.llama import ModelArgs

from engine.demo_models import (
    COMPLETE_MARKER,
    DEMO_SIZES,
    demo_model_bytes,
    demo_model_path,
    ensure_demo_model,
    kv_bytes_per_token,
)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    COMPLETE_MARKER,
)

ROUND_TRIP_TEXTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces,\ttabs\nand newlines  \n",
    "x = 3.14159; y = 1e-5 // 42% of $19.99",
    "café naïve façade",
    "日本語のテキスト",
    "emoji 🙂 and 🚀 with ❤️",
    "Ελληνικά, русский, العربية",
    "a word never seen before: Zyxqwvutsrp",
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model made twice, into two separate caches."""
    a = ensure_demo_model("tiny", tmp_path_factory.mktemp("cache-a"))
    b = ensure_demo_model("tiny", tmp_path_factory.mktemp("cache-b"))
    return a, b


@pytest.fixture(scope="module")
def loaded(made: tuple[Path, Path]) -> tuple[Any, Any]:
    return mlx_lm.load(str(made[0]))


def test_made_where_the_path_says(made: tuple[Path, Path]) -> None:
    a, _ = made
    assert a == demo_model_path("tiny", a.parent.parent)
    assert a.parent.name == "demo-models" and a.name == "tiny-v1"
    assert sorted(p.name for p in a.iterdir()) == sorted(MODEL_FILES)
    # Only the model and its lock beside it: no temporary folder left behind.
    assert sorted(p.name for p in a.parent.iterdir()) == [".tiny-v1.lock", "tiny-v1"]


def test_making_twice_gives_byte_identical_files(made: tuple[Path, Path]) -> None:
    a, b = made
    for name in MODEL_FILES:
        assert sha256(a / name) == sha256(b / name), name


def test_second_call_returns_the_existing_model(made: tuple[Path, Path]) -> None:
    a, _ = made
    before = {p.name: p.stat().st_mtime_ns for p in a.iterdir()}
    assert ensure_demo_model("tiny", a.parent.parent) == a
    assert {p.name: p.stat().st_mtime_ns for p in a.iterdir()} == before


def test_cache_dir_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PLIMSOLL_CACHE_DIR", str(tmp_path / "env"))
    assert demo_model_path("small") == tmp_path / "env" / "demo-models" / "small-v1"
    monkeypatch.delenv("PLIMSOLL_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo_model_path() == tmp_path / "home/.cache/plimsoll/demo-models/tiny-v1"
    with pytest.raises(ValueError, match="unknown demo size"):
        demo_model_path("huge")


def test_recovers_from_a_crashed_maker(made: tuple[Path, Path], tmp_path: Path) -> None:
    final = demo_model_path("tiny", tmp_path)
    # What a maker killed mid-way could leave: its temporary folder, and (never from us,
    # but possible by hand) a folder at the final path without the completion marker.
    stale = final.parent / ".tiny-v1.abc123.tmp"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a model")
    final.mkdir()
    (final / "config.json").write_text("{}")

    assert ensure_demo_model("tiny", tmp_path) == final
    assert not stale.exists()
    for name in MODEL_FILES:
        assert sha256(final / name) == sha256(made[0] / name), name


def test_concurrent_makers_make_one_model(made: tuple[Path, Path], tmp_path: Path) -> None:
    results: list[Path | BaseException] = []

    def make() -> None:
        try:
            results.append(ensure_demo_model("tiny", tmp_path))
        except BaseException as exc:  # reported below, not lost in the thread
            results.append(exc)

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = demo_model_path("tiny", tmp_path)
    assert results == [final] * 4
    assert sorted(p.name for p in final.parent.iterdir()) == [".tiny-v1.lock", "tiny-v1"]
    assert sha256(final / "model.safetensors") == sha256(made[0] / "model.safetensors")


def test_loaded_model_matches_the_spec(loaded: tuple[Any, Any]) -> None:
    model, _ = loaded
    spec = DEMO_SIZES["tiny"]
    params = tree_flatten(model.parameters())
    assert sum(v.size for _, v in params) == spec.param_count()
    assert sum(v.nbytes for _, v in params) == demo_model_bytes("tiny")
    assert {v.dtype for _, v in params} == {mx.float32}
    assert spec.max_position_embeddings >= 2048


@pytest.mark.parametrize("size", list(DEMO_SIZES))
def test_every_size_has_a_loadable_config(size: str) -> None:
    spec = DEMO_SIZES[size]
    args = ModelArgs.from_dict(spec.config())
    assert args.num_key_value_heads < args.num_attention_heads  # GQA
    assert args.hidden_size == args.num_attention_heads * spec.head_dim


def test_sizes_are_as_advertised() -> None:
    mib = 1 << 20
    assert demo_model_bytes("tiny") < 8 * mib
    assert 50 * mib <= demo_model_bytes("small") <= 100 * mib
    assert 250 * mib <= demo_model_bytes("medium") <= 400 * mib
    assert 800 * mib <= demo_model_bytes("large") <= 1300 * mib
    assert 2500 * mib <= demo_model_bytes("xl") <= 3500 * mib


def test_chat_template(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert all(isinstance(i, int) for i in ids)
    expected = "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == expected
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert text == "<|bos|><|im_start|>user\nhi<|im_end|>\n"
    # The markers are single special tokens, and the end of a turn stops generation.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 1
    assert im_end in tokenizer.eos_token_ids
    assert tokenizer.eos_token_id in tokenizer.eos_token_ids


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_text_round_trips(loaded: tuple[Any, Any], text: str) -> None:
    _, tokenizer = loaded
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Token by token through mlx-lm's streaming detokenizer, as the server streams text.
    # (It drops one leading space of a stream, as it does for any byte-level BPE model.)
    detok = tokenizer.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == (text[1:] if text.startswith(" ") else text)


def test_multibyte_characters_span_tokens(loaded: tuple[Any, Any]) -> None:
    """A character the tokenizer never merged is split into byte tokens, and still decodes."""
    _, tokenizer = loaded
    ids = tokenizer.encode("🦜")  # not in the corpus: its four bytes need several tokens
    assert 1 < len(ids) <= 4
    assert tokenizer.decode(ids) == "🦜"


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    # generate_step never stops at EOS: every run yields exactly n tokens.
    return [int(tok) for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_greedy_generation_is_deterministic(
    loaded: tuple[Any, Any], made: tuple[Path, Path]
) -> None:
    model, tokenizer = loaded
    prompt = tokenizer.encode("hello")
    first = greedy(model, prompt, 10)
    assert len(first) == 10
    assert greedy(model, prompt, 10) == first
    other, _ = mlx_lm.load(str(made[1]))
    assert greedy(other, prompt, 10) == first


def test_mlx_lm_generate_runs(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    text = mlx_lm.generate(model, tokenizer, prompt="hello", max_tokens=20)
    assert isinstance(text, str)


def test_kv_bytes_per_token_of_the_tiny_model(made: tuple[Path, Path]) -> None:
    import json

    config = json.loads((made[0] / "config.json").read_text())
    # 2 (K, V) x 2 layers x 2 kv heads x 32 head dim x 4 bytes (float32)
    assert kv_bytes_per_token(config) == 1024


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # Llama-3-8B: GQA, bfloat16. 2 x 32 x 8 x 128 x 2
        (
            {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "torch_dtype": "bfloat16"},
            131_072,
        ),
        # No kv heads given: as many as attention heads. No dtype: float16.
        ({"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768},
         2 * 12 * 12 * 64 * 2),
        # head_dim explicit and not hidden / heads (Gemma style); float32.
        ({"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
          "hidden_size": 3072, "head_dim": 256, "torch_dtype": "float32"},
         2 * 28 * 16 * 256 * 4),
        # head_dim present but null; transformers 5 "dtype"; kv heads null.
        ({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": None,
          "hidden_size": 512, "head_dim": None, "dtype": "torch.float32"},
         2 * 4 * 8 * 64 * 4),
        # A multimodal config: the language model's fields under text_config.
        ({"model_type": "llava", "torch_dtype": "float16",
          "text_config": {"num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 1, "hidden_size": 256}},
         2 * 2 * 1 * 64 * 2),
    ],
)
def test_kv_bytes_per_token(config: dict[str, Any], expected: int) -> None:
    assert kv_bytes_per_token(config) == expected


def test_kv_bytes_per_token_needs_the_shape() -> None:
    with pytest.raises(ValueError):
        kv_bytes_per_token({"num_attention_heads": 8, "hidden_size": 512})
    with pytest.raises(ValueError):
        kv_bytes_per_token({"num_hidden_layers": 8, "num_attention_heads": 8})
