"""Pages of a listing: an opaque token that names where the next page starts."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.errors import InvalidArgument

T = TypeVar("T")


_MARK = "after:"


def _token(key: str) -> str:
    return base64.urlsafe_b64encode((_MARK + key).encode()).decode()


def _after(token: str) -> str:
    try:
        text = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    if not text.startswith(_MARK):
        raise InvalidArgument("page_token is not a token this server issued; pass "
                              "next_page_token from the previous page", "page_token")
    return text.removeprefix(_MARK)


def page(items: Sequence[T], key: Callable[[T], str], page_size: int,
         page_token: str) -> tuple[list[T], str]:
    """Items ordered by `key`, from after the token's key, at most `page_size`
    (0: all) -> (the page, the next page's token or "" on the last)."""
    ordered = sorted(items, key=key)
    if page_token:
        start = _after(page_token)
        ordered = [i for i in ordered if key(i) > start]
    if not page_size or len(ordered) <= page_size:
        return list(ordered), ""
    chosen = ordered[:page_size]
    return chosen, _token(key(chosen[-1]))
