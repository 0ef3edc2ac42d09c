"""`plimsoll watch` on a real terminal: tmux runs it against a real server and the test
reads the screen (`tmux capture-pane -p`).

- A squeeze: the server runs in a child memory cgroup whose limit the test lowers, so
  the ceiling's container term falls below what the server uses and the level really
  goes ok -> soft, then back when the limit is raised again (skipped where no child
  memory cgroup can be made).
- A restart: the server is killed and a new one started on the same port; the screen
  must say it reconnected with a fresh snapshot of a restarted server, and the
  recording (--record) must plot.
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from plimsoll.v1 import control_pb2
from service import cli
from tests.support.processes import run_side_by_side
from tests.unit.test_plot import png_size
from tools.harness.cgroup import CgroupUnavailable, ChildCgroup, limit_for_ceiling
from tools.harness.server import ROOT, ServerProcess, serving, start_server

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]

MIB = 1 << 20
POLL = ("--poll-active", "0.25", "--poll-idle", "0.25", "--poll-empty", "0.25")


class Tmux:
    """One command in a detached tmux session on a private tmux server (its own socket),
    so nothing here touches anyone else's tmux."""

    def __init__(self, command: str, width: int = 160, height: int = 50) -> None:
        self.socket = f"plimsoll-test-{uuid.uuid4().hex[:8]}"
        self._tmux("new-session", "-d", "-s", "w", "-x", str(width), "-y", str(height),
                   command)
        self._tmux("set-option", "-t", "w", "remain-on-exit", "on")

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True,
                              capture_output=True, text=True, timeout=10).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "w")

    def wait_for(self, ok: Callable[[str], bool], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            if ok(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"the screen never showed {what} in {timeout}s:\n{text}")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "w", *keys)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=10)


def watch_command(port: int, *extra: str) -> str:
    argv = [sys.executable, "-m", "service.cli", "watch", "--port", str(port),
            "--models-every", "1", *extra]
    # The test process may carry COLUMNS/LINES, which rich would take over the pane's size.
    return f"unset COLUMNS LINES; cd {shlex.quote(str(ROOT))} && exec {shlex.join(argv)}"


@pytest.fixture()
def tmux() -> Iterator[Callable[[str], Tmux]]:
    made: list[Tmux] = []

    def start(command: str) -> Tmux:
        made.append(Tmux(command))
        return made[-1]

    yield start
    for t in made:
        t.close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_path) -> Iterator[ServerProcess]:
    """This module's own server, polling fast even when idle, so samples flow."""
    with serving(tmp_path_factory.mktemp("srv"), "--memory-guard-gb", "8", *POLL) as s:
        yield s


def status(srv: ServerProcess) -> control_pb2.GetMemoryStatusResponse:
    with srv.stubs() as (control, _):
        return control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=10)


def test_the_dashboard_shows_a_real_squeeze_and_its_release(tmp_path, tmux, demo_path):
    try:
        cg = ChildCgroup.create(1024 * MIB)
    except CgroupUnavailable as exc:
        pytest.skip(f"a real squeeze needs a child memory cgroup: {exc.reason}")
    srv = None
    try:
        # Soft at half the ceiling: the soft band (0.5 to 0.95 of the ceiling) is wide
        # enough that the server's own few MiB of drift cannot skip it.
        srv = start_server(tmp_path, "--memory-guard-gb", "8", "--soft-fraction", "0.5",
                           *POLL, prefix=cg.prefix())
        screen = tmux(watch_command(srv.port))
        text = screen.wait_for(lambda s: " OK " in s and "demo-tiny" in s, 30, "level OK")
        assert "binding: container" in text and "transitions" in text
        usage = status(srv).readings.process_bytes
        total = status(srv).readings.system_total_bytes
        # The container term (limit less its reserve) becomes usage / 0.7: mid-soft.
        cg.set_limit(limit_for_ceiling(int(usage / 0.7), total))
        # The transition can be drawn a sample before the admission state that says
        # paused: wait for the frame that has both.
        text = screen.wait_for(lambda s: " SOFT " in s and "ok → soft" in s
                               and "admissions paused" in s, 20,
                               "the squeeze (SOFT, ok → soft, admissions paused)")
        st = status(srv)
        ceiling = st.limits.ceiling_bytes
        assert ceiling < 1.2 * usage / 0.7, st.limits
        legend = next(line for line in text.splitlines() if "ceiling" in line and "soft" in line)
        for mark in (" soft ", " hard ", " ceiling ", "(binding: container)"):
            assert mark in legend, legend
        # The line under the bar letters the marks where they fall, in order.
        letters = next(line for line in text.splitlines()
                       if "S" in line and set(line.strip("│ ")) <= set("SHC "))
        assert letters.index("S") < letters.index("H") < letters.index("C"), letters
        cg.set_limit(1024 * MIB)
        text = screen.wait_for(lambda s: " OK " in s and "soft → ok" in s, 20,
                               "the release (OK, soft → ok)")
        assert "ok → soft" in text  # both transitions stay listed
        assert cg.oom_counters().oom_kill == 0
    finally:
        if srv is not None:
            srv.stop(signal.SIGKILL, 10)
        cg.destroy()


def test_the_dashboard_says_when_the_server_restarted_and_the_recording_plots(tmp_path, tmux,
                                                                            demo_path):
    record = tmp_path / "watch.jsonl"
    first = start_server(tmp_path, "--memory-guard-gb", "8", *POLL)
    second = None
    try:
        screen = tmux(watch_command(first.port, "--record", str(record)))
        text = screen.wait_for(lambda s: " OK " in s and "demo-tiny" in s, 30, "level OK")
        assert "connected: snapshot at sequence" in text
        for mark in (" soft ", " hard ", " ceiling "):
            assert mark in text
        # Let a few samples go by so the old process's sequence is clearly ahead: past the
        # snapshot's own sequence (which counts what the server published before we came).
        start = int(text.split("snapshot at sequence ", 1)[1].split()[0])
        screen.wait_for(lambda s: "sequence " in s and int(
            s.split("sequence ", 1)[1].split()[0]) >= start + 3, 20,
            f"sequence >= {start + 3}")
        first.stop(signal.SIGKILL, 10)
        screen.wait_for(lambda s: "disconnected" in s and "reconnecting" in s, 20,
                        "the break")
        # The same port: start_server's own --port comes first and the last one wins;
        # the handle is pointed at it before waiting for SERVING.
        second = start_server(tmp_path, "--memory-guard-gb", "8", *POLL,
                              "--port", str(first.port), wait=False)
        second.port = first.port
        second.wait_serving(60)
        text = screen.wait_for(lambda s: "server restarted" in s, 30, "server restarted")
        assert "reconnected with a fresh snapshot" in text and " OK " in text
        assert "restarts seen 1" in text and "connected · sequence" in text
        screen.keys("C-c")
        screen.wait_for(lambda s: "Pane is dead" in s or "plimsoll watch" not in s, 10,
                        "the dashboard exiting on Ctrl-C")
    finally:
        for srv in (first, second):
            if srv is not None:
                srv.stop(signal.SIGKILL, 10)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    notes = [line["note"] for line in lines if "note" in line]
    assert "down" in notes and "restarted" in notes
    kinds = [next(k for k in ("snapshot", "sample", "transition", "action")
                  if k in line["message"]) for line in lines if "message" in line]
    assert kinds.count("snapshot") == 2 and "sample" in kinds
    out = tmp_path / "restart.png"
    assert cli.main(["plot", str(record), "-o", str(out), "--width", "800", "--height",
                     "400"]) == 0
    assert png_size(out) == (800, 400)


def test_without_a_terminal_it_prints_lines_and_json_lines(tmp_path, srv):
    """Not a TTY: one plain line per snapshot, transition and action; --json: one JSON
    line per stream message, samples included."""
    base = [sys.executable, "-m", "service.cli", "watch", "--port", str(srv.port),
            "--duration", "2"]
    plain, as_json = run_side_by_side([base, [*base, "--json"]], cwd=ROOT)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.startswith("connected: snapshot at sequence "), plain.stdout
    assert "soft" in plain.stdout and "ceiling 8192.0 MiB" in plain.stdout
    assert as_json.returncode == 0, as_json.stderr
    docs = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert "snapshot" in docs[0]["message"] and docs[0]["received"] > 0
    assert any("sample" in d["message"] for d in docs[1:]), docs
