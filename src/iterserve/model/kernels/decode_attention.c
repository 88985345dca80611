/* Decode attention straight from the paged KV pool: one query token per sequence.
 *
 * Why: the torch path gathers every sequence's K/V into a padded [D, Lmax] tensor in every
 * layer, then SDPA reads it again. With one long request among short ones that is ~3x the
 * KV bytes of the step, padded to the longest context: on the `mix` workload it was ~26 ms
 * of an ~85 ms step. Here each sequence walks its own block table and reads each cached K
 * and V row once (GQA stays grouped: a KV head's rows serve its G query heads).
 *
 * The arithmetic is attention_core.h's, the same functions the prefill-chunk kernel calls,
 * so a decode row equals the same position computed inside a prompt chunk bit for bit (see
 * there for the order). This file only lays the work out:
 * - a work item is one sequence and one AT_SEG-key segment of its context (positions
 *   [128 j, 128 j + 128)), with all KV heads: per 64-key block every head's K/V rows are read
 *   (a slot's K or V row, all heads, is contiguous), so a long context splits over the
 *   threads (flash-decoding) and a short one is one item;
 * - each item leaves its segment's unnormalised output, max and sum per head; a sequence of
 *   one segment is normalised in place, longer ones are folded in segment order at the end.
 * The split depends only on a sequence's own length, never on the batch or the thread count.
 * - consecutive rows that are consecutive positions of one context (a request verifying
 *   speculative drafts sends its last token and its k drafts as k + 1 decode rows) form one
 *   group: its work items walk the context once for all of them, so each K/V row is read
 *   once per block for the whole group instead of once per row (the K/V read and, with a
 *   long context, the time of attention no longer grow with k). Each row still sees only its
 *   own keys, with its own arithmetic (attention_core.h: masked keys change no state), so a
 *   row of a group equals the same row alone bit for bit.
 *
 * The pools hold float32 or, with `--kv-cache-dtype float16`, IEEE half rows
 * (iterserve_decode_attention_kv, kv_type ITERSERVE_KV_F16), widened exactly by F16C, so a
 * step reads half the KV bytes. At the 1.7B shape (32 KV heads of 64, 24 layers: 384 KB of
 * float32 K/V per token) 8 sequences at ~300 tokens read ~0.9 GB of K/V per step, as much as
 * the Q4_K_M weights (1.05 GB). bf16 pools are read by the prefill-chunk kernel only (the
 * engine sends such decodes there as one-token chunks: the same arithmetic).
 *
 * The block tables and lengths come from the caller: every length must lie in
 * [1, max_blocks * bs] and every block a sequence uses must lie in the pool, else nothing is
 * computed and ITERSERVE_ELEN / ITERSERVE_EBLOCK is returned (checked before any read).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "iterserve.h"
#include "attention_core.h"
#include "scratch.h"

static __thread void *tl_buf;       /* each OpenMP thread's scratch (scratch.h) */
static __thread size_t tl_cap;

/* ITERSERVE_OK when every sequence's length and used blocks lie in the pool. */
static int check_tables(const int32_t *tables, int max_blocks, const int32_t *lens, int D,
                        int bs, int64_t pool_slots) {
    const int64_t nblocks = pool_slots / bs;
    for (int s = 0; s < D; s++) {
        const int len = lens[s];
        if (len < 1 || (int64_t)len > (int64_t)max_blocks * bs) return ITERSERVE_ELEN;
        const int32_t *t = tables + (int64_t)s * max_blocks;
        for (int b = 0; b < (len + bs - 1) / bs; b++)
            if (t[b] < 0 || t[b] >= nblocks) return ITERSERVE_EBLOCK;
    }
    return ITERSERVE_OK;
}

/* The first key a decode of a sequence of length len sees, aligned down to its block. */
static inline int first_key(int len, int window) {
    const int lo = window > 0 && len > window ? len - window : 0;
    return lo / AT_KT * AT_KT;
}

/* Rows s and s + 1 are one group: the next position of the same context (speculative
 * verification: a request's last token and its drafts are consecutive decode rows). The test
 * is on the data, not on who the rows belong to: row s + 1 is one token longer and its block
 * table equals row s's over every block row s reads, so row s reads the same K/V rows through
 * either table. */
static int same_context(const int32_t *tables, int max_blocks, const int32_t *lens, int s,
                        int bs) {
    if (lens[s + 1] != lens[s] + 1) return 0;
    const int used = (lens[s] + bs - 1) / bs;
    return memcmp(tables + (int64_t)s * max_blocks, tables + (int64_t)(s + 1) * max_blocks,
                  sizeof(int32_t) * (size_t)used) == 0;
}

#define MAX_GROUP 64        /* rows of one group (bounds each thread's scratch) */

static int decode_attention(const float *q, const void *kpool, const void *vpool,
                            int64_t pool_slots, const int32_t *tables, int max_blocks,
                            const int32_t *lens, int window, int D, int H, int kvh, int d,
                            int bs, float scale, float *out, int nthreads, int kv_type,
                            const float *sinks) {
    if (D < 1) return ITERSERVE_OK;
    const int bad = check_tables(tables, max_blocks, lens, D, bs, pool_slots);
    if (bad) return bad;
    const at_ops *ops = at_ops_for(0, d);
    const int G = H / kvh;                 /* query heads per KV head */
    const at_pools pools = {kpool, vpool, kv_type, d, bs, (long)kvh * d};
    /* groups: rows gs[g] .. gs[g+1)-1; work items of group g: first[g] .. first[g+1) */
    int *gs = malloc(sizeof(int) * (size_t)(D + 1));
    int *first = malloc(sizeof(int) * (size_t)(D + 1));
    if (!gs || !first) {
        free(gs); free(first);
        return ITERSERVE_ENOMEM;
    }
    int ng = 0, rmax = 1;
    for (int s = 0; s < D; s++) {
        if (s == 0 || s - gs[ng - 1] >= MAX_GROUP ||
            !same_context(tables, max_blocks, lens, s - 1, bs))
            gs[ng++] = s;
        if (s + 1 - gs[ng - 1] > rmax) rmax = s + 1 - gs[ng - 1];
    }
    gs[ng] = D;
    /* a group walks the segments from its first row's first key to its last row's last key:
     * each row sees only its own keys (its position and window mask the rest, which leaves
     * its state exactly as it was), so it gets the arithmetic it gets alone */
    first[0] = 0;
    for (int g = 0; g < ng; g++)
        first[g + 1] = first[g] + (lens[gs[g + 1] - 1] - 1) / AT_SEG
                       - first_key(lens[gs[g]], window) / AT_SEG + 1;
    const int nitems = first[ng];
    int *item_group = malloc(sizeof(int) * (size_t)nitems);
    long *part_of = malloc(sizeof(long) * (size_t)nitems);
    /* per item of a group of several segments: O [R H][d], then m [R H] and l [R H] */
    long nparts = 0;
    for (int g = 0; g < ng; g++)
        if (first[g + 1] - first[g] > 1)
            nparts += (long)(first[g + 1] - first[g]) * (gs[g + 1] - gs[g]) * H * (d + 2);
    float *part = malloc(sizeof(float) * (size_t)(nparts + 1));
    if (!item_group || !part || !part_of) {
        free(gs); free(first); free(item_group); free(part); free(part_of);
        return ITERSERVE_ENOMEM;
    }
    long np = 0;
    for (int g = 0; g < ng; g++) {
        const long floats = (long)(gs[g + 1] - gs[g]) * H * (d + 2);
        for (int it = first[g]; it < first[g + 1]; it++) {
            item_group[it] = g;
            part_of[it] = first[g + 1] - first[g] > 1 ? (np += floats) - floats : -1;
        }
    }
    if (nthreads < 1) nthreads = 1;
    if (nitems < nthreads) nthreads = nitems;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* Q [R H][d], O [R H][d], S [R G][AT_KT], m, l [R H], K/V widening buffers, a zero
         * row, then the K/V row pointers and the rows' positions: the thread's own buffer.
         * Within a KV head h the rows are member-major: row i G + g is query head h G + g
         * of the group's i-th row (so one block call covers every member). */
        const size_t RH = (size_t)rmax * H, RG = (size_t)rmax * G;
        const size_t fl = RH * d * 2 + RG * AT_KT + 2 * RH + 2 * (size_t)AT_KT * d
                          + (size_t)d + 64;
        const size_t bytes = fl * sizeof(float) + 2 * AT_KT * sizeof(float *)
                             + RG * sizeof(int);
        char *buf = scratch_grow(&tl_buf, &tl_cap, bytes);
        const int ok = buf != NULL;
        float *Q = NULL, *O = NULL, *S = NULL, *m = NULL, *l = NULL, *Kp = NULL, *Vp = NULL;
        float *zero = NULL;
        const float **kr = NULL, **vr = NULL;
        int *pos = NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else {
            Q = (float *)buf; O = Q + RH * d; S = O + RH * d;
            m = S + RG * AT_KT; l = m + RH; Kp = l + RH; Vp = Kp + (size_t)AT_KT * d;
            zero = Vp + (size_t)AT_KT * d;
            memset(zero, 0, sizeof(float) * (size_t)d);
            kr = (const float **)(buf + fl * sizeof(float));
            vr = kr + AT_KT;
            pos = (int *)(vr + AT_KT);
        }
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < nitems; it++) {
            if (!ok) continue;
            const int g = item_group[it], s0 = gs[g], R = gs[g + 1] - s0;
            const int len = lens[gs[g + 1] - 1], lo = first_key(lens[s0], window);
            const int seg = lo / AT_SEG + (it - first[g]);
            int k0 = seg * AT_SEG;
            if (k0 < lo) k0 = lo;
            const int k1 = (seg + 1) * AT_SEG < len ? (seg + 1) * AT_SEG : len;
            const int32_t *table = tables + (long)(gs[g + 1] - 1) * max_blocks;
            const int RGg = R * G;
            for (int i = 0; i < R; i++)
                for (int hq = 0; hq < H; hq++)
                    ops->scale_row(q + ((long)(s0 + i) * H + hq) * d, scale, d,
                                   Q + ((long)(hq / G) * RGg + i * G + hq % G) * d);
            for (int i = 0; i < R; i++)
                for (int gg = 0; gg < G; gg++) pos[i * G + gg] = lens[s0 + i] - 1;
            at_reset(R * H, d, O, m, l);
            for (int t0 = k0; t0 < k1; t0 += AT_KT) {
                const int n = k1 - t0 < AT_KT ? k1 - t0 : AT_KT;
                for (int h = 0; h < kvh; h++) {
                    at_rows(&pools, table, h, t0, n, kr, vr, Kp, Vp);
                    ops->block(RGg, Q + (long)h * RGg * d, pos, window, d, t0, n, kr,
                               (const float *const *)vr, zero, S, O + (long)h * RGg * d,
                               m + h * RGg, l + h * RGg);
                }
            }
            if (part_of[it] < 0) {
                for (int i = 0; i < R; i++)
                    for (int hq = 0; hq < H; hq++) {
                        const long r = (long)(hq / G) * RGg + i * G + hq % G;
                        if (sinks) ops->sink(1, d, sinks + hq, O + r * d, m + r, l + r);
                        ops->finish_row(O + r * d, l[r], d, out + ((long)(s0 + i) * H + hq) * d);
                    }
            } else {
                float *pr = part + part_of[it];
                memcpy(pr, O, sizeof(float) * (size_t)R * H * d);
                memcpy(pr + (long)R * H * d, m, sizeof(float) * (size_t)R * H);
                memcpy(pr + (long)R * H * d + R * H, l, sizeof(float) * (size_t)R * H);
            }
        }
        /* groups of several segments: fold them in order, then normalise */
#pragma omp for schedule(dynamic, 1)
        for (int g = 0; g < ng; g++) {
            if (!ok || first[g + 1] - first[g] < 2) continue;
            const int s0 = gs[g], R = gs[g + 1] - s0, RGg = R * G;
            at_reset(R * H, d, O, m, l);
            for (int it = first[g]; it < first[g + 1]; it++) {
                const float *pr = part + part_of[it];
                ops->fold(R * H, d, pr, pr + (long)R * H * d, pr + (long)R * H * d + R * H,
                          O, m, l);
            }
            for (int i = 0; i < R; i++)
                for (int hq = 0; hq < H; hq++) {
                    const long r = (long)(hq / G) * RGg + i * G + hq % G;
                    if (sinks) ops->sink(1, d, sinks + hq, O + r * d, m + r, l + r);
                    ops->finish_row(O + r * d, l[r], d, out + ((long)(s0 + i) * H + hq) * d);
                }
        }
    }
    free(part_of);
    free(part);
    free(item_group);
    free(first);
    free(gs);
    return failed ? ITERSERVE_ENOMEM : ITERSERVE_OK;
}


int iterserve_decode_attention(const float *q, const float *kpool, const float *vpool,
                               int64_t pool_slots, const int32_t *tables, int max_blocks,
                               const int32_t *lens, int window, int D, int H, int kvh, int d,
                               int bs, float scale, float *out, int nthreads) {
    return decode_attention(q, kpool, vpool, pool_slots, tables, max_blocks, lens, window, D, H,
                            kvh, d, bs, scale, out, nthreads, ITERSERVE_KV_F32, NULL);
}

int iterserve_decode_attention_kv(const float *q, const void *kpool, const void *vpool,
                                  int64_t pool_slots, const int32_t *tables, int max_blocks,
                                  const int32_t *lens, int window, int D, int H, int kvh, int d,
                                  int bs, float scale, float *out, int nthreads, int kv_type,
                                  const float *sinks) {
    if (kv_type != ITERSERVE_KV_F32 && kv_type != ITERSERVE_KV_F16) return ITERSERVE_ETYPE;
    return decode_attention(q, kpool, vpool, pool_slots, tables, max_blocks, lens, window, D, H,
                            kvh, d, bs, scale, out, nthreads, kv_type, sinks);
}
