"""ControlService over real gRPC: pins, WatchPressure, GetMemoryStatus, Admit, sessions."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc, types_pb2
from tests.support.wire import ttl
from tools.harness.server import start_server

MiB = 2**20


def test_memory_status_reports_readings_limits_models(stubs):
    control, _ = stubs
    st = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest())
    assert st.enforcer_enabled
    assert st.level == 1  # ok
    assert st.readings.process_bytes > 50 * MiB
    assert st.readings.system_total_bytes > st.readings.process_bytes
    assert st.readings.sources["footprint"]
    assert st.limits.tier == types_pb2.MEMORY_GUARD_TIER_CUSTOM
    assert st.limits.ceiling_bytes == 8 * 2**30
    assert st.limits.binding_term == types_pb2.CEILING_TERM_CUSTOM
    assert st.limits.soft_bytes < st.limits.hard_bytes < st.limits.ceiling_bytes
    assert st.limits.hard_bytes == int(st.limits.ceiling_bytes * 0.95)
    [model] = [m for m in st.models if m.model_id == "demo-tiny"]
    assert model.measured_bytes > 0 and model.batch_cap == 32
    assert st.poll_interval.ToNanoseconds() > 0


def test_pin_and_unpin_model(stubs):
    control, _ = stubs
    lease = control.Pin(control_pb2.PinRequest(model_id="demo-tiny", owner="test")).lease
    assert lease.lease_id and lease.model_id == "demo-tiny" and lease.owner == "test"
    models = {m.model_id: m for m in control.ListModels(control_pb2.ListModelsRequest()).models}
    assert models["demo-tiny"].pinned
    st = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest())
    assert lease.lease_id in {x.lease_id for x in st.leases}
    control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id))
    models = {m.model_id: m for m in control.ListModels(control_pb2.ListModelsRequest()).models}
    assert not models["demo-tiny"].pinned
    with pytest.raises(grpc.RpcError) as info:
        control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_expired_lease_unpins(stubs):
    control, _ = stubs
    lease = control.Pin(control_pb2.PinRequest(model_id="demo-tiny", ttl=ttl(0.5))).lease
    assert lease.HasField("expire_time")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        models = {m.model_id: m for m in control.ListModels(control_pb2.ListModelsRequest()).models}
        if not models["demo-tiny"].pinned:
            break
        time.sleep(0.2)
    assert not models["demo-tiny"].pinned


def test_pin_unloaded_model_loads_it(stubs, demo_path):
    control, inference = stubs
    control.LoadModel(control_pb2.LoadModelRequest(source=str(demo_path), model_id="pinme"),
                      timeout=120)
    control.UnloadModel(control_pb2.UnloadModelRequest(model_id="pinme"))
    lease = control.Pin(control_pb2.PinRequest(model_id="pinme", owner="t"), timeout=120).lease
    models = {m.model_id: m for m in control.ListModels(control_pb2.ListModelsRequest()).models}
    assert models["pinme"].state == control_pb2.MODEL_STATE_READY and models["pinme"].pinned
    control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id))
    control.UnloadModel(control_pb2.UnloadModelRequest(model_id="pinme"))


def test_pin_bad_input(stubs):
    control, _ = stubs
    with pytest.raises(grpc.RpcError) as info:
        control.Pin(control_pb2.PinRequest(owner="nobody"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        control.Pin(control_pb2.PinRequest(model_id="/no/such/model"), timeout=60)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_pressure_snapshot_samples_sequence(srv):
    with srv.channel() as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        call = control.WatchPressure(control_pb2.WatchPressureRequest(include_samples=True),
                                     timeout=30)
        msgs = []
        for m in call:
            msgs.append(m)
            if len(msgs) == 4:
                break
        call.cancel()
    assert msgs[0].WhichOneof("event") == "snapshot"
    assert msgs[0].snapshot.level == 1
    assert msgs[0].snapshot.limits.ceiling_bytes == 8 * 2**30
    # Per-process numbers: the snapshot carries the last event's, each sample the next.
    seqs = [m.sequence for m in msgs]
    assert seqs == sorted(set(seqs)) and seqs[1] > seqs[0]
    assert all(m.WhichOneof("event") == "sample" for m in msgs[1:])
    assert msgs[0].snapshot.HasField("admission") and msgs[1].sample.HasField("admission")


def test_admit_agrees_with_generate(stubs):
    control, inference = stubs
    req = inference_pb2.GenerateRequest(text="admit me", max_tokens=8, ignore_eos=True)
    resp = control.Admit(control_pb2.AdmitRequest(request=req, reserve=True,
                                                  reservation_ttl=ttl(10)))
    assert resp.verdict == control_pb2.ADMIT_VERDICT_ADMIT
    assert resp.projected_bytes > 0 and resp.admission_headroom_bytes > 0
    assert resp.ticket and resp.HasField("ticket_expire_time")
    req.admission_ticket = resp.ticket
    out = list(inference.Generate(req, timeout=60))
    assert out[-1].end.usage.completion_tokens == 8
    # A ticket is single use.
    with pytest.raises(grpc.RpcError) as info:
        list(inference.Generate(req, timeout=60))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # Admit validates like Generate.
    with pytest.raises(grpc.RpcError) as info:
        control.Admit(control_pb2.AdmitRequest(
            request=inference_pb2.GenerateRequest(text="x", model_id="nope")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_session_reuses_prefix_and_matches_cold(stubs):
    control, inference = stubs
    turn1 = list(range(10, 60))
    first = list(inference.Generate(inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=turn1), max_tokens=12, ignore_eos=True,
        session_id="conv-1"), timeout=60))
    assert first[0].start.cached_tokens == 0
    gen1 = [t for m in first if m.WhichOneof("event") == "chunk" for t in m.chunk.token_ids]
    turn2 = turn1 + gen1 + list(range(100, 130))
    warm = list(inference.Generate(inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=turn2), max_tokens=12, ignore_eos=True,
        session_id="conv-1"), timeout=60))
    # The stored cache holds the whole first turn: its prompt and every generated token.
    assert warm[0].start.cached_tokens == len(turn1) + len(gen1)
    assert warm[-1].end.usage.cached_tokens == warm[0].start.cached_tokens
    cold = list(inference.Generate(inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=turn2), max_tokens=12, ignore_eos=True),
        timeout=60))
    assert cold[0].start.cached_tokens == 0

    def toks(msgs):
        return [t for m in msgs if m.WhichOneof("event") == "chunk" for t in m.chunk.token_ids]

    assert toks(warm) == toks(cold)
    sessions = control.ListSessions(control_pb2.ListSessionsRequest()).sessions
    [conv] = [s for s in sessions if s.session_id == "conv-1"]
    assert conv.bytes > 0 and any(e.terminal for e in conv.entries)
    dropped = control.DropSession(control_pb2.DropSessionRequest(session_id="conv-1"))
    assert dropped.entries_dropped >= 1 and dropped.bytes_freed > 0
    with pytest.raises(grpc.RpcError) as info:
        control.DropSession(control_pb2.DropSessionRequest(session_id="conv-1"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_pin_session_shows_pinned(stubs):
    control, inference = stubs
    list(inference.Generate(inference_pb2.GenerateRequest(
        text="pin my session", max_tokens=4, ignore_eos=True, session_id="conv-pin"),
        timeout=60))
    lease = control.Pin(control_pb2.PinRequest(session_id="conv-pin", owner="t")).lease
    sessions = {s.session_id: s for s in
                control.ListSessions(control_pb2.ListSessionsRequest()).sessions}
    assert sessions["conv-pin"].pinned and sessions["conv-pin"].active
    control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id))


@contextmanager
def holding_the_only_slot(inference) -> Iterator[None]:
    """A long greedy stream runs for the block (it has started when the block begins),
    then is cancelled: nothing waits for its tokens."""
    call = inference.Generate(inference_pb2.GenerateRequest(
        text="a", max_tokens=3000, ignore_eos=True), timeout=60)
    started = threading.Event()
    ended: list[grpc.StatusCode] = []

    def read() -> None:
        try:
            for _m in call:
                started.set()
        except grpc.RpcError as err:
            ended.append(err.code())
        started.set()

    t = threading.Thread(target=read)
    t.start()
    try:
        assert started.wait(30) and not ended, ended
        yield
    finally:
        call.cancel()
        t.join(30)
    assert ended == [grpc.StatusCode.CANCELLED], ended


def test_hyper_mode_admits_one_at_a_time(tmp_path, demo_path):
    s = start_server(tmp_path, "--scheduler-mode", "hyper", "--max-num-seqs", "1")
    try:
        with s.channel() as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            inference = inference_pb2_grpc.InferenceServiceStub(ch)
            with holding_the_only_slot(inference):
                resp = control.Admit(control_pb2.AdmitRequest(
                    request=inference_pb2.GenerateRequest(text="b", max_tokens=4)))
            assert resp.verdict == control_pb2.ADMIT_VERDICT_WAIT
            assert resp.binding_constraint == control_pb2.ADMIT_CONSTRAINT_HYPER_CAP
    finally:
        s.stop()


def test_hyper_mode_refuses_wider_settings_at_start(tmp_path):
    import subprocess
    import sys

    from tools.harness.server import ROOT

    r = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--scheduler-mode",
                        "hyper", "--max-num-seqs", "4"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert "max-num-seqs" in r.stderr and "Traceback" not in r.stderr


def test_idle_session_ttl_is_enforced_on_the_tick(tmp_path, demo_path):
    s = start_server(tmp_path, "--session-idle-ttl", "1", "--poll-active", "0.2",
                     "--poll-idle", "0.2")
    try:
        with s.channel() as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            inference = inference_pb2_grpc.InferenceServiceStub(ch)
            list(inference.Generate(inference_pb2.GenerateRequest(
                text="remember me", max_tokens=4, ignore_eos=True, session_id="ttl"),
                timeout=60))

            def cached() -> set[str]:
                resp = control.ListSessions(control_pb2.ListSessionsRequest())
                return {x.session_id for x in resp.sessions}

            assert "ttl" in cached()
            deadline = time.monotonic() + 10
            while "ttl" in cached() and time.monotonic() < deadline:
                time.sleep(0.2)  # no lookups meanwhile: only the tick can expire it
            assert "ttl" not in cached()
    finally:
        s.stop()


def test_waiting_for_admission_times_out_or_finds_the_queue_full(tmp_path, demo_path):
    """A bounded admission queue: a typed status with RetryInfo, never a hang."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    s = start_server(tmp_path, "--scheduler-mode", "hyper", "--max-num-seqs", "1",
                     "--admission-timeout", "1", "--admission-queue-limit", "1")
    try:
        with s.stubs() as (_, inference), holding_the_only_slot(inference):
            errors: list[grpc.RpcError] = []

            def waiter() -> None:
                try:
                    list(inference.Generate(inference_pb2.GenerateRequest(
                        text="b", max_tokens=2), timeout=30))
                except grpc.RpcError as e:
                    errors.append(e)

            w = threading.Thread(target=waiter)
            w.start()
            time.sleep(0.3)  # the waiter holds the queue's only place
            with pytest.raises(grpc.RpcError) as full:
                list(inference.Generate(inference_pb2.GenerateRequest(text="c", max_tokens=2),
                                        timeout=30))
            w.join(30)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for err, reason in ((full.value, "QUEUE_FULL"), (errors[0], "ADMISSION_TIMEOUT")):
            details = rpc_status.from_call(err).details
            info = error_details_pb2.ErrorInfo()
            assert any(d.Unpack(info) for d in details) and info.reason == reason
            retry = error_details_pb2.RetryInfo()
            assert any(d.Unpack(retry) for d in details)
            assert retry.retry_delay.ToNanoseconds() > 0
    finally:
        s.stop()


def test_pin_of_an_unknown_model_is_not_found_and_fetches_nothing(stubs):
    """Only LoadModel (with a source) fetches anything: Pin of a name the server does
    not know is NOT_FOUND at once — no hub download attempt — and leaves no entry."""
    control, _ = stubs
    before = {m.model_id for m in control.ListModels(control_pb2.ListModelsRequest()).models}
    for name in ("no-such", "mlx-community/not-a-model-here"):
        with pytest.raises(grpc.RpcError) as info:
            control.Pin(control_pb2.PinRequest(model_id=name, owner="t"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert name in info.value.details()
    after = {m.model_id for m in control.ListModels(control_pb2.ListModelsRequest()).models}
    assert after == before


def test_a_failed_load_leaves_no_ghost_entry(stubs):
    control, _ = stubs
    before = {m.model_id for m in control.ListModels(control_pb2.ListModelsRequest()).models}
    for source, code in (("/no/such/folder", grpc.StatusCode.NOT_FOUND),
                         ("mlx-community/Qwen3-0.6B-4bit", grpc.StatusCode.UNAVAILABLE)):
        with pytest.raises(grpc.RpcError) as info:
            control.LoadModel(control_pb2.LoadModelRequest(source=source), timeout=120)
        assert info.value.code() == code
    after = {m.model_id for m in control.ListModels(control_pb2.ListModelsRequest()).models}
    assert after == before


def test_unloading_a_pinned_model_needs_force_and_releases_its_leases(stubs, demo_path):
    control, _ = stubs
    control.LoadModel(control_pb2.LoadModelRequest(source=str(demo_path), model_id="pinned-unload"),
                      timeout=120)
    lease = control.Pin(control_pb2.PinRequest(model_id="pinned-unload", owner="t")).lease
    with pytest.raises(grpc.RpcError) as info:
        control.UnloadModel(control_pb2.UnloadModelRequest(model_id="pinned-unload"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pinned" in info.value.details()
    control.UnloadModel(control_pb2.UnloadModelRequest(model_id="pinned-unload", force=True))
    status = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest())
    assert lease.lease_id not in {x.lease_id for x in status.leases}
    models = {m.model_id: m for m in control.ListModels(control_pb2.ListModelsRequest()).models}
    assert models["pinned-unload"].state == control_pb2.MODEL_STATE_UNLOADED
    assert not models["pinned-unload"].pinned
