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
 * The arithmetic is attention_core.h's (flash attention's online softmax in 64-key blocks and
 * 128-key segments at absolute positions), the same functions the decode kernel calls, so a
 * query gets the same bits whatever chunk it is in, whatever context is cached before it and
 * whether it is computed here or as a decode row. This file lays the work out:
 * - a work item is one chunk, one KV head and a tile of its queries: the G query heads that
 *   share the KV head times nq queries make R = nq * G rows (~48), so every K/V element loaded
 *   serves R rows (GQA stays grouped);
 * - the item walks the blocks from the first its rows may see (under a sliding window, that of
 *   its first query, aligned down to a block) to its last query, folding each segment into
 *   the rows' totals as it ends; rows that may not see a key score it -inf, which leaves their
 *   state unchanged, so the rows of one tile need not agree on where they start or end;
 * - OpenMP over items (largest first, dynamic), per-thread scratch allocated once per call.
 * The body is compiled for AVX2 and AVX-512 (attention_impl.h), chosen at run time
 * (iterserve_prefill_attention_isa; AVX-512 needs head_dim % 16 == 0).
 *
 * KV pools: float32, f16 and bf16 rows (attention_core.h's at_rows).
 *
 * Indices are checked before any read: every chunk needs 1 <= n, 0 <= ctx, ctx + n <=
 * max_blocks * bs and every block it uses inside the pool, else ITERSERVE_ELEN / ITERSERVE_EBLOCK.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "attention_core.h"
#include "scratch.h"

static __thread void *tl_buf;       /* each OpenMP thread's scratch (scratch.h) */
static __thread size_t tl_cap;

#define ROWS_TARGET 48     /* query rows (queries x heads of a group) per work item */

typedef struct {
    const float *q;
    const int32_t *q_starts, *ctx, *qlens, *tables;
    int max_blocks, window, H, kvh, d;
    float scale;
    float *out;
    at_pools pools;
    const float *sinks;            /* [H] attention sinks, or NULL */
} pa_args;

typedef struct { int s, h, q0, nq; double work; } pa_item;

typedef struct {
    float *Q, *S, *O, *OT, *m, *l, *mT, *lT, *Kp, *Vp, *zero;
    const float **kr, **vr;
    int *pos;
} pa_scratch;

/* One work item: the G query heads of KV head it->h for queries q0 .. q0+nq-1 of chunk it->s. */
static void run_item(const at_ops *ops, const pa_args *a, const pa_item *it, pa_scratch *sc) {
    const int G = a->H / a->kvh, d = a->d, H = a->H;
    const int R = it->nq * G;
    const long qrow0 = (long)a->q_starts[it->s] + it->q0;     /* row of query q0 in q / out */
    const int qp0 = a->ctx[it->s] + it->q0, qp1 = qp0 + it->nq - 1;
    const int window = a->window;
    int lo = window > 0 && qp0 - window + 1 > 0 ? qp0 - window + 1 : 0;
    lo = lo / AT_KT * AT_KT;
    const int hi = qp1 + 1;
    const int32_t *table = a->tables + (long)it->s * a->max_blocks;
    /* row r: query r / G, head h * G + r % G */
    for (int r = 0; r < R; r++) {
        sc->pos[r] = qp0 + r / G;
        ops->scale_row(a->q + ((qrow0 + r / G) * H + (long)it->h * G + r % G) * d, a->scale, d,
                       sc->Q + (long)r * d);
    }
    at_reset(R, d, sc->O, sc->m, sc->l);
    at_reset(R, d, sc->OT, sc->mT, sc->lT);
    for (int t0 = lo; t0 < hi; t0 += AT_KT) {
        const int n = hi - t0 < AT_KT ? hi - t0 : AT_KT;
        at_rows(&a->pools, table, it->h, t0, n, sc->kr, sc->vr, sc->Kp, sc->Vp);
        ops->block(R, sc->Q, sc->pos, window, d, t0, n, sc->kr, (const float *const *)sc->vr,
                   sc->zero, sc->S, sc->O, sc->m, sc->l);
        if ((t0 + AT_KT) % AT_SEG == 0 || t0 + AT_KT >= hi) {     /* a segment ends */
            ops->fold(R, d, sc->O, sc->m, sc->l, sc->OT, sc->mT, sc->lT);
            at_reset(R, d, sc->O, sc->m, sc->l);
        }
    }
    for (int r = 0; r < R; r++) {
        if (a->sinks)
            ops->sink(1, d, a->sinks + (long)it->h * G + r % G, sc->OT + (long)r * d,
                      sc->mT + r, sc->lT + r);
        ops->finish_row(sc->OT + (long)r * d, sc->lT[r], d,
                        a->out + ((qrow0 + r / G) * H + (long)it->h * G + r % G) * d);
    }
}

/* The ISA `isa` (0 auto, 1 AVX2, 2 AVX-512) resolves to for head_dim d on this CPU. The CPU
 * features are read once: cpuid traps to the hypervisor in a VM (~28 us a call measured
 * here, more than a whole short decode attention). */
int64_t iterserve_prefill_attention_isa(int64_t isa, int64_t d) {
    static int64_t features = -1;
    if (features < 0) features = iterserve_cpu_features();   /* idempotent: races are benign */
    const int64_t f = features;
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
                                float scale, float *out, int nthreads, int kv_type, int isa,
                                const float *sinks) {
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
    const pa_args a = {q, q_starts, ctx, qlens, tables, max_blocks, window, H, kvh, d, scale, out,
                       {kpool, vpool, kv_type, d, bs, (long)kvh * d}, sinks};
    const at_ops *ops = at_ops_for(isa, d);
    const int Rmax = nq * G;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > nitems) nthreads = nitems;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        pa_scratch sc = {0};
        const size_t fl = (size_t)Rmax * d * 3 + (size_t)AT_KT * Rmax + 4 * (size_t)Rmax
                          + 2 * (size_t)AT_KT * d + (size_t)d + 64;
        const size_t bytes = fl * sizeof(float) + 2 * AT_KT * sizeof(float *)
                             + (size_t)Rmax * sizeof(int);
        char *buf = scratch_grow(&tl_buf, &tl_cap, bytes);
        const int ok = buf != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else {
            sc.Q = (float *)buf;
            sc.O = sc.Q + (size_t)Rmax * d;
            sc.OT = sc.O + (size_t)Rmax * d;
            sc.S = sc.OT + (size_t)Rmax * d;
            sc.m = sc.S + (size_t)AT_KT * Rmax;
            sc.l = sc.m + Rmax;
            sc.mT = sc.l + Rmax;
            sc.lT = sc.mT + Rmax;
            sc.Kp = sc.lT + Rmax;
            sc.Vp = sc.Kp + (size_t)AT_KT * d;
            sc.zero = sc.Vp + (size_t)AT_KT * d;
            memset(sc.zero, 0, sizeof(float) * (size_t)d);
            sc.kr = (const float **)(buf + fl * sizeof(float));
            sc.vr = sc.kr + AT_KT;
            sc.pos = (int *)(sc.vr + AT_KT);
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < nitems; i++)
            if (ok) run_item(ops, &a, &items[i], &sc);
    }
    free(items);
    return failed ? ITERSERVE_ENOMEM : ITERSERVE_OK;
}
