"""The test machinery itself: cgroup discovery, OOM counters, the balloon.

The parsers run everywhere; the rest needs a child memory cgroup (root) and skips
with the reason where none can be made.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tools.balloon import MIB, Balloon, BalloonError, Reservoir
from tools.harness.cgroup import (
    CgroupUnavailable,
    find_own_cgroup,
    parse_v1_oom,
    parse_v2_events,
)
from tools.harness.server import ROOT

MOUNTINFO_V1 = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PROC_CGROUP_V1 = "5:devices:/\n4:memory:/process_api/abc\n0::/\n"
MOUNTINFO_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_parsers():
    counters = parse_v1_oom("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", "7\n")
    assert (counters.oom_kill, counters.failcnt, counters.oom) == (3, 7, 0)
    counters = parse_v2_events("low 0\nhigh 2\nmax 5\noom 1\noom_kill 1\noom_group_kill 0\n")
    assert (counters.oom_kill, counters.failcnt, counters.oom) == (1, 5, 1)


def test_find_own_cgroup_v1_and_v2():
    own = find_own_cgroup(PROC_CGROUP_V1, MOUNTINFO_V1, exists=lambda p: True)
    assert own.version == 1
    assert str(own.directory) == "/sys/fs/cgroup/memory/process_api/abc"
    # A mount whose root is a sub-cgroup (a container's namespaced view).
    nested = "35 31 0:32 /process_api /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    own = find_own_cgroup(PROC_CGROUP_V1, nested, exists=lambda p: True)
    assert str(own.directory) == "/sys/fs/cgroup/memory/abc"
    own = find_own_cgroup(
        "0::/user.slice/test\n", MOUNTINFO_V2, read_text=lambda p: "cpu io memory pids\n"
    )
    assert own.version == 2
    assert str(own.directory) == "/sys/fs/cgroup/user.slice/test"


def test_find_own_cgroup_reasons():
    with pytest.raises(CgroupUnavailable, match="no memory line"):
        find_own_cgroup("5:devices:/\n", MOUNTINFO_V1)
    with pytest.raises(CgroupUnavailable, match="not mounted"):
        find_own_cgroup("4:memory:/x\n", "")
    with pytest.raises(CgroupUnavailable, match="no memory controller"):
        find_own_cgroup("0::/x\n", MOUNTINFO_V2, read_text=lambda p: "cpu io\n")
    with pytest.raises(CgroupUnavailable, match="has no memory.limit_in_bytes"):
        find_own_cgroup(PROC_CGROUP_V1, MOUNTINFO_V1, exists=lambda p: False)


def test_reservoir_in_process():
    res = Reservoir(4 * MIB)
    assert res.set_bytes(10 * MIB) == 10 * MIB
    assert res.set_bytes(3 * MIB) == 3 * MIB
    assert res.release() == 0


def test_balloon_cli_hold_and_exit():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.balloon",
            "--mib",
            "32",
            "--step-mib",
            "8",
            "--hold-s",
            "0.2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0].startswith("ready pid") and lines[0].endswith("held 32.000"), out.stdout
    assert "held 0.000" in lines[1], out.stdout


def test_balloon_cli_signals():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.balloon", "--mib", "16"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip().endswith("held 16.000")
        proc.send_signal(signal.SIGUSR1)
        assert proc.stdout.readline().strip() == "held 0.000"
        proc.send_signal(signal.SIGUSR2)
        assert proc.stdout.readline().strip() == "held 16.000"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_balloon_is_charged_to_its_cgroup_and_oom_killed_past_the_limit(cgroups):
    cg = cgroups(192 * MIB)
    assert cg.pids() == []
    with Balloon(prefix=cg.prefix(), step_mib=16) as balloon:
        assert cg.pids() == [balloon.pid], "the prefix did not move the balloon into the cgroup"
        base = cg.usage_bytes()
        balloon.set(128)
        grown = cg.usage_bytes()
        assert grown - base >= 120 * MIB, (base, grown)  # touched pages are resident
        balloon.release()
        time.sleep(0.1)
        assert cg.usage_bytes() - base < 16 * MIB, "released memory was not given back"
        before = cg.oom_counters()
        with pytest.raises(BalloonError, match="SIGKILL"):
            balloon.set(400)  # past the 192 MiB limit: the OOM killer ends it
        after = cg.oom_counters()
        print(f"\n{cg.describe()} counters before {before} after {after}")
        assert after.oom_kill == before.oom_kill + 1
        assert balloon.proc is not None and balloon.proc.returncode == -signal.SIGKILL


def test_cgroup_destroy_kills_what_is_left(cgroups):
    cg = cgroups(64 * MIB)
    proc = subprocess.Popen([*cg.prefix(), "sleep", "300"])
    deadline = time.monotonic() + 5
    while proc.pid not in cg.pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cg.pids() == [proc.pid]
    cg.destroy()
    assert proc.wait(5) == -signal.SIGKILL
    assert not cg.path.exists()
    cg.destroy()  # idempotent
