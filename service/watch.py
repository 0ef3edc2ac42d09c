"""`plimsoll watch`: a live dashboard on ControlService.WatchPressure.

The parts:

- `WatchState`, fed by `apply` (one stream message), `on_down` (the stream broke) and
  `on_status` (a GetMemoryStatus answer, for the models). Nothing here does I/O.
- `render(state, now, bar_width)`: the state as a rich renderable, a pure function, so
  the screen can be tested without a terminal.
- `run(args)`: the thin loop. One thread reads the stream and re-subscribes when it
  breaks, with `resume_after_sequence` set to the last sequence seen, so a reconnect to
  the same process replays what was missed; a snapshot from another process (its
  `instance` differs; from a server without one, a sequence lower than what was seen)
  means the server restarted, and the screen says so.
  Another thread polls GetMemoryStatus for the models every few seconds and at once
  after a transition or a model action. `--record FILE` writes every stream message
  as one JSON line (`json_format.MessageToDict` plus the local receive time),
  which `plimsoll plot` draws.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import IO, Any

import grpc
from google.protobuf import json_format
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from plimsoll.v1 import control_pb2, control_pb2_grpc, types_pb2
from service.cli_common import (
    LEVEL_COLOURS,
    LEVEL_STYLES,
    add_target,
    address,
    error_fields,
    error_line,
    fmt_bytes,
    label,
    local_clock,
    new_process,
    open_channel,
)

HISTORY = 240  # usage readings kept for the sparkline
SPARK = "▁▂▃▄▅▆▇█"
BAR_FILL, BAR_EMPTY, MARK = "█", "─", "┃"
# Actions after which the model list is stale: poll GetMemoryStatus at once.
MODEL_ACTIONS = {
    control_pb2.ENFORCER_ACTION_KIND_EVICT_MODEL,
    control_pb2.ENFORCER_ACTION_KIND_MARK_PENDING_UNLOAD,
    control_pb2.ENFORCER_ACTION_KIND_ABORT_REQUESTS,
    control_pb2.ENFORCER_ACTION_KIND_ABORT_LOAD,
    control_pb2.ENFORCER_ACTION_KIND_REFUSE_LOAD,
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser(
        "watch", help="live pressure dashboard (WatchPressure)",
        description="Subscribe to WatchPressure (samples and enforcer actions) and show the "
        "level, usage against the soft and hard marks and the ceiling, the pool and bank, "
        "a sparkline of usage, the models and the last transitions and actions. Reconnects "
        "by itself; says when the server restarted. With --json (or when not a terminal "
        "with --json) it prints each stream message as a JSON line instead.")
    add_target(w, timeout=10.0)
    w.add_argument("--record", default=None, metavar="FILE",
                   help="write every stream message to FILE as JSON lines (for plimsoll plot)")
    w.add_argument("--no-samples", action="store_true",
                   help="transitions and actions only, not every tick's sample")
    w.add_argument("--models-every", type=float, default=3.0, metavar="S",
                   help="poll GetMemoryStatus for the models this often (default: %(default)s)")
    w.add_argument("--duration", type=float, default=None, metavar="S",
                   help="stop after S seconds (default: until Ctrl-C)")


# -- the state ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TransitionLine:
    at: float
    from_level: str
    to_level: str
    reason: str
    replayed: bool = False
    crossing: str = ""  # "usage 180.0 MiB >= soft 170.0 MiB", from the transition's figures


def crossing(t: control_pb2.PressureTransition) -> str:
    """The mark a transition crossed, with the figures it carries: up, the mark of the
    new level was reached; down, the usage fell under the mark of the old one."""
    marks = {types_pb2.PRESSURE_LEVEL_SOFT: ("soft", t.limits.soft_bytes),
             types_pb2.PRESSURE_LEVEL_HARD: ("hard", t.limits.hard_bytes),
             types_pb2.PRESSURE_LEVEL_EMERGENCY: ("ceiling", t.limits.ceiling_bytes)}
    up = t.to_level > t.from_level
    name, mark = marks.get(t.to_level if up else t.from_level, ("", 0))
    if not name:
        return ""
    return f"usage {fmt_bytes(t.readings.process_bytes)} {'>=' if up else '<'} {name} " \
        f"{fmt_bytes(mark)}"


@dataclass(frozen=True)
class ActionLine:
    at: float
    kind: str
    model_id: str
    bytes_freed: int
    entries: int
    requests: int
    reason: str
    level: str
    replayed: bool = False
    count: int = 1  # repeats folded into this line (same kind and model)
    first_reason: str = ""  # the reason of the first of them, when it differs


def fold_action(actions: deque[ActionLine], line: ActionLine) -> None:
    """Append `line`, folding it into an earlier line of the same kind and model: caps
    walk one step per tick and caches clear on most ticks, which would otherwise push
    every other action off the screen."""
    for i, old in enumerate(actions):
        if (old.kind, old.model_id) == (line.kind, line.model_id):
            del actions[i]
            first = old.first_reason or old.reason
            line = replace(line, count=old.count + 1,
                           bytes_freed=old.bytes_freed + line.bytes_freed,
                           entries=old.entries + line.entries,
                           requests=old.requests + line.requests,
                           first_reason=first if first != line.reason else "")
            break
    actions.append(line)


@dataclass
class WatchState:
    target: str
    level: int = types_pb2.PRESSURE_LEVEL_UNSPECIFIED
    readings: types_pb2.MemoryReadings | None = None
    limits: types_pb2.MemoryLimits | None = None
    admission: types_pb2.AdmissionState | None = None
    usage: deque[int] = field(default_factory=lambda: deque(maxlen=HISTORY))
    transitions: deque[TransitionLine] = field(default_factory=lambda: deque(maxlen=6))
    actions: deque[ActionLine] = field(default_factory=lambda: deque(maxlen=8))
    models: list[control_pb2.ModelInfo] = field(default_factory=list)
    models_at: float | None = None
    connected: bool = False
    last_sequence: int = 0
    instance: str = ""  # the server process the events came from
    seen_before_reconnect: int = 0  # the last sequence seen when the stream broke
    replayed: int = 0  # replayed events since the last break
    snapshots: int = 0
    restarts: int = 0
    attempts: int = 0  # failed connection attempts since the last good one
    notice: str = ""
    notice_kind: str = ""  # connected, reconnected, restarted, down
    notice_at: float = 0.0
    last_event_at: float = 0.0
    messages: int = 0


def _event_time(msg: control_pb2.WatchPressureResponse, now: float) -> float:
    if msg.HasField("event_time"):
        return msg.event_time.ToNanoseconds() / 1e9
    return now


def _say(state: WatchState, kind: str, text: str, now: float) -> None:
    state.notice, state.notice_kind, state.notice_at = text, kind, now


def _snapshot(state: WatchState, msg: control_pb2.WatchPressureResponse, now: float) -> None:
    snap = msg.snapshot
    seq = msg.sequence
    if state.snapshots == 0:
        _say(state, "connected", f"connected: snapshot at sequence {seq}", now)
    elif new_process(msg.instance, state.instance, seq, state.seen_before_reconnect):
        state.restarts += 1
        _say(state, "restarted", f"server restarted: reconnected with a fresh snapshot "
             f"(sequence {seq}, {state.seen_before_reconnect} seen before)", now)
    else:
        missing = " (replay incomplete: some were no longer retained)" \
            if snap.replay_incomplete else ""
        _say(state, "reconnected", f"reconnected: fresh snapshot, {state.replayed} missed "
             f"event(s) replayed after sequence {state.seen_before_reconnect}{missing}", now)
    state.snapshots += 1
    state.connected, state.attempts, state.replayed = True, 0, 0
    state.last_sequence = seq
    state.instance = msg.instance
    state.level = snap.level
    state.readings, state.limits, state.admission = snap.readings, snap.limits, snap.admission
    state.usage.append(snap.readings.process_bytes)


def apply(state: WatchState, msg: control_pb2.WatchPressureResponse, now: float) -> bool:
    """Feed one stream message; True when the model list should be refreshed now."""
    kind = msg.WhichOneof("event")
    state.messages += 1
    state.last_event_at = _event_time(msg, now)
    if msg.replayed:
        state.replayed += 1
    if kind == "snapshot":
        _snapshot(state, msg, now)
        return True
    state.last_sequence = max(state.last_sequence, msg.sequence)
    if kind == "sample":
        s = msg.sample
        state.level = s.level
        state.readings, state.limits, state.admission = s.readings, s.limits, s.admission
        state.usage.append(s.readings.process_bytes)
        return False
    if kind == "transition":
        t = msg.transition
        state.level = t.to_level
        state.readings, state.limits = t.readings, t.limits
        state.usage.append(t.readings.process_bytes)
        state.transitions.append(TransitionLine(
            _event_time(msg, now), label(types_pb2.PressureLevel, t.from_level),
            label(types_pb2.PressureLevel, t.to_level), t.reason, msg.replayed, crossing(t)))
        return True
    if kind == "action":
        a = msg.action
        fold_action(state.actions, ActionLine(
            _event_time(msg, now), label(control_pb2.EnforcerActionKind, a.kind), a.model_id,
            a.bytes_freed, a.entries_evicted, len(a.request_ids), a.reason,
            label(types_pb2.PressureLevel, a.level), msg.replayed))
        return a.kind in MODEL_ACTIONS
    return False


def on_down(state: WatchState, reason: str, now: float) -> None:
    """The stream broke (or could not be opened): remember where it stood."""
    if state.connected:
        state.seen_before_reconnect = state.last_sequence
    state.connected = False
    state.attempts += 1
    state.replayed = 0
    _say(state, "down", f"disconnected: {reason}; reconnecting (attempt {state.attempts})",
         now)


def on_status(state: WatchState, resp: control_pb2.GetMemoryStatusResponse,
              now: float) -> None:
    state.models = list(resp.models)
    state.models_at = now


# -- rendering (pure) ---------------------------------------------------------------------


def sparkline(values: list[int] | deque[int], width: int, min_span: int = 0) -> str:
    """The last `width` values as block characters, scaled between their min and max,
    the range at least `min_span` wide so that noise does not fill the whole height."""
    tail = list(values)[-width:] if width > 0 else []
    if not tail:
        return ""
    lo = min(tail)
    hi = max(max(tail), lo + min_span)
    if hi == lo:
        return SPARK[0] * len(tail)
    top = len(SPARK) - 1
    return "".join(SPARK[round((v - lo) / (hi - lo) * top)] for v in tail)


def _cell(value: int, scale: int, width: int) -> int:
    return min(width - 1, max(0, int(value / scale * width)))


def usage_bar(usage: int, limits: types_pb2.MemoryLimits, width: int, level: str) -> Text:
    """Usage as a bar of `width` cells over [0, max(ceiling, usage)], with the soft (S),
    hard (H) and ceiling (C) marks drawn on it and lettered on the line below."""
    scale = max(limits.ceiling_bytes, usage, 1)
    filled = min(width, int(usage / scale * width))
    cells = [(BAR_FILL, LEVEL_COLOURS.get(level, "white"))] * filled
    cells += [(BAR_EMPTY, "grey50")] * (width - filled)
    letters = [" "] * width
    for value, letter, style in ((limits.soft_bytes, "S", "bold yellow"),
                                 (limits.hard_bytes, "H", "bold red"),
                                 (limits.ceiling_bytes, "C", "bold white")):
        if value:
            i = _cell(value, scale, width)
            cells[i] = (MARK, style)
            letters[i] = letter
    bar = Text()
    for ch, style in cells:
        bar.append(ch, style=style)
    bar.append("\n" + "".join(letters), style="bold")
    return bar


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def memory_panel(state: WatchState, bar_width: int) -> RenderableType:
    if state.readings is None or state.limits is None:
        return Panel(Text("waiting for the first snapshot…", style="dim"), title="memory")
    rd, lim = state.readings, state.limits
    level = label(types_pb2.PressureLevel, state.level)
    usage = rd.process_bytes
    binding = label(types_pb2.CeilingTerm, lim.binding_term)
    legend = Text.assemble(
        (BAR_FILL, LEVEL_COLOURS.get(level, "white")),
        f" usage {fmt_bytes(usage)} ({_pct(usage, lim.ceiling_bytes)} of the ceiling)   ",
        ("S", "bold yellow"), f" soft {fmt_bytes(lim.soft_bytes)}   ",
        ("H", "bold red"), f" hard {fmt_bytes(lim.hard_bytes)}   ",
        ("C", "bold"), f" ceiling {fmt_bytes(lim.ceiling_bytes)} (binding: {binding})")
    adm = state.admission or types_pb2.AdmissionState()
    paused = Text(" · admissions paused", style="bold yellow") if adm.paused else Text("")
    figures = Text.assemble(
        f"pool {fmt_bytes(rd.mlx_pool_bytes)} · bank {fmt_bytes(adm.session_bank_bytes)} · "
        f"reservations {adm.reservations} ({fmt_bytes(adm.reserved_bytes)}) · "
        f"running {adm.running} · waiting {adm.waiting}", paused)
    history = list(state.usage)
    # At least 2% of the ceiling tall: a few MiB of noise stays a low line.
    spark = sparkline(history, bar_width, lim.ceiling_bytes // 50)
    trend = Text.assemble(
        "usage  ", (spark, LEVEL_COLOURS.get(level, "white")),
        f"  {fmt_bytes(min(history))} … {fmt_bytes(max(history))} over the last "
        f"{min(len(history), bar_width)} readings" if history else "")
    return Panel(Group(usage_bar(usage, lim, bar_width, level), legend, figures, trend),
                 title="memory", title_align="left")


def models_panel(state: WatchState, now: float) -> RenderableType:
    t = Table(show_edge=False, pad_edge=False, expand=False)
    longest = max((len(m.model_id) + 1 for m in state.models), default=5)
    t.add_column("model", no_wrap=True, min_width=longest)  # ids are never cut short
    for col in ("state", "size", "pinned", "active", "waiting", "batch cap",
                "pending unload"):
        t.add_column(col, justify="right" if col in ("size", "active", "waiting", "batch cap")
                     else "left")
    for m in state.models:
        t.add_row(m.model_id + ("*" if m.is_default else ""),
                  label(control_pb2.ModelState, m.state), fmt_bytes(m.measured_bytes),
                  Text("pinned", style="bold cyan") if m.pinned else "-",
                  str(m.active_requests), str(m.waiting_requests), str(m.batch_cap),
                  m.pending_unload or "-")
    age = f" (as of {now - state.models_at:.0f} s ago)" if state.models_at is not None else ""
    return Panel(t if state.models else Text("no model listed yet", style="dim"),
                 title=f"models{age}", title_align="left")


def transitions_panel(state: WatchState) -> RenderableType:
    t = Table.grid(padding=(0, 1))
    for line in list(state.transitions)[::-1]:
        move = Text.assemble((line.from_level, LEVEL_COLOURS.get(line.from_level, "")), " → ",
                             (line.to_level, "bold " + LEVEL_COLOURS.get(line.to_level, "")))
        why = "; ".join(p for p in (line.crossing, line.reason) if p)
        t.add_row(local_clock(line.at), move, why + (" (replayed)" if line.replayed else ""))
    body = t if state.transitions else Text("none yet", style="dim")
    return Panel(body, title="transitions", title_align="left")


def actions_panel(state: WatchState) -> RenderableType:
    t = Table(show_edge=False, pad_edge=False)
    for col in ("time", "action", "model", "freed", "level", "reason"):
        t.add_column(col, justify="right" if col == "freed" else "left")
    for a in list(state.actions)[::-1]:
        freed = fmt_bytes(a.bytes_freed) if a.bytes_freed else "-"
        extra = []
        if a.entries:
            extra.append(f"{a.entries} entries")
        if a.requests:
            extra.append(f"{a.requests} requests")
        reason = f"{a.first_reason} … {a.reason}" if a.first_reason else a.reason
        reason += f" [{', '.join(extra)}]" if extra else ""
        kind = a.kind + (f" ×{a.count}" if a.count > 1 else "")
        t.add_row(local_clock(a.at), kind, a.model_id or "-", freed,
                  Text(a.level, style=LEVEL_COLOURS.get(a.level, "")),
                  reason + (" (replayed)" if a.replayed else ""))
    body = t if state.actions else Text("none yet", style="dim")
    return Panel(body, title="enforcer actions", title_align="left")


NOTICE_STYLES = {"connected": "green", "reconnected": "bold cyan",
                 "restarted": "bold magenta", "down": "bold red"}


def header(state: WatchState, now: float) -> RenderableType:
    level = label(types_pb2.PressureLevel, state.level)
    badge = Text(f" {level.upper()} ", style=LEVEL_STYLES.get(level, ""))
    link = (Text("connected", style="green") if state.connected
            else Text("disconnected", style="bold red"))
    line = Text.assemble(("plimsoll watch ", "bold"), state.target, "  level ", badge, "  ",
                         link, f" · sequence {state.last_sequence} · {local_clock(now)}")
    if state.restarts:
        line.append(f" · restarts seen {state.restarts}")
    parts: list[RenderableType] = [line]
    if state.notice:
        parts.append(Text(f"{local_clock(state.notice_at)} {state.notice}",
                          style=NOTICE_STYLES.get(state.notice_kind, "")))
    return Group(*parts)


def render(state: WatchState, now: float, bar_width: int = 60) -> RenderableType:
    """The whole dashboard for `state` at wall-clock time `now`."""
    return Group(header(state, now), memory_panel(state, bar_width), models_panel(state, now),
                 transitions_panel(state), actions_panel(state))


def plain_line(state: WatchState, msg: control_pb2.WatchPressureResponse) -> str | None:
    """One line per snapshot, transition and action, for a log (samples are not news)."""
    kind = msg.WhichOneof("event")
    if kind == "snapshot" and state.readings is not None and state.limits is not None:
        lim = state.limits
        return (f"{state.notice}: level {label(types_pb2.PressureLevel, state.level)}, "
                f"usage {fmt_bytes(state.readings.process_bytes)}, soft "
                f"{fmt_bytes(lim.soft_bytes)}, hard {fmt_bytes(lim.hard_bytes)}, ceiling "
                f"{fmt_bytes(lim.ceiling_bytes)}")
    if kind == "transition" and state.transitions:
        t = state.transitions[-1]
        why = "; ".join(p for p in (t.crossing, t.reason) if p)
        return f"{local_clock(t.at)} transition {t.from_level} -> {t.to_level}: {why}"
    if kind == "action":
        a = msg.action  # this one action, not the folded screen line
        return (f"{local_clock(state.last_event_at)} action "
                f"{label(control_pb2.EnforcerActionKind, a.kind)} {a.model_id or '-'} freed "
                f"{fmt_bytes(a.bytes_freed)} at {label(types_pb2.PressureLevel, a.level)}: "
                f"{a.reason}")
    return None


# -- recording ----------------------------------------------------------------------------


def record_line(msg: control_pb2.WatchPressureResponse, received: float) -> str:
    return json.dumps({"received": round(received, 6), "message": json_format.MessageToDict(msg)})


def note_line(text: str, kind: str, received: float) -> str:
    """A local note (a break, a restart) in the same file: plot marks restarts."""
    return json.dumps({"received": round(received, 6), "note": kind, "text": text})


# -- the loop -----------------------------------------------------------------------------


class _Feeds:
    """The stream reader and the status poller, each a daemon thread, both feeding
    `events` with ("message", msg, t), ("down", reason, t) and ("status", resp, t)."""

    def __init__(self, target: str, samples: bool, models_every: float,
                 timeout: float, channel: Callable[[], grpc.Channel] | None = None) -> None:
        self.target, self.samples = target, samples
        # `channel`: TLS and the token of the verb's flags (cli_common.open_channel).
        self._channel = channel or (lambda: grpc.insecure_channel(target))
        self.models_every, self.timeout = models_every, timeout
        self.events: queue.Queue[tuple[str, Any, float]] = queue.Queue()
        self.stop = threading.Event()
        self.refresh = threading.Event()
        self._call: Any = None

    def start(self) -> _Feeds:
        for fn in (self._read, self._poll):
            threading.Thread(target=fn, daemon=True).start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.refresh.set()
        call = self._call
        if call is not None:
            with contextlib.suppress(Exception):
                call.cancel()

    def _read(self) -> None:
        last, instance, attempt = 0, "", 0
        while not self.stop.is_set():
            with self._channel() as channel:
                stub = control_pb2_grpc.ControlServiceStub(channel)
                req = control_pb2.WatchPressureRequest(
                    include_samples=self.samples, include_actions=True,
                    resume_after_sequence=last, resume_instance=instance)
                reason = "the server ended the stream"
                try:
                    self._call = stub.WatchPressure(req)
                    for msg in self._call:
                        attempt = 0
                        # A snapshot carries the last event it reflects: after a restart
                        # that is lower than before, and the resume point follows it.
                        snap = msg.WhichOneof("event") == "snapshot"
                        last = msg.sequence if snap else max(last, msg.sequence)
                        instance = msg.instance
                        self.events.put(("message", msg, time.time()))
                except grpc.RpcError as err:
                    reason = error_line(error_fields(err, self.target)).removeprefix("error: ")
                finally:
                    self._call = None
            if self.stop.is_set():
                return
            attempt += 1
            self.events.put(("down", reason, time.time()))
            self.stop.wait(min(2.0, 0.25 * 2 ** min(attempt, 4)))

    def _poll(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(grpc.RpcError), self._channel() as ch:
                resp = control_pb2_grpc.ControlServiceStub(ch).GetMemoryStatus(
                    control_pb2.GetMemoryStatusRequest(), timeout=self.timeout)
                self.events.put(("status", resp, time.time()))
            self.refresh.wait(self.models_every)
            self.refresh.clear()


def _bar_width(console: Console) -> int:
    return max(20, min(100, console.width - 8))


def run(args: argparse.Namespace) -> int:
    state = WatchState(address(args))
    console = Console(highlight=False)
    mode = "json" if args.json else ("screen" if console.is_terminal else "plain")
    record: IO[str] | None = open(args.record, "w", encoding="utf-8") if args.record else None  # noqa: SIM115
    feeds = _Feeds(state.target, not args.no_samples, args.models_every, args.timeout,
                   lambda: open_channel(args)).start()
    deadline = time.monotonic() + args.duration if args.duration is not None else None

    def handle(event: tuple[str, Any, float]) -> None:
        kind, payload, at = event
        if kind == "status":
            on_status(state, payload, at)
            return
        if kind == "down":
            on_down(state, payload, at)
            lines = [note_line(state.notice, "down", at)]
        else:
            restarts = state.restarts
            if apply(state, payload, at):
                feeds.refresh.set()
            lines = [record_line(payload, at)]
            if state.restarts != restarts:
                lines.append(note_line(state.notice, "restarted", at))
        for line in lines:
            if record is not None:
                record.write(line + "\n")
                record.flush()
            if mode == "json":
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        if mode == "plain":
            text = state.notice if kind == "down" else plain_line(state, payload)
            if text:
                print(text, flush=True)

    def pump(wait: float) -> None:
        try:
            handle(feeds.events.get(timeout=wait))
            while True:
                handle(feeds.events.get_nowait())
        except queue.Empty:
            pass

    def running() -> bool:
        return deadline is None or time.monotonic() < deadline

    try:
        if mode == "screen":
            with Live(render(state, time.time(), _bar_width(console)), console=console,
                      screen=True, auto_refresh=False) as live:
                while running():
                    pump(0.25)
                    live.update(render(state, time.time(), _bar_width(console)), refresh=True)
        else:
            while running():
                pump(0.25)
    except KeyboardInterrupt:
        pass
    finally:
        feeds.close()
        if record is not None:
            record.close()
    return 0
