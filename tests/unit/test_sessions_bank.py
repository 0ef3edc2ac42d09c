"""SessionBank: put (supersede, retention, caps), lookup, TTL, drop, listing, stats, spans.

The bank opens a SPAN_BANK_EVICT only for evictions it makes on its own (caps,
retention, supersede, drops); shrinks and expiry are the governor's to record.
"""

from __future__ import annotations

import threading

import pytest

from sessions.bank import (
    REASON_CAP_BYTES,
    REASON_CAP_ENTRIES,
    REASON_CAP_SESSION_BYTES,
    REASON_DROPPED,
    REASON_IDLE_TTL,
    REASON_REMOVED,
    REASON_SESSION_RETENTION,
    REASON_SUPERSEDED,
    REFUSED_EXCEEDS_MAX_BYTES,
    REFUSED_EXCEEDS_SESSION_BYTES,
    SessionBank,
    SessionEntry,
)
from telemetry import names
from tests.support.clock import FakeClock
from tests.support.sessions import SpanRecorder, make_entry


def mk(clock=None, active=(), **kw):
    evicted: list[tuple[str, tuple, str]] = []

    def on_evict(entries, reason):
        evicted.extend((e.session_id, e.tokens, reason) for e in entries)

    bank = SessionBank(clock=clock or FakeClock(), active_sessions=lambda: set(active),
                       on_evict=on_evict, **kw)
    return bank, evicted


def keys(bank):
    return sorted((e.session_id or "", e.tokens) for e in bank.entries())


def check_invariants(bank):
    es = bank.entries()
    assert bank.total_bytes() == sum(e.nbytes for e in es)
    assert bank.entry_count() == len(es)
    for s in {e.session_id for e in es if e.session_id}:
        assert bank.session_bytes(s) == sum(e.nbytes for e in es if e.session_id == s)


# -- entries -------------------------------------------------------------------


def test_entry_validates_and_exposes_key():
    e = make_entry([1, 2, 3], 10, "s")
    assert e.key == ("m", (1, 2, 3)) and e.prefix_len == 3 and e.lineage == ("m", "s")
    with pytest.raises(ValueError):
        make_entry([], 1)
    with pytest.raises(ValueError):
        make_entry([1], -1)


def test_put_stamps_clock_and_counts_live_ref_bytes_honestly():
    clock = FakeClock(50.0)
    bank, _ = mk(clock)
    r = bank.put(make_entry([1, 2], 700, "s", live_ref=True))
    assert r.stored and bank.total_bytes() == 700 and bank.session_bytes("s") == 700
    assert bank.total_nbytes == 700  # the seed's name for total_bytes()
    (e,) = bank.entries()
    assert e.created_at == e.last_access == 50.0 and e.live_ref


# -- supersede and retention ----------------------------------------------------


def test_put_supersedes_covered_prefixes_of_same_session_and_model():
    bank, evicted = mk()
    bank.put(make_entry([1, 2], 10, "s"))
    bank.put(make_entry([1, 2, 3], 10, "s"))
    bank.put(make_entry([1, 2], 10, "other"))  # other session: not superseded
    bank.put(make_entry([1, 2, 3, 4], 10, "s", model="m2"))  # other model: no cover
    r = bank.put(make_entry([1, 2, 3, 4, 5], 10, "s"))
    assert r.superseded == 1  # (1,2) was already superseded by (1,2,3)
    assert keys(bank) == [("other", (1, 2)), ("s", (1, 2, 3, 4)), ("s", (1, 2, 3, 4, 5))]
    assert [x for x in evicted if x[2] == REASON_SUPERSEDED] == [
        ("s", (1, 2), REASON_SUPERSEDED), ("s", (1, 2, 3), REASON_SUPERSEDED)]
    check_invariants(bank)


def test_put_does_not_supersede_forks_or_anonymous_entries_by_default():
    bank, _ = mk()
    bank.put(make_entry([1, 2, 3], 10, "s"))
    bank.put(make_entry([1, 2, 9, 9], 10, "s"))  # a fork: (1,2,3) is not a prefix
    bank.put(make_entry([7, 7], 10, None))
    bank.put(make_entry([7, 7, 7], 10, None))  # anonymous: shared prefix cache
    assert bank.entry_count() == 4
    bank2, _ = mk(supersede_anonymous=True)
    bank2.put(make_entry([7, 7], 10, None))
    assert bank2.put(make_entry([7, 7, 7], 10, None)).superseded == 1


def test_put_keeps_newest_three_per_session():
    clock = FakeClock()
    bank, evicted = mk(clock)
    for i in range(5):
        clock.advance(1)
        bank.put(make_entry([100 + i, 1], 10, "s"))  # forks: nothing superseded
    assert keys(bank) == [("s", (102, 1)), ("s", (103, 1)), ("s", (104, 1))]
    assert [x[1] for x in evicted if x[2] == REASON_SESSION_RETENTION] == [(100, 1), (101, 1)]


def test_put_same_key_replaces_entry():
    bank, evicted = mk()
    bank.put(make_entry([1, 2], 10, "s"))
    r = bank.put(make_entry([1, 2], 30, "s"))
    assert r.replaced == 1 and bank.total_bytes() == 30 and bank.entry_count() == 1
    check_invariants(bank)


# -- caps ------------------------------------------------------------------------


def test_global_byte_cap_evicts_lru_idle_first_never_the_new_entry():
    clock = FakeClock()
    bank, evicted = mk(clock, active={"live"}, max_bytes=1000)
    bank.put(make_entry([1], 400, "live"))  # oldest, but active
    clock.advance(1)
    bank.put(make_entry([2], 300, "idle1"))
    clock.advance(1)
    bank.put(make_entry([3], 300, "idle2"))
    clock.advance(1)
    r = bank.put(make_entry([4], 500, "new"))  # 1500 > 1000: needs 500
    assert r.stored and r.evicted == 2
    assert keys(bank) == [("live", (1,)), ("new", (4,))]
    assert [x[0] for x in evicted] == ["idle1", "idle2"] and {x[2] for x in evicted} == {REASON_CAP_BYTES}


def test_cap_takes_active_sessions_only_after_idle_ones():
    clock = FakeClock()
    bank, evicted = mk(clock, active={"live"}, max_bytes=1000)
    bank.put(make_entry([1], 400, "live"))
    clock.advance(1)
    bank.put(make_entry([2], 400, "idle"))
    clock.advance(1)
    bank.put(make_entry([3], 900, "new"))
    assert [x[0] for x in evicted] == ["idle", "live"] and keys(bank) == [("new", (3,))]


def test_new_entry_alone_over_a_cap_is_refused_and_nothing_is_evicted():
    bank, evicted = mk(max_bytes=2000, per_session_max_bytes=600)
    bank.put(make_entry([1], 500, "a"))
    r = bank.put(make_entry([2], 2001, None))
    assert not r.stored and r.refused_reason == REFUSED_EXCEEDS_MAX_BYTES
    r = bank.put(make_entry([3], 601, "b"))
    assert not r.stored and r.refused_reason == REFUSED_EXCEEDS_SESSION_BYTES
    assert bank.put(make_entry([4], 601, None)).stored  # anonymous: no per-session cap
    assert keys(bank) == [("", (4,)), ("a", (1,))] and evicted == []


def test_entry_exactly_at_cap_is_stored_and_evicts_all_others():
    bank, evicted = mk(max_bytes=1000)
    bank.put(make_entry([1], 300, "a"))
    assert bank.put(make_entry([2], 1000, "b")).stored
    assert keys(bank) == [("b", (2,))]


def test_per_session_cap_victims_come_from_that_session_only():
    clock = FakeClock()
    bank, evicted = mk(clock, per_session_max_bytes=1000)
    bank.put(make_entry([9], 900, "other"))  # oldest in the bank
    clock.advance(1)
    bank.put(make_entry([1, 1], 400, "s"))
    clock.advance(1)
    bank.put(make_entry([2, 2], 400, "s"))
    clock.advance(1)
    r = bank.put(make_entry([3, 3], 400, "s"))  # s: 1200 > 1000
    assert r.evicted == 1
    assert evicted == [("s", (1, 1), REASON_CAP_SESSION_BYTES)]
    assert bank.session_bytes("s") == 800 and bank.session_bytes("other") == 900


def test_entry_count_cap_default_24():
    clock = FakeClock()
    bank, evicted = mk(clock)
    assert bank.max_entries == 24
    for i in range(25):
        clock.advance(1)
        bank.put(make_entry([i], 1, None))
    assert bank.entry_count() == 24 and evicted == [(None, (0,), REASON_CAP_ENTRIES)]


def test_count_cap_tie_on_last_access_takes_larger_first():
    clock = FakeClock()
    bank, evicted = mk(clock, max_entries=2)
    bank.put(make_entry([1], 10, None))
    bank.put(make_entry([2], 20, None))  # same instant, larger
    clock.advance(1)
    bank.put(make_entry([3], 5, None))
    assert evicted == [(None, (2,), REASON_CAP_ENTRIES)]


# -- lookup, TTL ---------------------------------------------------------------------


def test_longest_prefix_counts_hits_and_misses_and_touches():
    clock = FakeClock(10.0)
    bank, _ = mk(clock)
    bank.put(make_entry([1, 2, 3], 10, "s"))
    clock.advance(5)
    e = bank.longest_prefix("m", [1, 2, 3, 4])
    assert e is not None and e.tokens == (1, 2, 3) and e.hits == 1 and e.last_access == 15.0
    assert bank.longest_prefix("m", [1, 2, 3]) is None  # equal to the prompt: not restorable
    assert bank.longest_prefix("m", [5]) is None
    st = bank.stats()
    assert (st.hits, st.misses) == (1, 2)


def test_restore_source_is_read_only_and_strict():
    clock = FakeClock()
    bank, _ = mk(clock)
    bank.put(make_entry([1, 2], 10, None))
    bank.put(make_entry([1, 2, 3], 10, None))
    clock.advance(9)
    assert bank.restore_source("m", [1, 2, 3]).tokens == (1, 2)
    assert bank.restore_source("m", [1, 2, 3, 4]).tokens == (1, 2, 3)
    assert bank.reusable_tokens("m", [1, 2, 3, 4]) == 3
    assert bank.stats().hits == 0 and all(e.last_access == 1000.0 for e in bank.entries())


def test_expire_idle_default_3600s_spares_active_sessions():
    clock = FakeClock(0.0)
    bank, evicted = mk(clock, active={"live"})
    assert bank.idle_ttl_s == 3600.0
    bank.put(make_entry([1], 10, "idle"))
    bank.put(make_entry([2], 10, "live"))
    clock.advance(1800)
    bank.put(make_entry([3], 10, "fresh"))
    assert bank.expire_idle(3599.0) == 0
    assert bank.expire_idle(3600.0) == 1
    assert evicted == [("idle", (1,), REASON_IDLE_TTL)]
    assert keys(bank) == [("fresh", (3,)), ("live", (2,))]


def test_lookup_does_not_expire_lazily_the_governor_tick_does():
    # Inverted: a lookup used to expire entries past the TTL on the way. Expiry is now
    # the governor's (ExpireSessions on its tick, told by expired_count()), so an entry
    # past its TTL but not yet expired is still a restore source, and the hit refreshes it.
    clock = FakeClock(0.0)
    bank, evicted = mk(clock)
    bank.put(make_entry([1], 10, "s"))
    clock.set(4000.0)
    assert bank.expired_count() == 1
    e = bank.longest_prefix("m", [1, 2])
    assert e is not None and e.last_access == 4000.0 and evicted == []
    assert bank.expired_count() == 0 and bank.expire_idle() == 0


def test_expired_count_is_read_only_and_spares_active_sessions():
    clock = FakeClock(0.0)
    bank, evicted = mk(clock, active={"live"})
    bank.put(make_entry([1], 10, "idle"))
    bank.put(make_entry([2], 10, "live"))
    clock.advance(1800)
    bank.put(make_entry([3], 10, "fresh"))
    assert bank.expired_count(3599.0) == 0
    assert bank.expired_count(3600.0) == 1  # the active session's entry is not counted
    assert bank.expired_count(5400.0) == 2
    clock.set(5400.0)
    assert bank.expired_count() == 2 and bank.entry_count() == 3 and evicted == []
    assert bank.expire_idle() == 2
    bank2, _ = mk(clock, idle_ttl_s=None)
    bank2.put(make_entry([1], 10, "s"))
    clock.set(1e9)
    assert bank2.expired_count() == 0 and bank2.expire_idle() == 0


def test_touch_refreshes_ttl():
    clock = FakeClock(0.0)
    bank, _ = mk(clock)
    bank.put(make_entry([1], 10, "s"))
    clock.set(3000.0)
    assert bank.longest_prefix("m", [1, 2]) is not None
    assert bank.expire_idle(3700.0) == 0 and bank.expire_idle(6600.0) == 1


# -- drop, listing ----------------------------------------------------------------------


def test_drop_session_returns_entries_and_bytes():
    bank, evicted = mk()
    bank.put(make_entry([1], 100, "s"))
    bank.put(make_entry([2], 50, "s", model="m2"))
    bank.put(make_entry([3], 7, "t"))
    assert bank.drop_session("s") == (2, 150)
    assert bank.drop_session("nope") == (0, 0)
    assert keys(bank) == [("t", (3,))]
    check_invariants(bank)


def test_drop_model_and_remove():
    bank, _ = mk()
    bank.put(make_entry([1], 100, "s"))
    bank.put(make_entry([2], 50, "s", model="m2"))
    assert bank.drop_model("m2") == (1, 50)
    assert bank.remove("m", [1]).nbytes == 100 and bank.remove("m", [1]) is None
    assert bank.total_bytes() == 0


def test_list_sessions_marks_terminal_and_active():
    clock = FakeClock()
    bank, _ = mk(clock, active={"a"})
    bank.put(make_entry([1, 2, 3], 30, "a"))
    clock.advance(1)
    bank.put(make_entry([9, 9], 20, "a"))  # a fork, shorter: non-terminal
    bank.put(make_entry([5], 5, None))
    info = {s.session_id: s for s in bank.list_sessions()}
    assert info["a"].active and info["a"].nbytes == 50 and not info[None].active
    assert [(x.prefix_tokens, x.terminal) for x in info["a"].entries] == [(2, False), (3, True)]
    assert [s.session_id for s in bank.list_sessions(model="zzz")] == []
    assert bank.is_terminal(bank.get("m", [1, 2, 3])) and not bank.is_terminal(bank.get("m", [9, 9]))


def test_on_evict_hook_failure_does_not_break_policy():
    def boom(entries, reason):
        raise RuntimeError("hook")

    bank = SessionBank(clock=FakeClock(), on_evict=boom)
    bank.put(make_entry([1], 10, "s"))
    assert bank.drop_session("s") == (1, 10) and bank.entry_count() == 0


def test_clock_going_backwards_is_clamped():
    clock = FakeClock(100.0)
    bank, _ = mk(clock)
    bank.put(make_entry([1], 1, None))
    clock.set(50.0)
    bank.put(make_entry([2], 1, None))
    assert [e.last_access for e in bank.entries()] == [100.0, 100.0]


def test_concurrent_put_lookup_and_shrink_keep_accounting_consistent():
    bank = SessionBank(clock=FakeClock(), max_entries=50, per_session_max_entries=5)
    stop = threading.Event()
    errors: list[BaseException] = []

    def engine():
        i = 0
        try:
            while not stop.is_set() and i < 3000:
                bank.put(SessionEntry("m", (i % 7, i % 11, i), f"s{i % 9}", None, 10))
                bank.longest_prefix("m", (i % 7, i % 11, i, 1))
                i += 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def enforcer():
        try:
            while not stop.is_set():
                bank.shrink_to_bytes(200, protect_active=True)
                bank.shrink_for_admission(100, protect_tokens=(1, 1, 1, 1), model="m")
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=engine), threading.Thread(target=enforcer)]
    for t in threads:
        t.start()
    threads[0].join(timeout=20)
    stop.set()
    threads[1].join(timeout=20)
    assert not errors
    check_invariants(bank)


# -- spans: only the bank's own evictions ---------------------------------------------------------


def evict_spans(rec):
    return [(s.attributes[names.ATTR_REASON], s.attributes[names.ATTR_ENTRIES_EVICTED],
             s.attributes[names.ATTR_BYTES_FREED]) for s in rec.spans(names.SPAN_BANK_EVICT)]


def test_put_time_evictions_open_one_span_per_reason():
    rec = SpanRecorder()
    clock = FakeClock()
    bank = SessionBank(clock=clock, max_bytes=1000, per_session_max_entries=2, tracer=rec.tracer)
    bank.put(make_entry([9], 300, "other"))
    clock.advance(1)
    bank.put(make_entry([1], 300, "s"))
    clock.advance(1)
    bank.put(make_entry([2], 300, "s"))
    assert rec.spans() == []  # nothing evicted yet
    clock.advance(1)
    r = bank.put(make_entry([3], 500, "s"))  # retention takes s's [1], then 1100 > 1000
    assert r.stored and r.evicted == 2
    assert evict_spans(rec) == [(REASON_SESSION_RETENTION, 1, 300), (REASON_CAP_BYTES, 1, 300)]
    assert {s.attributes[names.ATTR_MODEL] for s in rec.spans()} == {"m"}
    assert [s.name for s in rec.spans()] == [names.SPAN_BANK_EVICT] * 2


def test_supersede_and_entry_cap_spans():
    rec = SpanRecorder()
    clock = FakeClock()
    bank = SessionBank(clock=clock, max_entries=2, tracer=rec.tracer)
    bank.put(make_entry([1], 10, "s"))
    bank.put(make_entry([1, 2], 20, "s"))
    assert evict_spans(rec) == [(REASON_SUPERSEDED, 1, 10)]
    rec.clear()
    clock.advance(1)
    bank.put(make_entry([5], 7, None))
    clock.advance(1)
    bank.put(make_entry([6], 8, None))
    assert evict_spans(rec) == [(REASON_CAP_ENTRIES, 1, 20)]


def test_drops_and_remove_open_one_span_each():
    rec = SpanRecorder()
    bank = SessionBank(clock=FakeClock(), tracer=rec.tracer)
    bank.put(make_entry([1], 100, "s"))
    bank.put(make_entry([2], 50, "s", model="m2"))
    bank.put(make_entry([3], 7, "t"))
    bank.put(make_entry([4], 9, "t", model="m2"))
    assert bank.drop_session("s") == (2, 150)
    (span,) = rec.spans(names.SPAN_BANK_EVICT)
    assert evict_spans(rec) == [(REASON_DROPPED, 2, 150)]
    assert names.ATTR_MODEL not in span.attributes  # two models: no single model to name
    rec.clear()
    assert bank.drop_model("m2") == (1, 9)
    assert evict_spans(rec) == [(REASON_DROPPED, 1, 9)]
    assert rec.spans()[0].attributes[names.ATTR_MODEL] == "m2"
    rec.clear()
    assert bank.drop_session("nope") == (0, 0) and rec.spans() == []
    assert bank.remove("m", [3]) is not None
    assert evict_spans(rec) == [(REASON_REMOVED, 1, 7)]


def test_shrinks_and_expiry_open_no_span():
    rec = SpanRecorder()
    clock = FakeClock(0.0)
    bank = SessionBank(clock=clock, active_sessions=lambda: {"live"}, tracer=rec.tracer,
                       max_entries=100, per_session_max_entries=100)
    for i in range(6):
        bank.put(make_entry([i], 10, "live" if i == 0 else f"s{i}"))
    assert bank.shrink_to_bytes(40, protect_active=True) == 2
    assert bank.shrink_for_admission(20, protect_tokens=[9, 9], model="m") == (0, 2)
    assert bank.shrink_for_admission(0, protect_active=True) == (0, 1)
    clock.set(4000.0)
    assert bank.expire_idle() == 0  # only the active session's entry is left
    bank.put(make_entry([7], 10, "idle"))
    clock.set(8000.0)
    assert bank.expire_idle() == 1
    assert rec.spans() == []
    assert bank.stats().evictions == {"memory_pressure": 2, "prefill_admission_chain": 3,
                                      REASON_IDLE_TTL: 1}


def test_an_owner_past_its_session_cap_loses_its_least_recently_used_idle_session():
    from sessions.bank import REASON_CAP_OWNER_SESSIONS, SessionBank, SessionEntry

    now = [0.0]
    evicted: list[tuple[str | None, str]] = []
    bank = SessionBank(max_sessions_per_owner=2, clock=lambda: now[0],
                       on_evict=lambda es, why: evicted.extend((e.session_id, why) for e in es))

    def put(sid: str, owner: str, tokens: tuple[int, ...]) -> None:
        now[0] += 1
        bank.put(SessionEntry(model="m", tokens=tokens, session_id=sid, payload=None,
                              nbytes=10, owner=owner))

    put("a", "o1", (1,))
    put("b", "o1", (2,))
    put("x", "o2", (3,))
    put("a", "o1", (1, 4))  # a is used again: b is o1's least recently used
    put("c", "o1", (5,))
    # (a's shorter snapshot went when its longer one superseded it.)
    assert [e for e in evicted if e[1] == REASON_CAP_OWNER_SESSIONS] == [
        ("b", REASON_CAP_OWNER_SESSIONS)]
    assert {e.session_id for e in bank.entries()} == {"a", "c", "x"}
