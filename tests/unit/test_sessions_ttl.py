"""TtlMap (the one TTL map), and what is built on it: Leases and the ReservationBook."""

from __future__ import annotations

import pytest

from sessions.activity import ActiveSessions
from sessions.leases import Lease, Leases
from sessions.reservations import DEFAULT_RESERVATION_TTL_S, ReservationBook, request_digest
from sessions.ttl import Held, TtlMap
from tests.support.clock import FakeClock


def counter_ids(prefix: str):
    n = iter(range(1, 1000))
    return lambda: f"{prefix}{next(n)}"


# -- TtlMap ---------------------------------------------------------------------------


def test_put_get_live_and_len():
    clock = FakeClock(0.0)
    m: TtlMap[str] = TtlMap(clock)
    held = m.put("a", "A", 10.0)
    assert held == Held("A", 0.0, 10.0)
    assert m.put("b", "B", None) == Held("B", 0.0, None)  # None: until removed
    assert m.put("c", "C", 0) == Held("C", 0.0, None)  # 0 as well
    assert m.get("a") == held and m.get("zz") is None
    assert sorted(h.value for h in m.live()) == ["A", "B", "C"] and len(m) == 3
    assert m.now() == 0.0


def test_reads_expire_on_time_without_calling_expire():
    clock = FakeClock(0.0)
    m: TtlMap[str] = TtlMap(clock)
    m.put("a", "A", 10.0)
    m.put("b", "B", None)
    clock.set(9.999)
    assert m.get("a") is not None and len(m) == 2
    clock.set(10.0)  # the expiry instant itself is no longer live
    assert m.get("a") is None
    assert [h.value for h in m.live()] == ["B"] and len(m) == 1
    clock.set(1e9)
    assert m.get("b") is not None  # no TTL: never expires
    # expire() drops what is already unreadable and returns it.
    assert [h.value for h in m.expire()] == ["A"] and m.expire() == []


def test_pop_of_an_expired_entry_is_none_and_drops_it():
    clock = FakeClock(0.0)
    m: TtlMap[str] = TtlMap(clock)
    m.put("a", "A", 5.0)
    m.put("b", "B", 5.0)
    assert m.pop("b") == Held("B", 0.0, 5.0) and m.pop("b") is None  # single use
    clock.set(6.0)
    assert m.pop("a") is None
    assert m.expire() == []  # the pop removed it, live or not
    assert m.pop("never") is None


def test_negative_ttl_is_rejected():
    m: TtlMap[int] = TtlMap(FakeClock())
    with pytest.raises(ValueError, match="ttl must be >= 0"):
        m.put("a", 1, -0.5)
    assert len(m) == 0


def test_put_again_replaces_and_restarts_the_ttl():
    clock = FakeClock(0.0)
    m: TtlMap[str] = TtlMap(clock)
    m.put("a", "old", 5.0)
    clock.set(4.0)
    m.put("a", "new", 5.0)
    clock.set(8.0)
    assert m.get("a") == Held("new", 4.0, 9.0)


# -- Leases -------------------------------------------------------------------------------


def test_model_and_session_leases():
    clock = FakeClock(100.0)
    leases = Leases(clock, id_factory=counter_ids("L"))
    a = leases.pin_model("llama", owner="ops", ttl_s=30)
    b = leases.pin_model("llama", owner="batch")
    c = leases.pin_session("conv-1", owner="app", ttl_s=10)
    assert a.lease == Lease("L1", "ops", model_id="llama")
    assert (a.lease_id, a.created_at, a.expires_at) == ("L1", 100.0, 130.0)
    assert b.expires_at is None
    assert c.lease == Lease("L3", "app", session_id="conv-1")
    assert leases.model_count("llama") == 2 and leases.model_count("other") == 0
    assert leases.pinned_sessions() == frozenset({"conv-1"})
    assert [h.lease_id for h in leases.leases()] == ["L1", "L2", "L3"]


def test_expired_leases_no_longer_pin():
    clock = FakeClock(0.0)
    leases = Leases(clock, id_factory=counter_ids("L"))
    leases.pin_model("m", ttl_s=30)
    leases.pin_session("s", ttl_s=10)
    leases.pin_session("s", ttl_s=20)  # two leases on one session
    clock.set(10.0)
    assert leases.pinned_sessions() == frozenset({"s"})  # the second still holds it
    clock.set(20.0)
    assert leases.pinned_sessions() == frozenset() and leases.model_count("m") == 1
    clock.set(30.0)
    assert leases.model_count("m") == 0 and leases.leases() == []
    assert sorted(h.lease_id for h in leases.expire()) == ["L1", "L2", "L3"]


def test_unpin_returns_the_lease_once():
    leases = Leases(FakeClock(), id_factory=counter_ids("L"))
    held = leases.pin_model("m")
    assert leases.unpin(held.lease_id) == held and leases.unpin(held.lease_id) is None
    assert leases.model_count("m") == 0 and leases.unpin("nope") is None


def test_active_sessions_unite_in_flight_and_pinned():
    clock = FakeClock(0.0)
    leases = Leases(clock)
    active = ActiveSessions(leases)
    leases.pin_session("pinned", ttl_s=5)
    active.begin("running")
    active.begin("running")
    assert active() == frozenset({"running", "pinned"})
    active.end("running")
    assert active.in_flight_ids() == frozenset({"running"})  # one request still runs
    active.end("running")
    active.begin(None)  # anonymous requests are not sessions
    assert active() == frozenset({"pinned"})
    active.end(None)
    clock.set(5.0)
    assert active() == frozenset()


# -- ReservationBook ----------------------------------------------------------------------


def _reserve(book, nbytes, model, ttl_s=None, digest="d", client_request_id=""):
    return book.reserve(nbytes, model, digest, ttl_s, client_request_id).reservation


def test_reservations_count_against_others_and_expire():
    clock = FakeClock(0.0)
    book = ReservationBook(clock, id_factory=counter_ids("t"))
    r1 = _reserve(book, 1000, "m")  # default TTL 30 s
    r2 = _reserve(book, 300, "m2", ttl_s=10)
    assert DEFAULT_RESERVATION_TTL_S == 30.0
    assert (r1.ticket, r1.expires_at, r2.expires_at) == ("t1", 30.0, 10.0)
    assert book.reserved_bytes() == 1300
    assert book.reserved_bytes(excluding="t1") == 300
    assert book.reserved_bytes(model="m") == 1000
    clock.set(10.0)
    assert book.reserved_bytes() == 1000  # t2 expired: no longer counted
    assert len(book) == 1  # ... nor listed, before anyone calls expire()
    assert [r.ticket for r in book.expire()] == ["t2"] and len(book) == 1
    assert book.redeem("t1") == r1 and book.redeem("t1") is None  # single use
    r3 = _reserve(book, 5, "m", ttl_s=1)
    clock.set(11.0)
    assert book.redeem(r3.ticket) is None and len(book) == 0  # expired at redeem
    with pytest.raises(ValueError):
        _reserve(book, -1, "m")


def test_reservation_ttl_zero_means_default_and_negative_is_rejected():
    clock = FakeClock(0.0)
    book = ReservationBook(clock, default_ttl_s=7.0, id_factory=counter_ids("t"))
    assert _reserve(book, 1, "m", ttl_s=0).expires_at == 7.0
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        _reserve(book, 1, "m", ttl_s=-1)
    with pytest.raises(ValueError):
        ReservationBook(clock, default_ttl_s=0)


def test_redeem_releases_the_bytes():
    book = ReservationBook(FakeClock(0.0), id_factory=counter_ids("t"))
    r = _reserve(book, 50, "m")
    assert book.redeem(r.ticket) == r and book.reserved_bytes() == 0 and len(book) == 0


def test_reservation_ttl_is_clamped_to_the_maximum():
    clock = FakeClock(0.0)
    book = ReservationBook(clock, default_ttl_s=30.0, max_ttl_s=300.0,
                           id_factory=counter_ids("t"))
    ten_years = 10 * 365 * 86400.0
    grant = book.reserve(1, "m", "d", ten_years)
    assert grant.clamped and grant.reservation.expires_at == 300.0
    assert not book.reserve(1, "m", "d", 300.0).clamped
    with pytest.raises(ValueError):
        ReservationBook(clock, default_ttl_s=60.0, max_ttl_s=30.0)


def test_a_retry_with_the_same_client_request_id_returns_the_same_ticket():
    clock = FakeClock(0.0)
    book = ReservationBook(clock, id_factory=counter_ids("t"))
    first = book.reserve(100, "m", "d1", client_request_id="c1")
    again = book.reserve(100, "m", "d1", client_request_id="c1")
    assert again.repeated and again.reservation == first.reservation
    assert book.reserved_bytes() == 100 and len(book) == 1
    other = book.reserve(100, "m", "d2", client_request_id="c1")  # another request
    assert not other.repeated and book.reserved_bytes() == 200
    clock.set(31.0)  # both expired: the id may be used afresh
    assert not book.reserve(100, "m", "d1", client_request_id="c1").repeated


def test_request_digest_binds_model_prompt_and_budget():
    d = request_digest("m", [1, 2, 3], 16)
    assert d == request_digest("m", [1, 2, 3], 16)
    assert len({d, request_digest("m2", [1, 2, 3], 16), request_digest("m", [1, 2], 16),
                request_digest("m", [1, 2, 3], 17)}) == 4
