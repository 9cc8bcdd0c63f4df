/* Quantized mat-vec kernels and the elementwise ops for aarch64 (NEON), over ggml's own block
 * layouts: the same C API as the x86 files (cpu_kernels.c, cpu_gemm.c, cpu_packed.c), compiled
 * as one unit after cpu_pool.c by native/cpu_kernels.py.
 *
 * Weights are read in place (zero copy over the GGUF mmap). Activations are rounded exactly as
 * the x86 build rounds them (Q8_0 per 32 with an f16 scale against the per-block types, Q8_K
 * per 256 against the K-quants), so every block dot is an 8-bit integer dot:
 *
 *     w = s * q + m   =>   sum(w * x) = s * xd * dot(q, xq) + m * xd * sum(xq)
 *
 * dot16 below is one `sdot` (vdotq_s32, the dotprod extension: -march=armv8.2-a+dotprod and
 * later), or, on cores without it (Cortex-A72/A53, -march=armv8-a), vmull_s8 + pairwise adds.
 * Both give lane i of 4 the sum of the products of bytes 4i..4i+3: the same int32 lanes as
 * x86's vpmaddubsw + vpmaddwd (or vpdpbusd) over the two 16-byte halves of a 32-byte block.
 *
 * The dotprod and plain builds are bit-identical to the x86 AVX2 build, token by token (the
 * i8mm build, -march=armv8.6-a+i8mm, takes smmla and its own float order: see its section):
 * each 32-element block gives 8 int32
 * lanes (two int32x4), converted to f32 and fused-multiply-added into 8 float lanes with the
 * same scale, even and odd blocks into two accumulators, and the same horizontal sum at the
 * end ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)); K-quants sum each superblock in int32
 * with the same lane split and meet floats once per superblock, as llama.cpp. Every token of
 * a batch runs the arithmetic of a single-token dot, so a token's result does not depend on
 * the batch it comes in (speculative decoding's greedy exactness relies on that).
 *
 * No packed layout yet on ARM: ek_packed_bytes is 0 and the pack entry points return -2, as
 * the x86 AVX2-only build had them; prefill runs the mat-vec kernels in groups of MAXN tokens.
 */
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

#define MAXN 8
#define FORCE static inline __attribute__((always_inline))

static inline float f16(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* src (n,) f32 stored as f16 bits at dst, rounded to nearest, ties to even */
static void f16_store_row(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const __fp16 h = (__fp16)src[i];
        memcpy(dst + i, &h, 2);
    }
}

/* f32 rounded to the nearest f16 (ties to even, as F16C's vcvtps2ph) and back */
static inline float f16_round(float v) { return (float)(__fp16)v; }

/* ---- 8-bit dots: 16 signed bytes . 16 signed bytes -> 4 int32 (bytes 4i..4i+3 in lane i) -- */
#if defined(__ARM_FEATURE_DOTPROD)
static inline int32x4_t dot16(int8x16_t a, int8x16_t b) {
    return vdotq_s32(vdupq_n_s32(0), a, b);
}
#else
static inline int32x4_t dot16(int8x16_t a, int8x16_t b) {
    const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    const int32x4_t hi = vpaddlq_s16(vmull_high_s8(a, b));
    return vpaddq_s32(lo, hi);
}
#endif

/* The x86 hsum8 of the 8 lanes (lo: 0-3, hi: 4-7): ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)).
 * (vaddvq_f32 pairs the lanes differently and would break bit-identity with x86.) */
static inline float hsum8(float32x4_t lo, float32x4_t hi) {
    const float32x4_t t = vaddq_f32(lo, hi);
    const float32x2_t u = vadd_f32(vget_low_f32(t), vget_high_f32(t));
    return vget_lane_f32(u, 0) + vget_lane_f32(u, 1);
}

/* 16 bits -> 16 bytes, each 0x10 where its bit is set (the fifth bit of Q5_0 / Q5_1) */
static inline uint8x16_t bits_to_0x10(uint32_t bits) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bit)), vdupq_n_u8(0x10));
}

/* The 8 scales and mins of a Q4_K/Q5_K superblock (12 bytes at q): sub-blocks 0-3 keep their
 * low 6 bits in bytes 0-3 (scales) and 4-7 (mins); 4-7 take 4 bits from bytes 8-11 and their
 * top 2 bits from bits 6-7 of bytes 0-3 and 4-7. */
static inline void scales_mins_k4(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    for (int i = 0; i < 4; i++) {
        sc[i] = q[i] & 63;
        mn[i] = q[i + 4] & 63;
        sc[i + 4] = (q[i + 8] & 0x0F) | ((q[i] >> 6) << 4);
        mn[i + 4] = (q[i + 8] >> 4) | ((q[i + 4] >> 6) << 4);
    }
}

static inline int8x16_t loadx(const int8_t *x) { return vld1q_s8(x); }

/* ---- row dot products: one weight row (nb blocks) . n quantized activation rows -----------
 * Activations interleaved by block as on x86: token t's block b is xq + 32 * (b * n + t), its
 * scale xd[b * n + t], its 16-element sums xs[2 * (b * n + t) + 0/1]. Block-outer, token-inner;
 * the bodies are inlined for each n in 1..MAXN. acc[t][0] holds float lanes 0-3, [1] 4-7. */

typedef float32x4_t acc8_t[2];

/* acc += cvt(p) * s on both halves (fused, as _mm256_fmadd_ps) */
FORCE void fma8(acc8_t acc, int32x4_t p0, int32x4_t p1, float s) {
    const float32x4_t sv = vdupq_n_f32(s);
    acc[0] = vfmaq_f32(acc[0], vcvtq_f32_s32(p0), sv);
    acc[1] = vfmaq_f32(acc[1], vcvtq_f32_s32(p1), sv);
}

FORCE void blk_q8_0(const uint8_t *w, int b, const int8_t *xq, const float *xd, const int n,
                    acc8_t *acc) {
    const int8x16_t q0 = vld1q_s8((const int8_t *)w + 2), q1 = vld1q_s8((const int8_t *)w + 18);
    const float d = f16(w);
    for (int t = 0; t < n; t++) {
        const int8_t *x = xq + 32 * ((int64_t)b * n + t);
        fma8(acc[t], dot16(q0, loadx(x)), dot16(q1, loadx(x + 16)), d * xd[b * n + t]);
    }
}

/* Q4_0 / Q5_0: q unsigned (4 or 5 bits) with an offset of 8 or 16, removed from lane 0. */
FORCE void blk_q4_0(const uint8_t *w, int b, const int8_t *xq, const float *xd,
                    const int32_t *xs, const int n, acc8_t *acc, const int five) {
    const float d = f16(w);
    const uint8x16_t raw = vld1q_u8(w + 2 + 4 * five);
    uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(raw, 4);
    if (five) {
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        lo = vorrq_u8(lo, bits_to_0x10(qh));
        hi = vorrq_u8(hi, bits_to_0x10(qh >> 16));
    }
    const int8x16_t q0 = vreinterpretq_s8_u8(lo), q1 = vreinterpretq_s8_u8(hi);
    const int offset = five ? 16 : 8;
    for (int t = 0; t < n; t++) {
        const int64_t bt = (int64_t)b * n + t;
        const int8_t *x = xq + 32 * bt;
        const int32x4_t off = vsetq_lane_s32(offset * (xs[2 * bt] + xs[2 * bt + 1]),
                                             vdupq_n_s32(0), 0);
        fma8(acc[t], vsubq_s32(dot16(q0, loadx(x)), off), dot16(q1, loadx(x + 16)),
             d * xd[bt]);
    }
}

/* Q4_1 / Q5_1: w = d q + m; the m term in float, on its own per-token sum. */
FORCE void blk_q4_1(const uint8_t *w, int b, const int8_t *xq, const float *xd,
                    const int32_t *xs, const int n, acc8_t *acc, float *off, const int five) {
    const float d = f16(w), m = f16(w + 2);
    const uint8x16_t raw = vld1q_u8(w + 4 + 4 * five);
    uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(raw, 4);
    if (five) {
        uint32_t qh;
        memcpy(&qh, w + 4, 4);
        lo = vorrq_u8(lo, bits_to_0x10(qh));
        hi = vorrq_u8(hi, bits_to_0x10(qh >> 16));
    }
    const int8x16_t q0 = vreinterpretq_s8_u8(lo), q1 = vreinterpretq_s8_u8(hi);
    for (int t = 0; t < n; t++) {
        const int64_t bt = (int64_t)b * n + t;
        const int8_t *x = xq + 32 * bt;
        fma8(acc[t], dot16(q0, loadx(x)), dot16(q1, loadx(x + 16)), d * xd[bt]);
        off[t] += m * xd[bt] * (float)(xs[2 * bt] + xs[2 * bt + 1]);
    }
}

/* Two accumulator sets, even and odd blocks (two FMA chains); summed per token at the end. */
#define ACC2_BEGIN                                                                            \
    acc8_t acc0[MAXN], acc1[MAXN];                                                            \
    float off0[MAXN], off1[MAXN];                                                             \
    for (int t = 0; t < n; t++) {                                                             \
        acc0[t][0] = acc0[t][1] = acc1[t][0] = acc1[t][1] = vdupq_n_f32(0.0f);                \
        off0[t] = off1[t] = 0.0f;                                                             \
    }
#define ACC2_END                                                                              \
    for (int t = 0; t < n; t++)                                                               \
        out[(int64_t)t * ldo] = hsum8(vaddq_f32(acc0[t][0], acc1[t][0]),                      \
                                      vaddq_f32(acc0[t][1], acc1[t][1])) + (off0[t] + off1[t]);

/* a hint for the row bytes g_prefetch_ahead on: in-order cores (Cortex-A55/A76 little cores)
 * benefit; the big out-of-order cores' prefetchers see the stream anyway. The distance is
 * calibrated per CPU model as on x86 (backends/cpu/calibrate.py). */
static int g_prefetch_ahead = 1024;

/* Set the mat-vec kernels' prefetch distance (bytes, 0..65536, rounded down to a line). */
void ek_set_prefetch_ahead(int bytes) {
    g_prefetch_ahead = bytes < 0 ? 0 : (bytes > 65536 ? 65536 : bytes) & ~63;
}

/* The mat-vec kernels' prefetch distance in bytes. */
int ek_prefetch_ahead(void) { return g_prefetch_ahead; }

#define PREFETCH(p) __builtin_prefetch((const char *)(p) + g_prefetch_ahead)

FORCE void dot_q8_0_n(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,
                      int nb, const int n, float *out, int64_t ldo) {
    (void)xs;
    ACC2_BEGIN
    int b = 0;
    for (; b + 1 < nb; b += 2, w += 68) {
        PREFETCH(w);
        blk_q8_0(w, b, xq, xd, n, acc0);
        blk_q8_0(w + 34, b + 1, xq, xd, n, acc1);
    }
    if (b < nb) blk_q8_0(w, b, xq, xd, n, acc0);
    ACC2_END
}

#define DOT_OFFSET_TYPE(name, bytes, five)                                                    \
    FORCE void name(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,   \
                    int nb, const int n, float *out, int64_t ldo) {                           \
        ACC2_BEGIN                                                                            \
        int b = 0;                                                                            \
        for (; b + 1 < nb; b += 2, w += 2 * (bytes)) {                                        \
            PREFETCH(w);                                                                      \
            blk_q4_0(w, b, xq, xd, xs, n, acc0, five);                                        \
            blk_q4_0(w + (bytes), b + 1, xq, xd, xs, n, acc1, five);                          \
        }                                                                                     \
        if (b < nb) blk_q4_0(w, b, xq, xd, xs, n, acc0, five);                                \
        ACC2_END                                                                              \
    }

#define DOT_MIN_TYPE(name, bytes, five)                                                       \
    FORCE void name(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,   \
                    int nb, const int n, float *out, int64_t ldo) {                           \
        ACC2_BEGIN                                                                            \
        int b = 0;                                                                            \
        for (; b + 1 < nb; b += 2, w += 2 * (bytes)) {                                        \
            PREFETCH(w);                                                                      \
            blk_q4_1(w, b, xq, xd, xs, n, acc0, off0, five);                                  \
            blk_q4_1(w + (bytes), b + 1, xq, xd, xs, n, acc1, off1, five);                    \
        }                                                                                     \
        if (b < nb) blk_q4_1(w, b, xq, xd, xs, n, acc0, off0, five);                          \
        ACC2_END                                                                              \
    }

DOT_OFFSET_TYPE(dot_q4_0_n, 18, 0)
DOT_OFFSET_TYPE(dot_q5_0_n, 22, 1)
DOT_MIN_TYPE(dot_q4_1_n, 20, 0)
DOT_MIN_TYPE(dot_q5_1_n, 24, 1)

/* ---- K-quants against Q8_K activations (one scale per 256), integer per superblock --------
 * Each sub-block's 8 int32 lanes are scaled by its 6-bit (Q4_K/Q5_K) or 8-bit (Q6_K) scale
 * and summed in int32 over the superblock; the minimums (Q4_K/Q5_K) or the -32 offset (Q6_K)
 * come from the 16-element sums xs16 (int16, (nsb, n, 16) interleaved): lane s of the 8 gets
 * sub-block s's (Q4_K/Q5_K) or the pair 2s, 2s + 1 of 16-element halves' (Q6_K) share, as
 * x86's vpmaddwd places them. Then two float ops per token per superblock. */

/* lanes i = 0..3 of a[2i] * b[2i] + a[2i+1] * b[2i+1] (int16 -> int32, as vpmaddwd) */
static inline int32x4_t madd16(int16x8_t a, int16x8_t b) {
    return vpaddq_s32(vmull_s16(vget_low_s16(a), vget_low_s16(b)), vmull_high_s16(a, b));
}

FORCE void dot_qk_int_n(const uint8_t *w, const int8_t *xq, const float *xd,
                        const int16_t *xs16, int nb, const int n, float *out, int64_t ldo,
                        const int five) {
    const int bytes = five ? 176 : 144, nsb = nb / 8;
    const uint8x16_t low4 = vdupq_n_u8(0x0F), one = vdupq_n_u8(1);
    acc8_t acc[MAXN];
    for (int t = 0; t < n; t++) acc[t][0] = acc[t][1] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nsb; sb++, w += bytes) {
        PREFETCH(w);
        const float d = f16(w), dmin = f16(w + 2);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        uint8_t sc[8], mn[8];
        scales_mins_k4(w + 4, sc, mn);
        /* each sub-block's min for both of its 16-element halves: (16,) int16 */
        const uint8x8_t m8 = vld1_u8(mn);
        const uint8x8x2_t mm = vzip_u8(m8, m8);
        const int16x8_t mins_a = vreinterpretq_s16_u16(vmovl_u8(mm.val[0]));
        const int16x8_t mins_b = vreinterpretq_s16_u16(vmovl_u8(mm.val[1]));
        uint8x16_t h0 = vdupq_n_u8(0), h1 = vdupq_n_u8(0);
        if (five) h0 = vld1q_u8(qh), h1 = vld1q_u8(qh + 16);
        int32x4_t isum[MAXN][2];
        for (int t = 0; t < n; t++) isum[t][0] = isum[t][1] = vdupq_n_s32(0);
        for (int j = 0; j < 4; j++) {
            const uint8x16_t r0 = vld1q_u8(qs + 32 * j), r1 = vld1q_u8(qs + 32 * j + 16);
            uint8x16_t lo0 = vandq_u8(r0, low4), lo1 = vandq_u8(r1, low4);
            uint8x16_t hi0 = vshrq_n_u8(r0, 4), hi1 = vshrq_n_u8(r1, 4);
            if (five) {  /* bit 2j of qh[l] -> element l, bit 2j+1 -> element 32 + l */
                lo0 = vorrq_u8(lo0, vshlq_n_u8(vandq_u8(h0, one), 4));
                lo1 = vorrq_u8(lo1, vshlq_n_u8(vandq_u8(h1, one), 4));
                hi0 = vorrq_u8(hi0, vshlq_n_u8(vandq_u8(vshrq_n_u8(h0, 1), one), 4));
                hi1 = vorrq_u8(hi1, vshlq_n_u8(vandq_u8(vshrq_n_u8(h1, 1), one), 4));
                h0 = vshrq_n_u8(h0, 2);
                h1 = vshrq_n_u8(h1, 2);
            }
            for (int half = 0; half < 2; half++) {
                const int b = sb * 8 + 2 * j + half;
                const int8x16_t q0 = vreinterpretq_s8_u8(half ? hi0 : lo0);
                const int8x16_t q1 = vreinterpretq_s8_u8(half ? hi1 : lo1);
                const int32_t s = sc[2 * j + half];
                for (int t = 0; t < n; t++) {
                    const int8_t *x = xq + 32 * ((int64_t)b * n + t);
                    isum[t][0] = vmlaq_n_s32(isum[t][0], dot16(q0, loadx(x)), s);
                    isum[t][1] = vmlaq_n_s32(isum[t][1], dot16(q1, loadx(x + 16)), s);
                }
            }
        }
        for (int t = 0; t < n; t++) {
            const float D = xd[(sb * 8) * n + t];
            const int16_t *xs = xs16 + 16 * ((int64_t)sb * n + t);
            const int32x4_t imin0 = madd16(vld1q_s16(xs), mins_a);
            const int32x4_t imin1 = madd16(vld1q_s16(xs + 8), mins_b);
            fma8(acc[t], isum[t][0], isum[t][1], d * D);
            const float32x4_t dm = vdupq_n_f32(dmin * D);
            acc[t][0] = vfmsq_f32(acc[t][0], vcvtq_f32_s32(imin0), dm);
            acc[t][1] = vfmsq_f32(acc[t][1], vcvtq_f32_s32(imin1), dm);
        }
    }
    for (int t = 0; t < n; t++) out[(int64_t)t * ldo] = hsum8(acc[t][0], acc[t][1]);
}

FORCE void dot_q6_k_int_n(const uint8_t *w, const int8_t *xq, const float *xd,
                          const int16_t *xs16, int nb, const int n, float *out, int64_t ldo) {
    const uint8x16_t low4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3), m12 = vdupq_n_u8(12);
    const uint8x16_t m30 = vdupq_n_u8(0x30);
    acc8_t acc[MAXN];
    for (int t = 0; t < n; t++) acc[t][0] = acc[t][1] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nb / 8; sb++, w += 210) {
        PREFETCH(w);
        const float d = f16(w + 208);
        const int8_t *scales = (const int8_t *)(w + 192);
        const int16x8_t sc_a = vmovl_s8(vld1_s8(scales)), sc_b = vmovl_s8(vld1_s8(scales + 8));
        int32x4_t isum[MAXN][2];
        for (int t = 0; t < n; t++) isum[t][0] = isum[t][1] = vdupq_n_s32(0);
        for (int h = 0; h < 2; h++) {
            uint8x16_t q[4][2];
            for (int e = 0; e < 2; e++) {  /* e: bytes 0-15, 16-31 of each 32 */
                const uint8x16_t qa = vld1q_u8(w + 64 * h + 16 * e);
                const uint8x16_t qb = vld1q_u8(w + 64 * h + 32 + 16 * e);
                const uint8x16_t hb = vld1q_u8(w + 128 + 32 * h + 16 * e);
                q[0][e] = vorrq_u8(vandq_u8(qa, low4), vshlq_n_u8(vandq_u8(hb, m3), 4));
                q[1][e] = vorrq_u8(vandq_u8(qb, low4), vshlq_n_u8(vandq_u8(hb, m12), 2));
                q[2][e] = vorrq_u8(vshrq_n_u8(qa, 4), vandq_u8(hb, m30));
                q[3][e] = vorrq_u8(vshrq_n_u8(qb, 4), vandq_u8(vshrq_n_u8(hb, 2), m30));
            }
            for (int k = 0; k < 4; k++) {
                const int b = sb * 8 + 4 * h + k;
                /* the scale of the block's first 16 (lanes 0-3) and of its second 16 (4-7) */
                const int32_t s0 = scales[8 * h + 2 * k], s1 = scales[8 * h + 2 * k + 1];
                const int8x16_t q0 = vreinterpretq_s8_u8(q[k][0]);
                const int8x16_t q1 = vreinterpretq_s8_u8(q[k][1]);
                for (int t = 0; t < n; t++) {
                    const int8_t *x = xq + 32 * ((int64_t)b * n + t);
                    isum[t][0] = vmlaq_n_s32(isum[t][0], dot16(q0, loadx(x)), s0);
                    isum[t][1] = vmlaq_n_s32(isum[t][1], dot16(q1, loadx(x + 16)), s1);
                }
            }
        }
        for (int t = 0; t < n; t++) {
            const float D = xd[(sb * 8) * n + t];
            const int16_t *xs = xs16 + 16 * ((int64_t)sb * n + t);
            const int32x4_t off0 = vshlq_n_s32(madd16(vld1q_s16(xs), sc_a), 5);  /* 32 * sum */
            const int32x4_t off1 = vshlq_n_s32(madd16(vld1q_s16(xs + 8), sc_b), 5);
            fma8(acc[t], vsubq_s32(isum[t][0], off0), vsubq_s32(isum[t][1], off1), d * D);
        }
    }
    for (int t = 0; t < n; t++) out[(int64_t)t * ldo] = hsum8(acc[t][0], acc[t][1]);
}

FORCE void dot_q4_k_int_n(const uint8_t *w, const int8_t *xq, const float *xd,
                          const int16_t *xs16, int nb, const int n, float *out, int64_t ldo) {
    dot_qk_int_n(w, xq, xd, xs16, nb, n, out, ldo, 0);
}

FORCE void dot_q5_k_int_n(const uint8_t *w, const int8_t *xq, const float *xd,
                          const int16_t *xs16, int nb, const int n, float *out, int64_t ldo) {
    dot_qk_int_n(w, xq, xd, xs16, nb, n, out, ldo, 1);
}

/* One signature for every type: xs (int32 sums of 16) for the per-block types, xs16 (int16,
 * per superblock) for the K-quants; each dot takes the one it needs. */
typedef void (*dot_fn)(const uint8_t *, const int8_t *, const float *, const int32_t *,
                       const int16_t *, int, int, float *, int64_t);

#define DISPATCH_N(call)                                                                      \
    switch (n) {                                                                              \
    case 1: call(1); break;                                                                   \
    case 2: call(2); break;                                                                   \
    case 3: call(3); break;                                                                   \
    case 4: call(4); break;                                                                   \
    case 5: call(5); break;                                                                   \
    case 6: call(6); break;                                                                   \
    case 7: call(7); break;                                                                   \
    default: call(8); break;                                                                  \
    }

#define DISPATCH(name)                                                                        \
    static void name(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,  \
                     const int16_t *xs16, int nb, int n, float *out, int64_t ldo) {           \
        (void)xs16;                                                                           \
        DISPATCH_N(name##_CALL)                                                               \
    }
#define DISPATCHK(name)                                                                       \
    static void name(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,  \
                     const int16_t *xs16, int nb, int n, float *out, int64_t ldo) {           \
        (void)xs;                                                                             \
        DISPATCH_N(name##_CALL)                                                               \
    }

#define dot_q8_0_CALL(k) dot_q8_0_n(w, xq, xd, xs, nb, k, out, ldo)
#define dot_q4_0_CALL(k) dot_q4_0_n(w, xq, xd, xs, nb, k, out, ldo)
#define dot_q4_1_CALL(k) dot_q4_1_n(w, xq, xd, xs, nb, k, out, ldo)
#define dot_q5_0_CALL(k) dot_q5_0_n(w, xq, xd, xs, nb, k, out, ldo)
#define dot_q5_1_CALL(k) dot_q5_1_n(w, xq, xd, xs, nb, k, out, ldo)
#define dot_q4_k_CALL(k) dot_q4_k_int_n(w, xq, xd, xs16, nb, k, out, ldo)
#define dot_q5_k_CALL(k) dot_q5_k_int_n(w, xq, xd, xs16, nb, k, out, ldo)
#define dot_q6_k_CALL(k) dot_q6_k_int_n(w, xq, xd, xs16, nb, k, out, ldo)

DISPATCH(dot_q8_0)
DISPATCH(dot_q4_0)
DISPATCH(dot_q4_1)
DISPATCH(dot_q5_0)
DISPATCH(dot_q5_1)
DISPATCHK(dot_q4_k)
DISPATCHK(dot_q5_k)
DISPATCHK(dot_q6_k)

static dot_fn dot_for(int qtype) {
    switch (qtype) {
    case T_Q8_0: return dot_q8_0;
    case T_Q4_0: return dot_q4_0;
    case T_Q4_1: return dot_q4_1;
    case T_Q5_0: return dot_q5_0;
    case T_Q5_1: return dot_q5_1;
    case T_Q4_K: return dot_q4_k;
    case T_Q5_K: return dot_q5_k;
    case T_Q6_K: return dot_q6_k;
    default: return 0;
    }
}

static int is_kquant(int qtype) {
    return qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K;
}

int ek_supports(int qtype) { return dot_for(qtype) != 0; }

/* ---- i8mm (smmla): two weight rows x two tokens per instruction ----------------------------
 * Built where the compiler targets FEAT_I8MM (-march=armv8.6-a+i8mm: Apple M2 and later,
 * Snapdragon X, Graviton 3, Cortex-A710/X2 and later). vmmlaq_s32 multiplies a 2x8 int8 matrix
 * (8 bytes of two rows) by the transpose of another (8 bytes of two tokens) into 4 int32 lanes
 * [r0.t0, r0.t1, r1.t0, r1.t1], twice the multiply-adds of one sdot; four of them give the
 * whole 32-element block dot of each row with each token. Its lanes are whole-block sums, not
 * x86's 4-byte lanes, so this variant has its own float order and is NOT bit-identical to the
 * x86 build (or to the dotprod one): per block and per (row, token), acc += cvt(dot) * (d_r *
 * xd_t), even and odd blocks in two accumulators, summed at the end; K-quants sum each
 * superblock in int32 and meet floats twice per superblock, as elsewhere. Every token, a lone
 * one too (paired with a zero token), takes this same arithmetic, and a lane depends only on
 * its own row and token: results stay bit-identical alone or in a batch, and with either row
 * partner. Activations come pair-interleaved: token slots 2p, 2p + 1 of a group share 64
 * bytes per block, [t0 0-7, t1 0-7, t0 8-15, t1 8-15, t0 16-23, t1 16-23, t0 24-31, t1 24-31]
 * (smmla's B operands), a group of odd length padded with a zero token. */
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define PAIRS 1
#define MAXP (MAXN / 2)

/* two rows' 32 elements (lo: 0-15, hi: 16-31) as smmla's four 2x8 A operands */
FORCE void pair_rows(int8x16_t lo0, int8x16_t hi0, int8x16_t lo1, int8x16_t hi1, int8x16_t a[4]) {
    const int64x2_t l0 = vreinterpretq_s64_s8(lo0), l1 = vreinterpretq_s64_s8(lo1);
    const int64x2_t h0 = vreinterpretq_s64_s8(hi0), h1 = vreinterpretq_s64_s8(hi1);
    a[0] = vreinterpretq_s8_s64(vzip1q_s64(l0, l1));
    a[1] = vreinterpretq_s8_s64(vzip2q_s64(l0, l1));
    a[2] = vreinterpretq_s8_s64(vzip1q_s64(h0, h1));
    a[3] = vreinterpretq_s8_s64(vzip2q_s64(h0, h1));
}

/* [r0.t0, r0.t1, r1.t0, r1.t1] over elements 0-15 (a[0], a[1]) of a pair block x (64 bytes) */
FORCE int32x4_t mm_first16(const int8x16_t a[4], const int8_t *x) {
    return vmmlaq_s32(vmmlaq_s32(vdupq_n_s32(0), a[0], vld1q_s8(x)), a[1], vld1q_s8(x + 16));
}

FORCE int32x4_t mm_second16(const int8x16_t a[4], const int8_t *x) {
    return vmmlaq_s32(vmmlaq_s32(vdupq_n_s32(0), a[2], vld1q_s8(x + 32)), a[3], vld1q_s8(x + 48));
}

FORCE int32x4_t mm_block(const int8x16_t a[4], const int8_t *x) {
    return vmmlaq_s32(vmmlaq_s32(mm_first16(a, x), a[2], vld1q_s8(x + 32)), a[3], vld1q_s8(x + 48));
}

/* [v0, v0, v1, v1] */
static inline float32x4_t rows_f(float v0, float v1) {
    return vcombine_f32(vdup_n_f32(v0), vdup_n_f32(v1));
}

static inline int32x4_t rows_i(int32_t v0, int32_t v1) {
    return vcombine_s32(vdup_n_s32(v0), vdup_n_s32(v1));
}

/* one row's block of a per-block type as int8 (elements 0-15, 16-31), its scale and min */
enum { K_Q8_0, K_Q4_0, K_Q5_0, K_Q4_1, K_Q5_1 };

FORCE void unpack_block(const uint8_t *w, const int kind, int8x16_t *lo, int8x16_t *hi,
                        float *d, float *m) {
    *d = f16(w);
    *m = 0.0f;
    if (kind == K_Q8_0) {
        *lo = vld1q_s8((const int8_t *)w + 2);
        *hi = vld1q_s8((const int8_t *)w + 18);
        return;
    }
    const int has_min = kind == K_Q4_1 || kind == K_Q5_1, five = kind == K_Q5_0 || kind == K_Q5_1;
    if (has_min) *m = f16(w + 2);
    const uint8_t *p = w + 2 + 2 * has_min;  /* qh (Q5) or qs */
    const uint8x16_t raw = vld1q_u8(p + 4 * five);
    uint8x16_t l = vandq_u8(raw, vdupq_n_u8(0x0F)), h = vshrq_n_u8(raw, 4);
    if (five) {
        uint32_t qh;
        memcpy(&qh, p, 4);
        l = vorrq_u8(l, bits_to_0x10(qh));
        h = vorrq_u8(h, bits_to_0x10(qh >> 16));
    }
    *lo = vreinterpretq_s8_u8(l);
    *hi = vreinterpretq_s8_u8(h);
}

/* block b of rows w0, w1 against token pairs 0..np-1 (slots 2np); acc/off [r0t0 r0t1 r1t0 r1t1] */
FORCE void blk2(const uint8_t *w0, const uint8_t *w1, int b, const int8_t *xq, const float *xd,
                const int32_t *xs, const int np, const int kind, float32x4_t *acc,
                float32x4_t *off) {
    int8x16_t lo0, hi0, lo1, hi1, a[4];
    float d0, m0, d1, m1;
    unpack_block(w0, kind, &lo0, &hi0, &d0, &m0);
    unpack_block(w1, kind, &lo1, &hi1, &d1, &m1);
    pair_rows(lo0, hi0, lo1, hi1, a);
    const float32x4_t dv = rows_f(d0, d1), mv = rows_f(m0, m1);
    const int offset = kind == K_Q4_0 ? 8 : kind == K_Q5_0 ? 16 : 0;
    const int has_min = kind == K_Q4_1 || kind == K_Q5_1;
    for (int p = 0; p < np; p++) {
        const int64_t bt = (int64_t)b * 2 * np + 2 * p;  /* slot of the pair's first token */
        int32x4_t c = mm_block(a, xq + 32 * bt);
        const float32x2_t x2 = vld1_f32(xd + bt);
        const float32x4_t xdv = vcombine_f32(x2, x2);
        if (offset || has_min) {
            const int32_t s0 = xs[2 * bt] + xs[2 * bt + 1], s1 = xs[2 * bt + 2] + xs[2 * bt + 3];
            const int32x2_t s2 = vset_lane_s32(s1, vdup_n_s32(s0), 1);
            const int32x4_t sv = vcombine_s32(s2, s2);
            if (offset) c = vsubq_s32(c, vmulq_n_s32(sv, offset));
            else off[p] = vfmaq_f32(off[p], vmulq_f32(mv, xdv), vcvtq_f32_s32(sv));
        }
        acc[p] = vfmaq_f32(acc[p], vcvtq_f32_s32(c), vmulq_f32(dv, xdv));
    }
}

/* the 4 lanes of each pair into out0 (row 0) and out1 (row 1), tokens < m only */
FORCE void store_pairs(const float32x4_t *res, int np, int m, float *out0, float *out1,
                       int64_t ldo) {
    for (int p = 0; p < np; p++) {
        float v[4];
        vst1q_f32(v, res[p]);
        out0[(int64_t)(2 * p) * ldo] = v[0];
        out1[(int64_t)(2 * p) * ldo] = v[2];
        if (2 * p + 1 < m) {
            out0[(int64_t)(2 * p + 1) * ldo] = v[1];
            out1[(int64_t)(2 * p + 1) * ldo] = v[3];
        }
    }
}

FORCE void dot2_blocks_n(const uint8_t *w0, const uint8_t *w1, const int8_t *xq,
                         const float *xd, const int32_t *xs, int nb, const int np, int m,
                         float *out0, float *out1, int64_t ldo, const int kind, const int bytes) {
    float32x4_t acc0[MAXP], acc1[MAXP], off0[MAXP], off1[MAXP];
    for (int p = 0; p < np; p++)
        acc0[p] = acc1[p] = off0[p] = off1[p] = vdupq_n_f32(0.0f);
    int b = 0;
    for (; b + 1 < nb; b += 2, w0 += 2 * bytes, w1 += 2 * bytes) {
        PREFETCH(w0);
        PREFETCH(w1);
        blk2(w0, w1, b, xq, xd, xs, np, kind, acc0, off0);
        blk2(w0 + bytes, w1 + bytes, b + 1, xq, xd, xs, np, kind, acc1, off1);
    }
    if (b < nb) blk2(w0, w1, b, xq, xd, xs, np, kind, acc0, off0);
    float32x4_t res[MAXP];
    for (int p = 0; p < np; p++)
        res[p] = vaddq_f32(vaddq_f32(acc0[p], acc1[p]), vaddq_f32(off0[p], off1[p]));
    store_pairs(res, np, m, out0, out1, ldo);
}

/* sum over i of a[i] * b[i] for 8 int16 (exact in int32) */
static inline int32_t dot_s16x8(int16x8_t a, int16x8_t b) {
    return vaddvq_s32(vaddq_s32(vmull_s16(vget_low_s16(a), vget_low_s16(b)), vmull_high_s16(a, b)));
}

/* one Q4_K/Q5_K row's sub-blocks 2j (lo: elements 0-15, 16-31) and 2j+1 (hi) as int8 */
FORCE void unpack_qk_pair(const uint8_t *qs, uint8x16_t *h, int j, const int five,
                          int8x16_t q[2][2]) {
    const uint8x16_t low4 = vdupq_n_u8(0x0F), one = vdupq_n_u8(1);
    for (int e = 0; e < 2; e++) {
        const uint8x16_t r = vld1q_u8(qs + 32 * j + 16 * e);
        uint8x16_t lo = vandq_u8(r, low4), hi = vshrq_n_u8(r, 4);
        if (five) {
            lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(h[e], one), 4));
            hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(vshrq_n_u8(h[e], 1), one), 4));
            h[e] = vshrq_n_u8(h[e], 2);
        }
        q[0][e] = vreinterpretq_s8_u8(lo);
        q[1][e] = vreinterpretq_s8_u8(hi);
    }
}

FORCE void dot2_qk_n(const uint8_t *w0, const uint8_t *w1, const int8_t *xq, const float *xd,
                     const int16_t *xs16, int nb, const int np, int m, float *out0, float *out1,
                     int64_t ldo, const int five) {
    const int bytes = five ? 176 : 144, mp = 2 * np;
    float32x4_t acc[MAXP];
    for (int p = 0; p < np; p++) acc[p] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nb / 8; sb++, w0 += bytes, w1 += bytes) {
        PREFETCH(w0);
        PREFETCH(w1);
        uint8_t sc[2][8], mn[2][8];
        scales_mins_k4(w0 + 4, sc[0], mn[0]);
        scales_mins_k4(w1 + 4, sc[1], mn[1]);
        uint8x16_t h0[2] = {vdupq_n_u8(0), vdupq_n_u8(0)}, h1[2] = {vdupq_n_u8(0), vdupq_n_u8(0)};
        if (five) {
            h0[0] = vld1q_u8(w0 + 16), h0[1] = vld1q_u8(w0 + 32);
            h1[0] = vld1q_u8(w1 + 16), h1[1] = vld1q_u8(w1 + 32);
        }
        const uint8_t *qs0 = w0 + (five ? 48 : 16), *qs1 = w1 + (five ? 48 : 16);
        int32x4_t isum[MAXP];
        for (int p = 0; p < np; p++) isum[p] = vdupq_n_s32(0);
        for (int j = 0; j < 4; j++) {
            int8x16_t q0[2][2], q1[2][2], a[4];
            unpack_qk_pair(qs0, h0, j, five, q0);
            unpack_qk_pair(qs1, h1, j, five, q1);
            for (int half = 0; half < 2; half++) {
                const int s = 2 * j + half, b = sb * 8 + s;
                pair_rows(q0[half][0], q0[half][1], q1[half][0], q1[half][1], a);
                const int32x4_t scv = rows_i(sc[0][s], sc[1][s]);
                for (int p = 0; p < np; p++)
                    isum[p] = vmlaq_s32(isum[p], mm_block(a, xq + 32 * ((int64_t)b * mp + 2 * p)),
                                        scv);
            }
        }
        const int16x8_t mins0 = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mn[0])));
        const int16x8_t mins1 = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mn[1])));
        const float d0 = f16(w0), dmin0 = f16(w0 + 2), d1 = f16(w1), dmin1 = f16(w1 + 2);
        const float32x4_t dv = rows_f(d0, d1), dminv = rows_f(dmin0, dmin1);
        for (int p = 0; p < np; p++) {
            const int64_t t0 = (int64_t)sb * mp + 2 * p;
            const int16_t *xa = xs16 + 16 * t0, *xb = xa + 16;
            /* each token's 8 sub-block sums (two halves of 16 added) */
            const int16x8_t sa = vpaddq_s16(vld1q_s16(xa), vld1q_s16(xa + 8));
            const int16x8_t sbv = vpaddq_s16(vld1q_s16(xb), vld1q_s16(xb + 8));
            const int32_t i00 = dot_s16x8(mins0, sa), i01 = dot_s16x8(mins0, sbv);
            const int32_t i10 = dot_s16x8(mins1, sa), i11 = dot_s16x8(mins1, sbv);
            const int32_t lanes[4] = {i00, i01, i10, i11};
            const int32x4_t imin = vld1q_s32(lanes);
            const float32x2_t D2 = vld1_f32(xd + (int64_t)(sb * 8) * mp + 2 * p);
            const float32x4_t Dv = vcombine_f32(D2, D2);
            acc[p] = vfmaq_f32(acc[p], vcvtq_f32_s32(isum[p]), vmulq_f32(dv, Dv));
            acc[p] = vfmsq_f32(acc[p], vcvtq_f32_s32(imin), vmulq_f32(dminv, Dv));
        }
    }
    store_pairs(acc, np, m, out0, out1, ldo);
}

/* one Q6_K row's half h as q[k][e]: block 4h + k, bytes 16e..16e+15 (unsigned 0..63) */
FORCE void unpack_q6_half(const uint8_t *w, int h, int8x16_t q[4][2]) {
    const uint8x16_t low4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3), m12 = vdupq_n_u8(12);
    const uint8x16_t m30 = vdupq_n_u8(0x30);
    for (int e = 0; e < 2; e++) {
        const uint8x16_t qa = vld1q_u8(w + 64 * h + 16 * e);
        const uint8x16_t qb = vld1q_u8(w + 64 * h + 32 + 16 * e);
        const uint8x16_t hb = vld1q_u8(w + 128 + 32 * h + 16 * e);
        q[0][e] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(qa, low4), vshlq_n_u8(vandq_u8(hb, m3), 4)));
        q[1][e] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(qb, low4), vshlq_n_u8(vandq_u8(hb, m12), 2)));
        q[2][e] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(qa, 4), vandq_u8(hb, m30)));
        q[3][e] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(qb, 4), vandq_u8(vshrq_n_u8(hb, 2), m30)));
    }
}

FORCE void dot2_q6_k_n(const uint8_t *w0, const uint8_t *w1, const int8_t *xq, const float *xd,
                       const int16_t *xs16, int nb, const int np, int m, float *out0,
                       float *out1, int64_t ldo) {
    const int mp = 2 * np;
    float32x4_t acc[MAXP];
    for (int p = 0; p < np; p++) acc[p] = vdupq_n_f32(0.0f);
    for (int sb = 0; sb < nb / 8; sb++, w0 += 210, w1 += 210) {
        PREFETCH(w0);
        PREFETCH(w1);
        const int8_t *sc0 = (const int8_t *)(w0 + 192), *sc1 = (const int8_t *)(w1 + 192);
        int32x4_t isum[MAXP];
        for (int p = 0; p < np; p++) isum[p] = vdupq_n_s32(0);
        for (int h = 0; h < 2; h++) {
            int8x16_t q0[4][2], q1[4][2], a[4];
            unpack_q6_half(w0, h, q0);
            unpack_q6_half(w1, h, q1);
            for (int k = 0; k < 4; k++) {
                const int b = sb * 8 + 4 * h + k, s = 8 * h + 2 * k;
                pair_rows(q0[k][0], q0[k][1], q1[k][0], q1[k][1], a);
                const int32x4_t first = rows_i(sc0[s], sc1[s]), second = rows_i(sc0[s + 1], sc1[s + 1]);
                for (int p = 0; p < np; p++) {
                    const int8_t *x = xq + 32 * ((int64_t)b * mp + 2 * p);
                    isum[p] = vmlaq_s32(vmlaq_s32(isum[p], mm_first16(a, x), first),
                                        mm_second16(a, x), second);
                }
            }
        }
        const int16x8_t s0a = vmovl_s8(vld1_s8(sc0)), s0b = vmovl_s8(vld1_s8(sc0 + 8));
        const int16x8_t s1a = vmovl_s8(vld1_s8(sc1)), s1b = vmovl_s8(vld1_s8(sc1 + 8));
        const float32x4_t dv = rows_f(f16(w0 + 208), f16(w1 + 208));
        for (int p = 0; p < np; p++) {
            const int64_t t0 = (int64_t)sb * mp + 2 * p;
            const int16_t *xa = xs16 + 16 * t0, *xb = xa + 16;
            const int16x8_t xa0 = vld1q_s16(xa), xa1 = vld1q_s16(xa + 8);
            const int16x8_t xb0 = vld1q_s16(xb), xb1 = vld1q_s16(xb + 8);
            /* the -32 offset: 32 * sum over the 16 halves of scale * sum of 16 */
            const int32_t lanes[4] = {dot_s16x8(s0a, xa0) + dot_s16x8(s0b, xa1),
                                      dot_s16x8(s0a, xb0) + dot_s16x8(s0b, xb1),
                                      dot_s16x8(s1a, xa0) + dot_s16x8(s1b, xa1),
                                      dot_s16x8(s1a, xb0) + dot_s16x8(s1b, xb1)};
            const int32x4_t tot = vsubq_s32(isum[p], vshlq_n_s32(vld1q_s32(lanes), 5));
            const float32x2_t D2 = vld1_f32(xd + (int64_t)(sb * 8) * mp + 2 * p);
            acc[p] = vfmaq_f32(acc[p], vcvtq_f32_s32(tot), vmulq_f32(dv, vcombine_f32(D2, D2)));
        }
    }
    store_pairs(acc, np, m, out0, out1, ldo);
}

/* rows w0, w1 (w1 may be w0 again) against a group of m tokens (pair-interleaved, 2np slots) */
typedef void (*dot2_fn)(const uint8_t *, const uint8_t *, const int8_t *, const float *,
                        const int32_t *, const int16_t *, int, int, float *, float *, int64_t);

#define DISPATCH_P(call)                                                                      \
    switch ((m + 1) / 2) {                                                                    \
    case 1: call(1); break;                                                                   \
    case 2: call(2); break;                                                                   \
    case 3: call(3); break;                                                                   \
    default: call(4); break;                                                                  \
    }

#define DOT2(name, callp)                                                                     \
    static void name(const uint8_t *w0, const uint8_t *w1, const int8_t *xq, const float *xd, \
                     const int32_t *xs, const int16_t *xs16, int nb, int m, float *out0,      \
                     float *out1, int64_t ldo) {                                              \
        (void)xs; (void)xs16;                                                                 \
        DISPATCH_P(callp)                                                                     \
    }

#define Q8_0_P(k) dot2_blocks_n(w0, w1, xq, xd, xs, nb, k, m, out0, out1, ldo, K_Q8_0, 34)
#define Q4_0_P(k) dot2_blocks_n(w0, w1, xq, xd, xs, nb, k, m, out0, out1, ldo, K_Q4_0, 18)
#define Q5_0_P(k) dot2_blocks_n(w0, w1, xq, xd, xs, nb, k, m, out0, out1, ldo, K_Q5_0, 22)
#define Q4_1_P(k) dot2_blocks_n(w0, w1, xq, xd, xs, nb, k, m, out0, out1, ldo, K_Q4_1, 20)
#define Q5_1_P(k) dot2_blocks_n(w0, w1, xq, xd, xs, nb, k, m, out0, out1, ldo, K_Q5_1, 24)
#define Q4_K_P(k) dot2_qk_n(w0, w1, xq, xd, xs16, nb, k, m, out0, out1, ldo, 0)
#define Q5_K_P(k) dot2_qk_n(w0, w1, xq, xd, xs16, nb, k, m, out0, out1, ldo, 1)
#define Q6_K_P(k) dot2_q6_k_n(w0, w1, xq, xd, xs16, nb, k, m, out0, out1, ldo)

DOT2(dot2_q8_0, Q8_0_P)
DOT2(dot2_q4_0, Q4_0_P)
DOT2(dot2_q5_0, Q5_0_P)
DOT2(dot2_q4_1, Q4_1_P)
DOT2(dot2_q5_1, Q5_1_P)
DOT2(dot2_q4_k, Q4_K_P)
DOT2(dot2_q5_k, Q5_K_P)
DOT2(dot2_q6_k, Q6_K_P)

static dot2_fn dot2_for(int qtype) {
    switch (qtype) {
    case T_Q8_0: return dot2_q8_0;
    case T_Q4_0: return dot2_q4_0;
    case T_Q4_1: return dot2_q4_1;
    case T_Q5_0: return dot2_q5_0;
    case T_Q5_1: return dot2_q5_1;
    case T_Q4_K: return dot2_q4_k;
    case T_Q5_K: return dot2_q5_k;
    case T_Q6_K: return dot2_q6_k;
    default: return 0;
    }
}
#else
#define PAIRS 0
#endif

/* ---- activation rounding: the x86 build's, bit for bit ------------------------------------ */

/* x (n, cols) f32 -> xq (n, cols) int8, xd (n, cols/32), xs (n, cols/16) as ggml's x86
 * quantize_row_q8_0: q = round-half-even(x * (127 / amax)), d = amax / 127 kept as f16. */
static void quantize_rows(const float *x, int n, int cols, int8_t *xq, float *xd, int32_t *xs) {
    for (int t = 0; t < n; t++) {
        for (int b = 0; b < cols / 32; b++) {
            const float *v = x + (int64_t)t * cols + 32 * b;
            int8_t *q = xq + (int64_t)t * cols + 32 * b;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int s0 = 0, s1 = 0;
            for (int i = 0; i < 16; i++) {
                const int a = (int)nearbyintf(v[i] * inv), c = (int)nearbyintf(v[i + 16] * inv);
                q[i] = (int8_t)a;
                q[i + 16] = (int8_t)c;
                s0 += a;
                s1 += c;
            }
            xd[(int64_t)t * (cols / 32) + b] = f16_round(d);
            xs[(int64_t)t * (cols / 16) + 2 * b] = s0;
            xs[(int64_t)t * (cols / 16) + 2 * b + 1] = s1;
        }
    }
}

/* As ggml's Q8_K (against K-quant weights): per 256, iscale = -127 / peak (the signed value of
 * largest magnitude), q = min(127, round(iscale * x)), d = 1 / iscale for all 8 sub-blocks. */
static void quantize_rows_q8k(const float *x, int n, int cols, int8_t *xq, float *xd, int32_t *xs) {
    for (int t = 0; t < n; t++) {
        for (int b = 0; b < cols / 256; b++) {
            const float *v = x + (int64_t)t * cols + 256 * b;
            int8_t *q = xq + (int64_t)t * cols + 256 * b;
            float amax = 0.0f, peak = 0.0f;
            for (int i = 0; i < 256; i++) {
                if (fabsf(v[i]) > amax) { amax = fabsf(v[i]); peak = v[i]; }
            }
            const float iscale = amax > 0.0f ? -127.0f / peak : 0.0f;
            const float d = amax > 0.0f ? 1.0f / iscale : 0.0f;
            for (int i = 0; i < 256; i++) {
                const int a = (int)nearbyintf(iscale * v[i]);
                q[i] = (int8_t)(a > 127 ? 127 : a);
            }
            for (int s = 0; s < 8; s++) {
                int s0 = 0, s1 = 0;
                for (int i = 0; i < 16; i++) {
                    s0 += q[32 * s + i];
                    s1 += q[32 * s + 16 + i];
                }
                xd[(int64_t)t * (cols / 32) + 8 * b + s] = d;
                xs[(int64_t)t * (cols / 16) + 16 * b + 2 * s] = s0;
                xs[(int64_t)t * (cols / 16) + 16 * b + 2 * s + 1] = s1;
            }
        }
    }
}

/* ---- token groups, rows outer ------------------------------------------------------------- */

/* Tokens t0 .. t0 + m - 1 of xq (n, cols), xd (n, nb), xs (n, 2 nb) into the interleaved
 * layout: xqi (nb, ms, 32), xdi (nb, ms), xsi (nb, ms, 2), and for Q8_K activations (kq)
 * xs16i (nb / 8, ms, 16) int16, with ms = m token slots, or with i8mm (PAIRS) m rounded up to
 * even, the pad slot zeros, and each pair's 64 bytes of a block interleaved by 8 (smmla's
 * operands). */
static void interleave(const int8_t *xq, const float *xd, const int32_t *xs, int cols, int t0,
                       int m, int kq, int8_t *xqi, float *xdi, int32_t *xsi, int16_t *xs16i) {
    const int nb = cols / 32, ms = PAIRS ? m + (m & 1) : m;
    for (int t = 0; t < ms; t++) {
        const int pad = t >= m;
        const int8_t *q = xq + (int64_t)(t0 + t) * cols;
        const float *d = xd + (int64_t)(t0 + t) * nb;
        const int32_t *s = xs + (int64_t)(t0 + t) * 2 * nb;
        for (int b = 0; b < nb; b++) {
            int8_t *dst = xqi + 32 * ((int64_t)b * ms + t);
            if (PAIRS) {  /* this token's 8-byte pieces at 16k + 8 (t odd) within its pair */
                dst = xqi + 32 * ((int64_t)b * ms + (t & ~1)) + 8 * (t & 1);
                for (int k = 0; k < 4; k++) {
                    if (pad) memset(dst + 16 * k, 0, 8);
                    else memcpy(dst + 16 * k, q + 32 * b + 8 * k, 8);
                }
            } else {
                memcpy(dst, q + 32 * b, 32);
            }
            xdi[(int64_t)b * ms + t] = pad ? 0.0f : d[b];
            xsi[2 * ((int64_t)b * ms + t)] = pad ? 0 : s[2 * b];
            xsi[2 * ((int64_t)b * ms + t) + 1] = pad ? 0 : s[2 * b + 1];
        }
        if (kq)
            for (int sb = 0; sb < nb / 8; sb++)
                for (int i = 0; i < 16; i++)
                    xs16i[16 * ((int64_t)sb * ms + t) + i] = pad ? 0 : (int16_t)s[16 * sb + i];
    }
}

/* n tokens interleaved group by group, MAXN tokens to a group (the last may be short) */
typedef struct {
    int n, cols, ngroups;
    int8_t *xqi;
    float *xdi;
    int32_t *xsi;
    int16_t *xs16i;
} groups_t;

static void groups_free(groups_t *g) {
    free(g->xqi);
    free(g->xdi);
    free(g->xsi);
    free(g->xs16i);
}

static int groups_init(groups_t *g, const int8_t *xq, const float *xd, const int32_t *xs, int n,
                       int cols, int kq) {
    const int nb = cols / 32;
    g->n = n;
    g->cols = cols;
    g->ngroups = (n + MAXN - 1) / MAXN;
    const int slots = n + 1;  /* with i8mm, a last group of odd length gets a pad slot */
    g->xqi = malloc((size_t)slots * cols);
    g->xdi = malloc(sizeof(float) * slots * nb);
    g->xsi = malloc(sizeof(int32_t) * slots * 2 * nb);
    g->xs16i = malloc(sizeof(int16_t) * slots * 2 * nb);
    if (!g->xqi || !g->xdi || !g->xsi || !g->xs16i) return 0;
    for (int t0 = 0; t0 < n; t0 += MAXN) {
        const int m = n - t0 < MAXN ? n - t0 : MAXN;
        interleave(xq, xd, xs, cols, t0, m, kq, g->xqi + (int64_t)t0 * cols,
                   g->xdi + (int64_t)t0 * nb, g->xsi + (int64_t)t0 * 2 * nb,
                   g->xs16i + (int64_t)t0 * 2 * nb);
    }
    return 1;
}

typedef struct {
    dot_fn dot;  /* the kernel of the type (or, with i8mm, dot2 below) */
#if PAIRS
    dot2_fn dot2;
#endif
    const uint8_t *w;
    int64_t row_bytes;
    const groups_t *groups;
    float *out;
    int64_t ldo;
} matvec_job_t;

/* Rows [r0, r1) against every token group, out[t * ldo + r]: rows outer, groups inner, so a
 * chunk's weight blocks stay in L1 while all the tokens pass over them. */
static void matvec_rows(const void *ctx, int r0, int r1) {
    const matvec_job_t *j = ctx;
    const groups_t *g = j->groups;
    const int nb = g->cols / 32;
    for (int gi = 0; gi < g->ngroups; gi++) {
        const int64_t t0 = (int64_t)gi * MAXN;
        const int m = g->n - t0 < MAXN ? (int)(g->n - t0) : MAXN;
#if PAIRS
        for (int r = r0; r < r1; r += 2) {  /* rows in pairs, a last odd row with itself */
            const int r2 = r + 1 < r1 ? r + 1 : r;
            j->dot2(j->w + (int64_t)r * j->row_bytes, j->w + (int64_t)r2 * j->row_bytes,
                    g->xqi + t0 * g->cols, g->xdi + t0 * nb, g->xsi + t0 * 2 * nb,
                    g->xs16i + t0 * 2 * nb, nb, m, j->out + t0 * j->ldo + r,
                    j->out + t0 * j->ldo + r2, j->ldo);
        }
#else
        for (int r = r0; r < r1; r++)
            j->dot(j->w + (int64_t)r * j->row_bytes, g->xqi + t0 * g->cols, g->xdi + t0 * nb,
                   g->xsi + t0 * 2 * nb, g->xs16i + t0 * 2 * nb, nb, m,
                   j->out + t0 * j->ldo + r, j->ldo);
#endif
    }
}

/* the job of one matrix: its kernel(s), its rows, the token groups, where results go */
static matvec_job_t matvec_job(int qtype, const uint8_t *w, int64_t row_bytes,
                               const groups_t *g, float *out, int64_t ldo) {
    matvec_job_t j;
    memset(&j, 0, sizeof j);
    j.dot = dot_for(qtype);
#if PAIRS
    j.dot2 = dot2_for(qtype);
#endif
    j.w = w;
    j.row_bytes = row_bytes;
    j.groups = g;
    j.out = out;
    j.ldo = ldo;
    return j;
}

/* the activations of x (n, cols) rounded for qtype (Q8_K for K-quants, else Q8_0) */
typedef struct {
    int8_t *xq;   /* (n, cols) */
    float *xd;    /* (n, cols / 32) */
    int32_t *xs;  /* (n, cols / 16): sums of 16 */
} acts8_t;

static void acts8_free(acts8_t *a) {
    free(a->xq);
    free(a->xd);
    free(a->xs);
}

static int acts8_alloc(acts8_t *a, int n, int cols) {
    a->xq = malloc((size_t)n * cols);
    a->xd = malloc(sizeof(float) * n * (cols / 32));
    a->xs = malloc(sizeof(int32_t) * n * (cols / 16));
    if (a->xq && a->xd && a->xs) return 1;
    acts8_free(a);
    return 0;
}

static void acts8_round(acts8_t *a, int kq, const float *x, int n, int cols) {
    if (kq) quantize_rows_q8k(x, n, cols, a->xq, a->xd, a->xs);
    else quantize_rows(x, n, cols, a->xq, a->xd, a->xs);
}

/* out (n, rows) = w (rows, cols) . x (n, cols)^T with int8 activations; gemm_min is unused
 * here (no GEMM on ARM yet: every n runs the mat-vec kernels in groups of MAXN tokens).
 * Returns 0, -1 without memory, -2 for a type without kernels or a shape it does not take. */
int ek_matmul_f32(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
                  const float *x, int n, float *out, int nthreads, int gemm_min) {
    (void)gemm_min;
    const int kq = is_kquant(qtype);
    if (!ek_supports(qtype) || cols % 32 || (kq && cols % 256) || n < 1) return -2;
    acts8_t a;
    if (!acts8_alloc(&a, n, cols)) return -1;
    acts8_round(&a, kq, x, n, cols);
    groups_t g;
    int status = -1;
    if (groups_init(&g, a.xq, a.xd, a.xs, n, cols, kq)) {
        matvec_job_t j = matvec_job(qtype, w, row_bytes, &g, out, rows);
        parallel_matvec(matvec_rows, &j, rows, nthreads, n);
        status = 0;
    }
    groups_free(&g);
    acts8_free(&a);
    return status;
}

/* ---- several mat-vecs over the same input in one parallel job (as on x86) ------------------
 * Q, K and V (or gate and up) of a decode step: the activations rounded once per family, the
 * helpers woken once; each matrix's rows keep their own chunks, so every row runs the same
 * kernel as in a single mat-vec and the results are bit-identical to it. */

#define MULTI_MAX 8

typedef struct {
    int first_chunk[MULTI_MAX + 1];  /* matrix i owns chunks [first_chunk[i], first_chunk[i+1]) */
    int rows[MULTI_MAX];
    matvec_job_t jobs[MULTI_MAX];
} multi_job_t;

static void multi_rows(const void *ctx, int r0, int r1) {
    (void)r1;
    const multi_job_t *m = ctx;
    const int c = r0 / CHUNK_ROWS;
    int i = 0;
    while (c >= m->first_chunk[i + 1]) i++;
    const int lr0 = (c - m->first_chunk[i]) * CHUNK_ROWS;
    const int lr1 = lr0 + CHUNK_ROWS < m->rows[i] ? lr0 + CHUNK_ROWS : m->rows[i];
    matvec_rows(&m->jobs[i], lr0, lr1);
}

/* outs of `count` matrices (all `cols` wide) for the same x (n, cols), n <= MAXN; matrix i's
 * (n, rows[i]) result at out + n * (rows[0] + ... + rows[i-1]). Returns 0, -1 without
 * memory, -2 for a type without kernels, n > MAXN or count > MULTI_MAX. */
int ek_matvec_multi(int count, const int *qtypes, const uint8_t *const *ws,
                    const int64_t *row_bytes, const int *rows, int cols, const float *x, int n,
                    float *out, int nthreads) {
    if (count < 1 || count > MULTI_MAX || n < 1 || n > MAXN || cols % 32) return -2;
    int need[2] = {0, 0};  /* activation families used: [0] Q8_0, [1] Q8_K */
    for (int i = 0; i < count; i++) {
        if (!ek_supports(qtypes[i]) || (is_kquant(qtypes[i]) && cols % 256)) return -2;
        need[is_kquant(qtypes[i])] = 1;
    }
    acts8_t a;
    if (!acts8_alloc(&a, n, cols)) return -1;
    groups_t g[2];
    memset(g, 0, sizeof g);
    int status = 0;
    for (int kq = 0; kq < 2 && status == 0; kq++) {
        if (!need[kq]) continue;
        acts8_round(&a, kq, x, n, cols);
        if (!groups_init(&g[kq], a.xq, a.xd, a.xs, n, cols, kq)) status = -1;
    }
    if (status == 0) {
        multi_job_t m;
        memset(&m, 0, sizeof m);
        int64_t offset = 0;
        for (int i = 0; i < count; i++) {
            const int kq = is_kquant(qtypes[i]);
            m.rows[i] = rows[i];
            m.first_chunk[i + 1] = m.first_chunk[i] + (rows[i] + CHUNK_ROWS - 1) / CHUNK_ROWS;
            m.jobs[i] = matvec_job(qtypes[i], ws[i], row_bytes[i], &g[kq], out + offset, rows[i]);
            offset += (int64_t)n * rows[i];
        }
        parallel_matvec(multi_rows, &m, m.first_chunk[count] * CHUNK_ROWS, nthreads, n);
    }
    for (int kq = 0; kq < 2; kq++) groups_free(&g[kq]);
    acts8_free(&a);
    return status;
}

/* ---- no packed layout on ARM yet: the file's blocks are read in place ---------------------- */

int64_t ek_packed_bytes(int qtype, int rows, int cols) {
    (void)qtype; (void)rows; (void)cols;
    return 0;
}

int ek_pack(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols, uint8_t *dst,
            int nthreads) {
    (void)qtype; (void)w; (void)row_bytes; (void)rows; (void)cols; (void)dst; (void)nthreads;
    return -2;
}

int ek_matmul_packed(int qtype, const uint8_t *packed, int rows, int cols, const float *x,
                     int n, float *out, int nthreads) {
    (void)qtype; (void)packed; (void)rows; (void)cols; (void)x; (void)n; (void)out;
    (void)nthreads;
    return -2;
}

int ek_packed_rows(int qtype, const uint8_t *packed, int rows, int cols, const int64_t *ids,
                   int n, float *out) {
    (void)qtype; (void)packed; (void)rows; (void)cols; (void)ids; (void)n; (void)out;
    return -2;
}

int ek_matmul_packed_multi(int count, const int *qtypes, const uint8_t *const *packed,
                           const int *rows, int cols, const float *x, int n, float *out,
                           int nthreads) {
    (void)count; (void)qtypes; (void)packed; (void)rows; (void)cols; (void)x; (void)n;
    (void)out; (void)nthreads;
    return -2;
}

/* ---- elementwise (the x86 file's arithmetic, 4 lanes at a time) ---------------------------- */

/* e^x for 4 lanes: x = k ln2 + r with |r| <= ln2 / 2, e^r by the degree-7 Taylor polynomial of
 * the x86 exp8, 2^k built in the exponent bits. Below -87: 0; above 88: +inf. */
static inline float32x4_t exp4(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-87.0f);
    const uint32x4_t under = vcltq_f32(x, lo);
    x = vminq_f32(vmaxq_f32(x, lo), vdupq_n_f32(88.0f));
    const float32x4_t k = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504f)));
    float32x4_t r = vfmsq_f32(x, k, vdupq_n_f32(0.693145751953125f));
    r = vfmsq_f32(r, k, vdupq_n_f32(1.428606765330187e-06f));
    float32x4_t p = vdupq_n_f32(1.0f / 5040);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 720), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    /* k in [-126, 128): 2^k as bits; k = 128 overflows to inf as it should */
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)), 23);
    const float32x4_t res = vmulq_f32(p, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(res), under));
}

/* out = silu(gate) * up = gate / (1 + e^-gate) * up over n floats (SwiGLU); 8 at a time with
 * the tail in libm, as the x86 file splits it. */
static void silu_mul(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (; i + 8 <= n; i += 8)
        for (int h = 0; h < 8; h += 4) {
            const float32x4_t g = vld1q_f32(gate + i + h);
            const float32x4_t den = vaddq_f32(one, exp4(vsubq_f32(vdupq_n_f32(0.0f), g)));
            vst1q_f32(out + i + h, vmulq_f32(vdivq_f32(g, den), vld1q_f32(up + i + h)));
        }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* out = gelu(gate) * up with GELU's tanh form, tanh(y) = 1 - 2 / (e^(2y) + 1) (GeGLU). */
static void gelu_tanh_mul(const float *gate, const float *up, float *out, int64_t n) {
    const float32x4_t c = vdupq_n_f32(0.7978845608f), k = vdupq_n_f32(0.044715f);
    const float32x4_t one = vdupq_n_f32(1.0f), two = vdupq_n_f32(2.0f), half = vdupq_n_f32(0.5f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int h = 0; h < 8; h += 4) {
            const float32x4_t g = vld1q_f32(gate + i + h);
            const float32x4_t y = vmulq_f32(c, vfmaq_f32(g, vmulq_f32(k, g), vmulq_f32(g, g)));
            const float32x4_t th = vsubq_f32(one, vdivq_f32(two, vaddq_f32(exp4(vaddq_f32(y, y)), one)));
            const float32x4_t r = vmulq_f32(vmulq_f32(half, g), vaddq_f32(one, th));
            vst1q_f32(out + i + h, vmulq_f32(r, vld1q_f32(up + i + h)));
        }
    for (; i < n; i++) {
        const float g = gate[i];
        out[i] = 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g))) * up[i];
    }
}

/* out = x / sqrt(mean(x^2) + eps) * w, row by row: x, out (rows, d) f32, w (d,). As ggml: the
 * squares in f32, summed in f64 (4 partial sums, combined as the x86 file does), the mean
 * rounded to f32, then (x * scale) * w. */
void ek_rms_norm(const float *x, const float *w, float *out, int64_t rows, int d, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *o = out + r * d;
        float64x2_t s01 = vdupq_n_f64(0.0), s23 = vdupq_n_f64(0.0);
        int i = 0;
        for (; i + 4 <= d; i += 4) {
            const float32x4_t v = vld1q_f32(xr + i);
            const float32x4_t sq = vmulq_f32(v, v);
            s01 = vaddq_f64(s01, vcvt_f64_f32(vget_low_f32(sq)));
            s23 = vaddq_f64(s23, vcvt_high_f64_f32(sq));
        }
        const float64x2_t h = vaddq_f64(s01, s23);  /* (s0 + s2, s1 + s3) */
        double ss = vgetq_lane_f64(h, 0) + vgetq_lane_f64(h, 1);
        for (; i < d; i++) ss += (double)(xr[i] * xr[i]);
        const float mean = (float)(ss / d);
        const float scale = 1.0f / sqrtf(mean + eps);
        const float32x4_t iv = vdupq_n_f32(scale);
        for (i = 0; i + 4 <= d; i += 4)
            vst1q_f32(o + i, vmulq_f32(vmulq_f32(vld1q_f32(xr + i), iv), vld1q_f32(w + i)));
        for (; i < d; i++) o[i] = xr[i] * scale * w[i];
    }
}

/* Rotary embedding: x, out (n, heads, hd); cos, sin (n, hd/2) per position. neox turns the
 * pairs (i, i + hd/2) (ggml NEOX), otherwise adjacent pairs (2i, 2i + 1) (ggml NORM). */
void ek_rope(const float *x, const float *cos, const float *sin, float *out, int n, int heads,
             int hd, int neox) {
    const int half = hd / 2;
    for (int t = 0; t < n; t++) {
        const float *c = cos + (int64_t)t * half, *s = sin + (int64_t)t * half;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + ((int64_t)t * heads + h) * hd;
            float *o = out + ((int64_t)t * heads + h) * hd;
            if (neox) {
                const int vec = half - half % 8;  /* the x86 file's vector span, fused alike */
                int i = 0;
                for (; i < vec; i += 4) {
                    const float32x4_t a = vld1q_f32(xh + i), b = vld1q_f32(xh + i + half);
                    const float32x4_t cv = vld1q_f32(c + i), sv = vld1q_f32(s + i);
                    vst1q_f32(o + i, vfmaq_f32(vnegq_f32(vmulq_f32(b, sv)), a, cv));
                    vst1q_f32(o + i + half, vfmaq_f32(vmulq_f32(b, cv), a, sv));
                }
                for (; i < half; i++) {
                    const float a = xh[i], b = xh[i + half];
                    o[i] = a * c[i] - b * s[i];
                    o[i + half] = a * s[i] + b * c[i];
                }
            } else {
                for (int i = 0; i < half; i++) {
                    const float a = xh[2 * i], b = xh[2 * i + 1];
                    o[2 * i] = a * c[i] - b * s[i];
                    o[2 * i + 1] = a * s[i] + b * c[i];
                }
            }
        }
    }
}

/* The gated activations over a prefill's (n, ffn) products are worth threads: pieces of
 * ELEMENTWISE_PIECE floats, one per parallel_rows chunk. */
#define ELEMENTWISE_PIECE 16384

typedef struct {
    void (*fn)(const float *, const float *, float *, int64_t);
    const float *gate, *up;
    float *out;
    int64_t n;
} elementwise_job_t;

static void elementwise_piece(const void *ctx, int r0, int r1) {
    (void)r1;
    const elementwise_job_t *j = ctx;
    const int64_t start = (int64_t)(r0 / CHUNK_ROWS) * ELEMENTWISE_PIECE;
    const int64_t len = j->n - start < ELEMENTWISE_PIECE ? j->n - start : ELEMENTWISE_PIECE;
    j->fn(j->gate + start, j->up + start, j->out + start, len);
}

static void elementwise_mt(void (*fn)(const float *, const float *, float *, int64_t),
                           const float *gate, const float *up, float *out, int64_t n,
                           int nthreads) {
    const int64_t pieces = (n + ELEMENTWISE_PIECE - 1) / ELEMENTWISE_PIECE;
    if (pieces < 2 || pieces * CHUNK_ROWS > INT32_MAX) {
        fn(gate, up, out, n);
        return;
    }
    elementwise_job_t j = {fn, gate, up, out, n};
    parallel_rows(elementwise_piece, &j, (int)(pieces * CHUNK_ROWS), nthreads);
}

void ek_silu_mul(const float *gate, const float *up, float *out, int64_t n, int nthreads) {
    elementwise_mt(silu_mul, gate, up, out, n, nthreads);
}

void ek_gelu_tanh_mul(const float *gate, const float *up, float *out, int64_t n, int nthreads) {
    elementwise_mt(gelu_tanh_mul, gate, up, out, n, nthreads);
}

/* ---- attention over an f16 KV cache, flash style (the x86 file's scheme) -------------------
 * q (n, H, hd) f32; k, v (T, KVH, hd) f16 bits; mask (n, T) (nonzero: attend); out (n, H, hd);
 * hd % 8 == 0. The unit of work is one KV head and a block of ATTN_QBLOCK tokens; keys are
 * taken ATTN_KBLOCK at a time at multiples of ATTN_KBLOCK and converted from f16 once per
 * unit, K transposed to (hd, 16) and V as (16, hd); up to four query heads of a token share
 * every load of K and V; the softmax is online (running max and sum per row). A row's
 * arithmetic depends only on its own query and mask (fully masked key blocks are skipped), so
 * a token's result does not depend on the batch. */

typedef struct {
    const float *q;
    const uint16_t *k, *v;
    const uint8_t *mask;
    int n_heads, n_kv, hd, T;
    float scale, softcap;
    float *out;
    int failed;
} attn_job_t;

#define ATTN_QBLOCK 16
#define ATTN_KBLOCK 16

typedef struct {
    attn_job_t a;
    int n;        /* tokens */
    int nblocks;  /* token blocks of ATTN_QBLOCK */
    int hgroups;  /* units a KV head's query heads are split into (1: one unit) */
} attn_units_t;

/* keys j0.. of KV head kh as kt (hd, 16) and vb (16, hd) in f32; keys past T are zeros */
static void load_key_block(const attn_job_t *a, int kh, int j0, float *kt, float *vb) {
    const int hd = a->hd;
    for (int jj = 0; jj < ATTN_KBLOCK; jj++) {
        const int j = j0 + jj;
        float *vrow = vb + (int64_t)jj * hd;
        if (j >= a->T) {
            for (int d = 0; d < hd; d++) kt[d * ATTN_KBLOCK + jj] = vrow[d] = 0.0f;
            continue;
        }
        const int64_t at = ((int64_t)j * a->n_kv + kh) * hd;
        for (int d = 0; d < hd; d += 4) {
            const float32x4_t kv = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(a->k + at + d)));
            vst1q_f32(vrow + d, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(a->v + at + d))));
            kt[(d + 0) * ATTN_KBLOCK + jj] = vgetq_lane_f32(kv, 0);
            kt[(d + 1) * ATTN_KBLOCK + jj] = vgetq_lane_f32(kv, 1);
            kt[(d + 2) * ATTN_KBLOCK + jj] = vgetq_lane_f32(kv, 2);
            kt[(d + 3) * ATTN_KBLOCK + jj] = vgetq_lane_f32(kv, 3);
        }
    }
}

static inline float hmax4(float32x4_t v) { return vmaxvq_f32(v); }

/* Fold one block of keys into NG (1..4) query rows of one token: q (NG rows, hd apart),
 * bias (16,) 0 or -inf per key; acc (NG, hd), mx and sum (NG,) the rows' running state. */
static inline __attribute__((always_inline)) void
fold_rows(const attn_job_t *a, const float *q, const int NG, const float *kt, const float *vb,
          const float *bias, float *acc, float *mx, float *sum) {
    const int hd = a->hd;
    float32x4_t s[4][4];  /* (row, keys 4i..4i+3) */
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < 4; i++) s[g][i] = vdupq_n_f32(0.0f);
    for (int d = 0; d < hd; d++) {
        float32x4_t k[4];
        for (int i = 0; i < 4; i++) k[i] = vld1q_f32(kt + d * 16 + 4 * i);
        for (int g = 0; g < NG; g++) {
            const float b = q[(int64_t)g * hd + d];
            for (int i = 0; i < 4; i++) s[g][i] = vfmaq_n_f32(s[g][i], k[i], b);
        }
    }
    float pv[4][ATTN_KBLOCK], corr[4];
    for (int g = 0; g < NG; g++) {
        float32x4_t x[4];
        for (int i = 0; i < 4; i++) x[i] = vmulq_n_f32(s[g][i], a->scale);
        if (a->softcap > 0.0f) {
            for (int i = 0; i < 4; i++) vst1q_f32(pv[g] + 4 * i, x[i]);
            for (int i = 0; i < ATTN_KBLOCK; i++)
                pv[g][i] = a->softcap * tanhf(pv[g][i] / a->softcap);
            for (int i = 0; i < 4; i++) x[i] = vld1q_f32(pv[g] + 4 * i);
        }
        for (int i = 0; i < 4; i++) x[i] = vaddq_f32(x[i], vld1q_f32(bias + 4 * i));
        const float top = hmax4(vmaxq_f32(vmaxq_f32(x[0], x[1]), vmaxq_f32(x[2], x[3])));
        const float best = top > mx[g] ? top : mx[g];
        if (best == -INFINITY) {  /* nothing this row may attend to yet: leave it as it is */
            corr[g] = 1.0f;
            for (int i = 0; i < ATTN_KBLOCK; i++) pv[g][i] = 0.0f;
            continue;
        }
        corr[g] = vgetq_lane_f32(exp4(vdupq_n_f32(mx[g] - best)), 0);  /* 0 on a first block */
        float32x4_t p[4];
        for (int i = 0; i < 4; i++) p[i] = exp4(vsubq_f32(x[i], vdupq_n_f32(best)));
        mx[g] = best;
        /* the x86 hsum8 of (keys 0-7) + (keys 8-15) */
        sum[g] = sum[g] * corr[g] + hsum8(vaddq_f32(p[0], p[2]), vaddq_f32(p[1], p[3]));
        for (int i = 0; i < 4; i++) vst1q_f32(pv[g] + 4 * i, p[i]);
    }
    for (int d = 0; d < hd; d += 4) {
        float32x4_t x[4];
        for (int g = 0; g < NG; g++) x[g] = vmulq_n_f32(vld1q_f32(acc + (int64_t)g * hd + d), corr[g]);
        for (int jj = 0; jj < ATTN_KBLOCK; jj++) {
            const float32x4_t vv = vld1q_f32(vb + (int64_t)jj * hd + d);
            for (int g = 0; g < NG; g++) x[g] = vfmaq_n_f32(x[g], vv, pv[g][jj]);
        }
        for (int g = 0; g < NG; g++) vst1q_f32(acc + (int64_t)g * hd + d, x[g]);
    }
}

static void fold_key_block(const attn_job_t *a, const float *q, int ng, const float *kt,
                           const float *vb, const float *bias, float *acc, float *mx,
                           float *sum) {
    switch (ng) {
    case 1: fold_rows(a, q, 1, kt, vb, bias, acc, mx, sum); break;
    case 2: fold_rows(a, q, 2, kt, vb, bias, acc, mx, sum); break;
    case 3: fold_rows(a, q, 3, kt, vb, bias, acc, mx, sum); break;
    default: fold_rows(a, q, 4, kt, vb, bias, acc, mx, sum); break;
    }
}

