"""Which BLAS MLX's CPU backend calls, chosen once, before `mlx.core` is loaded.

The `mlx[cpu]` wheel for Linux links `libmlx.so` against the *reference* BLAS it bundles
(mlx_cpu.libs/libblas-*.so.3): correct, single-threaded and slow (a 4096x4096 float32
matrix-vector product takes ~9 ms, a 64-row one ~0.5 s on one core). MLX resolves its
`cblas_sgemm` calls (and its LAPACK calls) through the dynamic linker, whose global scope
is searched before a library's own dependencies. So an optimized BLAS loaded with
RTLD_GLOBAL *before* `mlx.core` is imported takes those calls over, with no rebuild.

`preload()` does that, once per process, and is called by `engine/__init__.py`, so it runs
before any module of the engine package (the only one that imports MLX) and before any
test or tool that goes through it. It does nothing when:

- not on Linux, or not with the `mlx[cpu]` wheel (macOS uses Accelerate; `mlx[cuda]` and
  builds from source are left exactly as they are);
- `PLIMSOLL_BLAS=reference` (or `off`), or `--no-optimized-blas` on the command line (read
  from `sys.argv` here, because the choice has to be made before argparse runs);
- the `[blas]` extra is not installed (three `stat` calls: cheap);
- `mlx.core` was already imported (its symbols may be bound: nothing is loaded, and the
  state says why).

The optimized BLAS is OpenBLAS from PyPI's `scipy-openblas32` wheel (`pip install
'plimsoll[blas]'`, Linux x86_64 and aarch64, ~30 MB). Its symbols carry a `scipy_` prefix,
so MLX cannot bind to them directly: engine/cblas_shim.c defines the entry MLX calls for
float32 products, `cblas_sgemm`, and forwards it — a one-row product (a decode step) to `sgemv`, which
streams the weights ~3x faster than OpenBLAS's own one-row sgemm, and a product of two or
three rows to one `sgemv` per row (1.5-2x OpenBLAS's sgemm there). The shim is compiled
once into the cache folder by the first C compiler found (`$CC`, cc, gcc, clang, then the
`ziglang` wheel the extra brings for machines without one). Without a compiler, or with
`PLIMSOLL_BLAS=mkl`, Intel oneMKL from the `mkl` wheel (`[mkl]` extra, ~1 GB) is loaded
as is through its single library `libmkl_rt`. `PLIMSOLL_BLAS=/path/to/lib.so` loads any
other BLAS whose CBLAS symbols are not prefixed (Debian's `libopenblas0-pthread`, say).

Threads: as many as the process may run at once (`usable_cpus()`: the CPU affinity mask
and the cgroup v1/v2 CPU quota, never `os.cpu_count()`). MLX's own work (bfloat16 and
float16 products, elementwise ops) and the server's event loop run on the same cores
between BLAS calls: MKL's OpenMP threads are told not to spin after a call
(`KMP_BLOCKTIME=0`), OpenBLAS's to spin ~26 ms (`OPENBLAS_THREAD_TIMEOUT=26`), and the
shim runs products under eight million multiply-adds (one-row products: half a million) on
one thread. Every variable is only a default: one already set in the environment wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import logging
import math
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from engine.cache_dir import cache_root

log = logging.getLogger(__name__)

ENV = "PLIMSOLL_BLAS"
# Multiply-adds from which the shim runs a product on every thread: products it sends to
# gemv (per row) and the rest (gemm). Below them one thread, which leaves the event loop and the
# clients a core (docs/benchmarks.md, "Optimized BLAS"). "GEMV,GEMM" overrides both.
PARALLEL_ENV = "PLIMSOLL_BLAS_PARALLEL_MIN"
GEMV_PARALLEL_MIN = 1 << 19
GEMM_PARALLEL_MIN = 1 << 23
# OpenBLAS's workers spin 2^this cycles after a call before they sleep
# (OPENBLAS_THREAD_TIMEOUT, read at load; ~26 ms at 2.6 GHz). Its default, 28 (~0.1 s),
# kept a second core busy for the whole of a tiny model's decode, which now stays on one
# thread (GEMM_PARALLEL_MIN). A worker must not sleep between a prefill chunk's products
# (its NumPy passes, a wait for the GIL): woken for the next one on virtual CPUs that had
# been idle, it made the first chunk after a pause up to twice as slow here
# (docs/benchmarks.md, "OpenBLAS's workers kept awake through a prefill chunk").
OPENBLAS_SPIN = 26
# Products of at most this many rows go to sgemv, one call per row (1 = only one-row
# products): on two to three rows that beats OpenBLAS's sgemm, from four it does not
# (docs/benchmarks.md, "Two and three rows as sgemv"). The variable overrides it.
GEMV_ROWS_ENV = "PLIMSOLL_BLAS_GEMV_ROWS"
GEMV_ROWS = 3
# Products of at most this many rows (a decode step's, one per sequence) by a float32
# weight of at least SKINNY_MIN_MACS multiply-adds run through the shim's own kernel,
# which reads the weight once per four rows, on every thread; OpenBLAS reads it once per
# row (sgemv) or packs it (sgemm) (engine/cblas_shim.c, "a float32 weight through the same
# kernel"; docs/benchmarks.md, "Skinny float32 products"). The variable overrides it; 0
# turns it off.
SKINNY_ROWS_ENV = "PLIMSOLL_BLAS_SKINNY_ROWS"
SKINNY_ROWS = 8
SKINNY_MIN_MACS = 1 << 16
# The shim's decode kernels run a product of at least KERNEL_PARALLEL_MIN_BYTES of weight on
# this many threads (default: the BLAS's; 1: one thread), its output columns split
# between MLX's thread and helpers (engine/cblas_shim.c, "more than one thread").
KERNEL_THREADS_ENV = "PLIMSOLL_KERNEL_THREADS"
KERNEL_PARALLEL_MIN_BYTES = 1 << 20
# Except one row of a half-precision weight whose rows hold fewer bytes than this (k under
# 2,048): alone, such a product gained at most 1.2x on two threads here (1,536 x 512 lost:
# 0.75x), against 1.34-1.38x from k = 2,048; inside a decode step the helper then competes
# with the thread encoding the next step's graph: the small bfloat16 demo model's
# one-sequence step ran 1.09-1.15x as fast with them on one thread, the medium bfloat16
# model's the same, its float16 one 1-5 % slower (docs/benchmarks.md, "One row of a
# half-precision weight on one thread").
HALF_ONE_ROW_SHARED_MIN_ROW_BYTES = 4096
KERNEL_MAX_THREADS = 8  # engine/cblas_shim.c: MAX_HELPERS + 1
# The decode kernels' instruction set: the best the CPU has, or at most the one this names
# (benchmarks compare them; a CPU that slows down under AVX-512 can be kept on AVX2).
KERNEL_ISA_ENV = "PLIMSOLL_KERNEL_ISA"
KERNEL_ISAS = ("portable", "avx2", "avx512")  # engine/cblas_shim.c's 0, 1, 2
FLAG = "--no-optimized-blas"
OFF_VALUES = frozenset({"reference", "off", "0", "false", "no", "none"})
AUTO_VALUES = frozenset({"", "auto", "1", "on", "true", "yes"})
# libmkl_rt's soname: .so.2 up to oneMKL 2025, .so.3 from 2026.
MKL_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")

# The OpenBLAS wheel whose ints are 32-bit, as MLX's cblas_sgemm calls pass them.
OPENBLAS_PACKAGE = "scipy_openblas32"
OPENBLAS_PREFIX = "scipy_"  # its exported names: scipy_cblas_sgemm, ...
CORETYPE_ENV = "OPENBLAS_CORETYPE"  # OpenBLAS's own: its kernels, instead of its choice
# The instruction set of the x86_64 kernels OpenBLAS names by core.
CORE_ISAS = {"Haswell": "avx2", "Zen": "avx2", "SkylakeX": "avx512", "Cooperlake": "avx512",
             "SapphireRapids": "avx512"}
SHIM_SOURCE = Path(__file__).with_name("cblas_shim.c")

# MKL_Set_Threading_Layer / MKL_THREADING_LAYER values.
_MKL_LAYERS = {0: "intel", 1: "sequential", 2: "pgi", 3: "gnu", 4: "tbb"}


@dataclass(frozen=True)
class BlasState:
    """What MLX's CPU BLAS calls resolve to in this process."""

    name: str  # "mkl" | "openblas" | "custom" | "reference" | "accelerate" | "default"
    version: str  # the library's own version ("2026.2"), "" when unknown
    description: str  # one line, no file paths
    threads: int  # threads one BLAS call may use; 0 when unknown
    optimized: bool  # an optimized BLAS was loaded ahead of MLX's own
    reason: str  # why this one
    path: str | None = None  # the loaded library (logs only; never sent on the wire)
    problem: bool = False  # what was asked for could not be had (the server warns)

    def summary(self) -> str:
        threads = f", {self.threads} thread{'s' if self.threads != 1 else ''}" \
            if self.threads else ""
        return f"{self.description}{threads} ({self.reason})"


_lock = threading.Lock()
_state: BlasState | None = None
_handles: list[ctypes.CDLL] = []  # kept so the libraries are never unloaded


def preload() -> BlasState:
    """Load the optimized BLAS globally if it applies; idempotent, and cheap after the first
    call. Never raises: a library that fails to load leaves the reference BLAS in place."""
    global _state
    if _state is not None:
        return _state
    with _lock:
        if _state is None:
            try:
                _state = _choose()
            except Exception as err:  # never break an import over a speed-up
                _state = _reference(f"optimized BLAS not loaded: {err}", problem=True)
            if _skinny:  # now that the BLAS's thread count is known (`kernel_threads`)
                _start_kernel_helpers()
    return _state


def state() -> BlasState:
    """The BLAS in use (preloading first if nothing has yet)."""
    return preload()


# --------------------------------------------------------------------------------------
# the choice


def _choose() -> BlasState:
    if sys.platform == "darwin":
        return BlasState("accelerate", "", "Apple Accelerate (linked by MLX)", 0, False,
                         "macOS: MLX's own BLAS")
    mlx_dir = _mlx_dir()
    if sys.platform != "linux" or mlx_dir is None:
        return BlasState("default", "", "MLX's own BLAS", 0, False, "left as is")
    reference = _bundled_reference(mlx_dir)
    if reference is None:  # mlx[cuda], or MLX built from source
        return BlasState("default", "", "MLX's own BLAS", 0, False,
                         "not the mlx[cpu] wheel: left as is")

    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in OFF_VALUES:
        return _reference(f"{ENV}={setting}", reference)
    if FLAG in getattr(sys, "argv", [])[1:]:
        return _reference(FLAG, reference)
    if "mlx.core" in sys.modules:
        return _reference("mlx.core was imported before the BLAS preload", reference,
                          problem=True)

    choice = setting.lower()
    if choice in AUTO_VALUES:
        return _auto(reference)
    if choice == "openblas":
        path = find_openblas()
        if path is None:
            return _reference(f"{ENV}=openblas but {OPENBLAS_PACKAGE} is not installed",
                              reference, problem=True)
        return _load_openblas(path, f"{ENV}=openblas")
    if choice == "mkl":
        path = find_mkl()
        if path is None:
            return _reference(f"{ENV}=mkl but libmkl_rt was not found", reference,
                              problem=True)
        return _load(path, f"{ENV}=mkl")
    if os.sep in setting or setting.endswith((".so", ".dylib")) or ".so." in setting:
        if not os.path.isfile(setting):
            return _reference(f"{ENV}: no such file", reference, problem=True)
        return _load(setting, f"{ENV}=<path>")
    return _reference(f"{ENV}={setting} is not one of auto, reference, openblas, mkl or a "
                      "path", reference, problem=True)


def _auto(reference: str) -> BlasState:
    """OpenBLAS through the shim, else MKL, else the reference BLAS: the first the
    environment has. OpenBLAS measured faster here at every product shape a model runs."""
    skipped = ""
    path = find_openblas()
    if path is not None:
        try:
            return _load_openblas(path, "the [blas] extra")
        except (ShimUnavailable, OSError, AttributeError) as err:
            skipped = f"OpenBLAS skipped: {err}"
    mkl = find_mkl()
    if mkl is not None:
        return _load(mkl, "the [blas] extra" + (f"; {skipped}" if skipped else ""))
    if skipped:
        return _reference(skipped, reference, problem=True)
    machine = os.uname().machine
    why = ("the [blas] extra is not installed" if machine in ("x86_64", "aarch64")
           else f"no optimized BLAS wheel for {machine}")
    return _reference(why, reference)


def _mlx_dir() -> str | None:
    """MLX's package folder, found without importing it."""
    try:
        spec = find_spec("mlx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _bundled_reference(mlx_dir: str) -> str | None:
    """The reference libblas the mlx[cpu] wheel bundles, or None for any other MLX."""
    site = os.path.dirname(mlx_dir)
    if glob.glob(os.path.join(site, "mlx_cuda*")):  # mlx[cuda] installed: hands off
        return None
    found = glob.glob(os.path.join(site, "mlx_cpu.libs", "libblas*.so*"))
    return found[0] if found else None


def find_mkl() -> str | None:
    """libmkl_rt from the `mkl` wheel: it installs into <prefix>/lib, not site-packages."""
    prefixes = [sys.prefix, sys.exec_prefix]
    try:
        import site

        prefixes.append(site.getuserbase())  # pip install --user
    except Exception:  # pragma: no cover - site is always there in CPython
        pass
    seen: set[str] = set()
    for prefix in prefixes:
        lib = os.path.join(prefix, "lib")
        if lib in seen:
            continue
        seen.add(lib)
        for name in MKL_NAMES:
            path = os.path.join(lib, name)
            if os.path.isfile(path):
                return path
        later = sorted(glob.glob(os.path.join(lib, "libmkl_rt.so.*")))  # a newer soname
        if later:
            return later[-1]
    return None


def find_openblas() -> str | None:
    """The library of the scipy-openblas32 wheel, found without importing it."""
    try:
        spec = find_spec(OPENBLAS_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
    found = sorted(glob.glob(os.path.join(lib, "libscipy_openblas*.so*")))
    return found[0] if found else None


def _reference(reason: str, path: str | None = None, problem: bool = False) -> BlasState:
    version = ""
    if path:
        # libblas-<hash>.so.3.10.0: netlib's version is the soname's tail.
        tail = os.path.basename(path).split(".so.", 1)
        version = tail[1] if len(tail) == 2 else ""
    desc = f"reference BLAS {version} (netlib, bundled with mlx[cpu])".replace("  ", " ")
    return BlasState("reference", version, desc, 1 if path else 0, False, reason, path,
                     problem)


# --------------------------------------------------------------------------------------
# loading


def _load(path: str, reason: str) -> BlasState:
    threads = usable_cpus()
    # Intel OpenMP reads this when its first parallel region starts, which is later than
    # the load: it has to stay in the environment (children inherit it, which is what
    # they want too). Every other setting is made by a call, so that a child process
    # works its own out.
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    if not hasattr(lib, "cblas_sgemm"):
        # Too late to unload it safely; MLX would not find its symbols here anyway.
        return _reference("the library has no cblas_sgemm: MLX keeps the reference BLAS",
                          _bundled_reference(_mlx_dir() or ""), problem=True)
    _handles.append(lib)
    if hasattr(lib, "MKL_Get_Max_Threads"):
        return _mkl_state(lib, path, reason, threads)
    if hasattr(lib, "openblas_get_config"):
        lib.openblas_get_config.restype = ctypes.c_char_p
        config = (lib.openblas_get_config() or b"").decode(errors="replace").strip()
        if "OPENBLAS_NUM_THREADS" not in os.environ and hasattr(lib, "openblas_set_num_threads"):
            lib.openblas_set_num_threads(ctypes.c_int(threads))
        actual = lib.openblas_get_num_threads() if hasattr(lib, "openblas_get_num_threads") \
            else 0
        version = config.split()[1] if config.startswith("OpenBLAS ") else ""
        return BlasState("openblas", version, config or "OpenBLAS", int(actual), True,
                         reason, path)
    return BlasState("custom", "", os.path.basename(path), 0, True, reason, path)


class ShimUnavailable(RuntimeError):
    """The CBLAS shim could not be built or loaded here (no C compiler, say)."""


def _load_openblas(path: str, reason: str) -> BlasState:
    """scipy-openblas32, whose symbols are prefixed: MLX reaches it through the shim.
    Nothing is global until the shim is bound: a failure leaves MLX's symbols alone."""
    shim_path = build_shim()
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(OPENBLAS_SPIN))
    lib = ctypes.CDLL(path)  # local scope: nothing binds to its names but the shim
    sgemm = getattr(lib, OPENBLAS_PREFIX + "cblas_sgemm", None)
    sgemv = getattr(lib, OPENBLAS_PREFIX + "cblas_sgemv", None)
    set_threads = getattr(lib, OPENBLAS_PREFIX + "openblas_set_num_threads", None)
    get_threads = getattr(lib, OPENBLAS_PREFIX + "openblas_get_num_threads", None)
    if sgemm is None or sgemv is None or set_threads is None or get_threads is None:
        raise ShimUnavailable(f"{os.path.basename(path)} lacks the {OPENBLAS_PREFIX}cblas "
                              "functions the shim needs")
    if not any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                          "OMP_NUM_THREADS")):
        set_threads(ctypes.c_int(usable_cpus()))
    threads = int(get_threads())
    rows = gemv_rows()
    try:
        shim = ctypes.CDLL(str(shim_path))  # local first: bound before anyone can call it
        shim.plimsoll_cblas_bind(ctypes.cast(sgemm, ctypes.c_void_p),
                                 ctypes.cast(sgemv, ctypes.c_void_p),
                                 ctypes.cast(set_threads, ctypes.c_void_p),
                                 ctypes.c_int(threads),
                                 *(ctypes.c_longlong(v) for v in parallel_min()),
                                 ctypes.c_int(rows))
    except (OSError, AttributeError) as err:
        shim_path.unlink(missing_ok=True)  # a bad build is not kept for the next start
        raise ShimUnavailable(f"the CBLAS shim did not load: {err}") from err
    # Now global (the same handle, promoted), so libmlx.so's cblas_sgemm binds to it.
    ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
    _handles.extend((lib, shim))
    cpu_isa = limit_kernel_isa(KERNEL_ISAS[-1])  # the best the CPU has, before any cap
    limit_kernel_isa(kernel_isa_limit())
    skinny = set_skinny_rows(skinny_rows())  # its helper threads start in `preload`
    get_config = getattr(lib, OPENBLAS_PREFIX + "openblas_get_config", None)
    config: list[str] = []
    if get_config is not None:
        get_config.restype = ctypes.c_char_p
        config = (get_config() or b"").decode(errors="replace").split()
    version = config[1] if len(config) > 1 and config[0] == "OpenBLAS" else ""
    # The core its DYNAMIC_ARCH build picked at load ("Haswell", "SkylakeX", "NeoverseN1").
    corename = getattr(lib, OPENBLAS_PREFIX + "openblas_get_corename", None)
    core = ""
    if corename is not None:
        corename.restype = ctypes.c_char_p
        core = (corename() or b"").decode(errors="replace").strip()
    kernels = kernels_text(core, os.environ.get(CORETYPE_ENV, "").strip(), cpu_isa)
    version = ".".join(version.split(".")[:3])
    desc = f"OpenBLAS {version} (scipy-openblas32{', ' + kernels if kernels else ''}" \
        + (f", float32 products of up to {skinny} rows through the shim's kernel" if skinny
           else "") \
        + (", one-row products as gemv)" if rows == 1 else
           f", products of up to {rows} rows as gemv)")
    return BlasState("openblas", version, desc, threads, True, reason, path)


def kernels_text(core: str, pinned: str, cpu_isa: str | None) -> str:
    """How the BLAS line names OpenBLAS's kernels: `core` as OpenBLAS reports it, `pinned`
    the OPENBLAS_CORETYPE of the environment ("" for none), `cpu_isa` the best the CPU has
    (the shim's word). A machine may pin them (older OpenBLAS builds fail on some CPUs);
    AVX2 ones pinned on a CPU with AVX-512 cost prefill 1.1-1.4x here, so the line says
    who chose them and what OpenBLAS would run instead."""
    if not core:
        return ""
    text = f"{core} kernels" + (f" as {CORETYPE_ENV}={pinned} asks" if pinned else "")
    if pinned and cpu_isa == "avx512" and CORE_ISAS.get(core) == "avx2":
        text += " on a CPU with AVX-512, for which OpenBLAS's own choice runs its AVX-512 ones"
    return text


def shim_counts() -> tuple[int, int, int] | None:
    """(sgemm, sgemv, on every thread) calls the shim has made since the load; None
    without the shim."""
    for lib in _handles:
        if hasattr(lib, "plimsoll_cblas_counts"):
            counts = [ctypes.c_longlong() for _ in range(3)]
            lib.plimsoll_cblas_counts(*(ctypes.byref(c) for c in counts))
            return counts[0].value, counts[1].value, counts[2].value
    return None


HALF_BF16, HALF_F16, HALF_F32 = 0, 1, 2  # engine/cblas_shim.c's kinds
HALF_ROWS = 32  # rows one call of the half-precision kernel takes


def half_gemv() -> Callable[..., int] | None:
    """The shim's half-precision decode product (`plimsoll_half_gemv` in
    engine/cblas_shim.c) as a ctypes function, or None without the shim (MKL, the
    reference BLAS, macOS). Its arguments: kind (HALF_BF16 / HALF_F16), rows (at most
    HALF_ROWS), k, x pointer, x row stride, weight pointer, weight row stride, y pointer,
    y row stride, first and end output column; it returns 0, or -1 for bad arguments."""
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    return _shim_function("plimsoll_half_gemv", [i, i, i, p, ll, p, ll, p, ll, i, i], i)


def half_rows_sum() -> Callable[..., int] | None:
    """The shim's weighted sum of stored rows (`plimsoll_half_rows_sum`): kind (HALF_*),
    rows of x (at most HALF_ROWS), rows of w summed, columns (a multiple of 8), x pointer
    and row stride, w pointer and row stride (elements), y pointer and row stride;
    y = x @ w, summed in float32. Returns 0, or -1 for bad arguments. None without the
    shim."""
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    return _shim_function("plimsoll_half_rows_sum", [i, i, ll, i, p, ll, p, ll, p, ll], i)


SOFTMAX_F32, SOFTMAX_BF16, SOFTMAX_F16 = 0, 1, 2  # engine/cblas_shim.c's softmax kinds


def softmax_rows() -> Callable[..., int] | None:
    """The shim's prefill softmax (`plimsoll_softmax_rows` in engine/cblas_shim.c) as a
    ctypes function, or None without the shim. Its arguments: kind (SOFTMAX_F32, or
    SOFTMAX_BF16 / SOFTMAX_F16 to round as such a model's attention does), the pointer to
    contiguous rows x columns float32 scores, first and end row, columns, pointers to the
    int64 first and end visible key of each window, queries per head, rows per batch
    entry and the window sets (1, or one per batch entry); it returns 0, or -1 for bad
    arguments."""
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    return _shim_function("plimsoll_softmax_rows", [i, p, ll, ll, ll, p, p, ll, ll, ll], i)


def swiglu() -> Callable[..., int] | None:
    """The shim's float32 SwiGLU (`plimsoll_swiglu`): out, gate and up pointers and a
    count of values; out = silu(gate) * up. None without the shim."""
    p, ll = ctypes.c_void_p, ctypes.c_longlong
    return _shim_function("plimsoll_swiglu", [p, p, p, ll], ctypes.c_int)


def _shim_function(name: str, argtypes: list, restype) -> Callable[..., int] | None:
    """The shim's function `name`, typed once; None until a loaded library has it."""
    fn = _shim_functions.get(name)
    if fn is None:
        fn = next((f for lib in _handles if (f := getattr(lib, name, None)) is not None), None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
            _shim_functions[name] = fn
    return fn


_shim_functions: dict[str, Callable[..., int]] = {}


_half_lock = threading.Lock()


def kernel_threads() -> int:
    """Threads a large decode-kernel product may run on: $PLIMSOLL_KERNEL_THREADS, else
    the BLAS's (the usable CPUs). A shim without helpers (not x86_64 Linux) runs one
    whatever this says."""
    raw = os.environ.get(KERNEL_THREADS_ENV, "").strip()
    threads = state().threads if _state is not None else usable_cpus()
    if raw:
        try:
            threads = int(raw)
        except ValueError:
            log.warning("%s=%r is not a number; using %d", KERNEL_THREADS_ENV, raw, threads)
    return max(1, min(threads, KERNEL_MAX_THREADS))


def _start_kernel_helpers() -> None:
    """Starts the shim's helper threads once, the first time a weight is registered: each
    a daemon thread that calls `plimsoll_kernel_helper`, which never returns (ctypes
    releases the GIL for it). Then products from KERNEL_PARALLEL_MIN_BYTES are shared."""
    global _helpers
    if _helpers is not None:
        return
    _helpers = 0
    helper = _shim_function("plimsoll_kernel_helper", [ctypes.c_int, ctypes.c_int], None)
    helpers = kernel_threads() - 1
    if helper is None or _kernel_share() is None or helpers < 1:
        return
    try:
        for i in range(helpers):
            threading.Thread(target=helper, args=(i, helpers),
                             name=f"plimsoll-kernel-{i + 1}", daemon=True).start()
    except RuntimeError as err:  # no thread to be had: products stay on one thread
        log.warning("decode-kernel helper threads not started: %s", err)
        return
    _helpers = helpers
    share_products()


_helpers: int | None = None  # None until the first registration tried to start them


def _kernel_share() -> Callable[..., None] | None:
    return _shim_function("plimsoll_kernel_share", [ctypes.c_longlong, ctypes.c_longlong],
                          None)


def share_products(half_one_row_min_row: int = HALF_ONE_ROW_SHARED_MIN_ROW_BYTES) -> bool:
    """Decode-kernel products from KERNEL_PARALLEL_MIN_BYTES of weight shared with the
    helper threads from now on, one row of a half-precision weight only where its rows
    hold `half_one_row_min_row` bytes or more (benchmarks switch it in one process); False
    where no helper runs."""
    share = _kernel_share()
    if not _helpers or share is None:
        return False
    share(KERNEL_PARALLEL_MIN_BYTES, half_one_row_min_row)
    return True


def kernel_helpers() -> int:
    """Helper threads the decode kernels share large products with (0: none started)."""
    return _helpers or 0


def kernel_shared() -> tuple[int, int, int]:
    """Decode-kernel products shared with the helper threads since the load, their output
    columns, and how many of those the helpers computed; zeros without them."""
    p = ctypes.POINTER(ctypes.c_longlong)
    fn = _shim_function("plimsoll_kernel_counts", [p, p, p], None)
    if fn is None:
        return 0, 0, 0
    out = [ctypes.c_longlong() for _ in range(3)]
    fn(*(ctypes.byref(v) for v in out))
    return out[0].value, out[1].value, out[2].value


def half_register(pointer: int, n: int, k: int, kind: int) -> int | None:
    """Registers the n x k half-precision weight at `pointer` (rows k values apart) with
    the shim, whose cblas_sgemm then runs the half-precision kernel for a float32 product
    with that pointer as its weight (engine/cblas_shim.c, "shown to MLX as float32 ones").
    The caller keeps the buffer alive until `half_unregister`. The slot, or None without
    the shim or a free slot."""
    fn = _shim_function("plimsoll_half_register",
                        [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int],
                        ctypes.c_int)
    if fn is None:
        return None
    with _half_lock:
        _start_kernel_helpers()
        slot = fn(pointer, n, k, kind)
    return slot if slot >= 0 else None


SCALE_BF16, SCALE_F16, SCALE_F32 = 0, 1, 2  # engine/cblas_shim.c's scale kinds


def quant_register(pointer: int, n: int, k: int, bits: int, group: int, scales: int,
                   biases: int, scale_kind: int) -> int | None:
    """Registers the n x k affine-quantized weight at `pointer` (rows k * bits / 8 bytes
    apart, n x k/group scales and biases of `scale_kind` at those pointers) like
    `half_register`; the slot, or None."""
    p, i = ctypes.c_void_p, ctypes.c_int
    fn = _shim_function("plimsoll_quant_register", [p, i, i, i, i, p, p, i], i)
    if fn is None:
        return None
    with _half_lock:
        _start_kernel_helpers()
        slot = fn(pointer, n, k, bits, group, scales, biases, scale_kind)
    return slot if slot >= 0 else None


def quant_gemv() -> Callable[..., int] | None:
    """The shim's affine-quantized decode product (`plimsoll_quant_gemv`), or None. Its
    arguments: bits, group, scale kind, rows, k, x pointer (each row: k values; the
    kernel sums each group itself), x row stride, weight, scales and biases pointers, y
    pointer, y row stride, first and end output column."""
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    return _shim_function("plimsoll_quant_gemv", [i, i, i, i, i, p, ll, p, p, p, p, ll, i, i],
                          i)


def half_unregister(slot: int) -> None:
    fn = _shim_function("plimsoll_half_unregister", [ctypes.c_int], None)
    if fn is not None:
        with _half_lock:
            fn(slot)


def half_calls() -> int:
    """Products the shim has run for registered half-precision weights since the load."""
    fn = _shim_function("plimsoll_half_calls", [], ctypes.c_longlong)
    return int(fn()) if fn is not None else 0


def half_registered() -> int:
    """Half-precision weights registered with the shim now."""
    fn = _shim_function("plimsoll_half_registered", [], ctypes.c_int)
    return int(fn()) if fn is not None else 0


def half_kernel_isa() -> str | None:
    """Which decode kernels the shim runs on this CPU ("avx512", "avx2" or "portable";
    float32 weights stay on AVX2 under AVX-512), or None without the shim."""
    fn = _shim_function("plimsoll_half_isa", [], ctypes.c_int)
    return KERNEL_ISAS[fn()] if fn is not None else None


def limit_kernel_isa(most: str) -> str | None:
    """Runs the decode kernels on at most `most` (one of KERNEL_ISAS) from now on; the
    one now in use, None without the shim."""
    fn = _shim_function("plimsoll_half_limit_isa", [ctypes.c_int], ctypes.c_int)
    return KERNEL_ISAS[fn(KERNEL_ISAS.index(most))] if fn is not None else None


def kernel_isa_limit() -> str:
    """$PLIMSOLL_KERNEL_ISA (portable, avx2 or avx512; a value it is not is logged and
    ignored), else the best: "avx512"."""
    raw = os.environ.get(KERNEL_ISA_ENV, "").strip().lower()
    if raw and raw not in KERNEL_ISAS:
        log.warning("%s=%r is not one of %s; the best the CPU has is used", KERNEL_ISA_ENV,
                    raw, ", ".join(KERNEL_ISAS))
    return raw if raw in KERNEL_ISAS else KERNEL_ISAS[-1]


def build_shim() -> Path:
    """engine/cblas_shim.c compiled once per source and machine into the cache folder
    (`cache_root()`: PLIMSOLL_CACHE_DIR, else ~/.cache/plimsoll), by the first C compiler that works:
    $CC, cc, gcc, clang, then the `ziglang` wheel's."""
    source = SHIM_SOURCE.read_bytes()
    key = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    folder = _shim_folder()
    out = folder / f"cblas_shim-{key}.so"
    if out.is_file():
        return out
    tried = []
    for cc in compilers():
        tmp = folder / f".{out.name}.{os.getpid()}.tmp"
        # --no-undefined: a build that would need a library after all fails here, not at load.
        # No stack protector: compilers that turn it on by default would call libc's
        # __stack_chk_fail, which a -nostdlib build has not got.
        cmd = [*cc, "-O2", "-shared", "-fPIC", "-nostdlib", "-fno-stack-protector",
               "-Wl,--no-undefined", "-o", str(tmp), str(SHIM_SOURCE)]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            tried.append(f"{os.path.basename(cc[-1])}: {err}")
            continue
        if done.returncode == 0 and tmp.is_file():
            os.replace(tmp, out)  # atomic: a process building beside us wins or loses whole
            return out
        tmp.unlink(missing_ok=True)
        tail = (done.stderr or b"").decode(errors="replace").strip().splitlines()[-1:]
        tried.append(f"{os.path.basename(cc[-1])}: exit {done.returncode} {' '.join(tail)}")
    if not tried:
        raise ShimUnavailable("no C compiler to build the CBLAS shim (install a C compiler "
                              "or the ziglang wheel)")
    raise ShimUnavailable("the CBLAS shim did not build: " + "; ".join(tried))


def compilers() -> list[list[str]]:
    """C compilers to try, as argument lists, in order."""
    found: list[list[str]] = []
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc", "clang"):
        path = shutil.which(name.split()[0]) if name else None
        if path and [path] not in found:
            found.append([path, *name.split()[1:]])
    if find_spec("ziglang") is not None:
        found.append([sys.executable, "-m", "ziglang", "cc"])
    return found


def _shim_folder() -> Path:
    """The cache folder (engine/cache_dir.py), else a private one under the temporary folder: never a folder
    another user could have put a library in."""
    candidates = [Path(tempfile.gettempdir()) / f"plimsoll-blas-{os.getuid()}"]
    with contextlib.suppress(RuntimeError, KeyError):  # no home folder to be found
        candidates.insert(0, cache_root() / "blas")
    for folder in candidates:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = folder.lstat()
        except OSError:
            continue
        private = st.st_uid == os.getuid() and not st.st_mode & 0o022
        if stat.S_ISDIR(st.st_mode) and private and os.access(folder, os.W_OK):
            return folder
    raise ShimUnavailable("no private writable folder for the CBLAS shim")


# mkl_service.h
_MKL_INTERFACE_LP64, _MKL_INTERFACE_GNU = 0, 2
_MKL_THREADING = {"intel": 0, "sequential": 1, "pgi": 2, "gnu": 3, "tbb": 4}


def _mkl_state(lib: ctypes.CDLL, path: str, reason: str, threads: int) -> BlasState:
    # Both layers must be set before any other MKL call; a variable the user set wins.
    if "MKL_INTERFACE_LAYER" not in os.environ:
        # MLX's LAPACK calls (and the reference liblapack, built with gfortran) use the
        # GNU Fortran convention for complex return values.
        lib.MKL_Set_Interface_Layer(ctypes.c_int(_MKL_INTERFACE_LP64 | _MKL_INTERFACE_GNU))
    layer = os.environ.get("MKL_THREADING_LAYER", "").strip().lower()
    if not layer:
        # Intel OpenMP comes with the wheel (intel-openmp); GNU's libgomp may be missing.
        layer = "sequential" if threads == 1 else "intel"
        got = lib.MKL_Set_Threading_Layer(ctypes.c_int(_MKL_THREADING[layer]))
        layer = _MKL_LAYERS.get(got, layer)
    if "MKL_NUM_THREADS" not in os.environ:
        lib.MKL_Set_Num_Threads(ctypes.c_int(threads))
    actual = int(lib.MKL_Get_Max_Threads())
    version = ""
    desc = "Intel oneMKL"
    if hasattr(lib, "MKL_Get_Version_String"):
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        text = buf.value.decode(errors="replace")
        # "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build 20260915 for ..."
        marker = " Version "
        if marker in text:
            version = text.split(marker, 1)[1].split("-", 1)[0].split()[0]
        desc = f"Intel oneMKL {version}".strip()
    desc += f" ({layer} threading)"
    return BlasState("mkl", version, desc, actual, True, reason, path)


# --------------------------------------------------------------------------------------
# how many CPUs the process may use


def parallel_min() -> tuple[int, int]:
    """(gemv, gemm) multiply-adds from which a product runs on every thread: the defaults,
    or $PLIMSOLL_BLAS_PARALLEL_MIN ("GEMV,GEMM"; a value that does not parse is logged
    and the defaults kept)."""
    raw = os.environ.get(PARALLEL_ENV, "").strip()
    if not raw:
        return GEMV_PARALLEL_MIN, GEMM_PARALLEL_MIN
    try:
        gemv, gemm = (int(v) for v in raw.split(","))
        if not (0 <= gemv < 2**63 and 0 <= gemm < 2**63):  # the shim's long long
            raise ValueError
    except ValueError:
        log.warning("%s=%r is not two non-negative integers (GEMV,GEMM); using %d,%d",
                    PARALLEL_ENV, raw, GEMV_PARALLEL_MIN, GEMM_PARALLEL_MIN)
        return GEMV_PARALLEL_MIN, GEMM_PARALLEL_MIN
    return gemv, gemm


def skinny_rows() -> int:
    """Rows up to which the shim runs a float32 product through its own kernel: SKINNY_ROWS,
    or $PLIMSOLL_BLAS_SKINNY_ROWS (0 off, up to HALF_ROWS; a value that does not parse is
    logged, the default kept)."""
    raw = os.environ.get(SKINNY_ROWS_ENV, "").strip()
    if not raw:
        return SKINNY_ROWS
    if raw.isdigit() and int(raw) <= HALF_ROWS:
        return int(raw)
    log.warning("%s=%r is not a whole number from 0 to %d; using %d", SKINNY_ROWS_ENV, raw,
                HALF_ROWS, SKINNY_ROWS)
    return SKINNY_ROWS


def set_skinny_rows(rows: int) -> int:
    """Float32 products of up to `rows` rows through the shim's kernel from now on (0: none;
    benchmarks switch it in one process), shared with the helper threads once the BLAS
    is loaded; the rows, 0 where the shim has no kernels."""
    global _skinny
    bind = _shim_function("plimsoll_skinny_bind", [ctypes.c_int, ctypes.c_longlong], None)
    if bind is None or half_gemv() is None:  # no shim, or one built without its kernels
        return 0
    bind(rows, SKINNY_MIN_MACS)
    _skinny = rows
    if rows and _state is not None:
        _start_kernel_helpers()
    return rows


_skinny = 0  # the rows the shim was last told (`set_skinny_rows`)


def skinny_calls() -> int:
    """Float32 products the shim ran through its own kernel since the load (tests read it)."""
    fn = _shim_function("plimsoll_skinny_calls", [], ctypes.c_longlong)
    return int(fn()) if fn is not None else 0


def gemv_rows() -> int:
    """Rows up to which the shim sends a product to sgemv, a call per row: GEMV_ROWS, or
    $PLIMSOLL_BLAS_GEMV_ROWS (1-64; a value that does not parse is logged, the default kept)."""
    raw = os.environ.get(GEMV_ROWS_ENV, "").strip()
    if not raw:
        return GEMV_ROWS
    if raw.isdigit() and 1 <= int(raw) <= 64:
        return int(raw)
    log.warning("%s=%r is not a whole number from 1 to 64; using %d", GEMV_ROWS_ENV, raw,
                GEMV_ROWS)
    return GEMV_ROWS


def usable_cpus() -> int:
    """CPUs this process may run on at once: its affinity mask, capped by the CPU quota of
    its cgroup and every ancestor (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us),
    rounded up. At least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(_read("/proc/self/cgroup"), _read("/proc/self/mountinfo"),
                             _read)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return max(1, n)


def cgroup_cpu_quota(proc_cgroup: str | None, mountinfo: str | None, read) -> float | None:
    """The tightest CPU quota (in cores) on the process's cgroup and its ancestors, or None
    when there is none. Pure over file contents: `read(path)` returns a file's text or None."""
    limits: list[float] = []
    mounts = _mounts(mountinfo or "")
    for line in (proc_cgroup or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            for mount_point, root in _mount_points(mounts, "cgroup2", None):
                for d in _dirs(mount_point, root, path):
                    limits += _v2_limit(read(d + "/cpu.max"))
        elif "cpu" in controllers.split(","):
            for mount_point, root in _mount_points(mounts, "cgroup", "cpu"):
                for d in _dirs(mount_point, root, path):
                    limits += _v1_limit(read(d + "/cpu.cfs_quota_us"),
                                        read(d + "/cpu.cfs_period_us"))
    return min(limits) if limits else None


def _v2_limit(text: str | None) -> list[float]:
    fields = (text or "").split()
    if len(fields) != 2 or fields[0] == "max":
        return []
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def _v1_limit(quota_text: str | None, period_text: str | None) -> list[float]:
    try:
        quota, period = int((quota_text or "").strip()), int((period_text or "").strip())
    except ValueError:
        return []
    return [quota / period] if quota > 0 and period > 0 else []  # -1: no quota


def _mounts(text: str) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fstype, super options) per line of /proc/self/mountinfo."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if sep and len(fields) >= 5 and rest:
            opts = set(rest[2].split(",")) if len(rest) > 2 else set()
            out.append((fields[3], fields[4], rest[0], opts))
    return out


def _mount_points(mounts, fstype: str, controller: str | None) -> list[tuple[str, str]]:
    found = [(m[1], m[0]) for m in mounts
             if m[2] == fstype and (controller is None or controller in m[3])]
    if found:
        return found
    default = "/sys/fs/cgroup" if controller is None else f"/sys/fs/cgroup/{controller}"
    return [(default, "/")]


def _dirs(mount_point: str, root: str, path: str) -> list[str]:
    """The cgroup's directory under the mount, then each ancestor up to the mount."""
    rel = path
    root = root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        rel = path[len(root):]
    d = os.path.normpath(mount_point + "/" + rel.lstrip("/"))
    top = os.path.normpath(mount_point)
    out = [d]
    while d != top and d.startswith(top + "/"):
        d = os.path.dirname(d)
        out.append(d)
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return None
