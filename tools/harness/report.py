"""Helpers for benchmark reports: logging, percentiles, and how busy the rest of the machine is."""

from __future__ import annotations

import asyncio
import sys
import time

import psutil


def log(msg: str) -> None:
    """Progress to stderr (stdout carries the report)."""
    print(msg, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ts(t) -> float:
    """A protobuf Timestamp as seconds since the epoch."""
    return t.seconds + t.nanos / 1e9


class Machine:
    """How busy the rest of the machine is: system CPU time less this process's and the
    server's. A benchmark on a shared box must not count a neighbour's burst against
    either side, so disturbed runs are measured, reported and run again."""

    # /proc/stat and /proc/PID/stat tick at 100 Hz: allow a few ticks of rounding.
    TICK_SLACK_S = 0.03

    def __init__(self, server_pid: int) -> None:
        self.server = psutil.Process(server_pid)

    def sample(self) -> tuple[float, float, float, float]:
        t = psutil.cpu_times()
        busy = sum(t) - t.idle
        for name in ("iowait", "guest", "guest_nice"):
            busy -= getattr(t, name, 0.0)
        srv = self.server.cpu_times()
        return time.perf_counter(), busy, time.process_time(), srv.user + srv.system

    @staticmethod
    def foreign_cores(a, b) -> float:
        wall = b[0] - a[0]
        other = (b[1] - a[1]) - (b[2] - a[2]) - (b[3] - a[3])
        return max(0.0, other) / wall if wall > 0 else 0.0

    def disturbed(self, foreign: float, wall_s: float, limit: float) -> bool:
        return foreign > limit + self.TICK_SLACK_S / max(wall_s, 1e-3)

    async def wait_quiet(self, limit: float, max_wait_s: float) -> float:
        """Waits until other processes use at most `limit` cores (over 0.5 s windows)."""
        deadline = time.monotonic() + max_wait_s
        announced = False
        while True:
            a = self.sample()
            await asyncio.sleep(0.5)
            foreign = self.foreign_cores(a, self.sample())
            if foreign <= limit + self.TICK_SLACK_S / 0.5 or time.monotonic() >= deadline:
                if announced:
                    log(f"  ...machine quiet enough ({foreign:.2f} cores used by others)")
                return foreign
            if not announced:
                log(
                    f"  other processes are using {foreign:.2f} cores; waiting "
                    f"(up to {max_wait_s:.0f} s)"
                )
                announced = True
