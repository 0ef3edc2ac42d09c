"""The optimized BLAS under MLX (engine/blas.py, issue 10).

With the `[blas]` extra MLX's float32 matrix products go to OpenBLAS through the CBLAS
shim (engine/cblas_shim.c: one-row products to sgemv), loaded before `mlx.core`;
PLIMSOLL_BLAS=mkl loads oneMKL (the `[mkl]` extra) instead; `--no-optimized-blas` /
PLIMSOLL_BLAS=reference keep MLX's bundled reference BLAS. Either way greedy decoding gives the same tokens, and the logits
agree within LOGITS_ATOL (measured: ~7e-6 on float32 demo models whose logits reach ~3;
exactly 0 on bfloat16 ones, which never call the BLAS). Each BLAS needs its own process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import blas
from engine.cache_dir import CACHE_ENV
from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2, inference_pb2
from telemetry import names
from tests.support.near_tie import agree_but_at_a_near_tie
from tests.support.processes import run_side_by_side
from tools.bench_blas import LOGITS_ATOL, compare_greedy
from tools.harness.server import ROOT, free_port, start_server, wait_all_serving

HAVE_MKL = sys.platform == "linux" and blas.find_mkl() is not None
needs_mkl = pytest.mark.skipif(not HAVE_MKL, reason="needs the [mkl] extra (Linux x86_64)")
HAVE_OPENBLAS = (sys.platform == "linux" and blas.find_openblas() is not None
                 and bool(blas.compilers()))
needs_openblas = pytest.mark.skipif(not HAVE_OPENBLAS,
                                    reason="needs the [blas] extra (Linux) and a compiler")
# What this process chose must not leak into the children's choice.
_OURS = ("PLIMSOLL_BLAS", "MKL_NUM_THREADS", "MKL_THREADING_LAYER", "MKL_INTERFACE_LAYER",
         "OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT", "PLIMSOLL_BLAS_PARALLEL_MIN",
         "PLIMSOLL_BLAS_GEMV_ROWS", "PLIMSOLL_BLAS_SKINNY_ROWS", "PLIMSOLL_KERNEL_ISA")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _OURS}
    return env | extra


def _python(code: str, env: dict[str, str] | None = None, **kw) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env=env or _env(), capture_output=True, text=True, timeout=120,
                          **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


_STATE = """
    import json, dataclasses
    from engine import blas
    print(json.dumps(dataclasses.asdict(blas.state())))
"""


def _state(env: dict[str, str] | None = None, args: tuple[str, ...] = (), **kw) -> dict:
    code = textwrap.dedent(_STATE)
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env or _env(),
                          capture_output=True, text=True, timeout=60, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# -- which BLAS, and why ---------------------------------------------------------------------
@needs_openblas
def test_mlx_binds_its_blas_calls_to_the_shim_or_mkl_only_when_on(tmp_path):
    """The dynamic linker's own word: libmlx.so's cblas_sgemm binds to the shim with the
    extra, to libmkl_rt (with a LAPACK routine) under PLIMSOLL_BLAS=mkl, and to the bundled
    reference BLAS with PLIMSOLL_BLAS=reference."""
    code = """
        import engine, mlx.core as mx
        a = mx.random.normal((64, 64))
        with mx.stream(mx.cpu):
            mx.eval(a @ a, mx.linalg.inv(a))
    """
    sides = [("auto", "cblas_shim-"), ("reference", "libblas")]
    if HAVE_MKL:
        sides.append(("mkl", "libmkl_rt"))
    # Side by side: the dynamic linker's logging makes each run slow.
    runs = run_side_by_side(
        [[sys.executable, "-c", textwrap.dedent(code)]] * len(sides), cwd=ROOT, timeout=120,
        envs=[_env(PLIMSOLL_BLAS=setting, LD_DEBUG="bindings",
                   LD_DEBUG_OUTPUT=str(tmp_path / setting)) for setting, _ in sides])
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    for setting, want in sides:
        text = "".join(p.read_text(errors="replace") for p in tmp_path.glob(f"{setting}.*"))
        sgemm = [ln for ln in text.splitlines()
                 if "libmlx.so" in ln and "`cblas_sgemm'" in ln]
        assert sgemm and all(want in ln for ln in sgemm), (setting, sgemm)
        if setting == "mkl":
            assert any("libmlx.so" in ln and "`sgetrf_'" in ln and "libmkl_rt" in ln
                       for ln in text.splitlines())


@needs_openblas
def test_state_follows_the_switches():
    on = _state()
    assert (on["name"], on["optimized"], on["reason"]) == ("openblas", True,
                                                          "the [blas] extra")
    assert on["version"] and on["threads"] == blas.usable_cpus()
    assert "/" not in on["description"] and "gemv" in on["description"]
    # Kernels pinned by the machine's environment are named as such (it is left as set).
    pinned = os.environ.get(blas.CORETYPE_ENV, "").strip()
    assert (f"kernels as {blas.CORETYPE_ENV}={pinned} asks" in on["description"]
            if pinned else "asks" not in on["description"]), on["description"]
    # ... and AVX2 ones pinned on a CPU with AVX-512 say what OpenBLAS would run instead.
    core = re.search(r"(\w+) kernels", on["description"])
    was = blas.half_kernel_isa()
    cpu = blas.limit_kernel_isa("avx512")  # the best this CPU has
    blas.limit_kernel_isa(was or "portable")
    below = bool(pinned) and core is not None and blas.CORE_ISAS.get(core[1]) == "avx2" \
        and cpu == "avx512"
    assert ("OpenBLAS's own choice runs its AVX-512 ones" in on["description"]) == below
    if HAVE_MKL:
        mkl = _state(_env(PLIMSOLL_BLAS="mkl"))
        assert (mkl["name"], mkl["optimized"], mkl["reason"]) == ("mkl", True,
                                                                 "PLIMSOLL_BLAS=mkl")

    off = _state(_env(PLIMSOLL_BLAS="reference"))
    assert (off["name"], off["optimized"], off["threads"]) == ("reference", False, 1)
    assert off["reason"] == "PLIMSOLL_BLAS=reference" and not off["problem"]
    # The flag is read off the command line, before argparse and before mlx.core.
    flag = _state(args=(blas.FLAG,))
    assert (flag["name"], flag["reason"]) == ("reference", blas.FLAG)

    bad = _state(_env(PLIMSOLL_BLAS="/nonexistent/libblas.so"))
    assert bad["name"] == "reference" and bad["problem"]


def test_the_blas_line_says_who_chose_openblass_kernels():
    pin = blas.CORETYPE_ENV
    assert blas.kernels_text("", "", "avx512") == ""
    assert blas.kernels_text("SkylakeX", "", "avx512") == "SkylakeX kernels"
    assert blas.kernels_text("Haswell", "", "avx2") == "Haswell kernels"
    assert blas.kernels_text("SkylakeX", "SkylakeX", "avx512") == \
        f"SkylakeX kernels as {pin}=SkylakeX asks"
    assert blas.kernels_text("Haswell", "haswell", "avx2") == \
        f"Haswell kernels as {pin}=haswell asks"
    for core in ("Haswell", "Zen"):
        assert blas.kernels_text(core, core, "avx512") == (
            f"{core} kernels as {pin}={core} asks on a CPU with AVX-512, for which "
            "OpenBLAS's own choice runs its AVX-512 ones")


@needs_openblas
def test_mlx_imported_first_keeps_the_reference_and_says_so():
    out = _python("""
        import json, dataclasses, mlx.core
        from engine import blas
        print(json.dumps(dataclasses.asdict(blas.state())))
    """)
    got = json.loads(out)
    assert got["name"] == "reference" and got["problem"]
    assert "imported before" in got["reason"]


@needs_openblas
def test_threads_follow_the_affinity_mask():
    def one_cpu():
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    assert _state(preexec_fn=one_cpu)["threads"] == 1
    assert _state(_env(OPENBLAS_NUM_THREADS="1"))["threads"] == 1  # the user's variable wins
    if HAVE_MKL:
        one = _state(_env(PLIMSOLL_BLAS="mkl"), preexec_fn=one_cpu)
        assert one["threads"] == 1 and "sequential" in one["description"]
        assert _state(_env(PLIMSOLL_BLAS="mkl", MKL_NUM_THREADS="1"))["threads"] == 1


@needs_openblas
def test_openblas_workers_spin_through_a_prefill_chunks_gaps_unless_the_user_says():
    """OpenBLAS reads its workers' spin at load: the server's default (2^26 cycles), or the
    user's own variable."""
    code = """
        import os
        from engine import blas
        blas.preload()
        print(os.environ["OPENBLAS_THREAD_TIMEOUT"])
    """
    assert blas.OPENBLAS_SPIN == 26
    assert _python(code).strip() == "26"
    assert _python(code, _env(OPENBLAS_THREAD_TIMEOUT="20")).strip() == "20"


@needs_openblas
@pytest.mark.parametrize("gemv_rows,skinny_rows", [(None, "0"), ("1", "0"), (None, None)])
def test_the_shim_sends_products_of_up_to_three_rows_to_gemv_and_the_rest_to_gemm(
        gemv_rows, skinny_rows):
    """Through MLX itself: a one-row product (either layout of the weight, as a linear
    layer or a plain matmul stores it) goes to sgemv, a three-row one to three sgemv
    calls (either layout of the rows too), a four- or 8-row one to sgemm; every result
    matches NumPy in float64. PLIMSOLL_BLAS_GEMV_ROWS=1 sends only one-row products.
    With the defaults (the skinny kernel on) every product by a weight stored as a linear
    layer stores it, up to 8 rows, goes to the shim's own kernel instead."""
    rows_as_gemv = int(gemv_rows or blas.GEMV_ROWS)
    skinny = blas.SKINNY_ROWS if skinny_rows is None else int(skinny_rows)
    env = _env(**({blas.GEMV_ROWS_ENV: gemv_rows} if gemv_rows else {}),
               **({blas.SKINNY_ROWS_ENV: skinny_rows} if skinny_rows else {}))
    out = _python("""
        import json
        import numpy as np
        from engine import blas
        import mlx.core as mx
        rng = np.random.default_rng(0)
        w = rng.standard_normal((384, 256)).astype(np.float32)
        x = rng.standard_normal((8, 256)).astype(np.float32)
        W, X = mx.array(w), mx.array(x)
        mx.eval(W, X)
        got = {}
        for name, y, want, rows, linear in (
            ("x @ w.T", X[:1] @ W.T, x[:1] @ w.T.astype(np.float64), 1, True),
            ("w.T[:1] @ w", W.T[:1] @ W, w.T[:1].astype(np.float64) @ w, 1, False),
            ("x @ w.T (3 rows)", X[:3] @ W.T, x[:3].astype(np.float64) @ w.T, 3, True),
            ("x.T[:, :3].T @ w.T (3 rows)", X.T[:, :3].T @ W.T,
             x[:3].astype(np.float64) @ w.T, 3, True),
            ("w.T[:3] @ w (3 rows)", W.T[:3] @ W, w.T[:3].astype(np.float64) @ w, 3, False),
            ("x @ w.T (4 rows)", X[:4] @ W.T, x[:4].astype(np.float64) @ w.T, 4, True),
            ("x @ w.T (8 rows)", X @ W.T, x.astype(np.float64) @ w.T, 8, True),
        ):
            before, skinny = blas.shim_counts(), blas.skinny_calls()
            mx.eval(y)
            after = blas.shim_counts()
            got[name] = {"gemm": after[0] - before[0], "gemv": after[1] - before[1],
                         "skinny": blas.skinny_calls() - skinny,
                         "err": float(np.abs(np.array(y) - want).max()), "rows": rows,
                         "linear": linear}
        print(json.dumps(got))
    """, env)
    for name, r in json.loads(out).items():
        assert r["err"] < 1e-3, (name, r)
        if r["linear"] and r["rows"] <= skinny:
            want = (0, 0, 1)
        else:
            want = (r["rows"], 0, 0) if r["rows"] <= rows_as_gemv else (0, 1, 0)
        assert (r["gemv"], r["gemm"], r["skinny"]) == want, (name, r)


_THREADS_USED = """
    import json
    from engine import blas
    import mlx.core as mx
    small = mx.ones((8, 256)) @ mx.ones((384, 256)).T  # 786k multiply-adds
    head = mx.ones((32, 128)) @ mx.ones((1024, 128)).T  # 4.2M: the tiny model's, 32 rows
    large = mx.ones((64, 512)) @ mx.ones((512, 512))  # 16.8M
    one_row = mx.ones((1, 1024)) @ mx.ones((1024, 1024))  # one row, 4 MB of weights
    got = {}
    for name, y in (("small", small), ("head", head), ("large", large),
                    ("one_row", one_row)):
        before = blas.shim_counts()
        mx.eval(y)
        got[name] = blas.shim_counts()[2] - before[2]
    print(json.dumps({"parallel": got, "min": blas.parallel_min()}))
"""


@needs_openblas
@pytest.mark.skipif(blas.usable_cpus() < 2, reason="one CPU: OpenBLAS runs one thread")
def test_only_products_past_the_thresholds_run_on_every_thread():
    """A few rows of a small layer stay on one thread (a second one would take the core the
    event loop needs); a prefill-sized product and a one-row product over 2 MB of weights
    use them all; PLIMSOLL_BLAS_PARALLEL_MIN moves both thresholds. (OpenBLAS's own: the
    skinny kernel, which would take the small product, is off here.)"""
    env = _env(OPENBLAS_NUM_THREADS="2", **{blas.SKINNY_ROWS_ENV: "0"})
    default = json.loads(_python(_THREADS_USED, env))
    assert default["parallel"] == {"small": 0, "head": 0, "large": 1, "one_row": 1}, default
    assert default["min"] == [blas.GEMV_PARALLEL_MIN, blas.GEMM_PARALLEL_MIN]
    every = json.loads(_python(_THREADS_USED, env | {blas.PARALLEL_ENV: "0,0"}))
    assert every["parallel"] == {"small": 1, "head": 1, "large": 1, "one_row": 1}, every
    high = json.loads(_python(_THREADS_USED, env | {blas.PARALLEL_ENV: "99999999,99999999"}))
    assert high["parallel"] == {"small": 0, "head": 0, "large": 0, "one_row": 0}, high


_SKINNY = """
    import json
    import numpy as np
    from engine import blas
    import mlx.core as mx
    rng = np.random.default_rng(5)
    got = []
    # (rows, n, k): tails of k past the 8-value vectors and the 32-value blocks, n not a
    # multiple of 16 (each from SKINNY_MIN_MACS), 2 MiB of weight (shared with the helper
    # threads), 9 rows (OpenBLAS)
    for rows, n, k in ((1, 384, 256), (2, 160, 257), (3, 64, 1031), (4, 513, 130),
                       (5, 256, 512), (8, 1024, 512), (1, 1024, 512), (9, 384, 256)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal((rows, k + 3)).astype(np.float32)
        W, X = mx.array(w), mx.array(x)
        mx.eval(W, X)
        calls, shared = blas.skinny_calls(), blas.kernel_shared()[0]
        y = X[:, :k] @ W.T  # x's rows k + 3 apart, as MLX passes them
        mx.eval(y)
        want = x[:, :k].astype(np.float64) @ w.T.astype(np.float64)
        scale = np.abs(x[:, :k]).astype(np.float64) @ np.abs(w.T).astype(np.float64)
        got.append({"rows": rows, "n": n, "k": k, "skinny": blas.skinny_calls() - calls,
                    "shared": blas.kernel_shared()[0] - shared,
                    "err": float((np.abs(np.array(y) - want) / scale).max()),
                    "bits": np.array(y).view(np.uint32).tolist()})
    print(json.dumps({"got": got, "helpers": blas.kernel_helpers(),
                      "description": blas.state().description}))
"""


@needs_openblas
def test_skinny_float32_products_run_through_the_shims_kernel():
    """Through MLX itself, with the defaults: a product of up to 8 rows by a weight stored
    as a linear layer stores it runs through the shim's own kernel (any k, tails
    included; x's rows apart), within float32 rounding of float64; a weight of 2 MiB is
    shared with the helper threads and gives the same bits on one thread; 9 rows go to
    OpenBLAS. The description says so; PLIMSOLL_BLAS_SKINNY_ROWS=0 turns it off."""
    default = json.loads(_python(_SKINNY, _env()))
    assert "float32 products of up to 8 rows through the shim's kernel" in \
        default["description"], default["description"]
    for r in default["got"]:
        assert r["err"] < 1e-5, r  # relative to the sum of the terms' sizes
        assert r["skinny"] == (1 if r["rows"] <= blas.SKINNY_ROWS else 0), r
    big = [r for r in default["got"] if r["n"] * r["k"] * 4 >= blas.KERNEL_PARALLEL_MIN_BYTES
           and r["skinny"]]
    assert big and all(r["shared"] == (1 if default["helpers"] else 0) for r in big), big
    one = json.loads(_python(_SKINNY, _env(**{blas.KERNEL_THREADS_ENV: "1"})))
    assert one["helpers"] == 0
    assert [r["bits"] for r in one["got"]] == [r["bits"] for r in default["got"]]
    # The helpers follow the BLAS's thread count, known only once it is loaded.
    one_blas = json.loads(_python(_SKINNY, _env(OPENBLAS_NUM_THREADS="1")))
    assert one_blas["helpers"] == 0
    assert [r["bits"] for r in one_blas["got"]] == [r["bits"] for r in default["got"]]
    off = json.loads(_python(_SKINNY, _env(**{blas.SKINNY_ROWS_ENV: "0"})))
    assert "through the shim's kernel" not in off["description"]
    assert all(r["skinny"] == 0 and r["err"] < 1e-5 for r in off["got"]), off["got"]


def test_a_skinny_row_count_that_does_not_parse_keeps_the_default(monkeypatch, caplog):
    for bad in ("many", "33", "-2", "2.5"):
        monkeypatch.setenv(blas.SKINNY_ROWS_ENV, bad)
        caplog.clear()
        assert blas.skinny_rows() == blas.SKINNY_ROWS
        assert blas.SKINNY_ROWS_ENV in caplog.text
    for good, want in (("0", 0), ("4", 4), ("32", 32)):
        monkeypatch.setenv(blas.SKINNY_ROWS_ENV, good)
        assert blas.skinny_rows() == want


def test_a_gemv_row_count_that_does_not_parse_keeps_the_default(monkeypatch, caplog):
    for bad in ("many", "0", "65", "-2", "2.5"):
        monkeypatch.setenv(blas.GEMV_ROWS_ENV, bad)
        caplog.clear()
        assert blas.gemv_rows() == blas.GEMV_ROWS
        assert blas.GEMV_ROWS_ENV in caplog.text, bad
    monkeypatch.setenv(blas.GEMV_ROWS_ENV, "8")
    assert blas.gemv_rows() == 8


def test_a_parallel_threshold_that_does_not_parse_keeps_the_defaults(monkeypatch, caplog):
    for bad in ("lots", "1,2,3", "-1,5", "1e9,1e9", f"1,{2**63}"):
        monkeypatch.setenv(blas.PARALLEL_ENV, bad)
        caplog.clear()
        assert blas.parallel_min() == (blas.GEMV_PARALLEL_MIN, blas.GEMM_PARALLEL_MIN)
        assert blas.PARALLEL_ENV in caplog.text, bad
    monkeypatch.setenv(blas.PARALLEL_ENV, " 7,8 ")
    assert blas.parallel_min() == (7, 8)


def test_without_a_compiler_the_choice_falls_back_to_mkl_and_says_why(tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(blas, "compilers", lambda: [])
    monkeypatch.setattr(blas, "_shim_folder", lambda: tmp_path)
    with pytest.raises(blas.ShimUnavailable, match="no C compiler"):
        blas.build_shim()
    loaded = []
    monkeypatch.setattr(blas, "find_openblas", lambda: "/somewhere/libscipy_openblas.so")
    monkeypatch.setattr(blas, "_load_openblas", lambda *a: blas.build_shim())
    monkeypatch.setattr(blas, "find_mkl", lambda: "/somewhere/libmkl_rt.so.3")
    monkeypatch.setattr(blas, "_load", lambda path, reason: loaded.append(reason) or "mkl")
    assert blas._auto("/x/libblas.so.3.10.0") == "mkl"
    assert loaded[0].startswith("the [blas] extra; OpenBLAS skipped: no C compiler")
    monkeypatch.setattr(blas, "find_mkl", lambda: None)
    got = blas._auto("/x/libblas.so.3.10.0")  # and without MKL: the reference, flagged
    assert (got.name, got.problem) == ("reference", True) and "no C compiler" in got.reason


@needs_openblas
@pytest.mark.skipif(find_spec("ziglang") is None, reason="needs the ziglang wheel")
def test_a_machine_with_no_c_compiler_builds_the_shim_with_the_ziglang_wheel(tmp_path):
    """A fresh machine has Python and the extra's wheels only: no cc on PATH, an empty
    cache. The shim is built by ziglang's compiler and OpenBLAS is in use."""
    env = _env(PATH=str(tmp_path / "bin"), PLIMSOLL_CACHE_DIR=str(tmp_path / "cache"),
               HOME=str(tmp_path))
    env.pop("CC", None)
    got = _state(env)
    assert (got["name"], got["problem"]) == ("openblas", False), got
    assert list((tmp_path / "cache" / "blas").glob("cblas_shim-*.so"))


@needs_openblas
@pytest.mark.parametrize("flag", ["-fstack-protector-all", "-DPLIMSOLL_NO_HALF_KERNEL"])
def test_the_shim_builds_whatever_the_compiler_adds(tmp_path, flag):
    """A compiler that turns the stack protector on by default (Ubuntu's gcc) still links
    the shim without libc; one without the half-precision kernel's vector builtins (GCC
    before 9; forced here by the define) builds it without the kernel, and decode then
    keeps MLX's own product."""
    env = _env(CC=" ".join([*blas.compilers()[0], flag]), PLIMSOLL_CACHE_DIR=str(tmp_path))
    got = json.loads(_python("""
        import json
        from engine import blas
        print(json.dumps([blas.state().name, blas.half_gemv() is not None]))
    """, env))
    assert got == ["openblas", flag != "-DPLIMSOLL_NO_HALF_KERNEL"]
    assert list((tmp_path / "blas").glob("cblas_shim-*.so"))


@needs_openblas
def test_a_broken_cached_shim_is_dropped_and_built_again(tmp_path):
    """A cached shim that does not load (a truncated file, say) is removed, the start falls
    back (MKL when there, else the reference) saying why, and the next start builds it."""
    env = _env(PLIMSOLL_CACHE_DIR=str(tmp_path))
    assert _state(env)["name"] == "openblas"
    [built] = (tmp_path / "blas").glob("cblas_shim-*.so")
    built.write_bytes(b"not a library")
    fallback = _state(env)
    assert fallback["name"] == ("mkl" if HAVE_MKL else "reference"), fallback
    assert "did not load" in fallback["reason"] and not built.exists()
    assert _state(env)["name"] == "openblas" and built.exists()


def test_the_shim_is_never_taken_from_a_folder_others_can_write(tmp_path, monkeypatch):
    shared = tmp_path / "cache"
    (shared / "blas").mkdir(parents=True)
    (shared / "blas").chmod(0o777)
    (tmp_path / "tmp" / f"plimsoll-blas-{os.getuid()}").mkdir(parents=True)
    (tmp_path / "tmp" / f"plimsoll-blas-{os.getuid()}").chmod(0o757)
    monkeypatch.setenv(CACHE_ENV, str(shared))
    monkeypatch.setattr(blas.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    with pytest.raises(blas.ShimUnavailable, match="private"):
        blas._shim_folder()
    (shared / "blas").chmod(0o700)
    assert blas._shim_folder() == shared / "blas"


def test_macos_and_other_mlx_builds_are_left_alone(tmp_path, monkeypatch):
    """No loading at all: macOS keeps Accelerate; mlx[cuda] (or a source build, with no
    bundled reference BLAS) keeps whatever it links."""
    site = tmp_path / "site-packages"
    (site / "mlx").mkdir(parents=True)
    (site / "mlx_cpu.libs").mkdir()
    (site / "mlx_cpu.libs" / "libblas-0123abcd.so.3.10.0").touch()
    monkeypatch.setattr(blas, "_mlx_dir", lambda: str(site / "mlx"))
    monkeypatch.setattr(blas, "_load", lambda *a: pytest.fail("nothing may be loaded"))
    monkeypatch.delenv(blas.ENV, raising=False)
    monkeypatch.setattr(blas, "find_mkl", lambda: None)
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)  # as in a fresh process
    got = blas._choose()  # mlx[cpu] without the extra
    assert (got.name, got.version) == ("reference", "3.10.0")
    assert got.reason in ("the [blas] extra is not installed",
                          f"no optimized BLAS wheel for {os.uname().machine}")
    (site / "mlx_cuda_12-0.32.4.dist-info").mkdir()
    monkeypatch.setattr(blas, "find_mkl", lambda: "/somewhere/libmkl_rt.so.3")
    assert (blas._choose().name, blas._choose().optimized) == ("default", False)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert blas._choose().name == "accelerate"


@contextlib.contextmanager
def _child_cpu_cgroup(quota_us: int, period_us: int) -> Iterator[Path]:
    """A child of this process's own cgroup v1 `cpu` hierarchy with that CFS quota,
    removed after (its processes must have exited); skips where none can be made (no
    root, no v1 cpu controller mounted). Children a killed run left are removed first."""
    own = next((line.split(":", 2)[2] for line in
                Path("/proc/self/cgroup").read_text().splitlines()
                if "cpu" in line.split(":", 2)[1].split(",")), None)
    mount = next((Path(p) for p in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")
                  if Path(p, "cpu.cfs_quota_us").exists()), None)
    if own is None or mount is None:
        pytest.skip("no cgroup v1 cpu controller here")
    parent = mount / own.lstrip("/")
    for stale in parent.glob("plimsoll-test-cpu-*"):
        with contextlib.suppress(OSError):  # another run's, still in use: left alone
            stale.rmdir()
    child = parent / f"plimsoll-test-cpu-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a child cpu cgroup: {exc}")
    try:
        (child / "cpu.cfs_period_us").write_text(str(period_us))
        (child / "cpu.cfs_quota_us").write_text(str(quota_us))
        yield child
    finally:
        for _ in range(50):  # a process that has just exited may still be counted
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@needs_openblas
@pytest.mark.skipif(blas.usable_cpus() < 2, reason="the quota must bind below the CPUs")
def test_a_real_cgroup_cpu_quota_sets_the_blas_threads():
    """A process started inside a child cgroup capped at one core (cgroup v1 CFS quota)
    runs the optimized BLAS on one thread where the affinity mask would give it every
    CPU: the threads OpenBLAS itself reports (`blas.state()`, which GetMemoryStatus and
    plimsoll_blas_info show)."""
    with _child_cpu_cgroup(50_000, 50_000) as child:
        code = ("import json, os, dataclasses; "
                f"open({str(child / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
                "from engine import blas; "
                "print(json.dumps([len(os.sched_getaffinity(0)), blas.usable_cpus(), "
                "dataclasses.asdict(blas.state())]))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    affinity, usable, state = json.loads(proc.stdout)
    assert affinity >= 2 and usable == 1
    assert state["optimized"] and state["threads"] == 1, state


def test_cgroup_cpu_quota_v1_v2_and_ancestors():
    quota = blas.cgroup_cpu_quota
    files = {
        "/sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000\n",
        "/sys/fs/cgroup/kubepods/cpu.max": "150000 100000\n",
        "/sys/fs/cgroup/cpu.max": None,
    }
    v2_mounts = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
    # The limit on an ancestor binds a child that has none of its own.
    assert quota("0::/kubepods/pod1\n", v2_mounts, files.get) == 1.5
    assert quota("0::/\n", v2_mounts, {"/sys/fs/cgroup/cpu.max": "max 100000"}.get) is None

    v1_mounts = ("32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                 "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    v1 = {"/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
          "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
          "/sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_quota_us": "-1\n",
          "/sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_period_us": "100000\n"}
    assert quota("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n", v1_mounts,
                 v1.get) == 0.5
    # A namespaced view: the mount's root is the process's own cgroup.
    ns_mounts = "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    ns = {"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "200000",
          "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"}
    assert quota("2:cpu:/docker/abc\n", ns_mounts, ns.get) == 2.0
    assert quota(None, None, files.get) is None


# -- same results --------------------------------------------------------------------------
@needs_openblas
def test_greedy_tokens_identical_and_logits_close_in_process():
    """Two worker processes, one per BLAS: tiny (float32), small (bfloat16) and a float32
    copy of small; every greedy token equal, every step's logits within LOGITS_ATOL."""
    got = compare_greedy(["tiny", "small", "small-float32"], max_tokens=8)
    assert got["blas"]["optimized"]["name"] == "openblas"
    assert got["blas"]["reference"]["name"] == "reference"
    for name, r in got["models"].items():
        assert r["tokens_identical"], name
        assert r["max_abs_diff"] <= LOGITS_ATOL, (name, r)
    assert got["models"]["small"]["max_abs_diff"] == 0.0  # bfloat16 never calls the BLAS


@needs_openblas
def test_server_reports_its_blas_and_the_flag_gives_the_same_tokens(tmp_path, demo_path):
    """`plimsoll serve` with the optimized BLAS and with --no-optimized-blas, on tiny
    (float32) and small (bfloat16, whose prefill may go through float32 and the BLAS:
    engine/fast_prefill.py): each reports its BLAS (status, log line and the
    plimsoll_blas_info series on /metrics), and greedy Generate streams the same tokens
    on both."""
    small = ensure_demo_model("small")
    prompts = ["Once upon a time, in a small village by the sea, there lived an old "
               "fisherman and his daughter.", "The quick brown fox", "def fibonacci(n):"]
    answers = {}
    sides = ((), (blas.FLAG,))
    ports = [free_port() for _ in sides]
    servers = []
    try:
        for args, port in zip(sides, ports, strict=True):  # side by side
            servers.append(start_server(tmp_path, "--model", str(demo_path), "--model",
                                        str(small), "--metrics-port", str(port), *args,
                                        env=_env(), wait=False))
        wait_all_serving(servers)
        found = []
        for srv, args, port in zip(servers, sides, ports, strict=True):
            series = _blas_series(port)
            with srv.stubs() as (control, inference):
                info = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(),
                                               timeout=30).blas
                models = [m.model_id for m in control.ListModels(
                    control_pb2.ListModelsRequest(), timeout=30).models]
                assert len(models) == 2, models
                answers[args] = {m: [_tokens(inference, m, p) for p in prompts]
                                 for m in models}
            found.append((args, info, srv.log(), series))
    except BaseException:
        for srv in servers:
            print(f"server log tail:\n{srv.log()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for srv in servers:
            srv.stop()
    for args, info, log, series in found:
        assert series == [{names.LABEL_BLAS: info.name, names.LABEL_VERSION: info.version,
                           names.LABEL_OPTIMIZED: "true" if info.optimized else "false",
                           names.LABEL_THREADS: str(info.threads)}], series
        if args:
            assert (info.name, info.optimized, info.threads) == ("reference", False, 1)
            assert info.reason == blas.FLAG
        else:
            assert (info.name, info.optimized) == ("openblas", True)
            assert info.threads == blas.usable_cpus() and info.version
        assert f"BLAS: {info.description}" in log
    tiny = next(m for m in answers[()] if m != "small-v1")
    assert answers[()][tiny] == answers[(blas.FLAG,)][tiny]  # float32: only the BLAS differs
    for prompt, fast, stock in zip(prompts, answers[()]["small-v1"],
                                   answers[(blas.FLAG,)]["small-v1"], strict=True):
        agree_but_at_a_near_tie(small, prompt, fast, stock)
    assert all(len(t) == 24 for seqs in answers[()].values() for t in seqs)


def _blas_series(port: int) -> list[dict[str, str]]:
    """The labels of each plimsoll_blas_info series valued 1 on a server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [dict(s.labels) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == names.METRIC_BLAS_INFO and s.value == 1]


def _tokens(inference, model_id: str, prompt: str) -> list[int]:
    req = inference_pb2.GenerateRequest(model_id=model_id, text=prompt, max_tokens=24,
                                        ignore_eos=True,
                                        sampling=inference_pb2.SamplingParams(temperature=0))
    return [t for m in inference.Generate(req, timeout=60)
            if m.WhichOneof("event") == "chunk" for t in m.chunk.token_ids]


# -- memory --------------------------------------------------------------------------------
@needs_mkl
def test_mkl_buffers_count_in_the_process_reading():
    """MKL's own buffers (MKL_Mem_Stat) land in RSS, which process_bytes includes
    (max(MLX active, RSS)): a cblas_sgemm on host arrays, no MLX allocation involved."""
    out = _python("""
        import ctypes, json
        import numpy as np
        from engine import blas
        from memory.readings import MemoryReader
        assert blas.state().name == "mkl"
        lib = ctypes.CDLL(blas.state().path)
        lib.MKL_Mem_Stat.restype = ctypes.c_int64
        n = ctypes.c_int()
        a = np.ones((512, 2048), np.float32); b = np.ones((2048, 2048), np.float32)
        c = np.zeros((512, 2048), np.float32)
        reader = MemoryReader(probe_device=False)
        before, mkl_before = reader.read(), lib.MKL_Mem_Stat(ctypes.byref(n))
        p = ctypes.c_void_p
        lib.cblas_sgemm(101, 111, 111, 512, 2048, 2048, ctypes.c_float(1.0),
                        p(a.ctypes.data), 2048, p(b.ctypes.data), 2048, ctypes.c_float(0.0),
                        p(c.ctypes.data), 2048)
        after, mkl_after = reader.read(), lib.MKL_Mem_Stat(ctypes.byref(n))
        assert c[0, 0] == 2048.0
        print(json.dumps({"mkl": mkl_after - mkl_before,
                          "footprint": after.footprint_bytes - before.footprint_bytes,
                          "process": after.process_bytes - before.process_bytes}))
    """, _env(PLIMSOLL_BLAS="mkl"))
    got = json.loads(out)
    assert got["mkl"] > 1 << 20, got  # MKL packs into buffers of its own
    assert got["footprint"] >= got["mkl"] and got["process"] >= got["mkl"], got
