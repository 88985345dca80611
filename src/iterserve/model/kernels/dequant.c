/* GGUF blocks -> float32, bit-exact with gguf-py's `quants.dequantize`, and the GEMM for every
 * type that has no register kernel in qgemm.c.
 *
 * Why: weights stay in their file's encoding (no float32 copy of a matrix ever exists), so
 * everything that needs floats decodes rows at use: the reference path dequantises a bounded
 * tile, prefill decodes a weight panel into an L2-sized scratch, an embedding lookup decodes
 * one row. One decoder per type serves all of them and the generic decode GEMM below, so there
 * is one definition of what a block means.
 *
 * Exactness: each decoder computes in float32 in the order gguf-py's numpy code does (e.g.
 * Q4_K: (d * sc) * q - (dmin * m), products rounded before the subtraction; the file is
 * compiled with -ffp-contract=off so no FMA fuses them), and f16 -> f32 (F16C) and bf16 -> f32
 * (a shift) are exact, so the result is bit-identical (tests/model/test_quant_kernel.py).
 * The loops are written over small integer arrays so that gcc vectorises them.
 *
 * Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
 * IQ4_XS, MXFP4. The float types are treated as blocks of 32 elements by the GEMM (k % 32 == 0
 * there); `dequant` takes any k for them.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "simd.h"

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

const int8_t iterserve_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1, 13, 25, 38, 53, 69, 89, 113};

typedef iterserve_decode_fn decode_fn;

/* y[0..32) = (float)q * ds - dm for 32 unsigned bytes q (products rounded, then subtracted,
 * as numpy does; -ffp-contract=off keeps them unfused); dm may be 0 (then y = q * ds - 0,
 * which is q * ds exactly). signed: q are int8. */
static inline void store32(__m256i q, int is_signed, __m256 ds, __m256 dm, float *y) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256i v = is_signed ? _mm256_cvtepi8_epi32(part[i]) : _mm256_cvtepu8_epi32(part[i]);
        _mm256_storeu_ps(y + 8 * i, _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), ds), dm));
    }
}

/* 0xFF in byte i where bit i of the 32-bit word at x is set (llama.cpp's bytes_from_bits_32) */
static inline __m256i bytes_from_bits_32(const uint8_t *x) {
    uint32_t x32;
    memcpy(&x32, x, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* --- 32-element blocks ----------------------------------------------------------------- */
static void dec_q4_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    const uint8_t *q = b + 2;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((q[i] & 15) - 8);
        y[i + 16] = d * (float)((q[i] >> 4) - 8);
    }
}

static void dec_q4_1(const uint8_t *b, float *y) {
    const float d = f16(b), m = f16(b + 2);
    const uint8_t *q = b + 4;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)(q[i] & 15) + m;
        y[i + 16] = d * (float)(q[i] >> 4) + m;
    }
}

static void dec_q5_0(const uint8_t *b, float *y) {
    /* q = (nibble | high bit << 4) - 16 as int8; y = d * q (gguf-py: d * qs.astype(f32)) */
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 6)), m4 = _mm_set1_epi8(15);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
    q = _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits_32(b + 2), _mm256_set1_epi8(16)));
    q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    store32(q, 1, _mm256_set1_ps(f16(b)), _mm256_setzero_ps(), y);
}

static void dec_q5_1(const uint8_t *b, float *y) {
    const float d = f16(b), m = f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *q = b + 8;
    for (int i = 0; i < 16; i++) {
        const int lo = (q[i] & 15) | (int)((qh >> i) & 1) << 4;
        const int hi = (q[i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
        y[i] = d * (float)lo + m;
        y[i + 16] = d * (float)hi + m;
    }
}

static void dec_q8_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int i = 0; i < 32; i++) y[i] = (float)q[i] * d;
}

static void dec_iq4_nl(const uint8_t *b, float *y) {
    const float d = f16(b);
    const uint8_t *q = b + 2;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)iterserve_iq4_values[q[i] & 15];
        y[i + 16] = d * (float)iterserve_iq4_values[q[i] >> 4];
    }
}

/* MXFP4 (gpt-oss's experts): an E8M0 scale byte, then the Q4_0 nibble order; the E2M1 values
 * doubled and the scale halved (ggml_e8m0_to_fp32_half), as gguf-py computes them. */
const int8_t iterserve_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static void dec_mxfp4(const uint8_t *b, float *y) {
    const float d = iterserve_e8m0_half(b[0]);
    const uint8_t *q = b + 1;
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)iterserve_mxfp4_values[q[i] & 15];
        y[i + 16] = d * (float)iterserve_mxfp4_values[q[i] >> 4];
    }
}

/* float types as 32-element pseudo-blocks (for the GEMM) */
static void dec_f32(const uint8_t *b, float *y) { memcpy(y, b, 32 * sizeof(float)); }

static void dec_f16(const uint8_t *b, float *y) {
    for (int i = 0; i < 32; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 2 * i))));
}

static void dec_bf16(const uint8_t *b, float *y) {
    for (int i = 0; i < 32; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 2 * i)));
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
}

/* --- 256-element super-blocks (K-quants, IQ4_XS) ----------------------------------------- */
static void dec_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int s = 0; s < 16; s++) {
        const float dl = d * (float)(sc[s] & 15), ml = dmin * (float)(sc[s] >> 4);
        /* element e = 16 s + i: half h = e / 128, shift (e % 128) / 32, byte h*32 + e % 32 */
        const int e0 = 16 * s, h = e0 / 128, shift = 2 * ((e0 % 128) / 32);
        const uint8_t *q = qs + h * 32 + e0 % 32;
        for (int i = 0; i < 16; i++) y[e0 + i] = dl * (float)((q[i] >> shift) & 3) - ml;
    }
}

static void dec_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = f16(b + 108);
    for (int s = 0; s < 16; s++) {
        const int l = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
        const int hh = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        const float dl = d * (float)((int8_t)(l | hh << 4) - 32);
        const int e0 = 16 * s, h = e0 / 128, shift = 2 * ((e0 % 128) / 32), j = e0 / 32;
        const uint8_t *q = qs + h * 32 + e0 % 32, *m = hm + e0 % 32;
        for (int i = 0; i < 16; i++) {
            const int ql = (q[i] >> shift) & 3, qh = ((m[i] >> j) & 1) ^ 1;
            y[e0 + i] = dl * (float)(ql - (qh << 2));
        }
    }
}

/* Q4_K / Q5_K's 6-bit sub-block scales and mins (gguf-py's Q4_K.get_scale_min) */
static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[4 + j] & 63;
    } else {
        *sc = (s[8 + j - 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
    }
}

static void dec_q4_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {                  /* 32 bytes: sub-blocks 2c (low), 2c+1 */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        const __m256i nib[2] = {_mm256_and_si256(raw, m4),
                                _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4)};
        for (int a = 0; a < 2; a++) {
            int sc, mn;
            scale_min_k4(scales, 2 * c + a, &sc, &mn);
            store32(nib[a], 0, _mm256_set1_ps(d * (float)sc), _mm256_set1_ps(dmin * (float)mn),
                    y + 32 * (2 * c + a));
        }
    }
}

static void dec_q5_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min_k4(scales, j, &sc, &mn);
        const float ds = d * (float)sc, dm = dmin * (float)mn;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 32; i++) {
            const int v = ((q[i] >> shift) & 15) | ((qh[i] >> j) & 1) << 4;
            y[32 * j + i] = ds * (float)v - dm;
        }
    }
}

static void dec_q6_k(const uint8_t *b, float *y) {
    /* element e = 128 h + 32 g + i: low 4 bits (ql[64h + 32(g%2) + i] >> 4(g/2)) & 15, high 2
     * bits (qh[32h + i] >> 2g) & 3; q = (low | high << 4) - 32; y = (d * sc[e/16]) * q */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        for (int g = 0; g < 4; g++) {
            __m256i lo = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (g % 2)));
            if (g / 2) lo = _mm256_srli_epi16(lo, 4);
            lo = _mm256_and_si256(lo, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), m2);
            const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), off);
            const int e0 = 128 * h + 32 * g;
            const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
            const __m128i part[4] = {q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)};
            for (int i = 0; i < 4; i++) {
                const __m256 ds = _mm256_set1_ps(d * (float)sc[(e0 + 8 * i) / 16]);
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i]));
                _mm256_storeu_ps(y + e0 + 8 * i, _mm256_mul_ps(ds, v));
            }
        }
    }
}

static void dec_iq4_xs(const uint8_t *b, float *y) {
    const float d = f16(b);
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int j = 0; j < 8; j++) {
        const int l = (sl[j / 2] >> (4 * (j % 2))) & 15, hh = (sh >> (2 * j)) & 3;
        const float dl = d * (float)((int8_t)(l | hh << 4) - 32);
        const uint8_t *q = qs + 16 * j;
        for (int i = 0; i < 16; i++) {
            y[32 * j + i] = dl * (float)iterserve_iq4_values[q[i] & 15];
            y[32 * j + 16 + i] = dl * (float)iterserve_iq4_values[q[i] >> 4];
        }
    }
}

/* --- the type table ----------------------------------------------------------------------- */
typedef struct { int elems, bytes; decode_fn fn; } type_info;

/* elems/bytes as ggml defines them; the float types' GEMM pseudo-block is 32 elements */
static type_info info(int64_t type) {
    switch (type) {
    case GGML_F32: return (type_info){1, 4, dec_f32};
    case GGML_F16: return (type_info){1, 2, dec_f16};
    case GGML_BF16: return (type_info){1, 2, dec_bf16};
    case GGML_Q4_0: return (type_info){32, 18, dec_q4_0};
    case GGML_Q4_1: return (type_info){32, 20, dec_q4_1};
    case GGML_Q5_0: return (type_info){32, 22, dec_q5_0};
    case GGML_Q5_1: return (type_info){32, 24, dec_q5_1};
    case GGML_Q8_0: return (type_info){32, 34, dec_q8_0};
    case GGML_Q2_K: return (type_info){256, 84, dec_q2_k};
    case GGML_Q3_K: return (type_info){256, 110, dec_q3_k};
    case GGML_Q4_K: return (type_info){256, 144, dec_q4_k};
    case GGML_Q5_K: return (type_info){256, 176, dec_q5_k};
    case GGML_Q6_K: return (type_info){256, 210, dec_q6_k};
    case GGML_IQ4_NL: return (type_info){32, 18, dec_iq4_nl};
    case GGML_IQ4_XS: return (type_info){256, 136, dec_iq4_xs};
    case GGML_MXFP4: return (type_info){32, 17, dec_mxfp4};
    default: return (type_info){0, 0, 0};
    }
}

int iterserve_block_elems(int64_t type) { return info(type).elems; }
int iterserve_block_bytes(int64_t type) { return info(type).bytes; }
int iterserve_can_dequant(int64_t type) { return info(type).fn != 0; }

iterserve_decode_fn iterserve_block_decoder(int64_t type, int *qb, int *bb) {
    const type_info ti = info(type);
    *qb = ti.elems > 1 ? ti.elems : 32;
    *bb = ti.elems > 1 ? ti.bytes : 32 * ti.bytes;
    return ti.fn;
}

/* --- dequant ------------------------------------------------------------------------------- */
static void dequant_row(int64_t type, type_info ti, const uint8_t *w, int64_t k, float *y) {
    if (type == GGML_F32) { memcpy(y, w, sizeof(float) * (size_t)k); return; }
    if (type == GGML_F16 || type == GGML_BF16) {
        int64_t i = 0;
        for (; i + 32 <= k; i += 32) ti.fn(w + 2 * i, y + i);
        for (; i < k; i++) {
            uint16_t h;
            memcpy(&h, w + 2 * i, 2);
            if (type == GGML_F16) y[i] = _cvtsh_ss(h);
            else { uint32_t u = (uint32_t)h << 16; memcpy(y + i, &u, 4); }
        }
        return;
    }
    const int64_t nb = k / ti.elems;
    for (int64_t b = 0; b < nb; b++) ti.fn(w + b * ti.bytes, y + b * ti.elems);
}

void iterserve_dequant(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                       int64_t k, float *out, int64_t ldo, int nthreads) {
    const type_info ti = info(type);
    if (!ti.fn || n < 1) return;
    if (nthreads < 1 || n * k < (1 << 16)) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < n; r++) dequant_row(type, ti, w + r * row_stride, k, out + r * ldo);
}

/* --- generic GEMM: decode a block into L1, dot it with up to 8 rows ------------------------ */
#define ACCS(R) ((R) <= 3 ? 4 : (R) <= 5 ? 2 : 1)
#define COL_CHUNK 64
#define X_TILE_BYTES (24 * 1024)

static inline __attribute__((always_inline)) void rows_by_col_g(
        int R, int A, decode_fn fn, int QB, int BB, const float *x, int64_t ldx, int b0, int b1,
        const uint8_t *wrow, float *y, int64_t ldy, int add, float *buf) {
    __m256 acc[12];
    for (int i = 0; i < R * A; i++) acc[i] = _mm256_setzero_ps();
    for (int b = b0; b < b1; b++) {
        fn(wrow + (int64_t)b * BB, buf);
        const float *xb = x + (int64_t)b * QB;
        for (int i = 0; i < QB / 8; i++) {
            const __m256 w = _mm256_load_ps(buf + 8 * i);
            for (int r = 0; r < R; r++)
                acc[r * A + i % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + r * ldx + 8 * i), w,
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

#define ROWS_G(R) rows_by_col_g(R, ACCS(R), ti.fn, QB, BB, xt, ldx, b0, b1, wn, yt, ldy, \
                                b0 > 0, buf)

void iterserve_qgemm_generic(int64_t type, const uint8_t *w, int64_t N, int64_t row_stride,
                             int64_t K, const float *x, int64_t M, int64_t ldx, float *y,
                             int64_t ldy, int nthreads) {
    const type_info ti = info(type);
    if (!ti.fn || M < 1 || N < 1) return;
    const int QB = ti.elems > 1 ? ti.elems : 32;
    const int BB = ti.elems > 1 ? ti.bytes : 32 * ti.bytes;
    const int nb = (int)(K / QB);
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
    const int64_t ntiles = (M + 7) / 8;
#pragma omp parallel num_threads(nthreads)
    {
        float buf[256] __attribute__((aligned(32)));
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                const float *xt = x + r0 * ldx;
                int kc_max = X_TILE_BYTES / (R * QB * (int)sizeof(float));
                if (kc_max < 1) kc_max = 1;
                const int nk = (nb + kc_max - 1) / kc_max;
                for (int kchunk = 0; kchunk < nk; kchunk++) {
                    const int b0 = (int)((int64_t)nb * kchunk / nk);
                    const int b1 = (int)((int64_t)nb * (kchunk + 1) / nk);
                    for (int64_t n = c0; n < c1; n++) {
                        const uint8_t *wn = w + n * row_stride;
                        float *yt = y + r0 * ldy + n;
                        switch (R) {
                        case 8: ROWS_G(8); break;
                        case 7: ROWS_G(7); break;
                        case 6: ROWS_G(6); break;
                        case 5: ROWS_G(5); break;
                        case 4: ROWS_G(4); break;
                        case 3: ROWS_G(3); break;
                        case 2: ROWS_G(2); break;
                        default: ROWS_G(1); break;
                        }
                    }
                }
            }
        }
    }
}
