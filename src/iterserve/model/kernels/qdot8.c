/* Decode GEMM with 8-bit activations and integer dot products (llama.cpp's scheme):
 * y[M, n] = x[M, k] . W[n, k]^T for W in its GGUF blocks, x float32 quantised to 8 bits once
 * per call.
 *
 * Why: qgemm.c expands every weight block to float32 in registers and dots it with float32
 * activations. At batch 1 on two cores that is bound by instructions, not by the bytes it
 * streams: a Q4_K super-block costs ~290 instructions there (nibbles -> int32 -> float, a
 * multiply and a subtract per 8 weights, then the FMAs), and the SmolLM2-1.7B-shaped Q4_K_M
 * model decoded one sequence at ~0.35x llama-server's speed. Quantising the activation row
 * to int8 (Q8_0 blocks of 32 with one float scale for the 32-element weight types, Q8_K
 * blocks of 256 with 16-element sums for the K-quants) lets a block be dotted as bytes:
 * AVX2 `vpmaddubsw` + `vpmaddwd`, AVX-512 VNNI `vpdpbusd` / `vpdpwssd`, one float multiply
 * per block (Q4_0 / Q8_0) or per super-block (Q4_K / Q6_K, whose sub-block scales multiply
 * the int16 pair sums in `vpmaddwd`). Weight nibbles stay bytes: no int -> float conversion
 * of the weights at all.
 *
 * Offsets (Q4_0's q - 8, Q6_K's q - 32, Q8_0's sign) are not applied to the weights: the
 * unsigned codes are dotted with the activations and the offset's share, off * sum(x), is
 * subtracted in integers: per 4-element group (the lanes of vpdpbusd / vpmaddwd) for the
 * 32-element types (`g4`, precomputed with the quantised row), per 16 elements with the
 * sub-block scales for Q6_K (`bsum16`); Q4_K's mins use the 32-element sums (`bsum32`).
 * AVX2's vpmaddubsw saturates at int16, so Q8_0 there uses llama.cpp's sign trick instead
 * (|w| . sign(x, w)); VNNI's vpdpbusd does not saturate and takes w + 128.
 *
 * Accuracy: the integer parts are exact, so the result differs from the float path only by
 * the activation rounding (<= d/2 per element, d = max|x|/127 per block) and the float
 * summation order: a relative error of ~0.2-0.5% per output for random data, like
 * llama.cpp's. Not bit-identical with qgemm.c's float path; the fused decode layers and the
 * per-module path both call iterserve_qgemm, which dispatches here under the same mode, so
 * those two stay bit-identical to each other.
 *
 * ISA: AVX-512 F/BW/VL/VNNI where the CPU has it (iterserve_st.int8), else AVX2. Threads
 * split the n output columns as in qgemm.c; the 32-element types go in row tiles of up to 4
 * (balanced), K in chunks whose quantised activations stay near L1. The K-quants take
 * dotkv_vnni / dotkw_avx2 (one decode of a super-block for all rows of the call, tiles of up
 * to 12; AVX-512 on vpdpbusd with lanes of 16-element groups; a software prefetch 2 columns
 * ahead), one Q4_K / Q5_K row on AVX-512 dotk1_vnni. Activations are quantised in vector code
 * (qblocks512 / qblocks256, the same values as the scalar rounding). Which rows come here at
 * all is dispatch.c's table (with the measurements: 1.7-4.6x the float kernels for the
 * K-quants at 1-32 rows). iterserve_k_split8 (the end of this file) runs a row as two int8
 * rows, its rounding and the residual, for the LM head's near-float mode.
 */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "kscales.h"
#include "scratch.h"

#define VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni")))
#define COL_CHUNK 64
#define ROW_TILE 4
#define A_TILE_BYTES (16 * 1024)     /* quantised activation bytes per row tile per K chunk */
/* The K chunks of the 32-element drivers are sized for a full tile of ROW_TILE rows whatever
 * the tile's own row count: a chunk's partial sum is reduced and added to the output, so its
 * boundaries are part of the summation order, and boundaries that followed the tile's rows
 * gave a row of a 4-row tile (K = 1536: two chunks) other bits than the same row alone (one
 * chunk). With them fixed by K, a row's result is the same in a call of 1 to ACT8 rows:
 * speculative verification (k + 1 decode rows) then computes what a one-row decode step does. */

/* ---- quantised activations ------------------------------------------------------------ */
/* One per call, in a thread-local buffer reused across calls. Per row r:
 * 32-element types: q[K] int8, g4[K/4] int32 = -off * (sum of 4 consecutive q),
 *   dxe[K/32 * 8] float = the block's scale repeated 8 times (one ymm per block);
 * K-quants: q[K], dk[K/256] float, bsum16[K/16] int16, bsum32[K/32] int16. */
typedef struct {
    int64_t M, K;
    int8_t *q;
    int32_t *g4;
    float *dx;
    int16_t *bs16, *bs32;
    float *xs;          /* dotkv_vnni: d_x * the 16-element group sums (quantise256v) */
} act8;

static __thread void *abuf;
static __thread size_t abuf_size;

static void *scratch(size_t bytes) { return scratch_grow(&abuf, &abuf_size, bytes); }

/* nb blocks of B (a multiple of 32) floats: d[b] = max|x| / 127 and q = x . (127 / max|x|)
 * rounded to nearest even, vectorised. The scalar loop (nearbyintf and fmaxf per element) cost
 * ~2.8 ns per element, ~23 us per row of K = 8192: a few percent of a batch-1 step and more
 * at batch 8 (every row is quantised once per GEMM call, on one thread). The values are
 * the same: max is exact in any order, the product is the same one multiply, and
 * vcvtps2dq rounds to nearest even as nearbyintf does in the default rounding mode
 * (|x . id| <= 127, so the narrowing never saturates). */
static __attribute__((target("avx512f,avx512bw,avx512vl"))) void qblocks512(
        const float *x, int64_t nb, int B, int8_t *q, float *d) {
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + (int64_t)B * b;
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < B; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
        const float amax = _mm512_reduce_max_ps(m);
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax / 127.f;
        const __m512 iv = _mm512_set1_ps(id);
        for (int i = 0; i < B; i += 16)
            _mm_storeu_si128((__m128i *)(q + (int64_t)B * b + i), _mm512_cvtsepi32_epi8(
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), iv))));
    }
}

static void qblocks256(const float *x, int64_t nb, int B, int8_t *q, float *d) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + (int64_t)B * b;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < B; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + i), absm));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = amax / 127.f;
        const __m256 iv = _mm256_set1_ps(id);
        for (int i = 0; i < B; i += 32) {
            __m256i c[4];
            for (int u = 0; u < 4; u++)
                c[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * u), iv));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                                 _mm256_packs_epi32(c[2], c[3]));
            _mm256_storeu_si256((__m256i *)(q + (int64_t)B * b + i), _mm256_permutevar8x32_epi32(p, order));
        }
    }
}

/* a second thread-local buffer: one row quantised in memory order, before a kernel's own order */
static __thread void *tbuf;
static __thread size_t tbuf_size;

static void *tscratch(size_t bytes) { return scratch_grow(&tbuf, &tbuf_size, bytes); }

/* qblocks for one row of K floats (d: K / B floats) */
static void qrow(const float *x, int64_t K, int B, int8_t *q, float *d) {
    if (iterserve_st.int8 == 2) qblocks512(x, K / B, B, q, d);
    else qblocks256(x, K / B, B, q, d);
}

/* Q8_0-style quantisation of M rows in blocks of 32; shift >= 0: g4 with off = 1 << shift;
 * SUMS: g4's place holds d_x * (sum of 4) as floats (Q4_1 / Q5_1's min term); else none. */
#define SUMS (-2)
static int quantise32(const float *x, int64_t M, int64_t ldx, int64_t K, int shift, act8 *a) {
    const int64_t nb = K / 32;
    const size_t qb = (size_t)(M * K), gb = (size_t)(M * K), db = (size_t)(M * nb * 8 * 4);
    uint8_t *p = scratch(qb + gb + db + 192);
    if (!p) return ITERSERVE_ENOMEM;
    a->M = M, a->K = K;
    a->g4 = (int32_t *)p;
    a->dx = (float *)(p + gb);
    a->q = (int8_t *)(p + gb + db);
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * ldx;
        int8_t *q = a->q + r * K;
        int32_t *g = a->g4 + r * (K / 4);
        float *dx = a->dx + r * nb * 8;
        qrow(xr, K, 32, q, dx);                   /* d[b] at dx[b], spread to 8 below */
        for (int64_t b = nb - 1; b >= 0; b--) {   /* downwards: dx[b] is read before dx[8b..] */
            const float d = dx[b];
            for (int i = 0; i < 8; i++) dx[8 * b + i] = d;
            if (shift >= 0)
                for (int i = 0; i < 8; i++) {
                    const int8_t *s = q + 32 * b + 4 * i;
                    g[8 * b + i] = -((s[0] + s[1] + s[2] + s[3]) * (1 << shift));
                }
            else if (shift == SUMS)               /* Q4_1 / Q5_1: d_x * sums of 4, float */
                for (int i = 0; i < 8; i++) {
                    const int8_t *s = q + 32 * b + 4 * i;
                    const float v = d * (float)(s[0] + s[1] + s[2] + s[3]);
                    memcpy(g + 8 * b + i, &v, 4);
                }
        }
    }
    return ITERSERVE_OK;
}

/* Q8_K-style quantisation in blocks of 256 (one scale each) with 16- and 32-element sums. */
static int quantise256(const float *x, int64_t M, int64_t ldx, int64_t K, act8 *a) {
    const int64_t nb = K / 256;
    const size_t qb = (size_t)(M * K), db = (size_t)(M * nb * 4);
    const size_t b16 = (size_t)(M * K / 16 * 2), b32 = (size_t)(M * K / 32 * 2);
    uint8_t *p = scratch(qb + db + b16 + b32 + 256);
    if (!p) return ITERSERVE_ENOMEM;
    a->M = M, a->K = K;
    a->q = (int8_t *)p;
    a->dx = (float *)(p + qb);
    a->bs16 = (int16_t *)(p + qb + db);
    a->bs32 = (int16_t *)(p + qb + db + b16);
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * ldx;
        int8_t *q = a->q + r * K;
        qrow(xr, K, 256, q, a->dx + r * nb);
        for (int64_t b = 0; b < nb; b++) {
            for (int j = 0; j < 16; j++) {
                int s = 0;
                for (int i = 0; i < 16; i++) s += q[256 * b + 16 * j + i];
                a->bs16[(r * nb + b) * 16 + j] = (int16_t)s;
            }
            for (int j = 0; j < 8; j++)
                a->bs32[(r * nb + b) * 8 + j] = (int16_t)(a->bs16[(r * nb + b) * 16 + 2 * j]
                                                          + a->bs16[(r * nb + b) * 16 + 2 * j + 1]);
        }
    }
    return ITERSERVE_OK;
}

/* ---- reductions ---------------------------------------------------------------------------- */
static inline float hsum8f(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum4f(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}


/* ---- AVX2 kernels: one weight row (column n) by R <= 4 activation rows ----------------- */
/* Geometry of the 32-element types: block bytes, where the 16 nibble bytes start. */
static inline int bb32(int type) {
    return type == GGML_Q8_0 ? 34 : type == GGML_Q4_0 || type == GGML_IQ4_NL ? 18
         : type == GGML_MXFP4 ? 17 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : 24;
}
static inline int qs32(int type) {
    return type == GGML_Q4_0 || type == GGML_IQ4_NL ? 2 : type == GGML_MXFP4 ? 1
         : type == GGML_Q4_1 ? 4 : type == GGML_Q5_0 ? 6 : 8;
}
/* The codebook types (IQ4_NL, MXFP4): a nibble indexes 16 signed values, which the 4-block
 * kernel shuffles in as unsigned bytes (value + CB_OFF) with -CB_OFF * sums in g4; MXFP4's
 * E8M0 scales are gathered as bytes and widened by exponent arithmetic. Only with VBMI (the
 * others fall back to the float kernels). One row of 23040 x 2880, one thread, best of 6
 * alternating rounds (weights 35-40 MB): int8 / float 11.3 / 8.4 GB/s MXFP4, 13.1 / 8.6
 * IQ4_NL, against Q4_0's 14.0 / 8.6 in the same run. */
static inline int is_cb(int type) { return type == GGML_IQ4_NL || type == GGML_MXFP4; }
static inline int cb_off(int type) { return type == GGML_MXFP4 ? 16 : 128; }
static inline int has_min(int type) { return type == GGML_Q4_1 || type == GGML_Q5_1; }
static inline int is_q5(int type) { return type == GGML_Q5_0 || type == GGML_Q5_1; }

/* 32 bits -> 32 bytes, 0xFF where the bit is set (llama.cpp's bytes_from_bits_32) */
static inline __m256i bits_to_bytes(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    const __m256i b = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf),
                                      _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

/* One block's 32 codes as bytes (unsigned; Q8_0: its signed values). */
static inline __attribute__((always_inline)) __m256i codes32(int type, const uint8_t *blk) {
    if (type == GGML_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + qs32(type)));
    __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    if (is_q5(type))
        w = _mm256_or_si256(w, _mm256_and_si256(bits_to_bytes(blk + (type == GGML_Q5_0 ? 2 : 4)),
                                                _mm256_set1_epi8(0x10)));
    return w;
}

/* 32-element types over blocks [b0, b1): per block and row, the integer dot of the codes
 * with the quantised row (+ g4: -offset * sums of 4), times d_w * d_x; Q4_1 / Q5_1 add
 * m_w * (d_x * sums of 4) (`sx4`, kept in g4's place). */
static inline __attribute__((always_inline)) void dot32_avx2(
        int R, int type, const act8 *a, int64_t r0, int64_t b0, int64_t b1,
        const uint8_t *wrow, float *out) {
    const int bb = bb32(type);
    const int64_t K = a->K, nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = wrow + b * bb;
        const __m256 dw = _mm256_set1_ps(f16(blk));
        const __m256i w = codes32(type, blk);
        const __m256i aw = type == GGML_Q8_0 ? _mm256_sign_epi8(w, w) : w;
        const __m256 mw = has_min(type) ? _mm256_set1_ps(f16(blk + 2)) : dw;
        for (int r = 0; r < R; r++) {
            const int64_t rr = r0 + r;
            __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + rr * K + 32 * b));
            if (type == GGML_Q8_0) x = _mm256_sign_epi8(x, w);
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones);
            const int32_t *g = a->g4 + rr * (K / 4) + 8 * b;
            if (type == GGML_Q4_0 || type == GGML_Q5_0)
                p = _mm256_add_epi32(p, _mm256_loadu_si256((const __m256i *)g));
            const __m256 s = _mm256_mul_ps(dw, _mm256_loadu_ps(a->dx + (rr * nb + b) * 8));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r]);
            if (has_min(type))
                acc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps((const float *)g), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8f(acc[r]);
}

/* shuffle masks broadcasting int16 lane j of a 128-bit half to all 8 lanes */
static inline __m256i bcast16_mask(int j) {
    return _mm256_set1_epi16((short)((2 * j) | ((2 * j + 1) << 8)));
}
/* lanes 0-7 <- int16 lane 2i, lanes 8-15 <- lane 2i+1 of each 128-bit half (Q6_K) */
static inline __m256i pair16_mask(int i) {
    const short lo = (short)((4 * i) | ((4 * i + 1) << 8)), hi = (short)((4 * i + 2) | ((4 * i + 3) << 8));
    return _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi);
}

/* ---- AVX-512 VNNI kernels ---------------------------------------------------------------- */
static inline VNNI float hsum16f(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline __attribute__((always_inline)) VNNI void dot32_vnni(
        int R, int type, const act8 *a, int64_t r0, int64_t b0, int64_t b1,
        const uint8_t *wrow, float *out) {
    const int bb = bb32(type);
    const int64_t K = a->K, nb = K / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F), x80 = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROW_TILE];
    __m256 acc1[ROW_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), acc1[r] = _mm256_setzero_ps();
    int64_t b = b0;
    for (; b + 1 < b1; b += 2) {                  /* two blocks per zmm */
        const uint8_t *blk = wrow + b * bb;
        const __m512 dw = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_castps256_ps512(_mm256_set1_ps(f16(blk)))),
            _mm256_castps_pd(_mm256_set1_ps(f16(blk + bb))), 1));
        __m512 mw = dw;
        if (has_min(type))
            mw = _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castps_pd(_mm512_castps256_ps512(_mm256_set1_ps(f16(blk + 2)))),
                _mm256_castps_pd(_mm256_set1_ps(f16(blk + bb + 2))), 1));
        __m512i w;
        if (type == GGML_Q8_0) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(blk + bb + 2));
            w = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1), x80);
        } else {
            const int qo = qs32(type);
            const __m256i t = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(blk + bb + qo)),
                                               _mm_loadu_si128((const __m128i *)(blk + qo)));
            const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
            /* [q0, q1, q0>>4, q1>>4] -> [q0, q0>>4, q1, q1>>4] */
            w = _mm512_and_si512(_mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0)), m4);
            if (is_q5(type)) {                    /* bit i of qh -> 16 in byte i */
                const int ho = type == GGML_Q5_0 ? 2 : 4;
                uint32_t h0, h1;
                memcpy(&h0, blk + ho, 4);
                memcpy(&h1, blk + bb + ho, 4);
                w = _mm512_or_si512(w, _mm512_maskz_mov_epi8(
                    (__mmask64)h0 | (__mmask64)h1 << 32, _mm512_set1_epi8(0x10)));
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t rr = r0 + r;
            const void *g = a->g4 + rr * (K / 4) + 8 * b;
            __m512i p = has_min(type) ? _mm512_setzero_si512() : _mm512_loadu_si512(g);
            p = _mm512_dpbusd_epi32(p, w, _mm512_loadu_si512((const void *)(a->q + rr * K + 32 * b)));
            const __m512 s = _mm512_mul_ps(dw, _mm512_loadu_ps(a->dx + (rr * nb + b) * 8));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[r]);
            if (has_min(type))
                acc[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps((const float *)g), acc[r]);
        }
    }
    for (; b < b1; b++) {                         /* an odd last block: 256-bit VNNI */
        const uint8_t *blk = wrow + b * bb;
        const __m256 dw = _mm256_set1_ps(f16(blk));
        const __m256 mw = has_min(type) ? _mm256_set1_ps(f16(blk + 2)) : dw;
        __m256i w = codes32(type, blk);
        if (type == GGML_Q8_0) w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        for (int r = 0; r < R; r++) {
            const int64_t rr = r0 + r;
            const int32_t *g = a->g4 + rr * (K / 4) + 8 * b;
            __m256i p = has_min(type) ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)g);
            p = _mm256_dpbusd_epi32(p, w, _mm256_loadu_si256((const __m256i *)(a->q + rr * K + 32 * b)));
            const __m256 s = _mm256_mul_ps(dw, _mm256_loadu_ps(a->dx + (rr * nb + b) * 8));
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc1[r]);
            if (has_min(type))
                acc1[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps((const float *)g), acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum16f(acc[r]) + hsum8f(acc1[r]);
}

/* ---- the driver ---------------------------------------------------------------------------- */

int iterserve_can_act8(int64_t type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_0 || type == GGML_Q5_1
        || type == GGML_Q8_0 || type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K
        || ((type == GGML_IQ4_NL || type == GGML_MXFP4) && iterserve_st.vbmi);   /* run_vbmi */
}

static inline int is_kq(int64_t type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
}

#define CALL(R, FN, TYPE) FN(R, TYPE, &a, r0, b0, b1, wn, o)
#define TILE(FN, TYPE)                                                                    \
    switch (R) {                                                                          \
    case 4: CALL(4, FN, TYPE); break;                                                     \
    case 3: CALL(3, FN, TYPE); break;                                                     \
    case 2: CALL(2, FN, TYPE); break;                                                     \
    default: CALL(1, FN, TYPE); break;                                                    \
    }

/* K chunks of the K-quant decode kernels: a chunk keeps a row tile's quantised activations
 * (292 bytes per super-block and row) near L1, but breaks the weight stream into pieces of a
 * row (column c's chunk is followed by column c + 1's, a row_stride away). Measured on the
 * down GEMM (2048x8192, one thread, CPU time, weights cold, same process, alternating;
 * kq-variants-down.json), 16 KB time / this time at 2 3 4 5 6 8 12 rows:
 *   Q4_K  32 KB: 2.34 1.31 1.12 1.47 1.03 1.06 1.12   64 KB: 2.34 1.22 0.95 1.42 1.04 0.98 0.98
 *   Q6_K  32 KB: 3.27 2.33 1.01 2.26 1.70 0.91 1.01   64 KB: 3.50 2.36 1.33 2.25 1.83 1.29 1.15
 * Hence 32 KB for Q4_K / Q5_K and 64 KB (one chunk up to K = 14336 at 4 rows) for Q6_K. */
static inline int64_t kq_chunk(int type, int64_t R, int64_t per_block) {
    const int64_t bytes = (type == GGML_Q6_K ? 64 : 32) * 1024;
    const int64_t kc = bytes / (R * per_block);
    return kc < 2 ? 2 : kc;
}

static void run_avx2(int type, const act8 *ap, const uint8_t *w, int64_t n, int64_t row_stride,
                     float *y, int64_t ldy, int nthreads) {
    const act8 a = *ap;
    const int64_t M = a.M, ntiles = (M + ROW_TILE - 1) / ROW_TILE;
    const int64_t nb = a.K / 32;
    const int64_t per_block = 32 + 32 + 32;                            /* activation bytes */
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = n * t / T, n1 = n * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                int64_t kc = A_TILE_BYTES / (ROW_TILE * per_block);
                if (kc < 1) kc = 1;
                const int64_t nk = (nb + kc - 1) / kc;
                for (int64_t kchunk = 0; kchunk < nk; kchunk++) {
                    const int64_t b0 = nb * kchunk / nk, b1 = nb * (kchunk + 1) / nk;
                    for (int64_t c = c0; c < c1; c++) {
                        const uint8_t *wn = w + c * row_stride;
                        float o[ROW_TILE] = {0};
                        switch (type) {
                        case GGML_Q4_0: TILE(dot32_avx2, GGML_Q4_0) break;
                        case GGML_Q4_1: TILE(dot32_avx2, GGML_Q4_1) break;
                        case GGML_Q5_0: TILE(dot32_avx2, GGML_Q5_0) break;
                        case GGML_Q5_1: TILE(dot32_avx2, GGML_Q5_1) break;
                        default: TILE(dot32_avx2, GGML_Q8_0) break;
                        }
                        for (int r = 0; r < R; r++) {
                            float *yy = y + (r0 + r) * ldy + c;
                            *yy = kchunk ? *yy + o[r] : o[r];
                        }
                    }
                }
            }
        }
    }
}

static VNNI void run_vnni(int type, const act8 *ap, const uint8_t *w, int64_t n,
                          int64_t row_stride, float *y, int64_t ldy, int nthreads) {
    const act8 a = *ap;
    const int64_t M = a.M, ntiles = (M + ROW_TILE - 1) / ROW_TILE;
    const int64_t nb = a.K / 32;
    const int64_t per_block = 32 + 32 + 32;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = n * t / T, n1 = n * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                int64_t kc = A_TILE_BYTES / (ROW_TILE * per_block);
                if (kc < 2) kc = 2;
                kc &= ~(int64_t)1;                   /* pairs of blocks per zmm */
                const int64_t nk = (nb + kc - 1) / kc;
                for (int64_t kchunk = 0; kchunk < nk; kchunk++) {
                    int64_t b0 = nb * kchunk / nk, b1 = nb * (kchunk + 1) / nk;
                    b0 &= ~(int64_t)1;                 /* even chunk starts */
                    if (kchunk + 1 < nk) b1 &= ~(int64_t)1;
                    for (int64_t c = c0; c < c1; c++) {
                        const uint8_t *wn = w + c * row_stride;
                        float o[ROW_TILE] = {0};
                        switch (type) {
                        case GGML_Q4_0: TILE(dot32_vnni, GGML_Q4_0) break;
                        case GGML_Q4_1: TILE(dot32_vnni, GGML_Q4_1) break;
                        case GGML_Q5_0: TILE(dot32_vnni, GGML_Q5_0) break;
                        case GGML_Q5_1: TILE(dot32_vnni, GGML_Q5_1) break;
                        default: TILE(dot32_vnni, GGML_Q8_0) break;
                        }
                        for (int r = 0; r < R; r++) {
                            float *yy = y + (r0 + r) * ldy + c;
                            *yy = kchunk ? *yy + o[r] : o[r];
                        }
                    }
                }
            }
        }
    }
}


/* ---- K-quant decode, all rows of a step over one decode of the weights -------------------
 * Decoding a super-block once per row tile of 4-6 rows and then spending ~19 instructions per
 * super-block and row on top of the 8 integer ones (the min / offset term in a register of
 * its own, d_min * d_x and d * d_x formed in scalar code and broadcast per row, two converts
 * and two FMAs) ran Q4_K at 9.1 GB/s of ~40 in a quiet batch-8 profile. dotkw_avx2 (AVX2)
 * decodes a super-block once for all rows of the call (tiles of up to KQW_TILE): the decoded super-block (8 code + 8 scale ymm)
 * goes to a stack scratch (L1) and the rows run over it 4 at a time (a code vector loaded
 * once per 4 rows); per row one accumulator and one tail, v = d . float(isum) [+ -d_min .
 * float(mins term)], acc += v . d_x, with d, d_min broadcast once per super-block; and
 * Q6_K's offset (-32 per code, scale -32 d) folded into the integer sum (isum starts at -32
 * sum_j sc_j bsum16_j, one vpmaddwd). AVX-512: dotkv_vnni below. */
#define KQW_TILE 12

static inline __attribute__((always_inline)) void dotkw_avx2(
        int R, int type, const act8 *a, int64_t r0, int64_t b0, int64_t b1,
        const uint8_t *wrow, int64_t pf, float *out) {
    const int bb = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210;
    const int64_t K = a->K, nb = K / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[KQW_TILE];
    __m256i wv[8], sv[8];                     /* the decoded super-block: codes, scales */
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = wrow + b * bb;
        if (pf)
            for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)blk + pf + l, _MM_HINT_T0);
        __m256 dv, cv = _mm256_setzero_ps();
        __m128i mins = _mm_setzero_si128();
        __m256i sc16m = _mm256_setzero_si256();
        if (type == GGML_Q4_K || type == GGML_Q5_K) {
            uint32_t u[4];
            q4k_scales(blk + 4, u);
            dv = _mm256_set1_ps(f16(blk)), cv = _mm256_set1_ps(-f16(blk + 2));
            const int qo = type == GGML_Q5_K ? 48 : 16;
            const __m256i qh = type == GGML_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                                 : _mm256_setzero_si256();
            const __m256i one = _mm256_set1_epi8(1);
            const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
            const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(ms));
            mins = _mm256_extracti128_si256(ms, 1);
            _Pragma("GCC unroll 16")
            for (int p = 0; p < 4; p++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qo + 32 * p));
                __m256i wl = _mm256_and_si256(raw, m4);
                __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                if (type == GGML_Q5_K) {
                    wl = _mm256_or_si256(wl, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
                    wh = _mm256_or_si256(wh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
                }
                wv[2 * p] = wl, wv[2 * p + 1] = wh;
                sv[2 * p] = _mm256_shuffle_epi8(sc, bcast16_mask(2 * p));
                sv[2 * p + 1] = _mm256_shuffle_epi8(sc, bcast16_mask(2 * p + 1));
            }
        } else {                                   /* Q6_K */
            dv = _mm256_set1_ps(f16(blk + 208));
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            sc16m = _mm256_slli_epi16(_mm256_sub_epi16(_mm256_setzero_si256(), sc16), 5);
            const __m256i sclo = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16));
            const __m256i schi = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(sc16, 1));
            for (int h = 0; h < 2; h++) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                for (int g = 0; g < 4; g++) {
                    const __m256i lo = g < 2 ? _mm256_and_si256(g == 0 ? l0 : l1, m4)
                        : _mm256_and_si256(_mm256_srli_epi16(g == 2 ? l0 : l1, 4), m4);
                    const __m256i hi = _mm256_and_si256(
                        g == 0 ? _mm256_slli_epi16(qh, 4) : g == 1 ? _mm256_slli_epi16(qh, 2)
                        : g == 2 ? qh : _mm256_srli_epi16(qh, 2), m30);
                    const int j = 4 * h + g;
                    wv[j] = _mm256_or_si256(lo, hi);
                    sv[j] = _mm256_shuffle_epi8(j < 4 ? sclo : schi, pair16_mask(j % 4));
                }
            }
        }
        _Pragma("GCC unroll 16")
        for (int q0 = 0; q0 < R; q0 += 4) {       /* rows 4 at a time over the decoded block */
            const int Q = R - q0 < 4 ? R - q0 : 4;
            __m256i isum[4];
            _Pragma("GCC unroll 16")
            for (int r = 0; r < Q; r++) {
                const int64_t rb = (r0 + q0 + r) * nb + b;
                isum[r] = type == GGML_Q6_K
                    ? _mm256_madd_epi16(sc16m, _mm256_loadu_si256((const __m256i *)(a->bs16 + rb * 16)))
                    : _mm256_setzero_si256();
            }
            _Pragma("GCC unroll 16")
            for (int j = 0; j < 8; j++) {
                const __m256i wj = wv[j];
                _Pragma("GCC unroll 16")
                for (int r = 0; r < Q; r++) {
                    const __m256i x = _mm256_loadu_si256(
                        (const __m256i *)(a->q + (r0 + q0 + r) * K + 256 * b + 32 * j));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wj, x), sv[j]));
                }
            }
            _Pragma("GCC unroll 16")
            for (int r = 0; r < Q; r++) {
                const int64_t rb = (r0 + q0 + r) * nb + b;
                __m256 v = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(isum[r]));
                if (type != GGML_Q6_K) {
                    const __m128i mt = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)(a->bs32 + rb * 8)));
                    v = _mm256_fmadd_ps(cv, _mm256_zextps128_ps256(_mm_cvtepi32_ps(mt)), v);
                }
                acc[q0 + r] = _mm256_fmadd_ps(v, _mm256_set1_ps(a->dx[rb]), acc[q0 + r]);
            }
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) out[r] = hsum8f(acc[r]);
}

/* ---- AVX-512 VNNI K-quant decode on vpdpbusd, lanes = 16-element groups ------------------
 * A row-tile kernel on vpmaddubsw + vpdpwssd spends two multiply-class instructions per 64 weights and row (vpmaddubsw,
 * then vpdpwssd with the sub-block scales), and at 4-12 rows that is what they are bound by:
 * Q4_K 2048x2048 at 8 rows took ~60 cycles per super-block and column, ~7.5 per row, the
 * throughput of 8 such instructions. Here a super-block is seen as 16 groups of 16 elements
 * (Q4_K / Q5_K: halves of their 8 sub-blocks; Q6_K: its 16 sub-blocks), and int32 lane j of
 * every vector belongs to one group g(j) = 4 (j % 4) + j / 4 (the order a 4x4 in-lane dword
 * transpose of the decoded codes gives, so the weights need no further permute):
 *   - the activations are quantised into that order (per super-block and row, load d of the
 *     4 holds, in lane j, elements 4d..4d+3 of group g(j)), with the group sums times d_x as
 *     floats (xs), once per call;
 *   - a super-block's codes are decoded once per column as before (4 zmm, memory order), then
 *     transposed (8 unpacks); its per-lane scales d . sc and offsets (-d_min . m, Q6_K -32 d
 *     . sc) become two float vectors;
 *   - per row: 4 vpdpbusd accumulate the whole super-block with no scale in between (a lane
 *     stays in one group), then one convert, acc += (float(isum) . d_x) . dsc + xs . off:
 *     4 multiply-class integer instructions and 8 in all, against 8 and ~14.
 * Tiles of up to KQW_TILE (12) rows over one decode: 12 accumulators + 4 codes + 2 scale
 * vectors fit the 32 zmm. Measured: see KQ_PF below. */
static const int8_t kqv_group[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* Q8_K-style quantisation as quantise256 (same rounding, same dx), in the lane order above,
 * with xs[(r * nb + b) * 16 + j] = d_x * (sum of group g(j)'s 16 quantised activations). */
static int quantise256v(const float *x, int64_t M, int64_t ldx, int64_t K, act8 *a) {
    const int64_t nb = K / 256;
    const size_t qb = (size_t)(M * K), db = (size_t)(M * nb * 4), xb = (size_t)(M * nb * 16 * 4);
    uint8_t *p = scratch(qb + db + xb + 256);
    if (!p) return ITERSERVE_ENOMEM;
    a->M = M, a->K = K;
    a->xs = (float *)p;
    a->dx = (float *)(p + xb);
    a->q = (int8_t *)(p + xb + db);
    a->bs16 = a->bs32 = NULL;
    int8_t *t = tscratch((size_t)K);
    if (!t) return ITERSERVE_ENOMEM;
    for (int64_t r = 0; r < M; r++) {
        qrow(x + r * ldx, K, 256, t, a->dx + r * nb);
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *tv = t + 256 * b;
            int8_t *q = a->q + r * K + 256 * b;
            const float d = a->dx[r * nb + b];
            for (int j = 0; j < 16; j++) {
                const int g = kqv_group[j];
                int s = 0;
                for (int e = 0; e < 16; e++) {
                    const int8_t v = tv[16 * g + e];
                    q[64 * (e / 4) + 4 * j + e % 4] = v;
                    s += v;
                }
                a->xs[(r * nb + b) * 16 + j] = d * (float)s;
            }
        }
    }
    return ITERSERVE_OK;
}

static inline __attribute__((always_inline)) VNNI void dotkv_vnni(
        int R, int type, const act8 *a, int64_t r0, int64_t b0, int64_t b1,
        const uint8_t *wrow, int64_t pf, float *out) {
    const int bb = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210;
    const int64_t K = a->K, nb = K / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    /* byte j of the lane-order scale vectors: the sub-block of group g(j) (Q4_K / Q5_K) */
    const __m128i sub = _mm_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7);
    const __m128i grp = _mm_loadu_si128((const __m128i *)kqv_group);
    __m512 acc[KQW_TILE];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = wrow + b * bb;
        if (pf)                   /* the same super-block pf bytes on (kq_pf columns ahead) */
            for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)blk + pf + l, _MM_HINT_T0);
        __m512i w[4];
        __m512 dsc, off;
        if (type == GGML_Q4_K || type == GGML_Q5_K) {
            uint32_t u[4];
            q4k_scales(blk + 4, u);
            const __m512 d = _mm512_set1_ps(f16(blk)), dmin = _mm512_set1_ps(-f16(blk + 2));
            const __m128i sm = _mm_set_epi32(u[3], u[2], u[1], u[0]);   /* 8 scales, 8 mins */
            const __m128i sj = _mm_shuffle_epi8(sm, sub);
            const __m128i mj = _mm_shuffle_epi8(sm, _mm_add_epi8(sub, _mm_set1_epi8(8)));
            dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sj)));
            off = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mj)));
            const int qo = type == GGML_Q5_K ? 48 : 16;
            const __m256i qh = type == GGML_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                                 : _mm256_setzero_si256();
            const __m256i one = _mm256_set1_epi8(1);
            _Pragma("GCC unroll 4")
            for (int p = 0; p < 4; p++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qo + 32 * p));
                w[p] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw),
                                                           _mm256_srli_epi16(raw, 4), 1), m4);
                if (type == GGML_Q5_K) {
                    const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4);
                    const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4);
                    w[p] = _mm512_or_si512(w[p], _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1));
                }
            }
        } else {                                   /* Q6_K: group g is sub-block g */
            const __m512 d = _mm512_set1_ps(f16(blk + 208));
            const __m128i sj = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 192)), grp);
            dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sj)));
            off = _mm512_mul_ps(_mm512_set1_ps(-32.f), dsc);
            _Pragma("GCC unroll 4")
            for (int p = 0; p < 4; p++) {
                const int h = p / 2, g = 2 * (p % 2);
                const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * h));
                const __m512i lo = _mm512_and_si512(g ? _mm512_srli_epi16(l, 4) : l, m4);
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                const __m256i h0 = g ? qh : _mm256_slli_epi16(qh, 4);
                const __m256i h1 = g ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 2);
                w[p] = _mm512_or_si512(lo, _mm512_and_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1), m30));
            }
        }
        /* w[a] dword 4c + e (elements 4e.. of group 4a + c) -> t[e] dword 4c + a */
        const __m512i t0 = _mm512_unpacklo_epi32(w[0], w[1]), t1 = _mm512_unpackhi_epi32(w[0], w[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(w[2], w[3]), t3 = _mm512_unpackhi_epi32(w[2], w[3]);
        const __m512i v0 = _mm512_unpacklo_epi64(t0, t2), v1 = _mm512_unpackhi_epi64(t0, t2);
        const __m512i v2 = _mm512_unpacklo_epi64(t1, t3), v3 = _mm512_unpackhi_epi64(t1, t3);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            const int64_t rb = (r0 + r) * nb + b;
            const int8_t *xq = a->q + (r0 + r) * K + 256 * b;
            __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v0,
                                               _mm512_loadu_si512((const void *)xq));
            isum = _mm512_dpbusd_epi32(isum, v1, _mm512_loadu_si512((const void *)(xq + 64)));
            isum = _mm512_dpbusd_epi32(isum, v2, _mm512_loadu_si512((const void *)(xq + 128)));
            isum = _mm512_dpbusd_epi32(isum, v3, _mm512_loadu_si512((const void *)(xq + 192)));
            const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(a->dx[rb]));
            acc[r] = _mm512_fmadd_ps(v, dsc, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(a->xs + rb * 16), off, acc[r]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) out[r] = hsum16f(acc[r]);
}

/* ---- AVX-512 VNNI, one Q4_K / Q5_K row ---------------------------------------------------
 * Batch-1 decode of a Q4_K_M model is ~75% Q4_K GEMMs, and a row-tile kernel ran them at
 * ~20 GB/s per thread hot and cold alike (bench_kq_decode.py --rows 1: bound by instructions,
 * while one thread can read ~34 GB/s and two ~40), so two threads read ~30 of the ~40 GB/s.
 * This kernel does the same integer arithmetic (codes x int8 activations in vpmaddubsw, the
 * sub-block scales in vpdpwssd, one float multiply per super-block) with fewer instructions
 * per super-block:
 *   - the codes are read 64 bytes at a time: and / shift / and give two zmm, each holding
 *     two 32-element sub-blocks (low nibbles: sub-blocks 2j and 2j + 2, high: 2j + 1 and
 *     2j + 3), so no 256-bit inserts; the activations are quantised in that order once per
 *     call (quantise256p: chunks of 32 in the order 0 2 1 3 4 6 5 7);
 *   - the 12 packed scale bytes are decoded in SSE registers (two vpshufb, shifts, masks:
 *     q4k_scales_v) instead of scalar code and four GPR-to-vector inserts;
 *   - d and d_min are converted together (one vcvtph2ps) and times d_x in one multiply.
 * Same rounding as quantise256, so the result equals dotkv_vnni's up to float summation order.
 * Measured: see KQ_PF below. */
static const uint8_t kq1_src[8] = {0, 2, 1, 3, 4, 6, 5, 7};   /* quantised chunk i <- x chunk */

static int quantise256p(const float *x, int64_t M, int64_t ldx, int64_t K, act8 *a) {
    const int rc = quantise256(x, M, ldx, K, a);
    if (rc) return rc;
    int8_t tmp[256];
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K / 256; b++) {
            int8_t *q = a->q + r * K + 256 * b;
            memcpy(tmp, q, 256);
            for (int i = 0; i < 8; i++) memcpy(q + 32 * i, tmp + 32 * kq1_src[i], 32);
        }
    return ITERSERVE_OK;
}

/* q4k_scales in SSE: bytes 0-7 the 8 scales, 8-15 the 8 mins (reads 16 bytes from s12). */
static inline __attribute__((always_inline)) VNNI __m128i q4k_scales_v(const uint8_t *s12) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)s12);
    /* A = [s0-3, s8-11, s4-7, s8-11], B = [0, s0-3, 0, s4-7] */
    const __m128i A = _mm_shuffle_epi8(raw, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i B = _mm_shuffle_epi8(raw, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i lo = _mm_and_si128(A, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(A, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(B, 2), _mm_set1_epi8(0x30));
    return _mm_or_si128(_mm_or_si128(lo, hi), top);
}

static inline __attribute__((always_inline)) VNNI float dotk1_vnni(
        int type, const act8 *a, int64_t b0, int64_t b1, const uint8_t *wrow, int64_t pf) {
    const int bb = type == GGML_Q4_K ? 144 : 176, qo = type == GGML_Q4_K ? 16 : 48;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    /* int16 lanes of the four code vectors -> their sub-block (L0, H0, L1, H1) */
    const __m512i i0 = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0, 0, 0, 0);
    const __m512i i1 = _mm512_add_epi16(i0, _mm512_set1_epi16(1));
    const __m512i i2 = _mm512_add_epi16(i0, _mm512_set1_epi16(4));
    const __m512i i3 = _mm512_add_epi16(i0, _mm512_set1_epi16(5));
    /* Q5_K: the qh bit of each code vector's two halves moved to bit 4 (left / right) */
    const __m512i hl0 = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), hl1 = _mm512_set_epi64(1, 1, 1, 1, 3, 3, 3, 3);
    const __m512i hr2 = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0), hr3 = _mm512_set_epi64(3, 3, 3, 3, 1, 1, 1, 1);
    const int8_t *xq = a->q;
    __m512 acc = _mm512_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = wrow + b * bb;
        if (pf)
            for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)blk + pf + l, _MM_HINT_T0);
        const int8_t *xb = xq + 256 * b;
        const __m128i sm = q4k_scales_v(blk + 4);
        const __m256i s16 = _mm256_cvtepu8_epi16(sm);          /* scales 0-7, mins 8-15 */
        const __m512i sc = _mm512_castsi256_si512(s16);
        const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_loadu_si32(blk)),
                                     _mm_set1_ps(a->dx[b]));   /* d . d_x, d_min . d_x */
        const __m512i v0 = _mm512_loadu_si512((const void *)(blk + qo));
        const __m512i v1 = _mm512_loadu_si512((const void *)(blk + qo + 64));
        __m512i L0 = _mm512_and_si512(v0, m4), H0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
        __m512i L1 = _mm512_and_si512(v1, m4), H1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
        if (type == GGML_Q5_K) {
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
            L0 = _mm512_or_si512(L0, _mm512_and_si512(_mm512_sllv_epi64(qh, hl0), m10));
            H0 = _mm512_or_si512(H0, _mm512_and_si512(_mm512_sllv_epi64(qh, hl1), m10));
            L1 = _mm512_or_si512(L1, _mm512_and_si512(_mm512_srlv_epi64(qh, hr2), m10));
            H1 = _mm512_or_si512(H1, _mm512_and_si512(_mm512_srlv_epi64(qh, hr3), m10));
        }
        __m512i isum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(
            L0, _mm512_loadu_si512((const void *)xb)), _mm512_permutexvar_epi16(i0, sc));
        __m512i isum2 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(
            H0, _mm512_loadu_si512((const void *)(xb + 64))), _mm512_permutexvar_epi16(i1, sc));
        isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(
            L1, _mm512_loadu_si512((const void *)(xb + 128))), _mm512_permutexvar_epi16(i2, sc));
        isum2 = _mm512_dpwssd_epi32(isum2, _mm512_maddubs_epi16(
            H1, _mm512_loadu_si512((const void *)(xb + 192))), _mm512_permutexvar_epi16(i3, sc));
        acc = _mm512_fmadd_ps(_mm512_broadcastss_ps(dd), _mm512_cvtepi32_ps(_mm512_add_epi32(isum, isum2)), acc);
        const __m128i mt = _mm_madd_epi16(_mm256_extracti128_si256(s16, 1),
                                          _mm_loadu_si128((const __m128i *)(a->bs32 + 8 * b)));
        accm = _mm_fnmadd_ps(_mm_permute_ps(dd, _MM_SHUFFLE(1, 1, 1, 1)), _mm_cvtepi32_ps(mt), accm);
    }
    return hsum16f(acc) + hsum4f(accm);
}

/* The column loop for one row: threads split the columns, each column's row whole (one
 * row's quantised activations, <= 292 bytes per super-block, stay in L1 up to K = 40k).
 * Each super-block also prefetches the same block KQ1_PF columns ahead: on the AVX-512 /
 * AMX Xeon the hardware prefetcher does not keep up with one column's short stream, and a
 * software prefetch two columns ahead took a cold 300 MB Q4_K matrix from 8.5 to 11 GB/s on
 * one thread and 16.5 to 20 GB/s on two (the LM-head and q/o shapes, bench_kq_decode.py);
 * 4 and 8 columns ahead measured between the two. The last KQ1_PF columns of a thread's
 * range prefetch nothing, so no read leaves the matrix. */
#define KQ1_PF 2
static VNNI void run_kq1_vnni(int type, const act8 *ap, const uint8_t *w, int64_t n,
                              int64_t row_stride, float *y, int nthreads) {
    const act8 a = *ap;
    const int64_t nb = a.K / 256;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = n * t / T, n1 = n * (t + 1) / T;
        if (type == GGML_Q4_K)
            for (int64_t c = n0; c < n1; c++) y[c] = dotk1_vnni(GGML_Q4_K, &a, 0, nb, w + c * row_stride, c + KQ1_PF < n1 ? KQ1_PF * row_stride : 0);
        else
            for (int64_t c = n0; c < n1; c++) y[c] = dotk1_vnni(GGML_Q5_K, &a, 0, nb, w + c * row_stride, c + KQ1_PF < n1 ? KQ1_PF * row_stride : 0);
    }
}

/* One decode of a super-block for all rows of a call (dotkv_vnni / dotkw_avx2) against one
 * decode per row tile of 4-6 rows (bench_kq_decode.py --cold 96 --clock cpu: one thread, CPU
 * time, weights streamed from memory, same process, alternating, medians of 7, under load;
 * results/kq-decode-t1.json), per-tile time / this time on AVX-512 at 1 2 4 6 8 12 rows:
 * Q4_K qo 2048^2 0.89 1.04 1.07 1.17 1.41 1.31, down 0.95 1.58 1.54 1.80 1.61 1.38; Q6_K qo
 * 1.03 1.07 1.13 1.25 1.29 1.24, down 1.02 1.34 2.50 1.06 2.21 1.17. Hence these kernels from
 * 2 rows and for one Q6_K row (the LM head); one Q4_K / Q5_K row on AVX-512 runs dotk1_vnni
 * (1.05-1.28x the per-tile kernel at one row, one-row runs: 35-36 GB/s of
 * ~40 on two threads). On AVX2 (forced; results/kq-decode-t1-avx2.json) level at K = 2048
 * and 1.2-1.8x on down. The software prefetch (the same super-block KQ_PF columns on) is what
 * makes the one-decode kernels pay with weights from memory: without it dotkv_vnni at 8 rows
 * ran 0.64-0.79x the per-tile kernel cold (1.2-1.3x hot); cold, one thread, medians of 11, us,
 * no prefetch | 1 | 2 | 4 columns ahead: Q6_K qo 8 rows 540 358 303 302, Q4_K qo 8 rows 423
 * 315 279 279, Q6_K down 8 rows 3758 1529 1596 1690; Q4_K qo 1 row 122 133 127 126. */
#define KQ_PF 2

#define CALLW(R, FN, TYPE) FN(R, TYPE, &a, r0, b0, b1, wn, pf, o)
#define TILEW(FN, TYPE)                                                                   \
    switch (R) {                                                                          \
    case 12: CALLW(12, FN, TYPE); break;                                                  \
    case 11: CALLW(11, FN, TYPE); break;                                                  \
    case 10: CALLW(10, FN, TYPE); break;                                                  \
    case 9: CALLW(9, FN, TYPE); break;                                                    \
    case 8: CALLW(8, FN, TYPE); break;                                                    \
    case 7: CALLW(7, FN, TYPE); break;                                                    \
    case 6: CALLW(6, FN, TYPE); break;                                                    \
    case 5: CALLW(5, FN, TYPE); break;                                                    \
    case 4: CALLW(4, FN, TYPE); break;                                                    \
    case 3: CALLW(3, FN, TYPE); break;                                                    \
    case 2: CALLW(2, FN, TYPE); break;                                                    \
    default: CALLW(1, FN, TYPE); break;                                                   \
    }

/* The column loop of the dotkw kernels: as run_vnni / run_avx2 (threads split the columns,
 * K chunks sized by kq_chunk for the tile's rows), with one tile of up to KQW_TILE rows. */
#define KQW_RUN(NAME, ATTR, FN)                                                           \
static ATTR void NAME(int type, const act8 *ap, const uint8_t *w, int64_t n,              \
                      int64_t row_stride, float *y, int64_t ldy, int nthreads) {          \
    const act8 a = *ap;                                                                   \
    const int64_t M = a.M, ntiles = (M + KQW_TILE - 1) / KQW_TILE, nb = a.K / 256;        \
    const int64_t pf = KQ_PF * row_stride;                                                \
    _Pragma("omp parallel num_threads(nthreads)")                                         \
    {                                                                                     \
        const int t = omp_get_thread_num(), T = omp_get_num_threads();                    \
        const int64_t n0 = n * t / T, n1 = n * (t + 1) / T;                               \
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {                                 \
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;                 \
            for (int64_t tile = 0; tile < ntiles; tile++) {                               \
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;       \
                const int R = (int)(r1 - r0);                                             \
                const int64_t kc = kq_chunk(type, R, 256 + 2 * 16 + 4);                   \
                const int64_t nk = (nb + kc - 1) / kc;                                    \
                for (int64_t kchunk = 0; kchunk < nk; kchunk++) {                         \
                    const int64_t b0 = nb * kchunk / nk, b1 = nb * (kchunk + 1) / nk;     \
                    for (int64_t c = c0; c < c1; c++) {                                   \
                        const uint8_t *wn = w + c * row_stride;                           \
                        float o[KQW_TILE] = {0};                                          \
                        switch (type) {                                                   \
                        case GGML_Q4_K: TILEW(FN, GGML_Q4_K) break;                       \
                        case GGML_Q5_K: TILEW(FN, GGML_Q5_K) break;                       \
                        default: TILEW(FN, GGML_Q6_K) break;                              \
                        }                                                                 \
                        for (int r = 0; r < R; r++) {                                     \
                            float *yy = y + (r0 + r) * ldy + c;                           \
                            *yy = kchunk ? *yy + o[r] : o[r];                             \
                        }                                                                 \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
}
KQW_RUN(run_kqw_vnni, VNNI, dotkv_vnni)
KQW_RUN(run_kqw_avx2, , dotkw_avx2)


/* ---- AVX-512 VNNI, 32-element nibble types in groups of 4 blocks (VBMI CPUs) -------------
 * The pair kernel above converts two f16 scales per pair of blocks in scalar code, builds the
 * scale vector with inserts, reads three activation arrays and spends ~22 instructions per 36
 * weight bytes: at batch 1 it ran Q4_0 at ~0.43 of the memory-bandwidth bound. Here four
 * blocks of a row (72-96 bytes, the row as in the file) are two loads, and everything else is
 * vector shuffles (AVX-512 VBMI `vpermt2b` / `vpermt2w` over that 128-byte window):
 *   t    = the 4 blocks' 64 nibble bytes, block i in bytes 16i..16i+15 (vpermt2b);
 *   lo   = t & 15, hi = (t >> 4) & 15: int32 lane j of either holds 4 codes of block j / 4;
 *   dw   = the 4 f16 scales, each repeated in its block's 4 lanes (vpermt2w + vcvtph2ps);
 * and the activations are quantised in the matching order (per group of 4 blocks and row:
 * xlo = elements 0-15 of each block, xhi = elements 16-31, g = -off * the lane's 8-element
 * sum or, for Q4_1 / Q5_1, d_x * that sum as float, dx = the block's activation scale per
 * lane), so a group is two vpdpbusd into one int32 vector whose lanes each belong to one
 * block, one convert and one FMA by dw * dx: ~12 instructions per 72 bytes at one row.
 * Q5_0 / Q5_1 add their fifth bits with a masked byte add (the 4 blocks' qh words gathered
 * by vpermt2w make the two 64-bit masks). A last group of fewer than 4 blocks loads under a
 * byte mask (zeros beyond the row, so nothing past the tensor is read) and its missing
 * blocks' activations are zero. */
#define VBMI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi")))
/* Measured (bench_int8.py --variants --cold 96, Q4_0, 1.7B shapes, one thread, under load):
 * one column at a time (the matrix streams linearly at one row: 2-4 columns per activation
 * load ran at 0.3-0.6x), K chunks of 32 KB of activations for the row tile (64 KB and 16 KB:
 * 0.5x at 4 rows of K = 8192) and a software prefetch 4 columns ahead (the chunks break the
 * linear stream: 2x at 2 rows of K = 8192). */
#define G32_TILE_BYTES (32 * 1024)
#define G32_PREFETCH 4
#define G32_BYTES 256                 /* activation bytes per group of 4 blocks and row */

/* The 4-block activation layout (see above) for the nibble types; off = 8 (Q4_0), 16 (Q5_0),
 * 0 with min = 1 (Q4_1 / Q5_1: g holds d_x * sums as float). */
static int quantise32g(const float *x, int64_t M, int64_t ldx, int64_t K, int off, int min,
                       act8 *a) {
    const int64_t nb = K / 32, ng = (nb + 3) / 4;
    uint8_t *p = scratch((size_t)(M * ng * G32_BYTES) + 64);
    if (!p) return ITERSERVE_ENOMEM;
    a->M = M, a->K = K;
    a->q = (int8_t *)p;
    memset(p, 0, (size_t)(M * ng * G32_BYTES));
    int8_t *t = tscratch((size_t)K + 4 * (size_t)nb);
    if (!t) return ITERSERVE_ENOMEM;
    float *td = (float *)(t + K);            /* K: a multiple of 32 */
    for (int64_t r = 0; r < M; r++) {
        qrow(x + r * ldx, K, 32, t, td);
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *gp = p + (r * ng + b / 4) * G32_BYTES;
            const int i = (int)(b % 4);
            int8_t *xlo = (int8_t *)gp + 16 * i, *xhi = (int8_t *)gp + 64 + 16 * i;
            int32_t *g = (int32_t *)(gp + 128) + 4 * i;
            float *dx = (float *)(gp + 192) + 4 * i;
            const float d = td[b];
            memcpy(xlo, t + 32 * b, 16);
            memcpy(xhi, t + 32 * b + 16, 16);
            for (int l = 0; l < 4; l++) {
                int s = 0;
                for (int e = 0; e < 4; e++) s += xlo[4 * l + e] + xhi[4 * l + e];
                if (min) {
                    const float v = d * (float)s;
                    memcpy(g + l, &v, 4);
                } else {
                    g[l] = -off * s;
                }
                dx[l] = d;
            }
        }
    }
    return ITERSERVE_OK;
}

/* iterserve_e8m0_half of 16 lanes of E8M0 exponents (0..255) */
static inline __attribute__((always_inline)) VBMI __m512 e8m0_half16(__m512i e) {
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 lt2 = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(lt2, big, small));
}

/* R activation rows by NC weight rows (columns c0.. at row_stride), K groups [g0, g1):
 * out[r * NC + c]. The activations of a group are loaded once for the NC columns. */
static inline __attribute__((always_inline)) VBMI void dot32g_vnni(
        int R, int NC, int type, const act8 *a, int64_t r0, int64_t g0, int64_t g1,
        const uint8_t *wrow, int64_t row_stride, float *out) {
    const int bb = bb32(type), qo = qs32(type), wb = 4 * bb;
    const int64_t nb = a->K / 32, ng = (nb + 3) / 4;
    const __m512i m4 = _mm512_set1_epi8(0x0F), c16 = _mm512_set1_epi8(0x10);
    /* byte i of t <- window byte bb * (i / 16) + qo + i % 16 */
    __m512i iq, id, ie = _mm512_setzero_si512(), cb = _mm512_setzero_si512();
    if (is_cb(type)) {      /* the codebook as unsigned bytes, in each 128-bit lane */
        const int8_t *v = type == GGML_MXFP4 ? iterserve_mxfp4_values : iterserve_iq4_values;
        uint8_t tc[64];
        for (int i = 0; i < 64; i++) tc[i] = (uint8_t)(v[i % 16] + cb_off(type));
        cb = _mm512_loadu_si512((const void *)tc);
    }
    {
        uint8_t tq[64], te[64] = {0};
        uint16_t td[32];
        /* window byte B: v0 byte B below 64, else v1 byte B - (wb - 32), index 64 + that */
#define WB(B) ((B) < 64 ? (B) : 64 + (B) - (wb - 32))
        for (int i = 0; i < 64; i++) tq[i] = (uint8_t)WB(bb * (i / 16) + qo + i % 16);
        for (int j = 0; j < 16; j++) {
            td[j] = (uint16_t)(WB(bb * (j / 4)) / 2);             /* d of block j / 4 */
            td[16 + j] = (uint16_t)(WB(bb * (j / 4) + 2) / 2);    /* m of block j / 4 */
        }
        if (is_q5(type)) {                                      /* qh low / high words */
            const int ho = type == GGML_Q5_0 ? 2 : 4;
            for (int j = 0; j < 4; j++) {
                td[16 + j] = (uint16_t)(WB(bb * j + ho) / 2);
                td[20 + j] = (uint16_t)(WB(bb * j + ho + 2) / 2);
            }
            if (type == GGML_Q5_1)                              /* keep m in 24..27 */
                for (int j = 0; j < 4; j++) td[24 + j] = (uint16_t)(WB(bb * j + 2) / 2);
        }
        for (int j = 0; j < 16; j++) te[j] = (uint8_t)WB(bb * (j / 4));   /* MXFP4's E8M0 */
#undef WB
        iq = _mm512_loadu_si512((const void *)tq);
        id = _mm512_loadu_si512((const void *)td);
        if (type == GGML_MXFP4) ie = _mm512_loadu_si512((const void *)te);
    }
    const __m512i im = _mm512_set_epi16(27, 27, 27, 27, 26, 26, 26, 26, 25, 25, 25, 25, 24, 24,
                                        24, 24, 27, 27, 27, 27, 26, 26, 26, 26, 25, 25, 25, 25,
                                        24, 24, 24, 24);
    __m512 acc[ROW_TILE * 4];
    for (int i = 0; i < R * NC; i++) acc[i] = _mm512_setzero_ps();
    const int64_t pfo = G32_PREFETCH * row_stride;
    for (int64_t G = g0; G < g1; G++) {
        const int64_t left = (nb - 4 * G) * bb;                 /* bytes of this row left */
        __mmask64 k0 = ~(__mmask64)0, k1 = 0;
        if (left < wb) {
            const int64_t l1 = left - (wb - 32);       /* bytes of v1 inside the row */
            k0 = left >= 64 ? ~(__mmask64)0 : (__mmask64)((1ULL << left) - 1);
            k1 = l1 > 0 ? (__mmask64)((1ULL << l1) - 1) : 0;
        }
        __m512i lo[4], hi[4];
        __m512 dw[4], mw[4];
        for (int c = 0; c < NC; c++) {
            const uint8_t *p = wrow + c * row_stride + G * wb;
            if (pfo)               /* a later column's K chunk: its rows are not contiguous */
                _mm_prefetch((const char *)(p + pfo), _MM_HINT_T0);
            __m512i v0, v1;
            if (left >= wb) {                  /* v1: the 32 bytes ending at the group's end */
                v0 = _mm512_loadu_si512((const void *)p);
                v1 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + wb - 32)));
            } else {                           /* a short last group: nothing past the row */
                v0 = _mm512_maskz_loadu_epi8(k0, p);
                v1 = _mm512_maskz_loadu_epi8(k1, p + wb - 32);
            }
            const __m512i t = _mm512_permutex2var_epi8(v0, iq, v1);
            lo[c] = _mm512_and_si512(t, m4);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(t, 4), m4);
            if (is_cb(type)) {
                lo[c] = _mm512_shuffle_epi8(cb, lo[c]);
                hi[c] = _mm512_shuffle_epi8(cb, hi[c]);
            }
            const __m512i sc = _mm512_permutex2var_epi16(v0, id, v1);
            dw[c] = _mm512_cvtph_ps(_mm512_castsi512_si256(sc));
            if (type == GGML_MXFP4)        /* ggml_e8m0_to_fp32_half of the 4 scale bytes */
                dw[c] = e8m0_half16(_mm512_cvtepu8_epi32(
                    _mm512_castsi512_si128(_mm512_permutex2var_epi8(v0, ie, v1))));
            mw[c] = dw[c];
            if (is_q5(type)) {
                const __m128i h = _mm512_extracti32x4_epi32(sc, 2);  /* words 16..23 */
                lo[c] = _mm512_mask_add_epi8(lo[c], (__mmask64)_mm_cvtsi128_si64(h), lo[c], c16);
                hi[c] = _mm512_mask_add_epi8(hi[c], (__mmask64)_mm_extract_epi64(h, 1), hi[c], c16);
            }
            if (type == GGML_Q4_1)
                mw[c] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sc, 1));
            else if (type == GGML_Q5_1)
                mw[c] = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(im, sc)));
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *ap = (const uint8_t *)a->q + ((r0 + r) * ng + G) * G32_BYTES;
            const __m512i xl = _mm512_loadu_si512((const void *)ap);
            const __m512i xh = _mm512_loadu_si512((const void *)(ap + 64));
            const __m512i gx = _mm512_loadu_si512((const void *)(ap + 128));
            const __m512 dx = _mm512_loadu_ps((const float *)(ap + 192));
            for (int c = 0; c < NC; c++) {
                __m512i s = has_min(type) ? _mm512_setzero_si512() : gx;
                s = _mm512_dpbusd_epi32(s, lo[c], xl);
                s = _mm512_dpbusd_epi32(s, hi[c], xh);
                acc[r * NC + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw[c], dx),
                                                  acc[r * NC + c]);
                if (has_min(type))
                    acc[r * NC + c] = _mm512_fmadd_ps(mw[c], _mm512_castsi512_ps(gx), acc[r * NC + c]);
            }
        }
    }
    for (int i = 0; i < R * NC; i++) out[i] = hsum16f(acc[i]);
}

/* Q8_0 (34-byte blocks, the old activation layout: q in order, g4 = -128 * sums of 4, dx per
 * 8 lanes): four blocks per step from a 136-byte window, codes gathered two blocks per zmm by
 * vpermt2b and flipped to unsigned (w + 128), the four scales by one vpermt2w; the blocks
 * left over at the end of a K chunk take the 256-bit one-block step. */
static inline __attribute__((always_inline)) VBMI void dot8_vnni(
        int R, int type, const act8 *a, int64_t r0, int64_t b0, int64_t b1,
        const uint8_t *wrow, float *out) {
    (void)type;
    const int64_t K = a->K, nb = K / 32;
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    __m512i i01, i23, idw;
    {
        uint8_t t01[64], t23[64];
        uint16_t td[32];
        for (int i = 0; i < 64; i++) {
            t01[i] = (uint8_t)(34 * (i / 32) + 2 + i % 32);          /* from p */
            t23[i] = (uint8_t)(34 * (2 + i / 32) + 2 + i % 32 - 64); /* from p + 64 */
        }
        for (int j = 0; j < 32; j++) td[j] = (uint16_t)(17 * (j / 8));
        i01 = _mm512_loadu_si512((const void *)t01);
        i23 = _mm512_loadu_si512((const void *)t23);
        idw = _mm512_loadu_si512((const void *)td);
    }
    __m512 acc[ROW_TILE];
    __m256 acc1[ROW_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), acc1[r] = _mm256_setzero_ps();
    int64_t b = b0;
    for (; b + 4 <= b1; b += 4) {
        const uint8_t *p = wrow + b * 34;
        const __m512i v0 = _mm512_loadu_si512((const void *)p);
        const __m512i v1 = _mm512_loadu_si512((const void *)(p + 64));
        const __m512i v2 = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(p + 128)));
        const __m512i w01 = _mm512_xor_si512(_mm512_permutex2var_epi8(v0, i01, v1), x80);
        const __m512i w23 = _mm512_xor_si512(_mm512_permutex2var_epi8(v1, i23, v2), x80);
        const __m512i sc = _mm512_permutex2var_epi16(v0, idw, v1);
        const __m512 d01 = _mm512_cvtph_ps(_mm512_castsi512_si256(sc));
        const __m512 d23 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sc, 1));
        for (int r = 0; r < R; r++) {
            const int64_t rr = r0 + r;
            const int32_t *g = a->g4 + rr * (K / 4) + 8 * b;
            const int8_t *xq = a->q + rr * K + 32 * b;
            const float *dx = a->dx + (rr * nb + b) * 8;
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)g), w01,
                                             _mm512_loadu_si512((const void *)xq));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(g + 16)), w23,
                                             _mm512_loadu_si512((const void *)(xq + 64)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d01, _mm512_loadu_ps(dx)), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d23, _mm512_loadu_ps(dx + 16)), acc[r]);
        }
    }
    for (; b < b1; b++) {
        const uint8_t *blk = wrow + b * 34;
        const __m256 dw = _mm256_set1_ps(f16(blk));
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                           _mm256_set1_epi8((char)0x80));
        for (int r = 0; r < R; r++) {
            const int64_t rr = r0 + r;
            __m256i p = _mm256_loadu_si256((const __m256i *)(a->g4 + rr * (K / 4) + 8 * b));
            p = _mm256_dpbusd_epi32(p, w, _mm256_loadu_si256((const __m256i *)(a->q + rr * K + 32 * b)));
            const __m256 s = _mm256_mul_ps(dw, _mm256_loadu_ps(a->dx + (rr * nb + b) * 8));
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum16f(acc[r]) + hsum8f(acc1[r]);
}


#define GCALL(R, NC, TYPE) dot32g_vnni(R, NC, TYPE, &a, r0, b0, b1, wn, row_stride, o)
/* R rows by nc columns (nc <= 4 for R <= 2, <= 2 for R = 3, 4) */
#define GTILE(TYPE)                                                                       \
    switch (R * 8 + nc) {                                                                 \
    case 4 * 8 + 2: GCALL(4, 2, TYPE); break;                                             \
    case 4 * 8 + 1: GCALL(4, 1, TYPE); break;                                             \
    case 3 * 8 + 2: GCALL(3, 2, TYPE); break;                                             \
    case 3 * 8 + 1: GCALL(3, 1, TYPE); break;                                             \
    case 2 * 8 + 4: GCALL(2, 4, TYPE); break;                                             \
    case 2 * 8 + 3: GCALL(2, 3, TYPE); break;                                             \
    case 2 * 8 + 2: GCALL(2, 2, TYPE); break;                                             \
    case 2 * 8 + 1: GCALL(2, 1, TYPE); break;                                             \
    case 1 * 8 + 4: GCALL(1, 4, TYPE); break;                                             \
    case 1 * 8 + 3: GCALL(1, 3, TYPE); break;                                             \
    case 1 * 8 + 2: GCALL(1, 2, TYPE); break;                                             \
    default: GCALL(1, 1, TYPE); break;                                                    \
    }

/* Driver of the two kernels above: as run_vnni, K chunks in groups of 4 blocks (nibble types,
 * their own activation layout) or in blocks (Q8_0). One Q8_0 row takes the pair kernel
 * (dot32_vnni) in this driver: bench_int8.py --variants --cold 96 ran dot8_vnni at 0.8x of it
 * at one row of K = 2048 and 1.4-1.5x at 4-8 rows (q32-int8-variants.json). */
static VBMI void run_vbmi(int type, const act8 *ap, const uint8_t *w, int64_t n,
                          int64_t row_stride, float *y, int64_t ldy, int nthreads) {
    const act8 a = *ap;
    const int64_t M = a.M, ntiles = (M + ROW_TILE - 1) / ROW_TILE;
    const int q8 = type == GGML_Q8_0;
    const int64_t nb = a.K / 32, nu = q8 ? nb : (nb + 3) / 4;   /* K units: blocks / groups */
    const int64_t per_unit = q8 ? 32 + 32 + 32 : G32_BYTES;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = n * t / T, n1 = n * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                /* chunks sized by this tile's rows, as kq_chunk: a chunk breaks the weight
                 * stream into pieces of a row, and sized for 4 rows it split every K over
                 * 2688 in two at one row. Q8_0 16384 x 2880 (gpt-oss's), one thread, one
                 * row: 6.3 GB/s of weights with ROW_TILE's chunks, 16-24 with the tile's;
                 * K = 5760: 8.0 -> 15-18; Q4_0 K = 5760: 10.4 -> 14-15 (bench_int8-like
                 * best-of-5 loops on a loaded 2-core EPYC; K <= 2048 unchanged). */
                int64_t kc = G32_TILE_BYTES / (R * per_unit);
                if (kc < 4) kc = 4;
                if (q8) kc &= ~(int64_t)3;
                const int64_t nk = (nu + kc - 1) / kc;
                for (int64_t kchunk = 0; kchunk < nk; kchunk++) {
                    int64_t b0 = nu * kchunk / nk, b1 = nu * (kchunk + 1) / nk;
                    if (q8) {                          /* chunk starts on 4 blocks */
                        b0 &= ~(int64_t)3;
                        if (kchunk + 1 < nk) b1 &= ~(int64_t)3;
                    }
                    if (q8) {
                        for (int64_t c = c0; c < c1; c++) {
                            const uint8_t *wn = w + c * row_stride;
                            float o[ROW_TILE] = {0};
                            if (R == 1)        /* measured: the pair kernel, 1.25x here */
                                CALL(1, dot32_vnni, GGML_Q8_0);
                            else
                                TILE(dot8_vnni, GGML_Q8_0)
                            for (int r = 0; r < R; r++) {
                                float *yy = y + (r0 + r) * ldy + c;
                                *yy = kchunk ? *yy + o[r] : o[r];
                            }
                        }
                        continue;
                    }
                    const int NC = 1;
                    for (int64_t c = c0; c < c1; c += NC) {
                        const int nc = c + NC <= c1 ? NC : (int)(c1 - c);
                        const uint8_t *wn = w + c * row_stride;
                        float o[ROW_TILE * 4] = {0};
                        switch (type) {
                        case GGML_Q4_0: GTILE(GGML_Q4_0) break;
                        case GGML_Q4_1: GTILE(GGML_Q4_1) break;
                        case GGML_Q5_0: GTILE(GGML_Q5_0) break;
                        case GGML_IQ4_NL: GTILE(GGML_IQ4_NL) break;
                        case GGML_MXFP4: GTILE(GGML_MXFP4) break;
                        default: GTILE(GGML_Q5_1) break;
                        }
                        for (int r = 0; r < R; r++)
                            for (int j = 0; j < nc; j++) {
                                float *yy = y + (r0 + r) * ldy + c + j;
                                *yy = kchunk ? *yy + o[r * nc + j] : o[r * nc + j];
                            }
                    }
                }
            }
        }
    }
}

int iterserve_k_act8(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                     const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int nthreads) {
    if (!iterserve_can_act8(type)) return ITERSERVE_ETYPE;
    const int kq = is_kq(type);
    if (k <= 0 || k % (kq ? 256 : 32)) return ITERSERVE_ETYPE;
    if (M < 1 || n < 1) return ITERSERVE_OK;
    const int wide = iterserve_st.int8 == 2;
    act8 a;
    int rc;
    if (nthreads < 1) nthreads = 1;
    if (n < 64 * nthreads) nthreads = 1;
    if (!kq && iterserve_st.vbmi) {              /* the 4-block kernels */
        if (type == GGML_Q8_0)
            rc = quantise32(x, M, ldx, k, 7, &a);
        else
            rc = quantise32g(x, M, ldx, k, type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16
                             : is_cb((int)type) ? cb_off((int)type) : 0, has_min((int)type), &a);
        if (rc) return rc;
        run_vbmi((int)type, &a, w, n, row_stride, y, ldy, nthreads);
        return ITERSERVE_OK;
    }
    if (is_cb((int)type)) return ITERSERVE_ETYPE;        /* run_vbmi only */
    if (kq && wide && M == 1 && type != GGML_Q6_K) {      /* one Q4_K / Q5_K row */
        rc = quantise256p(x, M, ldx, k, &a);
        if (rc) return rc;
        run_kq1_vnni((int)type, &a, w, n, row_stride, y, nthreads);
        return ITERSERVE_OK;
    }
    if (kq) {
        rc = wide ? quantise256v(x, M, ldx, k, &a) : quantise256(x, M, ldx, k, &a);
        if (rc) return rc;
        if (wide) run_kqw_vnni((int)type, &a, w, n, row_stride, y, ldy, nthreads);
        else run_kqw_avx2((int)type, &a, w, n, row_stride, y, ldy, nthreads);
        return ITERSERVE_OK;
    }
    /* g4 offsets: Q4_0 8, Q5_0 16; Q8_0 128 under VNNI (w + 128), none under AVX2's sign
     * trick; Q4_1 / Q5_1: the sums for their min term */
    rc = quantise32(x, M, ldx, k, type == GGML_Q4_0 ? 3 : type == GGML_Q5_0 ? 4
                    : type == GGML_Q8_0 ? (wide ? 7 : -1) : SUMS, &a);
    if (rc) return rc;
    if (wide) run_vnni((int)type, &a, w, n, row_stride, y, ldy, nthreads);
    else run_avx2((int)type, &a, w, n, row_stride, y, ldy, nthreads);
    return ITERSERVE_OK;
}

/* ---- split activations: int8 speed, error ~1/250 of int8's (ITERSERVE_K_SPLIT8) ----------
 * Why: the LM head's logits are what sampling reads, so plain int8 activations cost it too
 * much accuracy (layers.LM_HEAD_AUTO_ACTIVATIONS), and the float kernels are bound by
 * instructions where the int8 ones are bound by bytes: a Q6_K head
 * (49152 x 2048, cold) took 10.0 ms at 1 row on two threads against the int8 kernel's 4.4,
 * and 4.7 ms for 2 int8 rows (one decode of each super-block serves every row of a tile).
 * So each row x is passed as two rows: a = its own 8-bit rounding (d . q, the values
 * quantise* produce: the kernel re-quantises a exactly, since a's block maximum is 127 d and
 * every a / d is an integer), and the residual x - a (|x - a| <= d / 2), rounded to 8 bits in
 * turn. W . x = W . a + W . (x - a), and the only rounding left is the residual's: <= d / 254
 * per element, against d / 2 for plain int8 activations. Rows go in pieces of SPLIT8_ROWS
 * (2 x 8 int8 rows: one pass over the weights; their outputs, 2 x 8 x n floats, are the
 * scratch); outputs summed a + residual in that order. dispatch.c says where it runs. */
#define SPLIT8_ROWS 8

static __thread void *sbuf;
static __thread size_t sbuf_size;

int iterserve_k_split8(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                       const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                       int nthreads) {
    if (!iterserve_can_act8(type)) return ITERSERVE_ETYPE;
    const int B = is_kq(type) ? 256 : 32;
    if (k <= 0 || k % B) return ITERSERVE_ETYPE;
    if (M < 1 || n < 1) return ITERSERVE_OK;
    const int64_t P = M < SPLIT8_ROWS ? M : SPLIT8_ROWS;
    /* 2P rows of x, 2P rows of y, one row's codes and scales */
    const size_t xb = (size_t)(2 * P * k) * 4, yb = (size_t)(2 * P * n) * 4;
    uint8_t *p = scratch_grow(&sbuf, &sbuf_size, xb + yb + (size_t)k + (size_t)(k / B) * 4 + 128);
    if (!p) return ITERSERVE_ENOMEM;
    float *xs = (float *)p, *ys = (float *)(p + xb), *d = (float *)(p + xb + yb);
    int8_t *q = (int8_t *)(p + xb + yb + (size_t)(k / B) * 4);
    if (nthreads < 1) nthreads = 1;
    for (int64_t r0 = 0; r0 < M; r0 += P) {
        const int64_t R = M - r0 < P ? M - r0 : P;
        for (int64_t r = 0; r < R; r++) {
            const float *xr = x + (r0 + r) * ldx;
            float *a = xs + r * k, *res = xs + (R + r) * k;
            qrow(xr, k, B, q, d);
            for (int64_t i = 0; i < k; i++) {
                a[i] = d[i / B] * (float)q[i];
                res[i] = xr[i] - a[i];
            }
        }
        const int rc = iterserve_k_act8(type, w, n, row_stride, k, xs, 2 * R, k, ys, n, nthreads);
        if (rc) return rc;
        const int T = n * R < 65536 ? 1 : nthreads;
#pragma omp parallel for num_threads(T) schedule(static)
        for (int64_t c = 0; c < n; c++)
            for (int64_t r = 0; r < R; r++)
                y[(r0 + r) * ldy + c] = ys[r * n + c] + ys[(R + r) * n + c];
    }
    return ITERSERVE_OK;
}
