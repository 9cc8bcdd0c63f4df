/* Quantizers from float32 rows to ggml's block layouts (the converter's; built with cffi).
 *
 * Q8_0, Q4_0, Q5_0, Q5_1 follow ggml's reference rounding exactly (bit-identical files);
 * with an importance matrix Q4_0/Q5_0/Q5_1 take the weighted search, as llama-quantize does.
 * Q4_K and Q5_K search each 32-value sub-block's scale and minimum: a handful of candidate
 * inverse scales around nmax/(max-min), each followed by the closed-form weighted
 * least-squares fit of (scale, min) to the levels it rounds to, keeping the candidate with the
 * smallest weighted error. The 6-bit sub-block scales are then fitted the same way. Weights
 * are |x| plus the sub-block's RMS without an importance matrix, imatrix * sqrt(sigma^2 + x^2)
 * with one. Q6_K fits a symmetric scale per 16 values over candidates around nmax/max.
 * Arithmetic is float32 in ggml's order, compiled without FMA contraction.
 *
 * Beyond llama-quantize, with an importance matrix only: Q4_0/Q5_0 re-choose each value's level
 * for the scale as stored (f16) and refit the scale to them (refine_symmetric), and Q4_K/Q5_K
 * walk each sub-block's 6-bit (scale, min) to a local optimum of the weighted error as stored
 * and refit the f16 super-scales (refine_k4), and Q6_K walks its int8 group scales alike.
 * On Qwen2.5-0.5B's q4_k_m with the same importance matrix that took perplexity from
 * llama-quantize's +0.04% to -0.89%; without one the same steps moved it by -0.1% to +0.3%
 * (noise: files 107 bytes apart differ by 0.16%), so the plain path stays ggml's, and its
 * files llama-quantize's to a few bytes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK 32          /* values per block of the 32-block types */
#define QKK 256        /* values per K-quant super-block */
#define EPS_GROUP 1e-15f

typedef _Float16 half;

static inline uint16_t f16_bits(float x) {
    half h = (half)x; /* round to nearest even, as ggml's FP32_TO_FP16 */
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

static inline float f16_round(float x) { return (float)(half)x; }

/* nearest integer, ties to even (ggml's nearest_int through 1.5 * 2^23) */
static inline int nearest(float x) { return (int)rintf(x); }

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }

/* ----------------------------------------------------------------- 32-value block types */

/* Q8_0: 2-byte f16 scale + 32 int8 */
static void q8_0_row(const float *x, uint8_t *out, int64_t n) {
    for (int64_t b = 0; b < n / QK; b++, x += QK, out += 34) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = f16_bits(d);
        memcpy(out, &h, 2);
        for (int j = 0; j < QK; j++) out[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
    }
}

/* the value of largest magnitude (the first one where two tie), signed */
static inline float signed_absmax(const float *x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
    }
    return max;
}

static void pack_q4_0(uint8_t *out, float d, const int *L) {
    uint16_t h = f16_bits(d);
    memcpy(out, &h, 2);
    for (int j = 0; j < QK / 2; j++) out[2 + j] = (uint8_t)(L[j] | (L[j + QK / 2] << 4));
}

static void pack_q5(uint8_t *out, const int *L) {
    /* out: 4 bytes of high bits, then 16 bytes of low nibbles */
    uint32_t qh = 0;
    for (int j = 0; j < QK / 2; j++) {
        out[4 + j] = (uint8_t)((L[j] & 0x0F) | ((L[j + QK / 2] & 0x0F) << 4));
        qh |= (uint32_t)((L[j] >> 4) & 1) << j;
        qh |= (uint32_t)((L[j + QK / 2] >> 4) & 1) << (j + QK / 2);
    }
    memcpy(out, &qh, 4);
}

/* weighted error of x stored as d16 * (L - nmax), levels re-chosen for d16 (in place) */
static float relevel_symmetric(int n, int nmax, const float *x, const float *w, float d16,
                               int *L) {
    float err = 0.0f;
    for (int i = 0; i < n; i++) {
        int l = d16 != 0.0f ? imax(-nmax, imin(nmax - 1, nearest(x[i] / d16))) : 0;
        L[i] = l + nmax;
        float diff = d16 * l - x[i];
        err += w[i] * diff * diff;
    }
    return err;
}

/* A symmetric block's scale as stored (f16), refined: the levels re-chosen for the stored
 * scale (each value's nearest), the scale refitted to them by weighted least squares, a few
 * rounds, keeping the best as stored. ggml keeps the levels of the candidate scale it found. */
static float refine_symmetric(int n, int nmax, const float *x, const float *w, float d, int *L) {
    int cand[QK];
    float best_d = f16_round(d);
    float best = relevel_symmetric(n, nmax, x, w, best_d, L);
    for (int round = 0; round < 4; round++) {
        double slx = 0, sl2 = 0;
        for (int i = 0; i < n; i++) {
            int l = L[i] - nmax;
            slx += (double)w[i] * x[i] * l;
            sl2 += (double)w[i] * l * l;
        }
        if (sl2 <= 0.0) break;
        float nd = f16_round((float)(slx / sl2));
        if (nd == best_d) break;
        float err = relevel_symmetric(n, nmax, x, w, nd, cand);
        if (!(err < best)) break;
        best = err;
        best_d = nd;
        memcpy(L, cand, sizeof(int) * n);
    }
    return best_d;
}

/* symmetric weighted fit with levels in [-nmax, nmax-1] (ggml's make_qx_quants, rmse_type 1) */
static float fit_symmetric(int n, int nmax, const float *x, int *L, const float *w) {
    float max = signed_absmax(x, n);
    if (fabsf(max) < EPS_GROUP) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.0f;
    }
    float iscale = -nmax / max;
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < n; i++) {
        int l = imax(-nmax, imin(nmax - 1, nearest(iscale * x[i])));
        L[i] = l + nmax;
        float wi = w ? w[i] : x[i] * x[i];
        sumlx += wi * x[i] * l;
        suml2 += wi * l * l;
    }
    float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0.0f;
        for (int i = 0; i < n; i++) {
            int l = imax(-nmax, imin(nmax - 1, nearest(iscale * x[i])));
            float wi = w ? w[i] : x[i] * x[i];
            sumlx += wi * x[i] * l;
            suml2 += wi * l * l;
        }
        if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) {
                L[i] = nmax + imax(-nmax, imin(nmax - 1, nearest(iscale * x[i])));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* asymmetric weighted fit, levels 0..nmax: returns the scale, *neg_min = -(min) >= 0.
 * Candidates iscale = (rmin + rdelta*k + nmax) / (max - min), k = 0..nstep; each candidate's
 * levels get the least-squares (scale, min) in closed form. */
static float fit_scale_min(int n, int nmax, const float *x, const float *w, int *L,
                           float *neg_min, float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0];
    float sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0.0f) min = 0.0f;
    if (max <= min) {
        for (int i = 0; i < n; i++) L[i] = 0;
        *neg_min = -min;
        return 0.0f;
    }
    float iscale = nmax / (max - min);
    float scale = 1.0f / iscale;
    float best_err = 0.0f;
    for (int i = 0; i < n; i++) {
        L[i] = imax(0, imin(nmax, nearest(iscale * (x[i] - min))));
        float diff = scale * L[i] + min - x[i];
        best_err += w[i] * diff * diff;
    }
    int cand[QK];
    for (int k = 0; k <= nstep; k++) {
        iscale = (rmin + rdelta * k + nmax) / (max - min);
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
        for (int i = 0; i < n; i++) {
            int l = imax(0, imin(nmax, nearest(iscale * (x[i] - min))));
            cand[i] = l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D <= 0.0f) continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        if (this_min > 0.0f) { /* the minimum must not be positive: refit the scale alone */
            this_min = 0.0f;
            this_scale = sum_xl / sum_l2;
        }
        float err = 0.0f;
        for (int i = 0; i < n; i++) {
            float diff = this_scale * cand[i] + this_min - x[i];
            err += w[i] * diff * diff;
        }
        if (err < best_err) {
            memcpy(L, cand, sizeof(int) * n);
            best_err = err;
            scale = this_scale;
            min = this_min;
        }
    }
    *neg_min = -min;
    return scale;
}

/* non-negative values to levels 0..nmax under one weighted scale (the K-quants' 6-bit
 * sub-block scales and minimums); ggml's make_qp_quants */
static float fit_positive(int n, int nmax, const float *x, int *L, const float *w) {
    float max = 0.0f;
    for (int i = 0; i < n; i++) max = fmaxf(max, x[i]);
    if (max < EPS_GROUP) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.0f;
    }
    float iscale = nmax / max;
    for (int i = 0; i < n; i++) L[i] = nearest(iscale * x[i]);
    float scale = 1.0f / iscale;
    float best_mse = 0.0f;
    for (int i = 0; i < n; i++) {
        float diff = x[i] - scale * L[i];
        best_mse += w[i] * diff * diff;
    }
    for (int is = -4; is <= 4; is++) {
        if (is == 0) continue;
        float iscale_is = (0.1f * is + nmax) / max;
        float scale_is = 1.0f / iscale_is;
        float mse = 0.0f;
        for (int i = 0; i < n; i++) {
            int l = imin(nmax, nearest(iscale_is * x[i]));
            float diff = x[i] - scale_is * l;
            mse += w[i] * diff * diff;
        }
        if (mse < best_mse) { best_mse = mse; iscale = iscale_is; }
    }
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < n; i++) {
        int l = imin(nmax, nearest(iscale * x[i]));
        L[i] = l;
        sumlx += w[i] * x[i] * l;
        suml2 += w[i] * l * l;
    }
    for (int pass = 0; pass < 5; pass++) { /* move single levels while that lowers the error */
        int changed = 0;
        for (int i = 0; i < n; i++) {
            float slx = sumlx - w[i] * x[i] * L[i];
            float sl2 = suml2 - w[i] * L[i] * L[i];
            if (slx > 0.0f && sl2 > 0.0f) {
                int nl = imin(nmax, nearest(x[i] * sl2 / slx));
                if (nl != L[i]) {
                    slx += w[i] * x[i] * nl;
                    sl2 += w[i] * nl * nl;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = nl; sumlx = slx; suml2 = sl2;
                        changed++;
                    }
                }
            }
        }
        if (!changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

static float row_sigma2(const float *x, int64_t n) {
    float s = 0.0f;
    for (int64_t j = 0; j < n; j++) s += x[j] * x[j];
    return s / n;
}

static void q4_0_row(const float *x, uint8_t *out, int64_t n, const float *qw) {
    int L[QK];
    float w[QK];
    float sigma2 = qw ? row_sigma2(x, n) : 0.0f;
    for (int64_t b = 0; b < n / QK; b++, x += QK, out += 18) {
        float d;
        if (qw) {
            for (int j = 0; j < QK; j++) w[j] = qw[b * QK + j] * sqrtf(sigma2 + x[j] * x[j]);
            d = fit_symmetric(QK, 8, x, L, w);
            d = refine_symmetric(QK, 8, x, w, d, L);
        } else {
            d = signed_absmax(x, QK) / -8.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int j = 0; j < QK; j++) L[j] = imin(15, (int8_t)(x[j] * id + 8.5f));
        }
        pack_q4_0(out, d, L);
    }
}

static void q5_0_row(const float *x, uint8_t *out, int64_t n, const float *qw) {
    int L[QK];
    float w[QK];
    float sigma2 = qw ? row_sigma2(x, n) : 0.0f;
    for (int64_t b = 0; b < n / QK; b++, x += QK, out += 22) {
        float d;
        if (qw) {
            for (int j = 0; j < QK; j++) w[j] = qw[b * QK + j] * sqrtf(sigma2 + x[j] * x[j]);
            d = fit_symmetric(QK, 16, x, L, w);
            d = refine_symmetric(QK, 16, x, w, d, L);
        } else {
            d = signed_absmax(x, QK) / -16.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int j = 0; j < QK; j++) L[j] = imin(31, (int8_t)(x[j] * id + 16.5f));
        }
        uint16_t h = f16_bits(d);
        memcpy(out, &h, 2);
        pack_q5(out + 2, L);
    }
}

static void q5_1_row(const float *x, uint8_t *out, int64_t n, const float *qw) {
    int L[QK];
    float w[QK];
    float sigma2 = qw ? row_sigma2(x, n) : 0.0f;
    for (int64_t b = 0; b < n / QK; b++, x += QK, out += 24) {
        float d, m;
        if (qw) {
            for (int j = 0; j < QK; j++) w[j] = qw[b * QK + j] * sqrtf(sigma2 + x[j] * x[j]);
            float neg_min;
            d = fit_scale_min(QK, 31, x, w, L, &neg_min, -0.9f, 0.05f, 36);
            m = -neg_min;
        } else {
            float lo = x[0], hi = x[0];
            for (int j = 1; j < QK; j++) { lo = fminf(lo, x[j]); hi = fmaxf(hi, x[j]); }
            d = (hi - lo) / 31.0f;
            m = lo;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int j = 0; j < QK; j++) L[j] = (uint8_t)((x[j] - lo) * id + 0.5f);
        }
        uint16_t hd = f16_bits(d), hm = f16_bits(m);
        memcpy(out, &hd, 2);
        memcpy(out + 2, &hm, 2);
        pack_q5(out + 4, L);
    }
}

/* ----------------------------------------------------------------- K-quants */

/* the 12 bytes of 6-bit scales and minimums of 8 sub-blocks (Q4_K and Q5_K) */
static void pack_scales_k4(uint8_t *s, const int *ls, const int *lm) {
    memset(s, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            s[j] = (uint8_t)ls[j];
            s[j + 4] = (uint8_t)lm[j];
        } else {
            s[j + 4] = (uint8_t)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
            s[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            s[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
}

/* v rounded to the nearest integer, ties to even, exact for |v| < 2^22; beyond that it stays
 * beyond, which the callers' clamp to their levels makes right. Plain adds (no rintf, no
 * branch), so the error loops below vectorize on any x86-64 or ARM baseline. */
static inline float round_even(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

#define LANES 8 /* partial sums of the error loops: a fixed order, so the same bits anywhere */

static float sum_lanes(const float *acc) {
    float err = 0.0f;
    for (int k = 0; k < LANES; k++) err += acc[k];
    return err;
}

/* weighted squared error of one 32-value sub-block stored as d * q - dm, each level q the
 * nearest to its value in 0..nmax */
static float subblock_error(const float *x, const float *w, int nmax, float d, float dm) {
    float acc[LANES] = {0};
    if (!(d > 0.0f)) { /* every level 0 */
        for (int l = 0; l < QK; l += LANES) {
            for (int k = 0; k < LANES; k++) {
                float diff = dm + x[l + k];
                acc[k] += w[l + k] * diff * diff;
            }
        }
        return sum_lanes(acc);
    }
    const float top = (float)nmax;
    for (int l = 0; l < QK; l += LANES) {
        for (int k = 0; k < LANES; k++) {
            float q = round_even((x[l + k] + dm) / d);
            q = q < 0.0f ? 0.0f : q;
            q = q > top ? top : q;
            float diff = d * q - dm - x[l + k];
            acc[k] += w[l + k] * diff * diff;
        }
    }
    return sum_lanes(acc);
}

static float superblock_error(const float *x, const float *w, int nmax, float d16, float m16,
                              const int *ls, const int *lm) {
    float err = 0.0f;
    for (int j = 0; j < 8; j++) {
        err += subblock_error(x + QK * j, w + QK * j, nmax, d16 * ls[j], m16 * lm[j]);
    }
    return err;
}

/* Each sub-block's (scale, min) 6-bit levels walked to the best of their +-1 neighbours
 * while one is better, the values re-levelled for each (ggml rounds each fitted scale and
 * minimum once); each step lowers the error, and a level has 64 values. */
static float step_sub_levels(const float *x, const float *w, int nmax, float d16, float m16,
                             int *ls, int *lm) {
    float total = 0.0f;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + QK * j, *ws = w + QK * j;
        float best = subblock_error(xs, ws, nmax, d16 * ls[j], m16 * lm[j]);
        for (int walk = 0; walk < 64; walk++) {
            int bs = ls[j], bm = lm[j];
            for (int sc = imax(0, ls[j] - 1); sc <= imin(63, ls[j] + 1); sc++) {
                for (int mn = imax(0, lm[j] - 1); mn <= imin(63, lm[j] + 1); mn++) {
                    float e = subblock_error(xs, ws, nmax, d16 * sc, m16 * mn);
                    if (e < best) { best = e; bs = sc; bm = mn; }
                }
            }
            if (bs == ls[j] && bm == lm[j]) break;
            ls[j] = bs;
            lm[j] = bm;
        }
        total += best;
    }
    return total; /* the super-block's error as it now stands */
}

/* The two f16 super-scales refitted to the levels by weighted least squares
 * (x ~ d*ls*q - dmin*lm), kept when the stored error drops below ``err`` (the error now);
 * returns whether they were. */
static int refit_super_scales(const float *x, const float *w, int nmax, float *d16,
                              float *m16, const int *ls, const int *lm, float err) {
    double saa = 0, sab = 0, sbb = 0, sax = 0, sbx = 0;
    for (int j = 0; j < 8; j++) {
        float d = *d16 * ls[j], dm = *m16 * lm[j];
        for (int l = 0; l < QK; l++) {
            int i = QK * j + l;
            int q = d > 0.0f ? imax(0, imin(nmax, nearest((x[i] + dm) / d))) : 0;
            double a = (double)ls[j] * q, b = -(double)lm[j];
            saa += w[i] * a * a; sab += w[i] * a * b; sbb += w[i] * b * b;
            sax += w[i] * a * x[i]; sbx += w[i] * b * x[i];
        }
    }
    double det = saa * sbb - sab * sab;
    if (det <= 0.0) return 0;
    float nd = f16_round((float)((sax * sbb - sbx * sab) / det));
    float nm = f16_round((float)((saa * sbx - sab * sax) / det));
    if (!(nd > 0.0f && nm >= 0.0f && isfinite(nd) && isfinite(nm))) return 0;
    if ((nd == *d16 && nm == *m16) || !(superblock_error(x, w, nmax, nd, nm, ls, lm) < err)) {
        return 0;
    }
    *d16 = nd;
    *m16 = nm;
    return 1;
}

/* A super-block's scales as stored, refined against the weighted error they give: the
 * sub-block levels stepped, the super-scales refitted, the levels stepped again, so that the
 * stored result is a local optimum (no single +-1 step of a sub-block lowers its error). Each
 * step keeps the error or lowers it; the second walk runs only when the refit moved. */
static void refine_k4(const float *x, const float *w, int nmax, float *d_block, float *m_block,
                      int *ls, int *lm) {
    float d16 = f16_round(*d_block), m16 = f16_round(*m_block);
    if (d16 <= 0.0f) return;
    float err = step_sub_levels(x, w, nmax, d16, m16, ls, lm);
    if (refit_super_scales(x, w, nmax, &d16, &m16, ls, lm, err)) {
        step_sub_levels(x, w, nmax, d16, m16, ls, lm);
    }
    *d_block = d16;
    *m_block = m16;
}

/* one super-block of Q4_K (nmax 15) or Q5_K (nmax 31): d, dmin, 12 scale bytes, then the
 * levels L (256) for the caller to pack */
static void k4_superblock(const float *x, const float *qw, int nmax, uint8_t *head, int *L) {
    float scales[8], mins[8], sw[8], w[QKK];
    int ls[8], lm[8];
    float d_block, m_block;
    if (qw) {
        float sum_x2 = 0.0f;
        for (int l = 0; l < QKK; l++) sum_x2 += x[l] * x[l];
        float sigma2 = 2.0f * sum_x2 / QKK;
        for (int j = 0; j < 8; j++) {
            const float *xs = x + QK * j;
            float *ws = w + QK * j, sumw = 0.0f;
            for (int l = 0; l < QK; l++) {
                ws[l] = qw[QK * j + l] * sqrtf(sigma2 + xs[l] * xs[l]);
                sumw += ws[l];
            }
            sw[j] = sumw;
            scales[j] = fit_scale_min(QK, nmax, xs, ws, L + QK * j, &mins[j], -0.9f, 0.05f, 36);
        }
        d_block = fit_positive(8, 63, scales, ls, sw);
        m_block = fit_positive(8, 63, mins, lm, sw);
    } else {
        float max_scale = 0.0f, max_min = 0.0f;
        float rmin = nmax == 15 ? -1.0f : -0.5f;
        int nstep = nmax == 15 ? 20 : 15;
        for (int j = 0; j < 8; j++) {
            const float *xs = x + QK * j;
            float *ws = w + QK * j, sum_x2 = 0.0f;
            for (int l = 0; l < QK; l++) sum_x2 += xs[l] * xs[l];
            float av_x = sqrtf(sum_x2 / QK);
            for (int l = 0; l < QK; l++) ws[l] = av_x + fabsf(xs[l]);
            scales[j] = fit_scale_min(QK, nmax, xs, ws, L + QK * j, &mins[j], rmin, 0.1f, nstep);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
        float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
        for (int j = 0; j < 8; j++) {
            ls[j] = imin(63, (uint8_t)nearest(inv_scale * scales[j]));
            lm[j] = imin(63, (uint8_t)nearest(inv_min * mins[j]));
        }
        d_block = max_scale / 63.0f;
        m_block = max_min / 63.0f;
    }
    for (int j = 0; j < 8; j++) { ls[j] = imin(63, ls[j]); lm[j] = imin(63, lm[j]); }
    if (qw) refine_k4(x, w, nmax, &d_block, &m_block, ls, lm);
    uint16_t hd = f16_bits(d_block), hm = f16_bits(m_block);
    memcpy(head, &hd, 2);
    memcpy(head + 2, &hm, 2);
    pack_scales_k4(head + 4, ls, lm);
    /* final levels against the scales as stored (f16 super-scales times 6-bit integers) */
    float d16 = f16_round(d_block), m16 = f16_round(m_block);
    for (int j = 0; j < 8; j++) {
        float d = d16 * ls[j];
        if (d == 0.0f) continue;
        float dm = m16 * lm[j];
        for (int l = 0; l < QK; l++) {
            L[QK * j + l] = imax(0, imin(nmax, nearest((x[QK * j + l] + dm) / d)));
        }
    }
}

static void q4_k_row(const float *x, uint8_t *out, int64_t n, const float *qw) {
    int L[QKK];
    for (int64_t b = 0; b < n / QKK; b++, x += QKK, out += 144) {
        k4_superblock(x, qw ? qw + b * QKK : NULL, 15, out, L);
        uint8_t *q = out + 16;
        for (int j = 0; j < QKK; j += 64, q += 32) {
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        }
    }
}

static void q5_k_row(const float *x, uint8_t *out, int64_t n, const float *qw) {
    int L[QKK];
    for (int64_t b = 0; b < n / QKK; b++, x += QKK, out += 176) {
        k4_superblock(x, qw ? qw + b * QKK : NULL, 31, out, L);
        uint8_t *qh = out + 16, *ql = out + 48;
        memset(qh, 0, 32);
        uint8_t m1 = 1, m2 = 2;
        for (int j = 0; j < QKK; j += 64, ql += 32) {
            for (int l = 0; l < 32; l++) {
                int l1 = L[j + l], l2 = L[j + l + 32];
                if (l1 > 15) { l1 -= 16; qh[l] |= m1; }
                if (l2 > 15) { l2 -= 16; qh[l] |= m2; }
                ql[l] = (uint8_t)(l1 | (l2 << 4));
            }
            m1 <<= 2;
            m2 <<= 2;
        }
    }
}

/* weighted error of 16 values stored as d * (q - 32), each level the nearest (Q6_K), weighted
 * by the importance matrix */
static float q6_group_error(const float *x, const float *qw, float d) {
    float acc[LANES] = {0};
    for (int l = 0; l < 16; l += LANES) {
        for (int k = 0; k < LANES; k++) {
            float q = 0.0f;
            if (d != 0.0f) {
                q = round_even(x[l + k] / d);
                q = q < -32.0f ? -32.0f : q;
                q = q > 31.0f ? 31.0f : q;
            }
            float diff = d * q - x[l + k];
            acc[k] += qw[l + k] * diff * diff;
        }
    }
    return sum_lanes(acc);
}

/* With an importance matrix, Q6_K's int8 group scales as stored, each walked by single steps
 * while that lowers its weighted error with the values re-levelled (ggml rounds each fitted
 * scale once), as step_sub_levels does for Q4_K/Q5_K */
static void refine_q6_k(const float *x, const float *qw, float d16, int8_t *sc) {
    for (int s = 0; s < 16; s++) {
        const float *xs = x + 16 * s, *ws = qw + 16 * s;
        float best = q6_group_error(xs, ws, d16 * sc[s]);
        for (int walk = 0; walk < 256; walk++) {
            int bs = sc[s];
            for (int c = sc[s] - 1; c <= sc[s] + 1; c += 2) {
                if (c < -128 || c > 127) continue;
                float e = q6_group_error(xs, ws, d16 * c);
                if (e < best) { best = e; bs = c; }
            }
            if (bs == sc[s]) break;
            sc[s] = (int8_t)bs;
        }
    }
}

/* Q6_K: 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, f16 d (210 bytes) */
static void q6_k_row(const float *x, uint8_t *out, int64_t n, const float *qw) {
    int L[QKK];
    float scales[16];
    for (int64_t b = 0; b < n / QKK; b++, x += QKK, out += 210) {
        float max_scale = 0.0f, max_abs = 0.0f;
        for (int s = 0; s < 16; s++) {
            scales[s] = fit_symmetric(16, 32, x + 16 * s, L + 16 * s,
                                      qw ? qw + b * QKK + 16 * s : NULL);
            if (fabsf(scales[s]) > max_abs) { max_abs = fabsf(scales[s]); max_scale = scales[s]; }
        }
        if (max_abs < EPS_GROUP) {
            memset(out, 0, 210);
            continue;
        }
        float iscale = -128.0f / max_scale;
        uint16_t hd = f16_bits(1.0f / iscale);
        memcpy(out + 208, &hd, 2);
        int8_t *sc = (int8_t *)(out + 192);
        for (int s = 0; s < 16; s++) sc[s] = (int8_t)imin(127, nearest(iscale * scales[s]));
        float d16 = f16_round(1.0f / iscale);
        if (qw) refine_q6_k(x, qw + b * QKK, d16, sc);
        for (int s = 0; s < 16; s++) {
            float d = d16 * sc[s];
            if (d == 0.0f) continue;
            for (int l = 0; l < 16; l++) {
                L[16 * s + l] = imax(-32, imin(31, nearest(x[16 * s + l] / d))) + 32;
            }
        }
        uint8_t *ql = out, *qh = out + 128;
        for (int j = 0; j < QKK; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; l++) {
                ql[l] = (uint8_t)((L[j + l] & 0xF) | ((L[j + l + 64] & 0xF) << 4));
                ql[l + 32] = (uint8_t)((L[j + l + 32] & 0xF) | ((L[j + l + 96] & 0xF) << 4));
                qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                  ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
            }
        }
    }
}

/* ggml type ids */
enum { T_Q4_0 = 2, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

/* Quantize nrows rows of ncols floats into out (row after row of the type's blocks).
 * imatrix: ncols per-column weights or NULL. Returns 0, or -1 for an unknown type. */
int eq_quantize_rows(int type, const float *x, uint8_t *out, int64_t nrows, int64_t ncols,
                     int64_t row_bytes, const float *imatrix) {
    for (int64_t r = 0; r < nrows; r++) {
        const float *xr = x + r * ncols;
        uint8_t *o = out + r * row_bytes;
        switch (type) {
        case T_Q8_0: q8_0_row(xr, o, ncols); break;
        case T_Q4_0: q4_0_row(xr, o, ncols, imatrix); break;
        case T_Q5_0: q5_0_row(xr, o, ncols, imatrix); break;
        case T_Q5_1: q5_1_row(xr, o, ncols, imatrix); break;
        case T_Q4_K: q4_k_row(xr, o, ncols, imatrix); break;
        case T_Q5_K: q5_k_row(xr, o, ncols, imatrix); break;
        case T_Q6_K: q6_k_row(xr, o, ncols, imatrix); break;
        default: return -1;
        }
    }
    return 0;
}
