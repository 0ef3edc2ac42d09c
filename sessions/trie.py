"""A compressed (radix) trie over token ids.

The bank looks up "the longest cached key that is a prefix of this prompt" on
every request; a linear scan over every key would cost O(entries). A radix trie
walks the prompt once: each edge holds a run of tokens (a tuple slice), and a
whole edge is compared with one C-level tuple comparison, so a lookup costs
O(prompt length) regardless of how many entries the bank holds.

Not thread-safe on its own: the bank serialises access with its lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")
Tokens = tuple[int, ...]


class _Node(Generic[V]):
    __slots__ = ("edges", "value", "has_value")

    def __init__(self) -> None:
        # first token of the edge -> (edge label, child)
        self.edges: dict[int, tuple[Tokens, _Node[V]]] = {}
        self.value: V | None = None
        self.has_value = False


def _common_len(label: Tokens, key: Tokens, start: int) -> int:
    """Length of the common prefix of `label` and `key[start:]`.

    Binary search over slice equality: O(L log L) work, but all of it in C,
    which beats a Python loop for the 64–2048-token runs the bank stores.
    """
    lo, hi = 0, min(len(label), len(key) - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if label[:mid] == key[start : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TokenTrie(Generic[V]):
    """Maps exact token tuples to values; answers longest-prefix queries."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def insert(self, key: Tokens, value: V) -> V | None:
        """Store `value` under `key`; returns the value it replaced, if any."""
        node, i, n = self._root, 0, len(key)
        while i < n:
            edge = node.edges.get(key[i])
            if edge is None:
                leaf: _Node[V] = _Node()
                leaf.value, leaf.has_value = value, True
                node.edges[key[i]] = (key[i:], leaf)
                self._size += 1
                return None
            label, child = edge
            if key[i : i + len(label)] == label:
                node, i = child, i + len(label)
                continue
            # Partial match: split the edge where the key diverges.
            m = _common_len(label, key, i)
            mid: _Node[V] = _Node()
            mid.edges[label[m]] = (label[m:], child)
            node.edges[key[i]] = (label[:m], mid)
            node, i = mid, i + m
        old = node.value if node.has_value else None
        if not node.has_value:
            self._size += 1
        node.value, node.has_value = value, True
        return old

    def get(self, key: Tokens) -> V | None:
        found = self._walk(key)
        return found[0].value if found is not None and found[0].has_value else None

    def _walk(self, key: Tokens) -> tuple[_Node[V], list[tuple[_Node[V], int]]] | None:
        """The node at exactly `key` and the path to it: (parent, first token of the
        edge taken) per step; None when no node sits there."""
        path: list[tuple[_Node[V], int]] = []
        node, i, n = self._root, 0, len(key)
        while i < n:
            edge = node.edges.get(key[i])
            if edge is None:
                return None
            label, child = edge
            if key[i : i + len(label)] != label:
                return None
            path.append((node, key[i]))
            node, i = child, i + len(label)
        return node, path

    def remove(self, key: Tokens) -> V | None:
        """Remove `key`; returns its value (None if absent). Keeps the trie compressed."""
        found = self._walk(key)
        if found is None:
            return None
        node, path = found
        if not node.has_value:
            return None
        value = node.value
        node.value, node.has_value = None, False
        self._size -= 1
        self._compact(node, path)
        return value

    def _compact(self, node: _Node[V], path: list[tuple[_Node[V], int]]) -> None:
        """Drop a now-empty leaf and merge single-child pass-through nodes."""
        if not path:
            return  # the root is never removed or merged
        parent, first = path[-1]
        label, _ = parent.edges[first]
        if not node.edges:
            del parent.edges[first]
            # The parent may now be a valueless pass-through node with one child.
            if len(path) >= 2 and not parent.has_value and len(parent.edges) == 1:
                grand, gfirst = path[-2]
                glabel, _ = grand.edges[gfirst]
                (clabel, child), = parent.edges.values()
                grand.edges[gfirst] = (glabel + clabel, child)
        elif len(node.edges) == 1:
            (clabel, child), = node.edges.values()
            parent.edges[first] = (label + clabel, child)

    def longest_prefix(self, key: Tokens, max_len: int | None = None) -> tuple[int, V] | None:
        """The longest stored key that is a prefix of `key` and at most `max_len` long."""
        best: tuple[int, V] | None = None
        for depth, value in self.prefixes(key):
            if max_len is not None and depth > max_len:
                break
            best = (depth, value)
        return best

    def prefixes(self, key: Tokens) -> Iterator[tuple[int, V]]:
        """Every stored key that is a prefix of `key` (itself included), shortest first."""
        node, i, n = self._root, 0, len(key)
        if node.has_value:
            yield 0, node.value  # type: ignore[misc]
        while i < n:
            edge = node.edges.get(key[i])
            if edge is None:
                return
            label, child = edge
            if key[i : i + len(label)] != label:
                return
            node, i = child, i + len(label)
            if node.has_value:
                yield i, node.value  # type: ignore[misc]

    def values(self) -> Iterator[V]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.has_value:
                yield node.value  # type: ignore[misc]
            stack.extend(child for _, child in node.edges.values())
