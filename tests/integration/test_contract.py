"""The contract keeps its word, over real gRPC to a real server (tiny demo model):
reservations hold exactly their own bytes, bounded, bound to their request and
released however their Generate ends; retries with a client request id do not
duplicate; listings page; a stream that started always ends with its usage."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from plimsoll.v1 import control_pb2, inference_pb2, inference_pb2_grpc
from tests.support.wire import ttl

TEN_YEARS_S = 10 * 365 * 86400


def request(seed: int, tokens: int = 64, **kw) -> inference_pb2.GenerateRequest:
    ids = [5 + (seed * 13 + i) % 900 for i in range(tokens)]
    return inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=ids),
                                         max_tokens=kw.pop("max_tokens", 2), **kw)


def admission(control) -> control_pb2.GetMemoryStatusResponse:
    return control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest()).admission


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    info = error_details_pb2.ErrorInfo()
    for d in rpc_status.from_call(err).details:
        if d.Unpack(info):
            return info
    raise AssertionError(f"no ErrorInfo in {err}")


def run(inference, req) -> list:
    return list(inference.Generate(req, timeout=60))


@pytest.fixture()
def stubs(stubs):
    """The module server's stubs, with every ticket a test's Admit took released after
    the test, pass or fail: the tests count the server's reservations, and a failed
    test's would otherwise be counted by the ones after it."""
    control, inference = stubs
    admit, taken = control.Admit, []

    def recording(req, *args, **kwargs):
        resp = admit(req, *args, **kwargs)
        if resp.ticket:
            taken.append(resp.ticket)
        return resp

    control.Admit = recording
    yield control, inference
    control.Admit = admit
    for ticket in taken:  # a Generate with a bad field releases its ticket unrun
        bad = request(0, admission_ticket=ticket)
        bad.sampling.temperature = -1
        with pytest.raises(grpc.RpcError):
            run(inference, bad)
    assert admission(control).reservations == 0


def test_reservations_hold_exactly_their_own_bytes_and_lock_no_one_out(stubs):
    control, inference = stubs
    req = request(1, tokens=512)
    grants = [control.Admit(control_pb2.AdmitRequest(request=req, reserve=True))
              for _ in range(8)]
    assert all(g.verdict == control_pb2.ADMIT_VERDICT_ADMIT and g.ticket for g in grants)
    own = grants[0].request_bytes
    assert own > 0 and {g.request_bytes for g in grants} == {own}  # no compounding
    # Each Admit counts the tickets before it, and only in the projection.
    assert [g.reserved_bytes for g in grants] == [i * own for i in range(8)]
    held = admission(control)
    assert held.reservations == 8 and held.reserved_bytes == 8 * own
    # Another client's Generate is admitted beside them.
    other = run(inference, request(2))
    assert other[0].WhichOneof("event") == "start" and other[-1].WhichOneof("event") == "end"
    # Redeeming releases one at a time; a ticket is single-use.
    for i, g in enumerate(grants):
        msgs = run(inference, inference_pb2.GenerateRequest(
            token_ids=req.token_ids, max_tokens=req.max_tokens, admission_ticket=g.ticket))
        assert msgs[-1].end.usage.completion_tokens == 2
        assert admission(control).reservations == 7 - i
    assert admission(control).reserved_bytes == 0
    with pytest.raises(grpc.RpcError) as err:
        run(inference, inference_pb2.GenerateRequest(
            token_ids=req.token_ids, max_tokens=req.max_tokens,
            admission_ticket=grants[0].ticket))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(err.value).reason == "TICKET_NOT_FOUND"


def test_a_reservation_ttl_is_clamped_with_a_clear_message(stubs):
    control, _ = stubs
    resp = control.Admit(control_pb2.AdmitRequest(
        request=request(3), reserve=True, reservation_ttl=ttl(TEN_YEARS_S)))
    assert resp.ticket and resp.reservation_ttl.ToSeconds() == 300
    assert "clamped" in resp.reason and "300" in resp.reason
    left = resp.ticket_expire_time.ToSeconds() - time.time()
    assert 290 < left <= 301
    # Unset: the server default, 30 s.
    resp2 = control.Admit(control_pb2.AdmitRequest(request=request(4), reserve=True))
    assert resp2.reservation_ttl.ToSeconds() == 30
    release(stubs, (3, resp.ticket), (4, resp2.ticket))


def release(stubs, *seed_and_tickets) -> None:
    _, inference = stubs
    for seed, ticket in seed_and_tickets:
        run(inference, request(seed, admission_ticket=ticket))


def test_a_ticket_is_bound_to_its_request_and_released_by_a_generate_that_fails(stubs):
    control, inference = stubs
    t = control.Admit(control_pb2.AdmitRequest(request=request(5), reserve=True)).ticket
    assert admission(control).reservations == 1
    # Another prompt: refused, and the ticket is gone with that Generate.
    with pytest.raises(grpc.RpcError) as err:
        run(inference, request(6, admission_ticket=t))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(err.value).reason == "TICKET_MISMATCH"
    assert admission(control).reservations == 0
    # Another model: the same.
    t = control.Admit(control_pb2.AdmitRequest(request=request(5), reserve=True)).ticket
    with pytest.raises(grpc.RpcError) as err:
        run(inference, request(5, admission_ticket=t, model_id="no-such-model"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert admission(control).reservations == 0
    # A Generate with a bad field releases it too.
    t = control.Admit(control_pb2.AdmitRequest(request=request(5), reserve=True)).ticket
    bad = request(5, admission_ticket=t)
    bad.sampling.temperature = -1
    with pytest.raises(grpc.RpcError) as err:
        run(inference, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert admission(control).reservations == 0


def test_a_reservation_expires_on_time(stubs):
    control, _ = stubs
    control.Admit(control_pb2.AdmitRequest(request=request(7), reserve=True,
                                           reservation_ttl=ttl(0.3)))
    assert admission(control).reservations == 1
    time.sleep(0.5)
    held = admission(control)
    assert held.reservations == 0 and held.reserved_bytes == 0


def test_a_retried_admit_or_pin_with_a_client_request_id_does_not_duplicate(stubs):
    control, _ = stubs
    ask = control_pb2.AdmitRequest(request=request(8), reserve=True,
                                   client_request_id="retry-1")
    first, again = control.Admit(ask), control.Admit(ask)
    assert first.ticket == again.ticket
    assert admission(control).reservations == 1
    release(stubs, (8, first.ticket))
    pin = control_pb2.PinRequest(model_id="demo-tiny", owner="t", client_request_id="pin-1")
    a, b = control.Pin(pin).lease, control.Pin(pin).lease
    assert a.lease_id == b.lease_id and a.client_request_id == "pin-1"
    leases = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest()).leases
    assert [x.lease_id for x in leases if x.client_request_id == "pin-1"] == [a.lease_id]
    control.Unpin(control_pb2.UnpinRequest(lease_id=a.lease_id))


def test_model_listing_pages(stubs, demo_path):
    control, _ = stubs
    for name in ("page-b", "page-a"):
        control.LoadModel(control_pb2.LoadModelRequest(source=str(demo_path), model_id=name),
                          timeout=120)
    try:
        seen, token = [], ""
        while True:
            page = control.ListModels(control_pb2.ListModelsRequest(page_size=1,
                                                                    page_token=token))
            assert len(page.models) == 1
            seen.append(page.models[0].model_id)
            token = page.next_page_token
            if not token:
                break
        assert seen == ["demo-tiny", "page-a", "page-b"]
        everything = control.ListModels(control_pb2.ListModelsRequest())
        assert [m.model_id for m in everything.models] == seen
        assert not everything.next_page_token
        with pytest.raises(grpc.RpcError) as err:
            control.ListModels(control_pb2.ListModelsRequest(page_token="%%%"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        for name in ("page-a", "page-b"):
            control.UnloadModel(control_pb2.UnloadModelRequest(model_id=name))


def test_a_stream_cut_after_its_start_ends_with_its_usage_then_the_status(stubs, srv, demo_path):
    control, _ = stubs
    control.LoadModel(control_pb2.LoadModelRequest(source=str(demo_path), model_id="cut-me"),
                      timeout=120)
    got: list = []
    errors: list[grpc.RpcError] = []
    chunked = threading.Event()

    def stream() -> None:
        with srv.channel() as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            try:
                for m in stub.Generate(inference_pb2.GenerateRequest(
                        model_id="cut-me", text="x", max_tokens=3000, ignore_eos=True),
                        timeout=120):
                    got.append(m)
                    if m.WhichOneof("event") == "chunk":
                        chunked.set()
            except grpc.RpcError as e:
                errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    assert chunked.wait(60)
    control.UnloadModel(control_pb2.UnloadModelRequest(model_id="cut-me", force=True))
    t.join(60)
    (err,) = errors
    assert err.code() == grpc.StatusCode.ABORTED
    assert error_info(err).reason == "MODEL_UNLOADED"
    end = got[-1]
    assert end.WhichOneof("event") == "end"
    assert end.end.finish_reason == inference_pb2.FINISH_REASON_ABORTED
    sent = sum(len(m.chunk.token_ids) for m in got if m.WhichOneof("event") == "chunk")
    assert end.end.usage.completion_tokens == sent > 0
    assert end.end.usage.prompt_tokens == got[0].start.prompt_tokens


def test_status_and_samples_report_admission(stubs):
    control, _ = stubs
    t = control.Admit(control_pb2.AdmitRequest(request=request(9), reserve=True)).ticket
    call = control.WatchPressure(control_pb2.WatchPressureRequest(include_samples=True),
                                 timeout=30)
    try:
        msgs = []
        for m in call:
            msgs.append(m)
            if len(msgs) == 2:
                break
    finally:
        call.cancel()
    snap, sample = msgs[0].snapshot, msgs[1].sample
    assert snap.admission.reservations == 1 and snap.admission.reserved_bytes > 0
    assert sample.admission.reservations == 1
    assert msgs[1].sequence > msgs[0].sequence
    release(stubs, (9, t))
