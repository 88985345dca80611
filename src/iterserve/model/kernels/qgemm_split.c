/* LEGACY (delete together with model/quant.py's BlockQuantWeight): the decode GEMM over the
 * split layout the old loader made (quants in one array, scales widened to float32 in two
 * others). qgemm.c reads GGUF's own blocks with the same loop structure and summation order,
 * so the two give bit-identical results (tests/model/test_quant_kernel.py checks); this file
 * is also the "before" of the same-process A/B in benchmarks (benchmarks/bench_qgemm.py).
 *
 * Block-quantised GEMM for CPU decode: y[M,N] = x[M,K] . W[N,K]^T with W kept in GGUF's
 * 32-element blocks (Q4_0, Q4_1, Q8_0) and x, y in float32.
 *
 * Why: a decode step multiplies a handful of rows by every weight, so its time is spent
 * streaming weights. Dequantised to float32 the default model is 538 MB per step; in its
 * GGUF blocks it is ~96 MB. Each block is expanded to floats in registers, exactly as
 * gguf-py's dequantize does it (d*q, then + m, never fused), and dotted with up to 8 rows of
 * x in float32 FMAs, so the result equals a float32 GEMM over the dequantised weights up to
 * summation order.
 *
 * Layout (see iterserve/model/quant.py): qs [N][K/32][16 or 32 bytes] in GGUF's order (a
 * Q4 byte j holds element j in its low nibble and element j+16 in its high one), d and m
 * [N][K/32] float32. Threads split the N columns; compiled with -mavx2 -mfma, and with
 * -ffp-contract=off so the dequantisation is not fused into an FMA.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#include "iterserve.h"
#include "simd.h"

enum { KIND_Q4_0 = 0, KIND_Q4_1 = 1, KIND_Q8_0 = 2 };
#define QK 32
#define COL_CHUNK 64

/* One block of 32 weights -> w[0..3] (elements 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void dequant(
        int kind, const uint8_t *q, float d, float m, __m256 *w) {
    const __m256 vd = _mm256_set1_ps(d);
    if (kind == KIND_Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vd);
        }
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    __m256i v[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                    _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
    if (kind == KIND_Q4_0) {
        const __m256i eight = _mm256_set1_epi32(8);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v[i], eight)), vd);
    } else {
        const __m256 vm = _mm256_set1_ps(m);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v[i]), vd), vm);
    }
}

/* Independent accumulators per row, so that enough FMA chains are in flight: an FMA has a
 * latency of 4-5 cycles and two issue per cycle, so ~10 chains keep the units busy. With one
 * accumulator per row, a batch-1 call ran one chain (4 serial FMAs per block) and reached a
 * fifth of the FMA throughput; R*A stays <= 12 so accumulators and w[4] fit 16 registers. */
#define ACCS(R) ((R) <= 3 ? 4 : (R) <= 5 ? 2 : 1)

/* R rows of x times one weight row over blocks [b0, b1); R and A are compile-time constants
 * after inlining. y[r] is set, or with `add` accumulated (the second and later K chunks). */
static inline __attribute__((always_inline)) void rows_by_col(
        int R, int A, int kind, const float *x, long ldx, int b0, int b1, const uint8_t *q,
        long qblock, const float *d, const float *m, float *y, long ldy, int add) {
    __m256 acc[12];
    for (int i = 0; i < R * A; i++) acc[i] = _mm256_setzero_ps();
    for (int b = b0; b < b1; b++) {
        __m256 w[4];
        dequant(kind, q + b * qblock, d[b], m ? m[b] : 0.0f, w);
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

#define ROWS(R, KIND) \
    rows_by_col(R, ACCS(R), KIND, xt, K, b0, b1, qn, qblock, dn, mn, yt, N, b0 > 0)
#define DISPATCH(KIND)                                                                    \
    switch (R) {                                                                          \
    case 8: ROWS(8, KIND); break;                                                         \
    case 7: ROWS(7, KIND); break;                                                         \
    case 6: ROWS(6, KIND); break;                                                         \
    case 5: ROWS(5, KIND); break;                                                         \
    case 4: ROWS(4, KIND); break;                                                         \
    case 3: ROWS(3, KIND); break;                                                         \
    case 2: ROWS(2, KIND); break;                                                         \
    default: ROWS(1, KIND); break;                                                        \
    }

/* Activation bytes one row tile may take per K chunk: the tile is re-read for every weight
 * row, so it must stay in the 32 KiB L1 next to the streaming weights. down_proj's 8 rows x
 * 1,536 floats (48 KiB) did not, and ran at 70% of the other projections' rate. */
#define X_TILE_BYTES (24 * 1024)

/* y must be [M][N] contiguous, x [M][K] contiguous, K a multiple of 32. */
void iterserve_qgemm_split(int kind, const float *x, long M, long K, const uint8_t *qs,
                     const float *d, const float *m, float *y, long N, int nthreads) {
    const int nb = (int)(K / QK);
    const long qblock = kind == KIND_Q8_0 ? QK : QK / 2;
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
    /* Row tiles of at most 8, balanced (12 rows -> 6 + 6, not 8 + 4). */
    const long ntiles = (M + 7) / 8;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const long n0 = N * t / T, n1 = N * (t + 1) / T;
        for (long c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const long c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (long tile = 0; tile < ntiles; tile++) {
                const long r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                const float *xt = x + r0 * K;
                const int kc_max = X_TILE_BYTES / (R * QK * (int)sizeof(float));
                const int nk = (nb + kc_max - 1) / kc_max;
                for (int kchunk = 0; kchunk < nk; kchunk++) {
                    const int b0 = (int)((long)nb * kchunk / nk);
                    const int b1 = (int)((long)nb * (kchunk + 1) / nk);
                    for (long n = c0; n < c1; n++) {
                        const uint8_t *qn = qs + n * nb * qblock;
                        const float *dn = d + n * nb;
                        const float *mn = m ? m + n * nb : 0;
                        float *yt = y + r0 * N + n;
                        if (kind == KIND_Q8_0) { DISPATCH(KIND_Q8_0) }
                        else if (kind == KIND_Q4_1) { DISPATCH(KIND_Q4_1) }
                        else { DISPATCH(KIND_Q4_0) }
                    }
                }
            }
        }
    }
}
