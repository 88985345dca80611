/* GEMM over GGUF-encoded weights for CPU decode: y[M, n] = x[M, k] . W[n, k]^T, W one row
 * segment in its file encoding (rows of blocks exactly as in the GGUF, f16 scales inside the
 * blocks), x and y float32; y has its own row stride, so the segments of a fused weight
 * (q/k/v, gate/up, possibly of different types) write side by side into one output.
 *
 * Why: a decode step multiplies a handful of rows by every weight, so its time is spent
 * streaming weights. Dequantised to float32 the bundled model is 538 MB per step; in its
 * GGUF blocks it is ~96 MB. Each block is expanded to floats in registers, exactly as
 * gguf-py's dequantize does it (d*q, then + m, never fused), and dotted with up to 8 rows of
 * x in float32 FMAs, so the result equals a float32 GEMM over the dequantised weights up to
 * summation order.
 *
 * Register kernels (each block expanded in registers, no store): with AVX2 for Q4_0, Q4_1,
 * Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16 and F32; with AVX-512, where the CPU has it
 * (iterserve_st.wide), Q4_0 / Q4_1 / Q8_0 (and the codebook types IQ4_NL and MXFP4, whose
 * nibbles index a 16-byte table with one byte shuffle: 5.6-8.5x the generic kernel at 1 row,
 * benchmarks/results/paths-codebook-t1.json) in qgemm32_512 (1.4-1.7x the AVX2 kernel on the
 * bundled model's shapes) and every other of these types in qgemm_u512 (blocks512.h's
 * decoders). Same process, alternating, one thread, 1.7B shapes, loaded machine
 * (benchmarks/results/kquant-step1-t1.json, bench_qgemm.py paths): AVX-512 over AVX2 for
 * Q4_K 2.1-4.2x at 1 row, 1.3-3.2x at 4, for Q6_K 1.8-2.8x at 1, 1.7-1.8x at 4. Types without
 * a register kernel (Q2_K, Q3_K, IQ4_XS; IQ4_NL and MXFP4 without AVX-512) run
 * iterserve_qgemm_generic (each block decoded into an L1 buffer by the same code as
 * `dequant`, then dotted with the rows): 1.1-1.8x
 * faster than dequantise + F.linear on a 2048x2048 weight, 1.5-2.5x slower than a register
 * kernel. From a measured row count per type (dispatch.c) the panel GEMM of prefill.c runs.
 * Against kernels with scalar scale conversion (same process, alternating, one thread, 1.7B
 * shapes, 1-16 rows, loaded machine; benchmarks/results/kquant-decode-ab-t1.json): Q4_K
 * 1.7-5.0x, Q6_K 1.2-3.9x, Q5_K 2.1-5.6x, Q5_0 1.2-4.1x, Q5_1 1.5-5.1x; F16 / BF16 1.7-4.4x
 * at 1 row.
 *
 * The f16 scales are converted per block with F16C, straight from the block (vcvtph2ps from
 * memory). On the bundled model's Q4_1 shapes that is 0-11% (typically ~5%) slower than
 * scales pre-widened to float32 in separate arrays (same-process single-thread A/Bs on a
 * loaded machine, benchmarks/bench_qgemm.py layout): at these small shapes the loop is bound
 * by instruction throughput and the conversion adds ~2 instructions per block; the in-block
 * layout reads 17% fewer bytes (Q4_1: 20 vs 24 per block) and needs no copy of the file's
 * weights.
 *
 * Threads split the n columns; compiled with -mavx2 -mfma -mf16c, and with -ffp-contract=off
 * so the dequantisation is not fused into an FMA. Activations stay float32: results equal a
 * float32 GEMM over gguf-py's dequantised weights up to summation order. The int8-activation
 * kernels are qdot8.c and prefill8.c.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "simd.h"

#define QK 32
#define COL_CHUNK 64

/* One block of 32 weights -> w[0..3] (elements 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void dequant_block(
        int type, const uint8_t *blk, __m256 *w) {
    if (type == GGML_Q4_1) {          /* d and m: one conversion for both */
        /* 8 bytes from the block start (d, m and 4 quant bytes, all inside the block),
         * converted from memory in one instruction; lanes 0 and 1 are d and m */
        const __m256 s = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)blk)));
        const __m256 vd = _mm256_permutevar8x32_ps(s, _mm256_setzero_si256());
        const __m256 vm = _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(1));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i mask = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(raw, mask);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        __m256i v[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                        _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v[i]), vd), vm);
        return;
    }
    if (type == GGML_F16) {           /* the float types as 32-element pseudo-blocks */
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * i)));
        return;
    }
    if (type == GGML_BF16) {
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
                       _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * i))), 16));
        return;
    }
    if (type == GGML_F32) {
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps((const float *)blk + 8 * i);
        return;
    }
    const __m256 vd = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)blk)));
    if (type == GGML_Q5_0 || type == GGML_Q5_1) {
        /* q = nibble | bit i of qh << 4; Q5_0 d * (q - 16), Q5_1 d * q + m (dequant.c) */
        const int o = type == GGML_Q5_1 ? 4 : 2;
        uint32_t qh;
        memcpy(&qh, blk + o, 4);
        const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                               0x0101010101010101, 0x0000000000000000);
        __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
        hb = _mm256_or_si256(hb, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        hb = _mm256_and_si256(_mm256_cmpeq_epi8(hb, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + o + 4)), m4 = _mm_set1_epi8(15);
        const __m256i q = _mm256_or_si256(hb, _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4)));
        const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
        const __m128i part[4] = {q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)};
        if (type == GGML_Q5_1) {
            const __m256 vm = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(*(const uint16_t *)(blk + 2))));
            for (int i = 0; i < 4; i++)
                w[i] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[i]))), vm);
        } else {
            for (int i = 0; i < 4; i++)
                w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(
                           _mm256_cvtepu8_epi32(part[i]), _mm256_set1_epi32(16))), vd);
        }
        return;
    }
    if (type == GGML_Q8_0) {
        const uint8_t *q = blk + 2;
        for (int i = 0; i < 4; i++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vd);
        }
        return;
    }
    const uint8_t *q = blk + 2;
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    __m256i v[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                    _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
    const __m256i eight = _mm256_set1_epi32(8);
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v[i], eight)), vd);
}

/* Independent accumulators per row, so that enough FMA chains are in flight: an FMA has a
 * latency of 4-5 cycles and two issue per cycle, so ~10 chains keep the units busy. With one
 * accumulator per row, a batch-1 call ran one chain (4 serial FMAs per block) and reached a
 * fifth of the FMA throughput; R*A stays <= 12 so accumulators and w[4] fit 16 registers. */
#define ACCS(R) ((R) <= 3 ? 4 : (R) <= 5 ? 2 : 1)

static inline int block_bytes32(int type) {
    switch (type) {
    case GGML_Q8_0: return 34;
    case GGML_Q4_1: return 20;
    case GGML_MXFP4: return 17;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_F16: case GGML_BF16: return 64;
    case GGML_F32: return 128;
    default: return 18;
    }
}

/* R rows of x times one weight row over blocks [b0, b1); R, A and type are compile-time
 * constants after inlining. y[r] is set, or with `add` accumulated (later K chunks). */
static inline __attribute__((always_inline)) void rows_by_col(
        int R, int A, int type, const float *x, int64_t ldx, int b0, int b1,
        const uint8_t *wrow, float *y, int64_t ldy, int add) {
    const int bb = block_bytes32(type);
    __m256 acc[12];
    for (int i = 0; i < R * A; i++) acc[i] = _mm256_setzero_ps();
    for (int b = b0; b < b1; b++) {
        __m256 w[4];
        dequant_block(type, wrow + (int64_t)b * bb, w);
        const float *xb = x + b * QK;
        for (int r = 0; r < R; r++) {
            const float *xr = xb + r * ldx;
            for (int i = 0; i < 4; i++)
                acc[r * A + i % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * i), w[i],
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

#define ROWS(R, TYPE) \
    rows_by_col(R, ACCS(R), TYPE, xt, ldx, b0, b1, wn, yt, ldy, b0 > 0)
#define DISPATCH(TYPE)                                                                    \
    switch (R) {                                                                          \
    case 8: ROWS(8, TYPE); break;                                                         \
    case 7: ROWS(7, TYPE); break;                                                         \
    case 6: ROWS(6, TYPE); break;                                                         \
    case 5: ROWS(5, TYPE); break;                                                         \
    case 4: ROWS(4, TYPE); break;                                                         \
    case 3: ROWS(3, TYPE); break;                                                         \
    case 2: ROWS(2, TYPE); break;                                                         \
    default: ROWS(1, TYPE); break;                                                        \
    }

/* Activation bytes one row tile may take per K chunk: the tile is re-read for every weight
 * row, so it must stay in the 32 KiB L1 next to the streaming weights. down_proj's 8 rows x
 * 1,536 floats (48 KiB) did not, and ran at 70% of the other projections' rate. */
#define X_TILE_BYTES (24 * 1024)

/* K chunks of the K-quant and blocks512.h kernels for an x tile of R rows over nb blocks of
 * QB: none while the tile is at most X_WHOLE_BYTES, else chunks of X_TILE_BYTES. Splitting K
 * makes each weight row be read in pieces, in separate passes over the column chunk, and on
 * weights streamed from DRAM (1.7B shapes) that cost more than the L2 reads of an unsplit
 * tile: Q4_K 2048x2048 at 8 rows 629 vs 833 us, 8192x2048 at 4 rows 1.8 vs 2.4 ms (AVX-512,
 * one thread, same process, loaded machine). At 8 rows of 8,192 (256 KB) splitting still
 * wins (3.0 vs 5.3-6.0 ms). */
#define X_WHOLE_BYTES (64 * 1024)
static inline int kchunks(int R, int QB, int nb) {
    if ((int64_t)R * QB * nb * (int64_t)sizeof(float) <= X_WHOLE_BYTES) return 1;
    int kc_max = X_TILE_BYTES / (R * QB * (int)sizeof(float));
    if (kc_max < 1) kc_max = 1;
    return (nb + kc_max - 1) / kc_max;
}

static void qgemm32(int type, const uint8_t *w, int64_t N, int64_t row_stride, int64_t K,
                    const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                    int nthreads) {
    const int nb = (int)(K / QK);
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
    /* Row tiles of at most 8, balanced (12 rows -> 6 + 6, not 8 + 4). */
    const int64_t ntiles = (M + 7) / 8;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                const float *xt = x + r0 * ldx;
                const int kc_max = X_TILE_BYTES / (R * QK * (int)sizeof(float));
                const int nk = (nb + kc_max - 1) / kc_max;
                for (int kchunk = 0; kchunk < nk; kchunk++) {
                    const int b0 = (int)((int64_t)nb * kchunk / nk);
                    const int b1 = (int)((int64_t)nb * (kchunk + 1) / nk);
                    for (int64_t n = c0; n < c1; n++) {
                        const uint8_t *wn = w + n * row_stride;
                        float *yt = y + r0 * ldy + n;
                        switch (type) {
                        case GGML_Q8_0: DISPATCH(GGML_Q8_0) break;
                        case GGML_Q4_1: DISPATCH(GGML_Q4_1) break;
                        case GGML_Q5_0: DISPATCH(GGML_Q5_0) break;
                        case GGML_Q5_1: DISPATCH(GGML_Q5_1) break;
                        case GGML_F16: DISPATCH(GGML_F16) break;
                        case GGML_BF16: DISPATCH(GGML_BF16) break;
                        case GGML_F32: DISPATCH(GGML_F32) break;
                        default: DISPATCH(GGML_Q4_0) break;
                        }
                    }
                }
            }
        }
    }
}


/* --- AVX-512 variants of Q4_0 / Q4_1 / Q8_0 (chosen at run time, iterserve_st.wide) ------ */
/* Why: at decode batches the 32-wide kernels above are bound by instruction throughput, not
 * by the bytes they stream (batch-8 steps went from 12.1 to 12.9 ms in the fused layers when
 * the f16 scales moved into the blocks). One zmm holds half a block, so a block is 2 FMAs
 * per row instead of 4, its dequantisation half the instructions, and its scale(s) one
 * conversion. Same values as dequant_block (d*q then + m, unfused), so the same results up
 * to summation order. */
#define AVX512 __attribute__((target("avx512f,avx512vl,avx512bw")))
#include "blocks512.h"

static inline __attribute__((always_inline)) AVX512 void dequant_block512(
        int type, const uint8_t *blk, __m512 *w) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    if (type == GGML_Q4_1) {
        const __m128 s = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)blk));
        const __m512 vd = _mm512_broadcastss_ps(s);
        const __m512 vm = _mm512_broadcastss_ps(_mm_movehdup_ps(s));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        w[0] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd), vm);
        w[1] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd), vm);
        return;
    }
    if (type == GGML_IQ4_NL || type == GGML_MXFP4) {   /* codebook types: a byte shuffle */
        const int mx = type == GGML_MXFP4;
        const __m512 vd = mx ? _mm512_set1_ps(iterserve_e8m0_half(blk[0]))
            : _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(*(const uint16_t *)blk)));
        const __m128i tab = _mm_loadu_si128(
            (const __m128i *)(mx ? iterserve_mxfp4_values : iterserve_iq4_values));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (mx ? 1 : 2)));
        const __m128i lo = _mm_shuffle_epi8(tab, _mm_and_si128(raw, m4));
        const __m128i hi = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
        w[0] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
        w[1] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
        return;
    }
    const __m512 vd = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(*(const uint16_t *)blk)));
    if (type == GGML_Q8_0) {
        for (int i = 0; i < 2; i++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * i));
            w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), vd);
        }
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2)), e = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, m4), e);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), e);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), vd);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), vd);
}

/* As rows_by_col; A = 2 accumulators per row (the block's halves), or 4 for R <= 3 (blocks
 * alternate between two pairs, so that a batch-1 call still has 4 FMA chains in flight). */
static inline __attribute__((always_inline)) AVX512 void rows_by_col512(
        int R, int A, int type, const float *x, int64_t ldx, int b0, int b1,
        const uint8_t *wrow, float *y, int64_t ldy, int add) {
    const int bb = block_bytes32(type);
    __m512 acc[16];
    for (int i = 0; i < R * A; i++) acc[i] = _mm512_setzero_ps();
    int b = b0;
    if (A == 4)
        for (; b + 1 < b1; b += 2)
            for (int u = 0; u < 2; u++) {
                __m512 w[2];
                dequant_block512(type, wrow + (int64_t)(b + u) * bb, w);
                const float *xb = x + (b + u) * QK;
                for (int r = 0; r < R; r++)
                    for (int i = 0; i < 2; i++)
                        acc[r * 4 + 2 * u + i] = _mm512_fmadd_ps(
                            _mm512_loadu_ps(xb + r * ldx + 16 * i), w[i], acc[r * 4 + 2 * u + i]);
            }
    for (; b < b1; b++) {
        __m512 w[2];
        dequant_block512(type, wrow + (int64_t)b * bb, w);
        const float *xb = x + b * QK;
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 2; i++)
                acc[r * A + i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + r * ldx + 16 * i), w[i],
                                                 acc[r * A + i]);
    }
    for (int r = 0; r < R; r++) {
        __m512 s = acc[r * A];
        for (int i = 1; i < A; i++) s = _mm512_add_ps(s, acc[r * A + i]);
        const float v = _mm512_reduce_add_ps(s);
        y[r * ldy] = add ? y[r * ldy] + v : v;
    }
}

#define ROWS512(R, TYPE) \
    rows_by_col512(R, (R) <= 3 ? 4 : 2, TYPE, xt, ldx, b0, b1, wn, yt, ldy, b0 > 0)
#define DISPATCH512(TYPE)                                                                 \
    switch (R) {                                                                          \
    case 8: ROWS512(8, TYPE); break;                                                      \
    case 7: ROWS512(7, TYPE); break;                                                      \
    case 6: ROWS512(6, TYPE); break;                                                      \
    case 5: ROWS512(5, TYPE); break;                                                      \
    case 4: ROWS512(4, TYPE); break;                                                      \
    case 3: ROWS512(3, TYPE); break;                                                      \
    case 2: ROWS512(2, TYPE); break;                                                      \
    default: ROWS512(1, TYPE); break;                                                     \
    }

static AVX512 void qgemm32_512(int type, const uint8_t *w, int64_t N, int64_t row_stride,
                               int64_t K, const float *x, int64_t M, int64_t ldx, float *y,
                               int64_t ldy, int nthreads) {
    const int nb = (int)(K / QK);
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
    const int64_t ntiles = (M + 7) / 8;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                const float *xt = x + r0 * ldx;
                const int kc_max = X_TILE_BYTES / (R * QK * (int)sizeof(float));
                const int nk = (nb + kc_max - 1) / kc_max;
                for (int kchunk = 0; kchunk < nk; kchunk++) {
                    const int b0 = (int)((int64_t)nb * kchunk / nk);
                    const int b1 = (int)((int64_t)nb * (kchunk + 1) / nk);
                    for (int64_t n = c0; n < c1; n++) {
                        const uint8_t *wn = w + n * row_stride;
                        float *yt = y + r0 * ldy + n;
                        if (type == GGML_Q8_0) { DISPATCH512(GGML_Q8_0) }
                        else if (type == GGML_Q4_1) { DISPATCH512(GGML_Q4_1) }
                        else if (type == GGML_MXFP4) { DISPATCH512(GGML_MXFP4) }
                        else if (type == GGML_IQ4_NL) { DISPATCH512(GGML_IQ4_NL) }
                        else { DISPATCH512(GGML_Q4_0) }
                    }
                }
            }
        }
    }
}

/* --- K-quants in registers: Q4_K and Q6_K (the bulk of a Q4_K_M file) -------------------- */
/* Q4_K / Q5_K's 6-bit sub-block scale and min (gguf-py's Q4_K.get_scale_min) */
static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[4 + j] & 63;
    } else {
        *sc = (s[8 + j - 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
    }
}

/* Sub-block j (32 weights) of a 256-weight super-block -> w[0..3], the same values dequant.c
 * computes: Q4_K (d*sc) * q - (dmin*m); Q6_K (d*sc) * (q - 32). */
static inline __attribute__((always_inline)) void dequant_sub_k(
        int type, const uint8_t *blk, int j, __m256 *w) {
    const __m128i m4 = _mm_set1_epi8(15);
    if (type == GGML_Q4_K) {
        uint16_t h[2];
        memcpy(h, blk, 4);
        int sc, mn;
        scale_min_k4(blk + 4, j, &sc, &mn);
        const __m256 ds = _mm256_set1_ps(_cvtsh_ss(h[0]) * (float)sc);
        const __m256 dm = _mm256_set1_ps(_cvtsh_ss(h[1]) * (float)mn);
        const uint8_t *q = blk + 16 + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 4; i++) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            v = _mm_and_si128(_mm_srli_epi16(v, shift), m4);
            w[i] = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), ds), dm);
        }
    } else if (type == GGML_Q5_K) {                  /* (d*sc) * (nibble | hbit << 4) - (dmin*m) */
        uint16_t h[2];
        memcpy(h, blk, 4);
        int sc, mn;
        scale_min_k4(blk + 4, j, &sc, &mn);
        const __m256 ds = _mm256_set1_ps(_cvtsh_ss(h[0]) * (float)sc);
        const __m256 dm = _mm256_set1_ps(_cvtsh_ss(h[1]) * (float)mn);
        const uint8_t *q = blk + 48 + 32 * (j / 2), *qh = blk + 16;
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 4; i++) {
            __m128i v = _mm_and_si128(_mm_srli_epi16(_mm_loadl_epi64((const __m128i *)(q + 8 * i)), shift), m4);
            __m128i hb = _mm_and_si128(_mm_srli_epi16(_mm_loadl_epi64((const __m128i *)(qh + 8 * i)), j),
                                       _mm_set1_epi8(1));
            v = _mm_or_si128(v, _mm_slli_epi16(hb, 4));
            w[i] = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), ds), dm);
        }
    } else {                                         /* Q6_K */
        uint16_t hd;
        memcpy(&hd, blk + 208, 2);
        const float d = _cvtsh_ss(hd);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const int h = j / 4, g = j % 4;
        const uint8_t *ql = blk + 64 * h + 32 * (g % 2), *qh = blk + 128 + 32 * h;
        const int sl = 4 * (g / 2), sh = 2 * g;
        for (int i = 0; i < 4; i++) {
            __m128i lo = _mm_and_si128(_mm_srli_epi16(_mm_loadl_epi64((const __m128i *)(ql + 8 * i)), sl), m4);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(_mm_loadl_epi64((const __m128i *)(qh + 8 * i)), sh),
                                       _mm_set1_epi8(3));
            __m128i q = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
            const __m256 ds = _mm256_set1_ps(d * (float)sc[8 * h + (32 * g + 8 * i) / 16]);
            w[i] = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
    }
}

static inline __attribute__((always_inline)) void rows_by_col_k(
        int R, int A, int type, const float *x, int64_t ldx, int b0, int b1,
        const uint8_t *wrow, float *y, int64_t ldy, int add) {
    const int bb = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210;
    __m256 acc[12];
    for (int i = 0; i < R * A; i++) acc[i] = _mm256_setzero_ps();
    for (int b = b0; b < b1; b++) {
        const uint8_t *blk = wrow + (int64_t)b * bb;
        for (int j = 0; j < 8; j++) {
            __m256 w[4];
            dequant_sub_k(type, blk, j, w);
            const float *xb = x + (int64_t)b * 256 + 32 * j;
            for (int r = 0; r < R; r++) {
                const float *xr = xb + r * ldx;
                for (int i = 0; i < 4; i++)
                    acc[r * A + i % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * i), w[i],
                                                         acc[r * A + i % A]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 s = acc[r * A];
        for (int i = 1; i < A; i++) s = _mm256_add_ps(s, acc[r * A + i]);
        const float v = hsum8(s);
        y[r * ldy] = add ? y[r * ldy] + v : v;
    }
}

#define ROWS_K(R, TYPE) \
    rows_by_col_k(R, ACCS(R), TYPE, xt, ldx, b0, b1, wn, yt, ldy, b0 > 0)
#define DISPATCH_K(TYPE)                                                                  \
    switch (R) {                                                                          \
    case 8: ROWS_K(8, TYPE); break;                                                       \
    case 7: ROWS_K(7, TYPE); break;                                                       \
    case 6: ROWS_K(6, TYPE); break;                                                       \
    case 5: ROWS_K(5, TYPE); break;                                                       \
    case 4: ROWS_K(4, TYPE); break;                                                       \
    case 3: ROWS_K(3, TYPE); break;                                                       \
    case 2: ROWS_K(2, TYPE); break;                                                       \
    default: ROWS_K(1, TYPE); break;                                                      \
    }

static void qgemm_k(int type, const uint8_t *w, int64_t N, int64_t row_stride, int64_t K,
                    const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                    int nthreads) {
    const int nb = (int)(K / 256);
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
    const int64_t ntiles = (M + 7) / 8;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                const float *xt = x + r0 * ldx;
                const int nk = kchunks(R, 256, nb);
                for (int kchunk = 0; kchunk < nk; kchunk++) {
                    const int b0 = (int)((int64_t)nb * kchunk / nk);
                    const int b1 = (int)((int64_t)nb * (kchunk + 1) / nk);
                    for (int64_t n = c0; n < c1; n++) {
                        const uint8_t *wn = w + n * row_stride;
                        float *yt = y + r0 * ldy + n;
                        if (type == GGML_Q4_K) { DISPATCH_K(GGML_Q4_K) }
                        else if (type == GGML_Q5_K) { DISPATCH_K(GGML_Q5_K) }
                        else { DISPATCH_K(GGML_Q6_K) }
                    }
                }
            }
        }
    }
}

/* --- AVX-512 register kernels for every type of blocks512.h ------------------------------ */
/* Why: on an AVX-512 CPU the K-quants (Q4_K, Q5_K, Q6_K: the bulk of Q4_K_M / Q5_K_M files),
 * Q5_0 / Q5_1 and the float types (F16 GGUFs, bf16/fp16 checkpoints) ran the AVX2 kernels
 * above or the generic decode-into-L1 kernel (dequant.c), bound by instructions, not bytes.
 * Here a 32-element unit of a block is decoded into two zmm (blocks512.h: Q4_K's nibbles
 * through a 16-entry table per sub-block, one vpermps per 16 weights) and dotted with up to 8
 * activation rows; A = 4 accumulators per row for R <= 3 (units alternate between two
 * pairs), else 2. Same values as dequant.c, so the same results up to summation order. */
static inline __attribute__((always_inline)) AVX512 void rows_by_col_u512(
        int R, int A, int type, const float *x, int64_t ldx, int b0, int b1,
        const uint8_t *wrow, float *y, int64_t ldy, int add) {
    const int QB = qb512(type), BB = bb512(type), U = QB / 32;
    __m512 acc[16];
    for (int i = 0; i < R * A; i++) acc[i] = _mm512_setzero_ps();
    int b = b0;
    if (U == 1 && A == 4)                   /* 32-element blocks two at a time */
        for (; b + 1 < b1; b += 2)
            for (int u = 0; u < 2; u++) {
                __m512 w[2];
                unit512(type, wrow + (int64_t)(b + u) * BB, 0, 0, 0, w);
                const float *xb = x + (int64_t)(b + u) * QB;
                for (int r = 0; r < R; r++)
                    for (int i = 0; i < 2; i++)
                        acc[r * 4 + 2 * u + i] = _mm512_fmadd_ps(
                            _mm512_loadu_ps(xb + r * ldx + 16 * i), w[i], acc[r * 4 + 2 * u + i]);
            }
    for (; b < b1; b++) {
        const uint8_t *blk = wrow + (int64_t)b * BB;
        float s[16], m[8];
        kprep512(type, blk, s, m);
#pragma GCC unroll 8
        for (int j = 0; j < U; j++) {
            __m512 w[2];
            unit512(type, blk, j, s, m, w);
            const float *xb = x + (int64_t)b * QB + 32 * j;
            const int o = A == 4 ? 2 * (j & 1) : 0;
            for (int r = 0; r < R; r++)
                for (int i = 0; i < 2; i++)
                    acc[r * A + o + i] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + r * ldx + 16 * i),
                                                         w[i], acc[r * A + o + i]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 t = acc[r * A];
        for (int i = 1; i < A; i++) t = _mm512_add_ps(t, acc[r * A + i]);
        const float v = _mm512_reduce_add_ps(t);
        y[r * ldy] = add ? y[r * ldy] + v : v;
    }
}

#define ROWS_U(R, TYPE) \
    rows_by_col_u512(R, (R) <= 3 ? 4 : 2, TYPE, xt, ldx, b0, b1, wn, yt, ldy, b0 > 0)
#define DISPATCH_U(TYPE)                                                                  \
    switch (R) {                                                                          \
    case 8: ROWS_U(8, TYPE); break;                                                       \
    case 7: ROWS_U(7, TYPE); break;                                                       \
    case 6: ROWS_U(6, TYPE); break;                                                       \
    case 5: ROWS_U(5, TYPE); break;                                                       \
    case 4: ROWS_U(4, TYPE); break;                                                       \
    case 3: ROWS_U(3, TYPE); break;                                                       \
    case 2: ROWS_U(2, TYPE); break;                                                       \
    default: ROWS_U(1, TYPE); break;                                                      \
    }

static int has_u512(int64_t type) {
    switch (type) {
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: case GGML_Q5_0: case GGML_Q5_1:
    case GGML_F16: case GGML_BF16: case GGML_F32:
        return 1;
    default:
        return 0;
    }
}

static AVX512 void qgemm_u512(int type, const uint8_t *w, int64_t N, int64_t row_stride,
                              int64_t K, const float *x, int64_t M, int64_t ldx, float *y,
                              int64_t ldy, int nthreads) {
    const int QB = qb512(type);
    const int nb = (int)(K / QB);
    if (nthreads < 1) nthreads = 1;
    if (N < 64 * nthreads) nthreads = 1;
    const int64_t ntiles = (M + 7) / 8;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
        for (int64_t c0 = n0; c0 < n1; c0 += COL_CHUNK) {
            const int64_t c1 = c0 + COL_CHUNK < n1 ? c0 + COL_CHUNK : n1;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t r0 = M * tile / ntiles, r1 = M * (tile + 1) / ntiles;
                const int R = (int)(r1 - r0);
                const float *xt = x + r0 * ldx;
                const int nk = kchunks(R, QB, nb);
                for (int kchunk = 0; kchunk < nk; kchunk++) {
                    const int b0 = (int)((int64_t)nb * kchunk / nk);
                    const int b1 = (int)((int64_t)nb * (kchunk + 1) / nk);
                    for (int64_t n = c0; n < c1; n++) {
                        const uint8_t *wn = w + n * row_stride;
                        float *yt = y + r0 * ldy + n;
                        switch (type) {
                        case GGML_Q4_K: DISPATCH_U(GGML_Q4_K) break;
                        case GGML_Q5_K: DISPATCH_U(GGML_Q5_K) break;
                        case GGML_Q6_K: DISPATCH_U(GGML_Q6_K) break;
                        case GGML_Q5_0: DISPATCH_U(GGML_Q5_0) break;
                        case GGML_Q5_1: DISPATCH_U(GGML_Q5_1) break;
                        case GGML_F16: DISPATCH_U(GGML_F16) break;
                        case GGML_BF16: DISPATCH_U(GGML_BF16) break;
                        default: DISPATCH_U(GGML_F32) break;
                        }
                    }
                }
            }
        }
    }
}

int iterserve_can_qgemm(int64_t type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0
        || (iterserve_can_dequant(type) && (iterserve_block_elems(type) > 1
                                            || type == GGML_F16 || type == GGML_BF16
                                            || type == GGML_F32));
}

/* The register kernel of the type for the ISA in use (iterserve_st.wide), else the generic
 * block kernel; any row count (tiles of 8). */
void iterserve_k_registers(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                           int64_t k, const float *x, int64_t M, int64_t ldx, float *y,
                           int64_t ldy, int nthreads) {
    const int wide = iterserve_st.wide == 2;
    if (type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0) {
        if (wide) qgemm32_512((int)type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
        else qgemm32((int)type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    }
    else if (wide && (type == GGML_IQ4_NL || type == GGML_MXFP4))
        qgemm32_512((int)type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    else if (wide && has_u512(type))
        qgemm_u512((int)type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    else if (type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_F16 || type == GGML_BF16
             || type == GGML_F32)
        qgemm32((int)type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    else if (type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K)
        qgemm_k((int)type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    else
        iterserve_qgemm_generic(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
}
