/* Streamed decode kernels for F16 weights (f16 GGUFs, fp16 checkpoints): y[M, n] = x . W^T
 * for decode steps of 1..16 activation rows (dispatch.c), exact float32 arithmetic.
 *
 * Why: qgemm.c's register kernel at 1-2 rows (F16 as 32-element pseudo-blocks, K chunks of
 * the activations) and prefill.c's float32 panel GEMM from 3 rows (every weight panel
 * converted and packed into a scratch, then re-read) made a batch-8 step of the 1.7B F16
 * GGUF take ~240 ms while bf16dot.c's streamed kernel made the same step of the bf16
 * checkpoint in ~124 ms. This is bf16dot.c's streamed design for F16: each
 * weight row is read once from start to end, no packing, no K chunks; while a tile multiplies
 * weight rows c..c+C-1 it prefetches the same elements of the next C rows; all row tiles of a
 * call (tiles of <= 8 activation rows) run on one group of C weight rows before the next, so
 * the group (<= 3 x 16 KB) is re-read from L1/L2 by the second tile.
 *
 * Arithmetic: each f16 weight is widened exactly to float32 (vcvtph2ps: 16 halves into a zmm on
 * AVX-512F, 8 into a ymm with F16C on AVX2) and multiplied with the float32 activations in
 * float32 FMAs, so the result equals a float32 GEMM over gguf-py's dequantised weights up to
 * summation order (the same contract as qgemm.c's kernels; no activation rounding, unlike
 * bf16dot.c's F16 panel path, which rounds both sides to bf16). So it runs in every activation
 * mode, `float` included.
 *
 * A file of its own (not bf16dot.c): bf16dot.c's functions are compiled for avx512bf16 and
 * only run on CPUs that have it, while these need only AVX-512F (or AVX2 + FMA + F16C), i.e.
 * every CPU the kernels run on; and the product is exact, not bf16-rounded.
 *
 * Dispatch: dispatch.c hands F16 calls of 1..16 rows here, so the per-module path and the fused
 * decode layers (decode_layers.c, which call iterserve_qgemm) run the same code and stay
 * bit-identical. The ISA follows iterserve_st.wide (tests force AVX2 on an AVX-512 CPU).
 * Prefill (kernels.gemm) takes prefill.c / bf16dot.c's panel GEMMs.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "simd.h"
#include "scratch.h"

#define A512 __attribute__((target("avx512f,avx512vl,avx512bw,f16c,fma")))
#define A512_INLINE static inline __attribute__((always_inline)) A512
#define A2_INLINE static inline __attribute__((always_inline))

/* Against the register kernel (1-2 rows) and the float32 panel (from 3 rows) it replaced
 * (bench_bf16.py --types F16 --shapes qo gate down, same process, alternating, medians of 7,
 * loaded shared 2-core machine; benchmarks/results/f16-kernels-t{1,2}.json), time ratio qo
 * 2048x2048 / gate 8192x2048 / down 2048x8192:
 * - 1-2 rows: 0.82-0.91 / 0.99-1.11 / 0.93-1.16 (qo, 8 MB, is partly cache-resident);
 * - 4 rows: 1.71-2.39 / 2.29-2.30 / 1.31-1.45; 8 rows: 1.19-1.49 / 1.51-1.56 / 1.55-1.65;
 *   12 rows: 1.14-1.36 / 1.29-1.39 / 1.63-1.70;
 * - 16 rows against bf16dot.c's bf16 panel 0.87-1.00 / 0.95-1.13 / 1.27-1.31, against the
 *   float32 panel 1.07 / 1.12 / 1.27-1.46 at 16, 0.87 / 0.96 / 0.96-1.05 at 24: hence up to
 *   16 rows (dispatch.c).
 * End to end (1.7B F16 GGUF, 2 threads, 16 steps, medians of 3, loaded): 2.26x at batch 8
 * (6.8 -> 15.4 tok/s), 1.73x at batch 3, 1.27x at batch 1. The batch-8 tile (8 x 3 weight
 * rows, 24 FMAs per 3 weight loads) is bound by FMA throughput, ~16 GB/s of f16 weights per
 * core; bf16dot.c's vdpbf16ps does twice the products per instruction, but rounds both
 * sides to bf16. AVX2 is measured on this CPU by forcing it: level with AVX-512 at 1-4 rows,
 * about half from 8. */
/* from this many rows per tile on, the next group's weights are prefetched (bf16dot.c's
 * PF_MIN_R: at 1-2 rows the hardware prefetcher keeps up with whole rows) */
#ifndef F16_PF_MIN_R
#define F16_PF_MIN_R 3
#endif

/* --- activations: copied once per call into rows 64 bytes more than a multiple of K apart ---
 * (rows K * 4 bytes apart, K a multiple of 1,024, all fall into the same L1 sets) */
static __thread void *xs_buf = NULL;
static __thread size_t xs_cap = 0;   /* bytes */

static float *xs_scratch(size_t elems) {
    return scratch_grow(&xs_buf, &xs_cap, elems * sizeof(float));
}

/* --- AVX-512: R activation rows x C weight rows, 16 elements per step ------------------- */
A512_INLINE __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, t));
}

A512_INLINE void tile512(int R, int C, const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                         int64_t rs, const uint8_t *wn, float *y, int64_t ldy) {
    __m512 acc[24];
    for (int i = 0; i < R * C; i++) acc[i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= K; j += 32) {            /* 64 bytes of each weight row per step */
        for (int h = 0; h < 2; h++) {
            __m512 wv[8];
            for (int c = 0; c < C; c++) {
                wv[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + c * rs + 2 * (j + 16 * h))));
                if (h == 0 && R >= F16_PF_MIN_R)
                    _mm_prefetch((const char *)(wn + c * rs + 2 * j), _MM_HINT_T0);
            }
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_loadu_ps(x + r * ldx + j + 16 * h);
                for (int c = 0; c < C; c++) acc[r * C + c] = _mm512_fmadd_ps(xv, wv[c], acc[r * C + c]);
            }
        }
    }
    for (; j < K; j += 16) {                  /* the tail: 1..31 elements, masked */
        const int64_t left = K - j;
        const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512 wv[8];
        for (int c = 0; c < C; c++)
            wv[c] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const void *)(w + c * rs + 2 * j)));
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mk, x + r * ldx + j);
            for (int c = 0; c < C; c++) acc[r * C + c] = _mm512_fmadd_ps(xv, wv[c], acc[r * C + c]);
        }
    }
    float s[24];
    int i = 0;
    for (; i + 4 <= R * C; i += 4) _mm_storeu_ps(s + i, hsum4_512(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
    for (; i < R * C; i++) s[i] = _mm512_reduce_add_ps(acc[i]);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ldy + c] = s[r * C + c];
}

/* 1-2 activation rows: one weight row at a time (C = 1), four accumulators per row. The
 * weight rows of a call lie end to end, so a thread reads its share as one sequential stream,
 * which the hardware prefetcher follows best; C = 2..8 rows side by side (the tile above)
 * read 20-45% slower at 1 row on qo / gate shapes (one thread, loaded machine). */
A512_INLINE void row512(int R, const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                        float *y, int64_t ldy) {
    __m512 acc[8];
    for (int i = 0; i < 4 * R; i++) acc[i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 64 <= K; j += 64)
        for (int u = 0; u < 4; u++) {
            const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * (j + 16 * u))));
            for (int r = 0; r < R; r++)
                acc[4 * r + u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + j + 16 * u), wv, acc[4 * r + u]);
        }
    for (; j < K; j += 16) {
        const int64_t left = K - j;
        const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 wv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const void *)(w + 2 * j)));
        for (int r = 0; r < R; r++)
            acc[4 * r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, x + r * ldx + j), wv, acc[4 * r]);
    }
    for (int r = 0; r < R; r++)
        y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[4 * r], acc[4 * r + 1]),
                                                        _mm512_add_ps(acc[4 * r + 2], acc[4 * r + 3])));
}

/* C weight rows per group for tiles of up to R rows: R*C accumulators + C weights + 1 x <= 32
 * zmm, R*C >= 8 chains (FMA latency 4 x 2 per cycle). A table so a benchmark harness compiled
 * with this file can vary it. */
static int cols512[9] = {8, 8, 8, 6, 4, 4, 4, 3, 3};

/* --- AVX2 + F16C: 8 elements per step, 16 ymm: R*C accumulators + 1 weight + 1 x ---------- */
A2_INLINE void tile256(int R, int C, const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                       int64_t rs, const uint8_t *wn, float *y, int64_t ldy) {
    __m256 acc[12];
    for (int i = 0; i < R * C; i++) acc[i] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= K; j += 32) {
        for (int c = 0; c < C; c++)
            if (R >= F16_PF_MIN_R) _mm_prefetch((const char *)(wn + c * rs + 2 * j), _MM_HINT_T0);
        for (int h = 0; h < 4; h++)
            for (int c = 0; c < C; c++) {
                const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + c * rs + 2 * (j + 8 * h))));
                for (int r = 0; r < R; r++)
                    acc[r * C + c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + j + 8 * h), wv, acc[r * C + c]);
            }
    }
    for (; j < K; j += 8) {                   /* the tail: through a zero-padded copy */
        const int64_t left = K - j < 8 ? K - j : 8;
        for (int c = 0; c < C; c++) {
            uint16_t hw[8] = {0};
            memcpy(hw, w + c * rs + 2 * j, (size_t)left * 2);
            const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hw));
            for (int r = 0; r < R; r++) {
                float xf[8] = {0};
                memcpy(xf, x + r * ldx + j, (size_t)left * 4);
                acc[r * C + c] = _mm256_fmadd_ps(_mm256_loadu_ps(xf), wv, acc[r * C + c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ldy + c] = hsum8(acc[r * C + c]);
}

static int cols256[9] = {8, 8, 6, 4, 3, 2, 2, 1, 1};

/* --- one thread's weight rows [n0, n1): groups of CC rows, every row tile per group ------- */
#define TILE_CASE(FN, RR, CC) case RR: if (RR * CC <= CAP) FN(RR, CC, xt, ldx, K, wc, rs, wn, yt, ldy); break;
#define GROUP(FN, CC)                                                                        \
    for (int64_t tile = 0; tile < ntiles; tile++) {                                          \
        const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;                  \
        const float *xt = x + r0 * ldx;                                                      \
        float *yt = y + r0 * ldy + c;                                                        \
        switch ((int)(r1 - r0)) {                                                            \
        TILE_CASE(FN, 8, CC) TILE_CASE(FN, 7, CC) TILE_CASE(FN, 6, CC) TILE_CASE(FN, 5, CC)  \
        TILE_CASE(FN, 4, CC) TILE_CASE(FN, 3, CC) TILE_CASE(FN, 2, CC)                       \
        default: FN(1, CC, xt, ldx, K, wc, rs, wn, yt, ldy);                                 \
        }                                                                                    \
    }
#define RUN(FN, CCV)                                                                         \
    for (; c + CCV <= n1; c += CCV) {                                                        \
        const uint8_t *wc = w + c * rs;                                                      \
        const uint8_t *wn = c + 2 * CCV <= N ? wc + CCV * rs : wc;                           \
        GROUP(FN, CCV)                                                                       \
    }

#define CAP 24
static A512 void stream512_t(const uint8_t *w, int64_t n0, int64_t n1, int64_t N, int64_t rs,
                             int64_t K, const float *x, int64_t ldx, int64_t M, float *y,
                             int64_t ldy) {
    const int64_t ntiles = (M + 7) / 8, Rmax = (M + ntiles - 1) / ntiles;
    int64_t c = n0;
    if (M <= 2) {
        for (; c < n1; c++)
            if (M == 1) row512(1, x, ldx, K, w + c * rs, y + c, ldy);
            else row512(2, x, ldx, K, w + c * rs, y + c, ldy);
        return;
    }
    switch (cols512[Rmax]) {
    case 8: RUN(tile512, 8) break;
    case 6: RUN(tile512, 6) break;
    case 4: RUN(tile512, 4) break;
    default: RUN(tile512, 3)
    }
    for (; c < n1; c++) { const uint8_t *wc = w + c * rs, *wn = wc; GROUP(tile512, 1) }
}
#undef CAP

#define CAP 12
static void stream256_t(const uint8_t *w, int64_t n0, int64_t n1, int64_t N, int64_t rs,
                        int64_t K, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy) {
    const int64_t ntiles = (M + 7) / 8, Rmax = (M + ntiles - 1) / ntiles;
    int64_t c = n0;
    switch (cols256[Rmax]) {
    case 8: RUN(tile256, 8) break;
    case 6: RUN(tile256, 6) break;
    case 4: RUN(tile256, 4) break;
    case 3: RUN(tile256, 3) break;
    case 2: RUN(tile256, 2) break;
    default: break;
    }
    for (; c < n1; c++) { const uint8_t *wc = w + c * rs, *wn = c + 2 <= N ? wc + rs : wc; GROUP(tile256, 1) }
}
#undef CAP

/* isa 0: the ISA of iterserve_st.wide; 1: the AVX2 kernels; 2: the AVX-512 ones (benchmarks
 * and tests; returns ITERSERVE_ETYPE where the CPU lacks it). */
int iterserve_k_f16(int64_t isa, int64_t type, const uint8_t *w, int64_t n,
                    int64_t row_stride, int64_t k, const float *x, int64_t M, int64_t ldx,
                    float *y, int64_t ldy, int nthreads) {
    if (type != GGML_F16 || k < 1) return ITERSERVE_ETYPE;
    const int have512 = (iterserve_st.features & ITERSERVE_F_AVX512F) != 0;
    const int wide = isa == 2 ? 1 : isa == 1 ? 0 : iterserve_st.wide == 2;
    if (wide && !have512) return ITERSERVE_ETYPE;
    if (M < 1 || n < 1) return ITERSERVE_OK;
    if (nthreads < 1) nthreads = 1;
    if (n < 64 * nthreads) nthreads = 1;
    /* activations copied into rows 64 bytes more than a multiple of 64 bytes apart */
    const int64_t ldb = (k + 15) / 16 * 16 + 16;
    float *xs = xs_scratch((size_t)M * (size_t)ldb);
    if (!xs) return ITERSERVE_ENOMEM;
    for (int64_t m = 0; m < M; m++) memcpy(xs + m * ldb, x + m * ldx, sizeof(float) * (size_t)k);
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        /* split on multiples of 24 weight rows (whole groups of 8, 6, 4, 3, 2 or 1) */
        const int64_t g = (n + 23) / 24;
        const int64_t n0 = g * t / T * 24, n1e = g * (t + 1) / T * 24, n1 = n1e < n ? n1e : n;
        if (n0 < n1) {
            if (wide) stream512_t(w, n0, n1, n, row_stride, k, xs, ldb, M, y, ldy);
            else stream256_t(w, n0, n1, n, row_stride, k, xs, ldb, M, y, ldy);
        }
    }
    return ITERSERVE_OK;
}
