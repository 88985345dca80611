/* The per-layer elementwise ops of a decode step, one call each instead of several torch ops.
 *
 * Why: at small batches a step's arithmetic is tiny but each layer runs ~30 torch ops, each
 * paying dispatch (~5-25 us here): RMSNorm alone is pow, mean, add, rsqrt, mul, mul. These
 * run single-threaded; the rows are short (hidden 576, FFN 1536).
 *
 * rmsnorm:  y = (x * 1/sqrt(mean(x^2) + eps)) * w     (HF's order of the two products)
 * silu_mul: y = silu(g) * u with g, u the two halves of each row of gu (fused gate/up GEMM)
 * swiglu_oai: gpt-oss's clamped, alpha-scaled SwiGLU of its experts' gate/up output
 * rope:     rotary embedding in place on the q/k heads of the qkv GEMM's output
 * qk_norm:  Qwen3's per-head RMSNorm of q and k, in place on the qkv GEMM's output (the same
 *           arithmetic as rmsnorm, one head of d floats at a time)
 */
#include <immintrin.h>
#include <math.h>

#include "iterserve.h"
#include "simd.h"

static inline void rmsnorm_row(const float *xr, const float *w, float *yr, int64_t D, float eps) {
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

void iterserve_rmsnorm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps) {
    for (int64_t t = 0; t < T; t++) rmsnorm_row(x + t * D, w, y + t * D, D, eps);
}

void iterserve_qk_norm(float *x, int64_t T, int64_t ldx, int64_t H, int64_t kvh, int64_t d,
                       const float *qw, const float *kw, float eps) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < H + kvh; n++) {
            float *row = x + t * ldx + n * d;
            rmsnorm_row(row, n < H ? qw : kw, row, d, eps);
        }
}

void iterserve_silu_mul(const float *gu, float *y, int64_t T, int64_t I) {
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

/* Eight outputs of gpt-oss's activation, in torch's order of operations (moe.py's Expert):
 * (up + 1) * (g * sigmoid(g * alpha)), g = min(gate, limit), up clamped to [-limit, limit]. */
static inline __m256 swiglu_oai8(__m256 g, __m256 u, __m256 alpha, __m256 limit) {
    const __m256 one = _mm256_set1_ps(1.0f);
    g = _mm256_min_ps(g, limit);
    u = _mm256_max_ps(_mm256_min_ps(u, limit), _mm256_sub_ps(_mm256_setzero_ps(), limit));
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(g, alpha)));
    const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_add_ps(u, one), _mm256_mul_ps(g, s));
}

void iterserve_swiglu_oai(const float *gu, float *y, int64_t T, int64_t I, int64_t interleaved,
                          float alpha, float limit) {
    const __m256 av = _mm256_set1_ps(alpha), lv = _mm256_set1_ps(limit);
    const int64_t gs = interleaved ? 2 : 1;            /* stride of gate (and up) elements */
    for (int64_t t = 0; t < T; t++) {
        const float *row = gu + t * 2 * I;
        const float *g = row, *u = interleaved ? row + 1 : row + I;
        float *yr = y + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {        /* a column's arithmetic is the same in either layout */
            float gb[8], ub[8];
            for (int j = 0; j < 8; j++) {
                gb[j] = g[(i + j) * gs];
                ub[j] = u[(i + j) * gs];
            }
            _mm256_storeu_ps(yr + i, swiglu_oai8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub), av, lv));
        }
        if (i < I) {                       /* the tail through the same vector code, padded */
            float gb[8] = {0}, ub[8] = {0}, yb[8];
            for (int64_t j = 0; i + j < I; j++) {
                gb[j] = g[(i + j) * gs];
                ub[j] = u[(i + j) * gs];
            }
            _mm256_storeu_ps(yb, swiglu_oai8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub), av, lv));
            for (int64_t j = 0; i + j < I; j++) yr[i + j] = yb[j];
        }
    }
}

/* RoPE in place, HF's rotate_half form: for each of T rows (stride ldx floats) and `heads`
 * heads of d floats, with h = d/2 and cos/sin [T][d]:
 *   x[i]   <- x[i]*cos[i]     - x[i+h]*sin[i]
 *   x[i+h] <- x[i+h]*cos[i+h] + x[i]*sin[i+h]      (products rounded, then added, as torch) */
void iterserve_rope(float *x, int64_t T, int64_t ldx, int64_t heads, int64_t d,
                    const float *cos, const float *sin) {
    const long h = d / 2;
    for (long t = 0; t < T; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (long n = 0; n < heads; n++) {
            float *a = x + t * ldx + n * d, *b = a + h;
            long i = 0;
            for (; i + 8 <= h; i += 8) {
                __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
                __m256 lo = _mm256_sub_ps(_mm256_mul_ps(va, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(vb, _mm256_loadu_ps(s + i)));
                __m256 hi = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(c + h + i)),
                                          _mm256_mul_ps(va, _mm256_loadu_ps(s + h + i)));
                _mm256_storeu_ps(a + i, lo);
                _mm256_storeu_ps(b + i, hi);
            }
            for (; i < h; i++) {
                const float va = a[i], vb = b[i];
                a[i] = va * c[i] - vb * s[i];
                b[i] = vb * c[h + i] + va * s[h + i];
            }
        }
    }
}
