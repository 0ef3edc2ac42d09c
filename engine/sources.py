"""What a model source (a folder path or a Hugging Face repository id) may look like:
plain string checks, shared by loading, the control servicer and the access checks
without importing MLX."""

from __future__ import annotations

from engine.errors import InvalidArgument


def looks_like_path(source: str) -> bool:
    """A local path rather than a repository id (namespace/name)."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source


# A path longer than the OS's (PATH_MAX) names nothing; stat() would raise instead.
MAX_SOURCE_CHARS = 4096


def check_source(source: str) -> None:
    """INVALID_ARGUMENT for a source no folder or repository can have: empty, over
    MAX_SOURCE_CHARS, or holding a NUL or another control character."""
    if not source:
        raise InvalidArgument("source is empty: give a local folder or a repository id",
                              "source")
    if len(source) > MAX_SOURCE_CHARS:
        raise InvalidArgument(f"source is {len(source)} characters long; a folder path or "
                              f"repository id has at most {MAX_SOURCE_CHARS}", "source")
    if any(ord(c) < 32 or ord(c) == 127 for c in source):
        raise InvalidArgument("source holds a control character (a NUL, a newline...); "
                              "no folder or repository id does", "source")
