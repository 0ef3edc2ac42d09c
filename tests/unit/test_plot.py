"""`plimsoll plot`: a recorded WatchPressure stream read back and drawn as a PNG of the
size asked for (service/plot.py), including the episode recorded for docs/."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from plimsoll.v1 import control_pb2, types_pb2
from service import cli, plot, watch
from service.cli_common import OperatorError
from tests.unit.test_watch_render import (
    HARD,
    OK,
    SOFT,
    T0,
    MiB,
    action,
    sample,
    snapshot,
    transition,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
EVICT = control_pb2.ENFORCER_ACTION_KIND_EVICT_MODEL
SHRINK = control_pb2.ENFORCER_ACTION_KIND_SHRINK_SESSIONS
ABORT = control_pb2.ENFORCER_ACTION_KIND_ABORT_REQUESTS


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG signature and its IHDR chunk."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def episode_lines() -> list[str]:
    msgs = [(snapshot(10, 120), T0), (sample(11, 150, OK, T0 + 1), T0 + 1),
            (transition(12, OK, SOFT, 175, T0 + 2), T0 + 2),
            (action(13, EVICT, T0 + 2.5, model_id="m1"), T0 + 2.5),
            (sample(14, 185, SOFT, T0 + 3), T0 + 3),
            (transition(15, SOFT, HARD, 192, T0 + 4), T0 + 4),
            (action(16, SHRINK, T0 + 4.2), T0 + 4.2),
            (action(17, ABORT, T0 + 4.4, request_ids=["r1"]), T0 + 4.4),
            # a reconnect to the same process replays 16 and 17: drawn once
            (snapshot(17, 190, HARD, at=T0 + 5), T0 + 5),
            (transition(18, HARD, OK, 100, T0 + 6), T0 + 6)]
    lines = [watch.record_line(m, at) for m, at in msgs]
    replays = [action(16, SHRINK, T0 + 4.2), action(17, ABORT, T0 + 4.4)]
    for r in replays:
        r.replayed = True
    lines[8:8] = [watch.record_line(r, T0 + 5) for r in replays]
    lines.insert(8, watch.note_line("disconnected", "down", T0 + 4.6))
    # a new process: its snapshot numbers start again
    lines += [watch.note_line("server restarted", "restarted", T0 + 8),
              watch.record_line(snapshot(1, 110, at=T0 + 8), T0 + 8),
              watch.record_line(action(2, EVICT, T0 + 9), T0 + 9),
              watch.record_line(sample(3, 111, OK, T0 + 10), T0 + 10)]
    return lines


def test_parse_orders_dedupes_replays_and_breaks_the_line_where_the_stream_broke():
    ep = plot.parse_lines(episode_lines())
    assert ep.level == [OK, OK, SOFT, SOFT, HARD, types_pb2.PRESSURE_LEVEL_UNSPECIFIED, HARD,
                        OK, OK, OK]
    assert ep.t[:5] == [0.0, 1.0, 2.0, 3.0, 4.0] and ep.t[-1] == 10.0
    gap = ep.usage[5]
    assert gap != gap  # NaN: no reading while disconnected
    assert [k for _, k, _ in ep.actions] == [EVICT, SHRINK, ABORT, EVICT]  # replays dropped
    assert ep.restarts == [8.0]
    assert ep.ceiling[0] == 200 * MiB and ep.soft[0] == int(0.85 * 200 * MiB)
    assert plot.level_spans(ep) == [(2.0, 4.0, SOFT), (4.0, pytest.approx(4.6), HARD),
                                    (5.0, 6.0, HARD)]


def test_draw_writes_a_png_of_the_size_asked_for(tmp_path):
    out = tmp_path / "sub" / "episode.png"
    drawn = plot.draw(plot.parse_lines(episode_lines()), out, 900, 450, "test")
    assert png_size(out) == (900, 450)
    assert drawn["levels"] == ["hard", "ok", "soft"]
    assert drawn["actions"]["evict"] == 2 and drawn["actions"]["shrink"] == 1
    assert drawn["actions"]["abort"] == 1 and drawn["restarts"] == 1 and drawn["points"] == 9


def test_the_cli_plots_a_recording_and_reports_bad_files_in_one_line(tmp_path, capsys):
    rec = tmp_path / "rec.jsonl"
    rec.write_text("\n".join(episode_lines()) + "\n")
    out = tmp_path / "out.png"
    assert cli.main(["plot", str(rec), "-o", str(out), "--width", "640", "--height",
                     "320"]) == 0
    assert png_size(out) == (640, 320)
    assert "wrote" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"received": 1, "message": {"sequence": "1"}}\nnot json\n')
    assert cli.main(["plot", str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "error: line 2 is not JSON: Expecting value\n"
    with pytest.raises(OperatorError, match="no snapshot, sample or transition"):
        plot.parse_lines([watch.note_line("x", "down", T0)])
    assert cli.main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot read ")


def test_the_recorded_episode_in_docs_plots_at_its_size(tmp_path):
    """docs/episode.jsonl is a real cgroup-squeeze run (docs/operating-cli.md says how it
    was made): it goes ok -> soft -> hard and back, and the plot of it is a PNG."""
    recording = DOCS / "episode.jsonl"
    ep = plot.load_episode(recording)
    assert {OK, SOFT, HARD} <= set(ep.level)
    assert ep.level[0] == OK and ep.level[-1] == OK
    assert ep.actions, "the episode should show the enforcer acting"
    out = tmp_path / "episode.png"
    plot.draw(ep, out, 1200, 600, "episode")
    assert png_size(out) == (1200, 600)
    assert png_size(DOCS / "episode.png") == (1200, 600)
