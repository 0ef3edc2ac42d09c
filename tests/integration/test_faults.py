"""Faults on the real path (issue 12, item 4): a `plimsoll serve` subprocess on the tiny
demo model, real gRPC clients misbehaving.

- Streams cancelled at random points and deadlines expiring at random points (1,000 of
  each by default; `PLIMSOLL_FAULT_STREAMS` sets it) leave no request running or
  waiting, no session active, and MLX active memory back at its baseline (tolerance:
  what the session bank holds now, plus 4 MiB).
- A client that stops reading (HTTP/2 flow control holds the server's write) stalls
  neither another client's stream nor the governor, and its own stream ends
  ABORTED / CLIENT_STALLED after `--stream-stall-timeout`.
- A client killed with SIGKILL mid-stream leaves nothing running.
- Loads that fail midway (truncated safetensors, a config that is not JSON, weights
  that do not fit the config) leave no entry and no memory behind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tools.harness.server import ROOT, ServerProcess, start_server

pytestmark = pytest.mark.timeout(600)

STREAMS = int(os.environ.get("PLIMSOLL_FAULT_STREAMS", "1000"))
MIB = 1 << 20
STALL_S = 2.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> ServerProcess:
    s = start_server(tmp_path_factory.mktemp("faults"), "--memory-guard-gb", "8",
                     "--stream-stall-timeout", str(STALL_S), "--max-num-seqs", "8")
    yield s
    assert s.proc.poll() is None, f"the server exited:\n{s.log()[-3000:]}"
    s.stop()


def status(control) -> control_pb2.GetMemoryStatusResponse:
    return control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=10)


def settled(control, timeout: float = 30.0) -> control_pb2.GetMemoryStatusResponse:
    """Until nothing runs, waits or is active (or the timeout): the last status."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(control)
        models = control.ListModels(control_pb2.ListModelsRequest(), timeout=10).models
        sessions = control.ListSessions(control_pb2.ListSessionsRequest(), timeout=10).sessions
        quiet = (st.admission.running == 0 and st.admission.waiting == 0
                 and all(m.active_requests == 0 and m.waiting_requests == 0 for m in models)
                 and not any(s.active for s in sessions))
        if quiet or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def request(rng: random.Random, i: int) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(text=f"Once upon a time, {i}", ignore_eos=True,
                                        max_tokens=rng.randint(1, 48))
    if i % 4 == 0:
        req.session_id = f"fault-{i % 16}"  # restores and stores, cut at random points
    return req


def test_cancels_and_deadline_expiries_leave_nothing_behind(srv):
    with grpc.insecure_channel(srv.address) as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        inference = inference_pb2_grpc.InferenceServiceStub(ch)
        for i in range(0, 64, 4):  # the sessions exist, so later turns restore
            list(inference.Generate(request(random.Random(i), i), timeout=30))
        time.sleep(1.0)
        baseline = settled(control)
        base_mlx = baseline.readings.mlx_active_bytes - baseline.admission.session_bank_bytes
        ended: dict[str, int] = {}
        lock = threading.Lock()

        def count(name: str) -> None:
            with lock:
                ended[name] = ended.get(name, 0) + 1

        def cancel_one(i: int) -> None:
            rng = random.Random(i)
            call = inference.Generate(request(rng, i), timeout=30)
            try:
                for _ in range(rng.randint(0, 6)):
                    next(call)
            except (StopIteration, grpc.RpcError):
                pass
            call.cancel()
            count("cancelled")

        def expire_one(i: int) -> None:
            rng = random.Random(10_000 + i)
            try:
                list(inference.Generate(request(rng, i), timeout=rng.uniform(0.001, 0.08)))
                count("OK")
            except grpc.RpcError as err:
                count(err.code().name)

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(cancel_one, range(STREAMS)))
            list(pool.map(expire_one, range(STREAMS)))
        took = time.monotonic() - t0
        after = settled(control)
        after_mlx = after.readings.mlx_active_bytes - after.admission.session_bank_bytes
        print(f"\n{STREAMS} cancels + {STREAMS} deadlines in {took:.1f} s: {ended}; MLX active "
              f"less the bank {base_mlx / MIB:.1f} -> {after_mlx / MIB:.1f} MiB "
              f"(bank {after.admission.session_bank_bytes / MIB:.1f} MiB)")
        assert set(ended) <= {"cancelled", "OK", "DEADLINE_EXCEEDED"}, ended
        assert after.admission.running == 0 and after.admission.waiting == 0
        sessions = control.ListSessions(control_pb2.ListSessionsRequest(), timeout=10).sessions
        assert not [s.session_id for s in sessions if s.active]
        assert after_mlx <= base_mlx + 4 * MIB, (base_mlx, after_mlx)
        # And it still serves.
        assert list(inference.Generate(inference_pb2.GenerateRequest(
            text="The end", max_tokens=2), timeout=30))[-1].WhichOneof("event") == "end"


def test_a_client_that_stops_reading_stalls_nothing_and_is_ended(srv):
    # A small receive window and no window growth: the server's writes block soon.
    slow = grpc.insecure_channel(srv.address, options=[("grpc.http2.lookahead_bytes", 1024),
                                                       ("grpc.http2.bdp_probe", 0)])
    with grpc.insecure_channel(srv.address) as ch, slow:
        control = control_pb2_grpc.ControlServiceStub(ch)
        inference = inference_pb2_grpc.InferenceServiceStub(ch)
        # Two streams on one connection, ~41 KB each: together past the connection's
        # 64 KiB window, so the server's writes block whatever the stream windows are.
        stalls = [inference_pb2_grpc.InferenceServiceStub(slow).Generate(
            inference_pb2.GenerateRequest(text="Once upon a time", max_tokens=3000,
                                          ignore_eos=True, max_tokens_per_chunk=1),
            timeout=120) for _ in range(2)]
        assert [next(s).WhichOneof("event") for s in stalls] == ["start", "start"]
        t0 = time.monotonic()
        # Meanwhile another client's stream runs to its end, and the governor ticks.
        other = list(inference.Generate(inference_pb2.GenerateRequest(
            text="Meanwhile", max_tokens=16, ignore_eos=True), timeout=30))
        assert other[-1].WhichOneof("event") == "end"
        watch = control.WatchPressure(control_pb2.WatchPressureRequest(include_samples=True),
                                      timeout=10)
        events = [next(watch).WhichOneof("event") for _ in range(2)]  # snapshot, a sample
        watch.cancel()
        assert len(events) == 2, events
        while status(control).admission.running and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        freed_after = time.monotonic() - t0
        assert status(control).admission.running == 0
        assert STALL_S * 0.8 < freed_after < STALL_S + 10, freed_after
        ended = []
        for stalled in stalls:
            try:
                ended.append([m.WhichOneof("event") for m in stalled][-1])
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.ABORTED, err
                assert "stream-stall-timeout" in err.details()
                ended.append("ABORTED")
        assert "ABORTED" in ended and set(ended) <= {"ABORTED", "end"}, ended
        print(f"\nthe stalled stream's slot was freed {freed_after:.1f} s after it stalled")


CLIENT = """
import sys, grpc
sys.path.insert(0, {proto!r})
from plimsoll.v1 import inference_pb2, inference_pb2_grpc
stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel({address!r}))
for m in stub.Generate(inference_pb2.GenerateRequest(text="Once upon a time",
                       max_tokens=3000, ignore_eos=True), timeout=120):
    print(m.WhichOneof("event"), flush=True)
"""


def test_a_client_killed_with_sigkill_leaves_nothing_running(srv):
    code = CLIENT.format(proto=str(ROOT / "proto"), address=srv.address)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "start"
        proc.stdout.readline()  # a chunk: it is mid-decode
        with grpc.insecure_channel(srv.address) as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            assert status(control).admission.running == 1
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            t0 = time.monotonic()
            st = settled(control, timeout=20)
            assert st.admission.running == 0, "the killed client's request still runs"
            print(f"\nfreed {time.monotonic() - t0:.2f} s after the client was killed")
    finally:
        proc.kill()
        proc.wait()


def _broken_copies(demo: Path, root: Path) -> dict[str, Path]:
    out = {}
    trunc = root / "truncated"
    shutil.copytree(demo, trunc)
    weights = next(trunc.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out["truncated"] = trunc
    bad = root / "badconfig"
    shutil.copytree(demo, bad)
    (bad / "config.json").write_text('{"model_type": "llama", ')
    out["badconfig"] = bad
    wrong = root / "wrongshape"
    shutil.copytree(demo, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["hidden_size"] = cfg["hidden_size"] * 2  # the weights no longer fit the config
    (wrong / "config.json").write_text(json.dumps(cfg))
    out["wrongshape"] = wrong
    return out


def test_loads_that_fail_midway_leave_no_entry_and_no_memory(srv, demo_path, tmp_path):
    with grpc.insecure_channel(srv.address) as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        before = {m.model_id for m in control.ListModels(control_pb2.ListModelsRequest()).models}
        base = settled(control).readings.mlx_active_bytes
        for name, folder in _broken_copies(demo_path, tmp_path).items():
            with pytest.raises(grpc.RpcError) as err:
                control.LoadModel(control_pb2.LoadModelRequest(source=str(folder),
                                                               model_id=name), timeout=60)
            assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                        grpc.StatusCode.INVALID_ARGUMENT), (name, err.value)
            assert "see the server log" not in err.value.details(), (name, err.value.details())
        after = {m.model_id for m in control.ListModels(control_pb2.ListModelsRequest()).models}
        assert after == before
        assert status(control).readings.mlx_active_bytes <= base + MIB
