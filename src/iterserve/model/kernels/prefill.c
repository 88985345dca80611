/* Prefill / large-batch GEMM over GGUF-encoded weights: y[M, n] = x[M, k] . W[n, k]^T for
 * many activation rows (M > layers.QUANT_MAX_ROWS), W one row segment in its file encoding.
 *
 * Why: the decode kernels (qgemm.c) expand every block in registers once per 8 activation
 * rows, which is right when a step is bound by the weight bytes it streams, but a prefill
 * chunk of 64-512 rows is bound by arithmetic: there the decode kernels are several times
 * slower than a float GEMM. Dequantising 4 MB tiles of the weight to float32 and running
 * oneDNN on them (the reference path) costs a pass over memory per call and made prefill
 * slower than the prepacked float32 copy it replaced (issue 12's memory fix, issue 17's
 * regression). This kernel is a BLIS-style GEMM whose packing step *is* the dequantisation:
 *
 *   for each panel of NP = 32 weight rows (threads split the panels):
 *     for each K chunk of KC elements (whole blocks, ~256 elements):
 *       decode the panel's blocks of the chunk (dequant.c's decoders, the same code as
 *       `dequant`, so the values are bit-identical to gguf-py's) into a 16-row scratch and
 *       transpose it into bp[KC][NP]: K-major, so that one k gives NP weights side by side
 *       (32 KB, it stays in L1 next to the activations);
 *       for every tile of MR activation rows: acc[MR][NP] (+)= x[tile, chunk] . bp, with
 *       each x element broadcast against the NP weights in register-blocked FMAs.
 *
 * The decode work per weight is paid once per call and shared by all M rows (at M = 64 it
 * is ~1/10 of the FMAs). The micro-kernel is MR = 12 rows x 32 columns of zmm accumulators
 * (24 of the 32 registers) with AVX-512F, or 6 rows x 16 columns of ymm (12 of 16) with AVX2
 * on CPUs without it; chosen at run time (iterserve_gemm_isa). x and y are plain float32
 * with their own row strides, so the segments of a fused weight write side by side.
 * Results equal a float32 GEMM over gguf-py's dequantised weights up to summation order
 * (k in order within a chunk, chunks added in order). Every type dequant.c decodes is
 * accepted; the float types (F32 / F16 / BF16) are 32-element pseudo-blocks, so they need
 * k % 32 == 0, and an fp32/bf16 checkpoint needs no prepacked copy of its weights either.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"

#define NP 32                 /* weight rows per panel = output columns per micro-tile */
#define KC_TARGET 256         /* elements per K chunk (rounded to whole blocks) */
#define MR512 12
#define MR256 6
#define AVX512 __attribute__((target("avx512f,avx512vl,avx512bw")))

static int isa_in_use = 0;    /* 0: not chosen yet; 1: AVX2; 2: AVX-512F */

int64_t iterserve_gemm_isa(int64_t want) {
    const int have = (iterserve_cpu_features() >> 3) & 1 ? 2 : 1;
    isa_in_use = want >= 1 && want <= have ? (int)want : have;
    return isa_in_use;
}

/* dst[c][r] = src[r][c] for an 8x8 block (row strides lds, ldd floats). */
static inline void tr8x8(const float *src, int64_t lds, float *dst, int64_t ldd) {
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

/* Decode the panel's rows [p0, p0 + rows) (rows <= NP) over blocks [b0, b0 + nb) into
 * bp[nb * QB][NP], K-major; rows past `rows` are zero. tmp: 16 * nb * QB floats. */
static void pack_panel(iterserve_decode_fn fn, int QB, int BB, const uint8_t *w,
                       int64_t row_stride, int64_t p0, int rows, int b0, int nb, float *tmp,
                       float *bp) {
    const int kc = nb * QB;
    for (int h = 0; h < NP / 16; h++) {
        for (int j = 0; j < 16; j++) {
            const int r = 16 * h + j;
            float *dst = tmp + (int64_t)j * kc;
            if (r >= rows) { memset(dst, 0, sizeof(float) * (size_t)kc); continue; }
            const uint8_t *wr = w + (p0 + r) * row_stride + (int64_t)b0 * BB;
            for (int b = 0; b < nb; b++) fn(wr + (int64_t)b * BB, dst + b * QB);
        }
        for (int j0 = 0; j0 < 16; j0 += 8)
            for (int k0 = 0; k0 < kc; k0 += 8)
                tr8x8(tmp + (int64_t)j0 * kc + k0, kc, bp + (int64_t)k0 * NP + 16 * h + j0, NP);
    }
}

/* --- AVX-512: MR512 x 32 ----------------------------------------------------------------- */
static inline __attribute__((always_inline)) AVX512 void tile512(
        int R, const float *x, int64_t ldx, const float *bp, int kc, float *y, int64_t ldy,
        int add, __mmask16 m0, __mmask16 m1) {
    __m512 acc[2 * MR512];
    for (int r = 0; r < R; r++) {
        acc[2 * r] = add ? _mm512_maskz_loadu_ps(m0, y + r * ldy) : _mm512_setzero_ps();
        acc[2 * r + 1] = add ? _mm512_maskz_loadu_ps(m1, y + r * ldy + 16) : _mm512_setzero_ps();
    }
    for (int k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_load_ps(bp + k * NP), b1 = _mm512_load_ps(bp + k * NP + 16);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            acc[2 * r] = _mm512_fmadd_ps(a, b0, acc[2 * r]);
            acc[2 * r + 1] = _mm512_fmadd_ps(a, b1, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, acc[2 * r]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[2 * r + 1]);
    }
}

static AVX512 void rows512(int64_t M, const float *x, int64_t ldx, const float *bp, int kc,
                           float *y, int64_t ldy, int add, int cols) {
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int64_t m = 0; m < M; m += MR512) {
        const int R = M - m < MR512 ? (int)(M - m) : MR512;
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
#define T512(n) case n: tile512(n, xm, ldx, bp, kc, ym, ldy, add, m0, m1); break;
        switch (R) {
        T512(12) T512(11) T512(10) T512(9) T512(8) T512(7)
        T512(6) T512(5) T512(4) T512(3) T512(2) default: tile512(1, xm, ldx, bp, kc, ym, ldy, add, m0, m1);
        }
#undef T512
    }
}

/* --- AVX2: MR256 x 16, each 16-column half of the panel in turn ---------------------------- */
static inline __attribute__((always_inline)) void tile256(
        int R, const float *x, int64_t ldx, const float *bp, int kc, float *y, int64_t ldy,
        int add, int cols) {
    __m256 acc[2 * MR256];
    float buf[MR256 * 16];
    const int full = cols >= 16;
    for (int r = 0; r < R; r++) {
        if (add && full) {
            acc[2 * r] = _mm256_loadu_ps(y + r * ldy);
            acc[2 * r + 1] = _mm256_loadu_ps(y + r * ldy + 8);
        } else if (add) {
            memset(buf, 0, sizeof buf);
            memcpy(buf, y + r * ldy, sizeof(float) * (size_t)cols);
            acc[2 * r] = _mm256_loadu_ps(buf);
            acc[2 * r + 1] = _mm256_loadu_ps(buf + 8);
        } else {
            acc[2 * r] = acc[2 * r + 1] = _mm256_setzero_ps();
        }
    }
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_load_ps(bp + k * NP), b1 = _mm256_load_ps(bp + k * NP + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            acc[2 * r] = _mm256_fmadd_ps(a, b0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(a, b1, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (full) {
            _mm256_storeu_ps(y + r * ldy, acc[2 * r]);
            _mm256_storeu_ps(y + r * ldy + 8, acc[2 * r + 1]);
        } else {
            _mm256_storeu_ps(buf, acc[2 * r]);
            _mm256_storeu_ps(buf + 8, acc[2 * r + 1]);
            memcpy(y + r * ldy, buf, sizeof(float) * (size_t)cols);
        }
    }
}

static void rows256(int64_t M, const float *x, int64_t ldx, const float *bp, int kc, float *y,
                    int64_t ldy, int add, int cols) {
    for (int h = 0; h < NP / 16 && 16 * h < cols; h++) {
        const int c = cols - 16 * h > 16 ? 16 : cols - 16 * h;
        for (int64_t m = 0; m < M; m += MR256) {
            const int R = M - m < MR256 ? (int)(M - m) : MR256;
            const float *xm = x + m * ldx;
            float *ym = y + m * ldy + 16 * h;
            const float *b = bp + 16 * h;
#define T256(n) case n: tile256(n, xm, ldx, b, kc, ym, ldy, add, c); break;
            switch (R) {
            T256(6) T256(5) T256(4) T256(3) T256(2) default: tile256(1, xm, ldx, b, kc, ym, ldy, add, c);
            }
#undef T256
        }
    }
}

int iterserve_gemm(int64_t type, const uint8_t *w, int64_t N, int64_t row_stride, int64_t K,
                   const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int nthreads) {
    int QB, BB;
    const iterserve_decode_fn fn = iterserve_block_decoder(type, &QB, &BB);
    if (!fn || K % QB) return ITERSERVE_ETYPE;
    if (M < 1 || N < 1) return ITERSERVE_OK;
    if (!isa_in_use) iterserve_gemm_isa(0);
    const int wide = isa_in_use == 2;
    const int nbk = (int)(K / QB);
    int bpc = KC_TARGET / QB;                         /* blocks per K chunk */
    if (bpc < 1) bpc = 1;
    const int kc_max = bpc * QB;
    const int64_t npanels = (N + NP - 1) / NP;
    if (nthreads < 1) nthreads = 1;
    if (npanels < nthreads) nthreads = (int)npanels;
    int err = ITERSERVE_OK;
#pragma omp parallel num_threads(nthreads)
    {
        float *tmp = aligned_alloc(64, sizeof(float) * 16 * (size_t)kc_max);
        float *bp = aligned_alloc(64, sizeof(float) * NP * (size_t)kc_max);
        if (!tmp || !bp) {
#pragma omp atomic write
            err = ITERSERVE_ENOMEM;
        } else {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            const int64_t q0 = npanels * t / T, q1 = npanels * (t + 1) / T;
            for (int64_t q = q0; q < q1; q++) {
                const int64_t p0 = q * NP;
                const int rows = N - p0 < NP ? (int)(N - p0) : NP;
                for (int b0 = 0; b0 < nbk; b0 += bpc) {
                    const int nb = nbk - b0 < bpc ? nbk - b0 : bpc;
                    pack_panel(fn, QB, BB, w, row_stride, p0, rows, b0, nb, tmp, bp);
                    const float *xk = x + (int64_t)b0 * QB;
                    if (wide) rows512(M, xk, ldx, bp, nb * QB, y + p0, ldy, b0 > 0, rows);
                    else rows256(M, xk, ldx, bp, nb * QB, y + p0, ldy, b0 > 0, rows);
                }
            }
        }
        free(tmp);
        free(bp);
    }
    return err;
}
