"""Model lifecycle over gRPC: load, serve, unload, reload; busy unloads; memory freed."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tools.harness.server import serving, start_server


@pytest.fixture(scope="module")
def lifecycle_server(tmp_path_factory, demo_path):
    with serving(tmp_path_factory.mktemp("models")) as srv:
        yield srv


@pytest.fixture()
def stubs(lifecycle_server):
    with lifecycle_server.stubs() as pair:
        yield pair


def models(control) -> dict[str, control_pb2.ModelInfo]:
    return {m.model_id: m for m in control.ListModels(control_pb2.ListModelsRequest()).models}


def generate(inference, model: str, n: int = 4) -> list:
    return list(inference.Generate(inference_pb2.GenerateRequest(
        model_id=model, text="hello", max_tokens=n, ignore_eos=True), timeout=120))


def test_load_serve_unload_reload(stubs):
    control, inference = stubs
    small = ensure_demo_model("small")
    loaded = control.LoadModel(control_pb2.LoadModelRequest(source=str(small), model_id="second"),
                               timeout=300).model
    assert loaded.state == control_pb2.MODEL_STATE_READY
    assert loaded.measured_bytes > 10 * 2**20
    assert set(models(control)) == {"demo-tiny", "second"}
    assert generate(inference, "second")[-1].end.usage.completion_tokens == 4
    assert generate(inference, "demo-tiny")[-1].end.usage.completion_tokens == 4

    freed = control.UnloadModel(control_pb2.UnloadModelRequest(model_id="second")).freed_bytes
    # MLX active memory returns near its pre-load figure.
    assert freed >= 0.9 * loaded.measured_bytes, (freed, loaded.measured_bytes)
    assert models(control)["second"].state == control_pb2.MODEL_STATE_UNLOADED
    with pytest.raises(grpc.RpcError) as info:
        generate(inference, "second")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # MODEL_NOT_LOADED

    again = control.LoadModel(control_pb2.LoadModelRequest(source=str(small), model_id="second"),
                              timeout=300).model
    assert abs(again.measured_bytes - loaded.measured_bytes) < 0.1 * loaded.measured_bytes
    assert generate(inference, "second")[-1].end.usage.completion_tokens == 4
    control.UnloadModel(control_pb2.UnloadModelRequest(model_id="second"))


def test_unload_busy_model_refused_then_forced(stubs, lifecycle_server, demo_path):
    control, inference = stubs
    control.LoadModel(control_pb2.LoadModelRequest(source=str(demo_path), model_id="busy"),
                      timeout=120)
    errors: list[grpc.RpcError] = []
    started = threading.Event()

    def long_stream() -> None:
        with lifecycle_server.channel() as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            try:
                for m in stub.Generate(inference_pb2.GenerateRequest(
                        model_id="busy", text="x", max_tokens=3000, ignore_eos=True),
                        timeout=120):
                    if m.WhichOneof("event") == "chunk":
                        started.set()
            except grpc.RpcError as e:
                errors.append(e)

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    with pytest.raises(grpc.RpcError) as info:
        control.UnloadModel(control_pb2.UnloadModelRequest(model_id="busy"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    resp = control.UnloadModel(control_pb2.UnloadModelRequest(model_id="busy", force=True))
    assert resp.aborted_requests == 1
    t.join(60)
    assert len(errors) == 1
    err = errors[0]
    assert err.code() == grpc.StatusCode.ABORTED
    infos = [d for d in rpc_status.from_call(err).details
             if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    info_msg = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info_msg)
    assert info_msg.reason == "MODEL_UNLOADED"
    # The other model is unaffected.
    assert generate(inference, "demo-tiny")[-1].end.usage.completion_tokens == 4


def test_load_errors(stubs):
    control, _ = stubs
    with pytest.raises(grpc.RpcError) as info:
        control.LoadModel(control_pb2.LoadModelRequest(source=""))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        control.LoadModel(control_pb2.LoadModelRequest(source="/no/such/folder"), timeout=60)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        control.UnloadModel(control_pb2.UnloadModelRequest(model_id="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_lru_order_follows_use(stubs, demo_path):
    control, inference = stubs
    for name in ("lru-a", "lru-b"):
        control.LoadModel(control_pb2.LoadModelRequest(source=str(demo_path), model_id=name),
                          timeout=120)
    generate(inference, "lru-b")
    time.sleep(0.01)
    generate(inference, "lru-a")
    ms = models(control)
    assert ms["lru-a"].last_used_time.ToNanoseconds() > ms["lru-b"].last_used_time.ToNanoseconds()
    for name in ("lru-a", "lru-b"):
        control.UnloadModel(control_pb2.UnloadModelRequest(model_id=name))


def test_repository_id_takes_the_download_path(stubs):
    """No network here: the real huggingface_hub path fails fast with UNAVAILABLE."""
    control, _ = stubs
    with pytest.raises(grpc.RpcError) as info:
        control.LoadModel(control_pb2.LoadModelRequest(
            source="mlx-community/Qwen3-0.6B-4bit"), timeout=120)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "mlx-community/Qwen3-0.6B-4bit" in info.value.details()


def test_serve_several_models_from_flags(tmp_path, demo_path):
    small = ensure_demo_model("small")
    srv = start_server(tmp_path, "--model", str(demo_path), "--model", str(small))
    try:
        with srv.channel() as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            inference = inference_pb2_grpc.InferenceServiceStub(ch)
            ms = models(control)
            assert set(ms) == {"tiny-v1", "small-v1"}
            assert ms["tiny-v1"].is_default and not ms["small-v1"].is_default
            assert generate(inference, "small-v1")[-1].end.usage.completion_tokens == 4
            assert generate(inference, "")[0].start.model_id == "tiny-v1"
    finally:
        srv.stop()
