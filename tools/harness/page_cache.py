"""Keep the demo models' files in the page cache for the length of a test run.

Machines like the CI's page out file cache that has gone unread for about a minute (the
kernel's proactive reclaim, DAMON), and read it back from a disk at ~30 MB/s: a test that
loads the medium model (306 MB) a minute after the last one waited ~10 s on the disk, and
a test in a child cgroup could find the pages charged to its own cgroup on the way back
(`tests/pressure/harness.warm_page_cache` charges them to the test process instead).
`ModelFilePins` maps each model file read-only into this process and, once the file is in
the page cache (a test has read it), locks it (`mlock`): locked pages are never reclaimed,
so no later test reads them back, into its own cgroup or at all. It never reads a file from
the disk itself: a run that uses one small model does not wait for the others.
`pinned_model_files` runs it in a child process, so that the locked pages count in that
process's memory and not in the caller's (an in-process server reads the test process's
own RSS). They do leave the machine's MemAvailable: at most the budget.

Best effort: where locking is not allowed (no CAP_IPC_LOCK and a small RLIMIT_MEMLOCK)
or the budget is spent, a file is simply left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def lock_cached_file(path: Path) -> tuple[int, int] | None:
    """Map `path` read-only and, if every page of it is in the page cache, lock it in
    memory: (address, size); None while it is not (all) cached. OSError where mapping or
    locking is not allowed."""
    st = path.stat()
    if st.st_size == 0 or st.st_uid != os.geteuid():
        # mincore reports every page of a file the caller does not own as resident.
        return None
    size = st.st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)  # the mapping keeps the file
    if addr in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"mmap {path}")
    resident = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    # Bit 0 of each byte: the page is resident (Linux leaves the other bits 0).
    if _libc.mincore(addr, size, resident) != 0 or b"\x00" in resident.raw:
        _libc.munmap(addr, size)  # not read yet: not ours to read
        return None
    if _libc.mlock(addr, size) != 0:
        errno = ctypes.get_errno()
        _libc.munmap(addr, size)
        raise OSError(errno, f"mlock {path}")
    return addr, size


class ModelFilePins:
    """Every file of each complete model folder under `roots` (a folder of model folders,
    each complete once its config.json exists), locked once it is in the page cache, up
    to `budget_bytes` in all; a background thread looks again every `period_s`."""

    def __init__(self, roots: list[Path], budget_bytes: int, period_s: float = 5.0) -> None:
        self.roots = roots
        self.budget_bytes = budget_bytes
        self.period_s = period_s
        self.locked: dict[Path, tuple[int, int]] = {}
        self.refused: set[Path] = set()  # over the budget, or locking is not allowed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="model-file-pins", daemon=True)

    @property
    def locked_bytes(self) -> int:
        return sum(size for _, size in self.locked.values())

    def start(self) -> ModelFilePins:
        self._thread.start()
        return self

    def scan(self) -> None:
        for root in self.roots:
            if not root.is_dir():
                continue
            for folder in sorted(root.iterdir()):
                if folder.name.startswith(".") or not (folder / "config.json").is_file():
                    continue
                for path in sorted(folder.iterdir()):
                    if path.is_file() and path not in self.locked and path not in self.refused:
                        self._pin(path)

    def _pin(self, path: Path) -> None:
        if self.locked_bytes + path.stat().st_size > self.budget_bytes:
            self.refused.add(path)
            return
        try:
            got = lock_cached_file(path)
        except OSError as err:
            log.debug("model file pins: %s", err)
            self.refused.add(path)
            return
        if got is not None:
            self.locked[path] = got

    def _run(self) -> None:
        while True:
            try:
                self.scan()
            except OSError as err:  # a folder replaced while we looked: next time
                log.debug("model file pins: %s", err)
            if self._stop.wait(self.period_s):
                return

    def stop(self) -> None:
        """Unlock everything; if the thread is still inside a lock after 30 s, nothing (the
        process's exit unlocks it all)."""
        self._stop.set()
        self._thread.join(30)
        if not self._thread.is_alive():
            for addr, size in self.locked.values():
                _libc.munmap(addr, size)
            self.locked.clear()


def pin_until_stdin_closes(roots: list[str], budget_bytes: int) -> None:
    """`ModelFilePins` in this process until its standard input closes: the process that
    started it ended, however it ended."""
    pins = ModelFilePins([Path(r) for r in roots], budget_bytes).start()
    try:
        sys.stdin.buffer.read()
    finally:
        pins.stop()


_CHILD = ("import sys; from tools.harness.page_cache import pin_until_stdin_closes as run; "
          "run(sys.argv[2:], int(sys.argv[1]))")


@contextmanager
def pinned_model_files(roots: list[Path], budget_bytes: int) -> Iterator[subprocess.Popen]:
    """`ModelFilePins` over `roots` in a child process for the duration of the block."""
    root = Path(__file__).resolve().parent.parent.parent
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(budget_bytes),
                             *map(str, roots)], cwd=root, stdin=subprocess.PIPE)
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
