"""`plimsoll plot FILE -o episode.png`: a recorded WatchPressure stream as a picture.

The input is what `plimsoll watch --record FILE` writes: one JSON object a line, either
`{"received": t, "message": <WatchPressureResponse as MessageToDict>}` or a local note
`{"received": t, "note": "restarted" | "down", "text": ...}`. The picture: usage, the
ceiling and the soft and hard marks over time, the time spent at soft, hard and
emergency as shaded bands, enforcer actions as markers by kind (evictions, shrinks,
aborts, the rest), and a dashed line where the server restarted.

`load_episode` (file → Episode) and `draw` (Episode → PNG) are separate, so each can be
tested; matplotlib is imported only when drawing, with the headless Agg backend.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from plimsoll.v1 import control_pb2, types_pb2
from service.cli_common import MiB, OperatorError, label, new_process

LEVEL_FILL = {
    types_pb2.PRESSURE_LEVEL_SOFT: ("#f6d55c", "soft"),
    types_pb2.PRESSURE_LEVEL_HARD: ("#ed553b", "hard"),
    types_pb2.PRESSURE_LEVEL_EMERGENCY: ("#9b3dbf", "emergency"),
}
# Marker groups: (label, matplotlib marker, colour, the action kinds in it). Clearing the
# auxiliary caches happens on most ticks under pressure and is left out: it would bury
# the rest.
K = control_pb2
MARKERS = (
    ("evict", "v", "#c0392b", {K.ENFORCER_ACTION_KIND_EVICT_MODEL,
                               K.ENFORCER_ACTION_KIND_MARK_PENDING_UNLOAD}),
    ("shrink", "s", "#2471a3", {K.ENFORCER_ACTION_KIND_SHRINK_SESSIONS,
                                K.ENFORCER_ACTION_KIND_EXPIRE_SESSIONS}),
    ("abort", "X", "#000000", {K.ENFORCER_ACTION_KIND_ABORT_REQUESTS,
                               K.ENFORCER_ACTION_KIND_ABORT_LOAD,
                               K.ENFORCER_ACTION_KIND_PREFILL_ABORT}),
    ("cap step", "d", "#a569bd", {K.ENFORCER_ACTION_KIND_STORE_CACHE_CAP,
                                  K.ENFORCER_ACTION_KIND_BATCH_CAP}),
    ("reclaim", ".", "#117a65", {K.ENFORCER_ACTION_KIND_PRESSURE_RECLAIM,
                                 K.ENFORCER_ACTION_KIND_IDLE_RECLAIM}),
    ("refuse / pause", "|", "#7f8c8d", {K.ENFORCER_ACTION_KIND_REFUSE_ADMISSION,
                                        K.ENFORCER_ACTION_KIND_REFUSE_LOAD,
                                        K.ENFORCER_ACTION_KIND_PAUSE_ADMISSION,
                                        K.ENFORCER_ACTION_KIND_RESUME_ADMISSION}),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw a recorded pressure stream as a PNG",
                       description="Draw what `plimsoll watch --record FILE` recorded: usage, "
                       "the ceiling and the soft and hard marks over time, level bands and "
                       "enforcer actions.")
    p.add_argument("file", type=Path, help="the JSON-lines recording")
    p.add_argument("-o", "--output", type=Path, default=Path("episode.png"),
                   help="the PNG to write (default: %(default)s)")
    p.add_argument("--width", type=int, default=1200, help="pixels (default: %(default)s)")
    p.add_argument("--height", type=int, default=600, help="pixels (default: %(default)s)")
    p.add_argument("--title", default=None, help="the title (default: the file name)")
    p.add_argument("--json", action="store_true", help="print what was drawn as JSON")


# -- reading --------------------------------------------------------------------------------


@dataclass
class Episode:
    t: list[float] = field(default_factory=list)  # seconds since the first event
    usage: list[float] = field(default_factory=list)  # bytes; NaN where the stream broke
    ceiling: list[float] = field(default_factory=list)
    soft: list[float] = field(default_factory=list)
    hard: list[float] = field(default_factory=list)
    level: list[int] = field(default_factory=list)
    actions: list[tuple[float, int, str]] = field(default_factory=list)  # (t, kind, model)
    restarts: list[float] = field(default_factory=list)
    start: float = 0.0  # epoch seconds of t = 0

    @property
    def duration(self) -> float:
        return max(self.t, default=0.0)


def _when(line: dict, msg: control_pb2.WatchPressureResponse) -> float:
    if msg.HasField("event_time"):
        return msg.event_time.ToNanoseconds() / 1e9
    return float(line.get("received", 0.0))


def _figures(msg: control_pb2.WatchPressureResponse):
    kind = msg.WhichOneof("event")
    if kind == "snapshot":
        return msg.snapshot.level, msg.snapshot.readings, msg.snapshot.limits
    if kind == "sample":
        return msg.sample.level, msg.sample.readings, msg.sample.limits
    if kind == "transition":
        return msg.transition.to_level, msg.transition.readings, msg.transition.limits
    return None


def parse_lines(lines: list[str]) -> Episode:
    """The recording's messages in time order; replays of events already seen in the
    same server process are dropped (a reconnect replays what it may have missed)."""
    points: list[tuple[float, float, float, float, float, int]] = []
    actions: list[tuple[float, int, str]] = []
    restarts: list[float] = []
    gaps: list[float] = []  # the stream broke here: the lines break too
    seen: set[tuple[int, int]] = set()
    process, last, instance = 0, 0, ""
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as err:
            raise OperatorError(f"line {number} is not JSON: {err.msg}") from None
        if "note" in line:
            at = float(line.get("received", 0.0))
            if line["note"] == "restarted":
                restarts.append(at)
            elif line["note"] == "down":
                gaps.append(at)
            continue
        msg = control_pb2.WatchPressureResponse()
        try:
            json_format.ParseDict(line.get("message", {}), msg, ignore_unknown_fields=True)
        except json_format.ParseError as err:
            raise OperatorError(f"line {number} is no WatchPressure message: {err}") from None
        kind = msg.WhichOneof("event")
        if kind == "snapshot":
            if new_process(msg.instance, instance, msg.sequence, last):
                process += 1
            last, instance = msg.sequence, msg.instance
        else:
            if (process, msg.sequence) in seen:
                continue
            seen.add((process, msg.sequence))
            last = max(last, msg.sequence)
        at = _when(line, msg)
        if kind == "action":
            actions.append((at, msg.action.kind, msg.action.model_id))
            continue
        figures = _figures(msg)
        if figures is None:
            continue
        level, rd, lim = figures
        points.append((at, rd.process_bytes, lim.ceiling_bytes, lim.soft_bytes,
                       lim.hard_bytes, level))
    if not points:
        raise OperatorError("the recording holds no snapshot, sample or transition to draw")
    nan = float("nan")
    points += [(at, nan, nan, nan, nan, types_pb2.PRESSURE_LEVEL_UNSPECIFIED) for at in gaps]
    points.sort(key=lambda p: p[0])
    actions.sort()
    ep = Episode()
    ep.start = points[0][0]
    for at, usage, ceiling, soft, hard, level in points:
        ep.t.append(at - ep.start)
        ep.usage.append(usage)
        ep.ceiling.append(ceiling)
        ep.soft.append(soft)
        ep.hard.append(hard)
        ep.level.append(level)
    ep.actions = [(at - ep.start, kind, model) for at, kind, model in actions]
    ep.restarts = [at - ep.start for at in restarts]
    return ep


def load_episode(path: Path) -> Episode:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise OperatorError(f"cannot read {path}: {err.strerror or err}") from None
    return parse_lines(text.splitlines())


def level_spans(ep: Episode) -> list[tuple[float, float, int]]:
    """(start, end, level) for every stretch at soft or above: a level holds from its
    reading until the next one."""
    spans: list[tuple[float, float, int]] = []
    for i, level in enumerate(ep.level):
        if level not in LEVEL_FILL:
            continue
        end = ep.t[i + 1] if i + 1 < len(ep.t) else ep.t[i]
        if spans and spans[-1][2] == level and spans[-1][1] >= ep.t[i]:
            spans[-1] = (spans[-1][0], end, level)
        else:
            spans.append((ep.t[i], end, level))
    return spans


def _usage_at(ep: Episode, at: float) -> float:
    """Usage at time `at` (the last reading at or before it)."""
    value = next((u for u in ep.usage if u == u), 0.0)  # u == u: not NaN
    for t, u in zip(ep.t, ep.usage, strict=True):
        if t > at:
            break
        if u == u:
            value = u
    return value


# -- drawing --------------------------------------------------------------------------------


def draw(ep: Episode, output: Path, width: int = 1200, height: int = 600,
         title: str = "") -> dict:
    """Write the PNG (exactly width x height pixels); what was drawn, as counts."""
    import matplotlib  # noqa: PLC0415 - only the plot verb pays for it

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # noqa: PLC0415

    dpi = 100
    fig, ax = plt.subplots(figsize=(width / dpi, height / dpi), dpi=dpi)
    try:
        mib = [u / MiB for u in ep.usage]
        for start, end, level in level_spans(ep):
            colour, _ = LEVEL_FILL[level]
            ax.axvspan(start, max(end, start + 0.05), color=colour, alpha=0.25, lw=0)
        ax.step(ep.t, [c / MiB for c in ep.ceiling], where="post", color="#34495e", lw=1.6,
                label="ceiling")
        ax.step(ep.t, [h / MiB for h in ep.hard], where="post", color="#ed553b", lw=1.1,
                ls="--", label="hard mark")
        ax.step(ep.t, [s / MiB for s in ep.soft], where="post", color="#d4ac0d", lw=1.1,
                ls="--", label="soft mark")
        ax.plot(ep.t, mib, color="#1f618d", lw=2.0, label="usage")
        counts = {}
        for name, marker, colour, kinds in MARKERS:
            hits = [(at, _usage_at(ep, at) / MiB) for at, kind, _ in ep.actions if kind in kinds]
            counts[name] = len(hits)
            if hits:
                ax.scatter([h[0] for h in hits], [h[1] for h in hits], marker=marker, s=70,
                           color=colour, zorder=5, label=f"{name} ({len(hits)})")
        for at in ep.restarts:
            ax.axvline(at, color="#7d3c98", ls=":", lw=1.5)
            ax.annotate("server restarted", (at, ax.get_ylim()[1]), rotation=90, va="top",
                        ha="right", fontsize=8, color="#7d3c98")
        for level, (colour, name) in LEVEL_FILL.items():
            if level in ep.level:
                ax.axvspan(0, 0, color=colour, alpha=0.25, label=f"at {name}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_xlim(0, max(ep.duration, 1.0))
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(title)
        ax.legend(loc="lower left", fontsize=8, ncol=3, framealpha=0.85)
        fig.tight_layout()
        output.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(output, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    levels = sorted({label(types_pb2.PressureLevel, lv) for lv in ep.level if lv})
    readings = sum(1 for u in ep.usage if u == u)
    return {"output": str(output), "width": width, "height": height, "points": readings,
            "seconds": round(ep.duration, 3), "levels": levels, "actions": counts,
            "restarts": len(ep.restarts)}


def run(args: argparse.Namespace) -> int:
    if args.width < 100 or args.height < 100:
        raise OperatorError("plot: --width and --height must be at least 100 pixels")
    ep = load_episode(args.file)
    drawn = draw(ep, args.output, args.width, args.height, args.title or args.file.name)
    if args.json:
        print(json.dumps(drawn))
    else:
        acts = ", ".join(f"{n} {c}" for n, c in drawn["actions"].items() if c) or "no actions"
        print(f"wrote {drawn['output']} ({drawn['width']}x{drawn['height']}): "
              f"{drawn['points']} readings over {drawn['seconds']:.1f} s, levels "
              f"{'/'.join(drawn['levels'])}, {acts}")
    return 0
