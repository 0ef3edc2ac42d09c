"""Under a real cgroup squeeze the enforcer spills session snapshots to disk, and the
next turn restores them with the same greedy output as a cold run.

The server runs in a child memory cgroup of its own, on the tiny demo model (the
default, pinned so that the hard-mark relief cannot unload it: the test is about the
bank, not the model ladder), with `--session-disk-dir` on a temporary folder and the
seed's defaults otherwise (balanced tier, governor features on; only the poll
cadence is shortened so that a tick follows the new limit within a second).

1. Three sessions run one turn each (token-id prompts of 1,500, 2,500 and 3,000
   tokens, 8 tokens greedy, ignore_eos): the bank holds three terminal snapshots
   (1 KiB of KV per token: ~7 MiB).
2. The cgroup limit is tightened from the measured idle usage U (the median of
   GetMemoryStatus' process bytes) so that the container term of the ceiling puts U
   half-way between the hard mark (0.95 x ceiling) and the ceiling itself: at hard
   the tick shrinks the bank by usage - soft (~11 MiB here, more than the bank: all
   three entries go; `shrink_to_bytes`, idle entries, LRU first), and the bank's
   eviction hook hands the shed entries to the cold tier. Nothing calls DropSession.
   The first tick at soft clears the auxiliary caches, which returns a few MiB of
   heap and may leave usage under hard: then usage is measured and the limit set
   again (up to 4 times). The kernel limit stays over 100 MiB above the cgroup's own
   usage (its page cache of the model files is charged to the test, not the server).
   Measured here: the shrink frees ~7 MiB of snapshots but the process' usage does not
   drop (the pages are not returned to the system), so the level stays hard until the
   limit is relaxed; with nothing evictable (the model is pinned, nothing runs) the
   tick does nothing more.
3. Checks: a SHRINK_SESSIONS action on the WatchPressure stream; GetMemoryStatus'
   session_disk shows the writes and entries, ListSessions shows DISK entries for the
   sessions, and the Prometheus counters agree; the shed entries were not dropped.
4. The limit is relaxed; each session's next turn (previous prompt + its output + 3
   tokens) starts with cached_disk_tokens equal to the spilled prefix and its output
   equals a cold run of the same prompt (no session id). The server is alive and the
   cgroup's oom_kill counter is 0.

Run with ``pytest -s`` to see the figures.
"""

from __future__ import annotations

import http.client
import math
import random
import time

import grpc
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.demo_models import ensure_demo_model
from memory.levels import HARD_THRESHOLD
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2
from telemetry import names
from tests.pressure.harness import (
    EMERGENCY,
    HARD,
    MIB,
    OK,
    PressureWatcher,
    Turn,
    level_name,
    mib,
    run_generate,
    status_point,
    warm_page_cache,
)
from tools.harness.cgroup import limit_for_ceiling
from tools.harness.server import free_port

pytestmark = pytest.mark.timeout(120)

START_LIMIT_BYTES = 1024 * MIB  # while filling the bank: no pressure at all
POLL_S = "0.25"  # every cadence (active, idle, empty): the tick follows the limit fast
SESSIONS = {"c1": 1500, "c2": 2500, "c3": 3000}  # prompt tokens, oldest first
GEN_TOKENS = 8
NEW_TOKENS = 3  # appended to each session's next turn
MIN_DISTINCT = 4  # a cold output repeating one token would make "identical" prove little
# Where the idle usage sits between the hard mark and the ceiling (0: hard, 1: ceiling).
BAND_POSITION = 0.5
ATTEMPT_S = 1.5  # six ticks at the short cadence
SEED = 20250611


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 1000) for _ in range(n)]  # past the special tokens


def _request(tokens: list[int], session_id: str = "") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=tokens), max_tokens=GEN_TOKENS, ignore_eos=True,
        session_id=session_id, sampling=inference_pb2.SamplingParams(temperature=0.0))


def _scrape(port: int) -> dict[str, float]:
    """Prometheus samples by name summed over their labels, and by `name{label=value}`
    summed over the other labels."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            for k, v in s.labels.items():
                key = f"{s.name}{{{k}={v}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def _tiers(control) -> dict[str, list[tuple[int, str]]]:
    listed = control.ListSessions(control_pb2.ListSessionsRequest(), timeout=10)
    return {s.session_id: sorted((e.prefix_tokens, control_pb2.SessionTier.Name(e.tier)
                                  .removeprefix("SESSION_TIER_").lower()) for e in s.entries)
            for s in listed.sessions}


def _idle_usage(control, seconds: float = 0.6) -> int:
    points = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or len(points) < 3:
        points.append(control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(),
                                              timeout=5).readings.process_bytes)
        time.sleep(0.05)
    return sorted(points)[len(points) // 2]


def test_squeeze_spills_bank_to_disk_then_restores_identically(cgroups, servers, tmp_path):
    t0 = time.monotonic()
    tiny = ensure_demo_model("tiny")
    warm_page_cache(tiny)  # model-file page cache is charged to the test, not the cgroup
    disk = tmp_path / "disk"
    metrics_port = free_port()
    cg = cgroups(START_LIMIT_BYTES)
    srv = servers("--session-disk-dir", str(disk), "--metrics-port", str(metrics_port),
                  "--poll-active", POLL_S, "--poll-idle", POLL_S, "--poll-empty", POLL_S,
                  cgroup=cg)

    def note(line: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f}s] {line}")

    rng = random.Random(SEED)
    ch = srv.channel()
    control = control_pb2_grpc.ControlServiceStub(ch)
    watcher = None
    try:
        model = next(m.model_id for m in control.ListModels(
            control_pb2.ListModelsRequest(), timeout=30).models if m.is_default)
        control.Pin(control_pb2.PinRequest(model_id=model, owner="cold-squeeze"), timeout=30)
        note(f"server up ({model}, pinned); {cg.describe()}")

        # -- 1. fill the bank
        prompts: dict[str, list[int]] = {}
        first: dict[str, Turn] = {}
        for sid, n in SESSIONS.items():
            prompts[sid] = _tokens(rng, n)
            first[sid] = run_generate(srv.address, _request(prompts[sid], sid))
            assert first[sid].ended is not None and first[sid].ended.code == grpc.StatusCode.OK, (
                f"{sid}: {first[sid].ended}\n{srv.log()[-3000:]}")
        before = _tiers(control)
        assert all(before.get(sid) == [(len(prompts[sid]) + GEN_TOKENS, "ram")]
                   for sid in SESSIONS), before
        bank_bytes = control.ListSessions(control_pb2.ListSessionsRequest(),
                                          timeout=10).total_bytes
        note(f"bank filled: {before}, {mib(bank_bytes)}")

        # -- 2. squeeze: the idle usage between the hard mark and the ceiling
        watcher = PressureWatcher(srv.address, include_actions=True).start()
        total = psutil.virtual_memory().total
        squeezes: list[str] = []
        # The first tick at soft clears the auxiliary caches (malloc_trim: a few MiB of
        # heap go back), which may leave usage under hard: measure again and re-tighten.
        for _attempt in range(4):
            usage = _idle_usage(control)
            ceiling = usage / (HARD_THRESHOLD + BAND_POSITION * (1 - HARD_THRESHOLD))
            ceiling = int(math.ceil(ceiling / MIB)) * MIB
            limit = limit_for_ceiling(ceiling, total)
            assert cg.usage_bytes() < limit - 32 * MIB, (
                f"cgroup usage {mib(cg.usage_bytes())} too close to the new limit {mib(limit)}")
            cg.set_limit(limit)
            squeezes.append(f"usage {mib(usage)} -> limit {mib(limit)} (ceiling {mib(ceiling)})")
            note(f"squeeze: {squeezes[-1]}")
            deadline = time.monotonic() + ATTEMPT_S
            while time.monotonic() < deadline and not watcher.actions("shrink_sessions"):
                time.sleep(0.05)
            if watcher.actions("shrink_sessions"):
                break
        shrinks = watcher.actions("shrink_sessions")
        assert shrinks, (f"no SHRINK_SESSIONS action after {squeezes}\n{watcher.describe(t0)}")
        # The writes run on the tier's writer thread: wait for them to land.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=5)
            tier = status.session_disk
            if tier.writes >= len(SESSIONS) and tier.pending_writes == 0:
                break
            time.sleep(0.05)
        squeezed = status_point(status)
        tiers = _tiers(control)
        bank_after = control.ListSessions(control_pb2.ListSessionsRequest(),
                                          timeout=10).total_bytes
        metrics = _scrape(metrics_port)
        note(f"after the shrink: {squeezed.line()}")
        note(f"session_disk: writes {tier.writes} ({mib(tier.written_bytes)}) entries "
             f"{tier.entries} bytes {mib(tier.bytes)} drops {dict(tier.drops)} collected "
             f"{dict(tier.collected)}; bank (ListSessions total) {mib(bank_after)}")
        note(f"ListSessions: {tiers}")
        note(f"metrics: writes {metrics.get(names.METRIC_COLD_WRITES)} entries "
             f"{metrics.get(names.METRIC_COLD_ENTRIES)} shrinks "
             f"{metrics.get(names.METRIC_SHRINKS)} drops {metrics.get(names.METRIC_COLD_DROPS)}")
        note("shrink actions: " + "; ".join(
            f"entries={a.entries_evicted} freed={mib(a.bytes_freed)} level="
            f"{level_name(a.level)}: {a.reason}" for a in shrinks))

        # -- 3. the squeeze's evidence: shed by the enforcer, written, not dropped
        assert sum(a.entries_evicted for a in shrinks) >= len(SESSIONS), shrinks
        assert (tier.writes, tier.entries) == (len(SESSIONS), len(SESSIONS)), tier
        assert tier.bytes > 0 and tier.written_bytes == tier.bytes, tier
        assert not dict(tier.drops), f"shed entries were dropped, not spilled: {tier.drops}"
        for sid in SESSIONS:
            assert tiers.get(sid) == [(len(prompts[sid]) + GEN_TOKENS, "disk")], (sid, tiers)
        assert metrics.get(names.METRIC_COLD_WRITES) == len(SESSIONS), metrics
        assert metrics.get(names.METRIC_COLD_ENTRIES) == len(SESSIONS), metrics
        assert metrics.get(names.METRIC_COLD_DROPS, 0) == 0, metrics
        assert metrics.get(names.METRIC_SHRINKS, 0) >= 1, metrics

        # -- 4. relax, then each session's next turn restores from disk
        cg.set_limit(START_LIMIT_BYTES)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and status_point(control.GetMemoryStatus(
                control_pb2.GetMemoryStatusRequest(), timeout=5)).level != OK:
            time.sleep(0.05)
        results = []
        for sid in SESSIONS:
            nxt = prompts[sid] + first[sid].token_ids + _tokens(rng, NEW_TOKENS)
            warm = run_generate(srv.address, _request(nxt, sid))
            cold = run_generate(srv.address, _request(nxt))
            results.append((sid, warm, cold))
            note(f"{sid}: next turn {len(nxt)} tokens: {warm.ended}, cached "
                 f"{warm.cached_tokens} (disk {warm.start.cached_disk_tokens if warm.start else '-'})"
                 f"; cold run {cold.ended}; identical {warm.token_ids == cold.token_ids} "
                 f"({len(set(warm.token_ids))} distinct tokens)")
        final = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=5)
        hits = _scrape(metrics_port).get(f"{names.METRIC_SESSION_HITS}{{tier=disk}}", 0)
        note(f"end: restores {final.session_disk.restores} hits_disk "
             f"{final.session_disk.hits_disk} failures {final.session_disk.restore_failures}; "
             f"{names.METRIC_SESSION_HITS}{{tier=disk}} {hits}")
    finally:
        if watcher is not None:
            watcher.stop()
        ch.close()
        alive = srv.proc.poll() is None
        counters = cg.oom_counters()
        note(f"server {'alive' if alive else f'exited {srv.proc.returncode}'}; {cg.describe()} "
             f"peak {mib(cg.peak_bytes() or 0)}; total {time.monotonic() - t0:.1f}s")
        if watcher is not None:
            chatty = (" batch_cap ", " clear_aux_caches ")  # one per tick each
            lines = [ln for ln in watcher.describe(t0).splitlines()
                     if not any(c in ln for c in chatty)]
            print("pressure stream (without batch_cap / clear_aux_caches):\n" + "\n".join(lines))

    assert alive, f"the server died ({srv.proc.returncode}); {counters}\n{srv.log()[-3000:]}"
    assert counters.oom_kill == 0, f"the cgroup saw an OOM kill: {counters}"
    levels = [t.to_level for t in watcher.transitions()]
    assert HARD in levels and EMERGENCY not in levels, [level_name(x) for x in levels]
    for sid, warm, cold in results:
        assert warm.ended is not None and warm.ended.code == grpc.StatusCode.OK, (sid, warm.ended)
        assert cold.ended is not None and cold.ended.code == grpc.StatusCode.OK, (sid, cold.ended)
        spilled = len(prompts[sid]) + GEN_TOKENS
        assert warm.start.cached_disk_tokens == warm.start.cached_tokens == spilled, (
            f"{sid}: restored {warm.start.cached_tokens} tokens "
            f"({warm.start.cached_disk_tokens} from disk), not its {spilled}-token spill")
        assert cold.start.cached_tokens == 0, (sid, cold.start)
        assert len(set(cold.token_ids)) >= MIN_DISTINCT, (sid, cold.token_ids)  # not degenerate
        assert warm.token_ids == cold.token_ids, (sid, warm.token_ids, cold.token_ids)
    assert final.session_disk.restores == final.session_disk.hits_disk == len(SESSIONS), (
        final.session_disk)
    assert hits == len(SESSIONS), hits
    assert final.session_disk.restore_failures == 0, final.session_disk
