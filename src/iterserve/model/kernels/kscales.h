/* Q4_K / Q5_K sub-block scales and mins, shared by the decode kernels (qdot8.c) and the int8
 * prefill GEMM's panel decode (prefill8.c), so both read the 12 packed bytes one way. */
#ifndef ITERSERVE_KSCALES_H
#define ITERSERVE_KSCALES_H
#include <stdint.h>
#include <string.h>

/* The 8 scales (bytes 0-7 of u) and 8 mins (bytes 8-15) from a super-block's 12 packed bytes. */
static inline void q4k_scales(const uint8_t *s12, uint32_t u[4]) {
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    memcpy(u, s12, 12);
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t a = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = a;
    u[0] &= k1;
}
#endif
