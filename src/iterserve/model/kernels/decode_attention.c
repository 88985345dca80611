/* Decode attention straight from the paged KV pool: one query token per sequence.
 *
 * Why: the torch path gathers every sequence's K/V into a padded [D, Lmax] tensor in every
 * layer, then SDPA reads it again. With one long request among short ones that is ~3x the
 * KV bytes of the step, padded to the longest context: on the `mix` workload it was ~26 ms
 * of an ~85 ms step. Here each (sequence, KV head) pair walks its own block table and reads
 * each cached K and V row once, for all the query heads of its group (GQA stays grouped).
 *
 * Per pair: scores s = scale * q.k for positions [start, len) (start > 0 under a sliding
 * window), softmax in float32 with the max subtracted, then out = sum p * v. exp is a
 * vectorised Cephes-style polynomial (relative error ~1e-7, like expf).
 *
 * Layout: q [D][H][d]; pools [slots][kvh][d] with slot = block_table[p / bs] * bs + p % bs;
 * tables [D][max_blocks] int32; lens [D] int32 (context including the new token); out like q.
 * d must be a multiple of 8.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "simd.h"

void iterserve_decode_attention(const float *q, const float *kpool, const float *vpool,
                                const int32_t *tables, int max_blocks, const int32_t *lens,
                                int window, int D, int H, int kvh, int d, int bs, float scale,
                                float *out, int nthreads) {
    const int G = H / kvh;                 /* query heads per KV head */
    const long row = (long)kvh * d;        /* floats per slot */
    int maxlen = 0;
    for (int i = 0; i < D; i++) maxlen = lens[i] > maxlen ? lens[i] : maxlen;
    if (nthreads < 1) nthreads = 1;
    if (D * kvh < nthreads) nthreads = D * kvh;
#pragma omp parallel num_threads(nthreads)
    {
        /* scores for the G heads of one pair, each padded to a multiple of 8 */
        const long stride = ((long)maxlen + 7) / 8 * 8;
        float *scores = aligned_alloc(32, sizeof(float) * (size_t)(G * stride + 8));
#pragma omp for schedule(dynamic, 1)
        for (int pair = 0; pair < D * kvh; pair++) {
            const int s = pair / kvh, h = pair % kvh;
            const int len = lens[s];
            const int start = (window > 0 && len > window) ? len - window : 0;
            const int n = len - start;
            const int32_t *table = tables + (long)s * max_blocks;
            const float *qh = q + ((long)s * H + (long)h * G) * d;
            /* pass 1: scores, walking the block table block by block (no division per
             * position); all G query heads share each K row load */
            for (int p0 = start - start % bs; p0 < len; p0 += bs) {
                const float *kb = kpool + (long)table[p0 / bs] * bs * row + (long)h * d;
                const int j0 = p0 < start ? start - p0 : 0;
                const int j1 = p0 + bs <= len ? bs : len - p0;
                for (int j = j0; j < j1; j++) {
                    const float *k = kb + (long)j * row;
                    float *sp = scores + (p0 + j - start);
                    for (int g = 0; g < G; g++) {
                        const float *qg = qh + (long)g * d;
                        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(k));
                        for (int i = 8; i < d; i += 8)
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(k + i), a);
                        sp[g * stride] = hsum8(a) * scale;
                    }
                }
            }
            /* softmax per head */
            for (int g = 0; g < G; g++) {
                float *sg = scores + g * stride;
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
                i = 0;
                for (; i + 8 <= n; i += 8) {
                    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vmx));
                    _mm256_storeu_ps(sg + i, e);
                    vsum = _mm256_add_ps(vsum, e);
                }
                float sum = hsum8(vsum);
                if (i < n) {                        /* tail: pad with -inf -> exp 0 */
                    float tmp[8];
                    for (int j = 0; j < 8; j++) tmp[j] = i + j < n ? sg[i + j] - mx : -INFINITY;
                    __m256 e = exp256(_mm256_loadu_ps(tmp));
                    _mm256_storeu_ps(tmp, e);
                    for (int j = 0; i + j < n; j++) { sg[i + j] = tmp[j]; sum += tmp[j]; }
                }
                const __m256 inv = _mm256_set1_ps(1.0f / sum);
                for (i = 0; i + 8 <= n; i += 8)
                    _mm256_storeu_ps(sg + i, _mm256_mul_ps(_mm256_loadu_ps(sg + i), inv));
                for (; i < n; i++) sg[i] *= 1.0f / sum;
            }
            /* pass 2: out = sum p * v, 64 dims at a time in 8 registers per query head */
            for (int g = 0; g < G; g++) {
                const float *sg = scores + g * stride;
                float *o = out + ((long)s * H + (long)h * G + g) * d;
                for (int c = 0; c < d; c += 64) {
                    const int nv = (d - c) < 64 ? (d - c) / 8 : 8;
                    __m256 acc[8];
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                    for (int p0 = start - start % bs; p0 < len; p0 += bs) {
                        const float *vb = vpool + (long)table[p0 / bs] * bs * row + (long)h * d + c;
                        const int j0 = p0 < start ? start - p0 : 0;
                        const int j1 = p0 + bs <= len ? bs : len - p0;
                        for (int j = j0; j < j1; j++) {
                            const float *v = vb + (long)j * row;
                            const __m256 w = _mm256_set1_ps(sg[p0 + j - start]);
                            if (nv == 8) {      /* constant trip count: fully unrolled */
                                for (int i = 0; i < 8; i++)
                                    acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
                            } else {
                                for (int i = 0; i < nv; i++)
                                    acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
                            }
                        }
                    }
                    for (int i = 0; i < nv; i++) _mm256_storeu_ps(o + c + 8 * i, acc[i]);
                }
            }
        }
        free(scores);
    }
}
