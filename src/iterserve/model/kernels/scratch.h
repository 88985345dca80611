/* scratch.h - a thread's reusable scratch buffer, grown on demand.
 *
 * Why: several kernels copy, round or quantise a call's activations into a buffer of their
 * own layout once per call (f16dot.c, bf16dot.c, qdot8.c). Allocating it per call would cost
 * a malloc/free per GEMM on the decode path, so each kernel keeps one thread-local buffer
 * (the OpenMP pool's threads live as long as the process) and grows it in 16 KB steps,
 * 64-byte aligned for aligned vector loads. On allocation failure it returns NULL and forgets
 * the old size, so the caller reports ITERSERVE_ENOMEM and the next call tries again.
 */
#ifndef ITERSERVE_SCRATCH_H
#define ITERSERVE_SCRATCH_H

#include <stdlib.h>

static inline void *scratch_grow(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *cap = (bytes + 16383) & ~(size_t)16383;
        *buf = aligned_alloc(64, *cap);
        if (!*buf) *cap = 0;
    }
    return *buf;
}

#endif
