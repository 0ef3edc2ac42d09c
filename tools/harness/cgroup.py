"""A child memory cgroup, for the real-memory-limit tests and the benchmarks.

`ChildCgroup.create(limit_bytes)` makes ``plimsoll-<uuid>`` directly under this
process's *own* memory cgroup (cgroup v1 ``memory`` hierarchy, or cgroup v2 when the
own cgroup is on the unified hierarchy with the memory controller), sets its limit
(v1: ``memory.limit_in_bytes`` and, when present, ``memory.memsw.limit_in_bytes`` so
swap cannot stretch it; v2: ``memory.max`` and ``memory.swap.max = 0``; a limit of
None means none: ``-1`` / ``max``), and hands out ``prefix()``: a command prefix that
moves the spawned process into the cgroup before it ``exec``s the real command, so
every byte the command ever touches is charged there.

Only a nested cgroup is ever created: the limits of the cgroup this process runs in
are never touched. `CgroupUnavailable.reason` says why one cannot be made (not root,
no memory controller, read-only mount, cgroup v2 without memory delegation); tests
turn it into ``pytest.skip``, benchmarks into SKIPPED. `destroy()` SIGKILLs whatever
is still inside, waits for the tasks to leave and removes the directory; it is
idempotent and safe in finalizers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

V1_LIMIT = "memory.limit_in_bytes"
V1_MEMSW_LIMIT = "memory.memsw.limit_in_bytes"
V1_USAGE = "memory.usage_in_bytes"
V1_OOM_CONTROL = "memory.oom_control"
V1_FAILCNT = "memory.failcnt"
V2_MAX = "memory.max"
V2_SWAP_MAX = "memory.swap.max"
V2_CURRENT = "memory.current"
V2_EVENTS = "memory.events"

NAME_PREFIX = "plimsoll-"


class CgroupUnavailable(Exception):
    """No child memory cgroup can be made here; `reason` is the skip message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------
# finding this process's own memory cgroup


@dataclass(frozen=True)
class OwnCgroup:
    version: int  # 1 or 2
    directory: Path  # the own cgroup's directory under its mount


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(root, mount point, fstype, super options) per line of /proc/self/mountinfo."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rest = left.split(), right.split()
        if len(fields) >= 5 and rest:
            out.append((fields[3], fields[4], rest[0], rest[2] if len(rest) > 2 else ""))
    return out


def _under_mount(mount_point: str, mount_root: str, path: str) -> Path:
    rel = path
    root = mount_root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        rel = path[len(root) :]
    return Path(os.path.normpath(mount_point + "/" + rel.lstrip("/")))


def find_own_cgroup(
    proc_cgroup: str | None = None,
    mountinfo: str | None = None,
    *,
    exists: Callable[[Path], bool] = Path.exists,
    read_text: Callable[[Path], str] = Path.read_text,
) -> OwnCgroup:
    """The own memory cgroup (v1 memory hierarchy first, then v2), or CgroupUnavailable.

    `exists` and `read_text` stand in for the file system in tests.
    """
    if proc_cgroup is None:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    v1_path = v2_path = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "memory" in parts[1].split(","):
            v1_path = parts[2]
    mounts = _mounts(mountinfo)
    if v1_path is not None:
        mount = next((m for m in mounts if m[2] == "cgroup" and "memory" in m[3].split(",")), None)
        if mount is None:
            raise CgroupUnavailable(
                "cgroup v1 memory controller is listed in /proc/self/cgroup but not mounted"
            )
        own = _under_mount(mount[1], mount[0], v1_path)
        if not exists(own / V1_LIMIT):
            raise CgroupUnavailable(f"own v1 memory cgroup {own} has no {V1_LIMIT}")
        return OwnCgroup(1, own)
    if v2_path is not None:
        mount = next((m for m in mounts if m[2] == "cgroup2"), None)
        if mount is None:
            raise CgroupUnavailable("cgroup v2 is listed in /proc/self/cgroup but not mounted")
        own = _under_mount(mount[1], mount[0], v2_path)
        try:
            controllers = read_text(own / "cgroup.controllers").split()
        except OSError as exc:
            raise CgroupUnavailable(f"cannot read {own}/cgroup.controllers: {exc}") from None
        if "memory" not in controllers:
            raise CgroupUnavailable(
                f"own cgroup v2 {own} has no memory controller (controllers: "
                f"{' '.join(controllers) or 'none'})"
            )
        return OwnCgroup(2, own)
    raise CgroupUnavailable(
        "this process is in no memory cgroup (no memory line in /proc/self/cgroup)"
    )


# ---------------------------------------------------------------------------
# OOM counters


@dataclass(frozen=True)
class OomCounters:
    oom_kill: int  # processes the OOM killer killed in this cgroup
    failcnt: int  # v1: times the limit was hit; v2: "max" events
    oom: int = 0  # v2: times the cgroup went OOM; v1: under_oom now (0/1)

    def __str__(self) -> str:
        return f"oom_kill={self.oom_kill} failcnt={self.failcnt} oom={self.oom}"


def _keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def parse_v1_oom(oom_control: str, failcnt: str) -> OomCounters:
    keyed = _keyed(oom_control)
    return OomCounters(
        oom_kill=keyed.get("oom_kill", 0),
        failcnt=int(failcnt.strip() or 0),
        oom=keyed.get("under_oom", 0),
    )


def parse_v2_events(events: str) -> OomCounters:
    keyed = _keyed(events)
    return OomCounters(
        oom_kill=keyed.get("oom_kill", 0), failcnt=keyed.get("max", 0), oom=keyed.get("oom", 0)
    )


# ---------------------------------------------------------------------------
# the child cgroup


@dataclass
class ChildCgroup:
    version: int
    path: Path
    limit_bytes: int | None
    _destroyed: bool = field(default=False, repr=False)

    # -- creation ------------------------------------------------------------------
    @classmethod
    def create(cls, limit_bytes: int | None = None, own: OwnCgroup | None = None) -> ChildCgroup:
        if os.geteuid() != 0:
            raise CgroupUnavailable(f"creating a memory cgroup needs root (euid {os.geteuid()})")
        own = own or find_own_cgroup()
        if own.version == 2:
            _enable_v2_memory(own.directory)
        path = own.directory / f"{NAME_PREFIX}{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create {path}: {exc.strerror or exc}") from None
        child = cls(own.version, path, limit_bytes)
        try:
            child.set_limit(limit_bytes)
        except BaseException as exc:
            child.destroy()
            if isinstance(exc, OSError):
                raise CgroupUnavailable(f"cannot set a memory limit on {path}: {exc}") from None
            raise
        return child

    def set_limit(self, limit_bytes: int | None) -> None:
        """(Re)set the limit (None: no limit). v1 keeps memsw >= limit at every step, as the
        kernel demands."""
        if self.version == 1:
            value: int | str = -1 if limit_bytes is None else limit_bytes
            memsw = self.path / V1_MEMSW_LIMIT
            has_memsw = memsw.exists()
            raising = limit_bytes is None or (
                self.limit_bytes is not None and limit_bytes > self.limit_bytes
            )
            if has_memsw and raising:
                _write(memsw, value)  # raising: memsw first
                _write(self.path / V1_LIMIT, value)
            else:
                _write(self.path / V1_LIMIT, value)  # lowering / first time: limit first
                if has_memsw:
                    _write(memsw, value)
        else:
            _write(self.path / V2_MAX, "max" if limit_bytes is None else limit_bytes)
            swap = self.path / V2_SWAP_MAX
            if swap.exists():
                _write(swap, 0)
        self.limit_bytes = limit_bytes

    # -- using it ------------------------------------------------------------------
    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def prefix(self) -> list[str]:
        """Prepend to a command: the shell joins the cgroup, then execs the command."""
        return ["sh", "-c", f'echo $$ > "{self.procs_file}" && exec "$@"', "sh"]

    def add(self, pid: int) -> None:
        _write(self.procs_file, pid)

    def pids(self) -> list[int]:
        try:
            text = self.procs_file.read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def usage_bytes(self) -> int:
        name = V1_USAGE if self.version == 1 else V2_CURRENT
        return int((self.path / name).read_text().strip())

    def peak_bytes(self) -> int | None:
        """Highest usage seen (v1 memory.max_usage_in_bytes, v2 memory.peak), if kept."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text().strip())
        except (OSError, ValueError):
            return None

    def stat(self) -> dict[str, int]:
        try:
            return _keyed((self.path / "memory.stat").read_text())
        except OSError:
            return {}

    def oom_counters(self) -> OomCounters:
        if self.version == 1:
            return parse_v1_oom(
                (self.path / V1_OOM_CONTROL).read_text(), (self.path / V1_FAILCNT).read_text()
            )
        return parse_v2_events((self.path / V2_EVENTS).read_text())

    def describe(self) -> str:
        try:
            usage = self.usage_bytes() / 2**20
            counters = str(self.oom_counters())
        except OSError:
            usage, counters = float("nan"), "unreadable"
        limit = "none" if self.limit_bytes is None else f"{self.limit_bytes / 2**20:.0f} MiB"
        return (
            f"cgroup v{self.version} {self.path} limit {limit} "
            f"usage {usage:.0f} MiB {counters}"
        )

    # -- cleanup -------------------------------------------------------------------
    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every task inside and wait until none is left."""
        if self.version == 2 and (self.path / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(self.path / "cgroup.kill", 1)
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def destroy(self, timeout: float = 10.0) -> None:
        """Kill what is left inside and remove the directory (idempotent)."""
        if self._destroyed:
            return
        if not self.path.exists():
            self._destroyed = True
            return
        self.kill_all(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                self._destroyed = True
                return
            except FileNotFoundError:
                self._destroyed = True
                return
            except OSError as exc:
                # EBUSY while a killed task is still exiting (zombie not yet reaped).
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                self.kill_all(1.0)
                time.sleep(0.1)

    def __enter__(self) -> ChildCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _write(path: Path, value: int | str) -> None:
    with open(path, "w") as fh:
        fh.write(f"{value}\n")


def _enable_v2_memory(own: Path) -> None:
    """A v2 child only gets memory.max when the parent delegates the controller."""
    control = own / "cgroup.subtree_control"
    try:
        if "memory" in control.read_text().split():
            return
        _write(control, "+memory")
    except OSError as exc:
        # EBUSY: the own cgroup holds processes ("no internal processes" rule).
        raise CgroupUnavailable(
            f"cannot enable the memory controller for children of {own}: {exc.strerror or exc}"
        ) from None


def leftover_cgroups(own: OwnCgroup | None = None) -> list[Path]:
    """Child cgroups a crashed earlier run left behind (for diagnostics and cleanup)."""
    own = own or find_own_cgroup()
    return sorted(p for p in own.directory.glob(f"{NAME_PREFIX}*") if p.is_dir())


def remove_leftovers(own: OwnCgroup | None = None) -> list[Path]:
    """Remove *empty* child cgroups that earlier runs left behind.

    Cgroups with tasks inside are left alone: they may belong to a test session
    running concurrently.
    """
    removed: list[Path] = []
    try:
        own = own or find_own_cgroup()
    except (CgroupUnavailable, OSError):
        return removed
    for path in leftover_cgroups(own):
        try:
            if (path / "cgroup.procs").read_text().strip():
                continue
            path.rmdir()
            removed.append(path)
        except OSError:
            continue
    return removed


def limit_for_ceiling(ceiling: int, total: int) -> int:
    """The cgroup limit whose container term of Plimsoll's ceiling (limit - reserve) is
    `ceiling`, on a machine of `total` bytes (custom tier)."""
    from memory.levels import GIB, Tier, container_reserve_bytes

    lo, hi = ceiling, 2 * ceiling + 4 * GIB
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        if mid - container_reserve_bytes(Tier.CUSTOM, total, mid) < ceiling:
            lo = mid
        else:
            hi = mid
    return hi
