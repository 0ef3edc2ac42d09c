"""Bad input gets a clear status naming the field; the server keeps serving."""

from __future__ import annotations

import math
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from plimsoll.v1 import inference_pb2, inference_pb2_grpc
from tools.harness.server import serving

BIG = 3000  # beyond nothing; the tiny model's context is 4096


@pytest.fixture(scope="module")
def small_limit_server(tmp_path_factory, demo_path):
    with serving(tmp_path_factory.mktemp("badinput"), "--max-message-mb", "1") as srv:
        yield srv


@pytest.fixture()
def stub(small_limit_server):
    with small_limit_server.channel() as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch)


def failure(stub, req: inference_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=60))
    err = info.value
    field = ""
    status = rpc_status.from_call(err)
    for detail in status.details if status else []:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            field = bad.field_violations[0].field
    return err.code(), err.details(), field


def req(**kw) -> inference_pb2.GenerateRequest:
    sampling = kw.pop("sampling", {})
    r = inference_pb2.GenerateRequest(**kw)
    for k, v in sampling.items():
        setattr(r.sampling, k, v)
    return r


CASES = [
    ("no prompt", req(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("empty text", req(text="", max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "text"),
    ("empty token ids", req(token_ids=inference_pb2.TokenIds(ids=[])),
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids.ids"),
    ("max_tokens beyond context", req(text="hi", max_tokens=100_000),
     grpc.StatusCode.OUT_OF_RANGE, "max_tokens"),
    ("nan temperature", req(text="hi", sampling={"temperature": math.nan}),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ("negative temperature", req(text="hi", sampling={"temperature": -0.5}),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ("top_p zero", req(text="hi", sampling={"top_p": 0.0}),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ("top_p above one", req(text="hi", sampling={"top_p": 1.5}),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ("negative top_k", req(text="hi", sampling={"top_k": -1}),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k"),
    ("min_p one", req(text="hi", sampling={"min_p": 1.0}),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_p"),
    ("zero repetition penalty", req(text="hi", sampling={"repetition_penalty": 0.0}),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.repetition_penalty"),
    ("token id outside vocabulary", req(token_ids=inference_pb2.TokenIds(ids=[1, 10**9])),
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids.ids[1]"),
    ("prompt longer than context", req(token_ids=inference_pb2.TokenIds(ids=[5] * 5000)),
     grpc.StatusCode.OUT_OF_RANGE, "prompt"),
    ("bad chat role", req(chat=inference_pb2.ChatMessages(
        messages=[inference_pb2.ChatMessage(role="wizard", content="hi")])),
     grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].role"),
    ("oversized message", req(text="x" * (1_200_000)),
     grpc.StatusCode.OUT_OF_RANGE, "text"),
]


@pytest.mark.parametrize("name,request_,code,field", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(stub, name, request_, code, field):
    got_code, message, got_field = failure(stub, request_)
    assert got_code == code, message
    assert got_field == field, message
    assert message


def test_unknown_model_is_not_found(stub):
    code, message, _ = failure(stub, req(model_id="no-such-model", text="hi"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in message and "demo-tiny" in message


def test_bad_input_does_not_disturb_others(small_limit_server, stub):
    """A long good stream runs while every bad request fails; it completes intact."""
    out: list = []

    def good() -> None:
        with small_limit_server.channel() as ch:
            s = inference_pb2_grpc.InferenceServiceStub(ch)
            out.extend(s.Generate(req(text="steady", max_tokens=200, ignore_eos=True),
                                  timeout=120))

    t = threading.Thread(target=good)
    t.start()
    for _, r, code, _ in CASES:
        assert failure(stub, r)[0] == code
    t.join(120)
    assert out[-1].end.usage.completion_tokens == 200
    after = list(stub.Generate(req(text="still here", max_tokens=3, ignore_eos=True),
                               timeout=60))
    assert after[-1].end.usage.completion_tokens == 3
