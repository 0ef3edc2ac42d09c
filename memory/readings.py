"""Memory readings: what the process holds, what the machine and its container allow.

One `MemoryReadings` per measurement. Every figure says where it came from
(`sources`); a source that is unavailable is None, never guessed.

`MemoryReader` discovers paths once (total RAM, the process's own cgroup and
its ancestors, the PSI file, the Metal/CUDA device cap) and then reads cheap,
already-open files with `os.pread` each tick.

MLX figures come from the engine threads' own samples (`MlxFigures`), never from
an MLX call here: MLX belongs to the engine threads. With no sample (no model
loaded, or every sample too old) the MLX terms are unavailable and usage is
the footprint alone, which on Linux and macOS already includes MLX's memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

# A v1 cgroup with no limit reports a huge page-aligned number such as
# 9223372036854771712; anything this large (or 4 × the machine's RAM) is "no limit".
UNLIMITED_THRESHOLD_BYTES = 1 << 60
UNLIMITED_RAM_MULTIPLE = 4

# Linux PSI "some avg10" (percent of the last 10 s that some task stalled on
# memory) → coarse OS pressure. 10 % is where reclaim starts to cost latency;
# 40 % (or any "full" stall above 10 %) means the machine is thrashing.
PSI_WARNING_SOME_AVG10 = 10.0
PSI_CRITICAL_SOME_AVG10 = 40.0
PSI_CRITICAL_FULL_AVG10 = 10.0

# macOS kern.memorystatus_vm_pressure_level values.
_DARWIN_PRESSURE = {1: "normal", 2: "warning", 4: "critical"}



@dataclass(frozen=True)
class MlxFigures:
    """MLX's allocator as an engine thread sampled it (process-wide figures)."""

    active_bytes: int
    pool_bytes: int
    at: float  # monotonic seconds when sampled
    device_limit_bytes: int | None = None  # the Metal working set / CUDA memory, if any
    device_source: str | None = None


MlxSample = MlxFigures


@dataclass(frozen=True)
class MemoryReadings:
    """One measurement. Bytes throughout; None means "not available here"."""

    process_bytes: int  # max(mlx_active, footprint): what jetsam / the OOM killer sees
    system_total_bytes: int
    mlx_active_bytes: int | None = None
    mlx_pool_bytes: int | None = None  # MLX buffer pool: counted in footprint, reclaimable
    footprint_bytes: int | None = None  # RSS on Linux, phys_footprint on macOS
    system_available_bytes: int | None = None
    # macOS vm statistics (free/inactive/active pages × page size) for the
    # dynamic term's active-ratio formula; None on Linux, where "available"
    # already counts reclaimable page cache.
    system_free_bytes: int | None = None
    system_inactive_bytes: int | None = None
    system_active_bytes: int | None = None
    container_limit_bytes: int | None = None
    container_usage_bytes: int | None = None
    device_limit_bytes: int | None = None
    os_pressure: str | None = None  # "normal" | "warning" | "critical"
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def pool_bytes(self) -> int:
        """The reclaimable MLX pool, 0 when unknown (an unreadable pool never defers work)."""
        return self.mlx_pool_bytes or 0

    @property
    def own_bytes(self) -> int:
        """What the process itself holds for the dynamic term: footprint, else usage."""
        return self.footprint_bytes if self.footprint_bytes is not None else self.process_bytes

    def with_process_bytes(self, process_bytes: int) -> MemoryReadings:
        return dataclasses.replace(self, process_bytes=process_bytes)


# ---------------------------------------------------------------------------
# small cached-file helper


class _CachedFile:
    """A file kept open and re-read from offset 0 (proc/cgroup files regenerate on read)."""

    __slots__ = ("path", "_fd")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self, size: int = 4096) -> str | None:
        for _attempt in range(2):
            try:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                return os.pread(self._fd, size, 0).decode("ascii", "replace")
            except OSError:
                self.close()  # reopen once: the cgroup may have been recreated
        return None

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


# ---------------------------------------------------------------------------
# cgroup discovery (pure over file contents, so tests feed it fake trees)


@dataclass(frozen=True)
class CgroupLevel:
    """One cgroup directory on the way from the process's own cgroup to the root."""

    directory: str
    limit_file: str
    usage_file: str


@dataclass(frozen=True)
class CgroupInfo:
    version: int  # 1 or 2
    own_directory: str
    levels: tuple[CgroupLevel, ...]  # own cgroup first, then its ancestors
    pressure_file: str | None  # cgroup v2 memory.pressure of the own cgroup


def _parse_mountinfo(text: str) -> list[tuple[str, str, str, str]]:
    """(root, mount_point, fstype, super_options) per line of /proc/self/mountinfo."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        rest = right.split()
        if len(fields) < 5 or len(rest) < 1:
            continue
        mounts.append((fields[3], fields[4], rest[0], rest[2] if len(rest) > 2 else ""))
    return mounts


def _parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """(v1 memory controller path, v2 unified path) from /proc/self/cgroup."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _join_cgroup(mount_point: str, mount_root: str, cgroup_path: str) -> str:
    """Map a cgroup path to a directory under a mount whose root may be a sub-cgroup."""
    rel = cgroup_path
    if mount_root not in ("", "/"):
        if cgroup_path == mount_root:
            rel = "/"
        elif cgroup_path.startswith(mount_root.rstrip("/") + "/"):
            rel = cgroup_path[len(mount_root.rstrip("/")) :]
        # else: a namespaced view where the path is already relative to the mount
    return os.path.normpath(mount_point + "/" + rel.lstrip("/"))


def discover_cgroup(
    proc_cgroup: str | None,
    mountinfo: str | None,
    *,
    default_root: str = "/sys/fs/cgroup",
    exists: Callable[[str], bool] = os.path.exists,
) -> CgroupInfo | None:
    """Find the process's own memory cgroup and its ancestors (v1 or v2), or None."""
    v1_path, v2_path = _parse_proc_cgroup(proc_cgroup or "")
    mounts = _parse_mountinfo(mountinfo or "")

    if v1_path is not None:
        mount = next((m for m in mounts if m[2] == "cgroup" and "memory" in m[3].split(",")), None)
        mount_point, mount_root = (mount[1], mount[0]) if mount else (default_root + "/memory", "/")
        own = _join_cgroup(mount_point, mount_root, v1_path)
        if not exists(own + "/memory.limit_in_bytes"):
            own = mount_point  # a namespaced view: the mount is the process's cgroup
        if exists(own + "/memory.limit_in_bytes"):
            return _levels(
                1, own, mount_point, "memory.limit_in_bytes", "memory.usage_in_bytes", None, exists
            )
    if v2_path is not None:
        mount = next((m for m in mounts if m[2] == "cgroup2"), None)
        mount_point, mount_root = (mount[1], mount[0]) if mount else (default_root, "/")
        own = _join_cgroup(mount_point, mount_root, v2_path)
        if not exists(own + "/cgroup.controllers"):
            own = mount_point
        if exists(own + "/cgroup.controllers") or exists(own + "/memory.current"):
            pressure = own + "/memory.pressure"
            return _levels(
                2,
                own,
                mount_point,
                "memory.max",
                "memory.current",
                pressure if exists(pressure) else None,
                exists,
            )
    return None


def _levels(
    version: int,
    own: str,
    mount_point: str,
    limit_name: str,
    usage_name: str,
    pressure_file: str | None,
    exists: Callable[[str], bool],
) -> CgroupInfo:
    # Why walk up: a limit set on a parent cgroup (the container) binds the
    # process even when its own cgroup reports "unlimited".
    levels: list[CgroupLevel] = []
    directory = own
    stop = os.path.normpath(mount_point)
    while True:
        limit_file = f"{directory}/{limit_name}"
        if exists(limit_file):
            levels.append(CgroupLevel(directory, limit_file, f"{directory}/{usage_name}"))
        if os.path.normpath(directory) == stop or directory in ("/", ""):
            break
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return CgroupInfo(version, own, tuple(levels), pressure_file)


# Pages swapped in per second that count as pressure (4 KiB pages: ~4 MiB/s, ~64 MiB/s).
SWAPIN_WARNING_PAGES_S = 1024
SWAPIN_CRITICAL_PAGES_S = 16384
_SEVERITY = {None: 0, "normal": 1, "warning": 2, "critical": 3}


def swapin_pressure(pages_per_s: float) -> str:
    """Swap-in activity as a pressure level: the system is paging working sets back."""
    if pages_per_s >= SWAPIN_CRITICAL_PAGES_S:
        return "critical"
    if pages_per_s >= SWAPIN_WARNING_PAGES_S:
        return "warning"
    return "normal"


def worse(a: str | None, b: str | None) -> str | None:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def parse_swapins(vmstat: str | None) -> int | None:
    """The `pswpin` counter of /proc/vmstat (pages swapped in since boot)."""
    for line in (vmstat or "").splitlines():
        if line.startswith("pswpin "):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def parse_psi(text: str | None) -> str | None:
    """Map a PSI memory file to "normal" / "warning" / "critical" (None if unreadable)."""
    if not text:
        return None
    avg10: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        for item in parts[1:]:
            key, _, value = item.partition("=")
            if key == "avg10":
                try:
                    avg10[parts[0]] = float(value)
                except ValueError:
                    return None
    if "some" not in avg10:
        return None
    some, full = avg10["some"], avg10.get("full", 0.0)
    if some >= PSI_CRITICAL_SOME_AVG10 or full >= PSI_CRITICAL_FULL_AVG10:
        return "critical"
    if some >= PSI_WARNING_SOME_AVG10:
        return "warning"
    return "normal"


def is_unlimited(limit: int | None, total_bytes: int) -> bool:
    return (
        limit is None
        or limit <= 0
        or limit >= UNLIMITED_THRESHOLD_BYTES
        or limit >= total_bytes * UNLIMITED_RAM_MULTIPLE
    )


# ---------------------------------------------------------------------------
# macOS helpers (ctypes; every failure degrades to None)


class _Darwin:
    """proc_pid_rusage phys_footprint and sysctlbyname integers."""

    _RUSAGE_INFO_V4 = 4
    _PHYS_FOOTPRINT_OFFSET = 72  # 16-byte uuid + 7 uint64 before ri_phys_footprint

    def __init__(self) -> None:
        self._libproc = None
        self._libc = None
        try:
            self._libproc = ctypes.CDLL("/usr/lib/libproc.dylib", use_errno=True)
        except OSError:
            self._libproc = None
        try:
            self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        except OSError:
            self._libc = None

    def phys_footprint(self) -> int | None:
        if self._libproc is None:
            return None
        buf = ctypes.create_string_buffer(512)
        rc = self._libproc.proc_pid_rusage(
            ctypes.c_int(os.getpid()), ctypes.c_int(self._RUSAGE_INFO_V4), buf
        )
        if rc != 0:
            return None
        value = int.from_bytes(
            buf.raw[self._PHYS_FOOTPRINT_OFFSET : self._PHYS_FOOTPRINT_OFFSET + 8], sys.byteorder
        )
        return value or None

    def sysctl_int(self, name: str) -> int | None:
        if self._libc is None:
            return None
        value = ctypes.c_int64(0)
        size = ctypes.c_size_t(ctypes.sizeof(value))
        rc = self._libc.sysctlbyname(
            name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)
        )
        if rc != 0:
            return None
        # The kernel may write 4 bytes (int) into the 8-byte slot.
        raw = value.value if size.value == 8 else value.value & 0xFFFFFFFF
        return int(raw)


# ---------------------------------------------------------------------------
# the reader


class MemoryReader:
    """Discovers sources once, then reads them cheaply on every `read()`."""

    def __init__(
        self,
        *,
        proc_root: str = "/proc",
        cgroup_root: str = "/sys/fs/cgroup",
        platform: str = sys.platform,
        probe_device: bool = True,
    ) -> None:
        self._platform = platform
        self._linux = platform.startswith("linux")
        self._darwin = platform == "darwin"
        self._proc_root = proc_root
        self._total = int(psutil.virtual_memory().total)
        self._page_size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._statm = _CachedFile(f"{proc_root}/self/statm") if self._linux else None
        self._meminfo = _CachedFile(f"{proc_root}/meminfo") if self._linux else None
        self._process = psutil.Process()
        self._darwin_api = _Darwin() if self._darwin else None

        self._cgroup: CgroupInfo | None = None
        self._cgroup_files: list[tuple[CgroupLevel, _CachedFile, _CachedFile]] = []
        self._pressure_file: _CachedFile | None = None
        self._vmstat: _CachedFile | None = None
        self._last_swapin: tuple[float, int] | None = None
        self._pressure_source: str | None = None
        if self._linux:
            self._discover_linux(proc_root, cgroup_root)
        self._probe = probe_device
        self._device_limit, self._device_source = (
            self._probe_device() if probe_device else (None, None)
        )

    # -- discovery ------------------------------------------------------------
    def _discover_linux(self, proc_root: str, cgroup_root: str) -> None:
        proc_cgroup = _read_text(f"{proc_root}/self/cgroup")
        mountinfo = _read_text(f"{proc_root}/self/mountinfo")
        self._cgroup = discover_cgroup(proc_cgroup, mountinfo, default_root=cgroup_root)
        self._stat_files: dict[str, _CachedFile] = {}
        self._vmstat = _CachedFile(f"{proc_root}/vmstat")
        if self._cgroup is not None:
            self._cgroup_files = [
                (lvl, _CachedFile(lvl.limit_file), _CachedFile(lvl.usage_file))
                for lvl in self._cgroup.levels
            ]
        # The container's own pressure first (v2), else the system's PSI.
        candidates = []
        if self._cgroup is not None and self._cgroup.pressure_file:
            candidates.append((self._cgroup.pressure_file, "cgroup memory.pressure"))
        candidates.append((f"{proc_root}/pressure/memory", "psi /proc/pressure/memory"))
        for path, source in candidates:
            probe = _CachedFile(path)
            if parse_psi(probe.read()) is not None:
                self._pressure_file, self._pressure_source = probe, f"{source} ({path})"
                break
            probe.close()

    def _probe_device(self) -> tuple[int | None, str | None]:
        """The operator's GPU cap (macOS sysctl), read once. MLX's own device figure
        comes with the engine threads' samples (MLX is theirs to call)."""
        if self._darwin and self._darwin_api is not None:
            wired_mb = self._darwin_api.sysctl_int("iogpu.wired_limit_mb")
            if wired_mb and wired_mb > 0:
                return wired_mb * (1 << 20), "sysctl iogpu.wired_limit_mb"
        return None, None

    def _learn_device(self, mlx: MlxFigures | None) -> None:
        # The device figure is static: kept once an engine has reported it.
        if self._device_limit is None and mlx is not None and mlx.device_limit_bytes:
            self._device_limit = mlx.device_limit_bytes
            self._device_source = mlx.device_source or "mlx device_info"

    @property
    def total_bytes(self) -> int:
        return self._total

    @property
    def cgroup(self) -> CgroupInfo | None:
        return self._cgroup

    def describe(self) -> dict[str, str]:
        """The discovered sources, for logs and the status RPC."""
        out = {"platform": self._platform, "system_total_bytes": str(self._total)}
        if self._cgroup is not None:
            out["cgroup"] = f"v{self._cgroup.version} {self._cgroup.own_directory}"
        if self._pressure_source:
            out["os_pressure"] = self._pressure_source
        if self._device_source:
            out["device"] = self._device_source
        return out

    # -- reading --------------------------------------------------------------
    def read(self, mlx: MlxFigures | None = None) -> MemoryReadings:
        sources: dict[str, str] = {}
        if self._probe:
            self._learn_device(mlx)
        active, pool = self._read_mlx(mlx, sources)
        footprint = self._read_footprint(sources)
        available, free, inactive, act = self._read_system(sources)
        limit, usage = self._read_container(sources)
        pressure = self._read_os_pressure(sources)
        if self._device_limit is not None and self._device_source:
            sources["device"] = self._device_source
        candidates = [v for v in (active, footprint) if v is not None]
        process = max(candidates) if candidates else 0
        sources["process"] = "max(mlx_active, footprint)" if candidates else "unavailable"
        sources["system_total"] = "psutil virtual_memory().total"
        return MemoryReadings(
            process_bytes=process,
            system_total_bytes=self._total,
            mlx_active_bytes=active,
            mlx_pool_bytes=pool,
            footprint_bytes=footprint,
            system_available_bytes=available,
            system_free_bytes=free,
            system_inactive_bytes=inactive,
            system_active_bytes=act,
            container_limit_bytes=limit,
            container_usage_bytes=usage,
            device_limit_bytes=self._device_limit,
            os_pressure=pressure,
            sources=sources,
        )

    @staticmethod
    def _read_mlx(
        mlx: MlxFigures | None, sources: dict[str, str]
    ) -> tuple[int | None, int | None]:
        if mlx is None:
            sources["mlx"] = "unavailable (no fresh engine sample)"
            return None, None
        sources["mlx"] = "engine thread sample"
        return int(mlx.active_bytes), int(mlx.pool_bytes)

    def _read_footprint(self, sources: dict[str, str]) -> int | None:
        if self._darwin_api is not None:
            value = self._darwin_api.phys_footprint()
            if value is not None:
                sources["footprint"] = "proc_pid_rusage phys_footprint"
                return value
        if self._statm is not None:
            text = self._statm.read(256)
            if text:
                fields = text.split()
                if len(fields) >= 2 and fields[1].isdigit():
                    sources["footprint"] = "rss /proc/self/statm"
                    return int(fields[1]) * self._page_size
        try:
            value = int(self._process.memory_info().rss)
        except Exception:
            sources["footprint"] = "unavailable"
            return None
        sources["footprint"] = "rss psutil"
        return value

    def _read_system(
        self, sources: dict[str, str]
    ) -> tuple[int | None, int | None, int | None, int | None]:
        if self._meminfo is not None:
            text = self._meminfo.read(8192)
            if text:
                for line in text.splitlines():
                    if line.startswith("MemAvailable:"):
                        parts = line.split()
                        if len(parts) >= 2 and parts[1].isdigit():
                            sources["system_available"] = "/proc/meminfo MemAvailable"
                            return int(parts[1]) * 1024, None, None, None
        try:
            vm = psutil.virtual_memory()
        except Exception:
            sources["system_available"] = "unavailable"
            return None, None, None, None
        sources["system_available"] = "psutil virtual_memory().available"
        if self._darwin:
            sources["system_vm_stats"] = "psutil free/inactive/active"
            return int(vm.available), int(vm.free), int(vm.inactive), int(vm.active)
        return int(vm.available), None, None, None

    def _read_container(self, sources: dict[str, str]) -> tuple[int | None, int | None]:
        best: tuple[int, int | None, str] | None = None
        for level, limit_file, usage_file in self._cgroup_files:
            limit = _parse_int(limit_file.read(64))
            if is_unlimited(limit, self._total):
                continue
            assert limit is not None
            if best is None or limit < best[0]:
                best = (limit, _parse_int(usage_file.read(64)), level)
        if best is None:
            if self._cgroup is not None:
                sources["container"] = f"no limit (cgroup v{self._cgroup.version})"
            return None, None
        limit, usage, level = best
        sources["container"] = level.limit_file
        directory = level.directory
        if usage is not None:
            # Like the kubelet: the working set excludes inactive page cache (model
            # files just read), which the kernel drops before it OOM-kills anyone.
            inactive = self._inactive_file(directory)
            if inactive is not None:
                usage = max(0, usage - inactive)
                sources["container_usage"] = "usage - inactive_file (working set)"
        return limit, usage

    def _inactive_file(self, directory: str) -> int | None:
        stat = self._stat_files.get(directory)
        if stat is None:
            stat = self._stat_files[directory] = _CachedFile(f"{directory}/memory.stat")
        text = stat.read(16384)
        if not text:
            return None
        values = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
        raw = values.get("total_inactive_file", values.get("inactive_file"))
        return _parse_int(raw) if raw is not None else None

    def _read_os_pressure(self, sources: dict[str, str]) -> str | None:
        if self._darwin_api is not None:
            value = self._darwin_api.sysctl_int("kern.memorystatus_vm_pressure_level")
            if value in _DARWIN_PRESSURE:
                sources["os_pressure"] = "sysctl kern.memorystatus_vm_pressure_level"
                return _DARWIN_PRESSURE[value]
            return None
        value = None
        if self._pressure_file is not None:
            value = parse_psi(self._pressure_file.read(512))
            if value is not None and self._pressure_source:
                sources["os_pressure"] = self._pressure_source
        swap = self._swapin_level()
        if swap is not None and _SEVERITY[swap] > _SEVERITY[value]:
            sources["os_pressure"] = "swap-in rate /proc/vmstat pswpin"
        return worse(value, swap)

    def _swapin_level(self) -> str | None:
        """Pressure from the swap-in rate since the previous reading (None at first)."""
        if self._vmstat is None:
            return None
        pages = parse_swapins(self._vmstat.read(16384))
        now = time.monotonic()
        last, self._last_swapin = self._last_swapin, (now, pages) if pages is not None else None
        if pages is None or last is None or now <= last[0]:
            return None
        return swapin_pressure((pages - last[1]) / (now - last[0]))

    def close(self) -> None:
        for f in (self._statm, self._meminfo, self._pressure_file):
            if f is not None:
                f.close()
        for _lvl, a, b in self._cgroup_files:
            a.close()
            b.close()


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None
