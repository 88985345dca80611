/* The body of prefill_attention.c for one vector width, included twice: once for AVX2
 * (VW 8, __m256) and once, under `#pragma GCC target("avx512f...")`, for AVX-512 (VW 16).
 * prefill_attention.c defines the macros below before each include and explains the
 * algorithm; this file has no include guard on purpose. */

/* S^T[j][r] = sum_i k_j[i] * Qt[i][r] for NK keys x NR row vectors (Qt pre-scaled). */
static inline __attribute__((always_inline)) void FN(qk_tile)(
        int NK, int NR, const float *const *kr, const float *Qt, int Rp, int d, float *S) {
    VEC acc[QK_KEYS * 3];
    for (int j = 0; j < NK; j++)
        for (int k = 0; k < NR; k++) acc[j * NR + k] = VZERO();
    for (int i = 0; i < d; i++) {
        VEC qv[3];
        for (int k = 0; k < NR; k++) qv[k] = VLD(Qt + (long)i * Rp + k * VW);
        for (int j = 0; j < NK; j++) {
            const VEC kb = VSET(kr[j][i]);
            for (int k = 0; k < NR; k++) acc[j * NR + k] = VFMA(kb, qv[k], acc[j * NR + k]);
        }
    }
    for (int j = 0; j < NK; j++)
        for (int k = 0; k < NR; k++) VST(S + (long)j * Rp + k * VW, acc[j * NR + k]);
}

static void FN(qk)(int NR, const float *const *kr, const float *Qt, int Rp, int d, float *S) {
    switch (NR) {
    case 1: FN(qk_tile)(QK_KEYS, 1, kr, Qt, Rp, d, S); break;
    case 2: FN(qk_tile)(QK_KEYS, 2, kr, Qt, Rp, d, S); break;
    default: FN(qk_tile)(QK_KEYS, 3, kr, Qt, Rp, d, S); break;
    }
}

/* O[rr][0..NC*VW) += sum_t P[t][rr] * v_t[0..NC*VW) for NRW rows, t < n. */
static inline __attribute__((always_inline)) void FN(pv_tile)(
        int NRW, int NC, const float *const *vr, int c0, int n, const float *P, int Rp,
        float *O, int d) {
    VEC acc[PV_ROWS * 4];
    for (int rr = 0; rr < NRW; rr++)
        for (int c = 0; c < NC; c++) acc[rr * NC + c] = VLD(O + (long)rr * d + c * VW);
    for (int t = 0; t < n; t++) {
        VEC vv[4];
        for (int c = 0; c < NC; c++) vv[c] = VLD(vr[t] + c0 + c * VW);
        for (int rr = 0; rr < NRW; rr++) {
            const VEC w = VSET(P[(long)t * Rp + rr]);
            for (int c = 0; c < NC; c++) acc[rr * NC + c] = VFMA(w, vv[c], acc[rr * NC + c]);
        }
    }
    for (int rr = 0; rr < NRW; rr++)
        for (int c = 0; c < NC; c++) VST(O + (long)rr * d + c * VW, acc[rr * NC + c]);
}

#define PVT(a, b) FN(pv_tile)(a, b, vr, c0, n, P, Rp, O, d)
static void FN(pv)(int NRW, int NC, const float *const *vr, int c0, int n, const float *P,
                   int Rp, float *O, int d) {
    switch (NRW * 8 + NC) {
    case 9: PVT(1, 1); break;   case 10: PVT(1, 2); break;  case 11: PVT(1, 3); break;
    case 12: PVT(1, 4); break;
    case 17: PVT(2, 1); break;  case 18: PVT(2, 2); break;  case 19: PVT(2, 3); break;
    case 20: PVT(2, 4); break;
    case 25: PVT(3, 1); break;  case 26: PVT(3, 2); break;  case 27: PVT(3, 3); break;
    case 28: PVT(3, 4); break;
#if PV_ROWS > 3
    case 33: PVT(4, 1); break;  case 34: PVT(4, 2); break;  case 35: PVT(4, 3); break;
    case 36: PVT(4, 4); break;
    case 41: PVT(5, 1); break;  case 42: PVT(5, 2); break;  case 43: PVT(5, 3); break;
    case 44: PVT(5, 4); break;
    case 49: PVT(6, 1); break;  case 50: PVT(6, 2); break;  case 51: PVT(6, 3); break;
    case 52: PVT(6, 4); break;
#endif
    default: break;
    }
}
#undef PVT

/* One work item: the G query heads of KV head it->h for queries q0 .. q0+nq-1 of chunk it->s,
 * over its keys, one KT-key tile at a time with an online softmax. */
static void FN(run_item)(const pa_args *a, const pa_item *it, pa_scratch *sc) {
    const int G = a->H / a->kvh, d = a->d, H = a->H;
    const int R = it->nq * G, Rp = (R + VW - 1) / VW * VW, NRV = Rp / VW;
    const int start = a->ctx[it->s];
    const long qrow0 = (long)a->q_starts[it->s] + it->q0;     /* row of query q0 in q / out */
    const int qp0 = start + it->q0, qp1 = qp0 + it->nq - 1;   /* its first / last position */
    const int window = a->window;
    const int lo = window > 0 && qp0 - window + 1 > 0 ? qp0 - window + 1 : 0;
    const int hi = qp1 + 1;
    const int32_t *table = a->tables + (long)it->s * a->max_blocks;
    float *Qt = sc->Qt, *S = sc->S, *O = sc->O, *m = sc->m, *l = sc->l, *alpha = sc->alpha;
    /* Qt[i][r] = scale * q[row r][i]; row r = query r / G, head h * G + r % G */
    for (int r = 0; r < Rp; r++) {
        if (r < R) {
            const float *src = a->q + ((qrow0 + r / G) * H + (long)it->h * G + r % G) * d;
            for (int i = 0; i < d; i++) Qt[(long)i * Rp + r] = a->scale * src[i];
        } else {
            for (int i = 0; i < d; i++) Qt[(long)i * Rp + r] = 0.0f;
        }
    }
    memset(O, 0, sizeof(float) * (size_t)R * d);
    for (int r = 0; r < Rp; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    const VEC ninf = VSET(-INFINITY);
    for (int t0 = lo; t0 < hi; t0 += KT) {
        const int n = hi - t0 < KT ? hi - t0 : KT;
        const int npad = (n + QK_KEYS - 1) / QK_KEYS * QK_KEYS;
        pa_rows(a, table, it->h, t0, n, sc);
        for (int t = n; t < npad; t++) sc->kr[t] = sc->zero;
        /* scores, keys as rows: S[t][r] */
        for (int t = 0; t < npad; t += QK_KEYS)
            for (int k = 0; k < NRV; k += 3)
                FN(qk)(NRV - k < 3 ? NRV - k : 3, sc->kr + t, Qt + k * VW, Rp, d,
                       S + (long)t * Rp + k * VW);
        /* causal (and sliding-window) mask, only where the tile crosses a boundary */
        if (t0 + n - 1 > qp0 || (window > 0 && t0 <= qp1 - window)) {
            for (int t = 0; t < n; t++) {
                const int kp = t0 + t;
                float *st = S + (long)t * Rp;
                for (int r = 0; r < R; r++) {
                    const int qp = qp0 + r / G;
                    if (kp > qp || (window > 0 && kp <= qp - window)) st[r] = -INFINITY;
                }
            }
        }
        /* online softmax per row vector: new max, rescale factor, exp in place, sums */
        for (int k = 0; k < NRV; k++) {
            VEC mt = ninf;
            for (int t = 0; t < n; t++) mt = VMAX(mt, VLD(S + (long)t * Rp + k * VW));
            const VEC mold = VLD(m + k * VW);
            const VEC mnew = VMAX(mold, mt);
            const VEC msub = VKEEP(mnew, mnew);              /* -inf (all masked) -> 0 */
            VST(alpha + k * VW, VKEEP(VEXP(VSUB(mold, msub)), mold));
            VEC sum = VZERO();
            for (int t = 0; t < n; t++) {
                float *p = S + (long)t * Rp + k * VW;
                const VEC sv = VLD(p);
                const VEC e = VKEEP(VEXP(VSUB(sv, msub)), sv);
                VST(p, e);
                sum = VADD(sum, e);
            }
            VST(l + k * VW, VFMA(VLD(l + k * VW), VLD(alpha + k * VW), sum));
            VST(m + k * VW, mnew);
        }
        if (t0 > lo)
            for (int r = 0; r < R; r++) {
                const float al = alpha[r];
                if (al == 1.0f) continue;
                const VEC va = VSET(al);
                for (int i = 0; i < d; i += VW) VST(O + (long)r * d + i, VMUL(va, VLD(O + (long)r * d + i)));
            }
        /* O += P V */
        for (int r0 = 0; r0 < R; r0 += PV_ROWS) {
            const int nr = R - r0 < PV_ROWS ? R - r0 : PV_ROWS;
            for (int c0 = 0; c0 < d; c0 += 4 * VW) {
                const int nc = (d - c0) < 4 * VW ? (d - c0) / VW : 4;
                FN(pv)(nr, nc, (const float *const *)sc->vr, c0, n, S + r0, Rp,
                       O + (long)r0 * d + c0, d);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float *dst = a->out + ((qrow0 + r / G) * H + (long)it->h * G + r % G) * d;
        const VEC inv = VSET(1.0f / l[r]);
        for (int i = 0; i < d; i += VW) VST(dst + i, VMUL(inv, VLD(O + (long)r * d + i)));
    }
}
