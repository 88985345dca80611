/* AVX2 helpers shared by the kernels in this folder. */
#ifndef ITERSERVE_SIMD_H
#define ITERSERVE_SIMD_H
#include <immintrin.h>

/* Sum of the 8 floats of v. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 h = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, h);
    h = _mm_movehl_ps(h, s);
    return _mm_cvtss_f32(_mm_add_ss(s, h));
}

#endif
