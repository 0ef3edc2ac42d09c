"""Wire conversions that are pure functions (service/convert.py)."""

from __future__ import annotations

from service import convert


def test_a_duration_is_rounded_to_the_nanosecond_not_truncated():
    """A reservation's lifetime is its expiry less its creation on the monotonic clock:
    at some clock readings (t + 300.0) - t is 300 s less a rounding of the sum, which
    truncated to 299.999999999 s (whole seconds 299) on the wire."""
    created = 65410.462796616  # a reading where the sum rounds down
    lifetime = (created + 300.0) - created
    assert lifetime < 300.0
    d = convert.duration(lifetime)
    assert d.ToSeconds() == 300 and d.ToNanoseconds() == 300 * 10**9
    assert convert.duration(1.5e-9).ToNanoseconds() == 2
    assert convert.duration(0.25).ToNanoseconds() == 250_000_000
