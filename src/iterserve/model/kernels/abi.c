/* The library describes its own ABI (iterserve.h) so that kernels/__init__.py can refuse a
 * build whose structs or type table differ from the ctypes declarations, instead of passing
 * misplaced pointers; and reports the CPU features it detects at run time (cpuid + xgetbv,
 * so an OS that does not save AVX-512 state counts as no AVX-512).
 */
#include <cpuid.h>
#include <stddef.h>
#include <stdint.h>

#include "iterserve.h"

int64_t iterserve_abi(int64_t *out, int64_t cap) {
    int64_t v[32 + 4 * GGML_TYPE_LIMIT];
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

int64_t iterserve_cpu_features(void) {
    unsigned a, b, c, d;
    int64_t f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    uint64_t xcr0 = 0;
    if (osxsave) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((uint64_t)hi << 32) | lo;
    }
    const int ymm = (xcr0 & 0x6) == 0x6, zmm = (xcr0 & 0xe6) == 0xe6;
    if (!ymm) return 0;
    if (fma) f |= 1 << 1;
    if (f16c) f |= 1 << 2;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if ((b >> 5) & 1) f |= 1 << 0;                      /* avx2 */
        if (zmm) {
            if ((b >> 16) & 1) f |= 1 << 3;                 /* avx512f */
            if ((b >> 30) & 1) f |= 1 << 4;                 /* avx512bw */
            if ((b >> 31) & 1) f |= 1 << 5;                 /* avx512vl */
            if ((c >> 11) & 1) f |= 1 << 6;                 /* avx512vnni */
        }
        if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) {
            if (zmm && ((a >> 5) & 1)) f |= 1 << 7;         /* avx512bf16 */
            if ((a >> 4) & 1) f |= 1 << 8;                  /* avxvnni */
        }
    }
    return f;
}
