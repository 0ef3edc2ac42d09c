"""Limits (issue 12, item 2) on a real server over gRPC, each a typed status: stop strings
(count and length), WatchPressure streams open at once, Pin leases and Admit
reservations per owner. Calls per
connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a third call on one connection waits
in the client until one of its two ends, while another connection is not held up. The
other limits of the item have their own tests: in-flight requests (IN_FLIGHT_LIMIT) and the
admission queue (QUEUE_FULL) in test_admit_predicts_generate.py and test_contract.py,
prompt and max_tokens against the context and the message size in test_bad_input.py,
the session bank's entry and byte caps in the session tests.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from engine.request import MAX_STOP_CHARS, MAX_STOP_STRINGS
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tools.harness.server import ServerProcess, start_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> ServerProcess:
    s = start_server(tmp_path_factory.mktemp("limits"), "--max-watchers", "2",
                     "--max-leases-per-owner", "2", "--max-streams-per-connection", "2",
                     "--max-reservations-per-owner", "2",
                     "--max-sessions-per-owner", "2")
    yield s
    s.stop()


def details(err: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo, float | None,
                                         list[str]]:
    info, retry, bad = error_details_pb2.ErrorInfo(), None, []
    for d in rpc_status.from_call(err).details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            d.Unpack(info)
        elif d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            r = error_details_pb2.RetryInfo()
            d.Unpack(r)
            retry = r.retry_delay.ToNanoseconds() / 1e9
        elif d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            b = error_details_pb2.BadRequest()
            d.Unpack(b)
            bad = [v.field for v in b.field_violations]
    return info, retry, bad


def test_stop_strings_are_bounded_in_count_and_length(srv):
    with grpc.insecure_channel(srv.address) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        for stop, field in ((["x"] * (MAX_STOP_STRINGS + 1), "stop"),
                            (["ok", "y" * (MAX_STOP_CHARS + 1)], "stop[1]")):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(inference_pb2.GenerateRequest(text="hi", stop=stop),
                                   timeout=10))
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert details(err.value)[2] == [field]
        at_limit = ["z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
        events = list(stub.Generate(inference_pb2.GenerateRequest(
            text="hi", stop=at_limit, max_tokens=2), timeout=30))
        assert events[-1].WhichOneof("event") == "end"


def own_connection(srv: ServerProcess) -> grpc.Channel:
    """A channel with a connection of its own (not shared with the process's others)."""
    return grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)])


def test_watchpressure_streams_are_bounded(srv):
    channels = [own_connection(srv) for _ in range(4)]
    try:
        watch = [control_pb2_grpc.ControlServiceStub(c).WatchPressure for c in channels]
        open_ = [watch[i](control_pb2.WatchPressureRequest(), timeout=30) for i in range(2)]
        for w in open_:
            assert next(w).WhichOneof("event") == "snapshot"
        with pytest.raises(grpc.RpcError) as err:
            next(watch[2](control_pb2.WatchPressureRequest(), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info, retry, _ = details(err.value)
        assert info.reason == "WATCHER_LIMIT" and retry and retry > 0
        open_[0].cancel()
        for _ in range(50):  # the cancelled stream's slot comes back
            try:
                w = watch[3](control_pb2.WatchPressureRequest(), timeout=10)
                assert next(w).WhichOneof("event") == "snapshot"
                w.cancel()
                break
            except grpc.RpcError:
                time.sleep(0.1)
        else:
            pytest.fail("a cancelled WatchPressure stream never gave its slot back")
        open_[1].cancel()
    finally:
        for c in channels:
            c.close()


def test_leases_are_bounded_per_owner(srv):
    with grpc.insecure_channel(srv.address) as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        model = control.ListModels(control_pb2.ListModelsRequest(), timeout=10).models[0]

        def pin(owner: str):
            return control.Pin(control_pb2.PinRequest(model_id=model.model_id, owner=owner),
                               timeout=30).lease

        held = [pin("alice"), pin("alice")]
        with pytest.raises(grpc.RpcError) as err:
            pin("alice")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info, retry, _ = details(err.value)
        assert info.reason == "LEASE_LIMIT" and info.metadata["limit"] == "2"
        assert retry and retry > 0
        other = pin("bob")  # another owner is not limited by alice's leases
        control.Unpin(control_pb2.UnpinRequest(lease_id=held[0].lease_id), timeout=10)
        held[0] = pin("alice")
        for lease in (*held, other):
            control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id), timeout=10)


def test_calls_per_connection_wait_in_the_client_beyond_the_limit(srv):
    long = inference_pb2.GenerateRequest(text="Once upon a time", max_tokens=400,
                                         ignore_eos=True)
    with grpc.insecure_channel(srv.address) as ch, own_connection(srv) as other:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        running = [stub.Generate(long, timeout=60) for _ in range(2)]
        for call in running:
            assert next(call).WhichOneof("event") == "start"
        third = stub.Generate(inference_pb2.GenerateRequest(text="third", max_tokens=2),
                              timeout=60)
        waited = {}

        def read_third() -> None:
            t0 = time.monotonic()
            first = next(third)
            waited["s"] = time.monotonic() - t0
            waited["event"] = first.WhichOneof("event")

        reader = threading.Thread(target=read_third)
        reader.start()
        time.sleep(0.5)
        assert "s" not in waited, "the third call on the connection was not held back"
        # Another connection is not held up by this one's limit.
        quick = list(inference_pb2_grpc.InferenceServiceStub(other).Generate(
            inference_pb2.GenerateRequest(text="other", max_tokens=2), timeout=30))
        assert quick[-1].WhichOneof("event") == "end"
        running[0].cancel()
        reader.join(30)
        assert waited.get("event") == "start", waited
        running[1].cancel()


def test_reservations_are_bounded_per_owner(srv):
    with grpc.insecure_channel(srv.address) as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)

        def reserve(owner: str, crid: str = "") -> control_pb2.AdmitResponse:
            return control.Admit(control_pb2.AdmitRequest(
                request=inference_pb2.GenerateRequest(text=f"reserve {owner}", max_tokens=4),
                reserve=True, owner=owner, client_request_id=crid), timeout=30)

        first = reserve("carol", "c-1")
        assert first.ticket and reserve("carol").ticket
        with pytest.raises(grpc.RpcError) as err:
            reserve("carol")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info, retry, _ = details(err.value)
        assert info.reason == "RESERVATION_LIMIT" and info.metadata["limit"] == "2"
        assert retry and retry > 0
        assert reserve("carol", "c-1").ticket == first.ticket  # a retry is not a new ticket
        assert reserve("dave").ticket  # another owner is not limited by carol's
        # Redeeming one gives its slot back.
        list(inference_pb2_grpc.InferenceServiceStub(ch).Generate(
            inference_pb2.GenerateRequest(text="reserve carol", max_tokens=4,
                                          admission_ticket=first.ticket), timeout=30))
        assert reserve("carol").ticket


def test_sessions_are_bounded_per_owner(srv):
    with grpc.insecure_channel(srv.address) as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        inference = inference_pb2_grpc.InferenceServiceStub(ch)

        def turn(owner: str, session: str) -> None:
            list(inference.Generate(inference_pb2.GenerateRequest(
                text=f"a turn of {session}", max_tokens=2, session_id=session, owner=owner),
                timeout=30))

        def sessions() -> set[str]:
            return {s.session_id for s in control.ListSessions(
                control_pb2.ListSessionsRequest(), timeout=10).sessions}

        for sid in ("erin-1", "erin-2"):
            turn("erin", sid)
        turn("frank", "frank-1")
        assert {"erin-1", "erin-2", "frank-1"} <= sessions()
        turn("erin", "erin-1")  # erin-2 is now erin's least recently used
        turn("erin", "erin-3")
        kept = sessions()
        assert "erin-2" not in kept, kept
        assert {"erin-1", "erin-3", "frank-1"} <= kept  # another owner's are untouched
