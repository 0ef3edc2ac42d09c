/* The CBLAS entry MLX's CPU backend calls for float32 products (cblas_sgemm), forwarded to
 * an optimized BLAS whose own symbols carry a prefix (scipy-openblas32's
 * `scipy_cblas_sgemm`), which the dynamic linker could not bind MLX to by itself. Its
 * double and complex products (cblas_dgemm, cblas_cgemm) stay the wheel's reference BLAS.
 * engine/blas.py compiles this once, binds it to the library's functions, then makes it
 * global before mlx.core is loaded.
 *
 * A one-row product (a decode step: x[1, k] @ w.T) goes to sgemv: OpenBLAS's sgemm runs
 * the full packing path for one row and streams the weights at a third of gemv's speed.
 * So do products of up to gemv_rows rows (3 unless engine/blas.py binds another; two or
 * three sequences decoding together), one sgemv per row: reading the weights once per row still beats sgemm's packing there
 * (docs/benchmarks.md, "Two and three rows as sgemv").
 * A small product runs on one thread (below the multiply-adds engine/blas.py binds): a
 * second one gains little there and takes the core the event loop and the clients need.
 *
 * No libc, no headers: built with -nostdlib by whichever C compiler is at hand. */

typedef long long i64;
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
typedef void (*threads_fn)(int);


static sgemm_fn target_sgemm;
static sgemv_fn target_sgemv;
static threads_fn set_threads; /* the library's openblas_set_num_threads, or 0 */
static int max_threads, current_threads, gemv_rows = 1;
static i64 gemv_parallel_min, gemm_parallel_min; /* multiply-adds: from these, every thread */
static i64 gemm_calls, gemv_calls, parallel_calls;

void plimsoll_cblas_bind(void *sgemm, void *sgemv, void *set_num_threads, int threads,
                         i64 gemv_min, i64 gemm_min, int rows_as_gemv) {
  gemv_rows = rows_as_gemv;
  gemv_parallel_min = gemv_min;
  gemm_parallel_min = gemm_min;
  target_sgemm = (sgemm_fn)sgemm;
  target_sgemv = (sgemv_fn)sgemv;
  set_threads = (threads_fn)set_num_threads;
  max_threads = current_threads = threads;
}

/* MLX runs a stream's products on that stream's one thread, so a plain static is
 * enough to skip setting what is already set; two streams racing here could only make
 * one product run on the other's thread count. */
static void use_threads(i64 work, i64 least) {
  int want = work < least ? 1 : max_threads;
  parallel_calls += want > 1;
  if (set_threads && want != current_threads) {
    set_threads(want);
    current_threads = want;
  }
}

/* How many products went each way, and how many ran on every thread, since the load:
 * tests check the routing with it.
 * Plain counters, not atomics: those need libgcc on some targets (aarch64 outlines them),
 * and a stream's products come from one thread. */
void plimsoll_cblas_counts(i64 *gemm, i64 *gemv, i64 *parallel) {
  *gemm = gemm_calls;
  *gemv = gemv_calls;
  *parallel = parallel_calls;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  if (m >= 1 && m <= gemv_rows && k > 0 && order == ROW_MAJOR && target_sgemv) {
    use_threads((i64)n * k, gemv_parallel_min);
    /* Row i: c[i, :n] = alpha * op(a)[i, :k] @ op(b)[:k, :n] + beta * c[i, :n]. op(a)'s
     * row i is a's row i, or its column i when a is stored transposed (k x m). */
    int incx = trans_a == NO_TRANS ? 1 : lda;
    i64 step = trans_a == NO_TRANS ? lda : 1;
    for (int i = 0; i < m; i++) {
      const float *x = a + i * step;
      float *y = c + (i64)i * ldc;
      gemv_calls++;
      if (trans_b == NO_TRANS) /* b is stored k x n: y = b.T @ x */
        target_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, x, incx, beta, y, 1);
      else /* transposed (conjugated is the same for reals): b is stored n x k, y = b @ x */
        target_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, x, incx, beta, y, 1);
    }
    return;
  }
  use_threads((i64)m * n * k, gemm_parallel_min);
  gemm_calls++;
  target_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
