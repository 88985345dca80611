/* AVX-512 decoders of GGUF blocks into registers, shared by the decode kernels (qgemm.c) and
 * the prefill panel packer (prefill.c).
 *
 * Why one place: a block's meaning is defined once per type in dequant.c (bit-exact with
 * gguf-py); these are the same arithmetic, 16 lanes at a time, for the types whose AVX-512
 * decoding pays (the K-quants and Q5 types of Q4_K_M / Q5_K_M files, and the float types of
 * F16 GGUFs and bf16/fp16 checkpoints). A block is seen as units of 32 elements (1 unit for
 * the 32-element types and the float pseudo-blocks, 8 for the 256-element K-quants); a unit
 * becomes two zmm (elements 0-15, 16-31). Per-block scales are widened once per block
 * (`kprep512`), in scalar float32 arithmetic, which is the same IEEE operation as the vector
 * one in dequant.c.
 *
 * Exactness (the file is compiled with -ffp-contract=off): every lane is the value dequant.c
 * computes, e.g. Q4_K fl(fl(d*sc) * q) - fl(dmin*m). The 4-bit types use a 16-entry table per
 * (sub-)block instead of converting each nibble: T[q] = fl(fl(ds * q) - dm) for q = 0..15 is
 * built with the same two operations, and vpermps (which reads only the low 4 bits of each
 * index lane) looks every weight up: per 16 weights one permute instead of an integer
 * convert, a float convert, a multiply and a subtract.
 */
#ifndef ITERSERVE_BLOCKS512_H
#define ITERSERVE_BLOCKS512_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "iterserve.h"

#ifndef AVX512
#define AVX512 __attribute__((target("avx512f,avx512vl,avx512bw")))
#endif
#define B512_INLINE static inline __attribute__((always_inline)) AVX512

/* elements and bytes of one block as the register kernels see it (float types: 32) */
static inline int qb512(int type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ? 256 : 32;
}
static inline int bb512(int type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    case GGML_F16: case GGML_BF16: return 64;
    default: return 128;                     /* F32 */
    }
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q4_K / Q5_K's 6-bit sub-block scale and min (gguf-py's Q4_K.get_scale_min) */
static inline void kscale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[4 + j] & 63;
    } else {
        *sc = (s[8 + j - 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
    }
}

/* Per-block scales of the K-quants: Q4_K / Q5_K s[j] = d*sc_j, m[j] = dmin*m_j (j < 8);
 * Q6_K s[i] = d*sc_i (i < 16, one per 16 elements). Nothing for the other types. */
static inline __attribute__((always_inline)) void kprep512(int type, const uint8_t *b,
                                                           float *s, float *m) {
    if (type == GGML_Q4_K || type == GGML_Q5_K) {
        const float d = f16_at(b), dmin = f16_at(b + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            kscale_min(b + 4, j, &sc, &mn);
            s[j] = d * (float)sc;
            m[j] = dmin * (float)mn;
        }
    } else if (type == GGML_Q6_K) {
        const float d = f16_at(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int i = 0; i < 16; i++) s[i] = d * (float)sc[i];
    }
}

B512_INLINE __m512 iota16(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* Unit j of block b -> w[0] (elements 32j..32j+15), w[1] (32j+16..32j+31). */
B512_INLINE void unit512(int type, const uint8_t *b, int j, const float *s, const float *m,
                         __m512 *w) {
    const __m256i m4 = _mm256_set1_epi8(15);
    switch (type) {
    case GGML_Q4_0: {                        /* d * (q - 8) */
        const __m512 t = _mm512_mul_ps(_mm512_set1_ps(f16_at(b)),
                                       _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)));
        const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
        w[0] = _mm512_permutexvar_ps(i0, t);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), t);
        break;
    }
    case GGML_Q4_1: {                        /* d * q + m */
        const __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f16_at(b)), iota16()),
                                       _mm512_set1_ps(f16_at(b + 2)));
        const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4)));
        w[0] = _mm512_permutexvar_ps(i0, t);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), t);
        break;
    }
    case GGML_Q8_0: {                        /* q * d */
        const __m512 d = _mm512_set1_ps(f16_at(b));
        for (int i = 0; i < 2; i++)
            w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                       _mm_loadu_si128((const __m128i *)(b + 2 + 16 * i)))), d);
        break;
    }
    case GGML_Q5_0: case GGML_Q5_1: {        /* Q5_0 d * (q - 16); Q5_1 d * q + m */
        const int q5_1 = type == GGML_Q5_1;
        const uint8_t *qs = b + (q5_1 ? 8 : 6);
        uint32_t qh;
        memcpy(&qh, b + (q5_1 ? 4 : 2), 4);
        const __m128i raw = _mm_loadu_si128((const __m128i *)qs), n4 = _mm_set1_epi8(15);
        __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), n4),
                                     _mm_and_si128(raw, n4));
        q = _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(16));
        const __m512 d = _mm512_set1_ps(f16_at(b));
        const __m128i h[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        if (q5_1) {
            const __m512 mm = _mm512_set1_ps(f16_at(b + 2));
            for (int i = 0; i < 2; i++)
                w[i] = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h[i]))), mm);
        } else {
            for (int i = 0; i < 2; i++)
                w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
                           _mm512_cvtepu8_epi32(h[i]), _mm512_set1_epi32(16))), d);
        }
        break;
    }
    case GGML_Q4_K: {                        /* (d*sc) * q - (dmin*m), table per sub-block */
        const uint8_t *q = b + 16 + 32 * (j / 2);
        __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
        if (j & 1) {
            i0 = _mm512_srli_epi32(i0, 4);
            i1 = _mm512_srli_epi32(i1, 4);
        }
        const __m512 t = _mm512_sub_ps(_mm512_mul_ps(iota16(), _mm512_set1_ps(s[j])),
                                       _mm512_set1_ps(m[j]));
        w[0] = _mm512_permutexvar_ps(i0, t);
        w[1] = _mm512_permutexvar_ps(i1, t);
        break;
    }
    case GGML_Q5_K: {                        /* (d*sc) * (nibble | high bit << 4) - (dmin*m) */
        __m256i n = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (j / 2)));
        if (j & 1) n = _mm256_srli_epi16(n, 4);
        n = _mm256_and_si256(n, m4);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __mmask32 hb = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << j)));
        n = _mm256_mask_add_epi8(n, hb, n, _mm256_set1_epi8(16));   /* nibble + 16 = nibble | 16 */
        const __m512 ds = _mm512_set1_ps(s[j]), dm = _mm512_set1_ps(m[j]);
        w[0] = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                   _mm256_castsi256_si128(n))), ds), dm);
        w[1] = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                   _mm256_extracti128_si256(n, 1))), ds), dm);
        break;
    }
    case GGML_Q6_K: {                        /* (d*sc[e/16]) * ((low | high << 4) - 32) */
        const int h = j / 4, g = j % 4;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (g % 2)));
        if (g / 2) lo = _mm256_srli_epi16(lo, 4);
        lo = _mm256_and_si256(lo, m4);
        __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        hi = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * g), _mm256_set1_epi8(3));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                                          _mm256_set1_epi8(32));
        w[0] = _mm512_mul_ps(_mm512_set1_ps(s[2 * j]), _mm512_cvtepi32_ps(
                   _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        w[1] = _mm512_mul_ps(_mm512_set1_ps(s[2 * j + 1]), _mm512_cvtepi32_ps(
                   _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
        break;
    }
    case GGML_F16:
        for (int i = 0; i < 2; i++)
            w[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32 * i)));
        break;
    case GGML_BF16:
        for (int i = 0; i < 2; i++)
            w[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                       _mm256_loadu_si256((const __m256i *)(b + 32 * i))), 16));
        break;
    default:                                 /* F32 */
        for (int i = 0; i < 2; i++) w[i] = _mm512_loadu_ps((const float *)b + 16 * i);
    }
}

#endif
