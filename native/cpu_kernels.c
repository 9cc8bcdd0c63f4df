/* Quantized mat-vec kernels for x86 (AVX2, AVX-512 VNNI) over ggml's own block layouts.
 *
 * Weights are read in place (zero copy over the GGUF mmap): a row of a (rows, cols) matrix
 * is cols / block_size ggml blocks. Activations are quantized to int8 per 32 elements
 * (scale xd, plus sums of 16-element halves xs16 for the types with offsets or minimums),
 * so every block dot product is an unsigned-by-signed 8-bit integer dot:
 *
 *     w = s * q + m   (q unsigned)   =>   sum(w * x) = s * xd * dot(q, xq) + m * xd * sum(xq)
 *
 * dot32 below is vpdpbusd (AVX-512 VNNI, AVX-VNNI) or vpmaddubsw + vpmaddwd (AVX2). Block
 * layouts follow ggml-common.h. Built by native/cpu_kernels.py with -mavx2 (and -mavx512vnni
 * or -mavxvnni where present); never with AMX. Threads: the pool of cpu_pool.c, no OpenMP.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ---- 8-bit dot of 32 bytes: u (unsigned) . s (signed) -> 8 int32 partial sums ---------- */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dot32(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#elif defined(__AVXVNNI__)  /* the VEX form of the same instruction (Alder Lake+, Zen 4+) */
static inline __m256i dot32(__m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#else
static inline __m256i dot32(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 bits -> 32 bytes, each 0x10 where its bit is set (the fifth bit of Q5 types). */
static inline __m256i bits_to_0x10(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
#else
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
#endif
}

/* 16 packed bytes -> 32 nibbles: low nibbles first (elements 0..15), then high (16..31). */
static inline __m256i nibbles16(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline __m256i loadx(const int8_t *x) { return _mm256_loadu_si256((const __m256i *)x); }

/* All 8 scales and mins of a Q4_K/Q5_K superblock at once, on 32-bit words (a, b, c are
 * bytes 0-3, 4-7, 8-11): sub-blocks 0-3 keep their low 6 bits in a (scales) and b (mins);
 * 4-7 take 4 bits from c and their top 2 bits from bits 6-7 of a and b. */
static inline void scales_mins_k4(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a, b, c, lo[2], hi[2];
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    lo[0] = a & 0x3f3f3f3fu;
    lo[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    hi[0] = b & 0x3f3f3f3fu;
    hi[1] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
    memcpy(sc, lo, 8);
    memcpy(mn, hi, 8);
}

/* ---- row dot products: one weight row (nb blocks) . n quantized activation rows -----------
 * The activations come interleaved by block (see interleave below): token t's block b is
 * xq + 32 * (b * n + t) (int8), its scale xd[b * n + t] and its 16-element sums
 * xs[2 * (b * n + t)], xs[2 * (b * n + t) + 1]. Loops run block-outer, token-inner: each
 * weight block is unpacked once and dotted against every token while it sits in registers.
 * For each token the arithmetic (integer products, the order of the float accumulation) is
 * exactly that of a single-token dot, so a token's result is bit-identical whether it is
 * computed alone or in a batch (speculative decoding's greedy exactness relies on that). The
 * bodies are inlined for each n in 1..MAXN (a compile-time constant), so the per-token
 * accumulators stay in registers and every token's address is a constant offset; the
 * single-token path is the n = 1 case of the same code. Row results go to out[t * ldo]. */

#define MAXN 8
#define FORCE static inline __attribute__((always_inline))

/* Weight rows are streamed once per token; this VM's hardware prefetchers alone leave a core
 * at ~7 GB/s on them, so each step asks for the bytes g_prefetch_ahead further on. How far
 * pays differs between CPUs and with the hint: backends/cpu/calibrate.py times a large
 * mat-vec at 1-16 KB once per CPU model and sets the fastest where it beats this default by
 * 5% (ek_set_prefetch_ahead). On 2 Zen 5 cores with the non-temporal hint, decode went 1 KB
 * 9.5 ms a token (0.5B), 2 KB 9.0, 4 KB 8.2, 8 KB 7.9-8.1, 16 KB 8.6.
 * Non-temporal: read once, they should not push out of L2 what the step reads again (the
 * activations, the KV cache, the interpreter's own state between ops). Against _MM_HINT_T0,
 * interleaved on 2 Zen 5 cores at 2 KB: Gemma 3 270M decode 6.97 -> 6.51 ms a token (AVX2
 * build 7.48 -> 6.82; its output matmul 4.16 -> 3.88, the Python and small ops between
 * matmuls 1.35 -> 1.02), the Qwen 0.5B and 1.5B, an 8-sequence step and pp512 unchanged;
 * at 8 KB, Gemma 5.7-6.2 -> 5.2-5.3, the 0.5B 8.5-8.9 -> 7.9-8.6. */
#ifndef PREFETCH_AHEAD  /* the distance before calibration; -DPREFETCH_AHEAD=0 turns it off */
#define PREFETCH_AHEAD 8192
#endif
static int g_prefetch_ahead = PREFETCH_AHEAD;

/* Set the mat-vec kernels' prefetch distance (bytes, 0..65536, rounded down to a line). */
void ek_set_prefetch_ahead(int bytes) {
    g_prefetch_ahead = bytes < 0 ? 0 : (bytes > 65536 ? 65536 : bytes) & ~63;
}

/* The mat-vec kernels' prefetch distance in bytes. */
int ek_prefetch_ahead(void) { return g_prefetch_ahead; }

#define PREFETCH_HINT _MM_HINT_NTA
#if PREFETCH_AHEAD > 0
#define PREFETCH(p, bytes)                                                                    \
    for (int pf_ = 0; pf_ < (bytes); pf_ += 64)                                               \
        _mm_prefetch((const char *)(p) + g_prefetch_ahead + pf_, PREFETCH_HINT)
#else
#define PREFETCH(p, bytes) ((void)0)
#endif

/* The per-block float accumulation is a chain of dependent FMAs (4 cycles each): even and odd
 * blocks go to two accumulators so that one token's decode is not bound by that latency. The
 * order is the same for every n, so batch results stay bit-identical to single-token ones. */

/* lane 0 of an int32 vector minus v (the offset of the unsigned encodings, in integers) */
static inline __m256i sub_lane0(__m256i p, int v) {
    return _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(v)));
}

FORCE void blk_q8_0(const uint8_t *w, int b, const int8_t *xq, const float *xd, const int n,
                    __m256 *acc) {
    __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
    __m256i qa = _mm256_sign_epi8(q, q);
    const float d = f16(w);
    for (int t = 0; t < n; t++) {
        __m256i p = dot32(qa, _mm256_sign_epi8(loadx(xq + 32 * ((int64_t)b * n + t)), q));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[b * n + t]), acc[t]);
    }
}

/* Q4_0 / Q5_0: q unsigned (4 or 5 bits) with an offset of 8 or 16, removed in int32. */
FORCE void blk_q4_0(const uint8_t *w, int b, const int8_t *xq, const float *xd,
                    const int32_t *xs, const int n, __m256 *acc, const int five) {
    const float d = f16(w);
    __m256i q = nibbles16(w + 2 + 4 * five);
    if (five) {
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        q = _mm256_or_si256(q, bits_to_0x10(qh));
    }
    const int offset = five ? 16 : 8;
    for (int t = 0; t < n; t++) {
        const int64_t bt = (int64_t)b * n + t;
        __m256i p = sub_lane0(dot32(q, loadx(xq + 32 * bt)), offset * (xs[2 * bt] + xs[2 * bt + 1]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[bt]), acc[t]);
    }
}

/* Q4_1 / Q5_1: w = d q + m; the m term in float, on its own per-token sum. */
FORCE void blk_q4_1(const uint8_t *w, int b, const int8_t *xq, const float *xd,
                    const int32_t *xs, const int n, __m256 *acc, float *off, const int five) {
    const float d = f16(w), m = f16(w + 2);
    __m256i q = nibbles16(w + 4 + 4 * five);
    if (five) {
        uint32_t qh;
        memcpy(&qh, w + 4, 4);
        q = _mm256_or_si256(q, bits_to_0x10(qh));
    }
    for (int t = 0; t < n; t++) {
        const int64_t bt = (int64_t)b * n + t;
        __m256i p = dot32(q, loadx(xq + 32 * bt));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[bt]), acc[t]);
        off[t] += m * xd[bt] * (float)(xs[2 * bt] + xs[2 * bt + 1]);
    }
}

/* Two accumulator sets, even and odd blocks; summed per token at the end. */
#define ACC2_BEGIN                                                                            \
    __m256 acc0[MAXN], acc1[MAXN];                                                            \
    float off0[MAXN], off1[MAXN];                                                             \
    for (int t = 0; t < n; t++)                                                               \
        acc0[t] = acc1[t] = _mm256_setzero_ps(), off0[t] = off1[t] = 0.0f;
#define ACC2_END                                                                              \
    for (int t = 0; t < n; t++)                                                               \
        out[(int64_t)t * ldo] = hsum8(_mm256_add_ps(acc0[t], acc1[t])) + (off0[t] + off1[t]);

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Q8_0 on 512-bit vectors, two blocks per step: |q| . (x signed as q), one vpdpbusd, and
 * per-lane scales (lanes 0-7: block b's d * xd, 8-15: block b+1's). The same steps for every
 * n, so batch results stay bit-identical to single-token ones. */
FORCE void dot_q8_0_n(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,
                      int nb, int cols, const int n, float *out, int64_t ldo) {
    (void)xs; (void)cols;
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[MAXN];
    for (int t = 0; t < n; t++) acc[t] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2, w += 68) {
        PREFETCH(w, 68);
        const __m512i q = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2))),
            _mm256_loadu_si256((const __m256i *)(w + 36)), 1);
        const __m512i qa = _mm512_abs_epi8(q);
        const __mmask64 neg = _mm512_movepi8_mask(q);
        const __m128 d = _mm_cvtph_ps(_mm_setr_epi16(*(const short *)w, *(const short *)(w + 34),
                                                    0, 0, 0, 0, 0, 0));
        for (int t = 0; t < n; t++) {
            const __m512i x = _mm512_inserti64x4(
                _mm512_castsi256_si512(loadx(xq + 32 * ((int64_t)b * n + t))),
                loadx(xq + 32 * ((int64_t)(b + 1) * n + t)), 1);
            const __m512i xs8 = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qa, xs8);
            const __m128 s2 = _mm_mul_ps(d, _mm_setr_ps(xd[b * n + t], xd[(b + 1) * n + t], 0, 0));
            const __m512 sv = _mm512_permutexvar_ps(half, _mm512_castps128_ps512(s2));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sv, acc[t]);
        }
    }
    __m256 tail[MAXN];
    for (int t = 0; t < n; t++) tail[t] = _mm256_setzero_ps();
    if (b < nb) blk_q8_0(w, b, xq, xd, n, tail);
    for (int t = 0; t < n; t++)
        out[(int64_t)t * ldo] = _mm512_reduce_add_ps(acc[t]) + hsum8(tail[t]);
}
#else
FORCE void dot_q8_0_n(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,
                      int nb, int cols, const int n, float *out, int64_t ldo) {
    (void)xs; (void)cols;
    ACC2_BEGIN
    int b = 0;
    for (; b + 1 < nb; b += 2, w += 68) {
        PREFETCH(w, 68);
        blk_q8_0(w, b, xq, xd, n, acc0);
        blk_q8_0(w + 34, b + 1, xq, xd, n, acc1);
    }
    if (b < nb) blk_q8_0(w, b, xq, xd, n, acc0);
    ACC2_END
}
#endif

#define DOT_OFFSET_TYPE(name, bytes, five)                                                    \
    FORCE void name(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,   \
                    int nb, int cols, const int n, float *out, int64_t ldo) {                 \
        (void)cols;                                                                           \
        ACC2_BEGIN                                                                            \
        int b = 0;                                                                            \
        for (; b + 1 < nb; b += 2, w += 2 * (bytes)) {                                        \
            PREFETCH(w, 2 * (bytes));                                                 \
            blk_q4_0(w, b, xq, xd, xs, n, acc0, five);                                        \
            blk_q4_0(w + (bytes), b + 1, xq, xd, xs, n, acc1, five);                          \
        }                                                                                     \
        if (b < nb) blk_q4_0(w, b, xq, xd, xs, n, acc0, five);                                \
        ACC2_END                                                                              \
    }

#define DOT_MIN_TYPE(name, bytes, five)                                                       \
    FORCE void name(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,   \
                    int nb, int cols, const int n, float *out, int64_t ldo) {                 \
        (void)cols;                                                                           \
        ACC2_BEGIN                                                                            \
        int b = 0;                                                                            \
        for (; b + 1 < nb; b += 2, w += 2 * (bytes)) {                                        \
            PREFETCH(w, 2 * (bytes));                                                 \
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

/* dot_<type>(row, ..., n, out, ldo) for a runtime n in 1..MAXN: one inlined body per n. */
typedef void (*dot_fn)(const uint8_t *, const int8_t *, const float *, const int32_t *, int, int,
                       int, float *, int64_t);

#define DISPATCH(name)                                                                        \
    static void name(const uint8_t *w, const int8_t *xq, const float *xd, const int32_t *xs,  \
                     int nb, int cols, int n, float *out, int64_t ldo) {                     \
        switch (n) {                                                                          \
        case 1: name##_n(w, xq, xd, xs, nb, cols, 1, out, ldo); break;                        \
        case 2: name##_n(w, xq, xd, xs, nb, cols, 2, out, ldo); break;                        \
        case 3: name##_n(w, xq, xd, xs, nb, cols, 3, out, ldo); break;                        \
        case 4: name##_n(w, xq, xd, xs, nb, cols, 4, out, ldo); break;                        \
        case 5: name##_n(w, xq, xd, xs, nb, cols, 5, out, ldo); break;                        \
        case 6: name##_n(w, xq, xd, xs, nb, cols, 6, out, ldo); break;                        \
        case 7: name##_n(w, xq, xd, xs, nb, cols, 7, out, ldo); break;                        \
        default: name##_n(w, xq, xd, xs, nb, cols, 8, out, ldo); break;                       \
        }                                                                                     \
    }

DISPATCH(dot_q8_0)
DISPATCH(dot_q4_0)
DISPATCH(dot_q4_1)
DISPATCH(dot_q5_0)
DISPATCH(dot_q5_1)

static dot_fn dot_for(int qtype) {
    switch (qtype) {
    case T_Q8_0: return dot_q8_0;
    case T_Q4_0: return dot_q4_0;
    case T_Q4_1: return dot_q4_1;
    case T_Q5_0: return dot_q5_0;
    case T_Q5_1: return dot_q5_1;
    default: return 0;  /* K-quants: dotk_for */
    }
}

/* ---- K-quants against Q8_K activations (one scale per 256), integer per superblock --------
 * As llama.cpp: the 8 sub-blocks' products are scaled and summed in int32 (maddubs then madd
 * by the 6/8-bit scales), the minimums (Q4_K/Q5_K) or the -32 offset (Q6_K) come from the
 * 16-element sums xs16 (int16, (nsb, n, 16) interleaved), and only then is the superblock
 * scaled in float: two float ops per token per superblock instead of per 32. K-quant weights
 * always meet Q8_K activations (quantize_rows_q8k); exact integer sums, so each token's
 * result is still independent of the batch. */

static inline __m256i madd_acc(__m256i acc, __m256i p16, __m256i s16) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p16, s16);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, p16, s16);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, s16));
#endif
}

FORCE void dot_qk_int_n(const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *xs16,
                        int nb, const int n, float *out, int64_t ldo, const int five) {
    const int bytes = five ? 176 : 144, nsb = nb / 8;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MAXN];
    for (int t = 0; t < n; t++) acc[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++, w += bytes) {
        PREFETCH(w, bytes);
        const float d = f16(w), dmin = f16(w + 2);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        uint8_t sc[8], mn[8];
        scales_mins_k4(w + 4, sc, mn);
        /* (16,) int16: each sub-block's min for both of its 16-element halves */
        const __m128i m8 = _mm_loadl_epi64((const __m128i *)mn);
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        __m256i isum[MAXN];
        for (int t = 0; t < n; t++) isum[t] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(raw, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            if (five) {  /* bit 2j of qh[l] -> element l, bit 2j+1 -> element 32 + l */
                __m256i h = _mm256_srli_epi16(hbits, 2 * j);
                __m256i one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                hi = _mm256_or_si256(
                    hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
            }
            for (int half = 0; half < 2; half++) {
                const int b = sb * 8 + 2 * j + half;
                const __m256i q = half ? hi : lo, s16 = _mm256_set1_epi16(sc[2 * j + half]);
                for (int t = 0; t < n; t++) {
                    __m256i p = _mm256_maddubs_epi16(q, loadx(xq + 32 * ((int64_t)b * n + t)));
                    isum[t] = madd_acc(isum[t], p, s16);
                }
            }
        }
        for (int t = 0; t < n; t++) {
            const float D = xd[(sb * 8) * n + t];
            __m256i xs = _mm256_loadu_si256((const __m256i *)(xs16 + 16 * ((int64_t)sb * n + t)));
            __m256i imin = _mm256_madd_epi16(xs, mins16);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * D), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_set1_ps(dmin * D), acc[t]);
        }
    }
    for (int t = 0; t < n; t++) out[(int64_t)t * ldo] = hsum8(acc[t]);
}

FORCE void dot_q6_k_int_n(const uint8_t *w, const int8_t *xq, const float *xd,
                          const int16_t *xs16, int nb, const int n, float *out, int64_t ldo) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MAXN];
    for (int t = 0; t < n; t++) acc[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < nb / 8; sb++, w += 210) {
        PREFETCH(w, 210);
        const float d = f16(w + 208);
        const int8_t *scales = (const int8_t *)(w + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));
        __m256i isum[MAXN];
        for (int t = 0; t < n; t++) isum[t] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i qa = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            __m256i qb = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(qa, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(3)), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(qb, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(12)), 2));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                                   _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2),
                                                    _mm256_set1_epi8(0x30)));
            for (int k = 0; k < 4; k++) {
                const int b = sb * 8 + 4 * h + k;
                /* lanes 0-7: the scale of the block's first 16, 8-15: of its second 16 */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
                const __m256i pick = _mm256_add_epi16(
                    _mm256_set1_epi16((short)(8 * h + 2 * k)),
                    _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
                const __m256i s16 = _mm256_permutexvar_epi16(pick, sc16);
#else
                const __m256i s16 = _mm256_set_m128i(_mm_set1_epi16(scales[8 * h + 2 * k + 1]),
                                                     _mm_set1_epi16(scales[8 * h + 2 * k]));
#endif
                for (int t = 0; t < n; t++) {
                    __m256i p = _mm256_maddubs_epi16(q[k], loadx(xq + 32 * ((int64_t)b * n + t)));
                    isum[t] = madd_acc(isum[t], p, s16);
                }
            }
        }
        for (int t = 0; t < n; t++) {
            const float D = xd[(sb * 8) * n + t];
            __m256i xs = _mm256_loadu_si256((const __m256i *)(xs16 + 16 * ((int64_t)sb * n + t)));
            __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(xs, sc16), 5);  /* 32 * sum */
            __m256i tot = _mm256_sub_epi32(isum[t], off);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d * D), acc[t]);
        }
    }
    for (int t = 0; t < n; t++) out[(int64_t)t * ldo] = hsum8(acc[t]);
}

FORCE void dot_q4_k_int_n(const uint8_t *w, const int8_t *xq, const float *xd,
                          const int16_t *xs16, int nb, const int n, float *out, int64_t ldo) {
    dot_qk_int_n(w, xq, xd, xs16, nb, n, out, ldo, 0);
}

FORCE void dot_q5_k_int_n(const uint8_t *w, const int8_t *xq, const float *xd,
                          const int16_t *xs16, int nb, const int n, float *out, int64_t ldo) {
    dot_qk_int_n(w, xq, xd, xs16, nb, n, out, ldo, 1);
}

typedef void (*dotk_fn)(const uint8_t *, const int8_t *, const float *, const int16_t *, int, int,
                        float *, int64_t);

#define DISPATCHK(name)                                                                       \
    static void name(const uint8_t *w, const int8_t *xq, const float *xd, const int16_t *xs,  \
                     int nb, int n, float *out, int64_t ldo) {                                \
        switch (n) {                                                                          \
        case 1: name##_n(w, xq, xd, xs, nb, 1, out, ldo); break;                              \
        case 2: name##_n(w, xq, xd, xs, nb, 2, out, ldo); break;                              \
        case 3: name##_n(w, xq, xd, xs, nb, 3, out, ldo); break;                              \
        case 4: name##_n(w, xq, xd, xs, nb, 4, out, ldo); break;                              \
        case 5: name##_n(w, xq, xd, xs, nb, 5, out, ldo); break;                              \
        case 6: name##_n(w, xq, xd, xs, nb, 6, out, ldo); break;                              \
        case 7: name##_n(w, xq, xd, xs, nb, 7, out, ldo); break;                              \
        default: name##_n(w, xq, xd, xs, nb, 8, out, ldo); break;                             \
        }                                                                                     \
    }

DISPATCHK(dot_q4_k_int)
DISPATCHK(dot_q5_k_int)
DISPATCHK(dot_q6_k_int)

static dotk_fn dotk_for(int qtype) {
    switch (qtype) {
    case T_Q4_K: return dot_q4_k_int;
    case T_Q5_K: return dot_q5_k_int;
    case T_Q6_K: return dot_q6_k_int;
    default: return 0;
    }
}

/* ---- public entry points ----------------------------------------------------------------- */

/* K-quants take Q8_K activations and the integer superblock dots; the rest Q8_0 and dot_for. */
static int is_kquant(int qtype) { return dotk_for(qtype) != 0; }

int ek_supports(int qtype) { return dot_for(qtype) != 0 || is_kquant(qtype); }

/* x (n, cols) f32 -> xq (n, cols) int8, xd (n, cols/32), xs (n, cols/16). cols % 32 == 0. */
static void quantize_rows(const float *x, int n, int cols, int8_t *xq, float *xd, int32_t *xs) {
    for (int t = 0; t < n; t++) {
        for (int b = 0; b < cols / 32; b++) {
            const float *v = x + (int64_t)t * cols + 32 * b;
            int8_t *q = xq + (int64_t)t * cols + 32 * b;
            float amax = 0.0f;
            /* a compare, not fmaxf: libm's is a call into SSE code, which runs very slowly
             * while the upper halves of the vector registers are dirty */
            for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            /* ggml's Q8_0 (x86 quantize_row_q8_0): q = round(x * (127 / amax)), the scale
             * amax / 127 kept as f16 */
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int s0 = 0, s1 = 0;
            for (int i = 0; i < 16; i++) {
                int a = (int)nearbyintf(v[i] * inv), c = (int)nearbyintf(v[i + 16] * inv);
                q[i] = (int8_t)a;
                q[i + 16] = (int8_t)c;
                s0 += a;
                s1 += c;
            }
            xd[(int64_t)t * (cols / 32) + b] = _cvtsh_ss(_cvtss_sh(d, 0));
            xs[(int64_t)t * (cols / 16) + 2 * b] = s0;
            xs[(int64_t)t * (cols / 16) + 2 * b + 1] = s1;
        }
    }
}

/* As quantize_rows, but with one scale per 256 values as ggml's Q8_K (used against K-quant
 * weights): the scale comes from the signed value of largest magnitude, q = min(127,
 * round(-127/peak * x)), and the 8 sub-blocks of 32 share it. Matching llama.cpp's rounding
 * matters where one activation dwarfs the rest (Qwen2.5-1.5B's first token). */
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
                int a = (int)nearbyintf(iscale * v[i]);
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

/* Tokens t0 .. t0 + m - 1 of xq (n, cols), xd (n, nb), xs (n, 2 nb) into the interleaved
 * layout of the dot functions: xqi (nb, m, 32), xdi (nb, m), xsi (nb, m, 2), and, for the
 * integer K-quant path (kq: Q8_K activations), xs16i (nb / 8, m, 16) int16. */
static void interleave(const int8_t *xq, const float *xd, const int32_t *xs, int cols, int t0,
                       int m, int kq, int8_t *xqi, float *xdi, int32_t *xsi, int16_t *xs16i) {
    const int nb = cols / 32;
    for (int t = 0; t < m; t++) {
        const int8_t *q = xq + (int64_t)(t0 + t) * cols;
        const float *d = xd + (int64_t)(t0 + t) * nb;
        const int32_t *s = xs + (int64_t)(t0 + t) * 2 * nb;
        for (int b = 0; b < nb; b++) {
            memcpy(xqi + 32 * ((int64_t)b * m + t), q + 32 * b, 32);
            xdi[(int64_t)b * m + t] = d[b];
            xsi[2 * ((int64_t)b * m + t)] = s[2 * b];
            xsi[2 * ((int64_t)b * m + t) + 1] = s[2 * b + 1];
        }
        if (kq)
            for (int sb = 0; sb < nb / 8; sb++)
                for (int i = 0; i < 16; i++)
                    xs16i[16 * ((int64_t)sb * m + t) + i] = (int16_t)s[16 * sb + i];
    }
}

/* rows [r0, r1) against m <= MAXN interleaved tokens; out[t * ldo + r]. kdot (the integer
 * K-quant dot) for K-quants, else dot. */
static void matvec_il(dot_fn dot, dotk_fn kdot, const uint8_t *w, int64_t row_bytes, int r0,
                      int r1, int cols, const int8_t *xqi, const float *xdi, const int32_t *xsi,
                      const int16_t *xs16i, int m, float *out, int64_t ldo) {
    const int nb = cols / 32;
    if (kdot) {
        for (int r = r0; r < r1; r++)
            kdot(w + (int64_t)r * row_bytes, xqi, xdi, xs16i, nb, m, out + r, ldo);
        return;
    }
    for (int r = r0; r < r1; r++)
        dot(w + (int64_t)r * row_bytes, xqi, xdi, xsi, nb, cols, m, out + r, ldo);
}

/* n tokens interleaved group by group, MAXN tokens to a group (the last may be short): the
 * buffers of group g start at g * MAXN tokens' worth of each array. */
typedef struct {
    int n, cols, ngroups;
    int8_t *xqi;
    float *xdi;
    int32_t *xsi;
    int16_t *xs16i;
} groups_t;

static int groups_init(groups_t *g, const int8_t *xq, const float *xd, const int32_t *xs, int n,
                       int cols, int kq) {
    const int nb = cols / 32;
    g->n = n;
    g->cols = cols;
    g->ngroups = (n + MAXN - 1) / MAXN;
    g->xqi = malloc((size_t)n * cols);
    g->xdi = malloc(sizeof(float) * n * nb);
    g->xsi = malloc(sizeof(int32_t) * n * 2 * nb);
    g->xs16i = malloc(sizeof(int16_t) * n * 2 * nb);
    if (!g->xqi || !g->xdi || !g->xsi || !g->xs16i) return 0;
    for (int t0 = 0; t0 < n; t0 += MAXN) {
        const int m = n - t0 < MAXN ? n - t0 : MAXN;
        interleave(xq, xd, xs, cols, t0, m, kq, g->xqi + (int64_t)t0 * cols,
                   g->xdi + (int64_t)t0 * nb, g->xsi + (int64_t)t0 * 2 * nb,
                   g->xs16i + (int64_t)t0 * 2 * nb);
    }
    return 1;
}

static void groups_free(groups_t *g) {
    free(g->xqi);
    free(g->xdi);
    free(g->xsi);
    free(g->xs16i);
}

/* Rows [r0, r1) against every token group; out[t * ldo + r]. Rows outer, groups inner: a few
 * rows' blocks stay in L1 while all tokens pass over them, so prefill reads each weight once
 * (the int8 activations of all tokens sit in L2/L3). */
static void matvec_groups(dot_fn dot, dotk_fn kdot, const uint8_t *w, int64_t row_bytes, int r0,
                          int r1, const groups_t *g, float *out, int64_t ldo) {
    const int nb = g->cols / 32;
    for (int gi = 0; gi < g->ngroups; gi++) {
        const int64_t t0 = (int64_t)gi * MAXN;
        const int m = g->n - t0 < MAXN ? (int)(g->n - t0) : MAXN;
        matvec_il(dot, kdot, w, row_bytes, r0, r1, g->cols, g->xqi + t0 * g->cols,
                  g->xdi + t0 * nb, g->xsi + t0 * 2 * nb, g->xs16i + t0 * 2 * nb, m,
                  out + t0 * ldo, ldo);
    }
}

typedef struct {
    dot_fn dot;
    dotk_fn kdot;
    const uint8_t *w;
    int64_t row_bytes;
    const groups_t *groups;
    float *out;
    int64_t ldo;
} matvec_job_t;

static void matvec_rows(const void *ctx, int r0, int r1) {
    const matvec_job_t *j = ctx;
    matvec_groups(j->dot, j->kdot, j->w, j->row_bytes, r0, r1, j->groups, j->out, j->ldo);
}

/* out (n, rows) = w (rows, cols) . x^T from quantized activations (Q8_K for K-quants, else
 * Q8_0), on the caller and nthreads - 1 helpers; each row's blocks are unpacked once per
 * group of MAXN tokens. Returns 0, or -1 when the activation buffers cannot be allocated. */
static int matvec_mt(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
                     const int8_t *xq, const float *xd, const int32_t *xs, int n, float *out,
                     int nthreads) {
    const int kq = is_kquant(qtype);
    groups_t g;
    if (!groups_init(&g, xq, xd, xs, n, cols, kq)) {
        groups_free(&g);
        return -1;
    }
    matvec_job_t j = {dot_for(qtype), dotk_for(qtype), w, row_bytes, &g, out, rows};
    parallel_matvec(matvec_rows, &j, rows, nthreads, n);
    groups_free(&g);
    return 0;
}

/* x (n, cols) f32 rounded to int8 as llama.cpp rounds activations against qtype: Q8_K (one
 * scale per 256) for K-quants, else Q8_0 (per 32); the buffers every matmul entry point uses. */
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

/* Returns 1, or 0 without memory (a is then freed). */
static int acts8_round(acts8_t *a, int qtype, const float *x, int n, int cols) {
    a->xq = malloc((size_t)n * cols);
    a->xd = malloc(sizeof(float) * n * (cols / 32));
    a->xs = malloc(sizeof(int32_t) * n * (cols / 16));
    if (!a->xq || !a->xd || !a->xs) {
        acts8_free(a);
        return 0;
    }
    if (is_kquant(qtype)) quantize_rows_q8k(x, n, cols, a->xq, a->xd, a->xs);
    else quantize_rows(x, n, cols, a->xq, a->xd, a->xs);
    return 1;
}

/* ---- several mat-vecs over the same input in one parallel job ------------------------------
 * Decode multiplies one activation row by Q, K and V (or gate and up) in turn. Done as one job,
 * the activations are rounded once per family (Q8_K for K-quants, Q8_0 for the rest), the
 * helpers are woken once, and the small K/V matrices share the chunks with Q instead of being
 * split alone across threads. Each matrix's rows keep their own chunks, so every row runs the
 * same kernel as in a single mat-vec and the results are bit-identical to it. */

#define MULTI_MAX 8

typedef struct {
    int count;
    int first_chunk[MULTI_MAX + 1];  /* matrix i owns chunks [first_chunk[i], first_chunk[i+1]) */
    int rows[MULTI_MAX];
    matvec_job_t jobs[MULTI_MAX];
} multi_job_t;

/* The matrix of a multi job that owns chunk c (matrix i owns chunks [first_chunk[i],
 * first_chunk[i + 1])), and c's rows in it, [*lr0, *lr1). */
static int chunk_owner(const int *first_chunk, const int *rows, int c, int *lr0, int *lr1) {
    int i = 0;
    while (c >= first_chunk[i + 1]) i++;
    *lr0 = (c - first_chunk[i]) * CHUNK_ROWS;
    *lr1 = *lr0 + CHUNK_ROWS < rows[i] ? *lr0 + CHUNK_ROWS : rows[i];
    return i;
}

static void multi_rows(const void *ctx, int r0, int r1) {
    (void)r1;
    const multi_job_t *m = ctx;
    int lr0, lr1;
    const int i = chunk_owner(m->first_chunk, m->rows, r0 / CHUNK_ROWS, &lr0, &lr1);
    matvec_rows(&m->jobs[i], lr0, lr1);
}

/* outs of `count` matrices (all `cols` wide) for the same x (n, cols) f32, n <= MAXN; matrix
 * i's (n, rows[i]) result is stored at out + n * (rows[0] + ... + rows[i-1]). Returns 0, -1
 * without memory, -2 for a type without C kernels, n > MAXN or count > MULTI_MAX. */
int ek_matvec_multi(int count, const int *qtypes, const uint8_t *const *ws,
                    const int64_t *row_bytes, const int *rows, int cols, const float *x, int n,
                    float *out, int nthreads) {
    if (count < 1 || count > MULTI_MAX || n < 1 || n > MAXN || cols % 32) return -2;
    int need[2] = {0, 0};  /* activation families used: [0] Q8_0, [1] Q8_K */
    for (int i = 0; i < count; i++) {
        if (!ek_supports(qtypes[i]) || (is_kquant(qtypes[i]) && cols % 256)) return -2;
        need[is_kquant(qtypes[i])] = 1;
    }
    int8_t *xq = malloc((size_t)n * cols);
    float *xd = malloc(sizeof(float) * n * (cols / 32));
    int32_t *xs = malloc(sizeof(int32_t) * n * (cols / 16));
    groups_t g[2];
    int ready[2] = {0, 0}, status = -1;
    memset(g, 0, sizeof g);
    if (xq && xd && xs) {
        status = 0;
        for (int kq = 0; kq < 2 && status == 0; kq++) {
            if (!need[kq]) continue;
            if (kq) quantize_rows_q8k(x, n, cols, xq, xd, xs);
            else quantize_rows(x, n, cols, xq, xd, xs);
            ready[kq] = groups_init(&g[kq], xq, xd, xs, n, cols, kq);
            if (!ready[kq]) status = -1;
        }
    }
    if (status == 0) {
        multi_job_t m = {.count = count};
        int64_t offset = 0;
        for (int i = 0; i < count; i++) {
            const int kq = is_kquant(qtypes[i]);
            m.rows[i] = rows[i];
            m.first_chunk[i + 1] = m.first_chunk[i] + (rows[i] + CHUNK_ROWS - 1) / CHUNK_ROWS;
            matvec_job_t j = {dot_for(qtypes[i]), dotk_for(qtypes[i]), ws[i], row_bytes[i],
                              &g[kq], out + offset, rows[i]};
            m.jobs[i] = j;
            offset += (int64_t)n * rows[i];
        }
        parallel_matvec(multi_rows, &m, m.first_chunk[count] * CHUNK_ROWS, nthreads, n);
    }
    for (int kq = 0; kq < 2; kq++)
        if (need[kq]) groups_free(&g[kq]);
    free(xq);
    free(xd);
    free(xs);
    return status;
}

/* ---- elementwise ----------------------------------------------------------------------- */

/* e^x for 8 lanes: x = k ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 Taylor polynomial
 * (truncation error < 2e-9 relative, under f32 rounding; degree 6, at 1.2e-7, cost the 1.5B
 * two of 152 decode matches with llama.cpp), 2^k built in the exponent bits. Inputs below -87
 * give 0 (as expf's denormal range), above 88 give +inf. */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.0f), lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* k in [-126, 128): 2^k as bits; k = 128 (x near 88.7) overflows to inf as it should */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    __m256 res = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, res);
}

/* out = silu(gate) * up = gate / (1 + e^-gate) * up over n floats (SwiGLU). */
static void silu_mul(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, den), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* out = gelu(gate) * up with GELU's tanh form, tanh(y) = 1 - 2 / (e^(2y) + 1) (GeGLU). */
static void gelu_tanh_mul(const float *gate, const float *up, float *out, int64_t n) {
    const __m256 c = _mm256_set1_ps(0.7978845608f), k = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 y = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(k, g), _mm256_mul_ps(g, g), g));
        __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_add_ps(y, y)), one)));
        __m256 r = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, th));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(r, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        const float g = gate[i];
        out[i] = 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g))) * up[i];
    }
}

/* out = x / sqrt(mean(x^2) + eps) * w, row by row: x, out (rows, d) f32, w (d,). As ggml: the
 * squares in f32, summed in f64, the mean rounded to f32, then (x * scale) * w. */
void ek_rms_norm(const float *x, const float *w, float *out, int64_t rows, int d, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *o = out + r * d;
        __m256d s4 = _mm256_setzero_pd();
        int i = 0;
        for (; i + 4 <= d; i += 4) {
            const __m128 v = _mm_loadu_ps(xr + i);
            s4 = _mm256_add_pd(s4, _mm256_cvtps_pd(_mm_mul_ps(v, v)));
        }
        __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
        double ss = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
        for (; i < d; i++) ss += (double)(xr[i] * xr[i]);
        const float mean = (float)(ss / d);
        const float scale = 1.0f / sqrtf(mean + eps);
        const __m256 iv = _mm256_set1_ps(scale);
        for (i = 0; i + 8 <= d; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), iv),
                                                  _mm256_loadu_ps(w + i)));
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
                int i = 0;
                for (; i + 8 <= half; i += 8) {
                    const __m256 a = _mm256_loadu_ps(xh + i), b = _mm256_loadu_ps(xh + i + half);
                    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                    _mm256_storeu_ps(o + i, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
                    _mm256_storeu_ps(o + i + half, _mm256_fmadd_ps(a, sv, _mm256_mul_ps(b, cv)));
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

/* src (n,) f32 stored as f16 bits at dst, rounded to nearest, ties to even (numpy's
 * astype(float16) rounding); n % 8 == 0 */
static void f16_store_row(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

/* 16 f16 values at p as f32 */
static inline __m256 load_f16x8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Attention over an f16 KV cache, flash style: q (n, H, hd) f32; k, v (T, KVH, hd) f16 bits;
 * mask (n, T) (nonzero: attend); out (n, H, hd); hd % 8 == 0. Scores, softmax and the weighted
 * sum in f32. (Rounding q and the probabilities to f16 as llama.cpp's non-flash path does was
 * tried: it moved no reference agreement up, Gemma's and Qwen's down.)
 *
 * The unit of work is one KV head and a block of ATTN_QBLOCK tokens: up to ATTN_QBLOCK x G
 * query rows that read the same keys (GQA). Keys are taken ATTN_KBLOCK at a time, always at
 * multiples of ATTN_KBLOCK, and converted from f16 once per unit: K transposed to (hd, 16),
 * so that a row's 16 scores are 2 x hd FMAs of a broadcast query value, and V as (16, hd).
 * Up to four query heads of a token go together, sharing every load of K and V. The softmax
 * is online (a running max and sum per row, the row's accumulator rescaled when its max
 * grows), so a unit's memory does not grow with the context. (Two passes, the exact max
 * first, were tried: no closer to llama.cpp's logits, and 20% slower.)
 *
 * A row's arithmetic depends only on its own query and mask (masked keys add exact zeros and
 * leave its state as it was), so a token's result does not depend on the others in the
 * batch: decode, a speculative check and a prompt give the same numbers. */

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

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* r[i] <- column i of the 8x8 matrix whose rows are r[0..7] */
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* keys j0.. of KV head kh as kt (hd, 16) and vb (16, hd) in f32; keys past T are zeros */
static void load_key_block(const attn_job_t *a, int kh, int j0, float *kt, float *vb) {
    const int hd = a->hd;
    for (int half = 0; half < ATTN_KBLOCK; half += 8) {
        const uint16_t *krow[8], *vrow[8];
        for (int jj = 0; jj < 8; jj++) {
            const int j = j0 + half + jj;
            const int64_t at = ((int64_t)j * a->n_kv + kh) * hd;
            krow[jj] = j < a->T ? a->k + at : 0;
            vrow[jj] = j < a->T ? a->v + at : 0;
        }
        for (int d = 0; d < hd; d += 8) {
            __m256 r[8];
            for (int jj = 0; jj < 8; jj++) {
                r[jj] = krow[jj] ? load_f16x8(krow[jj] + d) : _mm256_setzero_ps();
                _mm256_storeu_ps(vb + (int64_t)(half + jj) * hd + d,
                                 vrow[jj] ? load_f16x8(vrow[jj] + d) : _mm256_setzero_ps());
            }
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (d + i) * ATTN_KBLOCK + half, r[i]);
        }
    }
}

/* Fold one block of keys into NG (1..4) query rows of one token: q (NG rows, hd apart),
 * bias (16,) 0 or -inf per key; acc (NG, hd), mx and sum (NG,) the rows' running state.
 * Inlined per NG so the row arrays live in registers. */
static inline __attribute__((always_inline)) void
fold_rows(const attn_job_t *a, const float *q, const int NG, const float *kt, const float *vb,
          const float *bias, float *acc, float *mx, float *sum) {
    const int hd = a->hd;
    __m256 s0[4], s1[4];
#if defined(__AVX512F__)
    /* a row's 16 scores in one register: each lane's FMAs in the same order as the two
     * 8-lane halves below, so the same bits in half the instructions */
    __m512 s[4];
    for (int g = 0; g < NG; g++) s[g] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        const __m512 k = _mm512_loadu_ps(kt + d * 16);
        for (int g = 0; g < NG; g++)
            s[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[(int64_t)g * hd + d]), k, s[g]);
    }
    for (int g = 0; g < NG; g++) {
        s0[g] = _mm512_castps512_ps256(s[g]);
        s1[g] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s[g]), 1));
    }
#else
    for (int g = 0; g < NG; g++) s0[g] = s1[g] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);
        for (int g = 0; g < NG; g++) {
            const __m256 b = _mm256_broadcast_ss(q + (int64_t)g * hd + d);
            s0[g] = _mm256_fmadd_ps(b, k0, s0[g]);
            s1[g] = _mm256_fmadd_ps(b, k1, s1[g]);
        }
    }
#endif
    float pv[4][ATTN_KBLOCK], corr[4];
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int g = 0; g < NG; g++) {
        __m256 x0 = _mm256_mul_ps(s0[g], scale), x1 = _mm256_mul_ps(s1[g], scale);
        if (a->softcap > 0.0f) {
            _mm256_storeu_ps(pv[g], x0);
            _mm256_storeu_ps(pv[g] + 8, x1);
            for (int i = 0; i < ATTN_KBLOCK; i++)
                pv[g][i] = a->softcap * tanhf(pv[g][i] / a->softcap);
            x0 = _mm256_loadu_ps(pv[g]), x1 = _mm256_loadu_ps(pv[g] + 8);
        }
        x0 = _mm256_add_ps(x0, _mm256_loadu_ps(bias));
        x1 = _mm256_add_ps(x1, _mm256_loadu_ps(bias + 8));
        const float top = hmax8(_mm256_max_ps(x0, x1));
        const float best = top > mx[g] ? top : mx[g];  /* not libm: see acts8_round */
        if (best == -INFINITY) {  /* nothing this row may attend to yet: leave it as it is */
            corr[g] = 1.0f;
            for (int i = 0; i < ATTN_KBLOCK; i++) pv[g][i] = 0.0f;
            continue;
        }
        /* 0 on the first block the row reaches (exp8, not SSE expf: see acts8_round) */
        corr[g] = _mm256_cvtss_f32(exp8(_mm256_set1_ps(mx[g] - best)));
        const __m256 p0 = exp8(_mm256_sub_ps(x0, _mm256_set1_ps(best)));
        const __m256 p1 = exp8(_mm256_sub_ps(x1, _mm256_set1_ps(best)));
        mx[g] = best;
        sum[g] = sum[g] * corr[g] + hsum8(_mm256_add_ps(p0, p1));
        _mm256_storeu_ps(pv[g], p0);
        _mm256_storeu_ps(pv[g] + 8, p1);
    }
    int d0 = 0;
#if defined(__AVX512F__)
    for (; d0 + 16 <= hd; d0 += 16) {  /* 16 lanes of the row at a time, the same per lane */
        __m512 x[4];
        for (int g = 0; g < NG; g++)
            x[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)g * hd + d0),
                                 _mm512_set1_ps(corr[g]));
        for (int jj = 0; jj < ATTN_KBLOCK; jj++) {
            const __m512 vv = _mm512_loadu_ps(vb + (int64_t)jj * hd + d0);
            for (int g = 0; g < NG; g++)
                x[g] = _mm512_fmadd_ps(_mm512_set1_ps(pv[g][jj]), vv, x[g]);
        }
        for (int g = 0; g < NG; g++) _mm512_storeu_ps(acc + (int64_t)g * hd + d0, x[g]);
    }
#endif
    for (int d = d0; d < hd; d += 8) {
        __m256 x[4];
        for (int g = 0; g < NG; g++)
            x[g] = _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)g * hd + d),
                                 _mm256_set1_ps(corr[g]));
        for (int jj = 0; jj < ATTN_KBLOCK; jj++) {
            const __m256 vv = _mm256_loadu_ps(vb + (int64_t)jj * hd + d);
            for (int g = 0; g < NG; g++)
                x[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&pv[g][jj]), vv, x[g]);
        }
        for (int g = 0; g < NG; g++) _mm256_storeu_ps(acc + (int64_t)g * hd + d, x[g]);
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


