"""Small builders of wire messages for tests."""

from __future__ import annotations

from google.protobuf import duration_pb2


def ttl(seconds: float) -> duration_pb2.Duration:
    """A google.protobuf.Duration of `seconds`."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d
