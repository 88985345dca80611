/* The library describes its own ABI (iterserve.h) so that kernels/_abi.py can refuse a
 * build whose structs or type table differ from the ctypes declarations, instead of passing
 * misplaced pointers.
 */
#include <stddef.h>
#include <stdint.h>

#include "iterserve.h"

int64_t iterserve_abi(int64_t *out, int64_t cap) {
    int64_t v[64 + 4 * GGML_TYPE_LIMIT];
    int n = 0;
    v[n++] = ITERSERVE_ABI_VERSION;
    v[n++] = sizeof(iterserve_segment);
    v[n++] = offsetof(iterserve_segment, type);
    v[n++] = offsetof(iterserve_segment, rows);
    v[n++] = offsetof(iterserve_segment, row_bytes);
    v[n++] = offsetof(iterserve_segment, row_stride);
    v[n++] = offsetof(iterserve_segment, data);
    v[n++] = sizeof(iterserve_linear);
    v[n++] = offsetof(iterserve_linear, nseg);
    v[n++] = offsetof(iterserve_linear, k);
    v[n++] = offsetof(iterserve_linear, seg);
    v[n++] = ITERSERVE_MAX_SEGMENTS;
    v[n++] = sizeof(iterserve_layer);
    v[n++] = offsetof(iterserve_layer, ln1);
    v[n++] = offsetof(iterserve_layer, ln2);
    v[n++] = offsetof(iterserve_layer, qkv_bias);
    v[n++] = offsetof(iterserve_layer, q_norm);
    v[n++] = offsetof(iterserve_layer, k_norm);
    v[n++] = offsetof(iterserve_layer, qkv);
    v[n++] = offsetof(iterserve_layer, o);
    v[n++] = offsetof(iterserve_layer, gate_up);
    v[n++] = offsetof(iterserve_layer, down);
    v[n++] = offsetof(iterserve_layer, moe);
    v[n++] = offsetof(iterserve_layer, o_bias);
    v[n++] = offsetof(iterserve_layer, sinks);
    v[n++] = offsetof(iterserve_layer, window);
    v[n++] = sizeof(iterserve_moe);
    v[n++] = offsetof(iterserve_moe, num_experts);
    v[n++] = offsetof(iterserve_moe, top_k);
    v[n++] = offsetof(iterserve_moe, inter);
    v[n++] = offsetof(iterserve_moe, norm_topk);
    v[n++] = offsetof(iterserve_moe, router);
    v[n++] = offsetof(iterserve_moe, gate_up);
    v[n++] = offsetof(iterserve_moe, down);
    v[n++] = offsetof(iterserve_moe, routing);
    v[n++] = offsetof(iterserve_moe, act);
    v[n++] = offsetof(iterserve_moe, interleaved);
    v[n++] = offsetof(iterserve_moe, alpha);
    v[n++] = offsetof(iterserve_moe, limit);
    v[n++] = offsetof(iterserve_moe, router_bias);
    v[n++] = offsetof(iterserve_moe, gate_up_bias);
    v[n++] = offsetof(iterserve_moe, down_bias);
    v[n++] = sizeof(iterserve_config);
    v[n++] = offsetof(iterserve_config, activations);
    v[n++] = offsetof(iterserve_config, isa);
    v[n++] = offsetof(iterserve_config, batch_invariant);
    v[n++] = GGML_TYPE_LIMIT;
    for (int t = 0; t < GGML_TYPE_LIMIT; t++) {
        v[n++] = iterserve_block_elems(t);
        v[n++] = iterserve_block_bytes(t);
        v[n++] = iterserve_can_qgemm(t);
        v[n++] = iterserve_can_dequant(t);
    }
    for (int i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}
