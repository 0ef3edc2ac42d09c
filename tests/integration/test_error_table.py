"""The error table (docs/errors.md) over real gRPC, against a real server on the demo model.

Each row is a condition a client can cause without memory pressure, the RPCs that
answer it, and what they must answer: the code, google.rpc.ErrorInfo (domain
"plimsoll.dev" and the reason), RetryInfo where retrying makes sense, ResourceInfo for
what was not found, BadRequest listing every violation by its full path, and a
message with no server path, traceback or exception repr. After every error the
server still serves a Generate.

Rows that need a forced state (a waiting queue, an enforcer abort, an engine failure,
draining) run against an in-process PlimsollServer, whose parts the test can drive.
The memory-pressure rows (MEMORY_PRESSURE, RESERVATIONS_HELD, PREFILL_EXCEEDS_CEILING,
LOAD_EXCEEDS_SOFT) are exercised under tests/pressure; here the mapping of every
reason to its code and details is checked for all of them.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from engine import errors, model_engine
from engine.model_engine import EngineSettings
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from service import status
from service.assembly import ServiceSettings
from service.server import PlimsollServer, ServerConfig
from tools.harness.server import ROOT, serving

DEFAULT = "demo-tiny"
SPARE = "spare"  # known, then unloaded: MODEL_NOT_LOADED
LONG = 3000  # tokens: a stream that outlives the checks made while it runs


# -- reading a status ---------------------------------------------------------------------
@dataclass
class Got:
    code: grpc.StatusCode
    message: str
    info: error_details_pb2.ErrorInfo | None
    retry: error_details_pb2.RetryInfo | None
    resource: error_details_pb2.ResourceInfo | None
    bad: error_details_pb2.BadRequest | None


def got(err: grpc.RpcError) -> Got:
    st = rpc_status.from_call(err)
    found: dict[type, object] = {}
    for detail in st.details if st else []:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo,
                    error_details_pb2.ResourceInfo, error_details_pb2.BadRequest):
            msg = cls()
            if detail.Unpack(msg):
                assert cls not in found, f"two {cls.__name__} details"
                found[cls] = msg
    return Got(err.code(), err.details() or "", found.get(error_details_pb2.ErrorInfo),
               found.get(error_details_pb2.RetryInfo),
               found.get(error_details_pb2.ResourceInfo),
               found.get(error_details_pb2.BadRequest))


def failure(call: Callable[[], object]) -> Got:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, str | bytes):
            list(result)
    return got(info.value)


_SERVER_PATHS = [p for p in {str(ROOT), str(Path.home()), tempfile.gettempdir(), sys.prefix,
                             str(Path(sys.executable).parent)} if len(p) > 1]
_PATH = re.compile(r"(?:^|[\s'\"(=:,])(~?/[^\s'\",;)]*)")


def assert_clean(message: str, *given: str) -> None:
    """No server file-system path, traceback or exception repr; what the client itself
    sent (`given`, e.g. its source) may be quoted."""
    text = message
    for g in sorted(given, key=len, reverse=True):
        text = text.replace(g, "<given>")
    assert message, "an empty message"
    for bad in ("Traceback", "Error(", "Exception", "File \"", ".py", "site-packages"):
        assert bad not in text, f"{bad!r} in {message!r}"
    for p in _SERVER_PATHS:
        assert p not in text, f"server path {p!r} in {message!r}"
    assert not _PATH.search(text), f"a path in {message!r}"


def check(g: Got, code: grpc.StatusCode, reason: str, *, retry: bool,
          resource: tuple[str, str] | None = None, fields: list[str] | None = None,
          given: tuple[str, ...] = ()) -> None:
    where = f"{g.code.name} {g.message!r}"
    assert g.code == code, where
    assert g.info is not None, f"no ErrorInfo: {where}"
    assert g.info.domain == errors.DOMAIN == "plimsoll.dev", where
    assert g.info.reason == reason, where
    assert errors.REASONS[reason] is not None
    if retry:
        assert g.retry is not None, f"no RetryInfo: {where}"
        assert g.retry.retry_delay.ToNanoseconds() >= 0
    else:
        assert g.retry is None, f"RetryInfo on {where}"
    if resource is not None:
        assert g.resource is not None, f"no ResourceInfo: {where}"
        assert (g.resource.resource_type, g.resource.resource_name) == resource, where
    if code == grpc.StatusCode.NOT_FOUND:
        assert g.resource is not None, f"NOT_FOUND without ResourceInfo: {where}"
    if fields is not None:
        assert g.bad is not None, f"no BadRequest: {where}"
        assert [v.field for v in g.bad.field_violations] == fields, where
        for v in g.bad.field_violations:
            assert v.description.startswith(v.field), v
            assert v.reason in (errors.INVALID_FIELD, errors.FIELD_OUT_OF_RANGE), v
            assert v.field in g.message, where
    elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        assert g.bad is not None and g.bad.field_violations, where
    assert_clean(g.message, *given)


def gen(text: str = "hi", model: str = "", n: int = 3, **kw) -> inference_pb2.GenerateRequest:
    sampling = kw.pop("sampling", {})
    r = inference_pb2.GenerateRequest(model_id=model, text=text, max_tokens=n, **kw)
    for k, v in sampling.items():
        setattr(r.sampling, k, v)
    return r


def still_serves(inference) -> None:
    msgs = list(inference.Generate(gen("still serving", n=3, ignore_eos=True), timeout=60))
    assert msgs[-1].end.usage.completion_tokens == 3


# -- the subprocess server and its state ----------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_path):
    with serving(tmp_path_factory.mktemp("errors"), "--memory-guard-gb", "8") as s:
        with s.stubs() as (control, _):
            control.LoadModel(control_pb2.LoadModelRequest(source=str(demo_path),
                                                           model_id=SPARE), timeout=120)
            control.UnloadModel(control_pb2.UnloadModelRequest(model_id=SPARE), timeout=60)
        yield s


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sources")
    (root / "empty").mkdir()
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{not json")
    (root / "noweights").mkdir()
    (root / "noweights" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "oddtype").mkdir()
    (root / "oddtype" / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    return {name: str(root / name) for name in ("empty", "badjson", "noweights", "oddtype")}


# Each row: (id, the call given (control, inference, folders), code, reason, retry,
# resource, fields, what the client gave that the message may quote).
ROWS = [
    # NOT_FOUND MODEL_NOT_FOUND, from every RPC that names a model.
    ("generate-unknown-model", lambda c, i, f: i.Generate(gen(model="no-such"), timeout=30),
     "NOT_FOUND", errors.MODEL_NOT_FOUND, False, ("model", "no-such"), None, ()),
    ("admit-unknown-model", lambda c, i, f: c.Admit(control_pb2.AdmitRequest(
        request=gen(model="no-such")), timeout=30),
     "NOT_FOUND", errors.MODEL_NOT_FOUND, False, ("model", "no-such"), None, ()),
    ("pin-unknown-model", lambda c, i, f: c.Pin(control_pb2.PinRequest(
        model_id="no-such", owner="t"), timeout=30),
     "NOT_FOUND", errors.MODEL_NOT_FOUND, False, ("model", "no-such"), None, ()),
    ("unload-unknown-model", lambda c, i, f: c.UnloadModel(control_pb2.UnloadModelRequest(
        model_id="no-such"), timeout=30),
     "NOT_FOUND", errors.MODEL_NOT_FOUND, False, ("model", "no-such"), None, ()),
    # FAILED_PRECONDITION MODEL_NOT_LOADED: known, unloaded, nothing loads it.
    ("generate-unloaded-model", lambda c, i, f: i.Generate(gen(model=SPARE), timeout=30),
     "FAILED_PRECONDITION", errors.MODEL_NOT_LOADED, False, ("model", SPARE), None, ()),
    ("admit-unloaded-model", lambda c, i, f: c.Admit(control_pb2.AdmitRequest(
        request=gen(model=SPARE)), timeout=30),
     "FAILED_PRECONDITION", errors.MODEL_NOT_LOADED, False, ("model", SPARE), None, ()),
    ("unload-unloaded-model", lambda c, i, f: c.UnloadModel(control_pb2.UnloadModelRequest(
        model_id=SPARE), timeout=30),
     "FAILED_PRECONDITION", errors.MODEL_NOT_LOADED, False, ("model", SPARE), None, ()),
    # LoadModel.
    ("load-id-in-use", lambda c, i, f: c.LoadModel(control_pb2.LoadModelRequest(
        source=f["empty"], model_id=DEFAULT), timeout=30),
     "ALREADY_EXISTS", errors.MODEL_ID_IN_USE, False, ("model", DEFAULT), None, ("<empty>",)),
    ("load-no-such-folder", lambda c, i, f: c.LoadModel(control_pb2.LoadModelRequest(
        source="/no/such/folder"), timeout=30),
     "NOT_FOUND", errors.SOURCE_NOT_FOUND, False, ("source", "/no/such/folder"), None,
     ("/no/such/folder",)),
    ("load-folder-without-config", lambda c, i, f: c.LoadModel(control_pb2.LoadModelRequest(
        source=f["empty"]), timeout=60),
     "FAILED_PRECONDITION", errors.LOAD_FAILED, False, ("source", "<empty>"), None,
     ("<empty>",)),
    ("load-folder-bad-config", lambda c, i, f: c.LoadModel(control_pb2.LoadModelRequest(
        source=f["badjson"]), timeout=60),
     "FAILED_PRECONDITION", errors.LOAD_FAILED, False, ("source", "<badjson>"), None,
     ("<badjson>",)),
    ("load-folder-without-weights", lambda c, i, f: c.LoadModel(
        control_pb2.LoadModelRequest(source=f["noweights"]), timeout=60),
     "FAILED_PRECONDITION", errors.LOAD_FAILED, False, ("source", "<noweights>"), None,
     ("<noweights>",)),
    ("load-folder-unknown-architecture", lambda c, i, f: c.LoadModel(
        control_pb2.LoadModelRequest(source=f["oddtype"]), timeout=60),
     "FAILED_PRECONDITION", errors.LOAD_FAILED, False, ("source", "<oddtype>"), None,
     ("<oddtype>",)),
    ("load-empty-source", lambda c, i, f: c.LoadModel(control_pb2.LoadModelRequest(
        source=""), timeout=30),
     "INVALID_ARGUMENT", errors.INVALID_FIELD, False, None, ["source"], ()),
    ("load-malformed-source", lambda c, i, f: c.LoadModel(control_pb2.LoadModelRequest(
        source="not a repo id!"), timeout=30),
     "INVALID_ARGUMENT", errors.INVALID_FIELD, False, None, ["source"], ()),
    # Leases, sessions, tickets.
    ("unpin-unknown-lease", lambda c, i, f: c.Unpin(control_pb2.UnpinRequest(
        lease_id="lease-nope"), timeout=30),
     "NOT_FOUND", errors.LEASE_NOT_FOUND, False, ("lease", "lease-nope"), None, ()),
    ("drop-unknown-session", lambda c, i, f: c.DropSession(control_pb2.DropSessionRequest(
        session_id="sess-nope"), timeout=30),
     "NOT_FOUND", errors.SESSION_NOT_FOUND, False, ("session", "sess-nope"), None, ()),
    ("generate-unknown-ticket", lambda c, i, f: i.Generate(gen(
        admission_ticket="tkt-nope"), timeout=30),
     "NOT_FOUND", errors.TICKET_NOT_FOUND, False, ("ticket", "tkt-nope"), None, ()),
    # Bad fields: every violation, by its full path.
    ("generate-many-bad-fields", lambda c, i, f: i.Generate(inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[
            inference_pb2.ChatMessage(role="user", content="hi"),
            inference_pb2.ChatMessage(role="wizard", content="hi")]),
        sampling=inference_pb2.SamplingParams(temperature=math.nan, top_p=0.0),
        stop=["ok", "fine", ""]), timeout=30),
     "INVALID_ARGUMENT", errors.INVALID_FIELD, False, None,
     ["sampling.temperature", "sampling.top_p", "stop[2]", "chat.messages[1].role"], ()),
    ("generate-out-of-range", lambda c, i, f: i.Generate(gen(n=100_000), timeout=30),
     "OUT_OF_RANGE", errors.FIELD_OUT_OF_RANGE, False, None, ["max_tokens"], ()),
    ("generate-malformed-and-out-of-range", lambda c, i, f: i.Generate(gen(
        n=100_000, sampling={"top_k": -2}), timeout=30),
     "INVALID_ARGUMENT", errors.INVALID_FIELD, False, None, ["sampling.top_k", "max_tokens"],
     ()),
    ("generate-ids-outside-vocabulary", lambda c, i, f: i.Generate(
        inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(
            ids=[1, 10**9, 2, 10**9 + 1]), max_tokens=2), timeout=30),
     "INVALID_ARGUMENT", errors.INVALID_FIELD, False, None,
     ["token_ids.ids[1]", "token_ids.ids[3]"], ()),
    ("generate-no-prompt", lambda c, i, f: i.Generate(inference_pb2.GenerateRequest(
        max_tokens=2), timeout=30),
     "INVALID_ARGUMENT", errors.INVALID_FIELD, False, None, ["prompt"], ()),
    ("admit-many-bad-fields", lambda c, i, f: c.Admit(control_pb2.AdmitRequest(
        request=gen(n=100_000, sampling={"temperature": -1.0, "min_p": 1.0},
                    stop=["", "x"])), timeout=30),
     "INVALID_ARGUMENT", errors.INVALID_FIELD, False, None,
     ["request.sampling.temperature", "request.sampling.min_p", "request.stop[0]",
      "request.max_tokens"], ()),
    ("admit-out-of-range", lambda c, i, f: c.Admit(control_pb2.AdmitRequest(
        request=gen(n=100_000)), timeout=30),
     "OUT_OF_RANGE", errors.FIELD_OUT_OF_RANGE, False, None, ["request.max_tokens"], ()),
]


def _resolve(value: str, folders: dict[str, str]) -> str:
    """"<name>" stands for the path of the test folder `name`."""
    if value.startswith("<") and value.endswith(">"):
        return folders[value[1:-1]]
    return value


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_error_table(stubs, folders, row):
    _, call, code, reason, retry, resource, fields, given = row
    control, inference = stubs
    g = failure(lambda: call(control, inference, folders))
    if resource is not None:
        resource = (resource[0], _resolve(resource[1], folders))
    check(g, grpc.StatusCode[code], reason, retry=retry, resource=resource, fields=fields,
          given=tuple(_resolve(x, folders) for x in given))
    still_serves(inference)


def test_a_repository_the_hub_cannot_serve(stubs):
    """A repository id goes to Hugging Face: offline (here) it is UNAVAILABLE
    SOURCE_UNAVAILABLE with a retry; with a network, an unknown repository is NOT_FOUND."""
    control, inference = stubs
    source = "plimsoll-tests/no-such-model-anywhere"
    g = failure(lambda: control.LoadModel(control_pb2.LoadModelRequest(source=source),
                                          timeout=120))
    if g.code == grpc.StatusCode.NOT_FOUND:
        check(g, g.code, errors.SOURCE_NOT_FOUND, retry=False, resource=("source", source),
              given=(source,))
    else:
        check(g, grpc.StatusCode.UNAVAILABLE, errors.SOURCE_UNAVAILABLE, retry=True,
              resource=("source", source), given=(source,))
        assert g.retry.retry_delay.ToNanoseconds() >= 10 * 10**9
    assert DEFAULT in {m.model_id for m in control.ListModels(
        control_pb2.ListModelsRequest()).models}
    still_serves(inference)


def test_not_loaded_says_how_to_load(stubs):
    control, inference = stubs
    g = failure(lambda: inference.Generate(gen(model=SPARE), timeout=30))
    assert "LoadModel" in g.message and "Pin" in g.message
    g = failure(lambda: control.LoadModel(control_pb2.LoadModelRequest(
        source="/no/such/folder"), timeout=30))
    assert "/no/such/folder" in g.message


def test_ticket_for_another_request_is_a_mismatch(stubs):
    control, inference = stubs
    admitted = control.Admit(control_pb2.AdmitRequest(request=gen("one prompt"), reserve=True),
                             timeout=30)
    assert admitted.ticket, admitted
    g = failure(lambda: inference.Generate(gen("another prompt",
                                               admission_ticket=admitted.ticket), timeout=30))
    check(g, grpc.StatusCode.FAILED_PRECONDITION, errors.TICKET_MISMATCH, retry=False)
    still_serves(inference)


def test_unloading_a_pinned_model_needs_force(stubs):
    control, inference = stubs
    lease = control.Pin(control_pb2.PinRequest(model_id=DEFAULT, owner="errors")).lease
    try:
        g = failure(lambda: control.UnloadModel(control_pb2.UnloadModelRequest(
            model_id=DEFAULT), timeout=30))
        check(g, grpc.StatusCode.FAILED_PRECONDITION, errors.MODEL_PINNED, retry=False,
              resource=("model", DEFAULT))
    finally:
        control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id))
    still_serves(inference)


class Stream:
    """A long Generate on its own thread: started once its start message came."""

    def __init__(self, srv, request: inference_pb2.GenerateRequest) -> None:
        self.started = threading.Event()
        self.messages: list = []
        self.error: grpc.RpcError | None = None
        self._channel = srv.channel()
        self._call = inference_pb2_grpc.InferenceServiceStub(self._channel).Generate(
            request, timeout=120)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for m in self._call:
                self.messages.append(m)
                self.started.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.started.set()

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(60)
        self._channel.close()


def test_busy_and_forced_unload(srv, stubs, demo_path):
    control, inference = stubs
    control.LoadModel(control_pb2.LoadModelRequest(source=str(demo_path), model_id="victim"),
                      timeout=120)
    stream = Stream(srv, gen("x", model="victim", n=LONG, ignore_eos=True))
    try:
        assert stream.started.wait(60) and stream.error is None
        g = failure(lambda: control.UnloadModel(control_pb2.UnloadModelRequest(
            model_id="victim"), timeout=30))
        check(g, grpc.StatusCode.FAILED_PRECONDITION, errors.MODEL_BUSY, retry=False,
              resource=("model", "victim"))
        control.UnloadModel(control_pb2.UnloadModelRequest(model_id="victim", force=True),
                            timeout=60)
        stream._thread.join(60)
        assert stream.error is not None
        check(got(stream.error), grpc.StatusCode.ABORTED, errors.MODEL_UNLOADED, retry=True)
    finally:
        stream.close()
    still_serves(inference)


# -- forced states, on an in-process server --------------------------------------------------
def agot(err: grpc.aio.AioRpcError) -> Got:
    return got(err)


async def afailure(call) -> Got:
    """The status of a unary call."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return agot(info.value)


async def astream_failure(call) -> Got:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [m async for m in call]
    return agot(info.value)


async def aread_failure(call) -> Got:
    """The status ending a stream already read with `read()`."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while await call.read() is not grpc.aio.EOF:
            pass
    return agot(info.value)


async def astill_serves(inference) -> None:
    msgs = [m async for m in inference.Generate(gen("still serving", n=3, ignore_eos=True))]
    assert msgs[-1].end.usage.completion_tokens == 3


async def _started(call) -> None:
    first = await call.read()
    assert first.WhichOneof("event") == "start"


async def test_forced_states(demo_path, monkeypatch):
    """Queue full, the in-flight limit, the admission timeout, an enforcer abort, an
    engine failure, memory not measured yet, draining and the drain cut."""
    config = ServerConfig(
        port=0, models=[str(demo_path)], engine=EngineSettings(max_num_seqs=1),
        drain_grace_s=0.5,
        service=ServiceSettings(scheduler_mode="hyper", admission_queue_limit=1,
                                admission_timeout_s=1.5, max_queued_requests=3))
    server = PlimsollServer(config)
    port = await server.start()
    await server.load_initial_models()
    svc = server.service
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            inference = inference_pb2_grpc.InferenceServiceStub(ch)
            control = control_pb2_grpc.ControlServiceStub(ch)

            # Hyper mode admits one request: A runs, B waits in the one-place queue.
            a = inference.Generate(gen("a", n=LONG, ignore_eos=True))
            await _started(a)
            b = asyncio.ensure_future(astream_failure(inference.Generate(gen("b", n=2))))
            for _ in range(100):
                if svc.queue.waiting:
                    break
                await asyncio.sleep(0.02)
            assert svc.queue.waiting == 1
            g = await astream_failure(inference.Generate(gen("c", n=2)))
            check(g, grpc.StatusCode.RESOURCE_EXHAUSTED, errors.QUEUE_FULL, retry=True)
            svc.pipeline.settings.max_queued_requests = 2  # A and B are in flight
            g = await astream_failure(inference.Generate(gen("d", n=2)))
            check(g, grpc.StatusCode.RESOURCE_EXHAUSTED, errors.IN_FLIGHT_LIMIT, retry=True)
            svc.pipeline.settings.max_queued_requests = 256
            g = await b  # waited 1.5 s behind A: the admission timeout, not memory
            check(g, grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ADMISSION_TIMEOUT, retry=True)

            # The enforcer aborts A (the same call its tick makes).
            (handle,) = svc.engines.handles()
            ended = await handle.abort_requests("test_abort")
            assert len(ended) == 1
            g = await aread_failure(a)
            check(g, grpc.StatusCode.ABORTED, errors.ENFORCER_ABORT, retry=True)
            await astill_serves(inference)

            # An engine failure: INTERNAL, quoting nothing of the exception.
            def boom(self, *args, **kwargs):
                raise RuntimeError("/srv/secret/mlx_lm/generate.py: KeyError('x')")

            monkeypatch.setattr(model_engine.BatchGenerator, "next", boom)
            g = await astream_failure(inference.Generate(gen("fails", n=3)))
            check(g, grpc.StatusCode.INTERNAL, errors.ENGINE_ERROR, retry=True)
            assert "secret" not in g.message and "KeyError" not in g.message
            monkeypatch.undo()
            await astill_serves(inference)

            # Memory not measured yet (no reading): Admit cannot decide.
            async def unmeasured(*args, **kwargs):
                return None

            monkeypatch.setattr(svc.governor, "admit", unmeasured)
            g = await afailure(control.Admit(control_pb2.AdmitRequest(request=gen())))
            check(g, grpc.StatusCode.UNAVAILABLE, errors.MEMORY_NOT_MEASURED, retry=True)
            monkeypatch.undo()

            # Draining: new work is refused with a retry (go to another replica).
            svc.lifecycle.draining = True
            for call in (lambda: inference.Generate(gen()),
                         lambda: control.Admit(control_pb2.AdmitRequest(request=gen())),
                         lambda: control.LoadModel(control_pb2.LoadModelRequest(
                             source=str(demo_path), model_id="late"))):
                c = call()
                g = (await astream_failure(c) if hasattr(c, "__aiter__")
                     else await afailure(c))
                check(g, grpc.StatusCode.UNAVAILABLE, errors.DRAINING, retry=True)
            svc.lifecycle.draining = False
            await astill_serves(inference)

            # The drain cut: a stream still running when the drain grace ends, and one
            # still waiting in the (hyper) admission queue behind it.
            cut = inference.Generate(gen("cut", n=LONG, ignore_eos=True))
            await _started(cut)
            queued = asyncio.ensure_future(astream_failure(inference.Generate(gen("q", n=2))))
            for _ in range(100):
                if svc.queue.waiting:
                    break
                await asyncio.sleep(0.02)
            assert svc.queue.waiting == 1
            await server.drain()
            g = await aread_failure(cut)
            check(g, grpc.StatusCode.UNAVAILABLE, errors.DRAINING, retry=True)
            g = await queued
            check(g, grpc.StatusCode.UNAVAILABLE, errors.DRAINING, retry=True)
    finally:
        await server.drain()


# -- the mapping, for every reason ----------------------------------------------------------
_CODE_OF = {
    errors.InvalidArgument: code_pb2.INVALID_ARGUMENT,
    errors.OutOfRange: code_pb2.OUT_OF_RANGE,
    errors.NotFound: code_pb2.NOT_FOUND,
    errors.AlreadyExists: code_pb2.ALREADY_EXISTS,
    errors.FailedPrecondition: code_pb2.FAILED_PRECONDITION,
    errors.Unavailable: code_pb2.UNAVAILABLE,
    errors.ResourceExhausted: code_pb2.RESOURCE_EXHAUSTED,
    errors.Aborted: code_pb2.ABORTED,
    errors.Internal: code_pb2.INTERNAL,
    errors.Unauthenticated: code_pb2.UNAUTHENTICATED,
    errors.PermissionDenied: code_pb2.PERMISSION_DENIED,
}
_RETRIED = (errors.Unavailable, errors.ResourceExhausted, errors.Aborted)


def _make(cls: type[errors.PlimsollError], reason: str) -> errors.PlimsollError:
    if issubclass(cls, errors.BadRequestError):
        return cls("x is bad", "x", reason=reason)
    if cls is errors.NotFound:
        return cls("not here", reason=reason, resource_name="id")
    if cls is errors.FailedPrecondition:
        return cls("not now", reason)
    return cls("no", reason=reason)


@pytest.mark.parametrize("reason", sorted(errors.REASONS))
def test_every_reason_maps_to_its_code_and_details(reason):
    cls = errors.REASONS[reason]
    st = status.to_status(_make(cls, reason))
    assert st.code.value[0] == _CODE_OF[cls]
    raw = status_pb2.Status.FromString(dict(st.trailing_metadata)["grpc-status-details-bin"])
    infos = [d for d in raw.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert len(infos) == 1
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    assert (info.domain, info.reason) == ("plimsoll.dev", reason)
    retry = any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in raw.details)
    assert retry == issubclass(cls, _RETRIED), reason
    if cls is errors.NotFound:
        assert any(d.Is(error_details_pb2.ResourceInfo.DESCRIPTOR) for d in raw.details)


def test_reasons_the_plans_emit_are_in_the_table():
    """The memory plans and the queue name reasons as strings (memory knows nothing of
    the service); every one must be a RESOURCE_EXHAUSTED reason of the table."""
    from memory.plans import admission
    for reason in set(admission.ERROR_REASONS.values()):
        assert errors.REASONS.get(reason) is errors.ResourceExhausted, reason


def test_unexpected_exceptions_become_internal_without_their_text():
    st = status.to_status(ValueError("/home/x/.cache/huggingface/hub: bad header"))
    assert st.code == grpc.StatusCode.INTERNAL
    assert "cache" not in st.details and "ValueError" not in st.details


def test_under_field_prefixes_every_path():
    v = errors.Violations()
    v.invalid("sampling.top_p", "sampling.top_p must be in (0, 1], got 0")
    v.out_of_range("max_tokens", "max_tokens 9 exceeds 8")
    err = errors.under_field(v.error(), "request")
    assert isinstance(err, errors.InvalidArgument)
    assert [x.field for x in err.violations] == ["request.sampling.top_p", "request.max_tokens"]
    assert [x.reason for x in err.violations] == [errors.INVALID_FIELD,
                                                  errors.FIELD_OUT_OF_RANGE]
    assert "request.sampling.top_p must be" in err.message
    unchanged = errors.NotFound("no", "model", resource_name="m")
    assert errors.under_field(unchanged, "request") is unchanged
