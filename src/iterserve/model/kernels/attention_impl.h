/* The arithmetic of attention over the paged KV pool for one vector width, shared by the
 * decode kernel (decode_attention.c) and the prefill-chunk kernel (prefill_attention.c).
 * attention_core.h includes it twice: for AVX2 (VW 8, __m256) and, under
 * `#pragma GCC target("avx512f...")`, for AVX-512 (VW 16, __m512), after defining the macros
 * below; this file has no include guard on purpose. attention_core.h explains the order of
 * operations (the reason both kernels call exactly these functions).
 *
 * A "row" is one query head of one query position: its pre-scaled query Q[r] (d floats), its
 * position pos[r], and its running softmax state (max m[r], sum l[r], unnormalised output
 * O[r]). Every function below works on each row on its own; rows are grouped only to share
 * K/V loads, so no row's result depends on which other rows share its call. */

/* The canonical sum of a vector's lanes: the lanes of its upper 256 bits folded onto the lower
 * (AVX-512), then ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)). */
static inline float FN(lanes_sum)(VEC v) {
    float a[VW];
    VST(a, v);
#if VW == 16
    for (int i = 0; i < 8; i++) a[i] = a[i] + a[i + 8];
#endif
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

static inline float FN(lanes_max)(VEC v) {
    float a[VW];
    VST(a, v);
    float x = a[0];
    for (int i = 1; i < VW; i++) x = a[i] > x ? a[i] : x;
    return x;
}

/* exp(x) of one float through the vector polynomial (elementwise: the lane it sits in does
 * not matter, so a row's rescale factor equals what a vector of rows would give). */
static inline float FN(exp1)(float x) {
    float a[VW];
    VST(a, VEXP(VSET(x)));
    return a[0];
}

/* S[r][t0 + j] for NR rows x NK keys (NR * NK <= 4 * QK_ROWS; NK = 4, or 8 with one row):
 * the dot of a row and a key is acc = fma(q[c], k[c], acc) over the d / VW vectors c in
 * order, then lanes_sum's tree (HSUM8V / HSUM4V apply the same tree to each input). */
static inline __attribute__((always_inline)) void FN(qk_tile)(
        int NR, int NK, const float *Q, int d, const float *const *kr, float *S, int ss) {
    VEC acc[4 * QK_ROWS];
    for (int j = 0; j < NR * NK; j++) acc[j] = VZERO();
    for (int c = 0; c < d; c += VW) {
        for (int r = 0; r < NR; r++) {
            const VEC qv = VLD(Q + (long)r * d + c);
            for (int j = 0; j < NK; j++)
                acc[r * NK + j] = VFMA(qv, VLD(kr[j] + c), acc[r * NK + j]);
        }
    }
    if (NK == 8) {                                   /* one row, 8 keys */
        _mm256_storeu_ps(S, HSUM8V(acc));
        return;
    }
    int r = 0;                                       /* rows of 4 keys, two at a time */
    for (; r + 2 <= NR; r += 2) {
        const __m256 h = HSUM8V(acc + r * 4);
        _mm_storeu_ps(S + (long)r * ss, _mm256_castps256_ps128(h));
        _mm_storeu_ps(S + (long)(r + 1) * ss, _mm256_extractf128_ps(h, 1));
    }
    if (r < NR) _mm_storeu_ps(S + (long)r * ss, HSUM4V(acc + r * 4));
}

#define QKT(nr) for (int t = 0; t < npad; t += 4) \
        FN(qk_tile)(nr, 4, Q + (long)r * d, d, kr + t, S + (long)r * ss + t, ss)
/* Scores of nr rows (Q[r], d floats each) against npad keys (npad % 8 == 0; rows past the
 * block point at a zero row): S[r][t]. Up to QK_ROWS rows share each K load. */
static void FN(scores)(int nr, const float *Q, int d, const float *const *kr, int npad,
                       float *S, int ss) {
    int r = 0;
    for (; r + QK_ROWS <= nr; r += QK_ROWS) QKT(QK_ROWS);
    switch (nr - r) {
    case 0: break;
    case 1:
        for (int t = 0; t < npad; t += 8)
            FN(qk_tile)(1, 8, Q + (long)r * d, d, kr + t, S + (long)r * ss + t, ss);
        break;
    case 2: QKT(2); break;
#if QK_ROWS > 3
    case 3: QKT(3); break;
    case 4: QKT(4); break;
    case 5: QKT(5); break;
#endif
    default: break;
    }
}
#undef QKT

/* O[rr][c0 .. c0 + NC*VW) += sum_t P[rr][t] * v_t[c0 ..] for NRW rows, t < n in order. */
static inline __attribute__((always_inline)) void FN(pv_tile)(
        int NRW, int NC, const float *const *vr, int c0, int n, const float *P, int ss,
        float *O, int d) {
    VEC acc[PV_ROWS * 4];
    for (int rr = 0; rr < NRW; rr++)
        for (int c = 0; c < NC; c++) acc[rr * NC + c] = VLD(O + (long)rr * d + c0 + c * VW);
    for (int t = 0; t < n; t++) {
        VEC vv[4];
        for (int c = 0; c < NC; c++) vv[c] = VLD(vr[t] + c0 + c * VW);
        for (int rr = 0; rr < NRW; rr++) {
            const VEC w = VSET(P[(long)rr * ss + t]);
            for (int c = 0; c < NC; c++) acc[rr * NC + c] = VFMA(w, vv[c], acc[rr * NC + c]);
        }
    }
    for (int rr = 0; rr < NRW; rr++)
        for (int c = 0; c < NC; c++) VST(O + (long)rr * d + c0 + c * VW, acc[rr * NC + c]);
}

#define PVT(a, b) FN(pv_tile)(a, b, vr, c0, n, P, ss, O, d)
static void FN(pv)(int NRW, int NC, const float *const *vr, int c0, int n, const float *P,
                   int ss, float *O, int d) {
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

/* One key block of one KV head for nr rows: keys t0 .. t0+n-1 (t0 % AT_KT == 0, n <= AT_KT),
 * K/V rows in kr / vr (kr[n ..] is padded here with the zero row `zero`). Each row sees
 * the keys in (pos - window, pos] (window 0: [0, pos]); the others score -inf. Then the
 * online-softmax update of each row: new max, rescale factor alpha = exp(m_old - m_new),
 * p = exp(s - m_new), l = fma(l, alpha, lanes_sum(sum over VW-key vectors of p)),
 * O = alpha * O + sum_t p_t v_t (t in order). */
static void FN(block)(int nr, const float *Q, const int *pos, int window, int d, int t0, int n,
                      const float **kr, const float *const *vr, const float *zero, float *S,
                      float *O, float *m, float *l) {
    const int npad = (n + VW - 1) / VW * VW;        /* whole vectors (and a multiple of 8) */
    const int ss = AT_KT;
    for (int t = n; t < npad; t++) kr[t] = zero;
    FN(scores)(nr, Q, d, kr, npad, S, ss);
    const VEC ninf = VSET(-INFINITY);
    for (int r = 0; r < nr; r++) {
        float *s = S + (long)r * ss;
        /* keys [a, b) of the block are this row's */
        const int first = window > 0 ? pos[r] - window + 1 : 0;
        const int a = first > t0 ? first - t0 : 0;
        const int b = pos[r] - t0 + 1 < n ? pos[r] - t0 + 1 : n;
        for (int t = 0; t < a && t < npad; t++) s[t] = -INFINITY;
        for (int t = b > 0 ? b : 0; t < npad; t++) s[t] = -INFINITY;
        VEC vm = ninf;
        for (int t = 0; t < npad; t += VW) vm = VMAX(vm, VLD(s + t));
        const float mt = FN(lanes_max)(vm);
        const float mold = m[r], mnew = mt > mold ? mt : mold;
        const float msub = mnew == -INFINITY ? 0.0f : mnew;
        const float alpha = mold == -INFINITY ? 0.0f : FN(exp1)(mold - msub);
        const VEC vsub = VSET(msub);
        VEC sum = VZERO();
        for (int t = 0; t < npad; t += VW) {
            const VEC sv = VLD(s + t);
            const VEC e = VKEEP(VEXP(VSUB(sv, vsub)), sv);
            VST(s + t, e);
            sum = VADD(sum, e);
        }
        l[r] = fmaf(l[r], alpha, FN(lanes_sum)(sum));
        m[r] = mnew;
        if (alpha != 1.0f) {
            const VEC va = VSET(alpha);
            for (int i = 0; i < d; i += VW) VST(O + (long)r * d + i, VMUL(va, VLD(O + (long)r * d + i)));
        }
    }
    for (int r0 = 0; r0 < nr; r0 += PV_ROWS) {
        const int nrw = nr - r0 < PV_ROWS ? nr - r0 : PV_ROWS;
        for (int c0 = 0; c0 < d; c0 += 4 * VW) {
            const int nc = (d - c0) < 4 * VW ? (d - c0) / VW : 4;
            FN(pv)(nrw, nc, vr, c0, n, S + (long)r0 * ss, ss, O + (long)r0 * d, d);
        }
    }
}

/* Fold a segment's state (O, m, l) of nr rows into their running total (OT, mT, lT), in the
 * order the segments come: M = max(mT, m), a = exp(mT - M), b = exp(m - M),
 * lT = fma(l, b, lT * a), OT = fma(O, b, OT * a); an empty total takes the segment as it is,
 * an empty segment changes nothing. */
static void FN(fold)(int nr, int d, const float *O, const float *m, const float *l, float *OT,
                     float *mT, float *lT) {
    for (int r = 0; r < nr; r++) {
        const float *o = O + (long)r * d;
        float *ot = OT + (long)r * d;
        if (m[r] == -INFINITY) continue;
        if (mT[r] == -INFINITY) {
            memcpy(ot, o, sizeof(float) * (size_t)d);
            mT[r] = m[r];
            lT[r] = l[r];
            continue;
        }
        const float M = m[r] > mT[r] ? m[r] : mT[r];
        const float a = FN(exp1)(mT[r] - M), b = FN(exp1)(m[r] - M);
        lT[r] = fmaf(l[r], b, lT[r] * a);
        mT[r] = M;
        const VEC va = VSET(a), vb = VSET(b);
        for (int i = 0; i < d; i += VW) VST(ot + i, VFMA(VLD(o + i), vb, VMUL(VLD(ot + i), va)));
    }
}

/* The sink of each of nr rows (gpt-oss: one learned logit per query head, a key with a zero
 * value) folded into the row's final state, as `fold` folds a segment of max sinks[r], sum 1
 * and output 0: l = l a + b, O = O a. Both kernels call it on the same final state, after
 * the last segment, so a row's bits stay those of the row alone. sinks NULL: nothing. */
static void FN(sink)(int nr, int d, const float *sinks, float *O, float *m, float *l) {
    if (!sinks) return;
    for (int r = 0; r < nr; r++) {
        const float s = sinks[r];
        const float M = m[r] > s ? m[r] : s;
        const float a = FN(exp1)(m[r] - M), b = FN(exp1)(s - M);
        l[r] = fmaf(1.0f, b, l[r] * a);
        m[r] = M;
        float *o = O + (long)r * d;
        const VEC va = VSET(a);
        for (int i = 0; i < d; i += VW) VST(o + i, VMUL(VLD(o + i), va));
    }
}

/* dst = O / l for one row (d floats). */
static inline void FN(finish_row)(const float *O, float l, int d, float *dst) {
    const VEC inv = VSET(1.0f / l);
    for (int i = 0; i < d; i += VW) VST(dst + i, VMUL(inv, VLD(O + i)));
}

/* Q[r] = scale * src[r] for one row of d floats. */
static inline void FN(scale_row)(const float *src, float scale, int d, float *dst) {
    const VEC vs = VSET(scale);
    for (int i = 0; i < d; i += VW) VST(dst + i, VMUL(vs, VLD(src + i)));
}
