"""py-spy's collapsed stacks (raw format, --threads): self and inclusive shares, printed."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections import Counter, defaultdict
from pathlib import Path

from tools.harness.server import ROOT


def find_py_spy() -> str | None:
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (file.py)' so lines of one function merge."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    file = m.group("file")
    parts = Path(file).parts
    if "site-packages" in parts:
        file = "/".join(parts[parts.index("site-packages") + 1 :])
    elif str(ROOT) in file:
        file = os.path.relpath(file, ROOT)
    else:
        file = "/".join(parts[-2:])
    return f"{m.group('func')} ({file})"


def analyze_collapsed(path: Path, top: int = 25) -> dict:
    """Self and inclusive shares of py-spy's collapsed stacks (raw format, --threads)."""
    total = 0
    by_thread: Counter[str] = Counter()
    self_t: Counter[str] = Counter()
    incl_t: Counter[str] = Counter()
    self_by_thread: dict[str, Counter[str]] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0]
        m = re.search(r'"([^"]*)"', thread)
        thread = m.group(1) if m else thread
        body = [_short(f) for f in frames[1:]] or ["<thread>"]
        total += n
        by_thread[thread] += n
        self_t[body[-1]] += n
        self_by_thread[thread][body[-1]] += n
        for f in set(body):
            incl_t[f] += n

    def pct(c: Counter[str]) -> list[tuple[str, float]]:
        return [(k, 100.0 * v / total) for k, v in c.most_common(top)] if total else []

    return {
        "samples": total,
        "threads": pct(by_thread),
        "self": pct(self_t),
        "inclusive": pct(incl_t),
        "self_by_thread": {
            t: [(k, 100.0 * v / total) for k, v in c.most_common(12)]
            for t, c in self_by_thread.items()
        },
    }


def print_profile(report: dict, title: str) -> None:
    print(f"\n### {title}: {report['samples']} samples, py-spy mode {report['mode']}")
    for heading, key in (
        ("threads", "threads"),
        ("self time", "self"),
        ("inclusive time", "inclusive"),
    ):
        print(f"\n{heading}:")
        for name, share in report[key]:
            print(f"  {share:6.1f}%  {name}")
    for thread, rows in report["self_by_thread"].items():
        print(f"\nself time in thread {thread}:")
        for name, share in rows:
            print(f"  {share:6.1f}%  {name}")
