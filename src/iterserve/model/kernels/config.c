/* The one place the kernels' modes and CPU features live.
 *
 * Why: the activation mode and the instruction sets decide which kernel runs and so what it
 * computes; keeping them in one struct (no static state per kernel file, no lazy CPU check per
 * kernel, no environment reads) makes that decision visible. Python sets one iterserve_config once
 * (kernels.configure) and every kernel reads the resolved iterserve_state below: what the
 * CPU has (cpuid + xgetbv, so an OS that does not save AVX-512 state counts as no AVX-512),
 * capped by the configured ISA. Kernel files never detect features or keep modes themselves.
 */
#include <cpuid.h>
#include <stdint.h>

#include "iterserve.h"

/* Zero is a safe state before the first iterserve_configure: float activations, AVX2. */
iterserve_state iterserve_st;

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
    if (fma) f |= ITERSERVE_F_FMA;
    if (f16c) f |= ITERSERVE_F_F16C;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if ((b >> 5) & 1) f |= ITERSERVE_F_AVX2;
        if (zmm) {
            if ((b >> 16) & 1) f |= ITERSERVE_F_AVX512F;
            if ((b >> 30) & 1) f |= ITERSERVE_F_AVX512BW;
            if ((b >> 31) & 1) f |= ITERSERVE_F_AVX512VL;
            if ((c >> 11) & 1) f |= ITERSERVE_F_AVX512VNNI;
            if ((c >> 1) & 1) f |= ITERSERVE_F_AVX512VBMI;
        }
        if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) {
            if (zmm && ((a >> 5) & 1)) f |= ITERSERVE_F_AVX512BF16;
            if ((a >> 4) & 1) f |= ITERSERVE_F_AVXVNNI;
        }
    }
    return f;
}

void iterserve_configure(const iterserve_config *cfg) {
    const int64_t f = iterserve_cpu_features();
    const int wide_ok = cfg->isa != ITERSERVE_ISA_AVX2;
    const int64_t v512 = ITERSERVE_F_AVX512F | ITERSERVE_F_AVX512BW | ITERSERVE_F_AVX512VL;
    iterserve_state s;
    s.activations = cfg->activations >= 0 && cfg->activations <= 2 ? (int)cfg->activations : 0;
    s.features = f;
    s.wide = wide_ok && (f & ITERSERVE_F_AVX512F) ? 2 : 1;
    s.int8 = wide_ok && (f & (v512 | ITERSERVE_F_AVX512VNNI)) == (v512 | ITERSERVE_F_AVX512VNNI)
             ? 2 : 1;
    s.vbmi = s.int8 == 2 && (f & ITERSERVE_F_AVX512VBMI) ? 1 : 0;
    s.bf16 = wide_ok && (f & ITERSERVE_F_AVX512BF16) ? 1 : 0;
    s.invariant = cfg->batch_invariant ? 1 : 0;
    iterserve_st = s;
}

int64_t iterserve_config_state(int64_t *out, int64_t cap) {
    const int64_t v[7] = {iterserve_st.activations, iterserve_st.features, iterserve_st.wide,
                          iterserve_st.int8, iterserve_st.vbmi, iterserve_st.bf16,
                          iterserve_st.invariant};
    for (int i = 0; i < 7 && i < cap; i++) out[i] = v[i];
    return 7;
}
