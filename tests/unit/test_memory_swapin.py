"""Swap-in activity as one more OS pressure signal (Linux /proc/vmstat pswpin)."""

from memory.readings import (
    MemoryReader,
    MlxFigures,
    parse_swapins,
    swapin_pressure,
    worse,
)

VMSTAT = "nr_free_pages 1000\npswpin 12345\npswpout 99\n"


def test_parse_swapins():
    assert parse_swapins(VMSTAT) == 12345
    assert parse_swapins("nr_free_pages 1\n") is None
    assert parse_swapins(None) is None


def test_swapin_rate_grades():
    assert swapin_pressure(0) == "normal"
    assert swapin_pressure(1023) == "normal"
    assert swapin_pressure(1024) == "warning"
    assert swapin_pressure(16384) == "critical"


def test_the_worse_signal_wins():
    assert worse("normal", "warning") == "warning"
    assert worse("critical", "warning") == "critical"
    assert worse(None, "normal") == "normal"
    assert worse("warning", None) == "warning"


def test_swapin_rate_from_two_readings(tmp_path, monkeypatch):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "vmstat").write_text("pswpin 0\n")
    reader = MemoryReader(proc_root=str(proc), probe_device=False)
    times = iter([100.0, 101.0])
    import memory.readings as readings

    monkeypatch.setattr(readings.time, "monotonic", lambda: next(times))
    assert reader._swapin_level() is None  # no rate from one reading
    (proc / "vmstat").write_text("pswpin 20000\n")
    assert reader._swapin_level() == "critical"  # 20,000 pages in one second


def test_real_reader_reports_a_level():
    r = MemoryReader()
    r.read(MlxFigures(0, 0, at=0.0))
    second = r.read(None)
    assert second.os_pressure in ("normal", "warning", "critical")
