/* The per-layer elementwise ops of a decode step, one call each instead of several torch ops.
 *
 * Why: at small batches a step's arithmetic is tiny but each layer runs ~30 torch ops, each
 * paying dispatch (~5-25 us here): RMSNorm alone is pow, mean, add, rsqrt, mul, mul. These
 * run single-threaded; the rows are short (hidden 576, FFN 1536).
 *
 * rmsnorm:  y = (x * 1/sqrt(mean(x^2) + eps)) * w     (HF's order of the two products)
 * silu_mul: y = silu(g) * u with g, u the two halves of each row of gu (fused gate/up GEMM)
 */
#include <immintrin.h>
#include <math.h>

#include "simd.h"

void iterserve_rmsnorm(const float *x, const float *w, float *y, long T, long D, float eps) {
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *yr = y + t * D;
        __m256 acc = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= D; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; i < D; i++) ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 vr = _mm256_set1_ps(r);
        for (i = 0; i + 8 <= D; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vr),
                                                   _mm256_loadu_ps(w + i)));
        for (; i < D; i++) yr[i] = (xr[i] * r) * w[i];
    }
}

void iterserve_silu_mul(const float *gu, float *y, long T, long I) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (long t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *yr = y + t * I;
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
