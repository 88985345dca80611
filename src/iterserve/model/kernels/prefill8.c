/* Prefill / large-batch GEMM with 8-bit activations and integer dot products:
 * y[M, n] = x[M, k] . W[n, k]^T for many activation rows (prefill chunks), W one row segment
 * in its GGUF encoding, x float32 quantised to 8 bits once per call.
 *
 * Why: prefill.c's float panel GEMM runs its register-blocked FMA micro-kernel at ~360
 * GFLOP/s on this 2-core AVX-512 EPYC, close to the fp32 FMA peak, and llama.cpp still
 * prefilled 512 tokens 1.1-1.25x faster on the same GGUF files: it quantises the
 * activations to 8 bits and multiplies bytes. AVX-512 VNNI's `vpdpbusd` does 64 byte
 * multiply-adds per instruction where an fp32 FMA does 16. This file is that GEMM for
 * Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K:
 *
 *   quantise x once per call: every row in blocks of 32 (scale dx = max|x| / 127, round to
 *   nearest even: qdot8.c's rule), stored as unsigned bytes xq + 128 (vpdpbusd multiplies
 *   unsigned by signed bytes), with dx and dx * sum(xq) per block (the min term);
 *   for each panel of NP = 32 weight rows (threads split the panels):
 *     decode the panel's whole K into an L2 scratch: the signed integer codes (Q4_0 q - 8,
 *     Q6_K q - 32, Q4_K q, ...) as bytes, K-major in groups of 4 (one zmm = 16 columns x 4
 *     k, what vpdpbusd takes), and per G-element block of each column (G = 32; Q6_K's
 *     scales are per 16, G = 16) its float scale (Q4_K d * sc), its float min (Q4_K's
 *     dmin * m, Q4_1's m) and -128 * sum(codes) (the +128 of the activations, undone in
 *     integers by starting the block's accumulator there);
 *     for every tile of up to MR8 activation rows: per block, int32 accumulators over the
 *     block (exact), then acc_f += float(acc_i) * scale * dx (+ min * dx * sum(xq)) -
 *     2 x MR8 zmm of float accumulators over the whole K, stored once.
 *
 * Accuracy: the integer part is exact, so the result is gguf-py's dequantised W times the
 * 8-bit-rounded x up to float32 summation order; against the float x the error is bounded by
 * sum_j |w_j| * dx_j / 2 (tests/model/test_prefill_kernel.py checks both). Activations are
 * quantised per 32 even for the K-quants (llama.cpp uses 256 there): 2-4x less rounding
 * error for the same arithmetic.
 *
 * ISA: AVX-512 F/BW/VL/VNNI (MR8 = 6 rows x 32 columns) where the CPU has it, else AVX2
 * (`vpmaddubsw` + `vpmaddwd`, 4 rows x 16 columns; not Q8_0, whose byte products would
 * saturate vpmaddubsw's int16 pair sums); iterserve_st.int8 chooses for both int8 files.
 * dispatch.c sends calls here under the activation mode (with the measurements). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "transpose.h"
#include "kscales.h"

#define VNNI8 __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni")))
#define NP8 32          /* weight rows per panel */
#define MR8 6           /* activation rows per AVX-512 micro-tile */
#define MR8_256 4       /* activation rows per AVX2 micro-tile */

int iterserve_can_gemm8(int64_t type) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0:
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return 1;
    default: return 0;
    }
}

static inline int qb8(int type) {          /* elements per type block */
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ? 256 : 32;
}
static inline int bb8(int type) {          /* bytes per type block */
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    default: return 210;                   /* Q6_K */
    }
}
static inline int g8(int type) { return type == GGML_Q6_K ? 16 : 32; }   /* scale block */
static inline int has_min8(int type) {
    return type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q4_K || type == GGML_Q5_K;
}

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 32 bits -> 32 bytes of 0x10 where the bit is set (the Q5 types' fifth bit) */
static inline __m256i bit5_bytes(uint32_t v) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    const __m256i b = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf),
                                      _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

static inline __m256i nibbles32(const uint8_t *qs) {   /* 16 bytes -> lo nibbles, hi nibbles */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* Q4_K / Q5_K's 6-bit scale and min of sub-block j (gguf-py's get_scale_min) */
/* All 8 scales (bytes 0-7) and 8 mins (bytes 8-15) of a Q4_K / Q5_K super-block from its 12
 * packed bytes (llama.cpp's utmp shuffle). Vectorising these and Q6_K's scale conversion cut
 * the K-quant panel decode, most of this GEMM's time at decode row counts: the GEMM
 * 1.10-1.36x for Q4_K, 1.02-1.07x for Q6_K (kq-gemm8-scales.json). */
static inline __m128i kscale8_all(const uint8_t *s12) {
    uint32_t u[4];
    q4k_scales(s12, u);
    return _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
}

/* One type block of one weight row -> its signed codes (qb8 bytes, in element order), the
 * float scale and min of each G-element scale block: w[e] = scale * code[e] - min (min 0 for
 * the types without one; Q4_1 / Q5_1 store +m, so their min is -m). The same values as
 * dequant.c / gguf-py up to the rounding of the scale product (Q4_K: fl(d * sc) exactly as
 * gguf-py; the product with the code is exact in the integer dot). */
static inline __attribute__((always_inline)) void decode8(int type, const uint8_t *b,
                                                          int8_t *codes, float *scale,
                                                          float *mins) {
    switch (type) {
    case GGML_Q4_0:
        _mm256_storeu_si256((__m256i *)codes, _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)));
        scale[0] = h2f(b);
        break;
    case GGML_Q4_1:
        _mm256_storeu_si256((__m256i *)codes, nibbles32(b + 4));
        scale[0] = h2f(b);
        mins[0] = -h2f(b + 2);
        break;
    case GGML_Q5_0: {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const __m256i q = _mm256_or_si256(nibbles32(b + 6), bit5_bytes(qh));
        _mm256_storeu_si256((__m256i *)codes, _mm256_sub_epi8(q, _mm256_set1_epi8(16)));
        scale[0] = h2f(b);
        break;
    }
    case GGML_Q5_1: {
        uint32_t qh;
        memcpy(&qh, b + 4, 4);
        _mm256_storeu_si256((__m256i *)codes, _mm256_or_si256(nibbles32(b + 8), bit5_bytes(qh)));
        scale[0] = h2f(b);
        mins[0] = -h2f(b + 2);
        break;
    }
    case GGML_Q8_0:
        memcpy(codes, b + 2, 32);
        scale[0] = h2f(b);
        break;
    case GGML_Q4_K: case GGML_Q5_K: {
        const float d = h2f(b), dmin = h2f(b + 2);
        const int q5 = type == GGML_Q5_K;
        const uint8_t *qs = b + (q5 ? 48 : 16);
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (q5) {
                const __m256i one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
            }
            _mm256_storeu_si256((__m256i *)(codes + 64 * j), lo);
            _mm256_storeu_si256((__m256i *)(codes + 64 * j + 32), hi);
        }
        {
            const __m128i v = kscale8_all(b + 4);
            _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d),
                                                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
            _mm256_storeu_ps(mins, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(
                                                     _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
        }
        break;
    }
    default: {                                            /* Q6_K */
        const float d = h2f(b + 208);
        const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
        const __m256i off = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qhp = b + 128 + 32 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
            const __m256i hb[4] = {
                _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4)};
            const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                   _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
            for (int c = 0; c < 4; c++)
                _mm256_storeu_si256((__m256i *)(codes + 128 * h + 32 * c),
                                    _mm256_sub_epi8(_mm256_or_si256(lo[c], hb[c]), off));
        }
        {
            const __m128i v = _mm_loadu_si128((const __m128i *)(b + 192));
            const __m256 dd = _mm256_set1_ps(d);
            _mm256_storeu_ps(scale, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
            _mm256_storeu_ps(scale + 8, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(
                                                          _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
        }
        break;
    }
    }
}

/* ---- the activations: one pass per call ---------------------------------------------------- */
typedef struct {
    int64_t M, K;
    uint8_t *xu;      /* [M][K]: xq + 128 */
    float *dx;        /* [M][K / 32] */
    float *xs;        /* [M][K / 32]: dx * sum(xq) of the block */
} xq8;

static void quantise_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, xq8 *a) {
    const int64_t K = a->K, nb = K / 32;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * ldx;
        uint8_t *q = a->xu + r * K;
        for (int64_t b = 0; b < nb; b++) {
            const float *v = xr + 32 * b;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            int s = 0;
            for (int i = 0; i < 32; i++) {
                const int t = (int)nearbyintf(v[i] * id);
                s += t;
                q[32 * b + i] = (uint8_t)(t + 128);
            }
            a->dx[r * nb + b] = d;
            a->xs[r * nb + b] = d * (float)s;
        }
    }
}

/* The same, 32 lanes at a time (cvtps rounds to nearest even like nearbyintf) */
static VNNI8 void quantise_rows512(const float *x, int64_t ldx, int64_t r0, int64_t r1, xq8 *a) {
    const int64_t K = a->K, nb = K / 32;
    const __m512i bias = _mm512_set1_epi32(128);
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * ldx;
        uint8_t *q = a->xu + r * K;
        for (int64_t b = 0; b < nb; b++) {
            const __m512 v0 = _mm512_loadu_ps(xr + 32 * b), v1 = _mm512_loadu_ps(xr + 32 * b + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            const __m512 vid = _mm512_set1_ps(id);
            const __m512i t0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
            const __m512i t1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
            const int s = _mm512_reduce_add_epi32(_mm512_add_epi32(t0, t1));
            _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(_mm512_add_epi32(t0, bias)));
            _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(t1, bias)));
            a->dx[r * nb + b] = d;
            a->xs[r * nb + b] = d * (float)s;
        }
    }
}

/* ---- the packed panel ---------------------------------------------------------------------- */
/* codes[K / 4][NP8][4] signed bytes; per G-block b: corr[b][NP8] int32 = -128 * sum(codes),
 * scale[b][NP8], mins[b][NP8] floats. Columns past `rows` are zero (they write nothing). */
typedef struct {
    int8_t *codes;
    int32_t *corr;
    float *scale, *mins;
} panel8;

static __thread uint8_t *pbuf;
static __thread size_t pbuf_size;

static int panel_alloc(int64_t K, int G, panel8 *p) {
    const size_t nblk = (size_t)(K / G);
    const size_t cb = (size_t)K * NP8, sb = nblk * NP8 * 4;
    const size_t need = cb + 3 * sb + 64;
    if (need > pbuf_size) {
        free(pbuf);
        pbuf = aligned_alloc(64, (need + 63) / 64 * 64);
        pbuf_size = pbuf ? need : 0;
        if (!pbuf) return ITERSERVE_ENOMEM;
    }
    p->codes = (int8_t *)pbuf;
    p->corr = (int32_t *)(pbuf + cb);
    p->scale = (float *)(pbuf + cb + sb);
    p->mins = (float *)(pbuf + cb + 2 * sb);
    return ITERSERVE_OK;
}

/* Decode rows [p0, p0 + rows) of W (all K) into p. tmp: NP8 x 256 bytes.
 * The 32-element types decode 8 blocks (256 elements) of a row at a time (GB = 8, when K is
 * whole 256s): each row's 144-272 bytes in a row are one short stream instead of 18-34 bytes
 * per row and block, the next group is prefetched, and the transposes and scale copies run
 * as for one 256-element super-block. Decode steps of 13-32 rows spend most of this GEMM's
 * time here (dispatch.c); against one block at a time the GEMM ran 1.15-1.94x at 8-32 rows
 * (bench_int8.py, benchmarks/results/q4-gemm8-pack.json). */

static inline __attribute__((always_inline)) void pack8(
        int type, const uint8_t *w, int64_t row_stride, int64_t p0, int rows, int64_t K,
        int8_t *tmp, panel8 *p) {
    const int QB = qb8(type), BB = bb8(type), G = g8(type), SB = QB / G;
    const int64_t nbk = K / QB;
    const int GB = QB == 32 && nbk % 8 == 0 ? 8 : 1;   /* blocks per step */
    const int QE = QB * GB, SE = SB * GB;
    float sc[NP8][16], mn[NP8][16];
    memset(tmp + (size_t)rows * QE, 0, (size_t)(NP8 - rows) * QE);
    memset(sc, 0, sizeof(sc));
    memset(mn, 0, sizeof(mn));
    for (int64_t b = 0; b < nbk; b += GB) {
        for (int j = 0; j < rows; j++) {
            const uint8_t *src = w + (p0 + j) * row_stride + b * BB;
            if (GB > 1 && b + 2 * GB <= nbk)
                for (int o = 0; o < GB * BB; o += 64)
                    _mm_prefetch((const char *)(src + GB * BB + o), _MM_HINT_T0);
            for (int i = 0; i < GB; i++)
                decode8(type, src + i * BB, tmp + (size_t)j * QE + i * QB, sc[j] + i * SB, mn[j] + i * SB);
        }
        /* codes: tmp[col][QE] as [col][QE/4] dwords -> codes[k/4][col] */
        int32_t *dst = (int32_t *)p->codes + (b * QB / 4) * NP8;
        for (int c0 = 0; c0 < QE / 4; c0 += 8)
            for (int n0 = 0; n0 < NP8; n0 += 8)
                tr8x8((const int32_t *)tmp + n0 * (QE / 4) + c0, QE / 4, dst + c0 * NP8 + n0, NP8);
        for (int s = 0; s < SE; s++) {
            const int64_t blk = b * SB + s;
            for (int j = 0; j < NP8; j++) {
                p->scale[blk * NP8 + j] = sc[j][s];
                p->mins[blk * NP8 + j] = mn[j][s];
            }
            /* -128 * sum of the block's codes, per column, from the packed codes */
            const __m256i one8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
            const int32_t *cg = dst + (s * G / 4) * NP8;
            for (int v = 0; v < NP8 / 8; v++) {
                __m256i acc = _mm256_setzero_si256();
                for (int g = 0; g < G / 4; g++) {
                    const __m256i c = _mm256_load_si256((const __m256i *)(cg + g * NP8 + 8 * v));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(one8, c), one16));
                }
                _mm256_store_si256((__m256i *)(p->corr + blk * NP8 + 8 * v),
                                   _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(acc, 7)));
            }
        }
    }
}

/* ---- AVX-512 VNNI micro-kernel: R <= MR8 rows x 32 columns, all of K -------------------- */
static inline __attribute__((always_inline)) VNNI8 void tile8_512(
        int R, int G, int MIN, const xq8 *a, int64_t r0, const panel8 *p, float *y, int64_t ldy,
        __mmask16 k0, __mmask16 k1) {
    const int64_t K = a->K, nb32 = K / 32, nblk = K / G;
    const uint8_t *xr = a->xu + r0 * K;
    const float *dxr = a->dx + r0 * nb32, *xsr = a->xs + r0 * nb32;
    __m512 fa[2 * MR8];
    for (int r = 0; r < 2 * R; r++) fa[r] = _mm512_setzero_ps();
    const int32_t *cw = (const int32_t *)p->codes;
    for (int64_t b = 0; b < nblk; b++) {
        const __m512i c0 = _mm512_load_si512(p->corr + b * NP8), c1 = _mm512_load_si512(p->corr + b * NP8 + 16);
        __m512i ia[2 * MR8];
        for (int r = 0; r < R; r++) ia[2 * r] = c0, ia[2 * r + 1] = c1;
        const int32_t *wb = cw + b * (G / 4) * NP8;
        const int64_t kk = b * G;
#pragma GCC unroll 8
        for (int g = 0; g < G / 4; g++) {
            const __m512i w0 = _mm512_load_si512(wb + g * NP8), w1 = _mm512_load_si512(wb + g * NP8 + 16);
            for (int r = 0; r < R; r++) {
                int32_t v;
                memcpy(&v, xr + r * K + kk + 4 * g, 4);
                const __m512i av = _mm512_set1_epi32(v);
                ia[2 * r] = _mm512_dpbusd_epi32(ia[2 * r], av, w0);
                ia[2 * r + 1] = _mm512_dpbusd_epi32(ia[2 * r + 1], av, w1);
            }
        }
        const __m512 s0 = _mm512_load_ps(p->scale + b * NP8), s1 = _mm512_load_ps(p->scale + b * NP8 + 16);
        const int64_t xb = kk / 32;
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_set1_ps(dxr[r * nb32 + xb]);
            fa[2 * r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[2 * r]), _mm512_mul_ps(s0, d), fa[2 * r]);
            fa[2 * r + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[2 * r + 1]), _mm512_mul_ps(s1, d), fa[2 * r + 1]);
        }
        if (MIN) {
            const __m512 m0 = _mm512_load_ps(p->mins + b * NP8), m1 = _mm512_load_ps(p->mins + b * NP8 + 16);
            for (int r = 0; r < R; r++) {
                const __m512 s = _mm512_set1_ps(xsr[r * nb32 + xb]);
                fa[2 * r] = _mm512_fnmadd_ps(m0, s, fa[2 * r]);
                fa[2 * r + 1] = _mm512_fnmadd_ps(m1, s, fa[2 * r + 1]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, k0, fa[2 * r]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, k1, fa[2 * r + 1]);
    }
}

static VNNI8 void rows8_512(int G, int MIN, const xq8 *a, const panel8 *p, float *y, int64_t ldy,
                            int cols) {
    const __mmask16 k0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    const int64_t M = a->M;
    for (int64_t m = 0; m < M; m += MR8) {
        const int R = M - m < MR8 ? (int)(M - m) : MR8;
        float *ym = y + m * ldy;
#define T8(n, g, mn) tile8_512(n, g, mn, a, m, p, ym, ldy, k0, k1)
#define T8R(g, mn) switch (R) { case 6: T8(6, g, mn); break; case 5: T8(5, g, mn); break;  \
        case 4: T8(4, g, mn); break; case 3: T8(3, g, mn); break; case 2: T8(2, g, mn); break; \
        default: T8(1, g, mn); }
        if (G == 16) { T8R(16, 0) }
        else if (MIN) { T8R(32, 1) }
        else { T8R(32, 0) }
#undef T8R
#undef T8
    }
}

/* ---- AVX2 micro-kernel: R <= MR8_256 rows x 16 columns (one half of the panel) ------------ */
static inline __attribute__((always_inline)) __m256i dp8_256(__m256i acc, __m256i a, __m256i w) {
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, w), _mm256_set1_epi16(1));
    return _mm256_add_epi32(acc, p);
}

static inline __attribute__((always_inline)) void tile8_256(
        int R, int G, int MIN, const xq8 *a, int64_t r0, const panel8 *p, int h, float *y,
        int64_t ldy, int cols) {
    const int64_t K = a->K, nb32 = K / 32, nblk = K / G;
    const uint8_t *xr = a->xu + r0 * K;
    const float *dxr = a->dx + r0 * nb32, *xsr = a->xs + r0 * nb32;
    __m256 fa[2 * MR8_256];
    for (int r = 0; r < 2 * R; r++) fa[r] = _mm256_setzero_ps();
    const int32_t *cw = (const int32_t *)p->codes + 16 * h;
    for (int64_t b = 0; b < nblk; b++) {
        const int32_t *cb = p->corr + b * NP8 + 16 * h;
        const __m256i c0 = _mm256_load_si256((const __m256i *)cb), c1 = _mm256_load_si256((const __m256i *)(cb + 8));
        __m256i ia[2 * MR8_256];
        for (int r = 0; r < R; r++) ia[2 * r] = c0, ia[2 * r + 1] = c1;
        const int32_t *wb = cw + b * (G / 4) * NP8;
        const int64_t kk = b * G;
#pragma GCC unroll 8
        for (int g = 0; g < G / 4; g++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(wb + g * NP8));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(wb + g * NP8 + 8));
            for (int r = 0; r < R; r++) {
                int32_t v;
                memcpy(&v, xr + r * K + kk + 4 * g, 4);
                const __m256i av = _mm256_set1_epi32(v);
                ia[2 * r] = dp8_256(ia[2 * r], av, w0);
                ia[2 * r + 1] = dp8_256(ia[2 * r + 1], av, w1);
            }
        }
        const float *sp = p->scale + b * NP8 + 16 * h;
        const __m256 s0 = _mm256_load_ps(sp), s1 = _mm256_load_ps(sp + 8);
        const int64_t xb = kk / 32;
        for (int r = 0; r < R; r++) {
            const __m256 d = _mm256_set1_ps(dxr[r * nb32 + xb]);
            fa[2 * r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[2 * r]), _mm256_mul_ps(s0, d), fa[2 * r]);
            fa[2 * r + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[2 * r + 1]), _mm256_mul_ps(s1, d), fa[2 * r + 1]);
        }
        if (MIN) {
            const float *mp = p->mins + b * NP8 + 16 * h;
            const __m256 m0 = _mm256_load_ps(mp), m1 = _mm256_load_ps(mp + 8);
            for (int r = 0; r < R; r++) {
                const __m256 s = _mm256_set1_ps(xsr[r * nb32 + xb]);
                fa[2 * r] = _mm256_fnmadd_ps(m0, s, fa[2 * r]);
                fa[2 * r + 1] = _mm256_fnmadd_ps(m1, s, fa[2 * r + 1]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        if (cols >= 16) {
            _mm256_storeu_ps(y + r * ldy, fa[2 * r]);
            _mm256_storeu_ps(y + r * ldy + 8, fa[2 * r + 1]);
        } else {
            float buf[16];
            _mm256_storeu_ps(buf, fa[2 * r]);
            _mm256_storeu_ps(buf + 8, fa[2 * r + 1]);
            memcpy(y + r * ldy, buf, sizeof(float) * (size_t)cols);
        }
    }
}

static void rows8_256(int G, int MIN, const xq8 *a, const panel8 *p, float *y, int64_t ldy,
                      int cols) {
    const int64_t M = a->M;
    for (int h = 0; h < 2 && 16 * h < cols; h++) {
        const int c = cols - 16 * h > 16 ? 16 : cols - 16 * h;
        for (int64_t m = 0; m < M; m += MR8_256) {
            const int R = M - m < MR8_256 ? (int)(M - m) : MR8_256;
            float *ym = y + m * ldy + 16 * h;
#define T8(n, g, mn) tile8_256(n, g, mn, a, m, p, h, ym, ldy, c)
#define T8R(g, mn) switch (R) { case 4: T8(4, g, mn); break; case 3: T8(3, g, mn); break; \
        case 2: T8(2, g, mn); break; default: T8(1, g, mn); }
            if (G == 16) { T8R(16, 0) }
            else if (MIN) { T8R(32, 1) }
            else { T8R(32, 0) }
#undef T8R
#undef T8
        }
    }
}

/* ---- the driver ---------------------------------------------------------------------------- */
static __thread uint8_t *xbuf;
static __thread size_t xbuf_size;

static VNNI8 void pack8_512(int type, const uint8_t *w, int64_t row_stride, int64_t p0, int rows,
                            int64_t K, int8_t *tmp, panel8 *p) {
    switch (type) {
    case GGML_Q4_0: pack8(GGML_Q4_0, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q4_1: pack8(GGML_Q4_1, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q5_0: pack8(GGML_Q5_0, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q5_1: pack8(GGML_Q5_1, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q8_0: pack8(GGML_Q8_0, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q4_K: pack8(GGML_Q4_K, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q5_K: pack8(GGML_Q5_K, w, row_stride, p0, rows, K, tmp, p); break;
    default: pack8(GGML_Q6_K, w, row_stride, p0, rows, K, tmp, p); break;
    }
}

static void pack8_256(int type, const uint8_t *w, int64_t row_stride, int64_t p0, int rows,
                      int64_t K, int8_t *tmp, panel8 *p) {
    switch (type) {
    case GGML_Q4_0: pack8(GGML_Q4_0, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q4_1: pack8(GGML_Q4_1, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q5_0: pack8(GGML_Q5_0, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q5_1: pack8(GGML_Q5_1, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q4_K: pack8(GGML_Q4_K, w, row_stride, p0, rows, K, tmp, p); break;
    case GGML_Q5_K: pack8(GGML_Q5_K, w, row_stride, p0, rows, K, tmp, p); break;
    default: pack8(GGML_Q6_K, w, row_stride, p0, rows, K, tmp, p); break;
    }
}

int iterserve_k_gemm8(int64_t type, const uint8_t *w, int64_t N, int64_t row_stride, int64_t K,
                      const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                      int nthreads) {
    if (!iterserve_can_gemm8(type) || K <= 0 || K % qb8((int)type)) return ITERSERVE_ETYPE;
    if (M < 1 || N < 1) return ITERSERVE_OK;
    const int wide = iterserve_st.int8 == 2;
    if (!wide && type == GGML_Q8_0) return ITERSERVE_ETYPE;     /* vpmaddubsw would saturate */
    const int64_t nb = K / 32;
    const size_t need = (size_t)(M * K) + 2 * (size_t)(M * nb) * sizeof(float) + 128;
    if (need > xbuf_size) {
        free(xbuf);
        xbuf = aligned_alloc(64, (need + 63) / 64 * 64);
        xbuf_size = xbuf ? need : 0;
        if (!xbuf) return ITERSERVE_ENOMEM;
    }
    xq8 a = {M, K, xbuf, (float *)(xbuf + (M * K + 63) / 64 * 64), NULL};
    a.xs = a.dx + M * nb;
    const int64_t npanels = (N + NP8 - 1) / NP8;
    if (nthreads < 1) nthreads = 1;
    const int G = g8((int)type), MIN = has_min8((int)type);
    int err = ITERSERVE_OK;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t r0 = M * t / T, r1 = M * (t + 1) / T;
        if (wide) quantise_rows512(x, ldx, r0, r1, &a);
        else quantise_rows(x, ldx, r0, r1, &a);
        panel8 p;
        int8_t tmp[NP8 * 256] __attribute__((aligned(64)));
        const int rc = panel_alloc(K, G, &p);
        if (rc) {
#pragma omp atomic write
            err = rc;
        }
#pragma omp barrier
        if (!err) {
            const int64_t q0 = npanels * t / T, q1 = npanels * (t + 1) / T;
            for (int64_t q = q0; q < q1; q++) {
                const int64_t p0 = q * NP8;
                const int rows = N - p0 < NP8 ? (int)(N - p0) : NP8;
                if (wide) {
                    pack8_512((int)type, w, row_stride, p0, rows, K, tmp, &p);
                    rows8_512(G, MIN, &a, &p, y + p0, ldy, rows);
                } else {
                    pack8_256((int)type, w, row_stride, p0, rows, K, tmp, &p);
                    rows8_256(G, MIN, &a, &p, y + p0, ldy, rows);
                }
            }
        }
    }
    return err;
}

/* ---- decode row counts: column tiles in the GEMM's arithmetic ------------------------------
 * Why: a sequence's logits must not depend on what else its step holds. The int8
 * GEMM above computes every output y[m][n] as one chain over the scale blocks of K, in order:
 *     acc = fma(float(I_b), fl(scale_b * dx_b), acc)   [then acc -= min_b * xs_b]
 * with I_b the exact integer dot of the block's codes and quantised activations, and the
 * activations quantised per row and per 32 elements (quantise_rows), so nothing depends on
 * M, the tile or the ISA. The decode kernels of earlier designs kept 8-16 float lanes per
 * output (partial sums across K) and so rounded differently: a row's result changed with
 * the kernel its step's row count chose. This kernel does the GEMM's arithmetic for any row
 * count without its panel transpose (which only pays from ~12 rows): 8 weight rows (output
 * columns) at a time, each type block decoded once per tile (decode8, the GEMM's decoder);
 * per activation row and 32 elements the 8 columns' integer partial sums (vpmaddubsw on
 * |code| and sign(x, code), vpmaddwd) are reduced with 6 vphaddd and 2 lane permutes into
 * one vector whose lane c is column c's exact block sum, and the float chain runs with lanes
 * = columns, as in the GEMM's micro-kernel. |code| <= 128 and |x| <= 127 keep the int16 pair
 * sums below 32768 for every type, Q8_0 included (the GEMM's unsigned-activation form
 * would saturate there on AVX2). AVX2 only: its lanes hold columns, so the AVX-512 GEMM and
 * this kernel agree bit for bit on any CPU. */
static inline __attribute__((always_inline)) __m256i dec8_sum8(const __m256i *v) {
    const __m256i q = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i p = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q, p, 0x20), _mm256_permute2x128_si256(q, p, 0x31));
}

static inline __attribute__((always_inline)) void dec8_tile(
        int type, const uint8_t *w, int64_t row_stride, int64_t c0, int nc, const xq8 *a,
        float *acc, int8_t *codes, int8_t *acodes, float *y, int64_t ldy) {
    const int QB = qb8(type), BB = bb8(type), G = g8(type), SB = QB / G, MIN = has_min8(type);
    const int64_t K = a->K, M = a->M, nbk = K / QB, nb32 = K / 32;
    const __m256i ones = _mm256_set1_epi16(1), x80 = _mm256_set1_epi8((char)0x80);
    float sc[8][16], mn[8][16];
    float scv[16][8] __attribute__((aligned(32))), mnv[16][8] __attribute__((aligned(32)));
    (void)acodes;
    memset(sc, 0, sizeof sc);
    memset(mn, 0, sizeof mn);
    memset(codes, 0, (size_t)8 * QB);
    for (int64_t i = 0; i < M * 8; i++) acc[i] = 0.f;
    for (int64_t b = 0; b < nbk; b++) {
        for (int c = 0; c < nc; c++) {
            const uint8_t *blk = w + (c0 + c) * row_stride + b * BB;
            if (b + 1 < nbk) _mm_prefetch((const char *)blk + 4 * BB, _MM_HINT_T0);
            decode8(type, blk, codes + c * QB, sc[c], mn[c]);
        }
        /* scales and mins with lanes = columns: 8x8 transposes of the decoded [column][block] */
        for (int j = 0; j < SB; j += 8) {
            tr8x8(&sc[0][j], 16, &scv[j][0], 8);
            if (MIN) tr8x8(&mn[0][j], 16, &mnv[j][0], 8);
        }
        if (SB == 1)
            for (int c = 0; c < 8; c++) scv[0][c] = sc[c][0], mnv[0][c] = mn[c][0];
        for (int64_t r = 0; r < M; r++) {
            const uint8_t *xr = a->xu + r * K + b * QB;
            const float *dxr = a->dx + r * nb32 + b * (QB / 32), *xsr = a->xs + r * nb32 + b * (QB / 32);
            __m256 fa = _mm256_loadu_ps(acc + 8 * r);
            for (int u = 0; u < QB / 32; u++) {                /* 32 elements: 1 or 2 blocks */
                const __m256i xq = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(xr + 32 * u)), x80);
                __m256i v[8];
                for (int c = 0; c < 8; c++) {
                    const __m256i cw = _mm256_loadu_si256((const __m256i *)(codes + c * QB + 32 * u));
                    v[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(cw),
                                                                  _mm256_sign_epi8(xq, cw)), ones);
                }
                const __m256 d = _mm256_set1_ps(dxr[u]);
                if (G == 32) {
                    const __m256i I = dec8_sum8(v);
                    fa = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(_mm256_load_ps(scv[u]), d), fa);
                    if (MIN) fa = _mm256_fnmadd_ps(_mm256_load_ps(mnv[u]), _mm256_set1_ps(xsr[u]), fa);
                } else {                                       /* Q6_K: two blocks of 16 */
                    const __m256i q = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                    const __m256i p = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
                    const __m256i I0 = _mm256_permute2x128_si256(q, p, 0x20);
                    const __m256i I1 = _mm256_permute2x128_si256(q, p, 0x31);
                    fa = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I0), _mm256_mul_ps(_mm256_load_ps(scv[2 * u]), d), fa);
                    fa = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I1), _mm256_mul_ps(_mm256_load_ps(scv[2 * u + 1]), d), fa);
                }
            }
            _mm256_storeu_ps(acc + 8 * r, fa);
        }
    }
    for (int64_t r = 0; r < M; r++) memcpy(y + r * ldy + c0, acc + 8 * r, sizeof(float) * (size_t)nc);
}

static __thread uint8_t *dbuf;
static __thread size_t dbuf_size;

int iterserve_k_dec8(int64_t type, const uint8_t *w, int64_t N, int64_t row_stride, int64_t K,
                     const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                     int nthreads) {
    if (!iterserve_can_gemm8(type) || K <= 0 || K % qb8((int)type)) return ITERSERVE_ETYPE;
    if (M < 1 || N < 1) return ITERSERVE_OK;
    const int wide = iterserve_st.int8 == 2;
    const int64_t nb = K / 32;
    const size_t need = (size_t)(M * K) + 2 * (size_t)(M * nb) * sizeof(float) + 128;
    if (need > xbuf_size) {
        free(xbuf);
        xbuf = aligned_alloc(64, (need + 63) / 64 * 64);
        xbuf_size = xbuf ? need : 0;
        if (!xbuf) return ITERSERVE_ENOMEM;
    }
    xq8 a = {M, K, xbuf, (float *)(xbuf + (M * K + 63) / 64 * 64), NULL};
    a.xs = a.dx + M * nb;
    const int64_t ntiles = (N + 7) / 8;
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
    int err = ITERSERVE_OK;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t r0 = M * t / T, r1 = M * (t + 1) / T;
        if (wide) quantise_rows512(x, ldx, r0, r1, &a);
        else quantise_rows(x, ldx, r0, r1, &a);
        const size_t mine = (size_t)M * 8 * sizeof(float) + 2 * 8 * 256 + 64;
        if (mine > dbuf_size) {
            free(dbuf);
            dbuf = aligned_alloc(64, (mine + 63) / 64 * 64);
            dbuf_size = dbuf ? mine : 0;
        }
        if (!dbuf) {
#pragma omp atomic write
            err = ITERSERVE_ENOMEM;
        }
#pragma omp barrier
        if (!err) {
            float *acc = (float *)dbuf;
            int8_t *codes = (int8_t *)(dbuf + (size_t)M * 8 * sizeof(float));
            int8_t *acodes = codes + 8 * 256;
            const int64_t q0 = ntiles * t / T, q1 = ntiles * (t + 1) / T;
            for (int64_t q = q0; q < q1; q++) {
                const int64_t c0 = 8 * q;
                const int nc = N - c0 < 8 ? (int)(N - c0) : 8;
                switch (type) {
#define D8(TY) case TY: dec8_tile(TY, w, row_stride, c0, nc, &a, acc, codes, acodes, y, ldy); break;
                D8(GGML_Q4_0) D8(GGML_Q4_1) D8(GGML_Q5_0) D8(GGML_Q5_1) D8(GGML_Q8_0)
                D8(GGML_Q4_K) D8(GGML_Q5_K)
                default: dec8_tile(GGML_Q6_K, w, row_stride, c0, nc, &a, acc, codes, acodes, y, ldy);
#undef D8
                }
            }
        }
    }
    return err;
}
