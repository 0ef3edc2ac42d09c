"""A memory balloon: a process that takes real memory, holds it and gives it back.

Memory is taken in anonymous ``mmap`` chunks of ``--step-mib`` and every page is
written, so it is resident and charged to the process's memory cgroup at once (an
untouched allocation costs nothing). Releasing unmaps the chunks: the memory goes back
to the system immediately, not to an allocator's free list.

Run it on its own::

    python -m tools.balloon --mib 2048 --step-mib 64 --hold-s 30

grows to 2 GiB in 64 MiB steps (``--step-delay-s`` between steps), holds it for 30 s and
exits. Without ``--hold-s`` it holds until a signal: SIGUSR1 releases everything and
keeps running, SIGUSR2 grows back to ``--mib``, SIGTERM/SIGINT release and exit.

With ``--control`` it also reads commands from stdin, one per line, and answers each
with one line ``held <MiB>`` once the change is resident::

    set N      hold exactly N MiB        grow N    take N MiB more
    shrink N   give N MiB back           release   give everything back
    status     just answer               quit      release and exit (EOF too)

``--oom-score-adj 1000`` makes the balloon the OOM killer's first choice in its cgroup,
so a test that squeezes a server next to it loses the balloon, never the server.

Tests use `Balloon`, which runs this module as a subprocess (optionally behind a
command prefix that moves it into a cgroup) and drives it over stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

MIB = 1 << 20
PAGE = mmap.PAGESIZE


class Reservoir:
    """Resident anonymous memory held as a stack of chunks of `step_bytes`."""

    def __init__(self, step_bytes: int = 16 * MIB) -> None:
        if step_bytes < PAGE:
            raise ValueError(f"step must be at least one page ({PAGE} bytes)")
        self.step_bytes = step_bytes - step_bytes % PAGE
        self._chunks: list[mmap.mmap] = []
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._held

    def set_bytes(self, target: int, delay_s: float = 0.0) -> int:
        """Grow or shrink to `target` bytes (rounded to pages); returns bytes held."""
        target = max(0, target - target % PAGE)
        with self._lock:
            while self._held < target:
                size = min(self.step_bytes, target - self._held)
                chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                # Write one byte per page: each write faults in a real, resident page.
                chunk[::PAGE] = b"\xa5" * (size // PAGE)
                self._chunks.append(chunk)
                self._held += size
                if delay_s and self._held < target:
                    time.sleep(delay_s)
            while self._held > target and self._chunks:
                chunk = self._chunks[-1]
                excess = self._held - target
                if len(chunk) <= excess:
                    self._chunks.pop()
                    self._held -= len(chunk)
                    chunk.close()
                else:
                    # Keep the head of the last chunk: replace it by a smaller one.
                    keep = len(chunk) - excess
                    smaller = mmap.mmap(-1, keep, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                    smaller[::PAGE] = b"\xa5" * (keep // PAGE)
                    self._chunks[-1] = smaller
                    chunk.close()
                    self._held -= excess
            return self._held

    def release(self) -> int:
        return self.set_bytes(0)


# ---------------------------------------------------------------------------
# the command-line process


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.balloon", description="Take, hold and give back real memory."
    )
    p.add_argument("--mib", type=float, default=0.0, help="MiB to take at start (default 0)")
    p.add_argument(
        "--step-mib", type=float, default=16.0, help="MiB taken per step (default %(default)s)"
    )
    p.add_argument(
        "--step-delay-s",
        type=float,
        default=0.0,
        help="pause between steps while growing (default %(default)s)",
    )
    p.add_argument(
        "--hold-s",
        type=float,
        default=None,
        help="hold this long, then release and exit (default: until a signal, "
        "'quit' or EOF with --control)",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="read commands from stdin and answer 'held <MiB>' to each",
    )
    p.add_argument(
        "--oom-score-adj",
        type=int,
        default=None,
        help="write this to /proc/self/oom_score_adj (1000: killed first)",
    )
    args = p.parse_args(argv)
    if args.mib < 0 or args.step_mib <= 0:
        p.error("--mib must be >= 0 and --step-mib > 0")
    return args


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _held_line(res: Reservoir) -> str:
    return f"held {res.held_bytes / MIB:.3f}"


def _command(res: Reservoir, line: str, delay_s: float) -> bool:
    """Apply one control command; False to exit."""
    parts = line.split()
    if not parts:
        return True
    cmd, arg = parts[0].lower(), (float(parts[1]) if len(parts) > 1 else 0.0)
    if cmd == "set":
        res.set_bytes(int(arg * MIB), delay_s)
    elif cmd == "grow":
        res.set_bytes(res.held_bytes + int(arg * MIB), delay_s)
    elif cmd == "shrink":
        res.set_bytes(res.held_bytes - int(arg * MIB))
    elif cmd == "release":
        res.release()
    elif cmd in ("quit", "exit"):
        res.release()
        return False
    elif cmd != "status":
        _say(f"error unknown command {cmd!r}")
        return True
    _say(_held_line(res))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.oom_score_adj is not None:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write(str(args.oom_score_adj))
    res = Reservoir(int(args.step_mib * MIB))
    stop = threading.Event()
    flags = {"release": False, "regrow": False}

    def on_term(signum, frame):  # noqa: ARG001
        stop.set()

    def on_usr1(signum, frame):  # noqa: ARG001
        flags["release"] = True

    def on_usr2(signum, frame):  # noqa: ARG001
        flags["regrow"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGUSR2, on_usr2)

    res.set_bytes(int(args.mib * MIB), args.step_delay_s)
    _say(f"ready pid {os.getpid()} " + _held_line(res))
    deadline = time.monotonic() + args.hold_s if args.hold_s is not None else None
    stdin_fd = sys.stdin.fileno() if args.control else None
    pending = b""
    while not stop.is_set():
        if flags["release"]:
            flags["release"] = False
            res.release()
            _say(_held_line(res))
        if flags["regrow"]:
            flags["regrow"] = False
            res.set_bytes(int(args.mib * MIB), args.step_delay_s)
            _say(_held_line(res))
        if deadline is not None and time.monotonic() >= deadline:
            break
        timeout = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
        if stdin_fd is None:
            time.sleep(timeout)
            continue
        try:
            ready, _, _ = select.select([stdin_fd], [], [], timeout)
        except InterruptedError:
            continue
        if not ready:
            continue
        data = os.read(stdin_fd, 4096)
        if not data:  # EOF: the controller went away
            break
        pending += data
        keep_going = True
        while keep_going and b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                keep_going = _command(res, line.decode(errors="replace"), args.step_delay_s)
            except (ValueError, IndexError) as exc:
                _say(f"error {exc}")
        if not keep_going:
            break
    res.release()
    _say(_held_line(res))
    return 0


# ---------------------------------------------------------------------------
# the test-side handle


class BalloonError(RuntimeError):
    pass


class Balloon:
    """Runs ``python -m tools.balloon --control`` and drives it over stdin.

    >>> b = Balloon(prefix=cgroup.prefix()).start()
    >>> b.set(512)      # returns once 512 MiB are resident
    >>> b.release(); b.stop()
    """

    def __init__(
        self,
        prefix: Sequence[str] = (),
        *,
        step_mib: float = 16.0,
        step_delay_s: float = 0.0,
        oom_score_adj: int | None = 1000,
        python: str = sys.executable,
        cwd: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.prefix = list(prefix)
        self.step_mib = step_mib
        self.step_delay_s = step_delay_s
        self.oom_score_adj = oom_score_adj
        self.python = python
        self.cwd = cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._pending = b""
        self.held_mib = 0.0
        self.lines: list[str] = []

    @property
    def pid(self) -> int:
        assert self.proc is not None, "balloon not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Balloon:
        cmd = [
            *self.prefix,
            self.python,
            "-m",
            "tools.balloon",
            "--control",
            "--step-mib",
            str(self.step_mib),
            "--step-delay-s",
            str(self.step_delay_s),
        ]
        if self.oom_score_adj is not None:
            cmd += ["--oom-score-adj", str(self.oom_score_adj)]
        self.proc = subprocess.Popen(
            cmd, cwd=self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        line = self._read_line()
        if not line.startswith("ready"):
            raise BalloonError(f"balloon did not start: {line!r}")
        return self

    def _read_line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            if not ready:
                raise BalloonError(f"balloon silent for {self.timeout_s}s")
            data = os.read(fd, 4096)
            if not data:
                code = self.proc.wait(5)
                raise BalloonError(
                    f"balloon exited with code {code} (SIGKILL, e.g. the "
                    f"OOM killer: {code == -signal.SIGKILL})"
                )
            self._pending += data
        raw, self._pending = self._pending.split(b"\n", 1)
        line = raw.decode(errors="replace").strip()
        self.lines.append(line)
        if "held " in line:
            self.held_mib = float(line.rsplit("held ", 1)[1])
        return line

    def command(self, line: str) -> float:
        """Send one command; returns MiB held once the balloon answered."""
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise BalloonError(f"balloon is not running (exit code {code})")
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode() + b"\n")
        except BrokenPipeError:
            raise BalloonError(f"balloon exited (code {self.proc.poll()})") from None
        answer = self._read_line()
        if not answer.startswith("held "):
            raise BalloonError(f"balloon answered {answer!r} to {line!r}")
        return self.held_mib

    def set(self, mib: float) -> float:
        return self.command(f"set {mib}")

    def grow(self, mib: float) -> float:
        return self.command(f"grow {mib}")

    def shrink(self, mib: float) -> float:
        return self.command(f"shrink {mib}")

    def release(self) -> float:
        return self.command("release")

    def stop(self, timeout: float = 10.0) -> int | None:
        """Release and exit; kills it if it does not go. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(b"quit\n")
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        return proc.returncode

    def __enter__(self) -> Balloon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
