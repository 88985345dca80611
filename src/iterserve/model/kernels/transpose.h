/* transpose.h: in-register transposes of 8x8 and 16x16 blocks of 32-bit words.
 *
 * Why a header of its own: the three panel packers (prefill.c's float panels, prefill8.c's
 * int8 code groups, bf16dot.c's bf16 pairs) all lay a weight panel out K-major with the same
 * transposes; they move bits, so one copy serves floats and integers alike. The 8x8 one needs
 * AVX (the library is built with -mavx2), the 16x16 one AVX-512F (callers are AVX-512
 * functions: it is always inlined into them).
 */
#ifndef ITERSERVE_TRANSPOSE_H
#define ITERSERVE_TRANSPOSE_H

#include <immintrin.h>
#include <stdint.h>

/* dst[c][r] = src[r][c] for an 8x8 block of 32-bit words (row strides lds, ldd in words). */
static inline void tr8x8(const void *src_, int64_t lds, void *dst_, int64_t ldd) {
    const float *src = (const float *)src_;
    float *dst = (float *)dst_;
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        const int a = 4 * i;
        s[a] = _mm256_shuffle_ps(t[a], t[a + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[a + 1] = _mm256_shuffle_ps(t[a], t[a + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[a + 2] = _mm256_shuffle_ps(t[a + 1], t[a + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[a + 3] = _mm256_shuffle_ps(t[a + 1], t[a + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}

/* dst[c][r] = src[r][c] for a 16x16 block of 32-bit words: unpack, shuffle, then two rounds of 128-bit lane
 * shuffles (64 shuffles for 256 floats; four tr8x8 take 96). */
static inline __attribute__((always_inline, target("avx512f"))) void tr16x16(
        const void *src_, int64_t lds, void *dst_, int64_t ldd) {
    const float *src = (const float *)src_;
    float *dst = (float *)dst_;
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i++) {               /* lane L: rows 2i, 2i+1 at columns 4L.. */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {               /* r[4i + c] lane L: rows 4i..4i+3, column 4L + c */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    }
    for (int c = 0; c < 4; c++) {               /* r[i] = column i of the 16 rows */
        r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
        r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ldd, r[i]);
}

#endif
