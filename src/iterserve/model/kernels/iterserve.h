/* The one ABI of iterserve's native CPU kernels: every exported function and struct, once.
 *
 * Why one header: the prototypes used to be written three times (in each .c file, again in
 * decode_layers.c, and as ctypes argtypes and Structure copies in Python), and nothing
 * checked that the copies agreed. Every kernel source includes this file; kernels/__init__.py
 * declares the same functions once (`_ARGTYPES`) and the same structs once (`Segment`,
 * `Linear`, `Layer`), and refuses to use a library whose `iterserve_abi()` (struct sizes and
 * field offsets, the ABI version, the block sizes of every type) differs from what ctypes
 * computes. Python callers go through one checked wrapper per kernel (dtype, contiguity,
 * shapes, strides -> ValueError); no raw pointer reaches these functions unchecked.
 *
 * Weights are GGUF's own encoding: each row of a weight matrix is the row's blocks exactly as
 * they lie in the file (f16 scales inside the blocks); a matrix may be split into row
 * segments of different types (fused q/k/v, gate/up), each written into its own column range
 * of one output. Type ids are ggml's (gguf.GGMLQuantizationType).
 *
 * Functions that take indices from the caller (block tables, slots, lengths) check them and
 * return a nonzero ITERSERVE_E* code instead of reading out of bounds.
 */
#ifndef ITERSERVE_H
#define ITERSERVE_H
#include <stdint.h>

#define ITERSERVE_ABI_VERSION 3

/* ggml type ids (gguf.GGMLQuantizationType) */
enum {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7,
    GGML_Q8_0 = 8, GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13,
    GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23, GGML_BF16 = 30,
    GGML_TYPE_LIMIT = 40
};

/* error codes of the functions that return int */
enum { ITERSERVE_OK = 0, ITERSERVE_EBLOCK = 1, ITERSERVE_ESLOT = 2, ITERSERVE_ELEN = 3,
       ITERSERVE_ETYPE = 4, ITERSERVE_ENOMEM = 5 };

/* One row segment of a weight: `rows` rows of `row_bytes` bytes each (row r at
 * data + r * row_stride), every row `k` elements of ggml type `type`. */
typedef struct {
    int64_t type, rows, row_bytes, row_stride;
    const uint8_t *data;
} iterserve_segment;

#define ITERSERVE_MAX_SEGMENTS 3
/* A linear layer's weight [sum of rows, k] as 1-3 segments stacked in output order. */
typedef struct {
    int64_t nseg, k;
    iterserve_segment seg[ITERSERVE_MAX_SEGMENTS];
} iterserve_linear;

/* One decoder layer of the Llama family for iterserve_decode_layers. The optional pointers
 * are NULL when the architecture has no such tensor. */
typedef struct {
    const float *ln1, *ln2;            /* [hidden] input / post-attention RMSNorm weights */
    const float *qkv_bias;             /* [(H + 2 kvh) d] or NULL (Qwen2) */
    const float *q_norm, *k_norm;      /* [d] per-head RMSNorm weights or NULL (Qwen3) */
    iterserve_linear qkv, o, gate_up, down;
} iterserve_layer;

/* --- ABI self-description (kernels/__init__.py compares it with ctypes) ----------------- */
/* Writes up to cap int64s: version, sizeof + offsets of the structs, then per type id
 * 0..GGML_TYPE_LIMIT-1 (block elements, block bytes, qgemm?, dequant?); returns the count. */
int64_t iterserve_abi(int64_t *out, int64_t cap);
/* CPU features as run-time detected bits (bit 0 avx2, 1 fma, 2 f16c, 3 avx512f, 4 avx512bw,
 * 5 avx512vl, 6 avx512vnni, 7 avx512bf16, 8 avxvnni). */
int64_t iterserve_cpu_features(void);

/* --- GEMM and dequantisation over GGUF blocks (qgemm.c, dequant.c) ----------------------- */
/* y[m][col] = sum_j x[m][j] * W[col][j] for the n rows of W (one segment), m < M; y row m at
 * y + m * ldy (the caller offsets y by the segment's first output column). From a per-type
 * row count on (qgemm.c's panel_rows, measured per type) it runs iterserve_gemm. */
void iterserve_qgemm(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                     const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                     int nthreads);
/* The same product for many rows of x (prefill, large batches; prefill.c): weight panels
 * decoded into an L1 scratch, then a register-blocked float32 GEMM. Any type `dequant`
 * decodes; k a multiple of the type's block (of 32 for the float types). Returns
 * ITERSERVE_OK, ITERSERVE_ETYPE (type or k not accepted) or ITERSERVE_ENOMEM. */
int iterserve_gemm(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                   const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int nthreads);
/* The instruction set iterserve_gemm and iterserve_qgemm's register kernels use:
 * want 1 = AVX2, 2 = AVX-512F, -1 = only report it, anything else (or more than the CPU
 * has) = the best the CPU has; returns the one now in use. */
int64_t iterserve_gemm_isa(int64_t want);
/* One path of iterserve_qgemm's float mode, for tests and benchmarks (kquant): path 1 = the
 * register kernel of the type for the ISA in use at any row count (no hand-over to the panel
 * GEMM), 2 = the generic decode-into-L1 kernel, 3 = the panel GEMM, else iterserve_qgemm. */
void iterserve_qgemm_path(int64_t path, int64_t type, const uint8_t *w, int64_t n,
                          int64_t row_stride, int64_t k, const float *x, int64_t M, int64_t ldx,
                          float *y, int64_t ldy, int nthreads);
/* out[r][0..k) = W[r] as float32, exactly as gguf-py's dequantize, for r < n. */
void iterserve_dequant(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                       int64_t k, float *out, int64_t ldo, int nthreads);

/* --- 8-bit activations, integer dot products (qdot8.c) ----------------------------------- */
/* The same product as iterserve_qgemm with x quantised to int8 once per call (Q8_0 blocks of
 * 32 for Q4_0 / Q8_0, Q8_K blocks of 256 for Q4_K / Q6_K) and integer dot products (AVX2
 * maddubs/madd or AVX-512 VNNI). Not bit-identical with the float path (activation rounding).
 * Returns ITERSERVE_OK, ITERSERVE_ETYPE (type without an int8 kernel, or k not whole blocks)
 * or ITERSERVE_ENOMEM. */
int iterserve_qgemm_act8(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                         int64_t k, const float *x, int64_t M, int64_t ldx, float *y,
                         int64_t ldy, int nthreads);
/* Instruction set of the int8 kernels: want 1 = AVX2, 2 = AVX-512 F/BW/VL/VNNI, -1 = only
 * report, anything else (or more than the CPU has) = the best; returns the one in use. */
int64_t iterserve_act8_isa(int64_t want);
/* Which AVX-512 kernels the 32-element types take: 0 = the 4-block VBMI kernels (default where
 * the CPU has VBMI), 1 = the two-block pair kernels (A/B); another value only reports. */
int64_t iterserve_act8_variant(int64_t v);
/* K-quant decode kernels' K chunk per row tile (A/B): 0 = 32 KB, Q6_K 64 KB (default),
 * 1 = session 14's 16 KB, 2 = no chunks, 3..1024 = that many KB; others only report. */
int64_t iterserve_act8_kq_variant(int64_t v);
/* Row count from which auto runs K-quant decode steps on iterserve_gemm8: 0 = the measured
 * per-type rows (default), v > 0 = from v rows (33: never; A/B); v < 0 only reports. */
int64_t iterserve_act8_kq_gemm_rows(int64_t v);
/* The same for the 32-element types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0): 0 = the measured rows
 * (default), v > 0 = from v rows (33: never, session 15's path; A/B); v < 0 only reports. */
int64_t iterserve_act8_q32_gemm_rows(int64_t v);
/* Most rows per AVX-512 K-quant decode tile where K <= 4096: 6 (default), 4 (session 14) ..
 * 8 (A/B); another value only reports. */
int64_t iterserve_act8_kq_tile(int64_t v);
/* K-quant decode kernels: 0 = one decode per super-block for all rows of the step (default,
 * session 16), 1 = session 15's row tiles (A/B); 101..112 = rows per tile of the former
 * (A/B); another value only reports. Returns 0 or 1. */
int64_t iterserve_act8_kq_decode(int64_t v);
/* Activation mode of iterserve_qgemm: 0 float (qgemm.c's kernels), 1 int8 (qdot8.c for the
 * types it has, up to 32 rows), 2 auto (int8 up to the measured per-type row counts in
 * qdot8.c); another value only reports. Returns the mode. */
int64_t iterserve_set_act_mode(int64_t mode);
/* internal: whether the int8 mode takes a call of this type and row count */
int iterserve_can_act8(int64_t type);
int iterserve_act8_takes(int64_t type, int64_t M);
int iterserve_act8_gemm8_takes(int64_t type, int64_t M, int64_t k);

/* --- prefill / large-batch GEMM with 8-bit activations (prefill8.c) --------------------- */
/* iterserve_gemm's product with x quantised to int8 once per call (blocks of 32) and the
 * weight panels decoded to int8 codes + per-block scales: AVX-512 VNNI vpdpbusd, or AVX2
 * maddubs (not Q8_0 there). Types: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K. Returns
 * ITERSERVE_OK, ITERSERVE_ETYPE (type / ISA / k not accepted) or ITERSERVE_ENOMEM. */
int iterserve_gemm8(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                    const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int nthreads);
/* Panel decode of the 32-element types in iterserve_gemm8: 0 = 8 blocks of a row at a time
 * with prefetch (default), 1 = one block at a time (session 15; A/B); others only report. */
int64_t iterserve_gemm8_pack_variant(int64_t v);
int iterserve_can_gemm8(int64_t type);
/* internal: whether iterserve_gemm hands a call of this type and row count to
 * iterserve_gemm8 under the activation mode (iterserve_set_act_mode) */
int iterserve_gemm8_takes(int64_t type, int64_t M);
/* --- bf16 dot products for BF16 (F16) weights (bf16dot.c, AVX-512 BF16) ------------------ */
/* The same product as iterserve_qgemm with x rounded to bf16 once per call and vdpbf16ps
 * (float32 accumulators): path 0 by row count, 1 the decode kernel, 2 the panel GEMM.
 * Returns ITERSERVE_ETYPE (not BF16/F16, k % 32, or no avx512bf16 in use) or ENOMEM. */
int iterserve_bf16_gemm(int64_t path, int64_t type, const uint8_t *w, int64_t n,
                        int64_t row_stride, int64_t k, const float *x, int64_t M, int64_t ldx,
                        float *y, int64_t ldy, int nthreads);
/* 0 = off, 1 = avx512bf16 (if the CPU has it); -1 only reports, anything else = the best. */
int64_t iterserve_bf16_isa(int64_t want);
/* The decode kernel (below BF16_PANEL_ROWS rows) of path 0: 0 streamed (default), 1 the
 * session-14 kernel with K chunks (A/B runs); -1 only reports. */
int64_t iterserve_bf16_variant(int64_t want);
/* internal: whether iterserve_qgemm / iterserve_gemm hand this call to iterserve_bf16_gemm */
int iterserve_bf16_takes(int64_t type, int64_t M);

/* --- streamed decode kernels for F16 weights (f16dot.c, AVX-512F or AVX2 + F16C) ---------- */
/* The same product as iterserve_qgemm for F16 weights, exact float32 (weights widened with
 * vcvtph2ps, float32 FMAs): path 0 the ISA of iterserve_gemm_isa, 1 AVX2, 2 AVX-512F (tests,
 * benchmarks). Any k >= 1. Returns ITERSERVE_ETYPE (not F16, or an ISA the CPU lacks) or ENOMEM. */
int iterserve_f16_gemm(int64_t path, int64_t type, const uint8_t *w, int64_t n,
                       int64_t row_stride, int64_t k, const float *x, int64_t M, int64_t ldx,
                       float *y, int64_t ldy, int nthreads);
/* F16 decode steps: 0 the streamed kernels (default), 1 session 15's paths (qgemm.c register
 * kernel / prefill.c panel; ITERSERVE_F16_DECODE=s15 at start); -1 only reports. */
int64_t iterserve_f16_variant(int64_t want);
/* internal: whether iterserve_qgemm hands this call to iterserve_f16_gemm */
int iterserve_f16_takes(int64_t type, int64_t M);

/* --- per-layer elementwise ops (elementwise.c) ------------------------------------------- */
void iterserve_rmsnorm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps);
void iterserve_silu_mul(const float *gu, float *y, int64_t T, int64_t I);
/* RoPE in place on the first `heads` heads of d floats of T rows (row stride ldx). */
void iterserve_rope(float *x, int64_t T, int64_t ldx, int64_t heads, int64_t d,
                    const float *cos, const float *sin);
/* In place: RMSNorm of each of the H q heads with qw and of the kvh k heads that follow
 * with kw, over T rows of stride ldx (Qwen3's q/k norm). */
void iterserve_qk_norm(float *x, int64_t T, int64_t ldx, int64_t H, int64_t kvh, int64_t d,
                       const float *qw, const float *kw, float eps);

/* --- attention over the paged KV pool (decode_attention.c) ------------------------------- */
/* Returns ITERSERVE_OK, or ITERSERVE_EBLOCK / ELEN when a table entry or length is outside
 * the pool (nothing is computed then). */
int iterserve_decode_attention(const float *q, const float *kpool, const float *vpool,
                               int64_t pool_slots, const int32_t *tables, int max_blocks,
                               const int32_t *lens, int window, int D, int H, int kvh, int d,
                               int bs, float scale, float *out, int nthreads);

/* --- every decoder layer of a decode-only step in one call (decode_layers.c) ------------- */
int iterserve_decode_layers(const iterserve_layer *layers, int nlayers, float *const *kpools,
                            float *const *vpools, int64_t pool_slots, float *h, int64_t T,
                            int64_t hidden, int H, int kvh, int d, int64_t inter, float eps,
                            const float *cos, const float *sin, const int64_t *slot_mapping,
                            const int32_t *tables, int max_blocks, const int32_t *lens,
                            int window, int bs, float scale, int nthreads);

/* --- the same two over a KV pool of float32 or f16 rows (bench, issue 13) --------------- */
/* kv_type: ITERSERVE_KV_F32 or ITERSERVE_KV_F16 (IEEE half, written with round-to-nearest-
 * even like torch's .to(float16)); any other value returns ITERSERVE_ETYPE. */
enum { ITERSERVE_KV_F32 = 0, ITERSERVE_KV_F16 = 1 };
int iterserve_decode_attention_kv(const float *q, const void *kpool, const void *vpool,
                                  int64_t pool_slots, const int32_t *tables, int max_blocks,
                                  const int32_t *lens, int window, int D, int H, int kvh, int d,
                                  int bs, float scale, float *out, int nthreads, int kv_type);

/* --- attention of prefill chunks over the paged KV pool (prefill_attention.c) ------------ */
/* bf16 pools: only the prefill attention reads them (the decode kernels return ETYPE). */
enum { ITERSERVE_KV_BF16 = 2 };
/* nseq chunks; chunk s has qlens[s] queries at rows q_starts[s].. of q / out ([T, H, d]
 * float32), at positions ctx[s].. after ctx[s] cached tokens, its block table at
 * tables + s * max_blocks. Causal within the chunk; window 0 or a sliding window.
 * isa: 0 auto, 1 AVX2, 2 AVX-512 (AVX2 where unsupported). Returns ITERSERVE_OK, ELEN /
 * EBLOCK (nothing computed), ETYPE or ENOMEM. */
int iterserve_prefill_attention(const float *q, const void *kpool, const void *vpool,
                                int64_t pool_slots, int nseq, const int32_t *q_starts,
                                const int32_t *ctx, const int32_t *qlens, const int32_t *tables,
                                int max_blocks, int window, int H, int kvh, int d, int bs,
                                float scale, float *out, int nthreads, int kv_type, int isa);
/* The ISA that `isa` resolves to for head_dim d on this CPU (1 AVX2, 2 AVX-512). */
int64_t iterserve_prefill_attention_isa(int64_t isa, int64_t d);
int iterserve_decode_layers_kv(const iterserve_layer *layers, int nlayers, void *const *kpools,
                               void *const *vpools, int64_t pool_slots, float *h, int64_t T,
                               int64_t hidden, int H, int kvh, int d, int64_t inter, float eps,
                               const float *cos, const float *sin, const int64_t *slot_mapping,
                               const int32_t *tables, int max_blocks, const int32_t *lens,
                               int window, int bs, float scale, int nthreads, int kv_type);

/* --- internal, shared between the kernel sources ---------------------------------------- */
/* Block geometry of a ggml type (0 if unknown) and whether dequant.c decodes it. */
int iterserve_block_elems(int64_t type);
int iterserve_block_bytes(int64_t type);
int iterserve_can_dequant(int64_t type);
int iterserve_can_qgemm(int64_t type);
/* One block of a type -> float32 (dequant.c's decoder, bit-exact with gguf-py); *qb, *bb: the
 * GEMM block geometry (elements, bytes; the float types as 32-element pseudo-blocks). NULL
 * for a type dequant.c does not decode. */
typedef void (*iterserve_decode_fn)(const uint8_t *block, float *out);
iterserve_decode_fn iterserve_block_decoder(int64_t type, int *qb, int *bb);
/* qgemm for any type dequant.c decodes: each block decoded into an L1 buffer, then dotted
 * with up to 8 activation rows (dequant.c). */
void iterserve_qgemm_generic(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                             int64_t k, const float *x, int64_t M, int64_t ldx, float *y,
                             int64_t ldy, int nthreads);

#endif
