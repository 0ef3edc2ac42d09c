"""Loading a model with mlx-lm, from a local folder or a Hugging Face repository id.

Runs on the engine thread that will own the model, so every lazy array is
evaluated on the thread that uses it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import mlx_lm.utils
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    HFValidationError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from mlx.utils import tree_flatten
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from engine import errors
from engine.demo_models import kv_bytes_per_token
from engine.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from engine.sources import check_source, looks_like_path
from memory.chunking import ConversionTransient

DEFAULT_CONTEXT = 4096
RETRY_FETCH_S = 30.0  # a repository the hub could not serve: retry after this


@dataclass(frozen=True)
class ModelFacts:
    """What the rest of the server may keep about a model; holds no MLX arrays."""

    context_length: int
    vocab_size: int
    kv_bytes_per_token: int
    weights_bytes: int
    measured_bytes: int
    attention_heads: int
    # What a prefill through fp32 conversions adds (engine/fast_prefill.py); None: stock.
    prefill_conversion: ConversionTransient | None = None


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
    prefill_conversion: ConversionTransient | None = None
    folder: str = ""  # the local folder it was loaded from
    content_hash: str = ""  # of that folder (content_hash): the cold tier's model identity

    def facts(self) -> ModelFacts:
        return ModelFacts(self.context_length, self.vocab_size, self.kv_bytes_per_token,
                          self.weights_bytes, self.measured_bytes, self.attention_heads,
                          self.prefill_conversion)


def is_local(source: str) -> bool:
    return Path(source).expanduser().is_dir()


def default_model_id(source: str) -> str:
    """`mlx-community/Qwen3-0.6B-4bit` → `Qwen3-0.6B-4bit`; a folder → its name."""
    return Path(source.rstrip("/")).name


def estimate_load_bytes(source: str) -> int | None:
    """A local model's weight files plus 5 %; None for a repository not yet downloaded.
    The files are the ones `mlx_lm.load` reads (``model*.safetensors``), not any other
    safetensors a folder may hold (an adapter, a consolidated copy)."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return None
    weights = sum(f.stat().st_size for f in folder.glob("model*.safetensors"))
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
    """Loads `source` with mlx-lm (a repository id is fetched through huggingface_hub
    first). Every failure is a PlimsollError in our words that quotes `source` as the
    client gave it, never a resolved path, a cache folder or a library's exception:
    NotFound (SOURCE_NOT_FOUND), InvalidArgument (not a folder nor a repository id),
    Unavailable (SOURCE_UNAVAILABLE: the hub cannot be reached) or FailedPrecondition
    (LOAD_FAILED: what is wrong with the folder). The cause stays chained for the log."""
    folder = resolve_source(source)
    config = check_model_folder(source, folder)
    try:
        model, config = mlx_lm.utils.load_model(folder)
    except Exception as exc:
        raise FailedPrecondition(
            f"source '{source}' could not be loaded: its weights do not match its "
            "config.json or cannot be read (the server log has the details)",
            errors.LOAD_FAILED, resource_type="source", resource_name=source) from exc
    try:
        tokenizer = mlx_lm.utils.load_tokenizer(
            folder, eos_token_ids=config.get("eos_token_id", None))
    except Exception as exc:
        raise FailedPrecondition(
            f"source '{source}' could not be loaded: its tokenizer files are missing or "
            "cannot be read (the server log has the details)",
            errors.LOAD_FAILED, resource_type="source", resource_name=source) from exc
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
        folder=str(folder),
        content_hash=content_hash(folder),
    )


# Weight files are hashed by size, safetensors header and sampled blocks: hashing every
# byte of tens of GB at each load would take minutes, and a change of weights changes
# their headers, sizes or the sampled blocks. Taken at load, on the engine thread.
_HASH_BLOCK = 1 << 20
_HASH_SAMPLES = 8


def content_hash(folder: Path) -> str:
    """A content hash of a model folder: config and tokenizer files whole, each
    weight file's size, safetensors header and sampled blocks."""
    h = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file())
    for p in files:
        name = p.name
        if name.endswith((".json", ".txt", ".model", ".jinja")):
            h.update(name.encode())
            h.update(p.read_bytes())
        elif name.endswith((".safetensors", ".bin", ".npz", ".gguf")):
            size = p.stat().st_size
            h.update(f"{name}:{size}".encode())
            with p.open("rb") as f:
                if name.endswith(".safetensors"):
                    head = f.read(8)
                    n = int.from_bytes(head, "little") if len(head) == 8 else 0
                    h.update(f.read(min(n, 64 << 20)))
                for i in range(_HASH_SAMPLES):
                    f.seek(max(0, size - _HASH_BLOCK) * i // max(1, _HASH_SAMPLES - 1))
                    h.update(f.read(_HASH_BLOCK))
    return h.hexdigest()[:32]


def resolve_source(source: str) -> Path:
    """The local folder to load `source` from, fetching a repository id first."""
    check_source(source)
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FailedPrecondition(f"source '{source}' is a file, not a model folder",
                                 errors.LOAD_FAILED, resource_type="source",
                                 resource_name=source)
    if looks_like_path(source):
        raise NotFound(f"source '{source}' is not a folder on the server", "source",
                       resource_name=source)
    try:
        validate_repo_id(source)
    except HFValidationError:
        raise InvalidArgument(
            f"source '{source}' is neither a folder on the server nor a Hugging Face "
            "repository id (name or namespace/name)", "source") from None
    try:
        return Path(snapshot_download(source, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise NotFound(
            f"repository '{source}' was not found on Hugging Face (or it is private or "
            "gated)", "source", resource_name=source) from exc
    except Exception as exc:
        # Offline with nothing cached, the hub unreachable or failing: worth a retry.
        raise Unavailable(
            f"cannot fetch repository '{source}': Hugging Face could not be reached and "
            "no copy is cached on the server", RETRY_FETCH_S,
            reason=errors.SOURCE_UNAVAILABLE, resource_type="source",
            resource_name=source) from exc


def check_model_folder(source: str, folder: Path) -> dict:
    """What mlx-lm needs before it builds anything, checked in our words: config.json
    (valid JSON, a supported model_type, no custom code) and weight files."""

    def refuse(what: str) -> FailedPrecondition:
        return FailedPrecondition(f"source '{source}' {what}", errors.LOAD_FAILED,
                                  resource_type="source", resource_name=source)

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise refuse("is not a model folder: config.json is missing")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise refuse("is not a model folder: config.json is not valid JSON") from exc
    if not isinstance(config, dict):
        raise refuse("is not a model folder: config.json is not a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise refuse("is not a model folder: config.json has no model_type")
    if config.get("model_file") is not None:
        raise refuse("needs custom code to build its model (model_file in config.json), "
                     "which this server does not run")
    try:
        mlx_lm.utils._get_classes(config)
    except Exception as exc:
        raise refuse(f"has model_type '{model_type}', which this server cannot load") from exc
    if not any(folder.glob("model*.safetensors")):
        raise refuse("has no weights: no model*.safetensors file")
    return config


def attention_heads(config: dict) -> int:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    heads = config.get("num_attention_heads") or text.get("num_attention_heads")
    return int(heads) if isinstance(heads, int) and heads > 0 else 32
