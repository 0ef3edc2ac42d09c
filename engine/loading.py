"""Loading a model with mlx-lm, from a local folder or a Hugging Face repository id.

Runs on the engine thread that will own the model, so every lazy array is
evaluated on the thread that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten

from engine.demo_models import kv_bytes_per_token

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class ModelFacts:
    """What the rest of the server may keep about a model; holds no MLX arrays."""

    context_length: int
    vocab_size: int
    kv_bytes_per_token: int
    weights_bytes: int
    measured_bytes: int
    attention_heads: int


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    config: dict
    context_length: int
    vocab_size: int
    kv_bytes_per_token: int
    weights_bytes: int
    measured_bytes: int = 0
    attention_heads: int = 1

    def facts(self) -> ModelFacts:
        return ModelFacts(self.context_length, self.vocab_size, self.kv_bytes_per_token,
                          self.weights_bytes, self.measured_bytes, self.attention_heads)


def is_local(source: str) -> bool:
    return Path(source).expanduser().is_dir()


def default_model_id(source: str) -> str:
    """`mlx-community/Qwen3-0.6B-4bit` → `Qwen3-0.6B-4bit`; a folder → its name."""
    return Path(source.rstrip("/")).name


def estimate_load_bytes(source: str) -> int | None:
    """A local model's weight files plus 5 %; None for a repository not yet downloaded."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return None
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return int(weights * 1.05) or None


def context_length(config: dict) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    text = config.get("text_config")
    if isinstance(text, dict):
        return context_length(text)
    return DEFAULT_CONTEXT


def load_model(source: str) -> LoadedModel:
    """`mlx_lm.load` (which downloads a repository id through huggingface_hub)."""
    path = str(Path(source).expanduser()) if is_local(source) else source
    model, tokenizer, config = mlx_lm.load(path, return_config=True)
    params = tree_flatten(model.parameters())
    mx.eval([p for _, p in params])
    vocab = config.get("vocab_size") or len(tokenizer.get_vocab())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        context_length=context_length(config),
        vocab_size=int(vocab),
        kv_bytes_per_token=kv_bytes_per_token(config),
        weights_bytes=sum(p.nbytes for _, p in params),
        attention_heads=attention_heads(config),
    )


def attention_heads(config: dict) -> int:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    heads = config.get("num_attention_heads") or text.get("num_attention_heads")
    return int(heads) if isinstance(heads, int) and heads > 0 else 32
