"""Model keep-alive and the loaded-model limits on the real path: `plimsoll serve` with
the flags, LoadModel / Generate / Pin over gRPC loopback, the governor's own loop and real
engine threads on copies of the tiny demo model (each copy its own engine).

The load warm-up is set to 0 here: it spares a just-loaded model from idle eviction for
10 s by default (tests/unit/test_model_limits.py covers that it does), which would only
make these tests wait.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from plimsoll.v1 import control_pb2, inference_pb2
from tools.harness.server import serving

pytestmark = pytest.mark.timeout(120)

READY = control_pb2.MODEL_STATE_READY


def seconds(s: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(s * 1e9))
    return d


def models(control) -> dict[str, control_pb2.ModelInfo]:
    r = control.ListModels(control_pb2.ListModelsRequest(), timeout=10)
    return {m.model_id: m for m in r.models}


def loaded(control) -> set[str]:
    return {k for k, m in models(control).items() if m.state == READY}


def load(control, source: Path, model_id: str, keep: float | None = None):
    req = control_pb2.LoadModelRequest(source=str(source), model_id=model_id)
    if keep is not None:
        req.keep_alive.CopyFrom(seconds(keep))
    return control.LoadModel(req, timeout=60).model


def generate(inference, model_id: str, keep: float | None = None) -> None:
    req = inference_pb2.GenerateRequest(model_id=model_id, text="Once upon a time",
                                        max_tokens=2)
    if keep is not None:
        req.keep_alive.CopyFrom(seconds(keep))
    ends = [m for m in inference.Generate(req, timeout=30) if m.WhichOneof("event") == "end"]
    assert ends, "no end message"


def wait_until(cond, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_keep_alive_expires_renews_and_yields_to_pins(tmp_path, demo_path):
    with serving(tmp_path, "--model", str(demo_path), "--load-warmup", "0") as srv, \
            srv.stubs() as (control, inference):
        info = load(control, demo_path, "short", keep=1.0)
        assert info.keep_alive.ToNanoseconds() == 1_000_000_000
        assert info.HasField("expire_time")
        expire = info.expire_time.ToNanoseconds() / 1e9
        assert 0 < expire - time.time() <= 1.0
        # Used every 0.3 s for 2 s: each request renews it from its end.
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            generate(inference, "short")
            time.sleep(0.3)
        assert "short" in loaded(control)
        # Then unused: gone about a second later, by the governor's own loop.
        waited = wait_until(lambda: "short" not in loaded(control))
        assert 0.5 < waited < 5.0, waited
        gone = models(control)["short"]
        assert gone.state == control_pb2.MODEL_STATE_UNLOADED
        assert not gone.HasField("expire_time")
        # The model named at start has no keep-alive and stays.
        first = next(m for m in models(control).values() if m.is_default)
        assert first.state == READY and not first.HasField("keep_alive")

        # A pin overrides the keep-alive while held.
        load(control, demo_path, "pinned", keep=0.2)
        lease = control.Pin(control_pb2.PinRequest(model_id="pinned", owner="t"),
                            timeout=10).lease
        assert not models(control)["pinned"].HasField("expire_time")
        time.sleep(0.8)  # four times the keep-alive
        assert "pinned" in loaded(control)
        control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id), timeout=10)
        wait_until(lambda: "pinned" not in loaded(control))

        # A Generate may set it: negative keeps the model loaded.
        load(control, demo_path, "kept", keep=0.2)
        generate(inference, "kept", keep=-1)
        assert not models(control)["kept"].HasField("keep_alive")
        time.sleep(0.8)  # four times the keep-alive it was loaded with
        assert "kept" in loaded(control)


def test_the_server_default_applies_to_loadmodel_not_to_models_named_at_start(tmp_path,
                                                                           demo_path):
    with serving(tmp_path, "--model", str(demo_path), "--load-warmup", "0",
                 "--keep-alive", "0.5") as srv, srv.stubs() as (control, inference):
        load(control, demo_path, "later")
        assert models(control)["later"].keep_alive.ToNanoseconds() == 500_000_000
        wait_until(lambda: "later" not in loaded(control))
        time.sleep(1.0)
        assert len(loaded(control)) == 1  # the model named at start


def test_max_loaded_models_evicts_lru_idle_unpinned_or_refuses(tmp_path, demo_path):
    with serving(tmp_path, "--model", str(demo_path), "--load-warmup", "0",
                 "--max-loaded-models", "2") as srv, srv.stubs() as (control, inference):
        start = next(iter(loaded(control)))
        load(control, demo_path, "b")
        generate(inference, start)  # the model named at start is now the most recent
        load(control, demo_path, "c")  # b is the LRU idle one
        assert loaded(control) == {start, "c"}
        lease = control.Pin(control_pb2.PinRequest(model_id="c", owner="t"), timeout=10).lease
        generate(inference, "c")
        load(control, demo_path, "d")  # c is pinned: the start model goes, though newer
        assert loaded(control) == {"c", "d"}
        control.Pin(control_pb2.PinRequest(model_id="d", owner="t"), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            load(control, demo_path, "e")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(err.value)
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        for detail in status.details:
            if detail.Is(info.DESCRIPTOR):
                detail.Unpack(info)
            elif detail.Is(retry.DESCRIPTOR):
                detail.Unpack(retry)
        assert info.reason == "MAX_LOADED_MODELS"
        assert info.metadata["max_loaded_models"] == "2"
        assert info.metadata["evictable_models"] == "0"
        assert retry.retry_delay.seconds > 0
        assert loaded(control) == {"c", "d"}  # nothing was evicted for it
        assert "e" not in models(control)  # and no ghost entry
        control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id), timeout=10)
        load(control, demo_path, "e")
        assert loaded(control) == {"d", "e"}


def test_max_model_memory_evicts_lru_idle_models(tmp_path, demo_path):
    size = sum(f.stat().st_size for f in demo_path.glob("*.safetensors"))
    cap_gb = 2.5 * size / 2**30  # two copies fit, three do not
    with serving(tmp_path, "--model", str(demo_path), "--load-warmup", "0",
                 "--max-model-memory-gb", f"{cap_gb:.6f}") as srv, \
            srv.stubs() as (control, inference):
        start = next(iter(loaded(control)))
        load(control, demo_path, "b")
        generate(inference, start)
        load(control, demo_path, "c")
        assert loaded(control) == {start, "c"}
        total = sum(m.measured_bytes for m in models(control).values() if m.state == READY)
        assert total <= cap_gb * 2**30
