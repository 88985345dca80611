/* A Mixture-of-Experts block of a small step in one call (Qwen3-MoE, Mixtral, gpt-oss).
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
 * Order of the arithmetic (the Python path's, moe.py): router logits by iterserve_qgemm, plus
 * the router's bias; the k largest (ties to the lower id); softmax in float32 over all experts
 * (renormalised when norm_topk) or over the k chosen logits (gpt-oss); experts in ascending
 * id, each over the tokens that chose it (gathered rows, in token order): gate_up GEMM plus
 * bias, the activation (elementwise.c, the kernel moe.py's Expert calls), down GEMM plus
 * bias; out[t] = 0 + y_e0 * w + y_e1 * w ... in that order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "iterserve.h"

/* y[T][ldy] = x[T][ldx] . W^T over the linear's segments, side by side in y's columns. */
static void linear(const iterserve_linear *w, const float *x, int64_t T, int64_t ldx, float *y,
                   int64_t ldy, int nthreads) {
    int64_t col = 0;
    for (int s = 0; s < w->nseg; s++) {
        const iterserve_segment *g = w->seg + s;
        iterserve_qgemm(g->type, g->data, g->rows, g->row_stride, w->k, x, T, ldx, y + col, ldy,
                        nthreads);
        col += g->rows;
    }
}

void iterserve_moe_route(const float *logits, int64_t T, int64_t E, int64_t k, int64_t norm_topk,
                         int64_t routing, float *weights, int64_t *ids) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
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
        }
        /* softmax over all E logits (SOFTMAX_TOPK) or over the k chosen ones (TOPK_SOFTMAX);
         * the largest logit is the first chosen either way */
        const float mx = l[id[0]];
        float sum = 0.0f;
        if (routing == ITERSERVE_ROUTE_TOPK_SOFTMAX)
            for (int64_t s = 0; s < k; s++) sum += expf(l[id[s]] - mx);
        else
            for (int64_t e = 0; e < E; e++) sum += expf(l[e] - mx);
        for (int64_t s = 0; s < k; s++) w[s] = expf(l[id[s]] - mx) / sum;
        if (norm_topk && routing != ITERSERVE_ROUTE_TOPK_SOFTMAX) {
            float tot = 0.0f;
            for (int64_t s = 0; s < k; s++) tot += w[s];
            for (int64_t s = 0; s < k; s++) w[s] = w[s] / tot;
        }
    }
}

/* y[r][j] += b[j] over n rows of ld floats (a Linear's bias, added after its GEMM as
 * layers.Linear does) */
static void add_bias(float *y, int64_t n, int64_t cols, int64_t ld, const float *b) {
    if (!b) return;
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < cols; j++) y[r * ld + j] = y[r * ld + j] + b[j];
}

int iterserve_moe_forward(const iterserve_moe *m, const float *x, int64_t T, int64_t hidden,
                          float *out, int nthreads) {
    const int64_t E = m->num_experts, k = m->top_k, I = m->inter;
    if (T <= 0) return ITERSERVE_OK;
    /* scratch: logits [T][E], weights [T][k], xe [T][hidden], gu [T][2I], act [T][I],
     * ye [T][hidden]; ids [T][k], rows [T] */
    const int64_t floats = T * (E + k + 2 * hidden + 3 * I);
    float *buf = malloc(sizeof(float) * (size_t)floats);
    int64_t *ibuf = malloc(sizeof(int64_t) * (size_t)(T * k + T));
    if (!buf || !ibuf) {
        free(buf);
        free(ibuf);
        return ITERSERVE_ENOMEM;
    }
    float *logits = buf, *wts = logits + T * E, *xe = wts + T * k, *gu = xe + T * hidden;
    float *act = gu + T * 2 * I, *ye = act + T * I;
    int64_t *ids = ibuf, *rows = ids + T * k;
    float *scale = logits;            /* reused once routed: one weight per gathered row */

    linear(&m->router, x, T, hidden, logits, E, nthreads);
    add_bias(logits, T, E, E, m->router_bias);
    iterserve_moe_route(logits, T, E, k, m->norm_topk, m->routing, wts, ids);
    memset(out, 0, sizeof(float) * (size_t)(T * hidden));
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t t = 0; t < T; t++)
            for (int64_t s = 0; s < k; s++)
                if (ids[t * k + s] == e) {
                    rows[n] = t;
                    scale[n] = wts[t * k + s];
                    n++;
                }
        if (!n) continue;
        const float *xin = x;
        if (T > 1) {                      /* one token: its own row, no gather */
            for (int64_t j = 0; j < n; j++)
                memcpy(xe + j * hidden, x + rows[j] * hidden, sizeof(float) * (size_t)hidden);
            xin = xe;
        }
        linear(m->gate_up + e, xin, n, hidden, gu, 2 * I, nthreads);
        add_bias(gu, n, 2 * I, 2 * I, m->gate_up_bias ? m->gate_up_bias[e] : NULL);
        if (m->act == ITERSERVE_MOE_SWIGLU_OAI)
            iterserve_swiglu_oai(gu, act, n, I, m->interleaved, m->alpha, m->limit);
        else
            iterserve_silu_mul(gu, act, n, I);
        linear(m->down + e, act, n, I, ye, hidden, nthreads);
        add_bias(ye, n, hidden, hidden, m->down_bias ? m->down_bias[e] : NULL);
        for (int64_t j = 0; j < n; j++) {
            float *o = out + rows[j] * hidden;
            const float *y = ye + j * hidden;
            const float w = scale[j];
            for (int64_t i = 0; i < hidden; i++) o[i] = o[i] + y[i] * w;
        }
    }
    free(buf);
    free(ibuf);
    return ITERSERVE_OK;
}
