/* One order of operations for attention over the paged KV pool, shared by the decode kernel
 * (decode_attention.c: one query per sequence) and the prefill-chunk kernel
 * (prefill_attention.c: chunks of queries with or without cached context).
 *
 * Why one order: a query at position p must get bitwise the same output whether it is a
 * decode row or a row of a prefill chunk of any size, after any cached prefix, alone or beside
 * other sequences (batch invariance: the same greedy answer under load, after preemption by
 * recompute or swap, with or without a prefix-cache hit). Float sums give different bits in
 * different orders, so both kernels call the functions of attention_impl.h, which fix the
 * order for each row by the row's own position only:
 *
 * - the query is pre-scaled once: q' = scale * q (one rounding per element);
 * - the score of a key is the dot of q' and k in VW-float vectors c = 0, VW, ... in order
 *   (acc = fma(q'[c], k[c], acc)), then the fixed lane tree of lanes_sum;
 * - keys go in blocks of AT_KT = 64 at absolute positions [64 j, 64 j + 64); within a block
 *   the online-softmax update of attention_impl.h's `block` (max, rescale factor, exp with
 *   the Cephes polynomial of simd.h, the block's sum over VW-key vectors then the lane tree,
 *   O rescaled then O += p v over the keys in order);
 * - blocks go in segments of AT_SEG = 128 keys at absolute positions; each segment starts from
 *   an empty state, and the segments are folded into the total in order (`fold`); a
 *   segment is what one decode work item computes, so a long context still splits over the
 *   threads (flash-decoding) without changing any row's arithmetic;
 * - with attention sinks (gpt-oss: a learned logit per query head that takes probability
 *   mass and gives nothing back), the sink folded into the final state as one more
 *   segment of max = sink, sum = 1, output 0 (`sink`);
 * - out = O * (1 / l).
 * Keys a row may not see (after its position; before its sliding window) score -inf, which
 * leaves its state exactly as it was (alpha = exp(0) = 1, p = 0, fma(0, v, o) = o), so the
 * prefill kernel's rows may walk blocks and segments that a decode of the same row skips.
 * The vector width is part of the order: AVX2 and AVX-512 builds give different bits from each
 * other, so both kernels run the ISA iterserve_prefill_attention_isa(0, d) picks (AVX-512 where
 * the CPU has F/BW/VL and d % 16 == 0); within one ISA every path agrees bit for bit.
 *
 * K/V rows: float32 rows are read in place; f16 (F16C) and bf16 (a shift) rows of a block are
 * widened into a per-thread [AT_KT][d] float buffer first (exact, so the pool's dtype changes
 * only what is stored, never the order).
 */
#ifndef ITERSERVE_ATTENTION_CORE_H
#define ITERSERVE_ATTENTION_CORE_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "iterserve.h"
#include "simd.h"

#define AT_KT 64           /* keys per block */
#define AT_SEG 128         /* keys per segment (a multiple of AT_KT) */

/* The 8 floats of the 8 vectors a[0..7], each summed with lanes_sum's tree:
 * [sum a0, ..., sum a7]. */
static inline __m256 at_hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The 4 floats of the 4 vectors a[0..3], each summed with lanes_sum's tree. */
static inline __m128 at_hsum4(const __m256 *a) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* Where a sequence's K/V rows are: the pools, their element type and row length. */
typedef struct {
    const void *kpool, *vpool;
    int kv_type, d, bs;
    long row;                      /* elements per slot: kvh * d */
} at_pools;

/* Row pointers of KV head h for positions t0 .. t0+n-1 of a sequence (block table `table`)
 * into kr / vr: the pool's own rows for float32, rows widened into Kp / Vp ([AT_KT][d]) for
 * f16 / bf16. */
static inline void at_rows(const at_pools *p, const int32_t *table, int h, int t0, int n,
                           const float **kr, const float **vr, float *Kp, float *Vp) {
    const long off = (long)h * p->d;
    const int d = p->d, bs = p->bs;
    int bi = t0 / bs, bo = t0 % bs;
    for (int t = 0; t < n; t++) {
        const long slot = (long)table[bi] * bs + bo;
        if (++bo == bs) { bo = 0; bi++; }
        if (p->kv_type == ITERSERVE_KV_F32) {
            kr[t] = (const float *)p->kpool + slot * p->row + off;
            vr[t] = (const float *)p->vpool + slot * p->row + off;
            continue;
        }
        const uint16_t *ks = (const uint16_t *)p->kpool + slot * p->row + off;
        const uint16_t *vs = (const uint16_t *)p->vpool + slot * p->row + off;
        float *kd = Kp + (long)t * d, *vd = Vp + (long)t * d;
        for (int i = 0; i < d; i += 8) {
            const __m128i kb = _mm_loadu_si128((const __m128i *)(ks + i));
            const __m128i vb = _mm_loadu_si128((const __m128i *)(vs + i));
            if (p->kv_type == ITERSERVE_KV_F16) {
                _mm256_storeu_ps(kd + i, _mm256_cvtph_ps(kb));
                _mm256_storeu_ps(vd + i, _mm256_cvtph_ps(vb));
            } else {
                _mm256_storeu_ps(kd + i, _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(kb), 16)));
                _mm256_storeu_ps(vd + i, _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(vb), 16)));
            }
        }
        kr[t] = kd;
        vr[t] = vd;
    }
}

/* --- AVX2 ------------------------------------------------------------------------------- */
#define VW 8
#define VEC __m256
#define FN(name) at_##name##_avx2
#define PV_ROWS 3
#define QK_ROWS 3
#define VZERO() _mm256_setzero_ps()
#define VLD(p) _mm256_loadu_ps(p)
#define VST(p, v) _mm256_storeu_ps(p, v)
#define VSET(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VEXP(x) exp256(x)
/* x where s > -inf, else 0 */
#define VKEEP(x, s) _mm256_and_ps(x, _mm256_cmp_ps(s, ninf, _CMP_GT_OQ))
#define HSUM8V(acc) at_hsum8x8(acc)
#define HSUM4V(acc) at_hsum4(acc)
#include "attention_impl.h"
#undef VW
#undef VEC
#undef FN
#undef PV_ROWS
#undef QK_ROWS
#undef VZERO
#undef VLD
#undef VST
#undef VSET
#undef VFMA
#undef VMAX
#undef VMUL
#undef VADD
#undef VSUB
#undef VEXP
#undef VKEEP
#undef HSUM8V
#undef HSUM4V

/* --- AVX-512 ---------------------------------------------------------------------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw")
/* exp256 of simd.h at 16 lanes (the same operations, so the same value per lane) */
static inline __m512 at_exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                         _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* Lanes i and i + 8 of v added: lanes_sum's first fold, in AVX2 width. */
static inline __m256 at_fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static inline __m256 at_hsum8x8_512(const __m512 *acc) {
    __m256 h[8];
    for (int j = 0; j < 8; j++) h[j] = at_fold512(acc[j]);
    return at_hsum8x8(h);
}

static inline __m128 at_hsum4_512(const __m512 *acc) {
    __m256 h[4];
    for (int j = 0; j < 4; j++) h[j] = at_fold512(acc[j]);
    return at_hsum4(h);
}

#define VW 16
#define VEC __m512
#define FN(name) at_##name##_avx512
#define PV_ROWS 6
#define QK_ROWS 6
#define VZERO() _mm512_setzero_ps()
#define VLD(p) _mm512_loadu_ps(p)
#define VST(p, v) _mm512_storeu_ps(p, v)
#define VSET(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VEXP(x) at_exp512(x)
#define VKEEP(x, s) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, ninf, _CMP_GT_OQ), x)
#define HSUM8V(acc) at_hsum8x8_512(acc)
#define HSUM4V(acc) at_hsum4_512(acc)
#include "attention_impl.h"
#undef VW
#undef VEC
#undef FN
#undef PV_ROWS
#undef QK_ROWS
#undef VZERO
#undef VLD
#undef VST
#undef VSET
#undef VFMA
#undef VMAX
#undef VMUL
#undef VADD
#undef VSUB
#undef VEXP
#undef VKEEP
#undef HSUM8V
#undef HSUM4V
#pragma GCC pop_options

/* The functions of one ISA, so the drivers are written once. */
typedef struct {
    void (*block)(int nr, const float *Q, const int *pos, int window, int d, int t0, int n,
                  const float **kr, const float *const *vr, const float *zero, float *S,
                  float *O, float *m, float *l);
    void (*fold)(int nr, int d, const float *O, const float *m, const float *l, float *OT,
                 float *mT, float *lT);
    void (*finish_row)(const float *O, float l, int d, float *dst);
    void (*scale_row)(const float *src, float scale, int d, float *dst);
    void (*sink)(int nr, int d, const float *sinks, float *O, float *m, float *l);
} at_ops;

static const at_ops AT_AVX2 = {at_block_avx2, at_fold_avx2, at_finish_row_avx2,
                               at_scale_row_avx2, at_sink_avx2};
static const at_ops AT_AVX512 = {at_block_avx512, at_fold_avx512, at_finish_row_avx512,
                                 at_scale_row_avx512, at_sink_avx512};

/* The ISA both kernels use for head_dim d (`isa` 0 = auto, 1 = AVX2, 2 = AVX-512). */
static inline const at_ops *at_ops_for(int isa, int d) {
    return iterserve_prefill_attention_isa(isa, d) == 2 ? &AT_AVX512 : &AT_AVX2;
}

/* An empty softmax state for nr rows: O = 0, m = -inf, l = 0. */
static inline void at_reset(int nr, int d, float *O, float *m, float *l) {
    memset(O, 0, sizeof(float) * (size_t)nr * d);
    for (int r = 0; r < nr; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
}

#endif
