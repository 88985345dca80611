/* A Mixture-of-Experts block of a small step in one call (Qwen3-MoE, Mixtral).
 *
 * Why: a decode token reads only its k experts' weights, so an MoE decode step should cost
 * the bytes of the active parameters. On the Python path (model/moe.py) the step paid, per
 * layer, a router GEMM, a softmax and top-k in torch, numpy grouping and 3 x k expert calls,
 * each with its allocations and ctypes conversions: a small Qwen3-MoE shape decoded at 0.16x
 * llama-server's batch-1 speed. Here the same work is a handful of C loops around the same
 * iterserve_qgemm calls a dense layer makes, and decode_layers.c runs it inside the fused
 * decode step. moe.py calls this function too for small row counts, and iterserve_moe_route
 * for every row count, so the fused and per-module paths give bit-identical results and a
 * token's routing does not depend on how many tokens share its step.
 *
 * Order of the arithmetic (the Python path's, moe.py): router logits by iterserve_qgemm;
 * softmax in float32 over all experts; the k largest (ties to the lower id); renormalised
 * when norm_topk; experts in ascending id, each over the tokens that chose it (gathered rows,
 * in token order); out[t] = 0 + y_e0 * w + y_e1 * w ... in that order.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "iterserve.h"

void iterserve_moe_route(const float *logits, int64_t T, int64_t E, int64_t k, int64_t norm_topk,
                         float *weights, int64_t *ids) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        float mx = l[0];
        for (int64_t e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += expf(l[e] - mx);
        float *w = weights + t * k;
        int64_t *id = ids + t * k;
        for (int64_t s = 0; s < k; s++) {         /* selection: k is small (2-8) */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t j = 0; j < s; j++) taken |= id[j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[s] = best;
            w[s] = expf(l[best] - mx) / sum;
        }
        if (norm_topk) {
            float tot = 0.0f;
            for (int64_t s = 0; s < k; s++) tot += w[s];
            for (int64_t s = 0; s < k; s++) w[s] = w[s] / tot;
        }
    }
}

/* Rows [r0, r1) of y = x . W^T (one thread): the part of each segment that falls in them. */
static void linear_rows(const iterserve_linear *w, const float *x, int64_t T, int64_t ldx,
                        float *y, int64_t ldy, int64_t r0, int64_t r1) {
    int64_t col = 0;
    for (int s = 0; s < w->nseg && col < r1; s++) {
        const iterserve_segment *g = w->seg + s;
        const int64_t a = r0 > col ? r0 : col, b = r1 < col + g->rows ? r1 : col + g->rows;
        if (a < b)
            iterserve_qgemm(g->type, g->data + (a - col) * g->row_stride, b - a, g->row_stride,
                            w->k, x, T, ldx, y + a, ldy, 1);
        col += g->rows;
    }
}

/* Thread `t` of `nt`'s share [*r0, *r1) of n rows, in multiples of 16 (whole register tiles). */
static void share(int64_t n, int t, int nt, int64_t *r0, int64_t *r1) {
    const int64_t tiles = (n + 15) / 16;
    *r0 = tiles * t / nt * 16;
    *r1 = tiles * (t + 1) / nt * 16;
    if (*r1 > n) *r1 = n;
    if (*r0 > n) *r0 = n;
}

/* Why one parallel region: on the per-call path each of a token's k experts makes two GEMM
 * calls, each its own OpenMP fork and join over rows as small as 2 x 256 (9 a layer at k = 4,
 * with the router). Here the threads split the rows of every active expert's gate/up, then of
 * every down, then the output columns, with three barriers a layer; each output row is the
 * same single-thread kernel's either way, so the result does not depend on the split. */
int iterserve_moe_forward(const iterserve_moe *m, const float *x, int64_t T, int64_t hidden,
                          float *out, int nthreads) {
    const int64_t E = m->num_experts, k = m->top_k, I = m->inter, P = T * k;
    if (T <= 0) return ITERSERVE_OK;
    /* scratch: logits [T][E], weights [T][k], per (token, expert) pair p grouped by expert:
     * xe [P][hidden], gu [P][2I], act [P][I], ye [P][hidden], scale [P]; ids [T][k],
     * rows [P] (the pair's token), first [E + 1] (expert e's pairs: first[e] .. first[e+1]) */
    const int64_t floats = T * E + P * (1 + 2 * hidden + 3 * I) + P;
    float *buf = malloc(sizeof(float) * (size_t)floats);
    int64_t *ibuf = malloc(sizeof(int64_t) * (size_t)(P + P + E + 1));
    if (!buf || !ibuf) {
        free(buf);
        free(ibuf);
        return ITERSERVE_ENOMEM;
    }
    float *logits = buf, *wts = logits + T * E, *xe = wts + P, *gu = xe + P * hidden;
    float *act = gu + P * 2 * I, *ye = act + P * I, *scale = ye + P * hidden;
    int64_t *ids = ibuf, *rows = ids + P, *first = rows + P;

#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t r0, r1;
        share(E, t, nt, &r0, &r1);
        linear_rows(&m->router, x, T, hidden, logits, E, r0, r1);
#pragma omp barrier
#pragma omp single
        {
            iterserve_moe_route(logits, T, E, k, m->norm_topk, wts, ids);
            int64_t n = 0;
            for (int64_t e = 0; e < E; e++) {      /* pairs by expert, tokens in order */
                first[e] = n;
                for (int64_t tok = 0; tok < T; tok++)
                    for (int64_t s = 0; s < k; s++)
                        if (ids[tok * k + s] == e) {
                            rows[n] = tok;
                            scale[n] = wts[tok * k + s];
                            memcpy(xe + n * hidden, x + tok * hidden,
                                   sizeof(float) * (size_t)hidden);
                            n++;
                        }
            }
            first[E] = n;
        }                                          /* (the single's barrier) */
        for (int64_t e = 0; e < E; e++) {          /* every expert's gate/up rows, split */
            const int64_t n = first[e + 1] - first[e];
            if (!n) continue;
            share(2 * I, t, nt, &r0, &r1);
            linear_rows(m->gate_up + e, xe + first[e] * hidden, n, hidden,
                        gu + first[e] * 2 * I, 2 * I, r0, r1);
        }
#pragma omp barrier
        share(P, t, nt, &r0, &r1);                 /* SiLU x up: pairs split */
        for (int64_t j = r0; j < r1; j++) iterserve_silu_mul(gu + j * 2 * I, act + j * I, 1, I);
#pragma omp barrier
        for (int64_t e = 0; e < E; e++) {
            const int64_t n = first[e + 1] - first[e];
            if (!n) continue;
            share(hidden, t, nt, &r0, &r1);
            linear_rows(m->down + e, act + first[e] * I, n, I, ye + first[e] * hidden, hidden,
                        r0, r1);
        }
#pragma omp barrier
        share(hidden, t, nt, &r0, &r1);            /* out columns split; experts in order */
        for (int64_t tok = 0; tok < T; tok++)
            for (int64_t i = r0; i < r1; i++) out[tok * hidden + i] = 0.0f;
        for (int64_t j = 0; j < P; j++) {
            float *o = out + rows[j] * hidden;
            const float *y = ye + j * hidden;
            const float w = scale[j];
            for (int64_t i = r0; i < r1; i++) o[i] = o[i] + y[i] * w;
        }
    }
    free(buf);
    free(ibuf);
    return ITERSERVE_OK;
}
