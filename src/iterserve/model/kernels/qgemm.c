/* Block-quantised GEMM for CPU decode: y[M,N] = x[M,K] . W[N,K]^T with W kept in GGUF's
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

/* R rows of x (R a compile-time constant after inlining) times one weight row. */
static inline __attribute__((always_inline)) void rows_by_col(
        int R, int kind, const float *x, long ldx, int nb, const uint8_t *q, long qblock,
        const float *d, const float *m, float *y, long ldy) {
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 w[4];
        dequant(kind, q + b * qblock, d[b], m ? m[b] : 0.0f, w);
        const float *xb = x + b * QK;
        for (int r = 0; r < R; r++) {
            const float *xr = xb + r * ldx;
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum8(acc[r]);
}

#define DISPATCH(KIND)                                                                    \
    switch (R) {                                                                          \
    case 8: rows_by_col(8, KIND, xt, K, nb, qn, qblock, dn, mn, yt, N); break;            \
    case 7: rows_by_col(7, KIND, xt, K, nb, qn, qblock, dn, mn, yt, N); break;            \
    case 6: rows_by_col(6, KIND, xt, K, nb, qn, qblock, dn, mn, yt, N); break;            \
    case 5: rows_by_col(5, KIND, xt, K, nb, qn, qblock, dn, mn, yt, N); break;            \
    case 4: rows_by_col(4, KIND, xt, K, nb, qn, qblock, dn, mn, yt, N); break;            \
    case 3: rows_by_col(3, KIND, xt, K, nb, qn, qblock, dn, mn, yt, N); break;            \
    case 2: rows_by_col(2, KIND, xt, K, nb, qn, qblock, dn, mn, yt, N); break;            \
    default: rows_by_col(1, KIND, xt, K, nb, qn, qblock, dn, mn, yt, N); break;           \
    }

/* y must be [M][N] contiguous, x [M][K] contiguous, K a multiple of 32. */
void iterserve_qgemm(int kind, const float *x, long M, long K, const uint8_t *qs,
                     const float *d, const float *m, float *y, long N, int nthreads) {
    const int nb = (int)(K / QK);
    const long qblock = kind == KIND_Q8_0 ? QK : QK / 2;
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const long n0 = N * t / T, n1 = N * (t + 1) / T;
        for (long c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const long c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (long r0 = 0; r0 < M; r0 += 8) {
                const int R = M - r0 < 8 ? (int)(M - r0) : 8;
                const float *xt = x + r0 * K;
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
