/* Decode attention straight from the paged KV pool: one query token per sequence.
 *
 * Why: the torch path gathers every sequence's K/V into a padded [D, Lmax] tensor in every
 * layer, then SDPA reads it again. With one long request among short ones that is ~3x the
 * KV bytes of the step, padded to the longest context: on the `mix` workload it was ~26 ms
 * of an ~85 ms step. Here each sequence walks its own block table and reads each cached K
 * and V row once, for all query heads (GQA stays grouped: a KV head serves its G heads).
 *
 * Per sequence and query head: scores s = scale * q.k for positions [start, len) (start > 0
 * under a sliding window), softmax in float32 with the max subtracted, then out = sum p * v.
 * exp is a vectorised Cephes-style polynomial (relative error ~1e-7, like expf).
 *
 * How it is laid out for speed (the first version ran at a third of memory speed and was
 * ~40% of a decode step at 10 sequences x 400 tokens):
 * - a work item is a sequence and a run of its positions, with all KV heads: a slot's K or
 *   V row (all heads, kvh*d floats) is contiguous, so each item streams whole rows (items of
 *   one (sequence, KV head) pair read a third of each row);
 * - long contexts split into runs (flash-decoding), so a few sequences still use every
 *   thread; each run keeps its softmax max and sum, and runs are merged at the end;
 * - scores: 8 positions per query head at once (8 FMA chains), the 8 sums reduced together
 *   with a horizontal-add tree;
 * - p * v: per 16 positions, tiles of up to 3 query heads x 32 dims (12 chains), each V load
 *   shared by the query heads of its group; accumulators live in the output between tiles;
 * - the score pass prefetches K rows ahead and the same positions' V rows for pass 2.
 * It still runs at about half the memory speed a plain read of the same rows reaches (its
 * arithmetic and its cache misses overlap poorly); the prefetches measured within noise of
 * none, and a single-pass online-softmax variant was no faster.
 *
 * The pools hold float32 or, with `--kv-cache-dtype float16`, IEEE half rows
 * (iterserve_decode_attention_kv, kv_type ITERSERVE_KV_F16): the same code with each K/V
 * load widened by F16C (vcvtph2ps), so a step reads half the KV bytes. At the 1.7B shape
 * (32 KV heads of 64, 24 layers: 384 KB of float32 K/V per token) 8 sequences at ~300
 * tokens read ~0.9 GB of K/V per step, as much as the Q4_K_M weights (1.05 GB).
 *
 * The block tables and lengths come from the caller: every length must lie in
 * [1, max_blocks * bs] and every block a sequence uses must lie in the pool, else nothing is
 * computed and ITERSERVE_ELEN / ITERSERVE_EBLOCK is returned (checked before any read).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "simd.h"

/* The 8 floats of the 8 vectors a[0..7], each summed: [sum a0, ..., sum a7]. */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 K/V elements from element index i of a row: float32, or half widened by F16C. */
static inline __attribute__((always_inline)) __m256 ld8(const void *row, long i, int f16) {
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    return _mm256_loadu_ps((const float *)row + i);
}

/* Scores of one query head against 8 K rows (rows past the run point at a zero row). */
static inline __attribute__((always_inline)) void scores8(
        const float *qg, const void *const *kr, long off, int d, float scale, float *dst,
        int f16) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + i);
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_fmadd_ps(qv, ld8(kr[j], off + i, f16), acc[j]);
    }
    _mm256_storeu_ps(dst, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
}

/* o[g][0..8*NV) += sum_t p[g][t] * V[t][off..off+8*NV) for NG query heads, t < n; NG and NV
 * are compile-time constants after inlining. */
static inline __attribute__((always_inline)) void pv_tile(
        int NG, int NV, const void *const *vr, long off, int n, const float *p, long pstride,
        float *o, long ostride, int f16) {
    __m256 acc[12];
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < NV; i++) acc[g * NV + i] = _mm256_loadu_ps(o + g * ostride + 8 * i);
    for (int t = 0; t < n; t++) {
        __m256 vv[4];
        for (int i = 0; i < NV; i++) vv[i] = ld8(vr[t], off + 8 * i, f16);
        for (int g = 0; g < NG; g++) {
            const __m256 w = _mm256_broadcast_ss(p + g * pstride + t);
            for (int i = 0; i < NV; i++) acc[g * NV + i] = _mm256_fmadd_ps(w, vv[i], acc[g * NV + i]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < NV; i++) _mm256_storeu_ps(o + g * ostride + 8 * i, acc[g * NV + i]);
}

#define PV(NG, NV) pv_tile(NG, NV, vr, off, n, p, pstride, o, ostride, F16)
#define F16 0
static void pv(int NG, int NV, const void *const *vr, long off, int n, const float *p,
               long pstride, float *o, long ostride) {
    switch (NG * 4 + NV) {
    case 5: PV(1, 1); break;   case 6: PV(1, 2); break;   case 7: PV(1, 3); break;
    case 8: PV(1, 4); break;
    case 9: PV(2, 1); break;   case 10: PV(2, 2); break;  case 11: PV(2, 3); break;
    case 12: PV(2, 4); break;
    case 13: PV(3, 1); break;  case 14: PV(3, 2); break;  case 15: PV(3, 3); break;
    default: PV(3, 4); break;
    }
}
#undef F16
#define F16 1
static void pv16(int NG, int NV, const void *const *vr, long off, int n, const float *p,
                 long pstride, float *o, long ostride) {
    switch (NG * 4 + NV) {
    case 5: PV(1, 1); break;   case 6: PV(1, 2); break;   case 7: PV(1, 3); break;
    case 8: PV(1, 4); break;
    case 9: PV(2, 1); break;   case 10: PV(2, 2); break;  case 11: PV(2, 3); break;
    case 12: PV(2, 4); break;
    case 13: PV(3, 1); break;  case 14: PV(3, 2); break;  case 15: PV(3, 3); break;
    default: PV(3, 4); break;
    }
}
#undef F16

/* Softmax numerator of n scores in place: s = exp(s - max); returns max, *sum gets the sum. */
static float exp_scores(float *sg, int n, float *sum_out) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + i));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float mx = _mm_cvtss_f32(m4);
    for (; i < n; i++) mx = sg[i] > mx ? sg[i] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vmx));
        _mm256_storeu_ps(sg + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    if (i < n) {                            /* tail: pad with -inf -> exp 0 */
        float tmp[8];
        for (int j = 0; j < 8; j++) tmp[j] = i + j < n ? sg[i + j] - mx : -INFINITY;
        _mm256_storeu_ps(tmp, exp256(_mm256_loadu_ps(tmp)));
        for (int j = 0; i + j < n; j++) { sg[i + j] = tmp[j]; sum += tmp[j]; }
    }
    *sum_out = sum;
    return mx;
}

#define PV_POSITIONS 16    /* positions per pass-2 sweep over the heads (V rows stay in L1) */
#define MIN_RUN 128        /* shortest run a sequence is split into */
#define MAX_RUN 256        /* longest: a run's K and V rows (~400 KB here) stay in L2 */
#define PF_AHEAD 16        /* K rows fetched this many positions ahead of pass 1 */

static inline void prefetch_row(const void *r, long nbytes, int hint_l2) {
    for (long i = 0; i < nbytes; i += 64) {
        if (hint_l2) _mm_prefetch((const char *)r + i, _MM_HINT_T1);
        else _mm_prefetch((const char *)r + i, _MM_HINT_T0);
    }
}

/* ITERSERVE_OK when every sequence's length and used blocks lie in the pool. */
static int check_tables(const int32_t *tables, int max_blocks, const int32_t *lens, int D,
                        int bs, int64_t pool_slots) {
    const int64_t nblocks = pool_slots / bs;
    for (int s = 0; s < D; s++) {
        const int len = lens[s];
        if (len < 1 || (int64_t)len > (int64_t)max_blocks * bs) return ITERSERVE_ELEN;
        const int32_t *t = tables + (int64_t)s * max_blocks;
        for (int b = 0; b < (len + bs - 1) / bs; b++)
            if (t[b] < 0 || t[b] >= nblocks) return ITERSERVE_EBLOCK;
    }
    return ITERSERVE_OK;
}

static inline __attribute__((always_inline)) int decode_attention(
        const float *q, const void *kpool, const void *vpool, int64_t pool_slots,
        const int32_t *tables, int max_blocks, const int32_t *lens, int window, int D, int H,
        int kvh, int d, int bs, float scale, float *out, int nthreads, int f16) {
    const int G = H / kvh;                 /* query heads per KV head */
    const long row = (long)kvh * d;        /* elements per slot */
    const long row_bytes = row * (f16 ? 2 : 4);
    if (nthreads < 1) nthreads = 1;
    if (D < 1) return ITERSERVE_OK;
    const int bad = check_tables(tables, max_blocks, lens, D, bs, pool_slots);
    if (bad) return bad;
    /* Split contexts into runs of `run` positions so there are ~4 items per thread. */
    long total = 0;
    for (int s = 0; s < D; s++) {
        const int len = lens[s];
        total += (window > 0 && len > window) ? window : len;
    }
    long run = (total / (4L * nthreads) + 7) / 8 * 8;
    if (run < MIN_RUN) run = MIN_RUN;
    if (run > MAX_RUN) run = MAX_RUN;
    int *first = malloc(sizeof(int) * (size_t)(D + 1));   /* items of s: first[s]..first[s+1) */
    first[0] = 0;
    for (int s = 0; s < D; s++) {
        const int len = lens[s];
        const int n = (window > 0 && len > window) ? window : len;
        first[s + 1] = first[s] + (int)((n + run - 1) / run);
    }
    const int nitems = first[D];
    int *item_seq = malloc(sizeof(int) * (size_t)nitems);
    for (int s = 0; s < D; s++)
        for (int it = first[s]; it < first[s + 1]; it++) item_seq[it] = s;
    /* per split item: unnormalised out [H][d], then max [H] and sum [H] */
    const long part_floats = (long)H * (d + 2);
    float *part = malloc(sizeof(float) * (size_t)(nitems * part_floats));
    if (nitems < nthreads) nthreads = nitems;
#pragma omp parallel num_threads(nthreads)
    {
        const long stride = run + 8;                       /* scores per query head */
        float *scores = aligned_alloc(32, sizeof(float) * (size_t)(H * stride));
        const void **kr = malloc(sizeof(void *) * (size_t)stride);
        const void **vr = malloc(sizeof(void *) * (size_t)stride);
        float *zero = calloc((size_t)row, sizeof(float));   /* all-zero bits: 0 in f16 too */
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < nitems; it++) {
            const int s = item_seq[it];
            const int len = lens[s];
            const int start = (window > 0 && len > window) ? len - window : 0;
            const int p0 = start + (int)((it - first[s]) * run);
            const int n = (int)(len - p0 < run ? len - p0 : run);
            const int split = first[s + 1] - first[s] > 1;
            const float *qs = q + (long)s * H * d;
            /* row addresses of positions p0 .. p0+n-1 */
            const int32_t *table = tables + (long)s * max_blocks;
            int bi = p0 / bs, bo = p0 % bs;
            for (int t = 0; t < n; t++) {
                const long slot = (long)table[bi] * bs + bo;
                kr[t] = (const char *)kpool + slot * row_bytes;
                vr[t] = (const char *)vpool + slot * row_bytes;
                if (++bo == bs) { bo = 0; bi++; }
            }
            for (int t = n; t < (n + 7) / 8 * 8; t++) kr[t] = zero;
            /* pass 1: scores of every query head, 8 positions at a time */
            for (int t = 0; t < n; t += 8) {
                for (int j = t + PF_AHEAD; j < t + PF_AHEAD + 8 && j < n; j++)
                    prefetch_row(kr[j], row_bytes, 0);
                for (int j = t; j < t + 8 && j < n; j++)
                    prefetch_row(vr[j], row_bytes, 1);
                for (int hq = 0; hq < H; hq++)
                    scores8(qs + (long)hq * d, kr + t, (long)(hq / G) * d, d, scale,
                            scores + hq * stride + t, f16);
            }
            /* softmax numerators; normalised here unless the run is merged later */
            float *o = split ? part + it * part_floats : out + (long)s * H * d;
            for (int hq = 0; hq < H; hq++) {
                float sum;
                const float mx = exp_scores(scores + hq * stride, n, &sum);
                if (split) {
                    o[(long)H * d + hq] = mx;
                    o[(long)H * d + H + hq] = sum;
                } else {
                    float *sg = scores + hq * stride;
                    const __m256 inv = _mm256_set1_ps(1.0f / sum);
                    int i = 0;
                    for (; i + 8 <= n; i += 8)
                        _mm256_storeu_ps(sg + i, _mm256_mul_ps(_mm256_loadu_ps(sg + i), inv));
                    for (; i < n; i++) sg[i] *= 1.0f / sum;
                }
            }
            /* pass 2: o += p * v, PV_POSITIONS rows at a time through every head tile */
            memset(o, 0, sizeof(float) * (size_t)H * d);
            for (int t0 = 0; t0 < n; t0 += PV_POSITIONS) {
                const int m = n - t0 < PV_POSITIONS ? n - t0 : PV_POSITIONS;
                for (int h = 0; h < kvh; h++)
                    for (int g0 = 0; g0 < G; g0 += 3) {
                        const int NG = G - g0 < 3 ? G - g0 : 3;
                        const int hq = h * G + g0;
                        for (int c = 0; c < d; c += 32) {
                            const int NV = (d - c) < 32 ? (d - c) / 8 : 4;
                            (f16 ? pv16 : pv)(NG, NV, vr + t0, (long)h * d + c, m,
                                              scores + hq * stride + t0, stride,
                                              o + (long)hq * d + c, d);
                        }
                    }
            }
        }
        free(zero);
        free(vr);
        free(kr);
        free(scores);
        /* merge the runs of split sequences: out = sum_r e^(m_r - M) o_r / sum_r e^(m_r - M) l_r */
#pragma omp for schedule(static)
        for (int s = 0; s < D; s++) {
            if (first[s + 1] - first[s] < 2) continue;
            for (int hq = 0; hq < H; hq++) {
                float M = -INFINITY, L = 0.0f;
                for (int it = first[s]; it < first[s + 1]; it++) {
                    const float mr = part[it * part_floats + (long)H * d + hq];
                    M = mr > M ? mr : M;
                }
                float *dst = out + ((long)s * H + hq) * d;
                memset(dst, 0, sizeof(float) * (size_t)d);
                for (int it = first[s]; it < first[s + 1]; it++) {
                    const float *pr = part + it * part_floats;
                    const float w = expf(pr[(long)H * d + hq] - M);
                    L += w * pr[(long)H * d + H + hq];
                    const __m256 vw = _mm256_set1_ps(w);
                    for (int i = 0; i < d; i += 8)
                        _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(vw, _mm256_loadu_ps(pr + (long)hq * d + i),
                                                                  _mm256_loadu_ps(dst + i)));
                }
                const __m256 inv = _mm256_set1_ps(1.0f / L);
                for (int i = 0; i < d; i += 8)
                    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(dst + i), inv));
            }
        }
    }
    free(part);
    free(item_seq);
    free(first);
    return ITERSERVE_OK;
}


int iterserve_decode_attention(const float *q, const float *kpool, const float *vpool,
                               int64_t pool_slots, const int32_t *tables, int max_blocks,
                               const int32_t *lens, int window, int D, int H, int kvh, int d,
                               int bs, float scale, float *out, int nthreads) {
    return decode_attention(q, kpool, vpool, pool_slots, tables, max_blocks, lens, window, D, H,
                            kvh, d, bs, scale, out, nthreads, 0);
}

int iterserve_decode_attention_kv(const float *q, const void *kpool, const void *vpool,
                                  int64_t pool_slots, const int32_t *tables, int max_blocks,
                                  const int32_t *lens, int window, int D, int H, int kvh, int d,
                                  int bs, float scale, float *out, int nthreads, int kv_type) {
    if (kv_type == ITERSERVE_KV_F16)
        return decode_attention(q, kpool, vpool, pool_slots, tables, max_blocks, lens, window,
                                D, H, kvh, d, bs, scale, out, nthreads, 1);
    if (kv_type != ITERSERVE_KV_F32) return ITERSERVE_ETYPE;
    return decode_attention(q, kpool, vpool, pool_slots, tables, max_blocks, lens, window, D, H,
                            kvh, d, bs, scale, out, nthreads, 0);
}
