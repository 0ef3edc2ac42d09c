"""`plimsoll watch` without a terminal: the state fed by stream messages and the pure
rendering of it (service/watch.py)."""

from __future__ import annotations

import io
import json

from google.protobuf import timestamp_pb2
from rich.console import Console

from plimsoll.v1 import control_pb2, types_pb2
from service import plot, watch

MiB = 1 << 20
T0 = 1_800_000_000.0
OK, SOFT, HARD = (types_pb2.PRESSURE_LEVEL_OK, types_pb2.PRESSURE_LEVEL_SOFT,
                  types_pb2.PRESSURE_LEVEL_HARD)


def limits(ceiling_mib: int = 200) -> types_pb2.MemoryLimits:
    return types_pb2.MemoryLimits(
        ceiling_bytes=ceiling_mib * MiB, soft_bytes=int(0.85 * ceiling_mib * MiB),
        hard_bytes=int(0.95 * ceiling_mib * MiB), binding_term=types_pb2.CEILING_TERM_CONTAINER)


def readings(usage_mib: float, pool_mib: float = 4) -> types_pb2.MemoryReadings:
    return types_pb2.MemoryReadings(process_bytes=int(usage_mib * MiB),
                                    mlx_pool_bytes=int(pool_mib * MiB))


def stamp(at: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(at * 1e9))
    return ts


def snapshot(seq: int, usage_mib: float, level: int = OK, at: float = T0,
             **kw) -> control_pb2.WatchPressureResponse:
    return control_pb2.WatchPressureResponse(
        sequence=seq, event_time=stamp(at), snapshot=control_pb2.PressureSnapshot(
            level=level, readings=readings(usage_mib), limits=limits(),
            admission=types_pb2.AdmissionState(session_bank_bytes=3 * MiB, reservations=1,
                                               reserved_bytes=2 * MiB), **kw))


def sample(seq: int, usage_mib: float, level: int, at: float) -> control_pb2.WatchPressureResponse:
    return control_pb2.WatchPressureResponse(
        sequence=seq, event_time=stamp(at), sample=control_pb2.PressureSample(
            level=level, readings=readings(usage_mib), limits=limits(),
            admission=types_pb2.AdmissionState(paused=level >= SOFT,
                                               session_bank_bytes=3 * MiB)))


def transition(seq: int, a: int, b: int, usage_mib: float, at: float,
               replayed: bool = False) -> control_pb2.WatchPressureResponse:
    return control_pb2.WatchPressureResponse(
        sequence=seq, event_time=stamp(at), replayed=replayed,
        transition=control_pb2.PressureTransition(
            from_level=a, to_level=b, readings=readings(usage_mib), limits=limits(),
            reason=f"usage {usage_mib} MiB >= soft 170 MiB"))


def action(seq: int, kind: int, at: float, **kw) -> control_pb2.WatchPressureResponse:
    return control_pb2.WatchPressureResponse(
        sequence=seq, event_time=stamp(at), action=control_pb2.EnforcerAction(kind=kind, **kw))


def screen(state: watch.WatchState, width: int = 150) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(watch.render(state, T0 + 60, bar_width=60))
    return console.export_text()


def squeezed_state() -> watch.WatchState:
    state = watch.WatchState("127.0.0.1:50051")
    for msg in (snapshot(5, 120), sample(6, 150, OK, T0 + 1),
                transition(7, OK, SOFT, 175, T0 + 2),
                action(8, control_pb2.ENFORCER_ACTION_KIND_EVICT_MODEL, T0 + 3,
                       model_id="demo-small", bytes_freed=64 * MiB, level=SOFT,
                       reason="idle LRU model at soft pressure"),
                sample(9, 172, SOFT, T0 + 4)):
        watch.apply(state, msg, T0 + 5)
    watch.on_status(state, control_pb2.GetMemoryStatusResponse(models=[
        control_pb2.ModelInfo(model_id="demo-tiny", state=control_pb2.MODEL_STATE_READY,
                              measured_bytes=int(2.5 * MiB), pinned=True, is_default=True,
                              batch_cap=32)]), T0 + 58)
    return state


def test_the_dashboard_shows_level_marks_figures_models_transitions_and_actions():
    state = squeezed_state()
    text = screen(state)
    assert " SOFT " in text and "connected" in text and "sequence 9" in text
    assert "usage 172.0 MiB (86.0% of the ceiling)" in text
    assert "soft 170.0 MiB" in text and "hard 190.0 MiB" in text
    assert "ceiling 200.0 MiB (binding: container)" in text
    assert "pool 4.0 MiB" in text and "bank 3.0 MiB" in text
    assert "admissions paused" in text
    assert "demo-tiny*" in text and "pinned" in text and "2.5 MiB" in text
    assert "ok → soft usage 175.0 MiB >= soft 170.0 MiB; usage 175 MiB >= soft 170 MiB" in text
    assert "evict_model" in text and "demo-small" in text and "64.0 MiB" in text
    assert "idle LRU model at soft pressure" in text
    # The sparkline holds the four readings, rising.
    line = next(li for li in text.splitlines() if li.strip("│ ").startswith("usage  "))
    spark = line.split("usage  ", 1)[1].split()[0]
    assert len(spark) == 4 and spark[0] == watch.SPARK[0] and spark[-1] != spark[0]


def test_the_bar_letters_the_marks_where_they_fall():
    bar = watch.usage_bar(100 * MiB, limits(200), 40, "ok").plain.splitlines()
    assert len(bar) == 2 and len(bar[0]) == 40
    assert bar[0].count(watch.BAR_FILL) == 20  # 100 of 200 MiB
    assert bar[1].index("S") == 34 and bar[1].index("H") == 38 and bar[1].index("C") == 39
    assert bar[0][34] == bar[0][38] == bar[0][39] == watch.MARK
    over = watch.usage_bar(250 * MiB, limits(200), 40, "hard").plain.splitlines()
    assert over[0].count(watch.BAR_FILL) == 40 - 3  # full, under the three marks
    assert over[1].index("C") == 32  # the scale grows to the usage: 200 / 250 of 40


def test_sparkline_scales_and_keeps_noise_low():
    assert watch.sparkline([1, 2, 3, 4, 5, 6, 7, 8], 8) == watch.SPARK
    assert watch.sparkline([5, 5, 5], 10) == watch.SPARK[0] * 3
    assert watch.sparkline(list(range(100)), 5) == watch.sparkline([95, 96, 97, 98, 99], 5)
    assert set(watch.sparkline([100, 101, 100], 3, min_span=100)) <= set(watch.SPARK[:2])
    assert watch.sparkline([], 5) == "" and watch.sparkline([1], 0) == ""


def test_a_lower_snapshot_sequence_after_a_break_is_a_restarted_server():
    state = squeezed_state()
    watch.on_down(state, "UNAVAILABLE: cannot reach a server at 127.0.0.1:50051", T0 + 10)
    text = screen(state)
    assert "disconnected" in text and "reconnecting (attempt 1)" in text
    assert state.seen_before_reconnect == 9
    watch.on_down(state, "UNAVAILABLE: cannot reach a server", T0 + 11)
    assert state.attempts == 2 and state.seen_before_reconnect == 9
    watch.apply(state, snapshot(2, 110, at=T0 + 12), T0 + 12)
    assert state.restarts == 1 and state.connected and state.last_sequence == 2
    text = screen(state)
    assert "server restarted: reconnected with a fresh snapshot (sequence 2, 9 seen before)" \
        in text
    assert " OK " in text and "restarts seen 1" in text


def test_a_snapshot_from_another_instance_is_a_restart_even_numbered_higher():
    """The new process may have published more than the old one had by the time the
    dashboard reconnects: its instance, not its numbers, says it is new."""
    state = watch.WatchState("127.0.0.1:50051")

    def snap(seq: int, instance: str, at: float) -> control_pb2.WatchPressureResponse:
        msg = snapshot(seq, 110, at=at)
        msg.instance = instance
        return msg

    watch.apply(state, snap(5, "a1", T0), T0)
    watch.on_down(state, "UNAVAILABLE: cannot reach a server", T0 + 1)
    watch.apply(state, snap(40, "b2", T0 + 2), T0 + 2)  # higher, yet another process
    assert state.restarts == 1 and "server restarted" in state.notice
    watch.on_down(state, "the server ended the stream", T0 + 3)
    watch.apply(state, snap(41, "b2", T0 + 4), T0 + 4)  # the same process again
    assert state.restarts == 1 and state.notice.startswith("reconnected:")


def test_a_resumed_stream_of_the_same_process_says_what_it_replayed():
    state = squeezed_state()
    watch.on_down(state, "RESOURCE_EXHAUSTED SUBSCRIBER_OVERFLOW: fell behind", T0 + 10)
    watch.apply(state, transition(11, SOFT, OK, 120, T0 + 10.5, replayed=True), T0 + 11)
    watch.apply(state, snapshot(12, 118, at=T0 + 11), T0 + 11)
    assert state.restarts == 0
    assert state.notice == ("reconnected: fresh snapshot, 1 missed event(s) replayed after "
                            "sequence 9")
    text = screen(state)
    assert "soft → ok" in text and "(replayed)" in text
    watch.on_down(state, "the server ended the stream", T0 + 20)
    watch.apply(state, snapshot(30, 118, at=T0 + 21, replay_incomplete=True), T0 + 21)
    assert "replay incomplete" in state.notice


def test_repeated_actions_of_a_kind_and_model_fold_into_one_line():
    state = watch.WatchState("x")
    watch.apply(state, snapshot(1, 100), T0)
    cap = control_pb2.ENFORCER_ACTION_KIND_BATCH_CAP
    aux = control_pb2.ENFORCER_ACTION_KIND_CLEAR_AUX_CACHES
    for i, n in enumerate((31, 30, 29)):
        watch.apply(state, action(2 + 2 * i, cap, T0 + i, model_id="m", reason=f"cap {n}",
                                  level=SOFT), T0 + i)
        watch.apply(state, action(3 + 2 * i, aux, T0 + i, bytes_freed=MiB, level=SOFT), T0 + i)
    watch.apply(state, action(9, cap, T0 + 4, model_id="other", reason="cap 3"), T0 + 4)
    assert [(a.kind, a.model_id, a.count) for a in state.actions] == [
        ("batch_cap", "m", 3), ("clear_aux_caches", "", 3), ("batch_cap", "other", 1)]
    assert state.actions[1].bytes_freed == 3 * MiB
    text = screen(state)
    assert "batch_cap ×3" in text and "cap 31 … cap 29" in text
    assert "clear_aux_caches ×3" in text and "3.0 MiB" in text


def test_model_actions_and_transitions_ask_for_a_fresh_model_list():
    state = watch.WatchState("x")
    assert watch.apply(state, snapshot(1, 100), T0)
    assert not watch.apply(state, sample(2, 100, OK, T0), T0)
    assert watch.apply(state, transition(3, OK, SOFT, 180, T0), T0)
    assert watch.apply(state, action(4, control_pb2.ENFORCER_ACTION_KIND_EVICT_MODEL, T0), T0)
    assert not watch.apply(state, action(5, control_pb2.ENFORCER_ACTION_KIND_BATCH_CAP, T0), T0)


def test_before_any_snapshot_it_says_it_is_waiting():
    text = screen(watch.WatchState("127.0.0.1:1"))
    assert "waiting for the first snapshot" in text and "disconnected" in text


def test_plain_lines_and_records_round_trip_into_the_plot():
    state = watch.WatchState("x")
    msgs = [snapshot(1, 120), transition(2, OK, SOFT, 175, T0 + 1),
            action(3, control_pb2.ENFORCER_ACTION_KIND_SHRINK_SESSIONS, T0 + 2,
                   bytes_freed=MiB, reason="shrink at soft", level=SOFT)]
    lines = []
    for msg in msgs:
        watch.apply(state, msg, T0 + 3)
        lines.append(watch.plain_line(state, msg))
    assert lines[0].startswith("connected: snapshot at sequence 1: level ok, usage 120.0 MiB")
    assert "transition ok -> soft" in lines[1]
    assert "action shrink_sessions - freed 1.0 MiB at soft: shrink at soft" in lines[2]
    assert watch.plain_line(state, sample(4, 1, OK, T0)) is None
    records = [watch.record_line(m, T0 + i) for i, m in enumerate(msgs)]
    records.append(watch.note_line("server restarted", "restarted", T0 + 5))
    first = json.loads(records[0])
    assert first["received"] == T0 and first["message"]["snapshot"]["level"] == "PRESSURE_LEVEL_OK"
    ep = plot.parse_lines(records)
    assert ep.level == [OK, SOFT] and ep.usage == [120 * MiB, 175 * MiB]
    assert ep.actions == [(2.0, control_pb2.ENFORCER_ACTION_KIND_SHRINK_SESSIONS, "")]
    assert ep.restarts == [5.0]
