"""TokenTrie and the bank's trie lookup against a brute-force linear scan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sessions.bank import SessionBank
from sessions.trie import TokenTrie
from tests.support.clock import FakeClock
from tests.support.sessions import make_entry

keys = st.lists(st.integers(0, 3), min_size=0, max_size=10).map(tuple)
ops = st.lists(st.tuples(st.booleans(), keys), min_size=1, max_size=60)


def brute_longest(store: dict, query: tuple, max_len: int | None) -> tuple[int, object] | None:
    best = None
    for k, v in store.items():
        fits = query[: len(k)] == k and (max_len is None or len(k) <= max_len)
        if fits and (best is None or len(k) > best[0]):
            best = (len(k), v)
    return best


def test_insert_get_remove_roundtrip():
    t: TokenTrie[str] = TokenTrie()
    assert t.insert((1, 2, 3), "a") is None
    assert t.insert((1, 2), "b") is None  # splits the (1, 2, 3) edge
    assert t.insert((1, 2, 4, 5), "c") is None  # branches below the split
    assert t.insert((1, 2), "b2") == "b"
    assert len(t) == 3
    assert t.get((1, 2)) == "b2" and t.get((1,)) is None and t.get((1, 2, 3, 4)) is None
    assert t.longest_prefix((1, 2, 3, 9)) == (3, "a")
    assert t.longest_prefix((1, 2, 3), max_len=2) == (2, "b2")
    assert t.longest_prefix((7,)) is None
    assert [d for d, _ in t.prefixes((1, 2, 4, 5, 6))] == [2, 4]
    assert t.remove((1, 2)) == "b2" and t.remove((1, 2)) is None
    assert t.longest_prefix((1, 2, 4, 5)) == (4, "c")
    assert t.remove((1, 2, 3)) == "a" and t.remove((1, 2, 4, 5)) == "c"
    assert len(t) == 0 and not t._root.edges


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(keys, min_size=1, max_size=10))
def test_trie_matches_linear_scan(operations, queries):
    t: TokenTrie[int] = TokenTrie()
    store: dict[tuple, int] = {}
    for i, (is_insert, key) in enumerate(operations):
        if is_insert:
            assert t.insert(key, i) == store.get(key)
            store[key] = i
        else:
            assert t.remove(key) == store.pop(key, None)
        assert len(t) == len(store)
    assert sorted(t.values()) == sorted(store.values())
    for q in queries:
        for max_len in (None, max(0, len(q) - 1)):
            assert t.longest_prefix(q, max_len) == brute_longest(store, q, max_len)
        assert t.get(q) == store.get(q)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=9).map(tuple),
                min_size=1, max_size=30, unique=True),
       st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=12).map(tuple),
                min_size=1, max_size=10))
def test_bank_restore_source_equals_brute_force_strict_prefix(stored, queries):
    bank = SessionBank(max_entries=1000, clock=FakeClock())
    for k in stored:
        assert bank.put(make_entry(k, 1)).stored
    keys_now = {e.tokens for e in bank.entries()}
    for q in queries:
        expect = max((k for k in keys_now if len(k) < len(q) and q[: len(k)] == k),
                     key=len, default=None)
        src = bank.restore_source("m", q)
        assert (src.tokens if src else None) == expect
        found = bank.longest_prefix("m", q)
        assert (found.tokens if found else None) == expect
    assert bank.restore_source("other-model", queries[0]) is None


def test_long_shared_prefixes_split_and_merge():
    t: TokenTrie[str] = TokenTrie()
    base = tuple(range(2048))
    t.insert(base, "full")
    t.insert(base[:64], "short")
    t.insert(base[:1000] + (99999,), "fork")
    assert t.longest_prefix(base[:1500]) == (64, "short")
    assert t.longest_prefix(base[:1000] + (99999, 1)) == (1001, "fork")
    t.remove(base[:64])
    assert t.longest_prefix(base[:1500]) is None
    assert t.longest_prefix(base + (5,)) == (2048, "full")
