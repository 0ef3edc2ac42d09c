"""SMG's MLX worker protocol (`mlx.grpc.engine.MlxEngine`) on a real Plimsoll server,
called directly over loopback with the stubs of `smg-grpc-proto`: the same answers as
plimsoll.v1 Generate, the statuses of the one error table, and the figures SMG reads.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time
import zipfile

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from smg_grpc_proto import mlx_engine_pb2 as mlx
from smg_grpc_proto import mlx_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from plimsoll.v1 import inference_pb2, inference_pb2_grpc
from tools.harness.server import serving

PROMPT = [5, 17, 99, 230, 411, 7, 64, 300]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    # One request in flight at most: the second is shed, which shows how a shed reaches
    # SMG. A fixed guard keeps the machine's other tenants from moving the level.
    with serving(tmp_path_factory.mktemp("smg-worker"), "--memory-guard-gb", "8",
                 "--max-queued-requests", "1") as srv:
        yield srv


@pytest.fixture()
def engine(worker):
    with worker.channel() as ch:
        yield mlx_engine_pb2_grpc.MlxEngineStub(ch)


def _request(stream: bool, max_tokens: int = 12, request_id: str = "r1", **sampling):
    return mlx.GenerateRequest(
        request_id=request_id, stream=stream,
        tokenized=mlx.TokenizedInput(input_ids=PROMPT),
        sampling_params=mlx.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           **sampling))


def _direct_ids(worker, max_tokens: int = 12, ignore_eos: bool = False) -> list[int]:
    with worker.channel() as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        req = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=PROMPT), max_tokens=max_tokens,
            ignore_eos=ignore_eos, sampling=inference_pb2.SamplingParams(temperature=0.0))
        return [t for r in stub.Generate(req, timeout=60) if r.HasField("chunk")
                for t in r.chunk.token_ids]


def _wait_until_idle(engine) -> None:
    # A cancelled or aborted stream frees its slot once the server has seen the end, a
    # moment after the client let go; the next test needs the one slot.
    deadline = time.monotonic() + 30
    while engine.GetServerInfo(mlx.GetServerInfoRequest(), timeout=10).active_requests:
        assert time.monotonic() < deadline, "the in-flight slot was never freed"
        time.sleep(0.05)


def test_generate_matches_plimsoll_generate_streaming_and_not(worker, engine):
    direct = _direct_ids(worker, ignore_eos=True)
    whole = list(engine.Generate(_request(False, ignore_eos=True), timeout=60))
    assert len(whole) == 1 and whole[0].HasField("complete")
    done = whole[0].complete
    assert list(done.output_ids) == direct
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
        "length", len(PROMPT), 12)
    streamed = list(engine.Generate(_request(True, ignore_eos=True), timeout=60))
    chunks = [r.chunk for r in streamed if r.HasField("chunk")]
    assert [t for c in chunks for t in c.token_ids] == direct
    # Cumulative completion counts, as SMG's own servicer sends them.
    assert chunks[-1].completion_tokens == 12 and chunks[0].prompt_tokens == len(PROMPT)
    end = streamed[-1].complete
    assert list(end.output_ids) == [] and end.completion_tokens == 12


def test_stop_token_ids_end_the_sequence_and_are_reported(worker, engine):
    direct = _direct_ids(worker, ignore_eos=True)
    stop = direct[3]
    first = direct.index(stop)
    done = next(iter(engine.Generate(
        _request(False, ignore_eos=True, stop_token_ids=[stop]), timeout=60))).complete
    # Withheld like EOS: the ids before it, then finish "stop" naming it.
    assert list(done.output_ids) == direct[:first]
    assert done.finish_reason == "stop" and done.matched_stop_token_id == stop


def test_unsupported_sampling_is_refused_naming_the_field(engine):
    with pytest.raises(grpc.RpcError) as info:
        list(engine.Generate(_request(False, frequency_penalty=0.5), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "frequency_penalty" in info.value.details()


def test_a_shed_reaches_smg_as_resource_exhausted_with_retry_info(engine):
    # The in-flight limit is 1: hold one long stream open and send a second.
    long = engine.Generate(_request(True, max_tokens=2000, request_id="long",
                                    ignore_eos=True), timeout=120)
    first = next(long)  # admitted and streaming
    assert first.HasField("chunk")
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(engine.Generate(_request(False, request_id="shed"), timeout=30))
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(err)
        kinds = {d.type_url.rsplit(".", 1)[-1]: d for d in status.details}
        info_detail = error_details_pb2.ErrorInfo()
        kinds["ErrorInfo"].Unpack(info_detail)
        assert info_detail.reason == "IN_FLIGHT_LIMIT"
        assert "RetryInfo" in kinds
    finally:
        long.cancel()
        _wait_until_idle(engine)


def test_abort_ends_a_stream_and_frees_its_slot(engine):
    stream = engine.Generate(_request(True, max_tokens=2000, request_id="to-abort",
                                      ignore_eos=True), timeout=120)
    assert next(stream).HasField("chunk")
    ended: list[str] = []

    def drain() -> None:
        try:
            ended.extend("complete" for r in stream if r.HasField("complete"))
            ended.append("ended")
        except grpc.RpcError as e:
            ended.append(e.code().name)

    reader = threading.Thread(target=drain)
    reader.start()
    engine.Abort(mlx.AbortRequest(request_ids=["to-abort"]), timeout=10)
    reader.join(30)
    # Ended early with no complete message: what SMG's own servicer does on Abort (the
    # gateway has dropped the stream by then and reads nothing more from it).
    assert not reader.is_alive()
    assert "complete" not in ended and ended[-1] in ("ended", "CANCELLED")
    # Its slot is free again (the in-flight limit is 1): a new request runs.
    _wait_until_idle(engine)
    done = next(iter(engine.Generate(_request(False, request_id="after"),
                                     timeout=30))).complete
    assert done.finish_reason in ("stop", "length")


def test_health_model_and_server_info(worker, engine, demo_path):
    health = engine.HealthCheck(mlx.HealthCheckRequest(), timeout=10)
    assert health.healthy, health.message
    assert "pressure ok" in health.message
    info = engine.GetModelInfo(mlx.GetModelInfoRequest(), timeout=10)
    assert (info.served_model_name, info.model_type, list(info.architectures)) == (
        "demo-tiny", "llama", ["LlamaForCausalLM"])
    assert (info.max_context_length, info.vocab_size, sorted(info.eos_token_ids)) == (
        4096, 1024, [2, 4])
    assert info.model_path == str(demo_path) and info.is_generation
    server = engine.GetServerInfo(mlx.GetServerInfoRequest(), timeout=10)
    assert server.server_type == "plimsoll" and server.active_requests == 0
    assert server.uptime_seconds > 0


def test_tokenizer_bundle_is_a_checksummed_zip_of_the_tokenizer(engine, demo_path):
    chunks = list(engine.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = set(zf.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
        assert "model.safetensors" not in names
        assert zf.read("tokenizer.json") == (demo_path / "tokenizer.json").read_bytes()
