/* Every decoder layer of a decode-only step in one call (Llama family and gpt-oss, GGUF-encoded
 * weights).
 *
 * Why: with the GEMMs, attention and elementwise ops already native, a small-batch decode step
 * still paid ~4-5 ms of Python per step on this CPU: 30 layers x ~12 module calls, each with
 * torch allocations, views and ctypes argument conversion (a batch-1 step was 13 ms, of which
 * 9 ms was arithmetic). This file strings the same kernels together in C, in the same order
 * and with the same arithmetic as llama.py's native path, so its results are bit-identical to
 * that path (tests/model/test_decode_layers.py checks that):
 *
 *   x  = rmsnorm(h, ln1)              iterserve_rmsnorm
 *   qkv = x . Wqkv^T (+ bias)          iterserve_qgemm per row segment (+ Qwen2's bias)
 *   q/k RMSNorm per head, in place     iterserve_qk_norm (Qwen3 only)
 *   rope on q and k, in place          iterserve_rope
 *   K, V rows -> the paged pools at this step's slots
 *   a  = attention(q, pools)           iterserve_decode_attention (the layer's window and
 *                                      sinks: gpt-oss's sliding / full layers)
 *   h += a . Wo^T (+ bias)             (gpt-oss's o bias)
 *   x  = rmsnorm(h, ln2)
 *   h += silu_mul(x . Wgu^T) . Wdown^T iterserve_silu_mul
 *        or h += moe(x)                 iterserve_moe_forward (moe.c: Qwen3-MoE, Mixtral,
 *                                      gpt-oss)
 *
 * Each weight is a list of 1-3 row segments (iterserve.h's iterserve_linear), possibly of
 * different types (a Q4_K_M file's fused q/k/v), each written into its own column range of
 * the output by the same iterserve_qgemm call the per-module path makes per segment.
 * kernels.DecodeLayers (Python) builds the per-layer descriptors once and checks every shape;
 * the pool addresses come per call (a cache's pools may be replaced). The pools hold float32
 * or f16 rows (iterserve_decode_layers_kv): f16 K/V are rounded to nearest even when written
 * (F16C, as torch's .to(float16) on the per-module path) and widened when read. Slots, block tables
 * and lengths are checked here before anything is written (ITERSERVE_ESLOT / EBLOCK / ELEN).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "iterserve.h"

/* Opt-in phase timing for benchmarks/profile_decode.py (where one decode step's time goes):
 * a decode step runs every layer in this one call, which neither cProfile nor torch.profiler
 * can look into. iterserve_decode_profile(acc) points the accumulator at `acc` (NULL turns
 * it off, the default): each phase below adds its wall seconds (CLOCK_MONOTONIC, on the
 * calling thread, around kernels that are themselves parallel) to acc[phase], and each GEMM
 * segment to acc[PROF_TYPE0 + ggml type] as well (per weight type). Off, it costs one
 * predictable branch per phase; the arithmetic is the same either way. Not thread-safe: one
 * profiler per process. Returns the number of slots acc must have. */
enum { PROF_NORM = 0, PROF_QKV, PROF_BIAS_QKNORM, PROF_ROPE, PROF_KV_WRITE, PROF_ATTN, PROF_O,
       PROF_RESIDUAL, PROF_GATE_UP, PROF_SILU, PROF_DOWN, PROF_CALL, PROF_MOE,
       PROF_TYPE0 = 16,
       PROF_SLOTS = PROF_TYPE0 + 48 };
static double *prof_acc = NULL;

int iterserve_decode_profile(double *acc) {
    prof_acc = acc;
    return PROF_SLOTS;
}

static inline double prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* t0 = the phase's start (0 when off); adds now - t0 to acc[slot]; returns now */
static inline double prof_add(int slot, double t0) {
    if (!prof_acc) return 0.0;
    const double t = prof_now();
    prof_acc[slot] += t - t0;
    return t;
}
#define PROF_START() (prof_acc ? prof_now() : 0.0)

/* y[T][ldy] = x . W^T over the linear's segments, side by side in y's columns. */
static void gemm(const iterserve_linear *w, const float *x, int64_t T, float *y, int64_t ldy,
                 int nthreads) {
    int64_t col = 0;
    for (int s = 0; s < w->nseg; s++) {
        const iterserve_segment *g = w->seg + s;
        const double t0 = PROF_START();
        iterserve_qgemm(g->type, g->data, g->rows, g->row_stride, w->k, x, T, w->k, y + col, ldy,
                        nthreads);
        if (g->type >= 0 && g->type < PROF_SLOTS - PROF_TYPE0) prof_add(PROF_TYPE0 + (int)g->type, t0);
        col += g->rows;
    }
}

/* n floats -> IEEE half, round to nearest even (n a multiple of 8: kvh * head_dim, d % 8 == 0) */
static void to_f16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

int iterserve_decode_layers(const iterserve_layer *layers, int nlayers, float *const *kpools,
                            float *const *vpools, int64_t pool_slots, float *h, int64_t T,
                            int64_t hidden, int H, int kvh, int d, int64_t inter, float eps,
                            const float *cos, const float *sin, const int64_t *slot_mapping,
                            const int32_t *tables, int max_blocks, const int32_t *lens,
                            int window, int bs, float scale, int nthreads) {
    return iterserve_decode_layers_kv(layers, nlayers, (void *const *)kpools,
                                      (void *const *)vpools, pool_slots, h, T, hidden, H, kvh, d,
                                      inter, eps, cos, sin, slot_mapping, tables, max_blocks,
                                      lens, window, bs, scale, nthreads, ITERSERVE_KV_F32);
}

int iterserve_decode_layers_kv(const iterserve_layer *layers, int nlayers, void *const *kpools,
                               void *const *vpools, int64_t pool_slots, float *h, int64_t T,
                               int64_t hidden, int H, int kvh, int d, int64_t inter, float eps,
                               const float *cos, const float *sin, const int64_t *slot_mapping,
                               const int32_t *tables, int max_blocks, const int32_t *lens,
                               int window, int bs, float scale, int nthreads, int kv_type) {
    const double tcall = PROF_START();
    if (kv_type != ITERSERVE_KV_F32 && kv_type != ITERSERVE_KV_F16) return ITERSERVE_ETYPE;
    if (kv_type == ITERSERVE_KV_F16 && d % 8) return ITERSERVE_ETYPE;
    for (int64_t t = 0; t < T; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= pool_slots) return ITERSERVE_ESLOT;
    const int64_t nblocks = pool_slots / bs;
    for (int64_t s = 0; s < T; s++) {             /* as decode_attention checks, before writing */
        if (lens[s] < 1 || (int64_t)lens[s] > (int64_t)max_blocks * bs) return ITERSERVE_ELEN;
        for (int b = 0; b < (lens[s] + bs - 1) / bs; b++) {
            const int32_t blk = tables[s * max_blocks + b];
            if (blk < 0 || blk >= nblocks) return ITERSERVE_EBLOCK;
        }
    }
    const int64_t qsz = (int64_t)H * d, kvsz = (int64_t)kvh * d, qkvw = qsz + 2 * kvsz;
    /* scratch: x [T][hidden], qkv [T][qkvw], q [T][qsz], a [T][qsz], gu [T][2 inter],
     * act [T][inter], y [T][hidden] */
    const int64_t floats = T * (2 * hidden + qkvw + 2 * qsz + 3 * inter);
    float *buf = malloc(sizeof(float) * (size_t)floats);
    if (!buf) return ITERSERVE_ENOMEM;
    float *x = buf, *qkv = x + T * hidden, *q = qkv + T * qkvw, *a = q + T * qsz;
    float *gu = a + T * qsz, *act = gu + T * 2 * inter, *y = act + T * inter;
    for (int l = 0; l < nlayers; l++) {
        const iterserve_layer *L = layers + l;
        void *kpool = kpools[l], *vpool = vpools[l];
        double tp = PROF_START();
        iterserve_rmsnorm(h, L->ln1, x, T, hidden, eps);
        tp = prof_add(PROF_NORM, tp);
        gemm(&L->qkv, x, T, qkv, qkvw, nthreads);
        tp = prof_add(PROF_QKV, tp);
        if (L->qkv_bias)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < qkvw; i++) qkv[t * qkvw + i] = qkv[t * qkvw + i] + L->qkv_bias[i];
        if (L->q_norm)
            iterserve_qk_norm(qkv, T, qkvw, H, kvh, d, L->q_norm, L->k_norm, eps);
        tp = prof_add(PROF_BIAS_QKNORM, tp);
        iterserve_rope(qkv, T, qkvw, H + kvh, d, cos, sin);
        tp = prof_add(PROF_ROPE, tp);
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * qkvw;
            memcpy(q + t * qsz, row, sizeof(float) * (size_t)qsz);
            if (kv_type == ITERSERVE_KV_F16) {
                to_f16((uint16_t *)kpool + slot_mapping[t] * kvsz, row + qsz, kvsz);
                to_f16((uint16_t *)vpool + slot_mapping[t] * kvsz, row + qsz + kvsz, kvsz);
            } else {
                memcpy((float *)kpool + slot_mapping[t] * kvsz, row + qsz,
                       sizeof(float) * (size_t)kvsz);
                memcpy((float *)vpool + slot_mapping[t] * kvsz, row + qsz + kvsz,
                       sizeof(float) * (size_t)kvsz);
            }
        }
        tp = prof_add(PROF_KV_WRITE, tp);
        iterserve_decode_attention_kv(q, kpool, vpool, pool_slots, tables, max_blocks, lens,
                                      L->window > 0 ? (int)L->window : window, (int)T, H, kvh,
                                      d, bs, scale, a, nthreads, kv_type, L->sinks);
        tp = prof_add(PROF_ATTN, tp);
        gemm(&L->o, a, T, y, hidden, nthreads);
        if (L->o_bias)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < hidden; i++) y[t * hidden + i] = y[t * hidden + i] + L->o_bias[i];
        tp = prof_add(PROF_O, tp);
        for (int64_t i = 0; i < T * hidden; i++) h[i] = h[i] + y[i];
        tp = prof_add(PROF_RESIDUAL, tp);
        iterserve_rmsnorm(h, L->ln2, x, T, hidden, eps);
        tp = prof_add(PROF_NORM, tp);
        if (L->moe) {
            const int rc = iterserve_moe_forward(L->moe, x, T, hidden, y, nthreads);
            if (rc != ITERSERVE_OK) {
                free(buf);
                return rc;
            }
            tp = prof_add(PROF_MOE, tp);
        } else {
            gemm(&L->gate_up, x, T, gu, 2 * inter, nthreads);
            tp = prof_add(PROF_GATE_UP, tp);
            iterserve_silu_mul(gu, act, T, inter);
            tp = prof_add(PROF_SILU, tp);
            gemm(&L->down, act, T, y, hidden, nthreads);
            tp = prof_add(PROF_DOWN, tp);
        }
        for (int64_t i = 0; i < T * hidden; i++) h[i] = h[i] + y[i];
        prof_add(PROF_RESIDUAL, tp);
    }
    free(buf);
    prof_add(PROF_CALL, tcall);
    return ITERSERVE_OK;
}
