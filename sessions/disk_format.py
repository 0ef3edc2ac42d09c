"""The cold tier's files: mlx-lm's own prompt-cache safetensors plus a JSON record.

One snapshot is two files in the tier's directory:
- `<key>.safetensors`, written by `mlx_lm.models.cache.save_prompt_cache` (so
  `load_prompt_cache` reads it back; no format of our own), its metadata holding
  the compatibility digest;
- `<key>.json`, the record: model id, compatibility key, session, tokens, the data
  file's size and SHA-256. It is written (atomically, by rename) after the data
  file, so a record always names a complete file; a data file with no record is
  an interrupted write and is collected.

Threads: `write_snapshot` runs on a writer thread over snapshot arrays the engine
thread already evaluated (`materialize`), so saving only reads host memory and
builds no graph. Restores read and verify the bytes on a worker (`read_verified`,
no MLX), and the engine thread turns them into caches (`load_snapshot`,
`thaw`), so every MLX array a request uses is made on the thread that runs it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

DATA_SUFFIX = ".safetensors"
RECORD_SUFFIX = ".json"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
KV_GROUP_SIZE = 64  # mlx-lm's default for quantized KV caches
_CHUNK = 1 << 22


def mlx_lm_version() -> str:
    try:
        return importlib_metadata.version("mlx-lm")
    except importlib_metadata.PackageNotFoundError:  # a source checkout
        import mlx_lm

        return str(getattr(mlx_lm, "__version__", "unknown"))


@dataclass(frozen=True)
class CompatKey:
    """What a snapshot is only good for: the same weights (by content), the same
    mlx-lm (its cache classes), the same KV dtype and the same quantization."""

    model_hash: str
    mlx_lm: str
    kv_dtype: str
    kv_bits: int  # 0: full precision
    kv_group_size: int = KV_GROUP_SIZE

    def digest(self) -> str:
        text = f"{self.model_hash}|{self.mlx_lm}|{self.kv_dtype}|{self.kv_bits}|{self.kv_group_size}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def as_dict(self) -> dict[str, Any]:
        return {"model_hash": self.model_hash, "mlx_lm": self.mlx_lm, "kv_dtype": self.kv_dtype,
                "kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size}


def entry_key(model_id: str, compat: str, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(f"{model_id}\0{compat}\0".encode())
    h.update(",".join(map(str, tokens)).encode())
    return h.hexdigest()[:40]


@dataclass(frozen=True)
class Record:
    """One snapshot's JSON record."""

    key: str
    model_id: str
    compat: str
    compat_key: dict[str, Any]
    session_id: str | None
    tokens: tuple[int, ...]
    data_bytes: int  # the data file's size
    kv_bytes: int  # the caches' bytes once loaded (what a restore allocates)
    sha256: str
    created_at: float  # wall clock
    format_version: int = FORMAT_VERSION

    @property
    def mlx_lm_version(self) -> str:
        return str(self.compat_key.get("mlx_lm", ""))

    def to_json(self) -> str:
        return json.dumps({
            "format_version": self.format_version, "key": self.key, "model_id": self.model_id,
            "compat": self.compat, "compat_key": self.compat_key, "session_id": self.session_id,
            "tokens": list(self.tokens), "data_bytes": self.data_bytes,
            "kv_bytes": self.kv_bytes, "sha256": self.sha256, "created_at": self.created_at,
        })

    @classmethod
    def from_json(cls, text: str) -> Record:
        d = json.loads(text)
        return cls(key=str(d["key"]), model_id=str(d["model_id"]), compat=str(d["compat"]),
                   compat_key=dict(d["compat_key"]), session_id=d.get("session_id"),
                   tokens=tuple(int(t) for t in d["tokens"]), data_bytes=int(d["data_bytes"]),
                   kv_bytes=int(d["kv_bytes"]), sha256=str(d["sha256"]),
                   created_at=float(d["created_at"]),
                   format_version=int(d.get("format_version", 0)))


def data_path(folder: Path, key: str) -> Path:
    return folder / f"{key}{DATA_SUFFIX}"


def record_path(folder: Path, key: str) -> Path:
    return folder / f"{key}{RECORD_SUFFIX}"


class CorruptSnapshot(Exception):
    """A file that does not match its record (truncated, altered, unreadable)."""


def write_snapshot(folder: Path, key: str, cache: list[Any], *, model_id: str,
                   compat: CompatKey, session_id: str | None, tokens: Sequence[int],
                   kv_bytes: int, now_wall: float) -> Record:
    """Writes the data file, then its record; both by rename, so a crash leaves either
    nothing or a data file without a record (collected at the next start)."""
    from mlx_lm.models.cache import save_prompt_cache

    digest = compat.digest()
    tmp = folder / f"{TMP_PREFIX}{uuid.uuid4().hex}{DATA_SUFFIX}"
    tmp_record = folder / f"{TMP_PREFIX}{uuid.uuid4().hex}{RECORD_SUFFIX}"
    try:
        save_prompt_cache(str(tmp), cache, {"plimsoll_compat": digest, "plimsoll_model": model_id})
        sha, size = _hash_file(tmp)
        record = Record(key=key, model_id=model_id, compat=digest, compat_key=compat.as_dict(),
                        session_id=session_id, tokens=tuple(tokens), data_bytes=size,
                        kv_bytes=kv_bytes, sha256=sha, created_at=now_wall)
        os.replace(tmp, data_path(folder, key))
        tmp_record.write_text(record.to_json())
        os.replace(tmp_record, record_path(folder, key))
        return record
    except BaseException:
        for p in (tmp, tmp_record):
            p.unlink(missing_ok=True)
        raise


def read_record(path: Path) -> Record:
    return Record.from_json(path.read_text())


def read_verified(folder: Path, record: Record) -> bytes:
    """The data file's bytes, checked against the record's size and SHA-256 (no MLX)."""
    path = data_path(folder, record.key)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptSnapshot(f"{path.name}: {exc}") from exc
    if len(data) != record.data_bytes:
        raise CorruptSnapshot(f"{path.name}: {len(data)} bytes, the record says "
                              f"{record.data_bytes} (truncated?)")
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise CorruptSnapshot(f"{path.name}: checksum mismatch")
    return data


class _NamedBytes(io.BytesIO):
    # mx.load picks the format from the file object's name.
    name = "snapshot.safetensors"


def load_snapshot(data: bytes, compat: str) -> list[Any]:
    """On the engine thread: the caches in verified bytes, through mlx-lm's loader."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    cache, meta = load_prompt_cache(_NamedBytes(data), return_metadata=True)
    if meta.get("plimsoll_compat") != compat:
        raise CorruptSnapshot("the file's compatibility key does not match its record")
    mx.eval([c.state for c in cache])
    return cache


def _hash_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size
