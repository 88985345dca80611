/* Every decoder layer of a decode-only step in one call (Llama family, block-quantised weights).
 *
 * Why: with the GEMMs, attention and elementwise ops already native, a small-batch decode step
 * still paid ~4-5 ms of Python per step on this CPU: 30 layers x ~12 module calls, each with
 * torch allocations, views and ctypes argument conversion (a batch-1 step was 13 ms, of which
 * 9 ms was arithmetic). This file strings the same kernels together in C, in the same order
 * and with the same arithmetic as llama.py's native path, so its results are bit-identical to
 * that path (tests/model/test_decode_layers.py checks that):
 *
 *   x  = rmsnorm(h, ln1)              iterserve_rmsnorm
 *   qkv = x . Wqkv^T                   iterserve_qgemm
 *   rope on q and k, in place          iterserve_rope
 *   K, V rows -> the paged pools at this step's slots
 *   a  = attention(q, pools)           iterserve_decode_attention
 *   h += a . Wo^T
 *   x  = rmsnorm(h, ln2)
 *   h += silu_mul(x . Wgu^T) . Wdown^T iterserve_silu_mul
 *
 * The model's Python side (llama.py, `use_fused_decode`) builds the per-layer descriptors once;
 * it only takes this path for decode-only steps whose rows all go through the block kernel,
 * with no q/k/v bias and no q/k norm.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void iterserve_qgemm(int kind, const float *x, long M, long K, const uint8_t *qs,
                     const float *d, const float *m, float *y, long N, int nthreads);
void iterserve_rmsnorm(const float *x, const float *w, float *y, long T, long D, float eps);
void iterserve_silu_mul(const float *gu, float *y, long T, long I);
void iterserve_rope(float *x, long T, long ldx, long heads, long d, const float *cos,
                    const float *sin);
void iterserve_decode_attention(const float *q, const float *kpool, const float *vpool,
                                const int32_t *tables, int max_blocks, const int32_t *lens,
                                int window, int D, int H, int kvh, int d, int bs, float scale,
                                float *out, int nthreads);

/* A block-quantised weight [N, K] (see quant.py); mirrors QWeight in llama.py. */
typedef struct {
    int64_t kind, n, k;
    const uint8_t *qs;
    const float *d, *m;
} qweight;

/* One decoder layer; mirrors DecodeLayer in llama.py. */
typedef struct {
    const float *ln1, *ln2;
    float *kpool, *vpool;              /* [slots][kvh * d] */
    qweight qkv, o, gate_up, down;
} decode_layer;

static void gemm(const qweight *w, const float *x, long T, float *y, int nthreads) {
    iterserve_qgemm((int)w->kind, x, T, w->k, w->qs, w->d, w->m, y, w->n, nthreads);
}

void iterserve_decode_layers(const decode_layer *layers, int nlayers, float *h, long T,
                             long hidden, int H, int kvh, int d, long inter, float eps,
                             const float *cos, const float *sin, const int64_t *slot_mapping,
                             const int32_t *tables, int max_blocks, const int32_t *lens,
                             int window, int bs, float scale, int nthreads) {
    const long qsz = (long)H * d, kvsz = (long)kvh * d, qkvw = qsz + 2 * kvsz;
    /* scratch: x [T][hidden], qkv [T][qkvw], q [T][qsz], a [T][qsz], gu [T][2 inter],
     * act [T][inter], y [T][hidden] */
    const long floats = T * (2 * hidden + qkvw + 2 * qsz + 3 * inter);
    float *buf = malloc(sizeof(float) * (size_t)floats);
    float *x = buf, *qkv = x + T * hidden, *q = qkv + T * qkvw, *a = q + T * qsz;
    float *gu = a + T * qsz, *act = gu + T * 2 * inter, *y = act + T * inter;
    for (int l = 0; l < nlayers; l++) {
        const decode_layer *L = layers + l;
        iterserve_rmsnorm(h, L->ln1, x, T, hidden, eps);
        gemm(&L->qkv, x, T, qkv, nthreads);
        iterserve_rope(qkv, T, qkvw, H + kvh, d, cos, sin);
        for (long t = 0; t < T; t++) {
            const float *row = qkv + t * qkvw;
            memcpy(q + t * qsz, row, sizeof(float) * (size_t)qsz);
            memcpy(L->kpool + slot_mapping[t] * kvsz, row + qsz, sizeof(float) * (size_t)kvsz);
            memcpy(L->vpool + slot_mapping[t] * kvsz, row + qsz + kvsz,
                   sizeof(float) * (size_t)kvsz);
        }
        iterserve_decode_attention(q, L->kpool, L->vpool, tables, max_blocks, lens, window,
                                   (int)T, H, kvh, d, bs, scale, a, nthreads);
        gemm(&L->o, a, T, y, nthreads);
        for (long i = 0; i < T * hidden; i++) h[i] = h[i] + y[i];
        iterserve_rmsnorm(h, L->ln2, x, T, hidden, eps);
        gemm(&L->gate_up, x, T, gu, nthreads);
        iterserve_silu_mul(gu, act, T, inter);
        gemm(&L->down, act, T, y, nthreads);
        for (long i = 0; i < T * hidden; i++) h[i] = h[i] + y[i];
    }
    free(buf);
}
