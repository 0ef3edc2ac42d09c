"""Governor benchmarks: the cost of one tick, and how fast a real server reacts to hard pressure.

    python -m tools.bench_enforcer                      # both parts
    python -m tools.bench_enforcer --skip-reaction      # (a) only: no server, no root
    python -m tools.bench_enforcer --skip-tick --rounds 20

(a) Tick cost, in this process: a real `memory.governor.Governor` driving the real
`memory.executor.Executor` over 8 fake engines (`tests.support.memory_fakes.FakeEngine`
in a `FakeEnginePool`) and a real `sessions.bank.SessionBank` holding 1,000 entries
(500 sessions x 2 forks, small dummy payloads with `nbytes` set, 10 % of the sessions
active), with the server's telemetry providers installed (an SDK tracer and meter,
nothing exported: the same as `plimsoll serve` by default). Every tick walks the
store-cache and batch caps of each ready engine, hands the limits to every engine and
runs the bank's upkeep (idle TTL, OS pressure guard, dynamic ceiling).

* ok: the real `MemoryReader` (real /proc, cgroup and PSI reads; it never calls MLX),
  usage far below the ceiling. Once with every engine idle and no recent MLX sample
  (the executor asks each engine for a fresh one), once with four engines busy and
  every engine holding a recent sample.
* soft and hard: `tests.support.memory_fakes.ScriptedReader` forces the pressure paths. soft: usage
  between the marks, every engine busy, so the tick clears the aux caches, re-measures,
  pauses admission and walks the caps (a steady state). hard, the whole ladder in one
  tick: clear aux caches, re-measure, shrink the bank toward soft (idle sessions first),
  ask engines for a pressure reclaim (refused, so nothing defers), evict the two least
  recently used idle models (the scripted usage drops by their measured size), re-measure
  and return to ok. Twice: with every session active (the shrink may take nothing) and
  with 10 % active (the shrink takes ~785 of the 1,000 entries). The evicted engines and
  entries are put back between ticks, untimed.

Each row is `await governor.tick()` timed with perf_counter_ns, median and p99 over N
ticks. Breakdown rows time `MemoryReader.read()` alone and `compute_limits` + the pure
plan (`tick_plan` driven by `tests.support.memory_fakes.drive`, no loop, no executor, no
telemetry) alone. Target: median <= 1 ms per tick.

(b) Reaction, against a real server (`python -m service.cli serve` as a subprocess):
from a step across the hard mark to the eviction done (the `evict_model` action on a
`WatchPressure(include_actions)` stream, which the governor publishes after the unload
returned). What the step must be, and why it is not a LoadModel:

* a LoadModel cannot cross hard on its own: the pre-load guard
  (`Governor.make_room_for_load`, the load plan) evicts idle LRU models down to the soft
  mark before the load starts, so usage never reaches hard (that is the load plan's
  reaction, not the tick's); and a finished load wakes the governor (`pool.listeners`),
  so even a load that did cross would not exercise the poll cadence;
* the step must come unannounced, the way a neighbour's allocation or a shrinking
  container does: nothing may call `governor.wake()`. The server runs in a child memory
  cgroup of this process's own (root; cgroup v1 or v2) with no limit, under a custom
  ceiling of `--ceiling-gb` (4 GiB: far above usage; custom also removes the dynamic
  term, which jitters with the page cache). Each round lowers the child's limit in one
  write so that the container term of the ceiling (limit - max(64 MiB, 10 %)) puts the
  server's current RSS at 98.5 % of it: above the hard mark (95 %), below the ceiling
  (no emergency, and the kernel reclaims nothing). The step time is the moment that
  write returns. A step whose first transition is not to hard (usage moved between the
  reading and the tick) is lifted and tried again; it is not a round.
* the cadence under test is the active one (`--poll-active 1.0`, the default): one long
  `Generate` stream runs on the tiny demo model throughout, so an engine is busy, as on
  a server serving traffic (the tiny model is pinned, so that the rounds keep it); a
  `small` demo model sits loaded and idle, least recently used: the victim. At hard the
  governor's tick evicts it (idle LRU first). Reloading the victim also opens a 2 s activity
  hint, so the cadence is 1 s either way.
* then the limit is lifted, the victim reloaded, and after a random 0.5-1.5 s (so the
  steps land at every phase of the 1 s tick) the next round steps again.

Reaction = server time of the `evict_model` action - step time (same machine, same wall
clock); split into detection (step -> the transition to hard, i.e. waiting for the next
tick) and eviction (transition -> action: the unload). Target: worst round <= 1.5 s
(one poll interval plus 0.5 s for the unload). Without root or a memory cgroup the part
prints SKIPPED and why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402

from engine.demo_models import ensure_demo_model  # noqa: E402
from memory.ceiling import compute_limits  # noqa: E402
from memory.config import MemoryConfig  # noqa: E402
from memory.executor import Executor  # noqa: E402
from memory.governor import Governor  # noqa: E402
from memory.levels import GIB, MIB, Tier, container_reserve_bytes  # noqa: E402
from memory.plans.steps import Snapshot  # noqa: E402
from memory.plans.tick import PolicyState, tick_plan  # noqa: E402
from memory.protocols import ReadingsSource  # noqa: E402
from memory.readings import MemoryReader, MlxFigures  # noqa: E402
from memory.views import RequestView  # noqa: E402
from plimsoll.v1 import (  # noqa: E402
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    types_pb2,
)
from service.convert import label as wire_label  # noqa: E402
from sessions.bank import SessionBank, SessionEntry  # noqa: E402

# The benchmark runs from a checkout, so it takes the test doubles from tests/.
from tests.support.memory_fakes import (  # noqa: E402
    FakeEngine,
    FakeEnginePool,
    ScriptedReader,
    drive,
    readings,
)
from tools.harness.cgroup import CgroupUnavailable, ChildCgroup, limit_for_ceiling  # noqa: E402
from tools.harness.report import log, percentile, ts  # noqa: E402
from tools.harness.server import ServerProcess, serving  # noqa: E402

TICK_TARGET_MS = 1.0
REACTION_TARGET_S = 1.5
N_MODELS = 8
N_ENTRIES = 1000
VOCAB = 32_000


def ms(ns: float) -> float:
    return ns / 1e6


def stats_ms(samples_ns: list[int]) -> tuple[float, float]:
    xs = [s / 1e6 for s in samples_ns]
    return statistics.median(xs), percentile(xs, 99)


# =====================================================================================
# (a) tick cost
# =====================================================================================
@dataclass
class Dummy:
    """A stand-in KV payload: the bank never looks inside."""

    nbytes: int


def make_bank(n_entries: int, active_share: float, rng: random.Random,
              on_evict=None) -> tuple[SessionBank, list[SessionEntry]]:
    """n_entries entries: n/2 named sessions with two forks each (a shared prefix of
    64-1,024 tokens, then distinct 16-512-token tails), 1-16 MiB each."""
    big = 1 << 62
    sessions = n_entries // 2
    active = frozenset(f"s{i}" for i in range(int(sessions * active_share)))
    bank = SessionBank(
        max_bytes=big, per_session_max_bytes=big, max_entries=n_entries * 2,
        per_session_max_entries=4, idle_ttl_s=None, active_sessions=lambda: active,
        on_evict=on_evict,
    )
    entries: list[SessionEntry] = []
    for s in range(sessions):
        prefix = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(64, 1024)))
        for fork in range(2):
            tail = (VOCAB + fork,) + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(16, 512)))
            nbytes = rng.randint(1, 16) * MIB
            entry = SessionEntry("m0", prefix + tail, f"s{s}", Dummy(nbytes), nbytes)
            bank.put(entry)
            entries.append(entry)
    assert bank.entry_count() == n_entries, bank.entry_count()
    return bank, entries


def make_engines(busy: int, *, sample: tuple[int, int] | None = None,
                 accept_reclaim: bool = True, measured: int = 4 * GIB) -> list[FakeEngine]:
    engines = []
    for i in range(N_MODELS):
        n = 2 if i < busy else 0
        reqs = tuple(RequestView(f"r{i}-{k}", 100.0 + k, 64 * MIB) for k in range(n))
        engines.append(FakeEngine(
            f"model-{i}", active_requests=n, requests=reqs, last_used=float(10 + i),
            measured_bytes=measured, sample=sample, accept_reclaim=accept_reclaim,
        ))
    return engines


SAMPLE = (300 * MIB, 20 * MIB)  # an engine thread's recent MLX sample (active, pool)


def make_governor(config: MemoryConfig, reader: ReadingsSource, pool: FakeEnginePool,
                  bank: SessionBank | None) -> Governor:
    """The server's wiring: one executor over the pool and the bank, one governor."""
    return Governor(config, Executor(reader, pool, bank=bank))


async def time_ticks(governor: Governor, n: int, reset=None) -> list[int]:
    out = []
    for _ in range(n):
        if reset is not None:
            reset()
        t0 = time.perf_counter_ns()
        await governor.tick()
        out.append(time.perf_counter_ns() - t0)
    return out


@dataclass
class CostRow:
    name: str
    samples_ns: list[int]
    note: str = ""
    target: bool = True  # measured against the 1 ms target

    @property
    def median_ms(self) -> float:
        return stats_ms(self.samples_ns)[0]

    @property
    def p99_ms(self) -> float:
        return stats_ms(self.samples_ns)[1]


HARD_GIB = 61.0  # custom 64 GiB: soft 54.4, hard 60.8; ok again below soft


async def hard_ladder(config: MemoryConfig, active_share: float, n: int, seed: int) -> CostRow:
    """Scripted usage just over hard, then the whole ladder in one tick.

    The bank holds about 8.5 GiB; its shrink toward soft (6.6 GiB) takes idle entries
    (the freed references land in the MLX pool, so usage does not drop). Engines refuse
    the pressure reclaim, so nothing defers. Two idle 4 GiB models are evicted (the
    scripted usage drops by their measured size): 53 GiB, ok again. What the tick took
    is put back between ticks, untimed.
    """
    evicted: list[SessionEntry] = []
    bank, _ = make_bank(N_ENTRIES, active_share, random.Random(seed + 1),
                        on_evict=lambda es, _reason: evicted.extend(es))
    engines = make_engines(4, sample=SAMPLE, accept_reclaim=False)
    pool = FakeEnginePool(*engines)
    script = ScriptedReader(readings(HARD_GIB, total_gib=128))

    def on_unload(model_id: str) -> None:
        cur = script.current
        script.current = cur.with_process_bytes(cur.process_bytes - 4 * GIB)

    pool.on_unload = on_unload
    enf = make_governor(config, script, pool, bank)
    counts: list[int] = []

    async def ticks(k: int) -> list[int]:
        out = []
        for _ in range(k):
            for e in engines:
                if e.model_id not in pool.engines:
                    pool.add(e)
            for e in evicted:
                bank.put(SessionEntry(e.model, e.tokens, e.session_id, e.payload, e.nbytes))
            evicted.clear()
            script.current = readings(HARD_GIB, total_gib=128)
            gc.collect()  # the re-put garbage is not the tick's
            t0 = time.perf_counter_ns()
            await enf.tick()
            out.append(time.perf_counter_ns() - t0)
            counts.append(len(evicted))
        return out

    await ticks(5)
    res = enf.last_result
    assert res is not None
    kinds = [type(o.action).__name__ for o in res.outcomes]
    evictions = kinds.count("EvictModel")
    assert evictions == 2 and res.level.label == "ok", (kinds, res.level)
    counts.clear()
    samples = await ticks(max(20, n // 10))
    label = (f"hard, whole ladder; {active_share:.0%} of sessions active"
             if active_share < 1 else "hard, whole ladder; every session active")
    return CostRow(
        label, samples,
        f"{res.measurements} readings, {len(res.outcomes)} actions: bank shrink took "
        f"{statistics.median(counts):.0f} entries, {evictions} model evictions, ok again",
    )


async def tick_cost(n: int, seed: int) -> list[CostRow]:
    from telemetry.setup import setup

    setup()  # the server's providers: SDK tracer and meter, nothing exported
    # The server logs at info to its stdout (a file); evictions and transitions log.
    logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"),  # noqa: SIM115
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rng = random.Random(seed)
    rows: list[CostRow] = []
    reader = MemoryReader()
    config = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=64)
    bank, _ = make_bank(N_ENTRIES, 0.10, rng)
    warm = max(20, n // 20)

    # -- ok, real reader ----------------------------------------------------------------
    for busy, sample, label in (
            (0, None, "ok, 8 idle engines (no recent sample: each asked for one)"),
            (4, SAMPLE, "ok, 4 of 8 busy (recent engine MLX samples)")):
        pool = FakeEnginePool(*make_engines(busy, sample=sample))
        enf = make_governor(config, reader, pool, bank)
        await time_ticks(enf, warm)
        res = enf.last_result
        assert res is not None and res.level.label == "ok", res
        rows.append(CostRow(label, await time_ticks(enf, n),
                            f"{res.measurements} reading, {len(res.outcomes)} actions"))

    # -- soft, scripted ---------------------------------------------------------------------
    soft = readings(57.0, total_gib=128)  # custom 64 GiB: soft 54.4, hard 60.8
    pool = FakeEnginePool(*make_engines(N_MODELS, sample=SAMPLE))
    enf = make_governor(config, ScriptedReader(soft), pool, bank)
    await time_ticks(enf, warm)
    res = enf.last_result
    assert res is not None and res.level.label == "soft", res
    rows.append(CostRow("soft, 8 busy engines (scripted readings)", await time_ticks(enf, n),
                        f"{res.measurements} readings, {len(res.outcomes)} actions"))

    # -- hard: the whole ladder --------------------------------------------------------------
    for share in (1.0, 0.10):
        rows.append(await hard_ladder(config, share, n, seed))

    # -- breakdown ------------------------------------------------------------------------
    rd: list[int] = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        r = reader.read()
        rd.append(time.perf_counter_ns() - t0)
    rows.append(CostRow("  MemoryReader.read() alone (no engine sample)", rd, target=False))

    figures = MlxFigures(*SAMPLE, at=time.monotonic())
    rd = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        reader.read(figures)
        rd.append(time.perf_counter_ns() - t0)
    rows.append(CostRow("  MemoryReader.read() alone (an engine sample)", rd, target=False))

    views = tuple(e.view() for e in make_engines(4))
    snap = Snapshot(r, views, bank.total_bytes(), bank_max_bytes=bank.max_bytes)
    lim: list[int] = []
    pol: list[int] = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        compute_limits(r, config)
        t1 = time.perf_counter_ns()
        drive(tick_plan(PolicyState(), config, 1000.0), [snap])
        t2 = time.perf_counter_ns()
        lim.append(t1 - t0)
        pol.append(t2 - t1)
    rows.append(CostRow("  compute_limits() alone", lim, target=False))
    rows.append(CostRow("  plan alone at ok (tick_plan + compute_limits, 8 views)", pol,
                        target=False))
    # And the hard ladder's pure policy, with the bank shrink and evictions answered
    # by tests.support.memory_fakes.default_outcome (no bank, no telemetry).
    hard_snaps = [Snapshot(readings(HARD_GIB, total_gib=128), views, 8 * GIB,
                           bank_max_bytes=bank.max_bytes)] * 3 + [
        Snapshot(readings(HARD_GIB - 8, total_gib=128), views, 8 * GIB,
                 bank_max_bytes=bank.max_bytes)]
    pol = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        drive(tick_plan(PolicyState(), config, 1000.0), hard_snaps)
        pol.append(time.perf_counter_ns() - t0)
    rows.append(CostRow("  plan alone at hard (fake outcomes)", pol, target=False))
    sh: list[int] = []
    for _ in range(max(20, n // 10)):
        b2, _ = make_bank(N_ENTRIES, 0.10, random.Random(seed + 2))
        target = b2.total_bytes() - int(6.6 * GIB)
        gc.collect()
        t0 = time.perf_counter_ns()
        k = b2.shrink_to_bytes(target, protect_active=True)
        sh.append(time.perf_counter_ns() - t0)
    rows.append(CostRow(f"  SessionBank.shrink_to_bytes alone ({k} of 1,000 entries)", sh,
                        target=False))
    return rows


def fmt_cost(rows: list[CostRow]) -> str:
    lines = [
        "| scenario | ticks | median (ms) | p99 (ms) | target | verdict | what one tick did |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        verdict = ("PASS" if r.median_ms <= TICK_TARGET_MS else "MISS") if r.target else ""
        target = f"≤ {TICK_TARGET_MS:g}" if r.target else ""
        lines.append(f"| {r.name.strip() if r.target else r.name.replace('  ', '↳ ', 1)} | "
                     f"{len(r.samples_ns)} | {r.median_ms:.3f} | {r.p99_ms:.3f} | {target} | "
                     f"{verdict} | {r.note} |")
    return "\n".join(lines)


# =====================================================================================
# (b) reaction against a real server
# =====================================================================================
@dataclass
class Round:
    usage: int
    limit: int
    ceiling: int
    hard: int
    t_step: float  # wall clock, after the write returned
    detect_s: float = float("nan")  # step -> transition to hard (server time)
    react_s: float = float("nan")  # step -> evict_model action (server time)
    receipt_s: float = float("nan")  # step -> action received by this client
    freed: int = 0
    tick_level: str = ""
    seen_usage: int = 0  # usage in the transition to hard
    after_level: str = "?"  # level at the end of the evicting tick
    after_usage: int = 0  # usage at the end of the evicting tick
    aborts: int = 0  # abort_requests actions in the round (the busy model's requests)
    notes: list[str] = field(default_factory=list)

    @property
    def evict_s(self) -> float:
        return self.react_s - self.detect_s


class Watch:
    """One WatchPressure(include_samples, include_actions) stream, every message kept."""

    def __init__(self, stub: control_pb2_grpc.ControlServiceStub) -> None:
        self.messages: list[tuple[float, control_pb2.WatchPressureResponse]] = []
        self.changed = asyncio.Event()
        self._call = stub.WatchPressure(
            control_pb2.WatchPressureRequest(include_samples=True, include_actions=True))
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            async for msg in self._call:
                self.messages.append((time.time(), msg))
                self.changed.set()

    async def wait_for(self, pred, since: int, timeout: float):
        deadline = time.monotonic() + timeout
        i = since
        while True:
            while i < len(self.messages):
                if pred(self.messages[i][1]):
                    return self.messages[i]
                i += 1
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)

    def close(self) -> None:
        self._call.cancel()
        self.task.cancel()


def level_name(level: int) -> str:
    return types_pb2.PressureLevel.Name(level).removeprefix("PRESSURE_LEVEL_").lower()


async def busy_loop(stub: inference_pb2_grpc.InferenceServiceStub, model: str,
                    stop: asyncio.Event, errors: list[str]) -> None:
    """Keep one Generate stream running on `model`, so the governor polls at 1 s."""
    # Long requests: each new Generate notes activity (and wakes a governor asleep for its
    # long idle interval), which would tick out of cadence.
    req = inference_pb2.GenerateRequest(model_id=model, text="busy " * 16, max_tokens=3500,
                                        ignore_eos=True)
    while not stop.is_set():
        try:
            async for _ in stub.Generate(req, timeout=120):
                if stop.is_set():
                    break
        except grpc.aio.AioRpcError as err:
            errors.append(f"{err.code().name}: {err.details()}")
            await asyncio.sleep(0.2)


async def reaction(args, cgroup: ChildCgroup, server: ServerProcess,
                   victim_path: Path) -> list[Round]:
    total = psutil.virtual_memory().total
    pid = server.proc.pid
    proc = psutil.Process(pid)
    rounds: list[Round] = []
    rng = random.Random(args.seed)
    async with grpc.aio.insecure_channel(server.address) as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        infer = inference_pb2_grpc.InferenceServiceStub(ch)
        models = (await control.ListModels(control_pb2.ListModelsRequest())).models
        busy_id = next(m.model_id for m in models if m.is_default)
        victim_id = next(m.model_id for m in models if not m.is_default)
        # The busy model is pinned: when an eviction does not bring usage down the
        # enforcer escalates, and must not unload the model the rounds depend on.
        await control.Pin(control_pb2.PinRequest(model_id=busy_id, owner="bench_enforcer"))
        watch = Watch(control)
        stop = asyncio.Event()
        errors: list[str] = []
        busy = asyncio.create_task(busy_loop(infer, busy_id, stop, errors))
        try:
            await asyncio.sleep(2.0)
            i = 0  # round 0 is a warm-up
            attempts = 0
            while len(rounds) < args.rounds and attempts < 3 * (args.rounds + 1):
                attempts += 1
                state = {m.model_id: m.state for m in
                         (await control.ListModels(control_pb2.ListModelsRequest())).models}
                if state[victim_id] != control_pb2.MODEL_STATE_READY:
                    await control.LoadModel(control_pb2.LoadModelRequest(
                        source=str(victim_path), id=victim_id))
                await asyncio.sleep(0.5 + rng.random())  # a random phase of the 1 s tick
                status = await control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest())
                waited = 0.0
                while status.level != types_pb2.PRESSURE_LEVEL_OK and waited < 10:
                    await asyncio.sleep(0.5)  # the previous round's pressure must be over
                    waited += 0.5
                    status = await control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest())
                if status.level != types_pb2.PRESSURE_LEVEL_OK:
                    log(f"  level {level_name(status.level)} 10 s after the "
                        "limit was lifted; skipping the round")
                    continue
                usage = proc.memory_info().rss  # what the reader's statm read sees
                ceiling = int(usage / args.usage_share)
                limit = limit_for_ceiling(ceiling, total)
                ceiling = limit - container_reserve_bytes(Tier.CUSTOM, total, limit)
                mark = len(watch.messages)
                cgroup.set_limit(limit)
                t_step = time.time()
                rnd = Round(usage, limit, ceiling, int(ceiling * 0.95), t_step)

                def is_hard(m) -> bool:
                    return (m.WhichOneof("event") == "transition"
                            and m.transition.to_level >= types_pb2.PRESSURE_LEVEL_HARD)

                def is_evict(m) -> bool:
                    return (m.WhichOneof("event") == "action"
                            and m.action.kind == control_pb2.ENFORCER_ACTION_KIND_EVICT_MODEL and m.action.model_id == victim_id)

                def is_sample(m) -> bool:
                    return m.WhichOneof("event") == "sample"

                def is_transition(m) -> bool:
                    return m.WhichOneof("event") == "transition"

                first = await watch.wait_for(is_transition, mark, args.timeout)
                if first is None or not is_hard(first[1]):
                    # Usage moved between this reading and the tick: the step landed
                    # below hard (soft evicts nothing here). Not a hard step: again.
                    cgroup.set_limit(None)
                    got = level_name(first[1].transition.to_level) if first else "no change"
                    log(f"  step landed at {got}, not hard (usage {usage / MIB:.0f} MiB, "
                        f"hard mark {rnd.hard / MIB:.0f} MiB); again")
                    await asyncio.sleep(1.5)
                    continue
                hard = first
                evict = await watch.wait_for(is_evict, mark, args.timeout)
                after = None
                if evict is not None:
                    # The tick's own sample comes right after its actions.
                    at = next(j for j in range(mark, len(watch.messages))
                              if watch.messages[j][1] is evict[1])
                    after = await watch.wait_for(is_sample, at, 3.0)
                    await asyncio.sleep(1.2)  # the next tick: does the enforcer escalate?
                cgroup.set_limit(None)
                if hard is not None:
                    t = hard[1].transition
                    rnd.detect_s = ts(hard[1].event_time) - t_step
                    rnd.seen_usage = t.readings.process_bytes
                    rnd.ceiling, rnd.hard = t.limits.ceiling_bytes, t.limits.hard_bytes
                    rnd.tick_level = level_name(t.to_level)
                else:
                    rnd.notes.append("no transition to hard")
                if evict is not None:
                    rnd.react_s = ts(evict[1].event_time) - t_step
                    rnd.receipt_s = evict[0] - t_step
                    rnd.freed = evict[1].action.bytes_freed
                    if evict[1].action.reason.startswith("make_room"):
                        rnd.notes.append("evicted by the load guard, not the enforcer")
                else:
                    rnd.notes.append(f"no evict_model for {victim_id} within {args.timeout} s")
                if after is not None:
                    rnd.after_level = level_name(after[1].sample.level)
                    rnd.after_usage = after[1].sample.readings.process_bytes
                end = len(watch.messages)
                if args.verbose:
                    for _recv, m in watch.messages[mark:end]:
                        kind = m.WhichOneof("event")
                        if kind == "transition":
                            what = (f"{level_name(m.transition.from_level)} -> "
                                    f"{level_name(m.transition.to_level)} "
                                    f"({m.transition.reason})")
                        elif kind == "action":
                            what = f"{wire_label(control_pb2.EnforcerActionKind, m.action.kind)} {m.action.model_id} {m.action.reason}"
                        else:
                            what = (f"level {level_name(m.sample.level)} usage "
                                    f"{m.sample.readings.process_bytes / MIB:.0f} MiB")
                        log(f"    {(ts(m.event_time) - t_step) * 1e3:+8.0f} ms {kind}: {what}")
                rnd.aborts = sum(1 for _, m in watch.messages[mark:end]
                                 if m.WhichOneof("event") == "action"
                                 and m.action.kind == control_pb2.ENFORCER_ACTION_KIND_ABORT_REQUESTS)
                i += 1
                if i == 1:
                    log(f"  warm-up round: reaction {rnd.react_s * 1e3:.0f} ms")
                else:
                    rounds.append(rnd)
                    log(f"  round {i - 1}: usage {usage / MIB:.0f} MiB, limit {limit / MIB:.0f} "
                        f"MiB, ceiling {ceiling / MIB:.0f} MiB; detect "
                        f"{rnd.detect_s * 1e3:.0f} ms, evict {rnd.evict_s * 1e3:.0f} ms, "
                        f"reaction {rnd.react_s * 1e3:.0f} ms {'; '.join(rnd.notes)}")
                await asyncio.sleep(0.3)
        finally:
            stop.set()
            busy.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await busy
            watch.close()
            with contextlib.suppress(OSError):
                cgroup.set_limit(None)
        if errors:
            log(f"  background Generate errors: {errors[:3]}")
    return rounds


def fmt_reaction(rounds: list[Round]) -> str:
    lines = [
        "| round | usage at step (MiB) | cgroup limit (MiB) | ceiling after step (MiB) | "
        "hard mark (MiB) | usage seen at hard (MiB) | detect (ms) | evict (ms) | "
        "reaction (ms) | client receipt (ms) | freed (MiB) | after the tick: level, "
        "usage (MiB) | aborts |",
        "|" + "|".join("---:" for _ in range(13)) + "|",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {r.usage / MIB:.0f} | {r.limit / MIB:.0f} | {r.ceiling / MIB:.0f} | "
            f"{r.hard / MIB:.0f} | {r.seen_usage / MIB:.0f} | {r.detect_s * 1e3:.0f} | "
            f"{r.evict_s * 1e3:.0f} | {r.react_s * 1e3:.0f} | {r.receipt_s * 1e3:.0f} | "
            f"{r.freed / MIB:.0f} | {r.after_level}, {r.after_usage / MIB:.0f} | {r.aborts} |"
        )
    return "\n".join(lines)


def summarize_reaction(rounds: list[Round]) -> tuple[str, bool]:
    def known(xs: list[float]) -> list[float]:
        return [x for x in xs if x == x]

    react = known([r.react_s for r in rounds])
    if not react or len(react) < len(rounds):
        return f"{len(rounds) - len(react)} round(s) saw no eviction — MISS", False
    detect = known([r.detect_s for r in rounds])
    evict = known([r.evict_s for r in rounds])
    worst = max(react)
    passed = worst <= REACTION_TARGET_S
    text = (
        f"reaction p50 {statistics.median(react) * 1e3:.0f} ms, max {worst * 1e3:.0f} ms "
        f"(detect p50 {statistics.median(detect) * 1e3:.0f} / max {max(detect) * 1e3:.0f} ms; "
        f"evict p50 {statistics.median(evict) * 1e3:.0f} / max {max(evict) * 1e3:.0f} ms) — "
        f"target max ≤ {REACTION_TARGET_S:g} s: {'PASS' if passed else 'MISS'}"
    )
    still = [i for i, r in enumerate(rounds, 1) if r.after_level != "ok"]
    aborted = [i for i, r in enumerate(rounds, 1) if r.aborts]
    if still:
        text += (f"\nafter the eviction usage stayed at or above soft in rounds {still}; the "
                 f"enforcer went on to abort the busy model's requests in rounds {aborted}")
    return text, passed


def run_reaction(args) -> tuple[list[Round], str] | str:
    try:
        cgroup = ChildCgroup.create()
    except CgroupUnavailable as exc:
        return f"SKIPPED: {exc}"
    tiny = ensure_demo_model("tiny")
    victim = ensure_demo_model(args.victim)
    try:
        with tempfile.TemporaryDirectory(prefix="plimsoll-bench-") as tmp:
            server_args = ["--model", str(tiny), "--model", str(victim),
                           "--memory-guard-gb", str(args.ceiling_gb),
                           "--poll-active", str(args.poll_active), "--no-session-bank"]
            log(f"starting the server in {cgroup.path} (cgroup v{cgroup.version})")
            env = dict(kv.split("=", 1) for kv in args.server_env)
            with serving(Path(tmp), *server_args, env=env, prefix=cgroup.prefix(),
                         timeout=300) as server:
                rounds = asyncio.run(reaction(args, cgroup, server, victim))
            if args.server_log:
                print(server.log()[-4000:])
    finally:
        cgroup.destroy()
    return rounds, str(cgroup.path)


# =====================================================================================
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-tick", action="store_true", help="skip (a), the tick cost")
    p.add_argument("--skip-reaction", action="store_true", help="skip (b), the reaction")
    p.add_argument("--ticks", type=int, default=2000, help="ticks per scenario (default 2000; "
                   "the hard ladder runs a tenth of that)")
    p.add_argument("--rounds", type=int, default=10, help="reaction rounds (default 10)")
    p.add_argument("--victim", default="small", help="demo size of the idle victim model "
                   "(default small)")
    p.add_argument("--ceiling-gb", type=float, default=4.0,
                   help="the server's --memory-guard-gb before each step (default 4)")
    p.add_argument("--poll-active", type=float, default=1.0,
                   help="the server's --poll-active (default 1.0, the server's default)")
    p.add_argument("--usage-share", type=float, default=0.985,
                   help="usage / ceiling right after the step (default 0.985: above the "
                   "0.95 hard mark, below the ceiling)")
    p.add_argument("--timeout", type=float, default=15.0,
                   help="seconds to wait for the eviction in a round (default 15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", action="store_true", help="print the server log's tail")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the server (repeatable), e.g. "
                   "MALLOC_MMAP_THRESHOLD_=131072")
    p.add_argument("--verbose", action="store_true",
                   help="log every WatchPressure message of each reaction round")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, "
          f"Python {platform.python_version()}")
    if not args.skip_tick:
        log("(a) tick cost")
        rows = asyncio.run(tick_cost(args.ticks, args.seed))
        print(f"\n(a) Governor tick cost — {N_MODELS} engines (fakes), SessionBank with "
              f"{N_ENTRIES:,} entries, real MemoryReader for ok rows\n")
        print(fmt_cost(rows))
        misses = [r.name.strip() for r in rows if r.target and r.median_ms > TICK_TARGET_MS]
        print(f"\ntarget: median ≤ {TICK_TARGET_MS:g} ms per tick — "
              + ("all PASS" if not misses else f"MISS: {misses}"))
    if not args.skip_reaction:
        log("(b) reaction")
        result = run_reaction(args)
        print(f"\n(b) Reaction: step across hard → evict_model done — server with demo-tiny "
              f"(pinned, busy: one Generate stream) and demo-{args.victim} (idle, LRU); "
              f"--memory-guard-gb {args.ceiling_gb:g}, --poll-active {args.poll_active:g}"
              f"{'; server env ' + ' '.join(args.server_env) if args.server_env else ''}; "
              "the step lowers the server's cgroup limit\n")
        if isinstance(result, str):
            print(result)
        else:
            rounds, path = result
            print(fmt_reaction(rounds))
            print()
            print(summarize_reaction(rounds)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
