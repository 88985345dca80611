/* The one ABI of iterserve's native CPU kernels: every exported function and struct, once.
 *
 * Why one header: prototypes written in each .c file, again in decode_layers.c, and as
 * ctypes argtypes and Structure copies in Python would be three copies that nothing checks
 * agree. Every kernel source includes this file; kernels/_abi.py
 * declares the same functions once (`ARGTYPES`) and the same structs once (`Segment`,
 * `Linear`, `Layer`, `Config`), and refuses to use a library whose `iterserve_abi()` (struct sizes and
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

#define ITERSERVE_ABI_VERSION 9

/* ggml type ids (gguf.GGMLQuantizationType) */
enum {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7,
    GGML_Q8_0 = 8, GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13,
    GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23, GGML_BF16 = 30, GGML_MXFP4 = 39,
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

/* A Mixture-of-Experts block (moe.c) in place of a dense MLP: a router over `num_experts`
 * experts (logits plus router_bias when set), `top_k` experts per token chosen by `routing`,
 * each expert a gated MLP of `inter` whose gate_up output (gate rows then up rows, or the two
 * alternating when `interleaved`) plus its bias feeds `act`, then down plus its bias.
 * ROUTE_SOFTMAX_TOPK: the k largest of softmax(logits), renormalised to sum 1 when norm_topk
 * (Qwen3-MoE, Mixtral); ROUTE_TOPK_SOFTMAX: softmax over the k largest logits (gpt-oss).
 * MOE_SILU: silu(gate) * up; MOE_SWIGLU_OAI: gpt-oss's clamped SwiGLU with alpha and limit. */
enum { ITERSERVE_ROUTE_SOFTMAX_TOPK = 0, ITERSERVE_ROUTE_TOPK_SOFTMAX = 1 };
enum { ITERSERVE_MOE_SILU = 0, ITERSERVE_MOE_SWIGLU_OAI = 1 };
typedef struct {
    int64_t num_experts, top_k, inter, norm_topk;
    iterserve_linear router;                 /* [num_experts, hidden] */
    const iterserve_linear *gate_up;         /* [num_experts] of [2 inter, hidden] */
    const iterserve_linear *down;            /* [num_experts] of [hidden, inter] */
    int64_t routing, act, interleaved;       /* ITERSERVE_ROUTE_*, ITERSERVE_MOE_*, 0 / 1 */
    float alpha, limit;                      /* MOE_SWIGLU_OAI's */
    const float *router_bias;                /* [num_experts] or NULL */
    const float *const *gate_up_bias;        /* [num_experts] of [2 inter], or NULL */
    const float *const *down_bias;           /* [num_experts] of [hidden], or NULL */
} iterserve_moe;

/* One decoder layer of the Llama family for iterserve_decode_layers. The optional pointers
 * are NULL when the architecture has no such tensor. */
typedef struct {
    const float *ln1, *ln2;            /* [hidden] input / post-attention RMSNorm weights */
    const float *qkv_bias;             /* [(H + 2 kvh) d] or NULL (Qwen2) */
    const float *q_norm, *k_norm;      /* [d] per-head RMSNorm weights or NULL (Qwen3) */
    iterserve_linear qkv, o, gate_up, down;
    const iterserve_moe *moe;          /* experts instead of gate_up / down, or NULL */
    const float *o_bias;               /* [hidden] or NULL (gpt-oss) */
    const float *sinks;                /* [H] attention-sink logits or NULL (gpt-oss) */
    int64_t window;                    /* this layer's sliding window; 0: the call's window */
} iterserve_layer;

/* --- the one configuration (config.c) --------------------------------------------------- */
/* What Python sets once (kernels.configure), before any kernel runs. */
/* ITERSERVE_ACT_PROCESS: in the *_act calls below, the configured mode (any other value
 * overrides it for that call: a layer that keeps its own mode, layers.Linear) */
/* ITERSERVE_ACT_SPLIT8 (a layer's own mode only, not the process's): decode row counts of
 * the int8 types on iterserve_k_split8 (near-float results at int8 speed), the rest as float. */
enum { ITERSERVE_ACT_FLOAT = 0, ITERSERVE_ACT_INT8 = 1, ITERSERVE_ACT_AUTO = 2,
       ITERSERVE_ACT_SPLIT8 = 3, ITERSERVE_ACT_PROCESS = -1 };
enum { ITERSERVE_ISA_BEST = 0, ITERSERVE_ISA_AVX2 = 1, ITERSERVE_ISA_AVX512 = 2 };
typedef struct {
    int64_t activations;        /* ITERSERVE_ACT_*: how the linear kernels treat activations */
    int64_t isa;                /* ITERSERVE_ISA_*: the widest vector ISA the kernels may use */
    int64_t batch_invariant;    /* 1: one arithmetic per output whatever the row count (dispatch.c) */
} iterserve_config;
/* CPU feature bits (iterserve_cpu_features) */
enum { ITERSERVE_F_AVX2 = 1 << 0, ITERSERVE_F_FMA = 1 << 1, ITERSERVE_F_F16C = 1 << 2,
       ITERSERVE_F_AVX512F = 1 << 3, ITERSERVE_F_AVX512BW = 1 << 4,
       ITERSERVE_F_AVX512VL = 1 << 5, ITERSERVE_F_AVX512VNNI = 1 << 6,
       ITERSERVE_F_AVX512BF16 = 1 << 7, ITERSERVE_F_AVXVNNI = 1 << 8,
       ITERSERVE_F_AVX512VBMI = 1 << 9 };
/* Resolves the configuration against the CPU into iterserve_st (below). */
void iterserve_configure(const iterserve_config *cfg);
/* The resolved state as int64s (activations, features, wide, int8, vbmi, bf16, invariant);
 * returns 7. */
int64_t iterserve_config_state(int64_t *out, int64_t cap);
/* CPU features as run-time detected bits (ITERSERVE_F_*: cpuid + OS state). */
int64_t iterserve_cpu_features(void);

/* --- ABI self-description (kernels/_abi.py compares it with ctypes) --------------------- */
/* Writes up to cap int64s: version, sizeof + offsets of the structs, then per type id
 * 0..GGML_TYPE_LIMIT-1 (block elements, block bytes, qgemm?, dequant?); returns the count. */
int64_t iterserve_abi(int64_t *out, int64_t cap);

/* --- the linear layer's product over GGUF blocks (dispatch.c: the one routing table) ----- */
/* y[m][col] = sum_j x[m][j] * W[col][j] for the n rows of W (one segment), m < M; y row m at
 * y + m * ldy (the caller offsets y by the segment's first output column). dispatch.c's table
 * chooses the kernel by (type, rows, activation mode). */
void iterserve_qgemm(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                     const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                     int nthreads);
/* The same product for prefill chunks and large batches, for every type dequant.c decodes
 * (k a multiple of the type's block, of 32 for the float types). Returns ITERSERVE_OK,
 * ITERSERVE_ETYPE (type or k not accepted) or ITERSERVE_ENOMEM. */
int iterserve_gemm(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                   const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int nthreads);
/* iterserve_qgemm and iterserve_gemm under activation mode `act` (ITERSERVE_ACT_*) instead of
 * the configured one; batch invariance and the ISA stay as configured. */
void iterserve_qgemm_act(int act, int64_t type, const uint8_t *w, int64_t n,
                         int64_t row_stride, int64_t k, const float *x, int64_t M,
                         int64_t ldx, float *y, int64_t ldy, int nthreads);
int iterserve_gemm_act(int act, int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                       int64_t k, const float *x, int64_t M, int64_t ldx, float *y,
                       int64_t ldy, int nthreads);
/* One kernel of the table, for tests and benchmarks: ITERSERVE_K_* below (ITERSERVE_K_AUTO:
 * the table's choice). Returns ITERSERVE_ETYPE where that kernel does not take the call. */
enum { ITERSERVE_K_AUTO = 0, ITERSERVE_K_REGISTERS = 1, ITERSERVE_K_GENERIC = 2,
       ITERSERVE_K_PANEL = 3, ITERSERVE_K_ACT8 = 4, ITERSERVE_K_GEMM8 = 5, ITERSERVE_K_BF16 = 6,
       ITERSERVE_K_F16 = 7, ITERSERVE_K_DEC8 = 8, ITERSERVE_K_SPLIT8 = 9 };
int iterserve_linear_kernel(int64_t kernel, int64_t type, const uint8_t *w, int64_t n,
                            int64_t row_stride, int64_t k, const float *x, int64_t M,
                            int64_t ldx, float *y, int64_t ldy, int nthreads);
/* The kernel the table chooses for a call (an ITERSERVE_K_* value). */
int64_t iterserve_route(int64_t type, int64_t M, int64_t k);
int64_t iterserve_route_act(int64_t type, int64_t M, int64_t k, int act);
/* Whether the int8 kernels cover the type (qdot8.c) and the int8 GEMM does (prefill8.c). */
int iterserve_can_act8(int64_t type);
int iterserve_can_gemm8(int64_t type);
/* out[r][0..k) = W[r] as float32, exactly as gguf-py's dequantize, for r < n. */
void iterserve_dequant(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                       int64_t k, float *out, int64_t ldo, int nthreads);

/* --- per-layer elementwise ops (elementwise.c) ------------------------------------------- */
void iterserve_rmsnorm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps);
void iterserve_silu_mul(const float *gu, float *y, int64_t T, int64_t I);
/* gpt-oss's expert activation of gu [T][2I] (gate, up halves, or alternating when
 * interleaved) into y [T][I]: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
 * g = min(gate, limit). */
void iterserve_swiglu_oai(const float *gu, float *y, int64_t T, int64_t I, int64_t interleaved,
                          float alpha, float limit);

/* --- Mixture of Experts (moe.c) --------------------------------------------------------- */
/* Routing of T tokens from router logits [T][E] (float32) by `routing` (ITERSERVE_ROUTE_*):
 * the k largest softmax probabilities per token, renormalised to sum 1 when norm_topk, or a
 * softmax over the k largest logits (ties to the lower expert id in both); weights [T][k]
 * float32, ids [T][k] int64, in descending weight order. */
void iterserve_moe_route(const float *logits, int64_t T, int64_t E, int64_t k, int64_t norm_topk,
                         int64_t routing, float *weights, int64_t *ids);
/* out[T][hidden] = the MoE block of x[T][hidden]: router GEMM, routing as above, each chosen
 * expert once over its tokens (ascending expert id), out[t] += y_e[t] * w[t, e] from zero.
 * Returns ITERSERVE_OK or ITERSERVE_ENOMEM. */
int iterserve_moe_forward(const iterserve_moe *m, const float *x, int64_t T, int64_t hidden,
                          float *out, int nthreads);
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

/* Opt-in phase timers of iterserve_decode_layers (benchmarks/profile_decode.py): acc of at
 * least the returned number of doubles, NULL off (the default). */
int iterserve_decode_profile(double *acc);

/* --- the same two over a KV pool of float32 or f16 rows (bench) ------------------------- */
/* kv_type: ITERSERVE_KV_F32 or ITERSERVE_KV_F16 (IEEE half, written with round-to-nearest-
 * even like torch's .to(float16)); any other value returns ITERSERVE_ETYPE. */
enum { ITERSERVE_KV_F32 = 0, ITERSERVE_KV_F16 = 1 };
int iterserve_decode_attention_kv(const float *q, const void *kpool, const void *vpool,
                                  int64_t pool_slots, const int32_t *tables, int max_blocks,
                                  const int32_t *lens, int window, int D, int H, int kvh, int d,
                                  int bs, float scale, float *out, int nthreads, int kv_type,
                                  const float *sinks);

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
                                float scale, float *out, int nthreads, int kv_type, int isa,
                                const float *sinks);
/* The ISA that `isa` resolves to for head_dim d on this CPU (1 AVX2, 2 AVX-512). */
int64_t iterserve_prefill_attention_isa(int64_t isa, int64_t d);
int iterserve_decode_layers_kv(const iterserve_layer *layers, int nlayers, void *const *kpools,
                               void *const *vpools, int64_t pool_slots, float *h, int64_t T,
                               int64_t hidden, int H, int kvh, int d, int64_t inter, float eps,
                               const float *cos, const float *sin, const int64_t *slot_mapping,
                               const int32_t *tables, int max_blocks, const int32_t *lens,
                               int window, int bs, float scale, int nthreads, int kv_type);

/* --- internal, shared between the kernel sources ---------------------------------------- */
/* The resolved configuration every kernel reads (config.c). activations: ITERSERVE_ACT_*;
 * wide: 2 = AVX-512F for the float kernels, else AVX2; int8: 2 = AVX-512 F/BW/VL/VNNI for the
 * int8 kernels, else AVX2; vbmi: int8 == 2 and AVX-512 VBMI; bf16: AVX-512 BF16 usable. */
typedef struct {
    int activations, wide, int8, vbmi, bf16, invariant;
    int64_t features;
} iterserve_state;
extern iterserve_state iterserve_st;

/* The leaf kernels dispatch.c routes to; each computes iterserve_qgemm's product.
 * qgemm.c: the float register kernels of the ISA in use, any row count (tiles of 8). */
void iterserve_k_registers(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride,
                           int64_t k, const float *x, int64_t M, int64_t ldx, float *y,
                           int64_t ldy, int nthreads);
/* prefill.c: the float32 panel GEMM (any type dequant.c decodes). */
int iterserve_k_panel(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                      const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                      int nthreads);
/* qdot8.c: int8 activations, integer dot products, decode row counts. Not bit-identical
 * with the float path (activation rounding). ETYPE: no int8 kernel for the type, or k not
 * whole blocks. */
int iterserve_k_act8(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                     const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int nthreads);
/* qdot8.c: each row as its 8-bit rounding plus the rounding's residual in 8 bits, two rows
 * of iterserve_k_act8 summed: rounding error ~1/250 of iterserve_k_act8's. ETYPE as it. */
int iterserve_k_split8(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                       const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                       int nthreads);
/* prefill8.c: int8 activations, panel GEMM (not Q8_0 on AVX2: ETYPE). */
int iterserve_k_gemm8(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                      const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                      int nthreads);
/* prefill8.c: the int8 GEMM's arithmetic at decode row counts (column tiles, no panel). */
int iterserve_k_dec8(int64_t type, const uint8_t *w, int64_t n, int64_t row_stride, int64_t k,
                     const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int nthreads);
/* bf16dot.c: activations rounded to bf16, vdpbf16ps (BF16 / F16 weights, avx512bf16 only);
 * path 0 by row count, 1 the decode kernel, 2 the panel GEMM. */
int iterserve_k_bf16(int64_t path, int64_t type, const uint8_t *w, int64_t n,
                     int64_t row_stride, int64_t k, const float *x, int64_t M, int64_t ldx,
                     float *y, int64_t ldy, int nthreads);
/* f16dot.c: streamed exact float32 kernels for F16 weights; isa 0 the state's, 1 AVX2,
 * 2 AVX-512F (ETYPE where the CPU lacks it). */
int iterserve_k_f16(int64_t isa, int64_t type, const uint8_t *w, int64_t n,
                    int64_t row_stride, int64_t k, const float *x, int64_t M, int64_t ldx,
                    float *y, int64_t ldy, int nthreads);
/* Block geometry of a ggml type (0 if unknown) and whether dequant.c decodes it. */
int iterserve_block_elems(int64_t type);
/* The non-linear 4-bit codebooks (dequant.c): IQ4_NL / IQ4_XS's values, MXFP4's E2M1 values
 * doubled (its scale is halved to match, ggml's convention) */
extern const int8_t iterserve_iq4_values[16], iterserve_mxfp4_values[16];
/* An MXFP4 block's E8M0 scale byte as ggml_e8m0_to_fp32_half: 2^(e - 128), denormal below 2 */
static inline float iterserve_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    __builtin_memcpy(&d, &bits, 4);
    return d;
}
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
