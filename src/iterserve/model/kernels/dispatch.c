/* The one routing table of the linear layers: (type, rows, activation mode) -> kernel.
 *
 * Why one table: each kernel file is a leaf that computes y = x . W^T its own way (qgemm.c's
 * float register kernels, prefill.c's float panel GEMM, qdot8.c's int8 decode kernels,
 * prefill8.c's int8 panel GEMM, bf16dot.c, f16dot.c, dequant.c's generic kernel); which one a
 * call takes is decided here and nowhere else, from iterserve_st (config.c) and the row
 * counts below, measured per type. The per-module path (layers.Linear) and the fused decode
 * layers (decode_layers.c) both call iterserve_qgemm / iterserve_gemm, so they take the same
 * kernel for the same call.
 *
 * The row counts are where one kernel measured faster than the next (same process,
 * alternating, CPU time, weights streamed from memory, 2-core AVX-512 EPYC under load;
 * benchmarks/bench_int8.py --crossover, bench_qgemm.py, bench_bf16.py; the JSON files named
 * are in benchmarks/results):
 *
 * - Float register kernels against the float panel GEMM (panel_rows; kquant-panel-rows-t1
 *   .json, register time / panel time on 2048x2048, 8192x2048, 2048x8192): Q4_K 0.37-0.69 at
 *   1 row, 0.79-0.90 at 4, 1.12-1.35 at 8 -> 8; Q5_K 1.00-1.18 at 8 -> 8; Q6_K 0.63-1.84 at
 *   4 -> 4; Q5_0 1.03-1.71 at 8, Q5_1 0.69-1.16 at 8 -> 8; F16 / BF16 / F32 1.03-1.43 at 4
 *   -> 3 (float panels are cheap to pack); Q4_0 / Q4_1 / Q8_0 level at 12-16 rows, the panel
 *   1.2-1.4x faster at 24-32 -> 16; Q2_K, Q3_K, IQ4_XS (the generic kernel) slower from 2;
 *   IQ4_NL / MXFP4 with AVX-512 (qgemm32_512; paths-codebook-t1.json) 0.12-0.19 at 1 row,
 *   0.36-0.43 at 8, 0.47-0.59 at 16 -> 32 (the panel decodes their blocks one by one),
 *   without it the generic kernel -> 2.
 *   The same table serves AVX2-only CPUs (not measured there).
 * - int8 decode kernels against the float kernels (int8-qgemm-cpu1.json, q32-int8-float.json,
 *   float time / int8 time): Q4_K 1.7-2.8x and Q6_K 1.3-4.6x at 1-32 rows; Q4_0 / Q8_0 1.1-1.9x
 *   at 1-8 rows and 0.8-0.9x at 16 with the pair kernels, while the 4-block VBMI kernels make
 *   Q4_0 / Q4_1 / Q5_0 / Q5_1 1.4-7x at 1-32 rows (Q8_0 0.9-2.2x). Hence auto runs int8
 *   decode for the K-quants up to 32 rows (ACT8_MAX_ROWS, layers.QUANT_MAX_ROWS), for the
 *   32-element nibble types up to 32 with VBMI, else and for Q8_0 up to 8.
 * - int8 decode kernels against the int8 GEMM (gemm8_from: decode time / GEMM time, 1 | 2
 *   threads, qo 2048x2048, gate_up 8192x2048, down 2048x8192, quiet kq-crossover runs):
 *   Q4_K qo 16: 1.01 | 1.21, gate_up 16: 0.94 | 0.92 and 20: 1.01 | 1.12, down 12: 0.92 |
 *   1.11, 14: 0.94 | 1.02; Q5_K qo 16: 1.09 | 1.32, down 14: 0.97 | 1.04; Q6_K qo 20: 0.90 |
 *   0.91, 24: 1.04 | 1.05, down 10: 0.93 | 1.00, 11: 1.02 | 1.14. AVX2 (forced) crosses at
 *   about the same rows. The 32-element types (q4-crossover-t1.json, one thread, qo / gate_up
 *   / down): Q4_0 at 12 rows 1.16 0.91 1.23, 14: 1.29 0.97 1.33; Q5_1 at 12: 1.16 1.07 1.61;
 *   Q8_0 at 4: 1.14 1.70 1.77; down at 6 rows Q4_0 1.11, Q4_1 1.26, Q5_0 1.25, Q5_1 1.42.
 *   Without the VBMI kernels (AVX2 forced, q4-crossover-avx2.json) the GEMM wins from 12 rows
 *   at the latest. Q8_0 where K is not a multiple of 256 (the bundled model's tied LM head,
 *   49152 x 576; the GEMM's grouped panel decode needs 8 blocks a row): decode / GEMM 0.80 at
 *   8 rows, 1.02 at 12 (q32-q8_0-head135-quiet.json); from 4 rows it cost the bundled model's
 *   `mix` at 8 slots 20%.
 * - The int8 GEMM against the float panel GEMM at 64 / 512 rows (i8gemm-prefill-gemm-t1
 *   .json): AVX-512 VNNI 2.1-2.5x / 2.7-3.1x (Q4_K, Q6_K, Q4_0), AVX2 1.4-1.6x / 1.3-1.6x:
 *   both ISAs take it from 33 rows under auto (Q8_0 only with VNNI: the AVX2 GEMM would
 *   saturate vpmaddubsw and refuses it).
 * - bf16 dot products (auto, avx512bf16 CPUs): BF16 weights at every row count, F16 from
 *   F16_DOT_ROWS (bf16dot.c says why); F16 decode steps of 1-16 rows take f16dot.c's streamed
 *   exact kernels in every mode (f16-kernels-t{1,2}.json: 1.2-2.4x the float panel at 4-12
 *   rows; level with the bf16 panel at 16).
 */
#include <stdint.h>

#include "iterserve.h"

/* ---- batch invariance (iterserve_config.batch_invariant) ----------------------------------
 * For every output element one order of arithmetic whatever the call's row count, so that a
 * sequence's logits do not depend on what else its step holds (decode rows, prefill chunks,
 * chunk sizes). Every kernel below splits the output columns over threads and never K.
 * - int8 / auto, the int8 types: prefill8.c's arithmetic at every row count (its decode-row
 *   kernel iterserve_k_dec8 below DEC8_GEMM_ROWS, its panel GEMM from there; the two are
 *   bit-identical, and so are the AVX2 and AVX-512 GEMMs).
 * - otherwise (float mode, the float types, the types without int8 kernels): prefill.c's
 *   float panel GEMM at every row count (one FMA chain per output, k in order); BF16 in auto
 *   on avx512bf16 CPUs bf16dot.c's panel GEMM at every row count; F16 the float panel.
 * Cost (same process, alternating, one thread, CPU time, weights cycled through 96 MB, medians
 * of 5, 2-core AVX2 EPYC under load ~12), iterserve_k_dec8 time / the default int8 decode
 * kernels' at 1 | 8 rows: Q4_K 2048x2048 2.96 | 1.57, 2048x8192 2.06 | 1.49; Q6_K 2048x2048
 * 3.73 | 2.36; Q4_0 2048x2048 1.60 | 0.69; Q4_1 1536x576 1.44 | 1.06; Q8_0 4096x576 1.82 |
 * 1.20. Far above the 10% a default may cost, so it is opt-in. */
#define DEC8_GEMM_ROWS 8

static int64_t route_invariant(int64_t type, int64_t M, int mode) {
    if (mode != ITERSERVE_ACT_FLOAT && iterserve_can_gemm8(type)) {
        if (M >= DEC8_GEMM_ROWS && (type != GGML_Q8_0 || iterserve_st.int8 == 2))
            return ITERSERVE_K_GEMM8;
        return ITERSERVE_K_DEC8;
    }
    if (type == GGML_BF16 && mode == ITERSERVE_ACT_AUTO && iterserve_st.bf16)
        return ITERSERVE_K_BF16;
    return ITERSERVE_K_PANEL;
}

#define ACT8_MAX_ROWS 32       /* decode steps: layers.QUANT_MAX_ROWS */
#define F16_STREAM_ROWS 16     /* f16dot.c's kernels up to here */
#define F16_DOT_ROWS 16        /* auto on avx512bf16 CPUs: F16 on the bf16 panel from here */
#define BF16_PANEL_ROWS 16     /* bf16dot.c: its panel GEMM from here, its decode kernel below */

static int is_kq(int64_t type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
}

/* From how many rows the float register kernels hand over to the float panel GEMM. */
static int64_t panel_rows(int64_t type) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q8_0: return 16;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q5_0: case GGML_Q5_1: return 8;
    case GGML_Q6_K: return 4;
    case GGML_F32: case GGML_F16: case GGML_BF16: return 3;
    case GGML_IQ4_NL: case GGML_MXFP4: return iterserve_st.wide == 2 ? 32 : 2;
    default: return 2;
    }
}

/* From how many rows auto runs a decode step of an int8 type on the int8 GEMM; K > 4096
 * (down_proj) earlier, where the decode kernels' activation tiles outgrow L1. */
static int64_t gemm8_from(int64_t type, int64_t k) {
    const int lng = k > 4096;
    int64_t from;
    switch (type) {
    case GGML_Q4_K: return lng ? 14 : 17;
    case GGML_Q5_K: return lng ? 14 : 16;
    case GGML_Q6_K: return lng ? 11 : 24;
    case GGML_Q4_0: from = lng ? 8 : 14; break;
    case GGML_Q4_1: from = lng ? 6 : 14; break;
    case GGML_Q5_0: from = lng ? 6 : 14; break;
    case GGML_Q5_1: from = lng ? 6 : 12; break;
    default: from = k % 256 ? 12 : 4; break;                      /* Q8_0 */
    }
    /* without the 4-block VBMI kernels (or for Q8_0) the decode kernels lose from 12 rows */
    if (!(iterserve_st.vbmi && type != GGML_Q8_0) && from > 12) from = 12;
    return from;
}

/* Whether the int8 decode kernels take a call under the mode. */
static int act8_takes(int64_t type, int64_t M, int mode) {
    if (mode == ITERSERVE_ACT_FLOAT || M > ACT8_MAX_ROWS || !iterserve_can_act8(type)) return 0;
    if (mode == ITERSERVE_ACT_INT8 || is_kq(type)) return 1;
    return M <= (iterserve_st.vbmi && type != GGML_Q8_0 ? 32 : 8);
}

static int bf16_takes(int64_t type, int64_t M, int mode) {
    if (M < 1 || mode != ITERSERVE_ACT_AUTO || !iterserve_st.bf16) return 0;
    return type == GGML_BF16 || (type == GGML_F16 && M >= F16_DOT_ROWS);
}

/* The GEMM family (iterserve_gemm: prefill chunks, large batches). */
static int64_t route_gemm(int64_t type, int64_t M, int mode) {
    if (mode != ITERSERVE_ACT_FLOAT && iterserve_can_gemm8(type)
        && (mode == ITERSERVE_ACT_INT8 || M > ACT8_MAX_ROWS)
        && (type != GGML_Q8_0 || iterserve_st.int8 == 2))
        return ITERSERVE_K_GEMM8;
    if (bf16_takes(type, M, mode)) return ITERSERVE_K_BF16;
    return ITERSERVE_K_PANEL;
}

/* The activation mode a call runs under: the process's, or a layer's own where it asks for
 * one (layers.Linear: the LM head's split activations under auto). */
static int mode_of(int act) {
    return act == ITERSERVE_ACT_FLOAT || act == ITERSERVE_ACT_INT8 || act == ITERSERVE_ACT_AUTO
        || act == ITERSERVE_ACT_SPLIT8 ? act : iterserve_st.activations;
}

/* Split activations (iterserve_k_split8) where its two int8 rows per row measured faster
 * than the float kernels; elsewhere, and under batch invariance (whose float kernels are one
 * order at every row count), the mode is float. float time / split8 time, 1 | 2 threads,
 * weights cycled through 300 MB (bench_int8.py --split8, AVX-512 VNNI Xeon), rows 1 2 4 8 16:
 * Q6_K 49152x2048 2.2 1.9 3.5 1.9 1.5 | 2.1 1.8 3.5 1.8 1.4 (32: 0.95 | 0.98); Q4_K 3.3 2.9
 * 2.2 1.9 1.3 | 3.0 2.7 2.4 1.9 1.3; Q8_0 49152x2048 1.23 1.12 0.89 | 1.32 1.10 0.86, the
 * bundled model's 49152x576 1.20 1.30 1.01 | 1.17 1.18 1.13, 0.66 | 0.65 at 8. Hence the
 * K-quants up to 16 rows, the 32-element types up to 2. */
static int split8_takes(int64_t type, int64_t M, int64_t k) {
    const int kq = is_kq(type);
    return !iterserve_st.invariant && M <= (kq ? 16 : 2) && iterserve_can_act8(type)
        && k % (kq ? 256 : 32) == 0;
}

int64_t iterserve_route_act(int64_t type, int64_t M, int64_t k, int act) {
    int mode = mode_of(act);
    if (mode == ITERSERVE_ACT_SPLIT8) {
        if (split8_takes(type, M, k)) return ITERSERVE_K_SPLIT8;
        mode = ITERSERVE_ACT_FLOAT;
    }
    if (iterserve_st.invariant) return route_invariant(type, M, mode);
    if (mode == ITERSERVE_ACT_AUTO && M <= ACT8_MAX_ROWS
        && iterserve_can_act8(type) && iterserve_can_gemm8(type) && M >= gemm8_from(type, k)
        && (type != GGML_Q8_0 || iterserve_st.int8 == 2))
        return ITERSERVE_K_GEMM8;
    if (act8_takes(type, M, mode)) return ITERSERVE_K_ACT8;
    if (bf16_takes(type, M, mode)) return ITERSERVE_K_BF16;
    if (type == GGML_F16 && M >= 1 && M <= F16_STREAM_ROWS) return ITERSERVE_K_F16;
    if (M >= panel_rows(type)) return route_gemm(type, M, mode);
    return ITERSERVE_K_REGISTERS;      /* qgemm.c's kernel of the type, else dequant.c's */
}

int64_t iterserve_route(int64_t type, int64_t M, int64_t k) {
    return iterserve_route_act(type, M, k, ITERSERVE_ACT_PROCESS);
}

int iterserve_linear_kernel(int64_t kernel, int64_t type, const uint8_t *w, int64_t n,
                            int64_t row_stride, int64_t k, const float *x, int64_t M,
                            int64_t ldx, float *y, int64_t ldy, int nthreads) {
    switch (kernel) {
    case ITERSERVE_K_REGISTERS:
        if (!iterserve_can_qgemm(type)) return ITERSERVE_ETYPE;
        if (M >= 1 && n >= 1)
            iterserve_k_registers(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
        return ITERSERVE_OK;
    case ITERSERVE_K_GENERIC:
        if (!iterserve_can_dequant(type)) return ITERSERVE_ETYPE;
        iterserve_qgemm_generic(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
        return ITERSERVE_OK;
    case ITERSERVE_K_PANEL:
        return iterserve_k_panel(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    case ITERSERVE_K_ACT8:
        return iterserve_k_act8(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    case ITERSERVE_K_GEMM8:
        return iterserve_k_gemm8(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    case ITERSERVE_K_DEC8:
        return iterserve_k_dec8(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    case ITERSERVE_K_SPLIT8:
        return iterserve_k_split8(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    case ITERSERVE_K_BF16:
        return iterserve_k_bf16(M >= BF16_PANEL_ROWS || iterserve_st.invariant ? 2 : 1, type, w,
                                n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    case ITERSERVE_K_F16:
        return iterserve_k_f16(0, type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
    default:
        iterserve_qgemm(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
        return ITERSERVE_OK;
    }
}

void iterserve_qgemm(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                     const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                     int nthreads) {
    iterserve_qgemm_act(ITERSERVE_ACT_PROCESS, type, w, n, row_stride, k, x, M, ldx, y, ldy,
                        nthreads);
}

void iterserve_qgemm_act(int act, int64_t type, const uint8_t *w, int64_t n,
                         int64_t row_stride, int64_t k, const float *x, int64_t M,
                         int64_t ldx, float *y, int64_t ldy, int nthreads) {
    if (M < 1 || n < 1) return;
    const int64_t kern = iterserve_route_act(type, M, k, act);
    if (iterserve_linear_kernel(kern, type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads)
        == ITERSERVE_OK)
        return;
    /* a kernel that refused the call (k not whole blocks, no memory): the float path */
    if (M >= panel_rows(type)
        && iterserve_k_panel(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads) == ITERSERVE_OK)
        return;
    iterserve_linear_kernel(ITERSERVE_K_REGISTERS, type, w, n, row_stride, k, x, M, ldx, y, ldy,
                            nthreads);
}

int iterserve_gemm(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                   const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int nthreads) {
    return iterserve_gemm_act(ITERSERVE_ACT_PROCESS, type, w, n, row_stride, k, x, M, ldx, y,
                              ldy, nthreads);
}

int iterserve_gemm_act(int act, int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                       int64_t k, const float *x, int64_t M, int64_t ldx, float *y,
                       int64_t ldy, int nthreads) {
    int QB, BB;
    if (!iterserve_block_decoder(type, &QB, &BB) || k % QB) return ITERSERVE_ETYPE;
    if (M < 1 || n < 1) return ITERSERVE_OK;
    const int mode = mode_of(act) == ITERSERVE_ACT_SPLIT8 ? ITERSERVE_ACT_FLOAT : mode_of(act);
    const int64_t kern = iterserve_st.invariant ? route_invariant(type, M, mode)
                                                : route_gemm(type, M, mode);
    if (kern != ITERSERVE_K_PANEL
        && iterserve_linear_kernel(kern, type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads)
           == ITERSERVE_OK)
        return ITERSERVE_OK;
    return iterserve_k_panel(type, w, n, row_stride, k, x, M, ldx, y, ldy, nthreads);
}
