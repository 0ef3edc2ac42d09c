"""Readings: the real machine, fake /proc and cgroup trees (v1 and v2), PSI, MLX samples.

The reader never calls MLX: MLX figures come from an engine thread's `MlxFigures`
sample, handed to `read()`; without one the MLX terms are unavailable (None).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from memory.readings import (
    UNLIMITED_THRESHOLD_BYTES,
    MemoryReader,
    MlxFigures,
    discover_cgroup,
    is_unlimited,
    parse_psi,
)

GIB = 1 << 30
V1_UNLIMITED = 9223372036854771712
ZERO = MlxFigures(0, 0, at=0.0)
PSI_QUIET = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


# -- the real machine -----------------------------------------------------------------


def test_reader_on_this_machine_returns_sane_values_and_sources():
    reader = MemoryReader(probe_device=False)
    r = reader.read()
    total = psutil.virtual_memory().total
    assert r.system_total_bytes == total
    assert 0 < r.footprint_bytes < total
    assert r.process_bytes == max(r.mlx_active_bytes or 0, r.footprint_bytes)
    assert (r.mlx_active_bytes, r.mlx_pool_bytes) == (None, None)  # no engine sample
    assert 0 < r.system_available_bytes <= total
    for key in ("mlx", "footprint", "system_available", "process", "system_total"):
        assert key in r.sources, key
    rss = psutil.Process().memory_info().rss
    assert abs(r.footprint_bytes - rss) < 64 * 1024 * 1024
    if r.container_limit_bytes is not None:
        assert 0 < r.container_limit_bytes < total * 4
    if r.os_pressure is not None:
        assert r.os_pressure in ("normal", "warning", "critical")
        assert "os_pressure" in r.sources
    reader.close()


@pytest.mark.skipif(
    not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists(), reason="needs cgroup v1"
)
def test_reader_finds_this_process_cgroup_v1():
    own = next(
        line.split(":", 2)[2]
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if "memory" in line.split(":")[1].split(",")
    )
    reader = MemoryReader(probe_device=False)
    assert reader.cgroup is not None and reader.cgroup.version == 1
    assert reader.cgroup.own_directory == os.path.normpath("/sys/fs/cgroup/memory" + own)
    assert reader.cgroup.levels[-1].directory == "/sys/fs/cgroup/memory"
    r = reader.read()
    assert r.sources["container"].startswith(("no limit", "/sys/fs/cgroup/memory"))


def test_read_memory_and_cost_of_a_read():
    fresh = MemoryReader()  # default discovery, device probe included
    r = fresh.read()
    fresh.close()
    assert r.process_bytes > 0
    reader = MemoryReader(probe_device=False)
    sample = MlxFigures(1, 2, at=0.0)
    reader.read(sample)
    start = time.perf_counter()
    for _ in range(200):
        reader.read(sample)
    per_read = (time.perf_counter() - start) / 200
    assert per_read < 0.002  # cheap: cached file descriptors, no discovery


# -- MLX samples ---------------------------------------------------------------------------


def test_an_engine_sample_is_used_and_a_missing_one_is_not_guessed(monkeypatch):
    import mlx.core as mx

    def forbidden() -> int:
        raise AssertionError("the reader called MLX")

    monkeypatch.setattr(mx, "get_active_memory", forbidden)
    monkeypatch.setattr(mx, "get_cache_memory", forbidden)
    reader = MemoryReader(probe_device=False)
    r = reader.read(MlxFigures(100 * GIB, 3 * GIB, at=0.0))
    assert (r.mlx_active_bytes, r.mlx_pool_bytes, r.process_bytes) == (
        100 * GIB,
        3 * GIB,
        100 * GIB,
    )
    assert r.sources["mlx"] == "engine thread sample"

    r = reader.read(None)
    assert (r.mlx_active_bytes, r.mlx_pool_bytes) == (None, None)
    assert r.process_bytes == r.footprint_bytes
    assert r.sources["mlx"].startswith("unavailable")
    assert r.pool_bytes == 0  # an unknown pool never defers work

    r = reader.read(MlxFigures(0, 0, at=0.0))  # a small active figure: footprint binds
    assert r.process_bytes == r.footprint_bytes and r.mlx_active_bytes == 0


# -- fake /proc and cgroup trees ---------------------------------------------------------------


def fake_proc(root: Path, cgroup: str, mountinfo: str, psi: str | None = PSI_QUIET) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    (proc / "self" / "statm").write_text("1000 2560 100 1 0 500 0\n")  # 2560 pages RSS
    (proc / "meminfo").write_text(
        "MemTotal: 65536000 kB\nMemFree: 1 kB\nMemAvailable: 2048000 kB\n"
    )
    if psi is not None:
        (proc / "pressure").mkdir()
        (proc / "pressure" / "memory").write_text(psi)
    return proc


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_parent_limit_binds_and_unlimited_is_skipped(tmp_path):
    mount = tmp_path / "cg" / "memory"
    own = mount / "svc" / "job"
    write(own / "memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    write(own / "memory.usage_in_bytes", "1000\n")
    write(mount / "svc" / "memory.limit_in_bytes", f"{2 * GIB}\n")
    write(mount / "svc" / "memory.usage_in_bytes", f"{GIB}\n")
    write(mount / "memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    write(mount / "memory.usage_in_bytes", "5\n")
    proc = fake_proc(
        tmp_path,
        "5:devices:/\n4:memory:/svc/job\n0::/\n",
        f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory\n",
    )
    reader = MemoryReader(proc_root=str(proc), probe_device=False)
    assert reader.cgroup.version == 1
    assert [lvl.directory for lvl in reader.cgroup.levels] == [
        str(own),
        str(mount / "svc"),
        str(mount),
    ]
    r = reader.read(ZERO)
    assert (r.container_limit_bytes, r.container_usage_bytes) == (2 * GIB, GIB)
    assert r.sources["container"] == str(mount / "svc" / "memory.limit_in_bytes")
    assert r.footprint_bytes == 2560 * os.sysconf("SC_PAGE_SIZE")
    assert r.sources["footprint"] == "rss /proc/self/statm"
    assert r.system_available_bytes == 2048000 * 1024
    assert r.os_pressure == "normal"

    # The limit is re-read every tick: an operator can lower it live.
    (mount / "svc" / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    assert reader.read(ZERO).container_limit_bytes == GIB


def test_cgroup_v1_with_a_container_root_mount(tmp_path):
    mount = tmp_path / "cg" / "memory"
    write(mount / "memory.limit_in_bytes", f"{3 * GIB}\n")
    write(mount / "memory.usage_in_bytes", f"{GIB}\n")
    proc = fake_proc(
        tmp_path,
        "4:memory:/docker/abc\n",
        f"35 31 0:32 /docker/abc {mount} rw,relatime - cgroup cgroup rw,memory\n",
    )
    reader = MemoryReader(proc_root=str(proc), probe_device=False)
    assert reader.cgroup.own_directory == str(mount)
    assert reader.read(ZERO).container_limit_bytes == 3 * GIB


def test_cgroup_v2_limit_usage_and_own_pressure_file(tmp_path):
    mount = tmp_path / "cg2"
    own = mount / "system.slice" / "plimsoll.service"
    write(mount / "cgroup.controllers", "memory\n")
    write(own / "cgroup.controllers", "memory\n")
    write(own / "memory.max", "max\n")
    write(own / "memory.current", f"{GIB}\n")
    write(
        own / "memory.pressure",
        "some avg10=12.50 avg60=1 avg300=0 total=9\nfull avg10=0.00 avg60=0 avg300=0 total=0\n",
    )
    write(mount / "system.slice" / "memory.max", f"{4 * GIB}\n")
    write(mount / "system.slice" / "memory.current", f"{2 * GIB}\n")
    proc = fake_proc(
        tmp_path,
        "0::/system.slice/plimsoll.service\n",
        f"30 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    reader = MemoryReader(proc_root=str(proc), probe_device=False)
    assert reader.cgroup.version == 2
    r = reader.read(ZERO)
    assert (r.container_limit_bytes, r.container_usage_bytes) == (4 * GIB, 2 * GIB)
    assert r.os_pressure == "warning"
    assert r.sources["os_pressure"].startswith("cgroup memory.pressure")


def test_no_cgroup_and_no_psi_are_none_not_guesses(tmp_path):
    proc = fake_proc(tmp_path, "", "", psi=None)
    reader = MemoryReader(
        proc_root=str(proc), cgroup_root=str(tmp_path / "none"), probe_device=False
    )
    r = reader.read(ZERO)
    assert reader.cgroup is None
    assert (r.container_limit_bytes, r.container_usage_bytes, r.os_pressure) == (None, None, None)
    assert "container" not in r.sources and "os_pressure" not in r.sources


def test_discover_cgroup_falls_back_to_the_standard_mounts(tmp_path):
    root = tmp_path / "sysfs"
    write(root / "memory" / "a" / "memory.limit_in_bytes", "1\n")
    info = discover_cgroup("4:memory:/a\n", "", default_root=str(root))
    assert info is not None and info.own_directory == str(root / "memory" / "a")


@pytest.mark.parametrize(
    ("limit", "unlimited"),
    [
        (None, True),
        (0, True),
        (V1_UNLIMITED, True),
        (UNLIMITED_THRESHOLD_BYTES, True),
        (64 * GIB * 4, True),  # >= 4 x RAM of a 64 GiB machine
        (64 * GIB * 4 - 1, False),
        (2 * GIB, False),
    ],
)
def test_is_unlimited(limit, unlimited):
    assert is_unlimited(limit, 64 * GIB) is unlimited


@pytest.mark.parametrize(
    ("text", "level"),
    [
        (PSI_QUIET, "normal"),
        ("some avg10=9.99 avg60=0 avg300=0 total=1\n", "normal"),
        ("some avg10=10.00 avg60=0 avg300=0 total=1\n", "warning"),
        (
            "some avg10=39.9 avg60=0 avg300=0 total=1\nfull avg10=9.9 avg60=0 avg300=0 total=1\n",
            "warning",
        ),
        ("some avg10=40.0 avg60=0 avg300=0 total=1\n", "critical"),
        (
            "some avg10=11 avg60=0 avg300=0 total=1\nfull avg10=10.0 avg60=0 avg300=0 total=1\n",
            "critical",
        ),
        ("", None),
        ("garbage\n", None),
        ("some avg10=x avg60=0\n", None),
    ],
)
def test_parse_psi_thresholds(text, level):
    assert parse_psi(text) == level
