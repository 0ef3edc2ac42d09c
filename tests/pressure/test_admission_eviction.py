"""Under a real memory limit, admission evicts idle models before it refuses.

The server runs in a child memory cgroup of its own: the tiny demo model (the default)
is pinned and serves; two ~320 MB "medium" demo models are loaded and left idle
(non-pinned). The cgroup is then tightened so that the soft mark sits 8 MiB above the
server's usage (level ok) — the ceiling is the container term, the custom tier's 8 GiB
being far above — with marks at 0.945 and 0.95 of it. A 4,000-token prefill on the
pinned model projects ~70 MiB: past the hard mark, the admission threshold.

Admission must use every relief the governor has before it refuses: the MLX pool, the
session bank (empty here), then idle non-pinned models least recently used first. So
the prefill is admitted after the older idle medium is evicted, the newer one stays,
the pinned model keeps serving, and nothing is OOM-killed. (A request that even
evicting both could not fit is refused and sheds nothing: see
tests/integration/test_governor.py, where the readings are exact.)
"""

from __future__ import annotations

import math
import random
import time

import grpc
import pytest

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2
from tests.pressure.harness import (
    MIB,
    OK,
    StatusPoller,
    level_name,
    mib,
    run_generate,
    warm_page_cache,
)

pytestmark = pytest.mark.timeout(240)

START_LIMIT_BYTES = 2048 * MIB
SOFT_FRACTION = 0.945
HARD_FRACTION = 0.95
SOFT_MARGIN_BYTES = 8 * MIB
CONTAINER_RESERVE_MIN_BYTES = 64 * MIB
WINDOW_S = 1.0
PROMPT_TOKENS = 4000


def _tightened_limit(usage: int) -> tuple[int, int]:
    """(cgroup limit, expected ceiling) putting the soft mark SOFT_MARGIN above usage."""
    ceiling = int(math.ceil((usage + SOFT_MARGIN_BYTES) / SOFT_FRACTION / MIB)) * MIB
    limit = ceiling + CONTAINER_RESERVE_MIN_BYTES
    if limit * 0.10 > CONTAINER_RESERVE_MIN_BYTES:  # above 640 MiB the reserve is 10 %
        limit = int(math.ceil(ceiling / 0.9 / MIB)) * MIB
    reserve = max(CONTAINER_RESERVE_MIN_BYTES, int(limit * 0.10))
    return limit, limit - reserve


def _request(model: str, tokens: list[int]) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(model_id=model, token_ids=inference_pb2.TokenIds(ids=tokens),
                                         max_tokens=4, ignore_eos=True)


def _loaded(control) -> dict[str, control_pb2.ModelInfo]:
    models = control.ListModels(control_pb2.ListModelsRequest(), timeout=10).models
    return {m.model_id: m for m in models if m.state == control_pb2.MODEL_STATE_READY}


def test_admission_evicts_idle_models_before_it_refuses(cgroups, servers, tmp_path):
    tiny_path, medium_path = ensure_demo_model("tiny"), ensure_demo_model("medium")
    for path in (tiny_path, medium_path):
        warm_page_cache(path)  # model-file page cache is charged to the test, not the cgroup
    cg = cgroups(START_LIMIT_BYTES)
    # m1 and m2 are loaded just before admission is asked to evict one: no load warm-up.
    srv = servers("--load-warmup", "0",
                  "--memory-guard-gb", "8", "--soft-fraction", str(SOFT_FRACTION),
                  "--hard-fraction", str(HARD_FRACTION), "--poll-active", "0.25",
                  "--poll-idle", "0.5", "--poll-empty", "0.5", cgroup=cg)
    ch = srv.channel()
    control = control_pb2_grpc.ControlServiceStub(ch)
    tiny = next(m.model_id for m in control.ListModels(control_pb2.ListModelsRequest(),
                                                 timeout=30).models if m.is_default)
    for model_id in ("m1", "m2"):  # m1 first: the least recently used idle model
        control.LoadModel(control_pb2.LoadModelRequest(source=str(medium_path), model_id=model_id),
                          timeout=120)
    control.Pin(control_pb2.PinRequest(model_id=tiny, owner="admission-test"), timeout=30)
    rng = random.Random(7)
    tokens = [rng.randrange(5, 1000) for _ in range(PROMPT_TOKENS)]
    warm = run_generate(srv.address, _request(tiny, tokens[:64]))
    assert warm.ended is not None and warm.ended.code == grpc.StatusCode.OK, warm.ended
    poller = StatusPoller(srv.address, period_s=0.05).start()
    try:
        time.sleep(WINDOW_S)
        window = sorted(p.process_bytes for p in poller.points
                        if p.at > time.monotonic() - WINDOW_S)
        usage = window[len(window) // 2]
        limit, ceiling = _tightened_limit(usage)
        cg.set_limit(limit)
        at = time.monotonic()
        point = poller.wait_for(lambda p: p.ceiling_bytes == ceiling, 10, after=at)
        assert point is not None, f"the ceiling did not follow the limit {mib(limit)}"
        print(f"usage {mib(usage)}; limit {mib(limit)}: {point.line()}")
        assert point.binding_term == "container", point.line()
        assert point.level == OK, f"level {level_name(point.level)} after tightening"
        infos = _loaded(control)
        assert set(infos) == {tiny, "m1", "m2"}

        # Admit says what Generate will do: admit after shedding (an idle model).
        admit = control.Admit(control_pb2.AdmitRequest(request=_request(tiny, tokens)),
                              timeout=30)
        print(f"Admit: verdict {admit.verdict} projected {mib(admit.projected_bytes)} "
              f"headroom {mib(admit.admission_headroom_bytes)} reason {admit.reason!r}")
        assert admit.verdict == control_pb2.ADMIT_VERDICT_ADMIT_AFTER_SHEDDING, admit
        turn = run_generate(srv.address, _request(tiny, tokens))
        print(f"Generate: {turn.ended}")
        assert turn.ended is not None and turn.ended.code == grpc.StatusCode.OK, (
            f"{turn.ended}\n{srv.log()[-3000:]}")
        loaded = _loaded(control)
        # Least recently used first, and as many as Admit previewed: m1 alone when its
        # bytes cover the shortfall, m1 then m2 when the projection (the prefill
        # guard's learned cost factor, measured on this run's earlier prefills) needs both.
        before = {m: infos[m].measured_bytes for m in ("m1", "m2")}
        previewed = ["m1"] if admit.shed_bytes <= before["m1"] + 16 * MIB else ["m1", "m2"]
        evicted = [m for m in ("m1", "m2") if m not in loaded]
        assert tiny in loaded and evicted == previewed, (sorted(loaded), admit.shed_bytes,
                                                         before)

    finally:
        poller.stop()
    counters = cg.oom_counters()
    assert counters.oom_kill == 0, f"the cgroup saw an OOM kill: {counters}"
    assert srv.proc.poll() is None, "the server died"
