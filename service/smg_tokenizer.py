"""The tokenizer bundle SMG's `GetTokenizer` expects: a ZIP of the model folder's
tokenizer and config files, streamed in 64 KiB chunks, the archive's SHA-256 (hex)
on the last chunk only. The gateway checks the digest before it unpacks, and uses
the files when it was started without `--model-path` (or to check it matches).

Written from the protocol (`smg_grpc_proto` `common.proto`), not copied from SMG's
servicer; the file list is the one SMG's own tokenizer loader looks for.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

CHUNK_BYTES = 64 * 1024  # the gateway's client reads chunks of at most this

# What a tokenizer (and its chat template and special tokens) is made of in a
# Hugging Face layout; never the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
)
TOKENIZER_GLOBS = ("*.jinja", "*.tiktoken")


@dataclass(frozen=True)
class TokenizerBundle:
    data: bytes
    sha256: str


def build_bundle(folder: Path) -> TokenizerBundle:
    """The ZIP of `folder`'s tokenizer files; FileNotFoundError when it has none."""
    names = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    for pattern in TOKENIZER_GLOBS:
        names += sorted(p.name for p in folder.glob(pattern)
                        if p.is_file() and p.name not in names)
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {folder}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            zf.write(folder / name, name)
    data = buf.getvalue()
    return TokenizerBundle(data, hashlib.sha256(data).hexdigest())


def bundle_chunks(bundle: TokenizerBundle) -> Iterator[common_pb2.GetTokenizerChunk]:
    total = len(bundle.data)
    for start in range(0, total, CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, total)
        yield common_pb2.GetTokenizerChunk(
            data=bundle.data[start:end], sha256=bundle.sha256 if end == total else "")


class BundleCache:
    """One bundle per folder, built off the event loop the first time (reading and
    deflating files would stall every stream meanwhile) and kept: a model folder does
    not change while it is served."""

    def __init__(self) -> None:
        self._bundles: dict[Path, TokenizerBundle] = {}

    async def get(self, folder: Path) -> TokenizerBundle:
        bundle = self._bundles.get(folder)
        if bundle is None:
            bundle = await asyncio.to_thread(build_bundle, folder)
            self._bundles[folder] = bundle
        return bundle
