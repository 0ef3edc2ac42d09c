"""A memory balloon next to the server drives its level ok -> soft -> hard -> ok.

The server and a balloon (`tools.balloon`) share one child memory cgroup. The balloon
does not touch the server's own usage; it eats the cgroup's headroom. The enforcer's
dynamic term is "own usage + what can still be given", and inside a container what
can still be given is the container's headroom (limit - working set), so the ceiling
falls one byte for each byte the balloon takes while the server's usage stays put:

    soft when  own >= soft_fraction x (own + headroom)
    hard when  own >= hard_fraction x (own + headroom)

With the tier's default marks (0.90/0.95) that whole ladder happens in the last few
percent of the server's own size before the cgroup is full, too close to the OOM
killer for a test; so this test sets soft_fraction 0.6 and hard_fraction 0.75 through
`--memory-config` and pins a ~320 MB medium model (own ≈ 430 MB): soft then arrives
with ~290 MB of headroom left and hard with ~140 MB.

Meanwhile the store-cache cap (`ModelInfo.store_cache_cap`, --max-num-seqs 4) must walk one
step per tick: down to 1 under pressure, back up to 4 at ok.

The scenario runs once (module fixture); the tests assert on its record. `pytest -s`
prints the figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2, control_pb2_grpc
from tests.pressure.harness import (
    CAP_FIELD,
    HARD,
    MIB,
    OK,
    SOFT,
    PressureWatcher,
    StatusPoint,
    StatusPoller,
    has_cap_field,
    level_name,
    mib,
    warm_page_cache,
)
from tools.balloon import Balloon, BalloonError
from tools.harness.cgroup import ChildCgroup, OomCounters
from tools.harness.server import ServerProcess, start_server

pytestmark = pytest.mark.timeout(240)

LIMIT_BYTES = 1536 * MIB
SOFT_FRACTION = 0.6
HARD_FRACTION = 0.75
MAX_NUM_SEQS = 4
POLL_ACTIVE_S = 0.25
POLL_IDLE_S = 0.5
SAFETY_MARGIN_BYTES = 64 * MIB  # the balloon never takes the cgroup closer than this to its limit
CROSS_BYTES = 8 * MIB  # how far past the predicted mark a step aims
MAX_STEP_BYTES = 256 * MIB
SETTLE_S = 2.5 * POLL_ACTIVE_S  # after a balloon step: long enough for two ticks


@dataclass
class BalloonRun:
    model_id: str = ""
    server_alive: bool = False
    server_exit: int | None = None
    oom: OomCounters | None = None
    balloon_error: str = ""
    steps: list[str] = field(default_factory=list)
    balloon_at_soft_mib: float | None = None
    balloon_at_hard_mib: float | None = None
    before: StatusPoint | None = None
    at_hard: StatusPoint | None = None
    after_release: StatusPoint | None = None
    cap_min_under_pressure: int | None = None
    failure: str = ""  # why the scenario stopped early
    points: list[StatusPoint] = field(default_factory=list)
    watcher: PressureWatcher | None = None
    t_release_sent: float = 0.0  # the release command was sent (memory may go from here)
    t_release: float = 0.0  # the balloon confirmed it holds nothing
    log_tail: str = ""

    def note(self, line: str) -> None:
        self.steps.append(line)
        print(line)


def _cap(point: StatusPoint, model_id: str) -> int | None:
    return point.caps.get(model_id)


def _working_set(cg: ChildCgroup) -> int:
    """The cgroup's usage less its inactive page cache (what the server should read)."""
    stat = cg.stat()
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return cg.usage_bytes() - inactive


def _drive(
    run: BalloonRun, srv: ServerProcess, cg: ChildCgroup, poller: StatusPoller, balloon: Balloon
) -> None:
    first = poller.wait_for(lambda p: True, 10)
    assert first is not None, f"GetMemoryStatus never answered: {poller.errors[-3:]}"
    run.before = first
    run.note(f"before     balloon    0 MiB | {first.line()}")

    # Grow until hard, each step aiming just past the next mark as the readings predict it
    # (the ceiling falls a byte for each byte the balloon takes), so that soft is seen on
    # the way: the soft band is ~140 MB of balloon wide here, the step's aim 8 MiB past it.
    last_step_at = time.monotonic()
    working_set = 0
    while True:
        # A point from a tick that has seen the balloon's last step (its working set),
        # so a late tick on a busy machine never makes the next step overshoot.
        point = (
            poller.wait_for(
                lambda p, ws=working_set: p.container_usage_bytes >= ws - 16 * MIB,
                10,
                after=last_step_at + SETTLE_S,
            )
            or poller.latest()
        )
        if point is None:
            run.failure = "GetMemoryStatus stopped answering while the balloon grew"
            return
        if point.level >= SOFT and run.balloon_at_soft_mib is None:
            run.balloon_at_soft_mib = balloon.held_mib
        if point.level >= HARD:
            run.balloon_at_hard_mib = balloon.held_mib
            run.at_hard = point
            run.note(f"HARD       balloon {balloon.held_mib:4.0f} MiB | {point.line()}")
            return
        mark, fraction = (
            (point.soft_bytes, SOFT_FRACTION)
            if point.level == OK
            else (point.hard_bytes, HARD_FRACTION)
        )
        need = max(0, mark - point.process_bytes) / fraction
        step = int(min(MAX_STEP_BYTES, need + CROSS_BYTES))
        room = cg.limit_bytes - cg.usage_bytes() - SAFETY_MARGIN_BYTES
        if step > room:
            run.failure = (
                f"the balloon filled the cgroup to within {mib(SAFETY_MARGIN_BYTES)} of its "
                f"{mib(cg.limit_bytes)} limit ({mib(cg.usage_bytes())} used, balloon "
                f"{balloon.held_mib:.0f} MiB) and the level is still {level_name(point.level)}: "
                f"the ceiling does not follow the container's headroom (binding term "
                f"{point.binding_term}, terms {point.terms}). The dynamic term must be "
                f"own usage + min(system available, container limit - container working set)."
            )
            return
        balloon.grow(step / MIB)
        last_step_at = time.monotonic()
        working_set = _working_set(cg)
        run.note(
            f"{level_name(point.level):<10} balloon {balloon.held_mib:4.0f} MiB "
            f"(+{step / MIB:.0f}) | cgroup {mib(cg.usage_bytes())} | {point.line()}"
        )


def _hold_and_release(run: BalloonRun, poller: StatusPoller, balloon: Balloon) -> None:
    # Hold at hard while the cap walks down (one step per 0.25 s tick: 4 -> 1 in ~1 s).
    poller.wait_for(lambda p: _cap(p, run.model_id) == 1, 6)
    time.sleep(2 * POLL_ACTIVE_S)
    held = [p for p in poller.points if p.at > (run.at_hard.at if run.at_hard else 0)]
    caps = [c for c in (_cap(p, run.model_id) for p in held) if c is not None]
    run.cap_min_under_pressure = min(caps) if caps else None
    latest = poller.latest()
    if latest is not None:
        run.note(f"held       balloon {balloon.held_mib:4.0f} MiB | {latest.line()}")

    run.t_release_sent = time.monotonic()
    balloon.release()
    run.t_release = time.monotonic()
    ok = poller.wait_for(lambda p: p.level == OK, 15, after=run.t_release)
    if ok is None:
        run.failure = "the level did not return to ok within 15 s of releasing the balloon"
        return
    run.note(f"released   balloon    0 MiB | {ok.line()}")
    back = poller.wait_for(lambda p: _cap(p, run.model_id) == MAX_NUM_SEQS, 15, after=run.t_release)
    run.after_release = back or poller.latest()
    if run.after_release is not None:
        run.note(f"recovered  balloon    0 MiB | {run.after_release.line()}")


@pytest.fixture(scope="module")
def balloon_run(tmp_path_factory, cgroup_support) -> BalloonRun:
    tmp = tmp_path_factory.mktemp("balloon")
    medium = ensure_demo_model("medium")
    warm_page_cache(medium)  # model-file page cache is charged to the test, not the cgroup
    config = tmp / "memory.toml"
    config.write_text(
        f'[memory]\ntier = "balanced"\nsoft_fraction = {SOFT_FRACTION}\n'
        f"hard_fraction = {HARD_FRACTION}\n"
    )
    run = BalloonRun()
    cg = ChildCgroup.create(LIMIT_BYTES)
    srv: ServerProcess | None = None
    balloon: Balloon | None = None
    poller: StatusPoller | None = None
    try:
        print(f"\n[balloon] {cg.describe()}")
        srv = start_server(
            tmp,
            "--model",
            str(medium),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--memory-config",
            str(config),
            "--poll-active",
            str(POLL_ACTIVE_S),
            "--poll-idle",
            str(POLL_IDLE_S),
            "--poll-empty",
            str(POLL_IDLE_S),
            prefix=cg.prefix(),
        )
        with srv.channel() as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            models = control.ListModels(control_pb2.ListModelsRequest(), timeout=30).models
            run.model_id = next(m.model_id for m in models if m.is_default)
            control.Pin(
                control_pb2.PinRequest(model_id=run.model_id, owner="balloon-test"), timeout=60
            )
        run.watcher = PressureWatcher(srv.address, include_actions=True).start()
        poller = StatusPoller(srv.address, period_s=0.05).start()
        balloon = Balloon(prefix=cg.prefix(), step_mib=16, oom_score_adj=1000).start()
        try:
            _drive(run, srv, cg, poller, balloon)
            if not run.failure:
                _hold_and_release(run, poller, balloon)
        except BalloonError as exc:
            run.balloon_error = str(exc)
        time.sleep(3 * POLL_ACTIVE_S)
    finally:
        if balloon is not None:
            balloon.stop()
        if poller is not None:
            poller.stop()
            run.points = list(poller.points)
        if run.watcher is not None:
            run.watcher.stop()
        if srv is not None:
            run.server_alive = srv.proc.poll() is None
            run.server_exit = srv.proc.returncode
            run.log_tail = srv.log()[-3000:]
        run.oom = cg.oom_counters()
        print(f"[balloon] {cg.describe()} peak {mib(cg.peak_bytes() or 0)}")
        if srv is not None:
            srv.stop(9, 10)
        cg.destroy()
    if run.watcher is not None:
        print(f"[balloon] pressure stream:\n{run.watcher.describe()}")
    print(
        f"[balloon] balloon at soft {run.balloon_at_soft_mib} MiB, at hard "
        f"{run.balloon_at_hard_mib} MiB; failure: {run.failure or 'none'}; "
        f"balloon error: {run.balloon_error or 'none'}"
    )
    return run


def _alive(run: BalloonRun) -> None:
    assert run.server_alive, f"the server died ({run.server_exit}); {run.oom}\n{run.log_tail}"
    assert run.oom is not None and run.oom.oom_kill == 0, f"OOM kill in the cgroup: {run.oom}"
    assert not run.balloon_error, f"the balloon failed: {run.balloon_error}"


def test_balloon_drives_ok_soft_hard_and_back_to_ok(balloon_run: BalloonRun):
    run = balloon_run
    _alive(run)
    assert not run.failure, run.failure + "\n" + "\n".join(run.steps)
    assert run.balloon_at_soft_mib is not None and run.balloon_at_hard_mib is not None
    assert run.balloon_at_soft_mib < run.balloon_at_hard_mib, (
        "soft and hard were first seen at the same balloon size: no soft phase observed"
    )

    # The balloon moved the ceiling, not the server's own usage.
    assert run.before is not None and run.at_hard is not None
    assert run.at_hard.binding_term == "dynamic", run.at_hard.line()
    assert run.at_hard.ceiling_bytes < run.before.ceiling_bytes - 400 * MIB, (
        run.before.line(),
        run.at_hard.line(),
    )
    assert abs(run.at_hard.process_bytes - run.before.process_bytes) < 100 * MIB, (
        "the server's own usage moved with the balloon",
        run.before.line(),
        run.at_hard.line(),
    )

    # WatchPressure saw ok -> soft -> hard ... -> ok, in order, with no gap.
    watcher = run.watcher
    assert watcher is not None
    problems = watcher.problems()
    assert not problems, f"{problems}\n{watcher.describe()}"
    transitions = [
        (level_name(t.from_level), level_name(t.to_level)) for t in watcher.transitions()
    ]
    assert transitions, f"no transition on WatchPressure\n{watcher.describe()}"
    assert transitions[0] == ("ok", "soft"), transitions
    assert ("soft", "hard") in transitions, transitions
    assert transitions.index(("soft", "hard")) > 0
    assert transitions[-1][1] == "ok", transitions
    assert all("emergency" not in t for t in transitions), transitions
    # Each transition carries the readings and limits that caused it.
    hard = next(t for t in watcher.transitions() if t.to_level == HARD)
    assert hard.readings.process_bytes >= hard.limits.hard_bytes > 0, hard
    assert hard.readings.container_limit_bytes == LIMIT_BYTES, hard.readings
    assert hard.reason, "a transition should say why"
    # EnforcerAction.level is "the level when it acted": the reclaim a hard tick asks for
    # right after its soft -> hard transition must say hard.
    misleveled = watcher.misleveled_actions()
    assert not misleveled, f"actions out of step with the stream's level: {misleveled}"


def test_store_cache_cap_walks_one_step_per_poll(balloon_run: BalloonRun):
    run = balloon_run
    _alive(run)
    assert has_cap_field(), (
        f"ModelInfo has no {CAP_FIELD!r} field: the store-cache cap the enforcer walks is not "
        "observable; add it to ModelInfo (GetMemoryStatus.models / ListModels)"
    )
    assert not run.failure, run.failure + "\n" + "\n".join(run.steps)
    series = [(p.at, p.level, _cap(p, run.model_id)) for p in run.points]
    series = [(t, lvl, c) for t, lvl, c in series if c is not None]
    assert series, "no cap figure in GetMemoryStatus"
    assert series[0][2] == MAX_NUM_SEQS, f"the cap starts at {series[0][2]}, not {MAX_NUM_SEQS}"

    # Distinct consecutive values differ by exactly one: one step per tick, never a jump.
    changes = [
        (t, prev, cur, lvl)
        for (_, _, prev), (t, lvl, cur) in zip(series, series[1:], strict=False)
        if cur != prev
    ]
    jumps = [(prev, cur) for _, prev, cur, _ in changes if abs(cur - prev) != 1]
    assert not jumps, f"the cap jumped by more than one step between samples: {jumps}"
    walk = [series[0][2]] + [cur for _, _, cur, _ in changes]
    print(f"[balloon] cap walk: {walk}")
    assert run.cap_min_under_pressure == 1, (
        f"under pressure the cap only reached {run.cap_min_under_pressure} (walk {walk})"
    )
    down = walk[: walk.index(1) + 1]
    assert down == list(range(MAX_NUM_SEQS, 0, -1)), f"walk down {down}"
    assert walk[-1] == MAX_NUM_SEQS, f"the cap did not recover to {MAX_NUM_SEQS}: {walk}"
    up = walk[walk.index(1) :]
    assert up == list(range(1, MAX_NUM_SEQS + 1)), f"walk up {up}"

    # Down steps happen only under pressure, up steps only after the release at ok.
    for t, prev, cur, _lvl in changes:
        if cur < prev:
            assert t < run.t_release, "the cap walked down after the balloon was released"
        else:
            assert t > run.t_release_sent, "the cap walked up while the balloon still held"

    # The action stream reports the same walk ("store_cache_cap", reason "cap N").
    assert run.watcher is not None
    reported = [a.reason for a in run.watcher.actions("store_cache_cap") if a.model_id == run.model_id]
    if reported:
        numbers = [int(r.split()[-1]) for r in reported if r.split() and r.split()[-1].isdigit()]
        assert numbers == walk[1:], f"store_cache_cap actions {reported} vs status walk {walk}"
