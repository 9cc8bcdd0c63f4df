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

/* one super-block of Q4_K (nmax 15) or Q5_K (nmax 31): d, dmin, 12 scale bytes, then the
 * levels L (256) for the caller to pack */
static void k4_superblock(const float *x, const float *qw, int nmax, uint8_t *head, int *L) {
    float scales[8], mins[8], sw[8], w[QK];
    int ls[8], lm[8];
    float d_block, m_block;
    if (qw) {
        float sum_x2 = 0.0f;
        for (int l = 0; l < QKK; l++) sum_x2 += x[l] * x[l];
        float sigma2 = 2.0f * sum_x2 / QKK;
        for (int j = 0; j < 8; j++) {
            const float *xs = x + QK * j;
            float sumw = 0.0f;
            for (int l = 0; l < QK; l++) {
                w[l] = qw[QK * j + l] * sqrtf(sigma2 + xs[l] * xs[l]);
                sumw += w[l];
            }
            sw[j] = sumw;
            scales[j] = fit_scale_min(QK, nmax, xs, w, L + QK * j, &mins[j], -0.9f, 0.05f, 36);
        }
        d_block = fit_positive(8, 63, scales, ls, sw);
        m_block = fit_positive(8, 63, mins, lm, sw);
    } else {
        float max_scale = 0.0f, max_min = 0.0f;
        float rmin = nmax == 15 ? -1.0f : -0.5f;
        int nstep = nmax == 15 ? 20 : 15;
        for (int j = 0; j < 8; j++) {
            const float *xs = x + QK * j;
            float sum_x2 = 0.0f;
            for (int l = 0; l < QK; l++) sum_x2 += xs[l] * xs[l];
            float av_x = sqrtf(sum_x2 / QK);
            for (int l = 0; l < QK; l++) w[l] = av_x + fabsf(xs[l]);
            scales[j] = fit_scale_min(QK, nmax, xs, w, L + QK * j, &mins[j], rmin, 0.1f, nstep);
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
