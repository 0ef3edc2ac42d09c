"""Deterministic demo models in mlx-lm's format, made on the spot with no download.

A demo model is a Llama-architecture checkpoint with random weights drawn from a fixed
seed and a real byte-level BPE tokenizer trained on a corpus embedded below. Its text is
gibberish, but it loads, templates, prefills and decodes exactly like a real model, so the
server runs on a fresh machine and memory tests get models of known size (a few MB to ~3 GB).

Making is deterministic: the same size gives byte-identical files on every run on a machine
(the weights come from a counter-based generator and a lookup table, never from float
maths that could vary). `ensure_demo_model` writes into a temporary folder beside the final
one and renames it into place under a file lock, so a crashed or concurrent maker never
leaves half a model behind.

Bump DEMO_FORMAT_VERSION whenever anything here changes the bytes that are made: it is part
of the folder name, so an old cache is never mistaken for the new recipe.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NumPy loads where models are made: client verbs import this module
    import numpy as np

from engine.cache_dir import CACHE_ENV as CACHE_ENV  # re-exported: tools name it here
from engine.cache_dir import cache_root

DEMO_FORMAT_VERSION = 1
COMPLETE_MARKER = "plimsoll_demo.json"

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Trained first, so they take ids 0..4 in this order.
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)

# ChatML-style turns. Works with message content given as a string or as a list of
# {"type": "text", "text": ...} parts (as OpenAI-style clients send it).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DTYPE_BYTES = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
}

# Weights are uniform in [-a, a] with a = std * sqrt(3): std 0.02 keeps logits sane.
_WEIGHT_STD = 0.02
# How many weights are drawn per generator call: bounds the transient memory of a tensor.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class DemoSpec:
    """The shape of one demo model; everything else is derived from it."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "float16"
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 20240611

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def folder_name(self) -> str:
        return f"{self.name}-v{DEMO_FORMAT_VERSION}"

    def param_count(self) -> int:
        return sum(math.prod(shape) for _, shape in tensor_shapes(self))

    def config(self) -> dict[str, Any]:
        """config.json, with every field mlx_lm.models.llama.ModelArgs reads."""
        vocab = _special_ids()
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_traditional": False,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": vocab[BOS],
            "eos_token_id": [vocab[EOS], vocab[IM_END]],
            "pad_token_id": vocab[PAD],
            "plimsoll_demo": {"size": self.name, "version": DEMO_FORMAT_VERSION},
        }


# GQA (kv heads < heads) on every size, with different ratios, so KV bytes per token differ
# from what the weights alone would suggest.
DEMO_SIZES: dict[str, DemoSpec] = {
    spec.name: spec
    for spec in (
        # ~2.6 MB in float32: the default served model; decodes fast on a reference-BLAS CPU.
        # Untied so greedy decoding does not just echo the input token.
        DemoSpec("tiny", 128, 2, 384, 4, 2, 1024, 4096, dtype="float32"),
        # ~67 MB
        DemoSpec("small", 512, 8, 1536, 8, 4, 8192, 4096, dtype="bfloat16"),
        # ~320 MB
        DemoSpec("medium", 1024, 12, 2560, 16, 4, 16384, 4096),
        # ~1 GB
        DemoSpec("large", 2048, 10, 5120, 16, 4, 32000, 4096, dtype="bfloat16",
                 tie_word_embeddings=True),
        # ~3 GB
        DemoSpec("xl", 3072, 13, 8192, 24, 8, 32000, 4096, dtype="bfloat16"),
    )
}


# --------------------------------------------------------------------------------------
# Public helpers


def demo_model_path(size: str = "tiny", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the demo model of this size lives (whether or not it has been made)."""
    spec = _spec(size)
    return cache_root(cache_dir) / "demo-models" / spec.folder_name


def ensure_demo_model(size: str = "tiny", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Make the demo model once and return its folder; return at once if it is complete."""
    spec = _spec(size)
    final = demo_model_path(size, cache_dir)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        # Another process may have finished it while we waited for the lock.
        if is_complete(final):
            return final
        _remove_leftovers(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            # mkdtemp makes it private (0700); the finished model is for every local user.
            tmp.chmod(0o755)
            write_demo_model(spec, tmp)
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# Variants made from a demo model with mlx-lm's own convert: the dtype or quantization
# mlx-community models ship in (bfloat16, 4- and 8-bit affine with group size 64).
DEMO_VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"dtype": "bfloat16"},
    "4bit": {"dtype": "bfloat16", "quantize": True, "q_bits": 4, "q_group_size": 64},
    "8bit": {"dtype": "bfloat16", "quantize": True, "q_bits": 8, "q_group_size": 64},
    "fp32": {"dtype": "float32"},
    # The same weights with a longer context (RoPE has no trained length here): for the
    # benchmarks of long prompts, e.g. the cold tier's 8,192-token restore.
    "16k": {"context": 16384},
}


def demo_variant_path(size: str, variant: str,
                      cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the `variant` (a DEMO_VARIANTS key) of a demo model lives."""
    _variant(variant)
    return demo_model_path(size, cache_dir).with_name(f"{_spec(size).folder_name}-{variant}")


def ensure_demo(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A demo model named as the benchmarks name them: SIZE, or SIZE-VARIANT."""
    size, _, variant = name.partition("-")
    return (ensure_demo_variant(size, variant, cache_dir) if variant
            else ensure_demo_model(size, cache_dir))


def ensure_demo_variant(size: str, variant: str,
                        cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Make the demo model of this size, then once its `variant` with mlx_lm's convert
    (cast and/or quantize), under the same lock-and-rename as the model itself."""
    options = _variant(variant)
    source = ensure_demo_model(size, cache_dir)
    final = demo_variant_path(size, variant, cache_dir)
    if is_complete(final):
        return final
    with _file_lock(final.parent / f".{final.name}.lock"):
        if is_complete(final):
            return final
        _remove_leftovers(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            tmp.chmod(0o755)
            _convert(source, tmp / "model", options)
            made = tmp / "model"
            _write_json(made / COMPLETE_MARKER, {
                "version": DEMO_FORMAT_VERSION,
                "spec": asdict(_spec(size)),
                "variant": variant,
                "convert": options,
            })
            _fsync_dir(made)
            os.replace(made, final)
            _fsync_dir(final.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def is_complete(folder: Path) -> bool:
    """A folder is complete once its marker exists: the marker is written last, before the
    atomic rename, so a folder at the final path without it is not one of ours."""
    return (folder / COMPLETE_MARKER).is_file()


def demo_model_bytes(size: str) -> int:
    """Estimated weight bytes: parameter count x bytes per parameter."""
    spec = _spec(size)
    return spec.param_count() * _DTYPE_BYTES[spec.dtype]


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """KV-cache bytes one token costs: 2 (K and V) x layers x kv heads x head dim x dtype.

    Works for any Hugging Face / mlx-lm style config: reads a nested `text_config` for
    multimodal models, accepts the usual alternative field names, defaults the kv heads to
    the attention heads (no GQA) and the dtype to float16.
    """
    cfg = _text_config(config)
    layers = _first_int(cfg, "num_hidden_layers", "n_layers", "num_layers", "n_layer")
    heads = _first_int(cfg, "num_attention_heads", "n_heads", "num_heads", "n_head")
    if layers is None or heads is None:
        raise ValueError("config lacks num_hidden_layers or num_attention_heads")
    kv_heads = _first_int(cfg, "num_key_value_heads", "n_kv_heads", "num_kv_heads") or heads
    head_dim = _first_int(cfg, "head_dim")
    if not head_dim:
        hidden = _first_int(cfg, "hidden_size", "n_embd", "d_model", "dim")
        if hidden is None:
            raise ValueError("config lacks head_dim and hidden_size")
        head_dim = hidden // heads
    # transformers 5 writes "dtype", older versions "torch_dtype"; nested configs may
    # keep it at the top level only.
    dtype = next(
        (c.get(k) for c in (cfg, config) for k in ("torch_dtype", "dtype") if c.get(k)), None
    )
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a config dtype name ("bfloat16", "torch.float32", ...);
    float16's 2 when absent or unknown, the common case for released checkpoints."""
    if not isinstance(dtype, str):
        return 2
    name = dtype.lower().removeprefix("torch.").removeprefix("mlx.core.")
    return _DTYPE_BYTES.get(name, 2)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config: multimodal ones nest it under text_config."""
    nested = config.get("text_config")
    if isinstance(nested, dict) and "num_hidden_layers" not in config:
        return nested
    return config


def _first_int(cfg: dict[str, Any], *keys: str) -> int | None:
    """The first of `keys` present with a positive integer value (None and 0 are absent)."""
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def dir_size(folder: Path) -> int:
    """Bytes on disk of the regular files in a folder (not recursive: models are flat)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


# --------------------------------------------------------------------------------------
# Making


def write_demo_model(spec: DemoSpec, folder: Path) -> None:
    """Write every file of the model into an existing, empty folder; the marker last."""
    tokenizer = train_tokenizer(spec.vocab_size)
    _write_json(folder / "config.json", spec.config())
    _write_tokenizer_files(tokenizer, spec, folder)
    _write_json(folder / "generation_config.json", _generation_config())
    _write_weights(spec, folder / "model.safetensors")
    _write_json(folder / COMPLETE_MARKER, {
        "version": DEMO_FORMAT_VERSION,
        "spec": asdict(spec),
        "param_count": spec.param_count(),
    })


def tensor_shapes(spec: DemoSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, named as mlx-lm's llama model names them."""
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    q, inter = spec.num_attention_heads * spec.head_dim, spec.intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (spec.vocab_size, h))
    ]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not spec.tie_word_embeddings:
        shapes.append(("lm_head.weight", (spec.vocab_size, h)))
    return shapes


def _write_weights(spec: DemoSpec, path: Path) -> None:
    import mlx.core as mx
    import numpy as np

    table = _value_table(spec.dtype)
    weights: dict[str, Any] = {}
    # On the CPU stream: making never needs (or competes for) an accelerator.
    with mx.stream(mx.cpu):
        for name, shape in tensor_shapes(spec):
            if name.endswith("norm.weight"):
                # RMSNorm scales start at one, as in a freshly initialised model.
                host = np.full(shape, _one(spec.dtype), dtype=table.dtype)
            else:
                host = _random_tensor(table, shape, _tensor_seed(spec, name))
            # Copy into MLX and drop the host array at once: peak memory stays near one
            # model plus one tensor.
            arr = mx.array(host)
            del host
            if spec.dtype == "bfloat16":
                arr = arr.view(mx.bfloat16)  # the table holds bfloat16 bit patterns
            mx.eval(arr)
            weights[name] = arr
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _value_table(dtype: str) -> np.ndarray:
    """The 65,536 weight values a 16-bit draw maps to: uniform on [-a, a], symmetric.

    Mapping draws through a table keeps the bytes identical on every machine: the only
    float maths happens once here, elementwise, with IEEE rounding. For bfloat16 (which
    NumPy lacks) the table holds bit patterns, rounded to nearest even.
    """
    import numpy as np
    a = np.float64(_WEIGHT_STD * np.sqrt(3.0))
    k = np.arange(65536, dtype=np.float64)
    values = (a * ((2.0 * k + 1.0) / 65536.0 - 1.0)).astype(np.float32)
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16)
    if dtype == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(np.uint16)
    raise ValueError(f"unsupported demo dtype {dtype!r}")


def _one(dtype: str) -> float | int:
    """1.0 in the table's representation (a bit pattern for bfloat16)."""
    return 0x3F80 if dtype == "bfloat16" else 1.0


def _random_tensor(table: np.ndarray, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Fill a tensor from its own counter-based stream, a chunk at a time.

    PCG64's raw output is stable across NumPy versions (unlike its distribution methods),
    and an explicit little-endian view makes the 16-bit draws the same on any host.
    """
    import numpy as np
    gen = np.random.PCG64(seed)
    out = np.empty(int(np.prod(shape)), dtype=table.dtype)
    for start in range(0, out.size, _CHUNK_ELEMENTS):
        n = min(_CHUNK_ELEMENTS, out.size - start)
        raw = gen.random_raw((n + 3) // 4).astype("<u8").view("<u2")[:n]
        out[start:start + n] = table[raw]
    return out.reshape(shape)


def _tensor_seed(spec: DemoSpec, name: str) -> int:
    """One independent seed per tensor, so adding a tensor never shifts the others."""
    digest = hashlib.sha256(f"{spec.seed}/{spec.folder_name}/{name}".encode()).digest()
    return int.from_bytes(digest[:16], "little")


def _convert(source: Path, dest: Path, options: dict[str, Any]) -> None:
    """mlx_lm.convert from a local demo model into `dest` (which must not exist); its
    progress lines go nowhere."""
    import io

    from mlx_lm.convert import convert

    options = dict(options)
    context = options.pop("context", None)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(source), str(dest), **options)
    # mlx_lm's convert casts the weights but keeps the config's dtype, from which the KV
    # bytes per token are read: say what the weights now are.
    edits: dict[str, dict[str, Any]] = {}
    if "dtype" in options:
        edits["config.json"] = {"torch_dtype": options["dtype"]}
    if context is not None:
        edits.setdefault("config.json", {})["max_position_embeddings"] = context
        edits["tokenizer_config.json"] = {"model_max_length": context}
    for name, values in edits.items():
        path = dest / name
        _write_json(path, {**json.loads(path.read_text()), **values})


def _variant(variant: str) -> dict[str, Any]:
    try:
        return DEMO_VARIANTS[variant]
    except KeyError:
        raise ValueError(f"unknown demo variant {variant!r}; choose from "
                         f"{', '.join(DEMO_VARIANTS)}") from None


# --------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens (a `tokenizers.Tokenizer`).

    Trained on the embedded corpus, extended with deterministic pseudo-words when the
    vocabulary asks for more merges than the corpus has; any last shortfall is filled with
    reserved special tokens so that every id the model can emit decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, so any text round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_texts(vocab_size), trainer=trainer)
    shortfall = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if shortfall > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(shortfall)])
    return tokenizer


def _training_texts(vocab_size: int) -> list[str]:
    texts = [p.strip() for p in DEMO_CORPUS.split("\n\n") if p.strip()]
    # The corpus alone yields roughly a thousand tokens; bigger vocabularies get
    # pseudo-words to learn from, a few per extra token wanted.
    extra_words = max(0, vocab_size - 1024) * 3
    texts += _pseudo_words(extra_words)
    return texts


def _pseudo_words(count: int, per_line: int = 16) -> list[str]:
    """Deterministic word-like strings from syllables, in lines of `per_line` words."""
    import numpy as np
    if count <= 0:
        return []
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
              "w", "z", "br", "ch", "dr", "st", "th", "tr", "sh", "pl", "gr", "qu"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "x"]
    raw = np.random.PCG64(0xD3E0).random_raw(count * 7).astype(np.uint64)
    lines, words = [], []
    for w in range(count):
        r = raw[w * 7:(w + 1) * 7]
        syllables = 1 + int(r[0] % 3)
        word = "".join(
            onsets[int(r[1 + 2 * s] % len(onsets))]
            + vowels[int(r[2 + 2 * s] % len(vowels))]
            + codas[int((r[1 + 2 * s] >> 32) % len(codas))]
            for s in range(syllables)
        )
        words.append(word)
        if len(words) == per_line:
            lines.append(" ".join(words))
            words = []
    if words:
        lines.append(" ".join(words))
    return lines


def _special_ids() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def _write_tokenizer_files(tokenizer: Any, spec: DemoSpec, folder: Path) -> None:
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    added = {
        str(i): {
            "content": tok.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        # Text prompts are not given a BOS (as with Qwen-style models): decode(encode(s))
        # gives back s. The chat template adds it.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": added,
    })
    _write_json(folder / "special_tokens_map.json", {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    })


def _generation_config() -> dict[str, Any]:
    ids = _special_ids()
    return {
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[PAD],
        "do_sample": False,
    }


# --------------------------------------------------------------------------------------
# Files and locks


def _spec(size: str) -> DemoSpec:
    try:
        return DEMO_SIZES[size]
    except KeyError:
        raise ValueError(f"unknown demo size {size!r}; choose from {', '.join(DEMO_SIZES)}") \
            from None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock; the kernel drops it if the holder dies."""
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(final: Path) -> None:
    """Under the lock no other maker of this model runs: clear what a crashed one left."""
    for stale in final.parent.glob(f".{final.name}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    # At the final path but without the marker: not a finished model of ours.
    if final.is_dir():
        shutil.rmtree(final)
    elif final.exists():
        final.unlink()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_dir(folder: Path) -> None:
    """Flush the files of a folder and the folder itself, so a rename after a crash never
    points at empty files."""
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------
# The training corpus: varied English prose, dialogue, numbers, code and a little of other
# scripts so the tokenizer learns multi-byte sequences. Changing it changes every tokenizer
# (bump DEMO_FORMAT_VERSION).

DEMO_CORPUS = """\
The Plimsoll line is the mark on a ship's hull that shows how deep it may safely be loaded. \
Samuel Plimsoll campaigned for it in the 1870s, after too many overloaded ships sank with \
their crews. A ship loaded below the line is safe; one loaded above it is a danger to all.

Memory is the cargo of an inference server. Every model, every cached prompt and every \
running request takes a share of it, and when the share grows past the line the whole \
process may be killed. A careful server measures its load every second and sheds work \
before it sinks.

Once upon a time, in a small village by the sea, there lived an old fisherman and his \
daughter. Every morning they rowed out before sunrise, and every evening they came home \
with a basket of silver fish. One day the weather turned, the wind rose, and the waves \
grew taller than the mast. "Hold on!" shouted the fisherman. "We will find the harbour."

She asked him, "How do you know the way when you cannot see the stars?" He smiled and \
said, "I listen to the water. It tells me where the rocks are, and where the sand is \
soft." They reached the shore just as the storm broke, tired but safe.

Q: What is the capital of France?
A: The capital of France is Paris.
Q: How many days are there in a leap year?
A: There are 366 days in a leap year.
Q: Which planet is closest to the sun?
A: Mercury is the closest planet to the sun.

User: Can you help me write a short poem about the rain?
Assistant: Of course. Here is one:
Soft rain on the window, grey light on the floor,
the kettle is singing, the cat's by the door.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 32 64 100 128 256 512 \
1000 1024 2048 4096 8192 65536 1,000,000 3.14159 2.71828 -42 +7 1e-5 0.02 99% 50/50.
Dates and times: 2024-06-11, 11 June 2024, 09:30, 23:59:59, Monday, Friday, December.
Prices: $19.99, €5, £12.50, ¥1000. Phone: +1 (555) 010-2030. Email: hello@example.com.

def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

for (int i = 0; i < n; i++) { sum += values[i]; }
if x >= 10 && y != 0 { return x / y; } else { return -1; }
{"model": "demo", "max_tokens": 128, "temperature": 0.7, "stream": true}
SELECT name, count(*) FROM requests WHERE status = 'ok' GROUP BY name ORDER BY 2 DESC;

Punctuation matters: commas, semicolons; colons: dashes - and -- em dashes \u2014 \
quotes 'single' and "double", brackets (round) [square] {curly} <angle>, ellipses... \
question marks? exclamation marks! slashes / and \\ back, hash # at @ percent % caret ^ \
ampersand & star * underscore _ plus + equals = tilde ~ pipe | and backtick `code`.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. \
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. The five \
boxing wizards jump quickly.

Weather report: cloudy in the morning with a chance of showers in the afternoon. \
Temperatures between 12 and 18 degrees. Winds from the west at 20 kilometres per hour. \
Tomorrow will be brighter, with sunshine spreading from the south.

Recipe: mix two cups of flour with one cup of water and a pinch of salt. Knead the dough \
for ten minutes, let it rest for an hour, then bake it at 220 degrees for half an hour. \
Serve warm with butter, honey or cheese.

A little of the wider world: a café on the corner serves crème brûlée and a naïve \
coffee; the façade is old. Straße, Müller, Zürich, São Paulo, señor, jalapeño, smørbrød. \
日本語のテキスト: 東京は大きな都市です。中文：你好，世界。한국어: 안녕하세요. \
Русский: привет, мир. Ελληνικά: γεια σου κόσμε. العربية: مرحبا بالعالم. हिन्दी: नमस्ते. \
Emoji: 🙂 😀 🚀 ❤️ 👍 🎉 — symbols: © ® ™ ° ± × ÷ ≤ ≥ ≠ ∞ → ← ✓ ★.

The history of computing is a history of memory. Early machines stored a few thousand \
words; today a laptop holds billions of bytes, yet programs still run out of room. Large \
language models are hungry: their weights fill gigabytes, and the cache of keys and \
values grows with every token of every conversation. Engineers learned to quantize \
weights, to share prefixes between requests, to evict what is idle and to refuse what \
cannot fit, with a clear reason and a time to retry.

Science notes: water boils at 100 degrees Celsius at sea level. Light travels about \
300,000 kilometres per second. The human heart beats around 100,000 times a day. DNA \
carries genetic information in four bases: adenine, cytosine, guanine and thymine.

Travel diary. We took the early train north, through green valleys and small towns with \
red roofs. At noon we stopped for bread, olives and a glass of cold lemonade. In the \
evening the mountains turned pink, then purple, then black, and the first stars appeared \
above the lake. Nobody spoke; there was nothing that needed to be said.

Meeting notes: 1. Review last week's incidents. 2. Agree on the memory ceiling for the \
new nodes. 3. Plan the load test for Thursday. Action items: Alice will update the \
dashboard; Bob will write the runbook; Carol will check the alerts.

Proverbs: A stitch in time saves nine. Many hands make light work. Still waters run deep. \
Better late than never. Actions speak louder than words. Where there is a will, there is \
a way. Look before you leap. Every cloud has a silver lining.

Letters of the alphabet: a b c d e f g h i j k l m n o p q r s t u v w x y z \
A B C D E F G H I J K L M N O P Q R S T U V W X Y Z. Mixed case: iPhone, eBay, McDonald, \
HTTP, gRPC, JSON, YAML, UTF-8, ASCII, CPU, GPU, RAM, MLX, KV-cache, LRU, OOM.
"""
