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
 * Below the forwarding: the decode kernels for half-precision, quantized and skinny
 * float32 products, and a prefill chunk's softmax and SwiGLU (each section says why).
 *
 * No libc, and no header but the compiler's own <immintrin.h> (for the AVX-512 kernels):
 * built with -nostdlib by whichever C compiler is at hand. */

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

static int shown_product(int order, int trans_a, int trans_b, int m, int n, int k,
                         float alpha, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc);
static int skinny_product(int order, int trans_a, int trans_b, int m, int n, int k,
                          float alpha, const float *a, int lda, const float *b, int ldb,
                          float beta, float *c, int ldc);

/* Skinny products (below, "a float32 weight through the same kernel"): up to this many
 * rows (0: none), from this many multiply-adds. engine/blas.py sets them. */
static int skinny_rows;
static i64 skinny_min_macs = (i64)1 << 62, skinny_calls;

void plimsoll_skinny_bind(int rows, i64 min_macs) {
  skinny_rows = rows;
  skinny_min_macs = min_macs;
}

i64 plimsoll_skinny_calls(void) { return skinny_calls; }

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  if (shown_product(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) ||
      skinny_product(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
    return;
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
 * as stored, widens it to float32 in registers and multiplies it into every row of x
 * (float32 sums, added in a fixed order). engine/fast_prefill.py has MLX call it for
 * decode rows (below, "shown to MLX as float32 ones").
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
/* AVX-512's 16 lanes: a wide accumulator is two 8-lane ones side by side. */
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef unsigned short v16u16 __attribute__((vector_size(32), aligned(2)));
typedef unsigned int v16u32 __attribute__((vector_size(64)));
typedef short v16i16 __attribute__((vector_size(32), aligned(2)));
typedef int v16i32 __attribute__((vector_size(64)));
union v16_halves {
  v16f w;
  v8f part[2];
};
/* An 8-lane vector's sum in one fixed order (every kernel's: each ISA gives the same bits);
 * v a variable. */
#define SUM8(v)                                                                             \
  ((((v)[0] + (v)[4]) + ((v)[1] + (v)[5])) + (((v)[2] + (v)[6]) + ((v)[3] + (v)[7])))

/* HALF_F32: a float32 weight through the same kernel (a skinny product, below). */
enum { HALF_BF16 = 0, HALF_F16 = 1, HALF_F32 = 2, HALF_ROWS = 32 };

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

/* The body, once per instruction set (ATTR its target; VF its vector of WL = 8 or 16
 * float32 lanes; WIDE(kind, wr, at, WIDEN8) WL weights of a row as VF; WIDEN8##_BF16(p)
 * and WIDEN8##_F16(p) 8 values as v8f). A weight row at a time (one sequential stream
 * from memory, which the prefetcher follows best), against up to 4 rows of x at once:
 * each WL weights are widened once into a register and multiplied into every x row's
 * accumulators (float32, 8 lanes; A of them per row, 8 * A values apart, so that 8
 * independent sums are in flight: 1 or 2 rows x 4, 3 or 4 rows x 2). With 16 lanes a
 * vector holds two of those accumulators side by side, split apart before the tail:
 * every sum is the AVX2 kernel's, bit for bit. MB and A are constants where a block is
 * called, so the accumulators live in registers; x stays in L1. Lanes are added in a
 * fixed order, then the scalar tail. */
#define UNROLL _Pragma("GCC unroll 4")
#define HALF_WIDEN(kind, p, WIDEN8)                                                         \
  ((kind) == HALF_BF16 ? WIDEN8##_BF16(p) : WIDEN8##_F16(p))
/* 8 weights from element `at` of a row (float32 ones as they are), and one. */
#define W8(kind, wr, at, WIDEN8)                                                            \
  ((kind) == HALF_F32 ? *(const v8f *)((const float *)(wr) + (at))                          \
                      : HALF_WIDEN(kind, (const unsigned short *)(wr) + (at), WIDEN8))
#define W1(kind, wr, at)                                                                    \
  ((kind) == HALF_F32   ? ((const float *)(wr))[at]                                         \
   : (kind) == HALF_BF16 ? bf16_to_float(((const unsigned short *)(wr))[at])                \
                         : half_to_float(((const unsigned short *)(wr))[at]))
/* 16 weights (AVX-512 only), and the 8-lane halves of a 16-lane vector. */
#define W16(kind, wr, at, WIDEN8)                                                           \
  ((kind) == HALF_F32 ? *(const v16f *)((const float *)(wr) + (at))                         \
   : (kind) == HALF_BF16 ? AVX512_16_BF16((const unsigned short *)(wr) + (at))              \
                         : AVX512_16_F16((const unsigned short *)(wr) + (at)))
#define HALF8(v, n) (v)
#define HALF16(v, n) (((union v16_halves){.w = (v)}).part[n])
#define HALF_FUNCS(SUFFIX, ATTR, VF, WL, WIDE, HALF, WIDEN8)                                \
  ATTR static inline __attribute__((always_inline)) void block_##SUFFIX(                    \
      const int kind, const int MB, const int A, int k, const float *x, i64 ldx,            \
      const void *wr, float *y, i64 ldy) {                                                  \
    const int P = (WL) / 8, AW = A / P; /* 8-lane accumulators per vector; vectors */      \
    VF wide[4][4];                                                                          \
    UNROLL for (int i = 0; i < MB; i++)                                                     \
      UNROLL for (int a = 0; a < AW; a++) wide[i][a] = (VF){0};                             \
    int ks = k / (8 * A) * (8 * A), kv = k & ~7;                                            \
    for (int t = 0; t < ks; t += 8 * A) {                                                   \
      UNROLL for (int a = 0; a < AW; a++) {                                                 \
        VF wv = WIDE(kind, wr, t + (WL) * a, WIDEN8);                                       \
        UNROLL for (int i = 0; i < MB; i++)                                                 \
          wide[i][a] += wv * *(const VF *)(x + i * ldx + t + (WL) * a);                     \
      }                                                                                     \
    }                                                                                       \
    v8f acc[4][4];                                                                          \
    UNROLL for (int i = 0; i < MB; i++)                                                     \
      UNROLL for (int a = 0; a < AW; a++)                                                   \
        UNROLL for (int h = 0; h < P; h++) acc[i][a * P + h] = HALF(wide[i][a], h);         \
    for (int t = ks; t < kv; t += 8) {                                                      \
      v8f wv = W8(kind, wr, t, WIDEN8);                                                     \
      UNROLL for (int i = 0; i < MB; i++) acc[i][0] += wv * *(const v8f *)(x + i * ldx + t);\
    }                                                                                       \
    UNROLL for (int i = 0; i < MB; i++) {                                                   \
      v8f v = A == 4 ? (acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3])                    \
                     : acc[i][0] + acc[i][1];                                               \
      float s = SUM8(v);                                                                    \
      for (int t = kv; t < k; t++) s += W1(kind, wr, t) * x[i * ldx + t];                  \
      y[i * ldy] = s;                                                                       \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static inline __attribute__((always_inline)) void rows_##SUFFIX(                     \
      const int kind, int m, int k, const float *x, i64 ldx, const void *w, i64 ldw,       \
      float *y, i64 ldy, int j0, int j1) {                                                  \
    for (int j = j0; j < j1; j++) {                                                         \
      const void *wr = (const char *)w + (i64)j * ldw * (kind == HALF_F32 ? 4 : 2);         \
      for (int i0 = 0; i0 < m; i0 += 4) {                                                   \
        const float *xb = x + i0 * ldx;                                                     \
        float *yb = y + i0 * ldy + j;                                                       \
        switch (m - i0 < 4 ? m - i0 : 4) {                                                  \
        case 1: block_##SUFFIX(kind, 1, 4, k, xb, ldx, wr, yb, ldy); break;                 \
        case 2: block_##SUFFIX(kind, 2, 4, k, xb, ldx, wr, yb, ldy); break;                 \
        case 3: block_##SUFFIX(kind, 3, 2, k, xb, ldx, wr, yb, ldy); break;                 \
        default: block_##SUFFIX(kind, 4, 2, k, xb, ldx, wr, yb, ldy); break;                \
        }                                                                                   \
      }                                                                                     \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static void half_gemv_##SUFFIX(int kind, int m, int k, const float *x, i64 ldx,      \
                                      const void *w, i64 ldw, float *y, i64 ldy, int j0,    \
                                      int j1) {                                             \
    if (kind == HALF_BF16)                                                                  \
      rows_##SUFFIX(HALF_BF16, m, k, x, ldx, w, ldw, y, ldy, j0, j1);                       \
    else if (kind == HALF_F16)                                                              \
      rows_##SUFFIX(HALF_F16, m, k, x, ldx, w, ldw, y, ldy, j0, j1);                        \
    else                                                                                    \
      rows_##SUFFIX(HALF_F32, m, k, x, ldx, w, ldw, y, ldy, j0, j1);                        \
  }

/* Each instruction set's widening of 8 values (ISA_8_BF16, ISA_8_F16), and AVX-512's of 16.
 * Portable: bfloat16 by a generic shift, float16 one value at a time. */
#define PORTABLE_8_BF16(p) ((v8f)(__builtin_convertvector(*(const v8u16 *)(p), v8u32) << 16))
#define PORTABLE_8_F16(p)                                                                   \
  ({                                                                                        \
    v8f v_;                                                                                 \
    for (int q = 0; q < 8; q++) v_[q] = half_to_float((p)[q]);                              \
    v_;                                                                                     \
  })

HALF_FUNCS(portable, , v8f, 8, W8, HALF8, PORTABLE_8)

#if defined(__x86_64__)
/* AVX2 + FMA; AVX-512F, BW and VL. One instruction per widening: vpmovzxwd for bfloat16
 * (GCC's builtin: its generic conversion splits into halves), F16C's vcvtph2ps for
 * float16 (GCC's builtin, as older clang's; clang 15 on lowers the conversion of a
 * _Float16 vector to it). */
#if defined(__clang__)
#define AVX2_8_BF16(p) PORTABLE_8_BF16(p)
#define AVX512_16_BF16(p)                                                                   \
  ((v16f)(__builtin_convertvector(*(const v16u16 *)(p), v16u32) << 16))
#else
#define AVX2_8_BF16(p) ((v8f)((v8u32)__builtin_ia32_pmovzxwd256(*(const v8i16 *)(p)) << 16))
#define AVX512_16_BF16(p)                                                                   \
  ((v16f)((v16u32)__builtin_ia32_pmovzxwd512_mask(*(const v16i16 *)(p), (v16i32){0},        \
                                                  (unsigned short)0xffff) << 16))
#endif
#if defined(__clang__) && __clang_major__ >= 15
typedef _Float16 v8f16 __attribute__((vector_size(16), aligned(2)));
typedef _Float16 v16f16 __attribute__((vector_size(32), aligned(2)));
#define AVX2_8_F16(p) __builtin_convertvector(*(const v8f16 *)(p), v8f)
#define AVX512_16_F16(p) __builtin_convertvector(*(const v16f16 *)(p), v16f)
#else
#define AVX2_8_F16(p) __builtin_ia32_vcvtph2ps256(*(const v8i16 *)(p))
#define AVX512_16_F16(p)                                                                    \
  __builtin_ia32_vcvtph2ps512_mask(*(const v16i16 *)(p), (v16f){0}, (unsigned short)0xffff, \
                                   4 /* the current rounding */)
#endif
#define AVX512_8_BF16 AVX2_8_BF16
#define AVX512_8_F16 AVX2_8_F16

HALF_FUNCS(avx2, __attribute__((target("avx2,fma,f16c"))), v8f, 8, W8, HALF8, AVX2_8)
HALF_FUNCS(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), v16f,
           16, W16, HALF16, AVX512_8)

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

/* AVX-512 F, BW and VL as well (the kernels are built for all three), and its registers
 * saved by the OS (opmask, both upper halves). */
static int have_avx512(void) {
  if (!have_avx2()) return 0;
  unsigned r[4], lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 0xe6u) != 0xe6u) return 0;
  cpuid(7, 0, r);
  const unsigned f_bw_vl = (1u << 16) | (1u << 30) | (1u << 31);
  return (r[1] & f_bw_vl) == f_bw_vl;
}
#endif

/* Which kernel runs here: 0 portable, 1 AVX2, 2 AVX-512 (the best the CPU has, or less
 * where plimsoll_half_limit_isa said so). */
static int half_isa = -1, half_isa_most = 2;

int plimsoll_half_isa(void) {
  if (half_isa < 0) {
#if defined(__x86_64__)
    int best = have_avx512() ? 2 : have_avx2();
#else
    int best = 0;
#endif
    half_isa = best < half_isa_most ? best : half_isa_most;
  }
  return half_isa;
}

/* Runs at most the given kernel (0 portable, 1 AVX2, 2 AVX-512) from now on: tests
 * compare them, and PLIMSOLL_KERNEL_ISA sets it at load. Returns the kernel now in use. */
int plimsoll_half_limit_isa(int most) {
  half_isa_most = most;
  half_isa = -1;
  return plimsoll_half_isa();
}

/* kind: HALF_BF16, HALF_F16 or HALF_F32; returns -1 for arguments it does not take. */
int plimsoll_half_gemv(int kind, int m, int k, const float *x, i64 ldx, const void *w,
                       i64 ldw, float *y, i64 ldy, int j0, int j1) {
  if ((kind != HALF_BF16 && kind != HALF_F16 && kind != HALF_F32) || m < 1 ||
      m > HALF_ROWS || k < 1 || j0 < 0 || j1 < j0)
    return -1;
#if defined(__x86_64__)
  /* A float32 weight stays on AVX2: MLX's buffers are not 64-byte aligned, and 64-byte
   * loads of the weight that straddle cache lines ran slower than AVX2's in scratch
   * timings, x aligned or not (1024x1024: 38-41 GB/s against 51-58); half-precision
   * weights, read 32 bytes at a time, gained (bfloat16 1024x1024: 61 against 43). */
  int isa = plimsoll_half_isa();
  if (isa == 2 && kind != HALF_F32) {
    half_gemv_avx512(kind, m, k, x, ldx, w, ldw, y, ldy, j0, j1);
    return 0;
  }
  if (isa) {
    half_gemv_avx2(kind, m, k, x, ldx, w, ldw, y, ldy, j0, j1);
    return 0;
  }
#endif
  half_gemv_portable(kind, m, k, x, ldx, w, ldw, y, ldy, j0, j1);
  return 0;
}

/* -- affine-quantized decode products -------------------------------------------------
 *
 * MLX's CPU quantized product reads a 4-bit weight at ~4 GB/s with float32 activations
 * (and ~0.4 with half-precision ones). A decode row's product through a weight quantized
 * as MLX does it (affine: w = scale * q + bias per group of `group` values along k, q
 * unsigned, packed low bits first in 32-bit words) is
 *
 *   y[i, j] = sum_g scale[j, g] * (q[j, g] . x[i, g]) + bias[j, g] * sum(x[i, g])
 *
 * Each row of a (x's row i at a + i * lda) holds x's k values; the shim sums each group
 * of them itself, once per product, before any thread reads the weight (made in MLX's
 * graph, they cost a decode step seven more operations per product). The
 * weight's words are read once and widened to float32 in registers, 8 values at a time
 * (a word broadcast to every lane, each lane shifting its own value out). */
typedef int v8i32 __attribute__((vector_size(32)));
enum { SCALE_BF16 = 0, SCALE_F16 = 1, SCALE_F32 = 2 };
/* The group sums a product holds on its stack (64 KB): a weight has at most this many
 * groups along k, and a product sums as many rows at a time as fit. */
enum { QUANT_SUMS = 16384 };

/* Each row's group sums (x's row i at a + i * lda) at sums[i * (k / group) + g], 8 lanes
 * at a time on every ISA: the same sums, whichever kernel reads them. */
static void group_sums(int m, int k, int group, const float *a, i64 lda, float *sums) {
  const int groups = k / group;
  for (int i = 0; i < m; i++)
    for (int g = 0; g < groups; g++) {
      const float *x = a + i * lda + (i64)g * group;
      v8f v = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int t = 0; t < group; t += 8) v += *(const v8f *)(x + t);
      sums[i * groups + g] = SUM8(v);
    }
}

static inline float scale_at(int skind, const void *p, i64 idx) {
  if (skind == SCALE_F32) return ((const float *)p)[idx];
  unsigned short h = ((const unsigned short *)p)[idx];
  return skind == SCALE_BF16 ? bf16_to_float(h) : half_to_float(h);
}

/* The 16 values of a quantized weight from word wd on, widened: Q8 as two 8-lane pieces
 * (p 0 and 1), Q16 as one 16-lane vector (AVX-512). */
#define TO_F32(v) __builtin_convertvector((v8i32)(v), v8f)
#define Q8(bits, wd, p) ((bits) == 4 ? Q8_4(wd[p]) : Q8_8(wd[2 * p], wd[2 * p + 1]))
#define Q8_4(u)                                                                             \
  TO_F32(((v8u32){u, u, u, u, u, u, u, u} >> (v8u32){0, 4, 8, 12, 16, 20, 24, 28}) & 15u)
#define Q8_8(u, v)                                                                          \
  TO_F32(((v8u32){u, u, u, u, v, v, v, v} >> (v8u32){0, 8, 16, 24, 0, 8, 16, 24}) & 255u)
/* Q16 is defined with the AVX-512 kernels (below): its words are spread over the lanes
 * by one vpermd, which only the intrinsics spell the same way for every compiler. */
/* A group's sum as AVX2's two 8-lane accumulators add it (acc[0] + acc[1]). */
#define FOLD8(acc) ((acc)[0] + (acc)[1])
#define FOLD16(acc) (HALF16((acc)[0], 0) + HALF16((acc)[0], 1))
/* VF, WL: the vector of WL float32 lanes; Q and FOLD the matching pair above. G groups
 * from group g on are summed side by side, each as it would be alone, and added to tot in
 * group order: a group's sums are chains of dependent multiply-adds, and one row of x has
 * only one or two of its own (G = 4 at one row, 2 at two, 1 from three). */
#define QUANT_FUNCS(SUFFIX, ATTR, VF, WL, Q, FOLD)                                          \
  ATTR static inline __attribute__((always_inline)) void qgroups_##SUFFIX(                  \
      const int bits, const int MB, const int G, int g, int group, int skind,               \
      const float *a, i64 lda, const unsigned char *wr, i64 s0, const void *scales,         \
      v8f *tot) {                                                                           \
    const int gbytes = group * bits / 8;                                                    \
    VF acc[4][4][2];                                                                        \
    UNROLL for (int h = 0; h < G; h++)                                                      \
      UNROLL for (int i = 0; i < MB; i++) acc[h][i][0] = acc[h][i][1] = (VF){0};            \
    for (int t = 0; t < group; t += 16) {                                                   \
      UNROLL for (int h = 0; h < G; h++) {                                                  \
        const unsigned *wd = (const unsigned *)(wr + (i64)(g + h) * gbytes + t * bits / 8); \
        UNROLL for (int p = 0; p < 16 / (WL); p++) {                                        \
          VF q = Q(bits, wd, p);                                                            \
          UNROLL for (int i = 0; i < MB; i++)                                               \
            acc[h][i][p] += q * *(const VF *)(a + i * lda + (i64)(g + h) * group + t +      \
                                              (WL) * p);                                    \
        }                                                                                   \
      }                                                                                     \
    }                                                                                       \
    UNROLL for (int h = 0; h < G; h++) {                                                    \
      float sc = scale_at(skind, scales, s0 + g + h);                                       \
      v8f sv = {sc, sc, sc, sc, sc, sc, sc, sc};                                            \
      UNROLL for (int i = 0; i < MB; i++) tot[i] += sv * FOLD(acc[h][i]);                   \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static inline __attribute__((always_inline)) void qblock_##SUFFIX(                   \
      const int bits, const int MB, int k, int group, int skind, const float *a, i64 lda,   \
      const float *sums, const unsigned char *wr, i64 s0, const void *scales,               \
      const void *biases, float *y, i64 ldy) {                                              \
    const int G = MB == 1 ? 4 : MB == 2 ? 2 : 1;                                            \
    v8f tot[4];                                                                             \
    UNROLL for (int i = 0; i < MB; i++) tot[i] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};             \
    int groups = k / group, g = 0;                                                          \
    for (; g + G <= groups; g += G)                                                         \
      qgroups_##SUFFIX(bits, MB, G, g, group, skind, a, lda, wr, s0, scales, tot);          \
    for (; g < groups; g++)                                                                 \
      qgroups_##SUFFIX(bits, MB, 1, g, group, skind, a, lda, wr, s0, scales, tot);          \
    UNROLL for (int i = 0; i < MB; i++) {                                                   \
      v8f v = tot[i];                                                                       \
      float r = SUM8(v);                                                                    \
      const float *xs = sums + i * groups;                                                  \
      float b0 = 0, b1 = 0, b2 = 0, b3 = 0; /* four chains of the biases' sum */          \
      int gi = 0;                                                                           \
      for (; gi + 4 <= groups; gi += 4) {                                                   \
        b0 += scale_at(skind, biases, s0 + gi) * xs[gi];                                    \
        b1 += scale_at(skind, biases, s0 + gi + 1) * xs[gi + 1];                            \
        b2 += scale_at(skind, biases, s0 + gi + 2) * xs[gi + 2];                            \
        b3 += scale_at(skind, biases, s0 + gi + 3) * xs[gi + 3];                            \
      }                                                                                     \
      for (; gi < groups; gi++) b0 += scale_at(skind, biases, s0 + gi) * xs[gi];            \
      y[i * ldy] = r + ((b0 + b1) + (b2 + b3));                                             \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static inline __attribute__((always_inline)) void qrows_##SUFFIX(                    \
      const int bits, int group, int skind, int m, int k, const float *a, i64 lda,          \
      const float *sums, const unsigned char *w, const void *scales, const void *biases,    \
      float *y, i64 ldy, int j0, int j1) {                                                  \
    i64 ldw = (i64)k * bits / 8, lds = k / group;                                           \
    for (int j = j0; j < j1; j++) {                                                         \
      const unsigned char *wr = w + j * ldw;                                                \
      for (int i0 = 0; i0 < m; i0 += 4) {                                                   \
        const float *ab = a + i0 * lda, *sb = sums + i0 * lds;                              \
        float *yb = y + i0 * ldy + j;                                                       \
        switch (m - i0 < 4 ? m - i0 : 4) {                                                  \
        case 1: qblock_##SUFFIX(bits, 1, k, group, skind, ab, lda, sb, wr, j * lds,         \
                                scales, biases, yb, ldy); break;                            \
        case 2: qblock_##SUFFIX(bits, 2, k, group, skind, ab, lda, sb, wr, j * lds,         \
                                scales, biases, yb, ldy); break;                            \
        case 3: qblock_##SUFFIX(bits, 3, k, group, skind, ab, lda, sb, wr, j * lds,         \
                                scales, biases, yb, ldy); break;                            \
        default: qblock_##SUFFIX(bits, 4, k, group, skind, ab, lda, sb, wr, j * lds,        \
                                 scales, biases, yb, ldy); break;                           \
        }                                                                                   \
      }                                                                                     \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static void quant_gemv_##SUFFIX(int bits, int group, int skind, int m, int k,        \
                                       const float *a, i64 lda, const float *sums,          \
                                       const unsigned char *w, const void *scales,          \
                                       const void *biases, float *y, i64 ldy, int j0,       \
                                       int j1) {                                            \
    if (bits == 4)                                                                          \
      qrows_##SUFFIX(4, group, skind, m, k, a, lda, sums, w, scales, biases, y, ldy, j0,    \
                     j1);                                                                   \
    else                                                                                    \
      qrows_##SUFFIX(8, group, skind, m, k, a, lda, sums, w, scales, biases, y, ldy, j0,    \
                     j1);                                                                   \
  }

QUANT_FUNCS(portable, , v8f, 8, Q8, FOLD8)
#if defined(__x86_64__)
QUANT_FUNCS(avx2, __attribute__((target("avx2,fma,f16c"))), v8f, 8, Q8, FOLD8)
#include <immintrin.h> /* a compiler's own header: no libc */
#define AVX512_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
AVX512_ATTR static inline __attribute__((always_inline)) v16f q16(int bits,
                                                                   const unsigned *wd) {
  const __m128i_u *words = (const __m128i_u *)wd;
  __m512i lanes, shifts;
  if (bits == 4) { /* two words over 8 lanes each */
    lanes = _mm512_permutexvar_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,
                                                      0, 0, 0),
                                     _mm512_castsi128_si512(_mm_loadl_epi64(words)));
    shifts = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
  } else { /* four words over 4 lanes each */
    lanes = _mm512_permutexvar_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0,
                                                      0, 0, 0),
                                     _mm512_castsi128_si512(_mm_loadu_si128(words)));
    shifts = _mm512_set_epi32(24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0);
  }
  __m512i q = _mm512_and_si512(_mm512_srlv_epi32(lanes, shifts),
                               _mm512_set1_epi32(bits == 4 ? 15 : 255));
  return (v16f)_mm512_cvtepi32_ps(q);
}
#define Q16(bits, wd, p) q16(bits, wd)
QUANT_FUNCS(avx512, AVX512_ATTR, v16f, 16, Q16, FOLD16)
#endif

/* The product with x's group sums given (`group_sums`), arguments as checked below. */
static void quant_rows(int bits, int group, int skind, int m, int k, const float *a, i64 lda,
                       const float *sums, const void *w, const void *scales,
                       const void *biases, float *y, i64 ldy, int j0, int j1) {
#if defined(__x86_64__)
  switch (plimsoll_half_isa()) {
  case 2:
    quant_gemv_avx512(bits, group, skind, m, k, a, lda, sums, w, scales, biases, y, ldy, j0,
                      j1);
    return;
  case 1:
    quant_gemv_avx2(bits, group, skind, m, k, a, lda, sums, w, scales, biases, y, ldy, j0,
                    j1);
    return;
  }
#endif
  quant_gemv_portable(bits, group, skind, m, k, a, lda, sums, w, scales, biases, y, ldy, j0,
                      j1);
}

/* bits 4 or 8; group a multiple of 16 that divides k (at most QUANT_SUMS groups); skind
 * SCALE_*. Returns -1 for arguments it does not take. */
int plimsoll_quant_gemv(int bits, int group, int skind, int m, int k, const float *a,
                        i64 lda, const void *w, const void *scales, const void *biases,
                        float *y, i64 ldy, int j0, int j1) {
  if ((bits != 4 && bits != 8) || group < 16 || group % 16 || k < group || k % group ||
      k / group > QUANT_SUMS || skind < SCALE_BF16 || skind > SCALE_F32 || m < 1 ||
      m > HALF_ROWS || j0 < 0 || j1 < j0 || lda < k)
    return -1;
  float sums[QUANT_SUMS];
  const int step = QUANT_SUMS / (k / group);
  for (int r0 = 0; r0 < m; r0 += step) {
    const int r = m - r0 < step ? m - r0 : step;
    group_sums(r, k, group, a + r0 * lda, lda, sums);
    quant_rows(bits, group, skind, r, k, a + r0 * lda, lda, sums, w, scales, biases,
               y + r0 * ldy, ldy, j0, j1);
  }
  return 0;
}

/* -- weights shown to MLX as float32 ones ----------------------------------------------
 *
 * Calling a kernel from Python costs a decode step one evaluation per product (and the
 * copies in and out). Instead engine/fast_prefill.py registers a layer's weight here and
 * hands MLX a float32 view of its bits (n x K: K = k/2 for half precision, k * bits / 32
 * for a quantized weight's words) and the float32 activations laid out as F x m rows of
 * K (a real row spread over F of them: F = 2 for half precision, 32 / bits for a
 * quantized weight): MLX's own float32 product then calls
 * cblas_sgemm above with that weight, and the product is the kernel's, inside MLX's lazy
 * graph. The real y fills the first m rows of the F m x n output. Only a registered
 * pointer takes this path, and engine/fast_prefill.py keeps each registered buffer alive
 * until it unregisters it, so no other array can be at that address; a product by one in
 * a shape it was not registered for gets NaN, not the BLAS's reading of its bits.
 *
 * Python registers under a lock, before it builds any graph that multiplies by the
 * weight; MLX runs that product later on its stream's thread, after its task queue has
 * ordered the registration before it. A product that finds a slot only ever finds one
 * registered that way, so readers need no more than the pointer being written last. */
enum { SHOWN_WEIGHTS = 4096 };
static struct {
  const void *volatile p;
  int n, k, kind, bits, group; /* bits 16: half precision (kind HALF_*); else SCALE_* */
  const void *scales, *biases;
} shown[SHOWN_WEIGHTS];
static volatile int shown_top; /* slots in use lie below */
static i64 shown_calls;

static int shown_slot(const void *p, int n, int k, int kind, int bits, int group,
                      const void *scales, const void *biases) {
  for (int s = 0; s < SHOWN_WEIGHTS; s++) {
    if (shown[s].p) continue;
    shown[s].n = n;
    shown[s].k = k;
    shown[s].kind = kind;
    shown[s].bits = bits;
    shown[s].group = group;
    shown[s].scales = scales;
    shown[s].biases = biases;
    __asm__ volatile("" ::: "memory");
    shown[s].p = p;
    if (s >= shown_top) shown_top = s + 1;
    return s;
  }
  return -1;
}

/* A slot for the n x k half-precision weight of this kind at p (rows k values apart), or
 * -1. */
int plimsoll_half_register(const void *p, int n, int k, int kind) {
  if (!p || n < 1 || k < 2 || (k & 1) || (kind != HALF_BF16 && kind != HALF_F16)) return -1;
  return shown_slot(p, n, k, kind, 16, 0, 0, 0);
}

/* A slot for the n x k affine-quantized weight at p (rows k * bits / 8 bytes apart) with
 * n x k/group scales and biases of kind skind, or -1. */
int plimsoll_quant_register(const void *p, int n, int k, int bits, int group,
                            const void *scales, const void *biases, int skind) {
  if (!p || !scales || !biases || n < 1 || (bits != 4 && bits != 8) || group < 16 ||
      group % 16 || k < group || k % group || k / group > QUANT_SUMS || skind < SCALE_BF16 ||
      skind > SCALE_F32)
    return -1;
  return shown_slot(p, n, k, skind, bits, group, scales, biases);
}

void plimsoll_half_unregister(int slot) {
  if (slot >= 0 && slot < SHOWN_WEIGHTS) shown[slot].p = 0;
}

/* Products that took this path since the load (tests and the install's check read it). */
i64 plimsoll_half_calls(void) { return shown_calls; }

/* Weights registered now (tests read it). */
int plimsoll_half_registered(void) {
  int live = 0;
  for (int s = 0; s < shown_top; s++) live += shown[s].p != 0;
  return live;
}

/* The fake row width K of a registered weight, and how many fake rows F hold a real one. */
static void shown_shape(int s, int *K, int *F) {
  if (shown[s].bits == 16) {
    *K = shown[s].k / 2;
    *F = 2;
    return;
  }
  *K = (int)((i64)shown[s].k * shown[s].bits / 32);
  *F = 32 / shown[s].bits;
}


/* One registered product, the columns [j0, j1) of its output. The weight's figures are
 * copied from its slot when the product starts: the slot may be unregistered (its layer
 * collected) or taken by another weight while MLX still runs a product that holds the
 * buffer. */
struct shown_job {
  const void *w, *scales, *biases;
  int k, kind, bits, group, rows;
  const float *a;
  i64 lda;
  float *c;
  i64 ldc;
  /* A quantized product's group sums of every row (`group_sums`), taken once by the
   * thread MLX calls us on; 0: each call takes its own (too many to hold). */
  const float *sums;
};

static void shown_columns(const struct shown_job *job, int j0, int j1) {
  for (int r0 = 0; r0 < job->rows; r0 += HALF_ROWS) {
    int r = job->rows - r0 < HALF_ROWS ? job->rows - r0 : HALF_ROWS;
    const float *a = job->a + r0 * job->lda;
    float *c = job->c + (i64)r0 * job->ldc;
    if (job->bits == 16 || job->bits == 32)
      plimsoll_half_gemv(job->kind, r, job->k, a, job->lda, job->w, job->k, c, job->ldc, j0,
                         j1);
    else if (job->sums)
      quant_rows(job->bits, job->group, job->kind, r, job->k, a, job->lda,
                 job->sums + (i64)r0 * (job->k / job->group), job->w, job->scales,
                 job->biases, c, job->ldc, j0, j1);
    else
      plimsoll_quant_gemv(job->bits, job->group, job->kind, r, job->k, a, job->lda, job->w,
                          job->scales, job->biases, c, job->ldc, j0, j1);
  }
}

/* -- a large shown product on more than one thread (x86_64 Linux) ----------------------
 *
 * One thread reads memory at ~24 GB/s here, two at ~36: a decode step's large products
 * are shared by the thread MLX calls us on and helper threads, in blocks of output
 * columns that each takes from a counter as it goes (every output is still one
 * thread's fixed sum: the result is the same bits). A helper the scheduler has not run
 * yet costs nothing: MLX's thread takes every block left, and waits only for blocks a
 * helper is in the middle of. (At normal priority: at SCHED_IDLE a helper preempted in
 * the middle of a block could hold MLX's thread for as long as busier threads keep the
 * cores.) The helpers are Python threads that engine/blas.py
 * starts inside `plimsoll_kernel_helper`, which never returns; they spin briefly after
 * a product, then sleep on a futex. No libc: system calls by hand, atomics that compile
 * inline. A forked child has no helpers, so a product is only shared in the process
 * they started in. One row of a half-precision weight with short rows stays on MLX's
 * thread: it gained little on two and slowed the step around it (engine/blas.py
 * HALF_ONE_ROW_SHARED_MIN_ROW_BYTES). */
#if defined(__x86_64__) && defined(__linux__)
enum { MAX_HELPERS = 7, FUTEX_WAIT = 128, FUTEX_WAKE = 129 }; /* the _PRIVATE ops */

static long sys_call3(long nr, long a, long b, long c) {
  long ret;
  register long r10 __asm__("r10") = 0;
  __asm__ volatile("syscall" : "=a"(ret) : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10)
                   : "rcx", "r11", "memory");
  return ret;
}
static long sys_getpid(void) { return sys_call3(39, 0, 0, 0); }
static void futex_wait(volatile unsigned *p, unsigned seen) {
  sys_call3(202, (long)p, FUTEX_WAIT, (int)seen);
}
static void futex_wake(volatile unsigned *p) { sys_call3(202, (long)p, FUTEX_WAKE, 0x7fffffff); }
#define LOAD(p) __atomic_load_n(p, __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n(p, v, __ATOMIC_RELEASE)
#define FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)

static struct shown_job shared_job;
static int shared_n, shared_block;
/* The product's generation (high 32 bits) and the next column to take (low 32 bits):
 * a late helper's take fails once the next product has begun. */
static volatile unsigned long long shared_next;
static volatile unsigned generation, columns_done; /* futex words */
static volatile int helper_asleep[MAX_HELPERS], caller_asleep;
static volatile int helpers_wanted, helpers_ready, busy;
static volatile long helpers_pid;
static i64 parallel_min_bytes = (i64)1 << 62, half_one_row_min_row_bytes;
static i64 shared_calls, shared_columns;
static volatile i64 helper_columns;
/* Pauses a helper spins after a product before it sleeps, and MLX's thread for the last
 * blocks (~40 us on this machine's CPUs). */
enum { HELPER_SPIN = 1500, CALLER_SPIN = 1500 };

/* Takes and runs blocks of product `g` until none is left; the columns it ran. */
static int take_blocks(unsigned g) {
  int ran = 0;
  for (;;) {
    unsigned long long now = LOAD(&shared_next);
    if ((unsigned)(now >> 32) != g || (int)(unsigned)now >= shared_n) return ran;
    int j0 = (int)(unsigned)now, j1 = j0 + shared_block < shared_n ? j0 + shared_block : shared_n;
    if (!__atomic_compare_exchange_n(&shared_next, &now, ((unsigned long long)g << 32) | (unsigned)j1,
                                     0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      continue;
    shown_columns(&shared_job, j0, j1);
    __atomic_add_fetch(&columns_done, (unsigned)(j1 - j0), __ATOMIC_ACQ_REL);
    ran += j1 - j0;
  }
}


/* Helper `index` (0 .. helpers - 1) of `helpers`: takes blocks of each shared product.
 * Called once per helper, on a thread of its own; never returns. */
void plimsoll_kernel_helper(int index, int helpers) {
  if (index < 0 || index >= MAX_HELPERS || helpers < 1 || helpers > MAX_HELPERS) return;
  unsigned seen = LOAD(&generation);
  if (__atomic_add_fetch(&helpers_ready, 1, __ATOMIC_SEQ_CST) == helpers) {
    helpers_pid = sys_getpid();
    STORE(&helpers_wanted, helpers);
  }
  for (;;) {
    unsigned now = LOAD(&generation);
    for (int i = 0; now == seen && i < HELPER_SPIN; i++) {
      __builtin_ia32_pause();
      now = LOAD(&generation);
    }
    if (now == seen) {
      STORE(&helper_asleep[index], 1);
      FENCE();
      if (LOAD(&generation) == seen) futex_wait(&generation, seen);
      STORE(&helper_asleep[index], 0);
      continue;
    }
    seen = now;
    int got = take_blocks(now);
    if (got) {
      __atomic_add_fetch(&helper_columns, got, __ATOMIC_RELAXED);
      FENCE();
      if (LOAD(&caller_asleep)) futex_wake(&columns_done);
    }
  }
}

/* From now on products of at least `min_bytes` of weight are shared (a huge value: none),
 * a half-precision weight's one-row products only where a row of it holds at least
 * `half_one_row_min_row` bytes. */
void plimsoll_kernel_share(i64 min_bytes, i64 half_one_row_min_row) {
  parallel_min_bytes = min_bytes;
  half_one_row_min_row_bytes = half_one_row_min_row;
}

/* Products shared since the load, their output columns, and how many of those the helpers
 * computed (tests read them). */
void plimsoll_kernel_counts(i64 *shared, i64 *columns, i64 *by_helpers) {
  *shared = shared_calls;
  *columns = shared_columns;
  *by_helpers = __atomic_load_n(&helper_columns, __ATOMIC_RELAXED);
}

static i64 job_row_bytes(const struct shown_job *job) {
  return job->bits == 16 ? (i64)job->k * 2 : (i64)job->k * job->bits / 8;
}

/* The product shared with the helpers if it is large enough and they are up (and this is
 * their process, and no other stream shares them now); 0 if not. */
static int shared_product(const struct shown_job *job, int n) {
  i64 row = job_row_bytes(job);
  if (job->bits == 16 && job->rows == 1 && row < half_one_row_min_row_bytes) return 0;
  if (!LOAD(&helpers_wanted) || row * n < parallel_min_bytes || sys_getpid() != helpers_pid ||
      __atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE))
    return 0;
  /* Blocks of ~64 KB of weight, whole multiples of 16 columns: no two threads write one
   * cache line of y. */
  int block = (int)((65536 + row - 1) / row + 15) & ~15;
  /* Close the last product's counter before its job is overwritten: a helper that read it
   * before it ran out, and was preempted, must not take a block of this product's figures
   * under the last one's generation (its take now fails). */
  unsigned last = generation;
  STORE(&shared_next, ((unsigned long long)last << 32) | 0x7fffffffu);
  FENCE();
  shared_job = *job;
  shared_n = n;
  shared_block = block;
  STORE(&columns_done, 0);
  unsigned g = last + 1;
  STORE(&shared_next, (unsigned long long)g << 32);
  STORE(&generation, g);
  FENCE();
  for (int h = 0; h < helpers_wanted; h++)
    if (LOAD(&helper_asleep[h])) {
      futex_wake(&generation);
      break;
    }
  take_blocks(g);
  unsigned seen;
  for (int i = 0; LOAD(&columns_done) != (unsigned)n && i < CALLER_SPIN; i++)
    __builtin_ia32_pause();
  while ((seen = LOAD(&columns_done)) != (unsigned)n) {
    STORE(&caller_asleep, 1);
    FENCE();
    if (LOAD(&columns_done) == seen) futex_wait(&columns_done, seen);
    STORE(&caller_asleep, 0);
  }
  shared_calls++;
  shared_columns += n;
  STORE(&busy, 0);
  return 1;
}
#else
static int shared_product(const struct shown_job *job, int n) {
  (void)job, (void)n;
  return 0;
}
#endif

/* -- a float32 weight through the same kernel ------------------------------------------
 *
 * A decode step of a float32 model multiplies a few rows (one per sequence) by each
 * weight: x[m, k] @ w.T, w stored n x k. One row goes to sgemv, which streams the weight
 * near this machine's bandwidth; two and three rows to one sgemv each, reading the weight
 * as many times; from four OpenBLAS's sgemm packs the weight as for a large product and
 * reads it at a third of that (docs/benchmarks.md, "Skinny float32 products"). The
 * half-precision kernel's body reads a float32 weight row as well (HALF_F32: no widening)
 * against up to 4 rows of x at once, and a large one is shared with the helper threads
 * like a shown product: the weight is read once for every 4 rows, on every thread. Each
 * output is one thread's sum in a fixed order, whatever the thread count. */
static int skinny_product(int order, int trans_a, int trans_b, int m, int n, int k,
                          float alpha, const float *a, int lda, const float *b, int ldb,
                          float beta, float *c, int ldc) {
  if (m < 1 || m > skinny_rows || order != ROW_MAJOR || trans_a != NO_TRANS ||
      trans_b != TRANS || alpha != 1.f || beta != 0.f || ldb != k || lda < k || ldc < n ||
      (i64)m * n * k < skinny_min_macs)
    return 0;
  struct shown_job job = {b, 0, 0, k, HALF_F32, 32, 0, m, a, lda, c, ldc, 0};
  if (!shared_product(&job, n))
    shown_columns(&job, 0, n);
  skinny_calls++;
  return 1;
}

static int shown_product(int order, int trans_a, int trans_b, int m, int n, int k,
                         float alpha, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc) {
  if (!shown_top) return 0;
  for (int s = 0; s < shown_top; s++) {
    if (shown[s].p != b) continue;
    int K, F;
    shown_shape(s, &K, &F);
    if (order != ROW_MAJOR || trans_a != NO_TRANS || trans_b != TRANS || alpha != 1.f ||
        beta != 0.f || lda != k || ldb != k || shown[s].n != n || K != k || m < F ||
        m % F) {
      const union { unsigned u; float f; } nan = {0x7fc00000u};
      for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
          c[order == ROW_MAJOR ? (i64)i * ldc + j : (i64)j * ldc + i] = nan.f;
      return 1;
    }
    struct shown_job job = {b, shown[s].scales, shown[s].biases, shown[s].k, shown[s].kind,
                            shown[s].bits, shown[s].group, m / F, a, (i64)F * K, c, ldc, 0};
    float sums[QUANT_SUMS]; /* the helpers read them while this thread waits for them */
    if (job.bits < 16 && (i64)job.rows * (job.k / job.group) <= QUANT_SUMS) {
      group_sums(job.rows, job.k, job.group, a, job.lda, sums);
      job.sums = sums;
    }
    if (!shared_product(&job, n))
      shown_columns(&job, 0, n);
    shown_calls++;
    return 1;
  }
  return 0;
}

/* -- a prefill chunk's softmax and SwiGLU -----------------------------------------------
 *
 * engine/fast_prefill.py runs a prefill chunk's attention softmax and a float32 model's
 * SwiGLU on the CPU outside MLX (MLX's CPU exp is scalar). In NumPy each is six to nine
 * passes over the block; here a softmax row is three (max, exp and sum, divide) and
 * SwiGLU one, ~4x and ~3x faster on 256 x 256 scores and 256 x 1536 activations. The exp
 * is Cephes' single-precision one (range reduction by ln 2 in two parts, a degree-6
 * polynomial: within 2 ulp of NumPy's), flushed to 0 below -87.3 where NumPy's gives
 * values under 1.2e-38, inf above 88 (NumPy's from 88.7), NaN for NaN. NumPy's order
 * of operations is kept: the scores rounded to bfloat16 or float16 first where such a
 * model's attention rounds them (to nearest even), the maximum subtracted, the
 * exponentials divided by their sum, the weights rounded again; SwiGLU as
 * (1 / (1 + exp(-g))) * g * u.
 *
 * A row past the end of its vectors is read and written a value at a time through a
 * vector of its own, padded with -inf (whose exp is 0); the empty asm statements keep
 * such loops from becoming calls to memcpy or memset, which a -nostdlib build has not
 * got. */
enum { SOFTMAX_F32 = 0, SOFTMAX_BF16 = 1, SOFTMAX_F16 = 2 };

#define SOFTMAX_FUNCS(SUFFIX, ATTR, VF, VI, VU, WL)                                         \
  ATTR static inline __attribute__((always_inline)) VF exp_##SUFFIX(VF x) {                 \
    const VF lo = (VF){} - 87.3365478515625f, hi = (VF){} + 88.0f, given = x;               \
    VI under = x < lo, over = x > hi, nan = x != x;                                         \
    x = (VF)(((VI)x & (x < hi)) | ((VI)hi & ~(x < hi)));                                    \
    x = (VF)(((VI)x & ~under) | ((VI)lo & under));                                          \
    const VF shift = (VF){} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */ \
    VF n = (x * 1.44269504088896341f + shift) - shift;                                      \
    VF r = x - n * 0.693359375f;                                                            \
    r = r - n * -2.12194440e-4f;                                                            \
    VF p = (VF){} + 1.9875691500e-4f;                                                       \
    p = p * r + 1.3981999507e-3f;                                                           \
    p = p * r + 8.3334519073e-3f;                                                           \
    p = p * r + 4.1665795894e-2f;                                                           \
    p = p * r + 1.6666665459e-1f;                                                           \
    p = p * r + 5.0000001201e-1f;                                                           \
    p = p * (r * r) + (r + 1.0f);                                                           \
    VI e = (__builtin_convertvector(n, VI) + 127) << 23;                                    \
    VF inf = (VF){} + __builtin_inff();                                                     \
    return (VF)(((VI)(p * (VF)e) & ~under & ~over & ~nan) | ((VI)inf & over) |              \
                ((VI)given & nan));                                                         \
  }                                                                                         \
                                                                                            \
  ATTR static inline __attribute__((always_inline)) VF round_bf16_##SUFFIX(VF v) {          \
    VU bits = (VU)v;                                                                        \
    bits += 0x7FFFu + ((bits >> 16) & 1u);                                                  \
    return (VF)(bits & 0xFFFF0000u);                                                        \
  }                                                                                         \
                                                                                            \
  /* To the nearest float16 (even on ties), as float32: 10 bits of mantissa; below 2^-14    \
   * multiples of 2^-24 (adding and taking away 0.75 rounds there, the sign kept); past    \
   * 65504 inf. */                                                                          \
  ATTR static inline __attribute__((always_inline)) VF round_f16_##SUFFIX(VF v) {           \
    VU bits = (VU)v, sign = bits & 0x80000000u;                                             \
    VU normal = (bits + 0xFFFu + ((bits >> 13) & 1u)) & 0xFFFFE000u;                        \
    VF tiny = (v + 0.75f) - 0.75f;                                                          \
    VU mag = bits & 0x7FFFFFFFu;                                                            \
    VU r = (VU)(((VI)normal & (VI)(mag >= 0x38800000u)) |                                   \
                ((VI)((VU)tiny | sign) & ~(VI)(mag >= 0x38800000u)));                       \
    VI over = (VI)((r & 0x7FFFFFFFu) > 0x477FE000u) & (VI)(mag < 0x7F800000u);              \
    return (VF)(((VI)r & ~over) | ((VI)(sign | 0x7F800000u) & over));                       \
  }                                                                                         \
                                                                                            \
  ATTR static inline __attribute__((always_inline)) VF round_to_##SUFFIX(int kind, VF v) {  \
    return kind == SOFTMAX_BF16 ? round_bf16_##SUFFIX(v)                                    \
         : kind == SOFTMAX_F16  ? round_f16_##SUFFIX(v)                                     \
                                : v;                                                        \
  }                                                                                         \
                                                                                            \
  /* `count` values of row at `at` into a vector, the lanes past them -inf. */              \
  ATTR static inline __attribute__((always_inline)) VF load_part_##SUFFIX(                  \
      const float *row, i64 at, i64 count) {                                                \
    union { VF v; float f[WL]; } part;                                                      \
    for (int l = 0; l < (WL); l++) {                                                        \
      part.f[l] = l < count ? row[at + l] : -__builtin_inff();                              \
      __asm__("" ::: "memory");                                                             \
    }                                                                                       \
    return part.v;                                                                          \
  }                                                                                         \
                                                                                            \
  ATTR static inline __attribute__((always_inline)) void store_part_##SUFFIX(               \
      float *row, i64 at, i64 count, VF v) {                                                \
    union { VF v; float f[WL]; } part = {v};                                                \
    for (int l = 0; l < count; l++) {                                                       \
      row[at + l] = part.f[l];                                                              \
      __asm__("" ::: "memory");                                                             \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static inline __attribute__((always_inline)) void zero_##SUFFIX(float *p,            \
                                                                       i64 count) {         \
    i64 j = 0;                                                                              \
    for (; j + (WL) <= count; j += (WL)) {                                                  \
      *(VF *)(p + j) = (VF){};                                                              \
      __asm__("" ::: "memory");                                                             \
    }                                                                                       \
    for (; j < count; j++) {                                                                \
      p[j] = 0;                                                                             \
      __asm__("" ::: "memory");                                                             \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static void softmax_##SUFFIX(int kind, float *s, i64 r0, i64 r1, i64 cols,           \
                                     const i64 *lo, const i64 *hi, i64 n, i64 per_batch,    \
                                     i64 batches) {                                         \
    for (i64 i = r0; i < r1; i++) {                                                         \
      i64 w = (batches > 1 ? i / per_batch : 0) * n + i % n;                                \
      i64 a = lo[w] < 0 ? 0 : lo[w] < cols ? lo[w] : cols;                                  \
      i64 z = hi[w] < a ? a : hi[w] < cols ? hi[w] : cols;                                  \
      float *all = s + i * cols, *row = all + a;                                            \
      i64 valid = z - a, full = valid / (WL) * (WL);                                        \
      VF top = (VF){} - __builtin_inff();                                                   \
      for (i64 j = 0; j <= full; j += (WL)) {                                               \
        VF v = j < full ? *(VF *)(row + j) : load_part_##SUFFIX(row, j, valid - j);         \
        v = round_to_##SUFFIX(kind, v);                                                     \
        top = (VF)(((VI)v & (v > top)) | ((VI)top & ~(v > top)));                           \
      }                                                                                     \
      float m = top[0];                                                                     \
      for (int l = 1; l < (WL); l++) m = top[l] > m ? top[l] : m;                           \
      if (!(m > -__builtin_inff() && m < __builtin_inff())) m = 0; /* every key hidden */   \
      VF sum = (VF){};                                                                      \
      for (i64 j = 0; j <= full; j += (WL)) {                                               \
        VF v = j < full ? *(VF *)(row + j) : load_part_##SUFFIX(row, j, valid - j);         \
        v = round_to_##SUFFIX(kind, v);                                                     \
        v = exp_##SUFFIX(v - m);                                                            \
        sum += v;                                                                           \
        if (j < full) *(VF *)(row + j) = v;                                                 \
        else store_part_##SUFFIX(row, j, valid - j, v);                                     \
      }                                                                                     \
      float total = 0;                                                                      \
      for (int l = 0; l < (WL); l++) total += sum[l];                                       \
      total = total == 0 ? 1 : total;                                                       \
      for (i64 j = 0; j <= full; j += (WL)) {                                               \
        VF v = j < full ? *(VF *)(row + j) : load_part_##SUFFIX(row, j, valid - j);         \
        v = v / total;                                                                      \
        v = round_to_##SUFFIX(kind, v);                                                     \
        if (j < full) *(VF *)(row + j) = v;                                                 \
        else store_part_##SUFFIX(row, j, valid - j, v);                                     \
      }                                                                                     \
      zero_##SUFFIX(all, a); /* the hidden keys */                                          \
      zero_##SUFFIX(all + z, cols - z);                                                     \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static void swiglu_##SUFFIX(float *out, const float *g, const float *u, i64 count) { \
    i64 full = count / (WL) * (WL);                                                         \
    for (i64 j = 0; j <= full; j += (WL)) {                                                 \
      VF gv = j < full ? *(const VF *)(g + j) : load_part_##SUFFIX(g, j, count - j);        \
      VF uv = j < full ? *(const VF *)(u + j) : load_part_##SUFFIX(u, j, count - j);        \
      VF sig = 1.0f / (exp_##SUFFIX(-gv) + 1.0f); /* exp(-g) inf past 88: sigmoid 0 */      \
      VF v = sig * gv * uv;                                                                 \
      if (j < full) *(VF *)(out + j) = v;                                                   \
      else store_part_##SUFFIX(out, j, count - j, v);                                       \
    }                                                                                       \
  }

/* -- a decode step's values over a long half-precision cache -------------------------
 *
 * A decode step's attention weighs the cache's value rows: y[i, :] = sum_s x[i, s] w[s, :]
 * for a query head's weights x and one key head's values w (s_len rows of d, stored as
 * the cache stores them). MLX's half-precision product is slow here and a float32 copy of
 * a long cache is a transient admission does not count, so the rows are read as stored
 * and summed in float32, 8 columns and up to 4 query heads at a time (their sums in
 * registers), s in order: each output is one sum in a fixed order. */
#define ROWS_SUM_FUNCS(SUFFIX, ATTR, WIDEN8)                                                \
  ATTR static inline __attribute__((always_inline)) void rows_block_##SUFFIX(               \
      const int kind, const int MB, i64 s_len, const float *x, i64 ldx, const void *w,      \
      i64 ldw, float *y, i64 ldy, int c) {                                                  \
    const int esize = kind == HALF_F32 ? 4 : 2;                                             \
    v8f acc[4] = {{0}, {0}, {0}, {0}};                                                      \
    for (i64 s = 0; s < s_len; s++) {                                                       \
      v8f wv = W8(kind, (const char *)w + s * ldw * esize, c, WIDEN8);                      \
      UNROLL for (int i = 0; i < MB; i++) acc[i] += x[i * ldx + s] * wv;                    \
    }                                                                                       \
    UNROLL for (int i = 0; i < MB; i++) *(v8f *)(y + i * ldy + c) = acc[i];                 \
  }                                                                                         \
                                                                                            \
  ATTR static inline __attribute__((always_inline)) void rows_kind_##SUFFIX(                \
      const int kind, int m, i64 s_len, int d, const float *x, i64 ldx, const void *w,      \
      i64 ldw, float *y, i64 ldy) {                                                         \
    for (int i0 = 0; i0 < m; i0 += 4) {                                                     \
      const float *xb = x + i0 * ldx;                                                       \
      float *yb = y + i0 * ldy;                                                             \
      for (int c = 0; c < d; c += 8) {                                                      \
        switch (m - i0 < 4 ? m - i0 : 4) {                                                  \
        case 1: rows_block_##SUFFIX(kind, 1, s_len, xb, ldx, w, ldw, yb, ldy, c); break;   \
        case 2: rows_block_##SUFFIX(kind, 2, s_len, xb, ldx, w, ldw, yb, ldy, c); break;   \
        case 3: rows_block_##SUFFIX(kind, 3, s_len, xb, ldx, w, ldw, yb, ldy, c); break;   \
        default: rows_block_##SUFFIX(kind, 4, s_len, xb, ldx, w, ldw, yb, ldy, c); break;  \
        }                                                                                   \
      }                                                                                     \
    }                                                                                       \
  }                                                                                         \
                                                                                            \
  ATTR static void rows_sum_##SUFFIX(int kind, int m, i64 s_len, int d, const float *x,     \
                                     i64 ldx, const void *w, i64 ldw, float *y, i64 ldy) {  \
    if (kind == HALF_BF16)                                                                  \
      rows_kind_##SUFFIX(HALF_BF16, m, s_len, d, x, ldx, w, ldw, y, ldy);                   \
    else if (kind == HALF_F16)                                                              \
      rows_kind_##SUFFIX(HALF_F16, m, s_len, d, x, ldx, w, ldw, y, ldy);                    \
    else                                                                                    \
      rows_kind_##SUFFIX(HALF_F32, m, s_len, d, x, ldx, w, ldw, y, ldy);                    \
  }

ROWS_SUM_FUNCS(portable, , PORTABLE_8)
#if defined(__x86_64__)
ROWS_SUM_FUNCS(avx2, __attribute__((target("avx2,fma,f16c"))), AVX2_8)
#endif

/* kind: HALF_BF16, HALF_F16 or HALF_F32 values, row stride ldw elements; m (at most
 * HALF_ROWS) rows of x, d a multiple of 8. Returns 0, or -1 for arguments it does not
 * take. (AVX-512 machines run the AVX2 build: 8 columns a vector are a head's width.) */
int plimsoll_half_rows_sum(int kind, int m, i64 s_len, int d, const float *x, i64 ldx,
                           const void *w, i64 ldw, float *y, i64 ldy) {
  if ((kind != HALF_BF16 && kind != HALF_F16 && kind != HALF_F32) || m < 1 ||
      m > HALF_ROWS || s_len < 0 || d < 8 || d % 8 || ldw < d || ldx < s_len || ldy < d)
    return -1;
#if defined(__x86_64__)
  if (plimsoll_half_isa()) {
    rows_sum_avx2(kind, m, s_len, d, x, ldx, w, ldw, y, ldy);
    return 0;
  }
#endif
  rows_sum_portable(kind, m, s_len, d, x, ldx, w, ldw, y, ldy);
  return 0;
}

/* Portable: 16-byte vectors, which any x86_64 (SSE2) or aarch64 (NEON) passes in
 * registers. */
typedef float v4f __attribute__((vector_size(16), aligned(4)));
typedef int v4i32 __attribute__((vector_size(16)));
typedef unsigned int v4u32 __attribute__((vector_size(16)));
SOFTMAX_FUNCS(portable, , v4f, v4i32, v4u32, 4)
#if defined(__x86_64__)
SOFTMAX_FUNCS(avx2, __attribute__((target("avx2,fma,f16c"))), v8f, v8i32, v8u32, 8)
SOFTMAX_FUNCS(avx512, AVX512_ATTR, v16f, v16i32, v16u32, 16)
#endif

/* Softmax in place over rows r0..r1 of the contiguous rows x cols scores at s, each row
 * over the keys of its window [lo, hi) (a mask's visible keys: causal, left padding and
 * sliding windows all leave one interval), the other keys set to 0. The rows are
 * `batches` (1, or one per window set) groups of per_batch rows, each group n queries
 * after n queries (heads one after another); row i's window is lo[w], hi[w] with w = its
 * group (when batches > 1) times n plus i % n. kind: SOFTMAX_F32, or SOFTMAX_BF16 or
 * SOFTMAX_F16 to round as a bfloat16 or float16 model's attention does. Returns 0, or -1
 * for arguments it does not take. */
int plimsoll_softmax_rows(int kind, float *s, i64 r0, i64 r1, i64 cols, const i64 *lo,
                          const i64 *hi, i64 n, i64 per_batch, i64 batches) {
  if (kind < SOFTMAX_F32 || kind > SOFTMAX_F16 || !s || !lo || !hi || r0 < 0 ||
      r1 < r0 || cols < 1 || n < 1 || per_batch < n || batches < 1 ||
      (batches > 1 && r1 > per_batch * batches))
    return -1;
#if defined(__x86_64__)
  switch (plimsoll_half_isa()) {
  case 2: softmax_avx512(kind, s, r0, r1, cols, lo, hi, n, per_batch, batches); return 0;
  case 1: softmax_avx2(kind, s, r0, r1, cols, lo, hi, n, per_batch, batches); return 0;
  }
#endif
  softmax_portable(kind, s, r0, r1, cols, lo, hi, n, per_batch, batches);
  return 0;
}

/* out = silu(g) * u over `count` float32 values. Returns 0, or -1 for a bad count. */
int plimsoll_swiglu(float *out, const float *g, const float *u, i64 count) {
  if (count < 0) return -1;
#if defined(__x86_64__)
  switch (plimsoll_half_isa()) {
  case 2: swiglu_avx512(out, g, u, count); return 0;
  case 1: swiglu_avx2(out, g, u, count); return 0;
  }
#endif
  swiglu_portable(out, g, u, count);
  return 0;
}
#else
static int shown_product(int order, int trans_a, int trans_b, int m, int n, int k,
                         float alpha, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc) {
  (void)order, (void)trans_a, (void)trans_b, (void)m, (void)n, (void)k, (void)alpha;
  (void)a, (void)lda, (void)b, (void)ldb, (void)beta, (void)c, (void)ldc;
  return 0;
}
static int skinny_product(int order, int trans_a, int trans_b, int m, int n, int k,
                          float alpha, const float *a, int lda, const float *b, int ldb,
                          float beta, float *c, int ldc) {
  return shown_product(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
#endif /* the half-precision kernel */
