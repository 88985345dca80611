/* Attention of prefill chunks straight from the paged KV pool.
 *
 * Why: a prefill chunk with context (a later chunk of a long prompt under chunked prefill, a
 * prompt after a cached prefix) went through torch: the context's K/V gathered from the pool
 * with index_select, then SDPA with an explicit [chunk, context + chunk] additive mask.
 * Measured on the bundled 135M shape (9 query heads, 3 KV heads of 64), a 128-token chunk at
 * context 1500 cost ~4 ms of attention per layer (~120 ms over the 30 layers, 8x the same chunk
 * at context 0); that gap made chunked prefill cost throughput on `longprompt` and made the
 * lab's linear step price under-predict such chunks. Here each chunk reads K/V through its
 * block table, once per (KV head, query tile), with no copy and no mask tensor.
 *
 * The algorithm (flash attention, forward, on CPU):
 * - a work item is one chunk, one KV head and a tile of its queries: the G query heads that
 *   share the KV head times nq queries make R = nq * G rows (~48), so every K/V element loaded
 *   serves R rows (GQA stays grouped);
 * - the item walks its keys (context + the chunk up to its last query; under a sliding window
 *   only the window of its first query onward) in tiles of KT keys: scores of all R rows, the
 *   causal / window mask only in tiles that cross a boundary, an online softmax (running max
 *   and sum per row, the accumulated output rescaled when the max grows), then O += P V;
 * - scores are computed keys-as-rows, S^T[key][row] = k . q, against Q transposed once per item
 *   (Qt[dim][row], pre-scaled): each K element is one broadcast, each Qt load serves QK_KEYS keys,
 *   and the softmax of a row is then a plain vector max / exp / sum down the key rows; P V
 *   broadcasts P[key][row] against V rows loaded from the pool;
 * - OpenMP over items (largest first, dynamic), per-thread scratch allocated once per call.
 * The same body is compiled for AVX2 (8 floats, 16 registers: 4 keys x 3 vectors for the
 * scores, 3 rows x 4 vectors for P V) and AVX-512 (16 floats, 32 registers: 8 x 3 and 6 x 4),
 * chosen at run time (prefill_attention_impl.h; AVX-512 needs head_dim % 16 == 0).
 *
 * KV pools: float32 rows are read in place; f16 (F16C) and bf16 (a shift) rows of a tile are
 * widened into a per-thread [KT][d] float buffer first (KT * d per tile against R * KT * d
 * multiply-adds). exp is the Cephes-style polynomial of simd.h (relative error ~1e-7).
 *
 * Indices are checked before any read: every chunk needs 1 <= n, 0 <= ctx, ctx + n <=
 * max_blocks * bs and every block it uses inside the pool, else ITERSERVE_ELEN / ITERSERVE_EBLOCK.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "simd.h"

#define KT 64              /* keys per tile */
#define ROWS_TARGET 48     /* query rows (queries x heads of a group) per work item */

typedef struct {
    const float *q;
    const void *kpool, *vpool;
    const int32_t *q_starts, *ctx, *qlens, *tables;
    int max_blocks, window, H, kvh, d, bs, kv_type;
    float scale;
    float *out;
} pa_args;

typedef struct { int s, h, q0, nq; double work; } pa_item;

typedef struct {
    float *Qt, *S, *O, *m, *l, *alpha, *Kp, *Vp, *zero;
    const float **kr, **vr;
} pa_scratch;

/* Row pointers (head h) of positions t0 .. t0+n-1 of a chunk into sc->kr / sc->vr: the pool's
 * own rows for float32, rows widened into sc->Kp / sc->Vp for f16 / bf16. */
static void pa_rows(const pa_args *a, const int32_t *table, int h, int t0, int n,
                    pa_scratch *sc) {
    const long row = (long)a->kvh * a->d, off = (long)h * a->d;
    const int d = a->d, bs = a->bs;
    int bi = t0 / bs, bo = t0 % bs;
    for (int t = 0; t < n; t++) {
        const long slot = (long)table[bi] * bs + bo;
        if (++bo == bs) { bo = 0; bi++; }
        if (a->kv_type == ITERSERVE_KV_F32) {
            sc->kr[t] = (const float *)a->kpool + slot * row + off;
            sc->vr[t] = (const float *)a->vpool + slot * row + off;
            continue;
        }
        const uint16_t *ks = (const uint16_t *)a->kpool + slot * row + off;
        const uint16_t *vs = (const uint16_t *)a->vpool + slot * row + off;
        float *kd = sc->Kp + (long)t * d, *vd = sc->Vp + (long)t * d;
        for (int i = 0; i < d; i += 8) {
            const __m128i kb = _mm_loadu_si128((const __m128i *)(ks + i));
            const __m128i vb = _mm_loadu_si128((const __m128i *)(vs + i));
            if (a->kv_type == ITERSERVE_KV_F16) {
                _mm256_storeu_ps(kd + i, _mm256_cvtph_ps(kb));
                _mm256_storeu_ps(vd + i, _mm256_cvtph_ps(vb));
            } else {
                _mm256_storeu_ps(kd + i, _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(kb), 16)));
                _mm256_storeu_ps(vd + i, _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(vb), 16)));
            }
        }
        sc->kr[t] = kd;
        sc->vr[t] = vd;
    }
}

/* --- AVX2 ------------------------------------------------------------------------------- */
#define VW 8
#define VEC __m256
#define FN(name) name##_avx2
#define QK_KEYS 4
#define PV_ROWS 3
#define VZERO() _mm256_setzero_ps()
#define VLD(p) _mm256_loadu_ps(p)
#define VST(p, v) _mm256_storeu_ps(p, v)
#define VSET(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VEXP(x) exp256(x)
/* x where s > -inf, else 0 */
#define VKEEP(x, s) _mm256_and_ps(x, _mm256_cmp_ps(s, ninf, _CMP_GT_OQ))
#include "prefill_attention_impl.h"
#undef VW
#undef VEC
#undef FN
#undef QK_KEYS
#undef PV_ROWS
#undef VZERO
#undef VLD
#undef VST
#undef VSET
#undef VFMA
#undef VMAX
#undef VMUL
#undef VADD
#undef VSUB
#undef VEXP
#undef VKEEP

/* --- AVX-512 ---------------------------------------------------------------------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw")
/* exp256 of simd.h at 16 lanes */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                         _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#define VW 16
#define VEC __m512
#define FN(name) name##_avx512
#define QK_KEYS 8
#define PV_ROWS 6
#define VZERO() _mm512_setzero_ps()
#define VLD(p) _mm512_loadu_ps(p)
#define VST(p, v) _mm512_storeu_ps(p, v)
#define VSET(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VEXP(x) exp512(x)
#define VKEEP(x, s) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, ninf, _CMP_GT_OQ), x)
#include "prefill_attention_impl.h"
#undef VW
#undef VEC
#undef FN
#undef QK_KEYS
#undef PV_ROWS
#undef VZERO
#undef VLD
#undef VST
#undef VSET
#undef VFMA
#undef VMAX
#undef VMUL
#undef VADD
#undef VSUB
#undef VEXP
#undef VKEEP
#pragma GCC pop_options

/* The ISA `isa` (0 auto, 1 AVX2, 2 AVX-512) resolves to for head_dim d on this CPU. */
int64_t iterserve_prefill_attention_isa(int64_t isa, int64_t d) {
    const int64_t f = iterserve_cpu_features();
    const int has512 = ((f >> 3) & 7) == 7;                 /* avx512f, avx512bw, avx512vl */
    if (isa == 1 || !has512 || d % 16) return 1;
    return 2;
}

static int cmp_work(const void *x, const void *y) {
    const double a = ((const pa_item *)x)->work, b = ((const pa_item *)y)->work;
    return a < b ? 1 : a > b ? -1 : 0;
}

int iterserve_prefill_attention(const float *q, const void *kpool, const void *vpool,
                                int64_t pool_slots, int nseq, const int32_t *q_starts,
                                const int32_t *ctx, const int32_t *qlens, const int32_t *tables,
                                int max_blocks, int window, int H, int kvh, int d, int bs,
                                float scale, float *out, int nthreads, int kv_type, int isa) {
    if (kv_type != ITERSERVE_KV_F32 && kv_type != ITERSERVE_KV_F16 && kv_type != ITERSERVE_KV_BF16)
        return ITERSERVE_ETYPE;
    if (nseq < 1) return ITERSERVE_OK;
    const int64_t nblocks = pool_slots / bs;
    for (int s = 0; s < nseq; s++) {
        const long total = (long)ctx[s] + qlens[s];
        if (qlens[s] < 1 || ctx[s] < 0 || total > (long)max_blocks * bs) return ITERSERVE_ELEN;
        const int32_t *t = tables + (long)s * max_blocks;
        for (long b = 0; b < (total + bs - 1) / bs; b++)
            if (t[b] < 0 || t[b] >= nblocks) return ITERSERVE_EBLOCK;
    }
    const int G = H / kvh;
    const int nq = ROWS_TARGET / G > 1 ? ROWS_TARGET / G : 1;
    int nitems = 0;
    for (int s = 0; s < nseq; s++) nitems += kvh * ((qlens[s] + nq - 1) / nq);
    pa_item *items = malloc(sizeof(pa_item) * (size_t)nitems);
    if (!items) return ITERSERVE_ENOMEM;
    int k = 0;
    for (int s = 0; s < nseq; s++)
        for (int q0 = 0; q0 < qlens[s]; q0 += nq)
            for (int h = 0; h < kvh; h++) {
                const int n = qlens[s] - q0 < nq ? qlens[s] - q0 : nq;
                const int qp0 = ctx[s] + q0;
                const int lo = window > 0 && qp0 - window + 1 > 0 ? qp0 - window + 1 : 0;
                items[k++] = (pa_item){s, h, q0, n, (double)n * (qp0 + n - lo)};
            }
    qsort(items, (size_t)nitems, sizeof(pa_item), cmp_work);
    const pa_args a = {q, kpool, vpool, q_starts, ctx, qlens, tables, max_blocks, window, H, kvh,
                       d, bs, kv_type, scale, out};
    const int use512 = iterserve_prefill_attention_isa(isa, d) == 2;
    const int Rmax = nq * G, Rp = (Rmax + 15) / 16 * 16;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > nitems) nthreads = nitems;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        pa_scratch sc;
        const size_t fl = (size_t)Rp * d * 2 + (size_t)KT * Rp + 3 * (size_t)Rp
                          + 2 * (size_t)KT * d + (size_t)d + 64;
        float *buf = aligned_alloc(64, (fl * sizeof(float) + 63) / 64 * 64);
        sc.kr = malloc(sizeof(float *) * KT);
        sc.vr = malloc(sizeof(float *) * KT);
        if (!buf || !sc.kr || !sc.vr) {
#pragma omp atomic write
            failed = 1;
        } else {
            memset(buf, 0, fl * sizeof(float));
            sc.Qt = buf;
            sc.O = sc.Qt + (size_t)Rp * d;
            sc.S = sc.O + (size_t)Rp * d;
            sc.m = sc.S + (size_t)KT * Rp;
            sc.l = sc.m + Rp;
            sc.alpha = sc.l + Rp;
            sc.Kp = sc.alpha + Rp;
            sc.Vp = sc.Kp + (size_t)KT * d;
            sc.zero = sc.Vp + (size_t)KT * d;
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < nitems; i++) {
            if (!buf || !sc.kr || !sc.vr) continue;
            if (use512) run_item_avx512(&a, &items[i], &sc);
            else run_item_avx2(&a, &items[i], &sc);
        }
        free(buf);
        free(sc.kr);
        free(sc.vr);
    }
    free(items);
    return failed ? ITERSERVE_ENOMEM : ITERSERVE_OK;
}
