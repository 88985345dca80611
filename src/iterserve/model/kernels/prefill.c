/* Prefill / large-batch GEMM over GGUF-encoded weights: y[M, n] = x[M, k] . W[n, k]^T for
 * many activation rows (M > layers.QUANT_MAX_ROWS), W one row segment in its file encoding.
 *
 * Why: the decode kernels (qgemm.c) expand every block in registers once per 8 activation
 * rows, which is right when a step is bound by the weight bytes it streams, but a prefill
 * chunk of 64-512 rows is bound by arithmetic: there the decode kernels are several times
 * slower than a float GEMM. Dequantising 4 MB tiles of the weight to float32 and running
 * oneDNN on them (the reference path) costs a pass over memory per call and is slower than
 * a prepacked float32 copy, which would double the resident weights. This kernel is a BLIS-style GEMM whose packing step *is* the dequantisation:
 *
 *   for each panel of NP = 32 weight rows (threads split the panels):
 *     for each K chunk of KC elements (whole blocks, ~256 elements):
 *       decode the panel's blocks of the chunk (dequant.c's decoders, the same code as
 *       `dequant`, so the values are bit-identical to gguf-py's) into a 16-row scratch and
 *       transpose it into bp[KC][NP]: K-major, so that one k gives NP weights side by side
 *       (32 KB, it stays in L1 next to the activations);
 *       for every tile of MR activation rows: acc[MR][NP] (+)= x[tile, chunk] . bp, with
 *       each x element broadcast against the NP weights in register-blocked FMAs.
 *
 * The decode work per weight is paid once per call and shared by all M rows (at M = 64 it
 * is ~1/10 of the FMAs). The micro-kernel is MR = 12 rows x 32 columns of zmm accumulators
 * (24 of the 32 registers) with AVX-512F, or 6 rows x 16 columns of ymm (12 of 16) with AVX2
 * on CPUs without it; chosen at run time (iterserve_st.wide). x and y are plain float32
 * with their own row strides, so the segments of a fused weight write side by side.
 * Measured (benchmarks/bench_qgemm.py prefill, one thread, CPU time, same process,
 * alternating, on a loaded 2-core AVX-512 EPYC; benchmarks/results/speed-prefill-gemm.json):
 * on the bundled model's Q4_1 shapes at M = 64-512 it is 1.1-1.9x the reference tiles and
 * 0.86-1.28x oneDNN over a prepacked float32 copy (median ~0.97x: the micro-kernel runs at
 * oneDNN's rate, ~200-220 GFLOP/s here, and the panel decode costs 3-14%); Q4_0 on 1.7B
 * shapes 0.93-1.01x of the prepacked copy. The K-quants and Q5_0 / Q5_1 are decoded by
 * blocks512.h's register decoders (pack512_u: no call per block, Q4_K's nibbles through a
 * per-sub-block table) and activation rows are processed in blocks of at most 256 (MB_MAX,
 * below): 1.7B shapes, 64 / 256 / 512 rows (benchmarks/results/kquant-prefill-ab-t1.json,
 * bench_qgemm.py ab --function gemm), Q4_K 1.01-1.07x / 0.95-0.97x / 0.86-0.93x oneDNN over a
 * prepacked float32 copy (a call per block decode with unblocked rows: 0.62-0.79x /
 * 0.79-0.87x / 0.78-0.85x in the same run); Q6_K 0.95-1.10x / 0.88-0.98x / 0.89-0.95x
 * prepacked. What is left at
 * 256-512 rows is the decode + 16x16 transpose of each panel (~350 us per pass over a
 * 2048x2048 Q4_K weight) on top of a micro-kernel that runs at oneDNN's rate.
 * Results equal a float32 GEMM over gguf-py's dequantised weights up to summation order
 * (k in order within a chunk, chunks added in order). Every type dequant.c decodes is
 * accepted; the float types (F32 / F16 / BF16) are 32-element pseudo-blocks, so they need
 * k % 32 == 0, and an fp32/bf16 checkpoint needs no prepacked copy of its weights either.
 * Under --kernel-activations int8 / auto, dispatch.c sends the types prefill8.c covers
 * (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K) to its int8-activation GEMM
 * (2-3.5x this one's speed at 64-512 rows); this file stays the float reference.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"

#define NP 32                 /* weight rows per panel = output columns per micro-tile */
#define KC_TARGET 256         /* elements per K chunk (rounded to whole blocks) */
/* At most MB_MAX activation rows per row block (blocks balanced, multiples of 12): every
 * weight panel is decoded once per block, and the block's x rows (up to MB_MAX x K floats)
 * are re-read for every panel, so they must stay in L2/L3: without blocking, 512 rows of
 * K = 8,192 (16 MB) streamed from memory for every panel and Q4_K ran at 0.71x of the
 * prepacked float32 GEMM (0.97x at 64 rows); with 96-row blocks it was 0.88x, but the panel
 * decode (~350 us per pass over a 2048x2048 Q4_K weight, ~10% of a 256-row call) was paid
 * three times at 256 rows. */
#define MB_MAX 256
#define MR512 12
#define MR256 6
#define AVX512 __attribute__((target("avx512f,avx512vl,avx512bw")))
#include "blocks512.h"
#include "transpose.h"

/* Decode the panel's rows [p0, p0 + rows) (rows <= NP) over blocks [b0, b0 + nb) into
 * bp[nb * QB][NP], K-major; rows past `rows` are zero. Block column by block column, so
 * the row-major scratch tmp (16 x QB floats) stays a few KB. TRANSPOSE16(src, dst) moves
 * 16 rows x QB columns of tmp into 16 columns of bp. */
#define PACK_PANEL_BODY(TRANSPOSE16)                                                        \
    for (int h = 0; h < NP / 16; h++) {                                                     \
        for (int j = 0; j < 16; j++)                                                        \
            if (16 * h + j >= rows) memset(tmp + j * QB, 0, sizeof(float) * (size_t)QB);    \
        const int live = rows - 16 * h < 16 ? rows - 16 * h : 16;                           \
        for (int b = 0; b < nb; b++) {                                                      \
            for (int j = 0; j < live; j++)                                                  \
                fn(w + (p0 + 16 * h + j) * row_stride + (int64_t)(b0 + b) * BB, tmp + j * QB); \
            float *dst = bp + (int64_t)b * QB * NP + 16 * h;                                \
            TRANSPOSE16(tmp, dst);                                                          \
        }                                                                                   \
    }

#define TR512(src, dst) \
    for (int k0 = 0; k0 < QB; k0 += 16) tr16x16(src + k0, QB, dst + k0 * NP, NP)
#define TR256(src, dst)                                                                     \
    for (int j0 = 0; j0 < 16; j0 += 8)                                                      \
        for (int k0 = 0; k0 < QB; k0 += 8) tr8x8(src + j0 * QB + k0, QB, dst + k0 * NP + j0, NP)

static AVX512 void pack_panel512_generic(iterserve_decode_fn fn, int QB, int BB, const uint8_t *w,
                                         int64_t row_stride, int64_t p0, int rows, int b0,
                                         int nb, float *tmp, float *bp) {
    PACK_PANEL_BODY(TR512)
}

/* One 32-element block of Q4_0 / Q4_1 / Q8_0 / F32 / F16 / BF16 -> y[0..32), with the same
 * arithmetic as dequant.c's decoders (so bit-identical to gguf-py): d*(q-8), d*q + m (the
 * product rounded, then the sum), q*d, and exact widenings. */
static inline __attribute__((always_inline)) AVX512 void dec512(int type, const uint8_t *b,
                                                                float *y) {
    const __m128i m4 = _mm_set1_epi8(15);
    uint16_t h[2];
    switch (type) {
    case GGML_Q4_0: {
        memcpy(h, b, 2);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(h[0]));
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), e = _mm_set1_epi8(8);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), e);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), e);
        _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))));
        _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))));
        break;
    }
    case GGML_Q4_1: {
        memcpy(h, b, 4);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(h[0])), m = _mm512_set1_ps(_cvtsh_ss(h[1]));
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
        const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        _mm512_store_ps(y, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo))), m));
        _mm512_store_ps(y + 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))), m));
        break;
    }
    case GGML_Q8_0: {
        memcpy(h, b, 2);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(h[0]));
        for (int i = 0; i < 2; i++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * i));
            _mm512_store_ps(y + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
        }
        break;
    }
    case GGML_F16:
        for (int i = 0; i < 2; i++)
            _mm512_store_ps(y + 16 * i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32 * i))));
        break;
    case GGML_BF16:
        for (int i = 0; i < 2; i++) {
            const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 32 * i)));
            _mm512_store_ps(y + 16 * i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        }
        break;
    default:                                   /* F32 */
        memcpy(y, b, 32 * sizeof(float));
    }
}

/* pack_panel for the 32-element types above: no call per block; F32 panels are transposed
 * straight from the weight rows. */
static inline __attribute__((always_inline)) AVX512 void pack512_t(
        int type, int BB, const uint8_t *w, int64_t row_stride, int64_t p0, int rows, int b0,
        int nb, float *tmp, float *bp) {
    for (int h = 0; h < NP / 16; h++) {
        const int live = rows - 16 * h < 16 ? rows - 16 * h : 16;
        if (live <= 0) {
            for (int k = 0; k < nb * 32; k++)
                _mm512_store_ps(bp + (int64_t)k * NP + 16 * h, _mm512_setzero_ps());
            continue;
        }
        const uint8_t *w0 = w + (p0 + 16 * h) * row_stride + (int64_t)b0 * BB;
        if (type == GGML_F32 && live == 16 && row_stride % 4 == 0) {
            for (int k0 = 0; k0 < nb * 32; k0 += 16)
                tr16x16((const float *)w0 + k0, row_stride / 4, bp + (int64_t)k0 * NP + 16 * h, NP);
            continue;
        }
        for (int j = live; j < 16; j++) memset(tmp + 32 * j, 0, 32 * sizeof(float));
        for (int b = 0; b < nb; b++) {
            for (int j = 0; j < live; j++) dec512(type, w0 + j * row_stride + (int64_t)b * BB, tmp + 32 * j);
            float *dst = bp + (int64_t)b * 32 * NP + 16 * h;
            tr16x16(tmp, 32, dst, NP);
            tr16x16(tmp + 16, 32, dst + 16 * NP, NP);
        }
    }
}

/* pack_panel for the types of blocks512.h without a dec512 case (the K-quants, Q5_0, Q5_1):
 * each block's units decoded in registers (the decode kernels' code) into 16 rows x QB floats
 * of tmp, then 16x16 transposes; no call per block, and Q4_K's nibbles through its table. */
static inline __attribute__((always_inline)) AVX512 void pack512_u(
        int type, const uint8_t *w, int64_t row_stride, int64_t p0, int rows, int b0, int nb,
        float *tmp, float *bp) {
    const int QB = qb512(type), BB = bb512(type), U = QB / 32;
    for (int h = 0; h < NP / 16; h++) {
        const int live = rows - 16 * h < 16 ? rows - 16 * h : 16;
        if (live <= 0) {
            for (int k = 0; k < nb * QB; k++)
                _mm512_store_ps(bp + (int64_t)k * NP + 16 * h, _mm512_setzero_ps());
            continue;
        }
        const uint8_t *w0 = w + (p0 + 16 * h) * row_stride + (int64_t)b0 * BB;
        for (int j = live; j < 16; j++) memset(tmp + QB * j, 0, sizeof(float) * (size_t)QB);
        for (int b = 0; b < nb; b++) {
            for (int j = 0; j < live; j++) {
                const uint8_t *blk = w0 + j * row_stride + (int64_t)b * BB;
                float s[16], m[8];
                kprep512(type, blk, s, m);
                float *t = tmp + QB * j;
#pragma GCC unroll 8
                for (int u = 0; u < U; u++) {
                    __m512 v[2];
                    unit512(type, blk, u, s, m, v);
                    _mm512_store_ps(t + 32 * u, v[0]);
                    _mm512_store_ps(t + 32 * u + 16, v[1]);
                }
            }
            float *dst = bp + (int64_t)b * QB * NP + 16 * h;
            for (int k0 = 0; k0 < QB; k0 += 16) tr16x16(tmp + k0, QB, dst + k0 * NP, NP);
        }
    }
}

static AVX512 void pack_panel512(int64_t type, iterserve_decode_fn fn, int QB, int BB,
                                 const uint8_t *w, int64_t row_stride, int64_t p0, int rows,
                                 int b0, int nb, float *tmp, float *bp) {
    switch (type) {
    case GGML_Q4_0: pack512_t(GGML_Q4_0, BB, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_Q4_1: pack512_t(GGML_Q4_1, BB, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_Q8_0: pack512_t(GGML_Q8_0, BB, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_F32: pack512_t(GGML_F32, BB, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_F16: pack512_t(GGML_F16, BB, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_BF16: pack512_t(GGML_BF16, BB, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_Q4_K: pack512_u(GGML_Q4_K, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_Q5_K: pack512_u(GGML_Q5_K, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_Q6_K: pack512_u(GGML_Q6_K, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_Q5_0: pack512_u(GGML_Q5_0, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    case GGML_Q5_1: pack512_u(GGML_Q5_1, w, row_stride, p0, rows, b0, nb, tmp, bp); break;
    default: pack_panel512_generic(fn, QB, BB, w, row_stride, p0, rows, b0, nb, tmp, bp);
    }
}

static void pack_panel256(iterserve_decode_fn fn, int QB, int BB, const uint8_t *w,
                          int64_t row_stride, int64_t p0, int rows, int b0, int nb, float *tmp,
                          float *bp) {
    PACK_PANEL_BODY(TR256)
}

/* --- AVX-512: MR512 x 32 ----------------------------------------------------------------- */
static inline __attribute__((always_inline)) AVX512 void tile512(
        int R, const float *x, int64_t ldx, const float *bp, int kc, float *y, int64_t ldy,
        int add, __mmask16 m0, __mmask16 m1) {
    __m512 acc[2 * MR512];
    for (int r = 0; r < R; r++) {
        acc[2 * r] = add ? _mm512_maskz_loadu_ps(m0, y + r * ldy) : _mm512_setzero_ps();
        acc[2 * r + 1] = add ? _mm512_maskz_loadu_ps(m1, y + r * ldy + 16) : _mm512_setzero_ps();
    }
    for (int k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_load_ps(bp + k * NP), b1 = _mm512_load_ps(bp + k * NP + 16);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            acc[2 * r] = _mm512_fmadd_ps(a, b0, acc[2 * r]);
            acc[2 * r + 1] = _mm512_fmadd_ps(a, b1, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, acc[2 * r]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[2 * r + 1]);
    }
}

static AVX512 void rows512(int64_t M, const float *x, int64_t ldx, const float *bp, int kc,
                           float *y, int64_t ldy, int add, int cols) {
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int64_t m = 0; m < M; m += MR512) {
        const int R = M - m < MR512 ? (int)(M - m) : MR512;
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
#define T512(n) case n: tile512(n, xm, ldx, bp, kc, ym, ldy, add, m0, m1); break;
        switch (R) {
        T512(12) T512(11) T512(10) T512(9) T512(8) T512(7)
        T512(6) T512(5) T512(4) T512(3) T512(2) default: tile512(1, xm, ldx, bp, kc, ym, ldy, add, m0, m1);
        }
#undef T512
    }
}

/* --- AVX2: MR256 x 16, each 16-column half of the panel in turn ---------------------------- */
static inline __attribute__((always_inline)) void tile256(
        int R, const float *x, int64_t ldx, const float *bp, int kc, float *y, int64_t ldy,
        int add, int cols) {
    __m256 acc[2 * MR256];
    float buf[MR256 * 16];
    const int full = cols >= 16;
    for (int r = 0; r < R; r++) {
        if (add && full) {
            acc[2 * r] = _mm256_loadu_ps(y + r * ldy);
            acc[2 * r + 1] = _mm256_loadu_ps(y + r * ldy + 8);
        } else if (add) {
            memset(buf, 0, sizeof buf);
            memcpy(buf, y + r * ldy, sizeof(float) * (size_t)cols);
            acc[2 * r] = _mm256_loadu_ps(buf);
            acc[2 * r + 1] = _mm256_loadu_ps(buf + 8);
        } else {
            acc[2 * r] = acc[2 * r + 1] = _mm256_setzero_ps();
        }
    }
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_load_ps(bp + k * NP), b1 = _mm256_load_ps(bp + k * NP + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            acc[2 * r] = _mm256_fmadd_ps(a, b0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(a, b1, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (full) {
            _mm256_storeu_ps(y + r * ldy, acc[2 * r]);
            _mm256_storeu_ps(y + r * ldy + 8, acc[2 * r + 1]);
        } else {
            _mm256_storeu_ps(buf, acc[2 * r]);
            _mm256_storeu_ps(buf + 8, acc[2 * r + 1]);
            memcpy(y + r * ldy, buf, sizeof(float) * (size_t)cols);
        }
    }
}

static void rows256(int64_t M, const float *x, int64_t ldx, const float *bp, int kc, float *y,
                    int64_t ldy, int add, int cols) {
    for (int h = 0; h < NP / 16 && 16 * h < cols; h++) {
        const int c = cols - 16 * h > 16 ? 16 : cols - 16 * h;
        for (int64_t m = 0; m < M; m += MR256) {
            const int R = M - m < MR256 ? (int)(M - m) : MR256;
            const float *xm = x + m * ldx;
            float *ym = y + m * ldy + 16 * h;
            const float *b = bp + 16 * h;
#define T256(n) case n: tile256(n, xm, ldx, b, kc, ym, ldy, add, c); break;
            switch (R) {
            T256(6) T256(5) T256(4) T256(3) T256(2) default: tile256(1, xm, ldx, b, kc, ym, ldy, add, c);
            }
#undef T256
        }
    }
}

int iterserve_k_panel(int64_t type, const uint8_t *w, int64_t N, int64_t row_stride, int64_t K,
                      const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                      int nthreads) {
    int QB, BB;
    const iterserve_decode_fn fn = iterserve_block_decoder(type, &QB, &BB);
    if (!fn || K % QB) return ITERSERVE_ETYPE;
    if (M < 1 || N < 1) return ITERSERVE_OK;
    const int wide = iterserve_st.wide == 2;
    const int nbk = (int)(K / QB);
    int bpc = KC_TARGET / QB;                         /* blocks per K chunk */
    if (bpc < 1) bpc = 1;
    const int kc_max = bpc * QB;
    const int64_t npanels = (N + NP - 1) / NP;
    if (nthreads < 1) nthreads = 1;
    if (npanels < nthreads) nthreads = (int)npanels;
    int err = ITERSERVE_OK;
#pragma omp parallel num_threads(nthreads)
    {
        float *tmp = aligned_alloc(64, sizeof(float) * 16 * (size_t)(QB < 32 ? 32 : QB));
        float *bp = aligned_alloc(64, sizeof(float) * NP * (size_t)kc_max);
        if (!tmp || !bp) {
#pragma omp atomic write
            err = ITERSERVE_ENOMEM;
        } else {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            const int64_t q0 = npanels * t / T, q1 = npanels * (t + 1) / T;
            const int64_t nmb = (M + MB_MAX - 1) / MB_MAX;
            const int64_t MB = ((M + nmb - 1) / nmb + 11) / 12 * 12;
            for (int64_t m0 = 0; m0 < M; m0 += MB) {       /* row blocks: x block stays cached */
                const int64_t mb = M - m0 < MB ? M - m0 : MB;
                for (int64_t q = q0; q < q1; q++) {
                    const int64_t p0 = q * NP;
                    const int rows = N - p0 < NP ? (int)(N - p0) : NP;
                    for (int b0 = 0; b0 < nbk; b0 += bpc) {
                        const int nb = nbk - b0 < bpc ? nbk - b0 : bpc;
                        if (wide) pack_panel512(type, fn, QB, BB, w, row_stride, p0, rows, b0, nb, tmp, bp);
                        else pack_panel256(fn, QB, BB, w, row_stride, p0, rows, b0, nb, tmp, bp);
                        const float *xk = x + m0 * ldx + (int64_t)b0 * QB;
                        float *yk = y + m0 * ldy + p0;
                        if (wide) rows512(mb, xk, ldx, bp, nb * QB, yk, ldy, b0 > 0, rows);
                        else rows256(mb, xk, ldx, bp, nb * QB, yk, ldy, b0 > 0, rows);
                    }
                }
            }
        }
        free(tmp);
        free(bp);
    }
    return err;
}
