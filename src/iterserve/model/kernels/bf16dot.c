/* BF16 (and optionally F16) weight GEMMs on AVX-512 BF16 dot products (vdpbf16ps), for the
 * decode steps and the prefill chunks of bf16 checkpoints (HF safetensors, BF16 GGUFs).
 *
 * Why: the float path (qgemm.c's register kernels, prefill.c's panels) widens every bf16
 * weight to float32 and multiplies it with float32 FMAs: 16 products per instruction, plus
 * the widening. vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 float32
 * accumulators in one instruction, straight from the weight bytes as they lie in the file,
 * so a bf16 GEMM does twice the products per instruction and no widening; at decode batches
 * of 8 and in prefill a 1.7B bf16 model is bound by exactly those instructions (vLLM's CPU
 * build, via oneDNN, uses the same instruction, and was 1.6x iterserve on `mix`).
 *
 * The price is the activations: vdpbf16ps takes bf16 on both sides, so each activation row is
 * rounded to bf16 (round to nearest even, like torch's .to(bfloat16)) once per call into a
 * per-thread scratch. Products of two bf16 are exact in float32 and are summed in float32,
 * so the result is x rounded to bf16, times W, in float32 (denormal inputs flushed to zero by
 * the instruction): relative error per output about 2^-9 of sum |x_j w_j| (tests check this
 * against x.bfloat16() @ W in float64, and the float path with bf16 tolerances). It is used in
 * the `auto` activation mode (iterserve_bf16_takes) on CPUs with avx512bf16 only; `float`
 * keeps the exact float32 path (the numerical reference), `int8` treats BF16 like `float`.
 *
 * Kernels, all reading the weight rows unchanged (no copy of the checkpoint):
 * - decode (M <= BF16_PANEL_ROWS - 1 activation rows): tiles of R <= 8 rows times C weight
 *   rows at a time (C = 8 at 1 row ... 3 at 8, so R*C >= 8 independent accumulator chains
 *   hide the instruction's latency): per 32 elements, C weight loads, R activation loads and
 *   R*C vdpbf16ps; threads split the weight rows. Each weight row is read once from start to
 *   end (decode_stream below), the next group of rows prefetched, every row tile per group
 *   of weight rows: K split into L1-sized strips of the activations instead ran a batch-8
 *   step of the 1.7B model at 19.3 GB/s (0.48 of the measured bandwidth, quiet profile), the
 *   whole rows 1.3-1.8x faster at 8 rows, 1.1-1.2x at 3-4 (one thread), equal at 1-2 (the
 *   hardware prefetcher already follows whole rows there); end to end 1.31x and 1.45x at
 *   batch 8. `mix` at 8 slots is 94% decode steps (bench_bf16.py --mix-split), 60% of them
 *   at 1-3 rows.
 * - panel (prefill, large batches): BLIS-style like prefill.c, but a "packed" panel is just
 *   the weight's own bf16 pairs transposed: bp[k/2][48] 32-bit lanes = (w[c][k], w[c][k+1])
 *   for 48 weight rows c, by 16x16 transposes of 32-bit words (no conversion at all for
 *   BF16); activations packed per tile of MR rows as [k/2][MR] pairs (plain rows K * 2 bytes
 *   apart share L1 sets); micro-kernel MR = 8 rows x NP = 48 columns = 24 zmm accumulators,
 *   per k pair 3 weight loads, one broadcast of the activation pair and 3 vdpbf16ps per row.
 *   Tile shapes, same process, alternating, one thread, 512 rows of 2048x2048 / 2048x8192,
 *   loaded machine (GFLOP/s): 12x32 110 / 104, 8x48 123 / 114, 6x64 125 / 103; torch's own
 *   bf16 matmul (oneDNN) 133 / 130 in the same run (bf16 output;
 *   kept ours for float32 outputs, one entry point for the fused and per-module paths and
 *   no per-shape oneDNN primitives). bench_bf16.py, one thread, loaded: torch
 *   (x.bfloat16() @ W^T, then .float()) over ours in time 0.96-1.09 at 128 rows and
 *   0.98 / 0.98 / 0.86 at 512 rows (qo / gate_up / down): equal but for `down` at 512 rows
 *   (torch 1.16x), and `mix`'s prefill steps are ~6% of its time with chunks of <= ~200 rows,
 *   so ours stays (float32 outputs; torch's CPU matmul has no float32 output for bf16 inputs).
 *   The compute bound: vdpbf16ps peaks at ~480 GFLOP/s per core here (2 per cycle); the
 *   panel reaches ~40% of it, oneDNN the same.
 *
 * F16 weights (f16 GGUFs): see F16_DOT_ROWS below for what was measured; F16 -> bf16 drops 3
 * of the 10 mantissa bits of every weight, which the F16C float path does not.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "scratch.h"
#include "transpose.h"

#define BF16 __attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16")))
#define BF16_INLINE static inline __attribute__((always_inline)) BF16

/* F16 weights (f16 GGUFs) in the auto mode (dispatch.c's F16_DOT_ROWS): each weight is
 * widened (F16C) and rounded to bf16 in the panel packer (once per call, shared by all rows),
 * then dotted like BF16. The cost is 3 of f16's 10 mantissa bits per weight (relative 2^-9,
 * the size of the activation rounding). Measured, same process, alternating, loaded machine:
 * bench_bf16.py --types F16 (one thread, F16C float path / bf16 dot): 0.74x at 1 row, 0.80-
 * 2.54x at 8 rows by shape (2048x8192 slower), 1.98x at 128 rows; end to end (1.7B F16 GGUF,
 * batch 8, 2 threads, decode kernel at 8 rows) auto / float 0.78x, while the same A/B on the
 * bf16 directory gave 1.54x: in the decode kernel the 3 conversion instructions per 32
 * weights are paid once per tile of <= 8 rows and compete with the dot products, in the panel
 * GEMM once per call. So F16 decode steps take f16dot.c's exact kernels and only prefill
 * chunks and large batches take the bf16 panel. */

/* From this many rows on the panel kernel runs (benchmarks/bench_bf16.py rows; dispatch.c). */
#define BF16_PANEL_ROWS 16

#ifndef NP
#define NP 48                  /* weight rows per panel (a multiple of 16) */
#endif
#define NB (NP / 16)           /* zmm accumulators per activation row */
#ifndef KC
#define KC 256                 /* K elements per panel chunk (bp: 128 pairs x 48 x 4 B = 24 KB) */
#endif
#ifndef MR
#define MR 8                   /* activation rows per micro-tile (MR * NB <= 24, MR <= 12) */
#endif
#define MB_MAX 256             /* activation rows per row block (prefill.c's reasoning) */

/* --- activations rounded to bf16, once per call --------------------------------------- */
static __thread void *xb_buf = NULL;
static __thread size_t xb_cap = 0;   /* bytes */

static uint16_t *xb_scratch(size_t elems) {
    return scratch_grow(&xb_buf, &xb_cap, elems * sizeof(uint16_t));
}

static BF16 void round_rows(const float *x, int64_t M, int64_t ldx, int64_t K, uint16_t *xb,
                            int64_t ldb, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        uint16_t *d = xb + m * ldb;
        for (int64_t j = 0; j < K; j += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + j + 16),
                                                   _mm512_loadu_ps(xr + j));
            _mm512_storeu_si512((void *)(d + j), (__m512i)v);
        }
    }
}

/* The panel kernel's activations: tiles of MR rows, each [K/2][MR] bf16 pairs (the pairs one
 * micro-kernel step broadcasts lie side by side; rows of a plain layout K * 2 bytes apart
 * fall into the same L1 sets when K is a multiple of 2,048); rows past M are zero. */
static BF16 void pack_rows(const float *x, int64_t M, int64_t ldx, int64_t K, uint32_t *xp,
                           int nthreads) {
    const int64_t tiles = (M + MR - 1) / MR;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
    for (int64_t tl = 0; tl < tiles; tl++) {
        uint32_t *d = xp + tl * (K / 2) * MR;
        for (int r = 0; r < MR; r++) {
            const int64_t m = tl * MR + r;
            if (m >= M) {
                for (int64_t p = 0; p < K / 2; p++) d[p * MR + r] = 0;
                continue;
            }
            const float *xr = x + m * ldx;
            for (int64_t j = 0; j < K; j += 32) {
                uint32_t v[16];
                _mm512_storeu_si512((void *)v, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(xr + j + 16), _mm512_loadu_ps(xr + j)));
                for (int i = 0; i < 16; i++) d[(j / 2 + i) * MR + r] = v[i];
            }
        }
    }
}

/* 32 weights of a row at element j as 32 bf16 (F16: widened, then rounded to bf16) */
BF16_INLINE __m512bh wload(int type, const uint8_t *row, int64_t j) {
    if (type == GGML_F16) {
        const __m256i *p = (const __m256i *)(row + 2 * j);
        return _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm256_loadu_si256(p + 1)),
                                   _mm512_cvtph_ps(_mm256_loadu_si256(p)));
    }
    return (__m512bh)_mm512_loadu_si512((const void *)(row + 2 * j));
}

/* --- decode, streamed: R activation rows x C weight rows, whole rows, next tile prefetched ---
 * K chunks would cut each weight row into strips of ~2.7 KB, read 64 rows apart, which the
 * hardware prefetchers do not follow, so each strip would start with DRAM misses. This reads each weight
 * row once from start to end and, while it multiplies rows c..c+C-1 at element j, prefetches
 * element j of the next C rows (one software prefetch per weight load, one tile ahead: the
 * lead is a tile's run time, ~0.2-0.5 us, longer than a DRAM miss). All row tiles of a
 * call run on a group of C weight rows before the next (the C rows, <= 48 KB, stay in L1/L2
 * for the second to fourth tile); the activation rows are read from L1/L2 (<= 8 x 16 KB). */
/* from this many activation rows per tile on, the next tile's weights are prefetched (at 1-2 rows
 * the hardware prefetcher keeps up and the prefetches only take load slots) */
#ifndef PF_MIN_R
#define PF_MIN_R 3
#endif
/* [sum(a), sum(b), sum(c), sum(d)] of four float32 vectors (AVX-512F shuffles only). */
#ifndef HSUM4
#define HSUM4 1
#endif
BF16_INLINE __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* 128-bit lanes [a0+a2, a1+a3, b0+b2, b1+b3] and likewise for c, d */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane k: the four partial sums of the k-th vector */
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, t));
}

BF16_INLINE void tile_pf(int R, int C, int type, const uint16_t *xb, int64_t ldb, int64_t K,
                         const uint8_t *w, int64_t row_stride, const uint8_t *wn, float *y,
                         int64_t ldy) {
    __m512 acc[24];
    for (int i = 0; i < R * C; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K; j += 32) {
        __m512bh wv[8];
        for (int c = 0; c < C; c++) {
            wv[c] = wload(type, w + c * row_stride, j);
            if (R >= PF_MIN_R) _mm_prefetch((const char *)(wn + c * row_stride + 2 * j), _MM_HINT_T0);
        }
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + r * ldb + j));
            for (int c = 0; c < C; c++) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], xv, wv[c]);
        }
    }
    /* the sums four accumulators at a time (hsum4: 14 instructions for 4 sums, against ~8 per
     * sum of _mm512_reduce_add_ps; ~10% of a tile at K = 2,048), then the odd ones */
    float s[24];
    int i = 0;
    if (HSUM4)
        for (; i + 4 <= R * C; i += 4)
            _mm_storeu_ps(s + i, hsum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
    for (; i < R * C; i++) s[i] = _mm512_reduce_add_ps(acc[i]);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ldy + c] = s[r * C + c];
}

/* C weight rows per group for tiles of up to R activation rows (R*C <= 24 accumulators) */
/* by R (the largest tile of the call); R * C <= 24 and C in {8, 6, 4, 3} (the cases compiled
 * below). A table so that a benchmark harness compiled with this file can vary it in one
 * process (under load no other choice beat these). */
static int pf_cols[9] = {8, 8, 6, 4, 4, 4, 4, 3, 3};
#define PF_COLS(R) pf_cols[R]

#define PF_R(RR, CC, TYPE) case RR: if (RR * CC <= 24) tile_pf(RR, CC, TYPE, xt, ldb, K, wc, row_stride, wn, yt, ldy); break;
#define PF_TILE(CC, TYPE) switch (R) { PF_R(8, CC, TYPE) PF_R(7, CC, TYPE) PF_R(6, CC, TYPE)  \
    PF_R(5, CC, TYPE) PF_R(4, CC, TYPE) PF_R(3, CC, TYPE) PF_R(2, CC, TYPE)                   \
    default: tile_pf(1, CC, TYPE, xt, ldb, K, wc, row_stride, wn, yt, ldy); }

/* one group of CC weight rows at wc (next group at wn) against all row tiles of x */
#define PF_GROUP(CC, TYPE)                                                                   \
    for (int64_t tile = 0; tile < ntiles; tile++) {                                          \
        const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;                  \
        const uint16_t *xt = xb + r0 * ldb;                                                  \
        float *yt = y + r0 * ldy + c;                                                        \
        const int R = (int)(r1 - r0);                                                        \
        PF_TILE(CC, TYPE)                                                                    \
    }

static BF16 void decode_stream_t(int type, const uint8_t *w, int64_t n0, int64_t n1,
                                 int64_t N, int64_t row_stride, int64_t K, const uint16_t *xb,
                                 int64_t ldb, int64_t M, float *y, int64_t ldy) {
    const int64_t ntiles = (M + 7) / 8;
    const int64_t Rmax = (M + ntiles - 1) / ntiles;
    const int CC = PF_COLS(Rmax);
    int64_t c = n0;
#define PF_RUN(CCV, TYPE)                                                                    \
    for (; c + CCV <= n1; c += CCV) {                                                        \
        const uint8_t *wc = w + c * row_stride;                                              \
        const uint8_t *wn = c + 2 * CCV <= N ? wc + CCV * row_stride : wc;                   \
        PF_GROUP(CCV, TYPE)                                                                  \
    }
    if (type == GGML_F16) {
        switch (CC) { case 8: PF_RUN(8, GGML_F16) break; case 6: PF_RUN(6, GGML_F16) break;
                      case 4: PF_RUN(4, GGML_F16) break; default: PF_RUN(3, GGML_F16) }
        for (; c < n1; c++) { const uint8_t *wc = w + c * row_stride, *wn = wc; PF_GROUP(1, GGML_F16) }
    } else {
        switch (CC) { case 8: PF_RUN(8, GGML_BF16) break; case 6: PF_RUN(6, GGML_BF16) break;
                      case 4: PF_RUN(4, GGML_BF16) break; default: PF_RUN(3, GGML_BF16) }
        for (; c < n1; c++) { const uint8_t *wc = w + c * row_stride, *wn = wc; PF_GROUP(1, GGML_BF16) }
    }
#undef PF_RUN
}

static BF16 void decode_stream(int type, const uint8_t *w, int64_t N, int64_t row_stride,
                               int64_t K, const uint16_t *xb, int64_t ldb, int64_t M, float *y,
                               int64_t ldy, int nthreads) {
    if (N < 64 * nthreads) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        /* split on multiples of 24 weight rows (whole groups of 8, 6, 4 or 3) */
        const int64_t g = (N + 23) / 24;
        const int64_t n0 = g * t / T * 24, n1e = g * (t + 1) / T * 24, n1 = n1e < N ? n1e : N;
        if (n0 < n1) decode_stream_t(type, w, n0, n1, N, row_stride, K, xb, ldb, M, y, ldy);
    }
}

/* --- panel GEMM -------------------------------------------------------------------------- */
/* bp[p][c] (p < kc/2, c < NP) = the bf16 pair (w[p0+c][k0+2p], w[p0+c][k0+2p+1]); rows past
 * `rows` are zero. F16 rows are rounded to bf16 into tmp (16 rows x KC) first. */
static BF16 void pack_bf16(int type, const uint8_t *w, int64_t row_stride, int64_t p0, int rows,
                           int64_t k0, int kc, uint16_t *tmp, uint32_t *bp) {
    for (int h = 0; h < NP / 16; h++) {
        const int live = rows - 16 * h < 16 ? rows - 16 * h : 16;
        if (live <= 0) {
            for (int p = 0; p < kc / 2; p++)
                _mm512_store_si512((void *)(bp + p * NP + 16 * h), _mm512_setzero_si512());
            continue;
        }
        const uint8_t *w0 = w + (p0 + 16 * h) * row_stride + 2 * k0;
        if (type == GGML_BF16 && live == 16 && row_stride % 4 == 0) {
            for (int q = 0; q < kc / 2; q += 16)
                tr16x16((const uint32_t *)w0 + q, row_stride / 4, bp + q * NP + 16 * h, NP);
            continue;
        }
        for (int j = 0; j < 16; j++) {
            uint16_t *d = tmp + j * KC;
            if (j >= live) { memset(d, 0, sizeof(uint16_t) * (size_t)kc); continue; }
            const uint8_t *row = w0 + j * row_stride;
            for (int e = 0; e < kc; e += 32)
                _mm512_storeu_si512((void *)(d + e), (__m512i)wload(type, row, e));
        }
        for (int q = 0; q < kc / 2; q += 16)
            tr16x16((const uint32_t *)tmp + q, KC / 2, bp + q * NP + 16 * h, NP);
    }
}

BF16_INLINE void micro(int R, const uint32_t *xp, const uint32_t *bp, int kc,
                       float *y, int64_t ldy, int add, const __mmask16 *mk) {
    __m512 acc[NB * 12];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NB; i++)
            acc[NB * r + i] = add ? _mm512_maskz_loadu_ps(mk[i], y + r * ldy + 16 * i)
                                  : _mm512_setzero_ps();
    for (int p = 0; p < kc / 2; p++) {
        __m512bh b[NB];
        for (int i = 0; i < NB; i++)
            b[i] = (__m512bh)_mm512_load_si512((const void *)(bp + p * NP + 16 * i));
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[p * MR + r]);
            for (int i = 0; i < NB; i++) acc[NB * r + i] = _mm512_dpbf16_ps(acc[NB * r + i], a, b[i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NB; i++) _mm512_mask_storeu_ps(y + r * ldy + 16 * i, mk[i], acc[NB * r + i]);
}

/* rows [0, M) of a row block: xp its first tile at pair k0/2 (tile stride K/2 * MR) */
static BF16 void micro_rows(int64_t M, const uint32_t *xp, int64_t K, const uint32_t *bp,
                            int kc, float *y, int64_t ldy, int add, int cols) {
    __mmask16 mk[NB];
    for (int i = 0; i < NB; i++) {
        const int c = cols - 16 * i;
        mk[i] = c >= 16 ? 0xFFFF : c <= 0 ? 0 : (__mmask16)((1u << c) - 1);
    }
    for (int64_t m = 0; m < M; m += MR) {
        const int R = M - m < MR ? (int)(M - m) : MR;
        const uint32_t *xm = xp + (m / MR) * (K / 2) * MR;
        float *ym = y + m * ldy;
#define MT(n) case n: if (n <= MR) micro(n, xm, bp, kc, ym, ldy, add, mk); break;
        switch (R) {
        MT(12) MT(11) MT(10) MT(9) MT(8) MT(7) MT(6) MT(5) MT(4) MT(3) MT(2)
        default: micro(1, xm, bp, kc, ym, ldy, add, mk);
        }
#undef MT
    }
}

static BF16 int panel_bf16(int type, const uint8_t *w, int64_t N, int64_t row_stride, int64_t K,
                           const uint32_t *xp, int64_t M, float *y, int64_t ldy, int nthreads) {
    const int64_t npanels = (N + NP - 1) / NP;
    if (npanels < nthreads) nthreads = (int)npanels;
    int err = ITERSERVE_OK;
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *bp = aligned_alloc(64, sizeof(uint32_t) * NP * (KC / 2));
        uint16_t *tmp = aligned_alloc(64, sizeof(uint16_t) * 16 * KC);
        if (!bp || !tmp) {
#pragma omp atomic write
            err = ITERSERVE_ENOMEM;
        } else {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            const int64_t q0 = npanels * t / T, q1 = npanels * (t + 1) / T;
            const int64_t nmb = (M + MB_MAX - 1) / MB_MAX;
            const int64_t MB = ((M + nmb - 1) / nmb + MR - 1) / MR * MR;
            for (int64_t m0 = 0; m0 < M; m0 += MB) {
                const int64_t mb = M - m0 < MB ? M - m0 : MB;
                for (int64_t q = q0; q < q1; q++) {
                    const int64_t p0 = q * NP;
                    const int rows = N - p0 < NP ? (int)(N - p0) : NP;
                    for (int64_t k0 = 0; k0 < K; k0 += KC) {
                        const int kc = K - k0 < KC ? (int)(K - k0) : KC;
                        pack_bf16(type, w, row_stride, p0, rows, k0, kc, tmp, bp);
                        micro_rows(mb, xp + (m0 / MR) * (K / 2) * MR + (k0 / 2) * MR, K, bp, kc, y + m0 * ldy + p0, ldy,
                                   k0 > 0, rows);
                    }
                }
            }
        }
        free(bp);
        free(tmp);
    }
    return err;
}

/* path 0: by row count (BF16_PANEL_ROWS); 1: the decode kernel; 2: the panel kernel. */
int iterserve_k_bf16(int64_t path, int64_t type, const uint8_t *w, int64_t n,
                     int64_t row_stride, int64_t k, const float *x, int64_t M, int64_t ldx,
                     float *y, int64_t ldy, int nthreads) {
    if ((type != GGML_BF16 && type != GGML_F16) || k % 32 || !iterserve_st.bf16)
        return ITERSERVE_ETYPE;
    if (M < 1 || n < 1) return ITERSERVE_OK;
    if (nthreads < 1) nthreads = 1;
    const int panel = path == 2 || (path != 1 && M >= BF16_PANEL_ROWS);
    if (panel) {
        const int64_t tiles = (M + MR - 1) / MR;
        uint16_t *xp = xb_scratch((size_t)tiles * MR * (size_t)k);
        if (!xp) return ITERSERVE_ENOMEM;
        pack_rows(x, M, ldx, k, (uint32_t *)xp, nthreads);
        return panel_bf16((int)type, w, n, row_stride, k, (const uint32_t *)xp, M, y, ldy, nthreads);
    }
    /* rows 64 bytes more than K apart, so that they do not share L1 sets */
    const int64_t ldb = k + 32;
    uint16_t *xb = xb_scratch((size_t)M * (size_t)ldb);
    if (!xb) return ITERSERVE_ENOMEM;
    round_rows(x, M, ldx, k, xb, ldb, nthreads);
    decode_stream((int)type, w, n, row_stride, k, xb, ldb, M, y, ldy, nthreads);
    return ITERSERVE_OK;
}
