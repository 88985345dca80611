/* GEMM over GGUF-encoded weights for CPU decode: y[M, n] = x[M, k] . W[n, k]^T, W one row
 * segment in its file encoding (rows of blocks exactly as in the GGUF, f16 scales inside the
 * blocks), x and y float32; y has its own row stride, so the segments of a fused weight
 * (q/k/v, gate/up, possibly of different types) write side by side into one output.
 *
 * Why: a decode step multiplies a handful of rows by every weight, so its time is spent
 * streaming weights. Dequantised to float32 the bundled model is 538 MB per step; in its
 * GGUF blocks it is ~96 MB. Each block is expanded to floats in registers, exactly as
 * gguf-py's dequantize does it (d*q, then + m, never fused), and dotted with up to 8 rows of
 * x in float32 FMAs, so the result equals a float32 GEMM over the dequantised weights up to
 * summation order.
 *
 * Q4_0, Q4_1 and Q8_0 have register kernels here (f16 scales converted per block with F16C:
 * one vcvtph2ps per block, measured level with the old layout's pre-widened float32 scales in
 * a same-process A/B, see the report of the change). Every other type dequant.c decodes runs
 * through iterserve_qgemm_generic: each block is decoded into an L1 buffer by the same code
 * as `dequant`, then dotted with the rows.
 *
 * Threads split the n columns; compiled with -mavx2 -mfma -mf16c, and with -ffp-contract=off
 * so the dequantisation is not fused into an FMA. Float activations (not 8-bit ones with
 * integer dot products as llama.cpp does): results stay equal to the float reference up to
 * summation order, which the tests and the fused decode path's bit-identity rely on.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "simd.h"

#define QK 32
#define COL_CHUNK 64

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One block of 32 weights -> w[0..3] (elements 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void dequant_block(
        int type, const uint8_t *blk, __m256 *w) {
    const __m256 vd = _mm256_set1_ps(f16_at(blk));
    if (type == GGML_Q8_0) {
        const uint8_t *q = blk + 2;
        for (int i = 0; i < 4; i++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vd);
        }
        return;
    }
    const uint8_t *q = blk + (type == GGML_Q4_1 ? 4 : 2);
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    __m256i v[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                    _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
    if (type == GGML_Q4_0) {
        const __m256i eight = _mm256_set1_epi32(8);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v[i], eight)), vd);
    } else {
        const __m256 vm = _mm256_set1_ps(f16_at(blk + 2));
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v[i]), vd), vm);
    }
}

/* Independent accumulators per row, so that enough FMA chains are in flight: an FMA has a
 * latency of 4-5 cycles and two issue per cycle, so ~10 chains keep the units busy. With one
 * accumulator per row, a batch-1 call ran one chain (4 serial FMAs per block) and reached a
 * fifth of the FMA throughput; R*A stays <= 12 so accumulators and w[4] fit 16 registers. */
#define ACCS(R) ((R) <= 3 ? 4 : (R) <= 5 ? 2 : 1)

static inline int block_bytes32(int type) {
    return type == GGML_Q8_0 ? 34 : type == GGML_Q4_1 ? 20 : 18;
}

/* R rows of x times one weight row over blocks [b0, b1); R, A and type are compile-time
 * constants after inlining. y[r] is set, or with `add` accumulated (later K chunks). */
static inline __attribute__((always_inline)) void rows_by_col(
        int R, int A, int type, const float *x, int64_t ldx, int b0, int b1,
        const uint8_t *wrow, float *y, int64_t ldy, int add) {
    const int bb = block_bytes32(type);
    __m256 acc[12];
    for (int i = 0; i < R * A; i++) acc[i] = _mm256_setzero_ps();
    for (int b = b0; b < b1; b++) {
        __m256 w[4];
        dequant_block(type, wrow + (int64_t)b * bb, w);
        const float *xb = x + b * QK;
        for (int r = 0; r < R; r++) {
            const float *xr = xb + r * ldx;
            for (int i = 0; i < 4; i++)
                acc[r * A + i % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * i), w[i],
                                                     acc[r * A + i % A]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 s = acc[r * A];
        for (int i = 1; i < A; i++) s = _mm256_add_ps(s, acc[r * A + i]);
        const float v = hsum8(s);
        y[r * ldy] = add ? y[r * ldy] + v : v;
    }
}

#define ROWS(R, TYPE) \
    rows_by_col(R, ACCS(R), TYPE, xt, ldx, b0, b1, wn, yt, ldy, b0 > 0)
#define DISPATCH(TYPE)                                                                    \
    switch (R) {                                                                          \
    case 8: ROWS(8, TYPE); break;                                                         \
    case 7: ROWS(7, TYPE); break;                                                         \
    case 6: ROWS(6, TYPE); break;                                                         \
    case 5: ROWS(5, TYPE); break;                                                         \
    case 4: ROWS(4, TYPE); break;                                                         \
    case 3: ROWS(3, TYPE); break;                                                         \
    case 2: ROWS(2, TYPE); break;                                                         \
    default: ROWS(1, TYPE); break;                                                        \
    }

/* Activation bytes one row tile may take per K chunk: the tile is re-read for every weight
 * row, so it must stay in the 32 KiB L1 next to the streaming weights. down_proj's 8 rows x
 * 1,536 floats (48 KiB) did not, and ran at 70% of the other projections' rate. */
#define X_TILE_BYTES (24 * 1024)

static void qgemm32(int type, const uint8_t *w, int64_t N, int64_t row_stride, int64_t K,
                    const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                    int nthreads) {
    const int nb = (int)(K / QK);
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
    /* Row tiles of at most 8, balanced (12 rows -> 6 + 6, not 8 + 4). */
    const int64_t ntiles = (M + 7) / 8;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                const float *xt = x + r0 * ldx;
                const int kc_max = X_TILE_BYTES / (R * QK * (int)sizeof(float));
                const int nk = (nb + kc_max - 1) / kc_max;
                for (int kchunk = 0; kchunk < nk; kchunk++) {
                    const int b0 = (int)((int64_t)nb * kchunk / nk);
                    const int b1 = (int)((int64_t)nb * (kchunk + 1) / nk);
                    for (int64_t n = c0; n < c1; n++) {
                        const uint8_t *wn = w + n * row_stride;
                        float *yt = y + r0 * ldy + n;
                        if (type == GGML_Q8_0) { DISPATCH(GGML_Q8_0) }
                        else if (type == GGML_Q4_1) { DISPATCH(GGML_Q4_1) }
                        else { DISPATCH(GGML_Q4_0) }
                    }
                }
            }
        }
    }
}

int iterserve_can_qgemm(int64_t type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0
        || (iterserve_can_dequant(type) && (iterserve_block_elems(type) > 1
                                            || type == GGML_F16 || type == GGML_BF16
                                            || type == GGML_F32));
}

void iterserve_qgemm(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                     const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                     int nthreads) {
    if (M < 1 || n < 1) return;
    if (type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0)
        qgemm32((int)type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    else
        iterserve_qgemm_generic(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
}
