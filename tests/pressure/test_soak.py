"""A bounded soak (issue 12, item 5): one server in a child memory cgroup, mixed traffic
(Generate with and without sessions, Admit with and without reserve, Pin / Unpin,
WatchPressure subscribers that come and go) while the cgroup limit cycles between
roomy and squeezed (level ok <-> hard).

It passes when every call ended OK or with a typed shed (RESOURCE_EXHAUSTED, ABORTED,
UNAVAILABLE with RetryInfo... nothing UNKNOWN or INTERNAL), the server never died and
the cgroup saw no OOM kill, and RSS and MLX active memory are flat: the least-squares
slope over the second half of the run (after warm-up), sampled at the same phase of
each pressure cycle, under SLOPE_LIMIT_MIB_PER_MIN. `PLIMSOLL_SOAK_SECONDS` sets the
length (default 120 in CI; figures in docs/benchmarks.md come from longer runs).
"""

from __future__ import annotations

import collections
import os
import random
import threading
import time

import grpc
import pytest

from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc, types_pb2
from tests.pressure.harness import mib, rss_bytes
from tools.harness.steering import ROOMY_LIMIT, Squeeze, memory_status, worker_args

SECONDS = float(os.environ.get("PLIMSOLL_SOAK_SECONDS", "120"))
CYCLE_S = 8.0  # half roomy, half squeezed
SLOPE_LIMIT_MIB_PER_MIN = 4.0
TYPED = {"OK", "RESOURCE_EXHAUSTED", "ABORTED", "UNAVAILABLE", "CANCELLED",
         "DEADLINE_EXCEEDED"}

pytestmark = pytest.mark.timeout(int(SECONDS) + 240)


def slope_per_min(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 3:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


def test_mixed_traffic_under_cycling_pressure_stays_flat_and_typed(cgroups, servers):
    cg = cgroups(ROOMY_LIMIT)
    srv = servers(*worker_args(1.0, 0)[:-2], "--stream-stall-timeout", "10", cgroup=cg)
    squeeze = Squeeze(srv, cg)
    codes: collections.Counter[str] = collections.Counter()
    untyped: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def note(kind: str, code: grpc.StatusCode, details: str = "") -> None:
        with lock:
            codes[f"{kind}:{code.name}"] += 1
            if code.name not in TYPED:
                untyped.append(f"{kind} {code.name}: {details}")

    def generator(seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(srv.address) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            i = 0
            while not stop.is_set():
                i += 1
                req = inference_pb2.GenerateRequest(
                    text=f"Soak {seed} turn {i}: once upon a time", ignore_eos=True,
                    max_tokens=rng.randint(1, 32))
                if rng.random() < 0.5:
                    req.session_id = f"soak-{seed}-{rng.randrange(4)}"
                try:
                    call = stub.Generate(req, timeout=30)
                    if rng.random() < 0.2:  # a client that gives up midway
                        next(call, None)
                        call.cancel()
                        note("generate", grpc.StatusCode.CANCELLED)
                        continue
                    for _ in call:
                        pass
                    note("generate", grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    note("generate", err.code(), err.details() or "")

    def controller(seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(srv.address) as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            model = control.ListModels(control_pb2.ListModelsRequest(), timeout=10).models[0]
            while not stop.is_set():
                try:
                    kind = rng.choice(("admit", "reserve", "pin", "watch", "status"))
                    if kind in ("admit", "reserve"):
                        control.Admit(control_pb2.AdmitRequest(
                            reserve=kind == "reserve", request=inference_pb2.GenerateRequest(
                                text="admit me", max_tokens=8)), timeout=10)
                    elif kind == "pin":
                        lease = control.Pin(control_pb2.PinRequest(
                            model_id=model.model_id, owner=f"soak-{seed}"), timeout=10).lease
                        time.sleep(rng.uniform(0, 0.3))
                        control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id),
                                      timeout=10)
                    elif kind == "watch":
                        w = control.WatchPressure(control_pb2.WatchPressureRequest(
                            include_samples=True, include_actions=True), timeout=10)
                        next(w)
                        w.cancel()
                    else:
                        control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=10)
                    note(kind, grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    note(kind, err.code(), err.details() or "")
                time.sleep(0.05)

    rss: list[tuple[float, float]] = []
    mlx: list[tuple[float, float]] = []
    levels: collections.Counter[int] = collections.Counter()
    threads = [threading.Thread(target=generator, args=(s,), daemon=True) for s in range(3)]
    threads += [threading.Thread(target=controller, args=(10 + s,), daemon=True) for s in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    try:
        while (now := time.monotonic() - t0) < SECONDS:
            squeezed = (now % CYCLE_S) >= CYCLE_S / 2
            if squeezed:
                squeeze.press()
            else:
                squeeze.release()
            time.sleep(CYCLE_S / 2 - 0.5)
            st = memory_status(srv)
            levels[st.level] += 1
            if not squeezed:  # flatness measured at the same phase: end of the roomy half
                rss.append((now, rss_bytes(srv.proc.pid) / 2**20))
                mlx.append((now, st.readings.mlx_active_bytes / 2**20))
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        squeeze.release()
    alive = srv.proc.poll() is None
    counters = cg.oom_counters()
    half = [p for p in rss if p[0] >= SECONDS / 2]
    rss_slope = slope_per_min(half)
    mlx_slope = slope_per_min([p for p in mlx if p[0] >= SECONDS / 2])
    print(f"\nsoak {SECONDS:.0f} s: {sum(codes.values())} calls {dict(sorted(codes.items()))}; "
          f"levels seen {dict(levels)}; RSS {rss[0][1]:.0f} -> {rss[-1][1]:.0f} MiB, slope "
          f"{rss_slope:+.2f} MiB/min; MLX active {mlx[0][1]:.1f} -> {mlx[-1][1]:.1f} MiB, "
          f"slope {mlx_slope:+.2f} MiB/min; {cg.describe()}")
    assert alive, f"the server died:\n{srv.log()[-3000:]}"
    assert counters.oom_kill == 0, counters
    assert not untyped, untyped[:10]
    assert levels.get(types_pb2.PRESSURE_LEVEL_HARD, 0) + levels.get(
        types_pb2.PRESSURE_LEVEL_SOFT, 0) > 0, f"never under pressure: {dict(levels)}"
    assert abs(rss_slope) < SLOPE_LIMIT_MIB_PER_MIN, (rss, mib(rss_bytes(srv.proc.pid)))
    assert abs(mlx_slope) < SLOPE_LIMIT_MIB_PER_MIN, mlx
