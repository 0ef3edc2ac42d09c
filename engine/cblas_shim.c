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

/* -- half-precision decode products ---------------------------------------------------
 *
 * MLX's CPU product for a bfloat16 or float16 weight streams it at ~1.6-2.5 GB/s here. A
 * decode step's product (a few rows) is bound by reading the weight once, so this reads it
 * as stored, widens each chunk of a weight row to float32 in a buffer that stays in L1,
 * and takes its dot products with every row of x (float32 sums, four accumulators per
 * row, added in a fixed order). engine/fast_prefill.py calls it for decode rows.
 *
 * y[i, j] = x[i, :k] . w[j, :k]   for i < m (at most HALF_ROWS), j0 <= j < j1
 *
 * It needs vector conversions (GCC 9, any clang). An older compiler, or
 * -DPLIMSOLL_NO_HALF_KERNEL, builds the shim without it: engine/blas.py then finds no
 * plimsoll_half_gemv and decode keeps MLX's own product.
 */

#if !defined(PLIMSOLL_NO_HALF_KERNEL) && (defined(__clang__) || __GNUC__ >= 9)

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef unsigned short v8u16 __attribute__((vector_size(16), aligned(2)));
typedef short v8i16 __attribute__((vector_size(16), aligned(2)));
typedef unsigned int v8u32 __attribute__((vector_size(32)));

enum { HALF_BF16 = 0, HALF_F16 = 1, HALF_CHUNK = 512, HALF_ROWS = 32 };

static float half_to_float(unsigned short h) {
  unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  unsigned bits;
  if (e == 0x1f)
    bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
  else if (e)
    bits = sign | ((e + 112u) << 23) | (man << 13);
  else if (!man)
    bits = sign;
  else { /* subnormal: normalize */
    unsigned be = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      be--;
    }
    bits = sign | (be << 23) | ((man & 0x3ffu) << 13);
  }
  union { unsigned u; float f; } v = {bits};
  return v.f;
}

static float bf16_to_float(unsigned short h) {
  union { unsigned u; float f; } v = {(unsigned)h << 16};
  return v.f;
}

/* The body, once per instruction set: WIDEN8(src, dst) widens 8 values. */
#define HALF_KERNEL(NAME, ATTR, WIDEN8)                                                     \
  ATTR static void NAME(int kind, int m, int k, const float *x, i64 ldx,                    \
                        const unsigned short *w, i64 ldw, float *y, i64 ldy, int j0,         \
                        int j1) {                                                           \
    float buf[HALF_CHUNK] __attribute__((aligned(32)));                                     \
    v8f acc[HALF_ROWS][4];                                                                  \
    int kv = k & ~31;                                                                       \
    for (int j = j0; j < j1; j++) {                                                         \
      const unsigned short *wr = w + (i64)j * ldw;                                          \
      for (int c = 0; c < kv; c += HALF_CHUNK) {                                            \
        int e = c + HALF_CHUNK < kv ? c + HALF_CHUNK : kv;                                  \
        for (int t = c; t < e; t += 8)                                                      \
          WIDEN8(wr + t, buf + t - c);                                                      \
        for (int i = 0; i < m; i++) {                                                       \
          const float *xr = x + (i64)i * ldx + c;                                           \
          const v8f *b = (const v8f *)buf, *p = (const v8f *)xr;                            \
          v8f a0 = b[0] * p[0], a1 = b[1] * p[1], a2 = b[2] * p[2], a3 = b[3] * p[3];       \
          for (int t = 4; t < (e - c) / 8; t += 4) {                                        \
            a0 += b[t] * p[t];                                                              \
            a1 += b[t + 1] * p[t + 1];                                                      \
            a2 += b[t + 2] * p[t + 2];                                                      \
            a3 += b[t + 3] * p[t + 3];                                                      \
          }                                                                                 \
          if (c) {                                                                          \
            acc[i][0] += a0; acc[i][1] += a1; acc[i][2] += a2; acc[i][3] += a3;             \
          } else {                                                                          \
            acc[i][0] = a0; acc[i][1] = a1; acc[i][2] = a2; acc[i][3] = a3;                 \
          }                                                                                 \
        }                                                                                   \
      }                                                                                     \
      for (int i = 0; i < m; i++) {                                                         \
        float s = 0.f;                                                                      \
        if (kv) {                                                                           \
          v8f a = (acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]);                        \
          s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));            \
        }                                                                                   \
        for (int t = kv; t < k; t++)                                                        \
          s += (kind == HALF_BF16 ? bf16_to_float(wr[t]) : half_to_float(wr[t])) *           \
               x[(i64)i * ldx + t];                                                         \
        y[(i64)i * ldy + j] = s;                                                            \
      }                                                                                     \
    }                                                                                       \
  }

/* Portable: bfloat16 widens as a vector shift, float16 one value at a time. */
#define WIDEN8_PORTABLE(src, dst)                                                           \
  do {                                                                                      \
    if (kind == HALF_BF16) {                                                                \
      *(v8f *)(dst) = (v8f)(__builtin_convertvector(*(const v8u16 *)(src), v8u32) << 16);   \
    } else {                                                                                \
      for (int q = 0; q < 8; q++) (dst)[q] = half_to_float((src)[q]);                       \
    }                                                                                       \
  } while (0)

HALF_KERNEL(half_gemv_portable, , WIDEN8_PORTABLE)

#if defined(__x86_64__)
/* AVX2 + FMA, float16 through F16C's vcvtph2ps (GCC's builtin, as older clang's; clang
 * 15 on lowers the conversion of a _Float16 vector to it). */
#if defined(__clang__) && __clang_major__ >= 15
typedef _Float16 v8f16 __attribute__((vector_size(16), aligned(2)));
#define F16_TO_F32(p) __builtin_convertvector(*(const v8f16 *)(p), v8f)
#else
#define F16_TO_F32(p) __builtin_ia32_vcvtph2ps256(*(const v8i16 *)(p))
#endif
#define WIDEN8_AVX2(src, dst)                                                               \
  do {                                                                                      \
    if (kind == HALF_BF16)                                                                  \
      *(v8f *)(dst) = (v8f)(__builtin_convertvector(*(const v8u16 *)(src), v8u32) << 16);   \
    else                                                                                    \
      *(v8f *)(dst) = F16_TO_F32(src);                                                      \
  } while (0)

HALF_KERNEL(half_gemv_avx2, __attribute__((target("avx2,fma,f16c"))), WIDEN8_AVX2)

static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
  __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3])
                   : "a"(leaf), "c"(sub));
}

/* AVX2, FMA and F16C on the CPU, and AVX state saved by the OS. */
static int have_avx2(void) {
  unsigned r[4];
  cpuid(0, 0, r);
  if (r[0] < 7) return 0;
  cpuid(1, 0, r);
  unsigned ecx = r[2];
  if (!(ecx & (1u << 12)) || !(ecx & (1u << 27)) || !(ecx & (1u << 28)) ||
      !(ecx & (1u << 29)))
    return 0;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 6u) != 6u) return 0;
  cpuid(7, 0, r);
  return (r[1] >> 5) & 1u;
}
#endif

static int half_isa = -1; /* 0 portable, 1 AVX2 */

/* Which kernel runs here: 0 portable, 1 AVX2 (tests and the log read it). */
int plimsoll_half_isa(void) {
  if (half_isa < 0) {
#if defined(__x86_64__)
    half_isa = have_avx2();
#else
    half_isa = 0;
#endif
  }
  return half_isa;
}

/* Runs the portable kernel even where AVX2 is there (tests compare both); returns the
 * kernel now in use. */
int plimsoll_half_use_portable(int portable) {
  half_isa = -1;
  if (!portable) return plimsoll_half_isa();
  half_isa = 0;
  return 0;
}

/* kind: HALF_BF16 or HALF_F16; returns -1 for arguments it does not take. */
int plimsoll_half_gemv(int kind, int m, int k, const float *x, i64 ldx,
                       const unsigned short *w, i64 ldw, float *y, i64 ldy, int j0, int j1) {
  if ((kind != HALF_BF16 && kind != HALF_F16) || m < 1 || m > HALF_ROWS || k < 1 ||
      j0 < 0 || j1 < j0)
    return -1;
#if defined(__x86_64__)
  if (plimsoll_half_isa()) {
    half_gemv_avx2(kind, m, k, x, ldx, w, ldw, y, ldy, j0, j1);
    return 0;
  }
#endif
  half_gemv_portable(kind, m, k, x, ldx, w, ldw, y, ldy, j0, j1);
  return 0;
}
#endif /* the half-precision kernel */
