"""The server under a real memory limit: it survives with the enforcer, dies without it.

The server runs in a child memory cgroup of its own whose limit is below the
workload's naive demand. The workload, the same in both runs:

- the tiny demo model (default) serves four long concurrent generations (ignore_eos);
- four ~320 MB "medium" demo models are loaded in turn with LoadModel, back to back
  (no pause for an enforcer tick between them); the first is pinned with Pin.

The limit comes from a calibration run outside any limit: L = (baseline + 3 × medium)
/ 0.855, where baseline is the server's RSS with the tiny model after generations and
medium is the RSS one medium load adds. With the balanced tier the ceiling is the
container term 0.9 L, soft 0.81 L and hard 0.855 L, so:

- baseline + pinned + 1 medium (≈ 0.61 L) sits well below soft;
- baseline + pinned + 2 mediums (0.855 L) sits between soft and the ceiling: the
  enforcer must evict the least recently used idle medium (the pinned one and the busy
  tiny model are not candidates);
- baseline + 4 mediums (≈ 1.1 L) is the naive demand: above the limit itself, so with
  the enforcer off the kernel's OOM killer ends the server — the proof that this test
  can fail. With the enforcer on, the LoadModel pre-check must make room before the
  fourth load (no tick happens between back-to-back loads).

Then m3 is pinned as well and two more mediums are loaded, each pinned once loaded: with
nothing left to evict, LoadModel (or Pin's reload) must refuse with RESOURCE_EXHAUSTED /
MEMORY_PRESSURE and byte figures before the limit is reached; the server stays alive.

Run with ``pytest -s`` to see the figures.
"""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2, control_pb2_grpc
from tests.pressure.harness import (
    MIB,
    Ended,
    Generations,
    PressureWatcher,
    ended_from_error,
    is_typed_end,
    level_name,
    mib,
    model_file_bytes,
    rss_bytes,
    status_point,
    warm_page_cache,
)
from tools.harness.server import start_server

pytestmark = pytest.mark.timeout(240)

# (baseline + pinned + 2 mediums) / limit: the hard mark, mid-way between soft (0.81 L)
# and the ceiling (0.9 L), so the generations' own growth cannot push it out of the band.
TARGET_FRACTION = 0.855
MEDIUM_IDS = ("m0-pinned", "m1", "m2", "m3")
PINNED = MEDIUM_IDS[0]
EXTRA_IDS = ("m4", "m5")  # loaded once every medium left is pinned: cannot all fit
GENERATIONS = 4
GEN_TOKENS = 2500
LOAD_TIMEOUT_S = 120


@dataclass(frozen=True)
class Calibration:
    baseline_bytes: int  # server RSS with the tiny model, after concurrent generations
    medium_bytes: int  # RSS one medium LoadModel adds
    medium_measured_bytes: int  # ModelInfo.measured_bytes the server reports for it
    medium_file_bytes: int
    gen_seconds: float  # how long the concurrent generations took, unconstrained

    @property
    def limit_bytes(self) -> int:
        raw = (self.baseline_bytes + 3 * self.medium_bytes) / TARGET_FRACTION
        return int(math.ceil(raw / MIB)) * MIB

    @property
    def naive_demand_bytes(self) -> int:
        return self.baseline_bytes + len(MEDIUM_IDS) * self.medium_bytes

    def describe(self) -> str:
        return (
            f"calibration: baseline {mib(self.baseline_bytes)}, medium +{mib(self.medium_bytes)} "
            f"(measured_bytes {mib(self.medium_measured_bytes)}, files "
            f"{mib(self.medium_file_bytes)}), {GENERATIONS}x{GEN_TOKENS}-token tiny "
            f"generations {self.gen_seconds:.1f}s; limit {mib(self.limit_bytes)}, naive demand "
            f"{mib(self.naive_demand_bytes)}"
        )


@pytest.fixture(scope="module")
def medium_path() -> Path:
    path = ensure_demo_model("medium")
    warm_page_cache(path)  # charge model-file page cache to the test's cgroup, not the server's
    warm_page_cache(ensure_demo_model("tiny"))
    return path


@pytest.fixture(scope="module")
def calibration(tmp_path_factory, medium_path, cgroup_support) -> Calibration:
    """Measure the server outside any limit: tiny baseline and one medium's cost."""
    srv = start_server(tmp_path_factory.mktemp("calibrate"), "--no-enforcer")
    try:
        t0 = time.monotonic()
        gens = Generations(srv.address, GENERATIONS, max_tokens=GEN_TOKENS).start()
        assert gens.join(180), "calibration generations did not finish"
        gen_s = time.monotonic() - t0
        assert all(r is not None and r.code == grpc.StatusCode.OK for r in gens.results), [
            str(r) for r in gens.results
        ]
        time.sleep(0.5)
        baseline = rss_bytes(srv.proc.pid)
        with srv.channel() as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            info = control.LoadModel(
                control_pb2.LoadModelRequest(source=str(medium_path), model_id="calibrate"),
                timeout=LOAD_TIMEOUT_S,
            ).model
        time.sleep(0.5)
        medium = rss_bytes(srv.proc.pid) - baseline
    finally:
        srv.stop(9)
    cal = Calibration(baseline, medium, info.measured_bytes, model_file_bytes(medium_path), gen_s)
    print("\n" + cal.describe())
    assert medium > 100 * MIB, f"a medium load added only {mib(medium)}: calibration is off"
    return cal


# ---------------------------------------------------------------------------
# the scenario, identical with and without the enforcer


@dataclass
class Record:
    loads: dict[str, Ended | control_pb2.ModelInfo] = field(default_factory=dict)
    pin: Ended | control_pb2.PinResponse | None = None
    generations: Generations | None = None
    figures: list[str] = field(default_factory=list)
    died_during: str | None = None

    def note(self, line: str) -> None:
        self.figures.append(line)
        print(line)


def _figures(tag: str, srv, cg, control) -> str:
    parts = [f"{tag:<18}"]
    if srv.proc.poll() is None:
        try:
            parts.append(f"rss {mib(rss_bytes(srv.proc.pid))}")
        except Exception:  # noqa: BLE001 - the process may be going
            parts.append("rss ?")
    else:
        parts.append(f"server exited {srv.proc.returncode}")
    parts.append(
        f"cgroup {mib(cg.usage_bytes())} (peak {mib(cg.peak_bytes() or 0)}) {cg.oom_counters()}"
    )
    if control is not None and srv.proc.poll() is None:
        try:
            point = status_point(
                control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=5)
            )
            parts.append(f"| {point.line()}")
        except grpc.RpcError as err:
            parts.append(f"| status {err.code().name}")
    return " ".join(parts)


def run_workload(srv, cg, medium: Path, *, with_status: bool) -> Record:
    rec = Record()
    with srv.channel() as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        status_stub = control if with_status else None
        rec.note(_figures("start", srv, cg, status_stub))

        def load(model_id: str) -> bool:
            try:
                info = control.LoadModel(
                    control_pb2.LoadModelRequest(source=str(medium), model_id=model_id),
                    timeout=LOAD_TIMEOUT_S,
                ).model
                rec.loads[model_id] = info
            except grpc.RpcError as err:
                rec.loads[model_id] = ended_from_error(err)
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    # The connection dropped: give a killed server time to be reaped.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        srv.proc.wait(5)
            rec.note(_figures(f"load {model_id}", srv, cg, status_stub))
            if srv.proc.poll() is not None:
                rec.died_during = f"LoadModel {model_id}"
                return False
            return True

        if not load(PINNED):
            return rec
        try:
            rec.pin = control.Pin(
                control_pb2.PinRequest(model_id=PINNED, owner="pressure-test"), timeout=30
            )
        except grpc.RpcError as err:
            rec.pin = ended_from_error(err)
        rec.generations = Generations(srv.address, GENERATIONS, max_tokens=GEN_TOKENS).start()
        rec.generations.wait_started(60)
        rec.note(_figures("generating", srv, cg, status_stub))
        for model_id in MEDIUM_IDS[1:]:  # back to back: no pause for an enforcer tick
            if not load(model_id):
                break
    return rec


def pin_and_overload(srv, cg, medium: Path, rec: Record) -> dict[str, Ended | str]:
    """Pin m3 too, then load more mediums and pin each one that loads: with nothing left
    to evict, the pre-load check must refuse before the cgroup limit is reached.

    Returns, per extra model, "pinned" or the typed status that refused it — from
    LoadModel, or from Pin when a tick evicted the model between the two calls (it was
    the only idle non-pinned model above soft) and Pin's reload was refused.
    """
    out: dict[str, Ended | str] = {}
    with srv.channel() as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        try:
            # m3 may already be gone (see the LRU note in the test); then Pin reloads it.
            control.Pin(control_pb2.PinRequest(model_id="m3", owner="pressure-test"), timeout=60)
            out["m3 (pin)"] = "pinned"
        except grpc.RpcError as err:
            out["m3 (pin)"] = ended_from_error(err)
        for model_id in EXTRA_IDS:
            try:
                control.LoadModel(
                    control_pb2.LoadModelRequest(source=str(medium), model_id=model_id),
                    timeout=LOAD_TIMEOUT_S,
                )
                control.Pin(
                    control_pb2.PinRequest(model_id=model_id, owner="pressure-test"), timeout=60
                )
                out[model_id] = "pinned"
            except grpc.RpcError as err:
                out[model_id] = ended_from_error(err)
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        srv.proc.wait(5)
            rec.note(_figures(f"pinned, load {model_id}", srv, cg, control))
            if srv.proc.poll() is not None:
                rec.died_during = f"LoadModel {model_id} with every medium pinned"
                break
    return out


def _final_state(srv) -> dict[str, control_pb2.ModelInfo]:
    with srv.channel() as ch:
        models = (
            control_pb2_grpc.ControlServiceStub(ch)
            .ListModels(control_pb2.ListModelsRequest(), timeout=10)
            .models
        )
    return {m.model_id: m for m in models}


def _state(m: control_pb2.ModelInfo | None) -> str:
    if m is None:
        return "absent"
    return control_pb2.ModelState.Name(m.state).removeprefix("MODEL_STATE_").lower()


# ---------------------------------------------------------------------------
# the tests


def test_without_enforcer_the_server_is_oom_killed(calibration, cgroups, servers, medium_path):
    """The control run: same limit, same workload, enforcer off -> the OOM killer ends it."""
    cg = cgroups(calibration.limit_bytes)
    print(f"\n[enforcer off] {cg.describe()}\n{calibration.describe()}")
    srv = servers("--no-enforcer", cgroup=cg)
    rec = run_workload(srv, cg, medium_path, with_status=False)
    if rec.generations is not None:
        rec.generations.join(60)
    try:
        code = srv.proc.wait(30)
    except Exception:  # noqa: BLE001
        code = srv.proc.poll()
    counters = cg.oom_counters()
    print(
        f"[enforcer off] server exit code {code} during {rec.died_during}; {counters}; "
        f"loads: { {k: str(v) if isinstance(v, Ended) else 'ok' for k, v in rec.loads.items()} }"
    )
    assert code is not None, (
        f"the server survived {len(MEDIUM_IDS)} medium loads under a {mib(cg.limit_bytes)} limit "
        f"with the enforcer off: the limit does not bind, so the enforcer-on test proves "
        f"nothing.\n" + "\n".join(rec.figures)
    )
    assert code == -signal.SIGKILL, (
        f"the server exited with {code}, not SIGKILL\n{srv.log()[-3000:]}"
    )
    assert counters.oom_kill >= 1, f"SIGKILL but the cgroup's oom_kill counter is 0: {counters}"


def test_with_enforcer_the_server_survives_and_sheds(calibration, cgroups, servers, medium_path,
                                                     tmp_path):
    cg = cgroups(calibration.limit_bytes)
    print(f"\n[enforcer on] {cg.describe()}\n{calibration.describe()}")
    # Back-to-back loads make room by evicting the mediums loaded just before: no warm-up.
    srv = servers(
        "--load-warmup",
        "0",
        "--memory-guard",
        "balanced",
        "--poll-active",
        "0.5",
        "--poll-idle",
        "1",
        "--poll-empty",
        "1",
        cgroup=cg,
    )
    watcher = PressureWatcher(srv.address, include_actions=True).start()
    try:
        rec = run_workload(srv, cg, medium_path, with_status=True)
        assert srv.proc.poll() is None, (
            f"the server died ({srv.proc.returncode}) during {rec.died_during} with the "
            f"enforcer on; {cg.oom_counters()}\n"
            + "\n".join(rec.figures)
            + f"\nwatch:\n{watcher.describe()}\nlog tail:\n{srv.log()[-3000:]}"
        )

        # Let the enforcer settle (it may evict at soft a tick after the last load).
        want_unloaded = set(MEDIUM_IDS[1:3])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            models = _final_state(srv)
            unloaded = {k for k, m in models.items() if m.state == control_pb2.MODEL_STATE_UNLOADED}
            if want_unloaded <= unloaded and srv.proc.poll() is None:
                break
            time.sleep(0.25)
        with srv.channel() as ch:
            rec.note(_figures("settled", srv, cg, control_pb2_grpc.ControlServiceStub(ch)))
        extra = pin_and_overload(srv, cg, medium_path, rec)

        gens = rec.generations
        assert gens is not None
        assert gens.join(180), "generations still running after 180 s"
        rec.note(_figures("generations done", srv, cg, None))
    finally:
        time.sleep(0.3)
        watcher.stop()

    models = _final_state(srv)
    counters = cg.oom_counters()
    evicted = [a.model_id for a in watcher.actions("evict_model")]
    print(f"[enforcer on] models: { {k: (_state(m), m.pinned) for k, m in models.items()} }")
    print(f"[enforcer on] evict_model actions: {evicted}")
    print(f"[enforcer on] generations: {[str(r) for r in gens.results]}")
    print(
        f"[enforcer on] loads: { {k: str(v) if isinstance(v, Ended) else 'ok' for k, v in rec.loads.items()} }"
    )
    print(f"[enforcer on] pressure stream:\n{watcher.describe()}")
    print(f"[enforcer on] {cg.describe()} peak {mib(cg.peak_bytes() or 0)}")

    # Never OOM-killed.
    assert srv.proc.poll() is None, f"server exited {srv.proc.returncode}"
    assert counters.oom_kill == 0, f"the cgroup saw an OOM kill: {counters}"

    # Every load fitted after evictions; the pin held.
    refused = {k: str(v) for k, v in rec.loads.items() if isinstance(v, Ended)}
    assert not refused, (
        f"LoadModel refused/failed although evicting idle models makes room: {refused}"
    )
    assert not isinstance(rec.pin, Ended), f"Pin failed: {rec.pin}"
    pinned = models.get(PINNED)
    assert pinned is not None and pinned.state == control_pb2.MODEL_STATE_READY and pinned.pinned, (
        f"the pinned model is {_state(pinned)} (pinned={getattr(pinned, 'pinned', None)})"
    )
    assert PINNED not in evicted, f"the pinned model was evicted: {evicted}"

    # Idle models evicted in LRU order: m1 (oldest), then m2 (then m3, the newest, only if
    # usage stayed at soft after m2 went: see test_memory_return for why that happens).
    for mid in ("m1", "m2"):
        assert _state(models.get(mid)) == "unloaded", f"{mid} is {_state(models.get(mid))}"
    medium_evictions = [m for m in evicted if m in MEDIUM_IDS]
    assert medium_evictions[:2] == ["m1", "m2"], (
        f"evict_model actions on the WatchPressure stream should name m1 then m2 (LRU order); "
        f"got {evicted}"
    )
    firsts = [medium_evictions.index(m) for m in MEDIUM_IDS[1:] if m in medium_evictions]
    assert firsts == sorted(firsts), f"mediums not evicted in LRU order: {evicted}"
    if "m3" in medium_evictions:
        print(
            "[enforcer on] NOTE: m3 was evicted too: usage stayed above soft after m2 was "
            "evicted (memory not returned to the system; see test_memory_return)"
        )

    # A model whose Pin succeeded stays loaded: an eviction decided on a tick's snapshot
    # must not go ahead once a lease exists (LoadModel -> Pin races the soft tick here).
    pinned_gone = {
        k: _state(m)
        for k, m in models.items()
        if m.pinned and m.state != control_pb2.MODEL_STATE_READY
    }
    assert not pinned_gone, (
        f"pinned models not loaded: {pinned_gone}; evict_model actions {evicted}; "
        f"pin outcomes { {k: str(v) for k, v in extra.items()} }"
    )

    # With every medium pinned, more loads are refused with a typed LOAD_EXCEEDS_SOFT status.
    print(f"[enforcer on] pin m3, then load+pin more: { {k: str(v) for k, v in extra.items()} }")
    refusals = [v for v in extra.values() if isinstance(v, Ended)]
    assert refusals, (
        f"{len(EXTRA_IDS)} more mediums loaded and pinned with nothing evictable: the pre-load "
        f"check did not refuse ({mib(cg.limit_bytes)} limit)"
    )
    for refusal in refusals:
        assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED, str(refusal)
        assert refusal.reason == "LOAD_EXCEEDS_SOFT", str(refusal)
        figures = [v for v in refusal.metadata.values() if v.isdigit()]
        assert figures, f"the refusal's ErrorInfo metadata carries no byte figure: {refusal}"
    for model_id, outcome in extra.items():
        if outcome == "pinned":
            name = model_id.split()[0]
            assert _state(models.get(name)) == "ready" and models[name].pinned, (
                f"{name} was pinned but is {_state(models.get(name))}"
            )

    # Every request ended with a typed status.
    assert all(r is not None for r in gens.results), "a generation never ended"
    untyped = [str(r) for r in gens.results if r is not None and not is_typed_end(r)]
    assert not untyped, f"generations ended without a typed status: {untyped}"

    # The pressure stream: snapshot first, increasing sequence, transitions chained.
    assert watcher.ended is None or watcher.ended.code == grpc.StatusCode.CANCELLED, (
        f"WatchPressure ended by the server: {watcher.ended}"
    )
    problems = watcher.problems()
    assert not problems, f"WatchPressure stream problems: {problems}\n{watcher.describe()}"
    levels = [level_name(t.to_level) for t in watcher.transitions()]
    print(f"[enforcer on] transitions seen: {levels or 'none (the pre-load check kept it ok)'}")
    assert "emergency" not in levels, f"the enforcer let usage reach emergency: {levels}"
    # EnforcerAction.level is "the level when it acted": an eviction made by a soft tick
    # must say soft, in step with the transitions on the same stream.
    misleveled = watcher.misleveled_actions()
    assert not misleveled, f"actions out of step with the stream's level: {misleveled}"
