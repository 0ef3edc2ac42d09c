"""Under a real memory limit, long prompts are shed with typed statuses while active
sessions keep their caches, and nothing is OOM-killed.

The server runs in a child memory cgroup of its own with two demo models, both pinned so
that no model eviction or model-level abort muddles the picture: `tiny` (the default,
1 KiB of KV per token, fast) and `small` (8 KiB of KV per token, ~20 tokens/s here).

1. Fill the SessionBank: five sessions each run one turn and leave a terminal snapshot.
   The two oldest become ACTIVE: `s1-pinned` (tiny, 4,000 tokens) through
   ControlService.Pin, and `s2-live` (small) by running a long second turn, restored
   from its snapshot, through the whole probe phase. Three idle small sessions
   (3,000 tokens, ~24 MiB each) follow, oldest first: plain LRU would take the active
   ones first, so only the protection of active sessions keeps them.
2. Tighten the cgroup: the limit is set so that the container term of the ceiling
   (limit - 64 MiB; the custom tier's 8 GiB is far above) puts the soft mark
   (0.945 x ceiling) 8 MiB above the measured usage. The hard mark (0.95 x ceiling,
   also the custom tier's prefill abort margin) is the admission threshold. The cgroup
   limit stays 64 MiB above the ceiling: a badly misjudged admission would be OOM-killed.
3. Probes, each asked of `Admit` first (dry run), then sent to `Generate`:
   - R1: a whole-context prompt (4,088 + 8 tokens) on `small`: even with every
     sheddable entry gone it stays over the ceiling -> REJECT at the ceiling /
     RESOURCE_EXHAUSTED MEMORY_PRESSURE with byte figures and RetryInfo, and nothing is
     shed for it (reusable state is not thrown away for a request refused anyway).
     The limit is then re-tightened to the usage R1's pool reclaim left behind.
   - A: a `small` prompt sized from Admit's own figures (half-way between the sizes
     that preview shedding two and three entries) -> ADMIT_AFTER_SHEDDING of two
     entries; Generate admits it and sheds at most what Admit previewed (it re-measures
     after each step and may stop sooner), idle sessions only, least recently used first.
   - R2: R1 again after A: still refused (or, if A's prefill left the level at soft,
     WAIT from Admit and a typed MEMORY_PRESSURE from Generate's bounded wait).
4. Afterwards: the pinned and the in-flight session kept their entries with the same
   bytes throughout; the live turn started from its cache (cached_tokens > 0) and stored
   a longer snapshot; the pinned session's next turn (the limit relaxed again: the
   live decode grows the heap past the probes' margin) restores its whole prefix; every
   stream ended with a typed status; no emergency, no abort; the server is alive and the
   cgroup's oom_kill counter is 0.

Run with ``pytest -s`` to see the figures (limit, ceiling, marks, bank before/after).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import grpc
import pytest

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2
from service.convert import label as wire_label
from tests.pressure.harness import (
    EMERGENCY,
    MIB,
    OK,
    BackgroundTurn,
    PressureWatcher,
    StatusPoller,
    Turn,
    is_typed_end,
    kind_label,
    level_name,
    mib,
    rss_bytes,
    run_generate,
    warm_page_cache,
)

pytestmark = pytest.mark.timeout(240)

START_LIMIT_BYTES = 1024 * MIB  # while filling the bank: no pressure at all
SOFT_FRACTION = 0.945
HARD_FRACTION = 0.95  # the admission threshold (= the custom prefill abort margin)
SOFT_MARGIN_BYTES = 8 * MIB  # usage below the soft mark once the limit is tightened
CONTAINER_RESERVE_MIN_BYTES = 64 * MIB  # memory.levels: limit - max(64 MiB, 10 % limit)
POLL_ACTIVE_S = 0.25
WINDOW_S = 1.5  # usage is the median of this many seconds of GetMemoryStatus
SETTLE_TIMEOUT_S = 8.0  # how long to wait for a window within half the soft margin

PINNED_TOKENS = 4000  # s1-pinned, on tiny: near the 4,096-token context
# The idle sessions, on small (~24 MiB of KV each). Admit previews the pool reclaim as
# freeing the pool; what Generate then measures moves by several MiB either way (seen: the
# trim returned 10-11 MiB more; once, with a 3 MiB entry, the reading came back more than
# half an entry higher and a third entry went). Entries far larger than that swing keep
# probe A's count a statement about the contract, not about the live decode's timing.
IDLE_TOKENS = 3000
LIVE_PROMPT_TOKENS = 128  # s2-live's first turn, on small
LIVE_TOKENS = 1500  # s2-live's second turn: long enough to span every probe at ~110 tok/s
LONG_TOKENS = 4088  # the refused probes, on small: with max_tokens 8, the whole context
MAX_PROBE_TOKENS = 1536  # probe A's search range
IDLE_IDS = ("s3-idle", "s4-idle", "s5-idle")  # least recently used first
PINNED_ID = "s1-pinned"
LIVE_ID = "s2-live"
SEED = 20240905


def _tokens(rng: random.Random, n: int) -> list[int]:
    # Ids 5..999: inside both vocabularies, past the special tokens 0..4.
    return [rng.randrange(5, 1000) for _ in range(n)]


def _request(model: str, tokens: list[int], max_tokens: int, session_id: str = ""):
    return inference_pb2.GenerateRequest(
        model_id=model,
        token_ids=inference_pb2.TokenIds(ids=tokens),
        max_tokens=max_tokens,
        ignore_eos=True,
        session_id=session_id,
    )


def _verdict(v: int) -> str:
    return control_pb2.AdmitVerdict.Name(v).removeprefix("ADMIT_VERDICT_").lower()


def constraint(admit: control_pb2.AdmitResponse) -> str:
    return wire_label(control_pb2.AdmitConstraint, admit.binding_constraint)


def _admit_line(r: control_pb2.AdmitResponse) -> str:
    retry = r.retry_after.seconds + r.retry_after.nanos / 1e9 if r.HasField("retry_after") else 0
    return (
        f"{_verdict(r.verdict)} projected {mib(r.projected_bytes)} headroom "
        f"{mib(r.admission_headroom_bytes)} shed {r.shed_entries} entries / {mib(r.shed_bytes)} "
        f"binding '{constraint(r)}' level {level_name(r.pressure_level)}"
        + (f" retry {retry:.1f}s" if retry else "")
    )


def _sessions(control) -> dict[str, control_pb2.SessionInfo]:
    resp = control.ListSessions(control_pb2.ListSessionsRequest(), timeout=10)
    return {s.session_id: s for s in resp.sessions}


def _bank_line(sessions: dict[str, control_pb2.SessionInfo]) -> str:
    parts = []
    for sid, s in sorted(sessions.items()):
        flags = ("P" if s.pinned else "") + ("A" if s.active else "")
        parts.append(f"{sid}={mib(s.bytes)}{'[' + flags + ']' if flags else ''}")
    total = sum(s.bytes for s in sessions.values())
    return f"{mib(total)}: " + " ".join(parts)


def _entry_bytes(s: control_pb2.SessionInfo | None) -> list[tuple[int, int]]:
    if s is None:
        return []
    return sorted((e.prefix_tokens, e.bytes) for e in s.entries)


@dataclass
class Probe:
    name: str
    model: str
    prompt_tokens: int
    admit: control_pb2.AdmitResponse | None = None
    turn: Turn | None = None
    bank_before: dict[str, control_pb2.SessionInfo] = field(default_factory=dict)
    bank_at_start: dict[str, control_pb2.SessionInfo] | None = None  # when `start` arrived
    bank_after: dict[str, control_pb2.SessionInfo] = field(default_factory=dict)

    def shed(self) -> list[str]:
        """Sessions that lost entries between the request and its start (or end)."""
        after = self.bank_at_start if self.bank_at_start is not None else self.bank_after
        return [
            sid
            for sid, s in self.bank_before.items()
            if _entry_bytes(s) != _entry_bytes(after.get(sid))
        ]


def _tightened_limit(usage: int) -> tuple[int, int]:
    """(cgroup limit, expected ceiling) putting the soft mark SOFT_MARGIN above usage."""
    ceiling = int(math.ceil((usage + SOFT_MARGIN_BYTES) / SOFT_FRACTION / MIB)) * MIB
    limit = ceiling + CONTAINER_RESERVE_MIN_BYTES
    if limit * 0.10 > CONTAINER_RESERVE_MIN_BYTES:  # above 640 MiB the reserve is 10 %
        limit = int(math.ceil(ceiling / 0.9 / MIB)) * MIB
    reserve = max(CONTAINER_RESERVE_MIN_BYTES, int(limit * 0.10))
    return limit, limit - reserve


def test_long_prompts_shed_idle_sessions_and_spare_active_ones(cgroups, servers):
    tiny_path, small_path = ensure_demo_model("tiny"), ensure_demo_model("small")
    for path in (tiny_path, small_path):
        warm_page_cache(path)  # model-file page cache is charged to the test, not the cgroup
    cg = cgroups(START_LIMIT_BYTES)
    srv = servers(
        "--memory-guard-gb",
        "8",
        "--soft-fraction",
        str(SOFT_FRACTION),
        "--hard-fraction",
        str(HARD_FRACTION),
        "--poll-active",
        str(POLL_ACTIVE_S),
        "--poll-idle",
        "0.5",
        "--poll-empty",
        "0.5",
        "--admission-timeout",
        "5",
        cgroup=cg,
    )
    t0 = time.monotonic()
    figures: list[str] = []
    problems: list[str] = []

    def note(line: str) -> None:
        figures.append(line)
        print(f"[{time.monotonic() - t0:5.1f}s] {line}")

    def check(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    rng = random.Random(SEED)
    ch = srv.channel()
    control = control_pb2_grpc.ControlServiceStub(ch)
    models = control.ListModels(control_pb2.ListModelsRequest(), timeout=30).models
    tiny = next(m.model_id for m in models if m.is_default)
    control.LoadModel(control_pb2.LoadModelRequest(source=str(small_path), model_id="small"), timeout=120)
    small = "small"
    for model_id in (tiny, small):  # never an eviction victim, never a model-level abort
        control.Pin(control_pb2.PinRequest(model_id=model_id, owner="shedding-test"), timeout=60)
    poller = StatusPoller(srv.address, period_s=0.05).start()
    watcher = PressureWatcher(srv.address, include_actions=True).start()
    turns: dict[str, Turn] = {}
    probes: list[Probe] = []
    live: BackgroundTurn | None = None
    try:
        # -- 1. fill the bank: the active sessions first, so LRU alone would take them
        prompts: dict[str, tuple[str, list[int]]] = {
            PINNED_ID: (tiny, _tokens(rng, PINNED_TOKENS)),
            LIVE_ID: (small, _tokens(rng, LIVE_PROMPT_TOKENS)),
        }
        prompts.update({sid: (small, _tokens(rng, IDLE_TOKENS)) for sid in IDLE_IDS})
        for sid, (model, tokens) in prompts.items():
            turns[sid] = run_generate(srv.address, _request(model, tokens, 8, sid))
            assert turns[sid].ended is not None and turns[sid].ended.code == grpc.StatusCode.OK, (
                f"filling {sid}: {turns[sid].ended}\n{srv.log()[-3000:]}"
            )
        pin = control.Pin(
            control_pb2.PinRequest(session_id=PINNED_ID, owner="shedding-test"), timeout=10
        ).lease
        live_model, live_prompt = prompts[LIVE_ID]
        live_next = live_prompt + turns[LIVE_ID].token_ids + _tokens(rng, 8)
        live = BackgroundTurn(
            srv.address, _request(live_model, live_next, LIVE_TOKENS, LIVE_ID)
        ).start()
        assert live.wait_tokens(4, 60), f"{LIVE_ID}'s second turn never streamed: {live.turn.ended}"
        filled = _sessions(control)
        note(f"filled in {time.monotonic() - t0:.1f}s; bank {_bank_line(filled)}")
        missing = [sid for sid in prompts if sid not in filled]
        assert not missing, f"sessions not cached after their turn: {missing}"
        idle_bytes = {sid: filled[sid].bytes for sid in IDLE_IDS}
        active_before = {sid: _entry_bytes(filled[sid]) for sid in (PINNED_ID, LIVE_ID)}
        assert filled[PINNED_ID].pinned and filled[PINNED_ID].active, filled[PINNED_ID]
        assert filled[LIVE_ID].active, f"{LIVE_ID} is in flight but not active: {filled[LIVE_ID]}"

        # -- 2. tighten the cgroup so the soft mark sits SOFT_MARGIN above usage
        def tighten(label: str) -> tuple[int, int, int, int]:
            """(limit, ceiling, soft, hard) once the server's ceiling follows the limit."""
            # Right after the live turn starts, its MLX pool is still filling: usage ramps
            # by up to the pool's cap (32 MiB), more than the soft margin. Measure once a
            # whole window stays within half the margin, so the median holds still.
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while True:
                time.sleep(WINDOW_S)
                window = sorted(
                    p.process_bytes for p in poller.points if p.at > time.monotonic() - WINDOW_S
                )
                settled = window[-1] - window[0] <= SOFT_MARGIN_BYTES // 2
                if settled or time.monotonic() > deadline:
                    break
            assert settled, (
                f"usage never settled within {SETTLE_TIMEOUT_S:.0f}s: the last "
                f"{WINDOW_S}s spanned {mib(window[0])}..{mib(window[-1])}"
            )
            usage = window[len(window) // 2]  # the median: the live decode makes it swing
            limit, ceiling = _tightened_limit(usage)
            assert cg.usage_bytes() < limit - 16 * MIB, (
                f"cgroup usage {mib(cg.usage_bytes())} too close to the new limit {mib(limit)}"
            )
            before = cg.limit_bytes
            cg.set_limit(limit)
            at = time.monotonic()
            point = poller.wait_for(lambda p: p.ceiling_bytes == ceiling, 10, after=at)
            assert point is not None, (
                f"the ceiling did not follow the new cgroup limit {mib(limit)} (want "
                f"{mib(ceiling)}): {poller.latest().line() if poller.latest() else '-'}"
            )
            note(
                f"{label}: usage {mib(usage)} (over {WINDOW_S:.0f}s: {mib(window[0])}.."
                f"{mib(window[-1])}); cgroup limit {mib(before)} -> {mib(limit)}: "
                f"{point.line()}"
            )
            assert point.binding_term == "container", point.line()
            assert point.level == OK, f"level {level_name(point.level)} right after tightening"
            return limit, ceiling, point.soft_bytes, point.hard_bytes

        limit, ceiling, soft, hard = tighten("tighten")

        def admit(model: str, tokens: list[int]) -> control_pb2.AdmitResponse:
            return control.Admit(
                control_pb2.AdmitRequest(request=_request(model, tokens, 8)), timeout=10
            )

        def probe(name: str, model: str, tokens: list[int]) -> Probe:
            p = Probe(name, model, len(tokens))
            p.bank_before = _sessions(control)
            p.admit = admit(model, tokens)

            def on_start(_start) -> None:
                p.bank_at_start = _sessions(control)

            p.turn = run_generate(srv.address, _request(model, tokens, 8), on_start=on_start)
            p.bank_after = _sessions(control)
            probes.append(p)
            note(f"{name}: {len(tokens)} tokens on {model}: Admit {_admit_line(p.admit)}")
            note(
                f"{name}: Generate -> {p.turn.ended}; shed {p.shed() or 'nothing'}; bank "
                f"{_bank_line(p.bank_at_start or p.bank_after)}"
            )
            return p

        # -- 3. probes
        long_prompt = _tokens(rng, LONG_TOKENS)
        r1 = probe("R1", small, long_prompt)
        # R1's admission reclaimed the MLX pool (and whatever that frees beyond it):
        # measure again so that A's figures start from settled usage.
        limit, ceiling, soft, hard = tighten("re-tighten")

        # A: size the prompt from Admit's own figures so that it previews shedding two
        # idle snapshots: half-way between the sizes that shed two and three entries.
        a_tokens = _tokens(rng, MAX_PROBE_TOKENS)

        def first_size(entries: int) -> int | None:
            # Not monotonic: past the largest prompt shedding can fit, Admit previews
            # shedding nothing (it would be refused, and nothing is shed for it).
            for size in range(8, MAX_PROBE_TOKENS + 1, 8):
                if admit(small, a_tokens[:size]).shed_entries >= entries:
                    return size
            return None

        # The live turn's MLX pool fills and is reclaimed as it decodes, moving usage by up
        # to its cap (32 MiB) between one Admit and the next: a size found while the pool
        # was full can preview shedding fewer entries a moment later. Size again then (the
        # figures moved, not the contract: A's own Admit is what the checks below hold
        # Generate to).
        for attempt in range(1, 4):
            two, three = first_size(2), first_size(3)
            assert two is not None, (
                f"no prompt of up to {MAX_PROBE_TOKENS} tokens on {small} makes Admit shed "
                f"two entries: {_admit_line(admit(small, a_tokens))}"
            )
            size = (two + three) // 2 if three else two
            note(f"A: sheds 2 entries from {two} tokens, 3 from {three}; using {size}")
            if admit(small, a_tokens[:size]).shed_entries == 2:
                break
            note(f"A: the figures moved (attempt {attempt}): "
                 f"{_admit_line(admit(small, a_tokens[:size]))}")
        a = probe("A", small, a_tokens[:size])
        r2 = probe("R2", small, long_prompt)

        # -- 4. the active sessions, while s2-live is still in flight
        during = _sessions(control)
        live_running = live.turn.ended is None
        note(
            f"after the probes ({'live turn still running' if live_running else 'live turn ended'}"
            f"): bank {_bank_line(during)}"
        )
        # The probes are over: pin the live session too, so that the snapshot its turn
        # stores is not an idle victim of a later enforcer tick before we look at it.
        live_pin = control.Pin(
            control_pb2.PinRequest(session_id=LIVE_ID, owner="shedding-test"), timeout=10
        ).lease
        assert live.join(120), f"{LIVE_ID}'s second turn did not end"
        after_live = _sessions(control)
        # The live turn's 1,500-token decode grows the heap past the margin the probes were
        # sized in (seen: usage 272 MiB against a 269 MiB admission limit, nothing left to
        # shed but 3 MiB), and a turn refused then would say nothing of the snapshot. The
        # probes are over: give the memory back, so the next turn asks only whether the
        # pinned snapshot is still there to restore.
        cg.set_limit(START_LIMIT_BYTES)
        relaxed = poller.wait_for(
            lambda p: p.ceiling_bytes > ceiling + 256 * MIB, 10, after=time.monotonic()
        )
        assert relaxed is not None, (
            f"the ceiling did not follow the cgroup limit back to {mib(START_LIMIT_BYTES)}: "
            f"{poller.latest().line() if poller.latest() else '-'}"
        )
        nxt = _request(
            tiny, prompts[PINNED_ID][1] + turns[PINNED_ID].token_ids + _tokens(rng, 8), 8, PINNED_ID
        )
        pinned_turn = run_generate(srv.address, nxt)
        for lease in (pin, live_pin):
            control.Unpin(control_pb2.UnpinRequest(lease_id=lease.lease_id), timeout=10)
        final = _sessions(control)
        note(
            f"end: bank {_bank_line(final)}; {PINNED_ID} next turn {pinned_turn.ended} "
            f"cached {pinned_turn.cached_tokens}/{len(nxt.token_ids.ids)}"
        )
    finally:
        time.sleep(0.3)
        watcher.stop()
        poller.stop()
        ch.close()
        if live is not None:
            live.join(60)
        alive = srv.proc.poll() is None
        counters = cg.oom_counters()
        peak_point = max(poller.points, key=lambda p: p.process_bytes, default=None)
        note(
            f"server {'alive' if alive else f'exited {srv.proc.returncode}'}; {cg.describe()} "
            f"peak {mib(cg.peak_bytes() or 0)}; rss now "
            f"{mib(rss_bytes(srv.proc.pid)) if alive else '-'}; highest status "
            f"{peak_point.line() if peak_point else '-'}"
        )
        changes, last = [], None
        for pt in poller.points:
            if pt.level != last:
                changes.append(
                    f"{pt.at - t0:.1f}s {level_name(pt.level)} ({mib(pt.process_bytes)})"
                )
                last = pt.level
        spans = [
            f"{p.name} {p.turn.started_at - t0:.1f}s..{p.turn.ended_at - t0:.1f}s"
            for p in probes
            if p.turn is not None and p.turn.started_at
        ]
        note(f"levels (GetMemoryStatus): {', '.join(changes)}; admitted probes: {spans}")
        print(f"pressure stream:\n{watcher.describe(t0)}")

    # -- never OOM-killed
    assert alive, f"the server died ({srv.proc.returncode}); {counters}\n{srv.log()[-3000:]}"
    assert counters.oom_kill == 0, f"the cgroup saw an OOM kill: {counters}"

    # -- every stream ended with a typed status
    streams = {f"turn {k}": t for k, t in turns.items()}
    streams.update({f"probe {p.name}": p.turn for p in probes if p.turn is not None})
    streams.update({f"{LIVE_ID} second turn": live.turn, f"{PINNED_ID} next turn": pinned_turn})
    for name, t in streams.items():
        check(
            t.ended is not None and is_typed_end(t.ended),
            f"{name} ended without a typed status: {t.ended}",
        )

    # -- R1 / R2: refused with the figures, and nothing shed for a hopeless prompt. R1
    # comes at ok; R2 follows A, whose prefill may have left the level at soft: then
    # admissions pause behind the live turn, Admit says WAIT and Generate's wait ends
    # in a typed MEMORY_PRESSURE too (the two must still agree).
    for r in (r1, r2):
        assert r.admit is not None and r.turn is not None and r.turn.ended is not None
        e = r.turn.ended
        waited = r.admit.verdict == control_pb2.ADMIT_VERDICT_WAIT and r is r2
        check(
            r.admit.verdict == control_pb2.ADMIT_VERDICT_REJECT
            and constraint(r.admit) in ("admission_limit", "prefill_exceeds_ceiling")
            or waited,
            f"{r.name}: Admit should REJECT at the ceiling: {_admit_line(r.admit)}",
        )
        check(
            not r.turn.admitted
            and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            and e.reason in ("MEMORY_PRESSURE", "PREFILL_EXCEEDS_CEILING")
            + (("ADMISSION_TIMEOUT",) if waited else ()),
            f"{r.name}: Admit said {_verdict(r.admit.verdict)} but Generate did not end "
            f"RESOURCE_EXHAUSTED/MEMORY_PRESSURE before any prefill: start={r.turn.start} {e}",
        )
        check(
            e.metadata.get("binding") == constraint(r.admit),
            f"{r.name}: Admit's binding constraint '{constraint(r.admit)}' but "
            f"Generate's '{e.metadata.get('binding')}'",
        )
        check(
            e.retry_after_s is not None and e.retry_after_s > 0,
            f"{r.name}: the refusal carries no RetryInfo: {e}",
        )
        if not waited:
            numeric = {k for k, v in e.metadata.items() if v.lstrip("-").isdigit()}
            check(
                {"projected_bytes", "admission_limit_bytes", "usage_bytes"} <= numeric,
                f"{r.name}: the refusal's ErrorInfo metadata lacks byte figures: {e.metadata}",
            )
            if e.metadata.get("projected_after_shed_bytes", "").isdigit():
                check(
                    int(e.metadata["projected_after_shed_bytes"])
                    > int(e.metadata.get("ceiling_bytes", 0)),
                    f"{r.name}: refused although it fits under the ceiling: {e.metadata}",
                )
        check(
            not r.shed(),
            f"{r.name}: a hopeless prompt shed {r.shed()} (reusable state lost "
            f"for a request refused anyway)",
        )

    # -- A: Admit and Generate agree, and only the LRU idle sessions were shed
    assert a.admit is not None and a.turn is not None
    check(
        a.admit.verdict == control_pb2.ADMIT_VERDICT_ADMIT_AFTER_SHEDDING
        and a.admit.shed_entries == 2,
        f"A: Admit should preview ADMIT_AFTER_SHEDDING of 2 entries: {_admit_line(a.admit)}",
    )
    check(
        a.turn.admitted and a.turn.ended is not None and a.turn.ended.code == grpc.StatusCode.OK,
        f"A: Admit said {_verdict(a.admit.verdict)} but Generate ended {a.turn.ended} "
        f"(start={a.turn.start})",
    )
    shed = a.shed()
    check(
        set(shed) <= set(IDLE_IDS),
        f"A: admission shed active sessions: {sorted(set(shed) - set(IDLE_IDS))} (shed {shed})",
    )
    idle_shed = [sid for sid in shed if sid in IDLE_IDS]
    # Least recently used first among those A found: at a hard level the enforcer may have
    # shed the oldest already (seen: s3-idle during R1, s4-idle before A, both LRU first).
    idle_found = [sid for sid in IDLE_IDS if sid in a.bank_before]
    check(
        idle_shed == idle_found[: len(idle_shed)],
        f"A: idle sessions not shed least recently used first: {idle_shed} of {idle_found}",
    )
    # Generate re-measures after each step and stops once the prompt fits, so it may shed
    # less than Admit previewed (the pool reclaim also returns heap pages, which the
    # preview cannot count); never more.
    check(
        len(shed) <= a.admit.shed_entries,
        f"A: Admit previewed shedding {a.admit.shed_entries} entries "
        f"({mib(a.admit.shed_bytes)}) but Generate shed {len(shed)} sessions {shed} "
        f"({mib(sum(idle_bytes.get(s, 0) for s in shed))})",
    )

    # -- the active sessions kept their caches (same entries, same bytes) ...
    for sid in (PINNED_ID, LIVE_ID):
        for label, bank in [
            (f"at {p.name}'s start", p.bank_at_start or p.bank_after) for p in probes
        ] + [("after the probes", during)]:
            check(
                _entry_bytes(bank.get(sid)) == active_before[sid],
                f"{sid} (active) lost its cache {label}: {_entry_bytes(bank.get(sid))} "
                f"!= {active_before[sid]}",
            )
    check(live_running, f"{LIVE_ID}'s turn ended before the probes did: not a live test")
    # ... the live turn started from its cache and stored a longer snapshot ...
    check(
        live.turn.cached_tokens == len(live_prompt) + len(turns[LIVE_ID].token_ids),
        f"{LIVE_ID}'s second turn restored {live.turn.cached_tokens} tokens, not its "
        f"{len(live_prompt) + len(turns[LIVE_ID].token_ids)}-token snapshot",
    )
    live_entries = _entry_bytes(after_live.get(LIVE_ID))
    check(
        bool(live_entries) and max(live_entries)[0] > len(live_next),
        f"{LIVE_ID}'s second turn stored no longer snapshot: {live_entries}",
    )
    # ... and the pinned session's next turn restores its prefix.
    pinned_prefix = max(active_before[PINNED_ID])[0]
    check(
        pinned_turn.cached_tokens == pinned_prefix,
        f"{PINNED_ID}'s next turn restored {pinned_turn.cached_tokens} tokens, not its "
        f"{pinned_prefix}-token snapshot",
    )

    # -- the enforcer never reached emergency and aborted nothing
    transitions = [level_name(t.to_level) for t in watcher.transitions()]
    check(
        EMERGENCY not in [t.to_level for t in watcher.transitions()],
        f"the level reached emergency: {transitions}",
    )
    aborts = [
        f"{kind_label(x.kind)} {list(x.request_ids)}: {x.reason}"
        for x in watcher.actions()
        if kind_label(x.kind).startswith("abort")
    ]
    check(not aborts, f"the enforcer aborted requests: {aborts}")
    note(
        f"transitions {transitions or 'none'}; cgroup limit {mib(limit)}, ceiling "
        f"{mib(ceiling)}, hard {mib(hard)}, soft {mib(soft)}"
    )

    assert not problems, "\n".join(problems) + "\n\nfigures:\n" + "\n".join(figures)
