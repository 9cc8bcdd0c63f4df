/* Prefill GEMM on AVX-512 VNNI, for every quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
 * Q5_K, Q6_K): out (n, rows) = w (rows, cols) . x (n, cols)^T with int8 activations.
 *
 * Compiled as one unit after cpu_kernels.c (it uses its block helpers and thread pool).
 *
 * Rows in lanes. Each chunk of CHUNK_ROWS = 16 weight rows (one zmm of 16 int32 lanes) is
 * unpacked once into unsigned bytes laid out (cols / 4, 16 rows, 4): the 64 bytes of one
 * column group hold 4 consecutive weights of each row. vpdpbusd of that vector with token t's
 * 4 activations broadcast ({1to16}, straight from memory) adds to lane r the 4-term dot of row
 * r with t, so a register tile of 16 rows x GEMM_T tokens needs one weight load per GEMM_T
 * vpdpbusd and no horizontal sums anywhere: lane r of token t's accumulator is out[t][r],
 * stored as it is.
 *
 * Per sub-block s of L columns (32; 16 for Q6_K, whose scales are per 16) a row's weights are
 *       w = scale_s * q + minv_s                           (q unsigned, 0..255)
 * (K-quants: scale_s = d sc_s, minv_s = -dmin m_s, kept as integers sc_s, m_s and d, dmin)
 * so for token t, with int8 activations xq and scale xd,
 *       sum_s(w x) = scale_s xd (dot_s(q, xq) - off sum_s(xq)) + minv_s xd sum_s(xq)
 * where the offset types (Q4_0 off 8, Q5_0 16, Q8_0 128, Q6_K 32) have minv = -off scale and
 * the types with a stored minimum (Q4_1, Q5_1, Q4_K, Q5_K) have off = 0. The integer part
 * accumulates exactly in int32 over the whole sub-block (L / 4 vpdpbusd), starting from the
 * token's -off sum_s(xq) (a broadcast load, no arithmetic); only then does it meet floats:
 *   per-block types: acc += cvt(i) * (scale_s * xd_t,s)    [+ minv_s * (xd sum)_t,s]
 *   K-quants (xd per 256), as llama.cpp: isum += i * sc_s and imin += sum_t,s * m_s in int32
 *   (the integer 6/8-bit scales and minimums), and once per superblock
 *   acc += cvt(isum) * d xd_t - cvt(imin) * dmin xd_t.
 * That is 1-4 operations per token per 32 (Q6_K: 16) columns against 8 (4) vpdpbusd, where
 * the previous design (one block's dot per vpdpbusd, then cvt, mul and fma, and a horizontal
 * sum per output) spent 3 float operations per vpdpbusd. (Float per sub-block for K-quants
 * was 12% faster at 4 tokens; the exact integer sums keep llama.cpp's rounding.)
 *
 * The activations are repacked once per call so that one column group of a token tile is
 * GEMM_T consecutive 4-byte words, with their per-sub-block side values alongside. Weights
 * are decoded 256 columns x 16 rows at a time and transposed into the lane layout in
 * registers; units of work are up to GEMM_GROUP chunks, so a token tile's activations are
 * reused from cache across them.
 *
 * Measured, one thread of this 2-core AVX-512 VNNI VM (shared: single runs vary by up to
 * ~30%, so these are the best matmul of 9 per variant, interleaved), GFLOP/s before (previous
 * tile GEMM for per-block types, mat-vec kernels for K-quants) -> now, 512 tokens:
 *   Q4_K 8960 x 1536  113 -> 437      Q6_K 1536 x 8960  109 -> 412
 *   Q5_0 2048 x 640    83 -> 429      Q4_K 1536 x 1536  113 -> 458
 *   2048 x 2048: Q4_0 107 -> 439, Q4_1 76 -> 379, Q5_0 110 -> 434, Q5_1 108 -> 375,
 *                Q8_0 117 -> 436, Q4_K 112 -> 453, Q5_K 103 -> 451, Q6_K 108 -> 408
 * With few tokens the unpack weighs more: 16 tokens, Q4_K 8960 x 1536 114 -> 171, Q4_0
 * 2048 x 2048 27 -> 170; 9 tokens (a tile of 8, one of 1) Q4_K 8960 x 1536 106 -> 113.
 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_GEMM 1  /* the file-block GEMM and the packed tiles below are AVX-512; the AVX2
                        build shares the activation and chunk layouts (cpu_packed.c) */
#endif

#ifndef GEMM_T
#define GEMM_T 8  /* tokens per register tile: 8 int32 + 8 (K-quants 16) f32 accumulators;
                     6, 10 and 12 measured no faster */
#endif
#ifndef GEMM_GROUP
#define GEMM_GROUP 4  /* chunks of rows per unit of work (gemm_unit) */
#endif
_Static_assert(CHUNK_ROWS == 16, "a chunk's rows fill the 16 int32 lanes of a zmm");
_Static_assert(GEMM_T == 8, "the tile switches compile every length 1..8");

/* How a type's weights meet the activations. */
typedef struct {
    int L;    /* columns per scale (sub-block) */
    int kq;   /* K-quant: Q8_K activations, one xd per 256 columns */
    int min;  /* a stored minimum per sub-block (minv), else the offset off */
    int off;  /* q - off is the signed weight (offset types) */
} form_t;

static form_t form_of(int qtype) {
    switch (qtype) {
    case T_Q4_0: return (form_t){32, 0, 0, 8};
    case T_Q5_0: return (form_t){32, 0, 0, 16};
    case T_Q8_0: return (form_t){32, 0, 0, 128};
    case T_Q4_1: case T_Q5_1: return (form_t){32, 0, 1, 0};
    case T_Q4_K: case T_Q5_K: return (form_t){32, 1, 1, 0};
    case T_Q6_K: return (form_t){16, 1, 0, 32};
    default: return (form_t){0, 0, 0, 0};
    }
}

/* Token tiles: GEMM_T tokens each, the rest in one tile (each size 1..GEMM_T its own compiled
 * kernel, so a ragged batch runs no padding tokens, and a speculative check of up to GEMM_T
 * tokens reads each weight once). */
static inline int tile_len(int left) { return left >= GEMM_T ? GEMM_T : left; }

/* ---- activations: all tokens, repacked once per call -------------------------------------
 * Token tile [t0, t0 + T) starts at t0 tokens' worth of each array; inside it
 *   x:  (cols / 4, T, 4) int8     the T tokens' 4 activations of each column group
 *   xc: (cols / L, T) int32        -off * sum_s(xq): the offset types' integer start
 *   f1: per-block types (cols / 32, T) xd; K-quants (cols / 256, T) xd
 *   f2: (cols / 32, T) per-block min types: xd * sum_s(xq) (K-quants take their sums from xc)
 *   xp: (cols / L / 2, T) K-quants: sum_s(xq) of sub-blocks 2i, 2i + 1 as one int32 of two
 *       int16 (|sum| <= 32 * 127), the operand vpmaddwd pairs with two sub-blocks' minimums
 *       or scales (the AVX2 tiles) */
typedef struct {
    int8_t *x;
    int32_t *xc, *xp;
    float *f1, *f2;
} gemm_acts_t;

static void acts_free(gemm_acts_t *a) {
    free(a->x);
    free(a->xc);
    free(a->xp);
    free(a->f1);
    free(a->f2);
}

/* One token (xq, xd, xs as quantize_rows / quantize_rows_q8k give them) into slot t of a tile
 * of T whose arrays start at x, xc, f1, f2. */
static void acts_token(form_t f, int cols, const int8_t *xq, const float *xd, const int32_t *xs,
                       int T, int t, int8_t *x, int32_t *xc, int32_t *xp, float *f1, float *f2) {
    for (int k = 0; k < cols / 4; k++) memcpy(x + 4 * ((int64_t)k * T + t), xq + 4 * k, 4);
    for (int s = 0; s < cols / f.L; s++) {
        const int32_t sum = f.L == 16 ? xs[s] : xs[2 * s] + xs[2 * s + 1];
        xc[(int64_t)s * T + t] = f.min ? sum : -f.off * sum;  /* min types: the sum itself */
        if (f.kq && s % 2 == 0) xp[(int64_t)s / 2 * T + t] = (int32_t)((uint32_t)sum & 0xFFFFu);
        if (f.kq && s % 2 == 1) xp[(int64_t)s / 2 * T + t] |= (int32_t)((uint32_t)sum << 16);
    }
    for (int b = 0; b < cols / 32; b++) {
        const int32_t sum = xs[2 * b] + xs[2 * b + 1];
        if (!f.kq) {
            f1[(int64_t)b * T + t] = xd[b];
            f2[(int64_t)b * T + t] = xd[b] * (float)sum;
        } else if (b % 8 == 0) {
            f1[(int64_t)(b / 8) * T + t] = xd[b];
        }
    }
}

static int acts_init(gemm_acts_t *a, form_t f, const int8_t *xq, const float *xd,
                     const int32_t *xs, int n, int cols) {
    const int nb = cols / 32;
    a->x = malloc((size_t)n * cols);
    a->xc = malloc(sizeof(int32_t) * n * (cols / 16));
    a->xp = malloc(sizeof(int32_t) * n * (cols / 32));
    a->f1 = malloc(sizeof(float) * n * nb);
    a->f2 = malloc(sizeof(float) * n * nb);
    if (!a->x || !a->xc || !a->xp || !a->f1 || !a->f2) return 0;
    for (int t0 = 0, T; t0 < n; t0 += T) {
        T = tile_len(n - t0);
        for (int t = 0; t < T; t++) {
            const int64_t tok = t0 + t;
            acts_token(f, cols, xq + tok * cols, xd + tok * nb, xs + tok * 2 * nb, T, t,
                       a->x + (int64_t)t0 * cols, a->xc + (int64_t)t0 * (cols / f.L),
                       a->xp + (int64_t)t0 * (cols / f.L / 2), a->f1 + (int64_t)t0 * nb,
                       a->f2 + (int64_t)t0 * nb);
        }
    }
    return 1;
}

/* ---- weights: one chunk of rows, unpacked per thread -------------------------------------
 *   q:     (cols / 4, 16, 4) unsigned bytes, rows in lanes
 *   per-block types: scale (cols / 32, 16) f32 d, minv (cols / 32, 16) f32 m (Q4_1, Q5_1)
 *   K-quants: scale (cols / L, 16) int32 sub-block scales, minv (cols / 32, 16) int32
 *             minimums (Q4_K, Q5_K), dd (cols / 256, 2, 16) f32 d and dmin per superblock */
#define SPAN 256  /* columns decoded per row before their transpose into q */

typedef struct {
    uint8_t *q;
    uint8_t *tmp;  /* (16, SPAN): each row's q of one span in column order */
    float *scale, *minv, *dd;
    size_t cap;    /* columns the buffers hold */
} chunk_t;

static __thread chunk_t tl_chunks[GEMM_GROUP];  /* grown on demand, per thread, never freed */

static int chunk_reserve(chunk_t *u, int cols) {
    if (u->cap >= (size_t)cols) return 1;
    free(u->q);
    free(u->tmp);
    free(u->scale);
    free(u->minv);
    free(u->dd);
    /* 64-byte aligned: every zmm load of a chunk is one cache line; q whole 64-column pieces */
    u->q = aligned_alloc(64, (size_t)CHUNK_ROWS * ((cols + 63) / 64 * 64));
    u->tmp = aligned_alloc(64, (size_t)CHUNK_ROWS * SPAN);
    u->scale = aligned_alloc(64, sizeof(float) * cols);  /* 16 lanes x cols / 16 at most */
    u->minv = aligned_alloc(64, sizeof(float) * cols / 2);
    u->dd = aligned_alloc(64, sizeof(float) * ((cols + 255) / 256) * 32);
    u->cap = u->q && u->tmp && u->scale && u->minv && u->dd ? (size_t)cols : 0;
    return u->cap != 0;
}

/* Row decoders: q (cols bytes, column order) and the row's lane of scale / minv (stride 16). */

static void decode_q8_0(const uint8_t *w, int nb, uint8_t *q, float *sc) {
    for (int b = 0; b < nb; b++, w += 34, q += 32) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 2));
        _mm256_storeu_si256((__m256i *)q, _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)));
        sc[16 * b] = f16(w);
    }
}

/* Q4_0, Q4_1, Q5_0, Q5_1: low nibbles are elements 0..15, high 16..31, qh bit i element i */
static void decode_q4_q5(const uint8_t *w, int nb, int one, int five, uint8_t *q, float *sc,
                         float *mn) {
    const int bytes = 18 + 2 * one + 4 * five;
    for (int b = 0; b < nb; b++, w += bytes, q += 32) {
        __m256i v = nibbles16(w + 2 + 2 * one + 4 * five);
        if (five) {
            uint32_t qh;
            memcpy(&qh, w + 2 + 2 * one, 4);
            v = _mm256_or_si256(v, bits_to_0x10(qh));
        }
        _mm256_storeu_si256((__m256i *)q, v);
        sc[16 * b] = f16(w);
        if (one) mn[16 * b] = f16(w + 2);
    }
}

/* Q4_K / Q5_K: 32 bytes of qs per 64 elements (low nibbles first); Q5_K's fifth bits are
 * bits 2j (first 32) and 2j + 1 (second 32) of qh[0..31]. */
static void decode_qk(const uint8_t *w, int nsb, int five, uint8_t *q, int32_t *sc, int32_t *mn,
                      float *dd) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int sb = 0; sb < nsb; sb++, w += five ? 176 : 144, q += 256) {
        const float d = f16(w), dmin = f16(w + 2);
        const uint8_t *qs = w + (five ? 48 : 16);
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)(w + 16));
        uint8_t s[8], m[8];
        scales_mins_k4(w + 4, s, m);
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(raw, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            if (five) {
                const __m256i h = _mm256_srli_epi16(hbits, 2 * j);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                                             _mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
            }
            _mm256_storeu_si256((__m256i *)(q + 64 * j), lo);
            _mm256_storeu_si256((__m256i *)(q + 64 * j + 32), hi);
        }
        for (int j = 0; j < 8; j++) {
            sc[16 * (8 * sb + j)] = s[j];
            mn[16 * (8 * sb + j)] = m[j];
        }
        dd[32 * sb] = d;
        dd[32 * sb + 16] = dmin;
    }
}

/* Q6_K: per 128 elements, ql[0..63] and qh[0..31]: element 32i + l takes a nibble of
 * ql[l + 32 (i & 1)] (low for i < 2) and bits 2i, 2i + 1 of qh[l]; scales are int8 per 16. */
static void decode_q6k(const uint8_t *w, int nsb, uint8_t *q, int32_t *sc, float *dd) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    for (int sb = 0; sb < nsb; sb++, w += 210, q += 256) {
        const float d = f16(w + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i qa = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            const __m256i qb = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            const __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(qa, low4),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 4), hi2)),
                _mm256_or_si256(_mm256_and_si256(qb, low4),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 2), hi2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                                _mm256_and_si256(qh, hi2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), hi2)),
            };
            for (int i = 0; i < 4; i++)
                _mm256_storeu_si256((__m256i *)(q + 128 * h + 32 * i), v[i]);
        }
        for (int j = 0; j < 16; j++) sc[16 * (16 * sb + j)] = (int8_t)w[192 + j];
        dd[32 * sb] = d;
    }
}

/* 16 rows of 64 bytes (src, stride apart) -> dst (16, 16, 4): dword k of row r to dst + 64 k
 * + 4 r. Three rounds of in-lane unpacks and 128-bit shuffles, no scalar dword moves (AVX2
 * only packs at load, where dword copies are fast enough). */
#if !defined(HAVE_GEMM)
static void transpose16(const uint8_t *src, int stride, uint8_t *dst) {
    for (int r = 0; r < 16; r++)
        for (int k = 0; k < 16; k++) memcpy(dst + 64 * k + 4 * r, src + (int64_t)r * stride + 4 * k, 4);
}
#else
static void transpose16(const uint8_t *src, int stride, uint8_t *dst) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(src + (int64_t)i * stride);
    for (int i = 0; i < 8; i++) {  /* lane l: (row 2i, 2i + 1) x elements 4l + {0,1} / {2,3} */
        t[i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[8 + i] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++)  /* v[4 e' + g]: rows 4g..4g+3 of element 4l + 2h + e' */
        for (int g = 0; g < 4; g++) {
            r[8 * h + g] = _mm512_unpacklo_epi64(t[8 * h + 2 * g], t[8 * h + 2 * g + 1]);
            r[8 * h + 4 + g] = _mm512_unpackhi_epi64(t[8 * h + 2 * g], t[8 * h + 2 * g + 1]);
        }
    for (int e = 0; e < 4; e++) {  /* element e of each lane l: gather lane l of the 4 groups */
        const __m512i *v = r + 4 * e;
        const __m512i a = _mm512_shuffle_i32x4(v[0], v[1], 0x44);  /* lanes 0, 1 of v0, v1 */
        const __m512i b = _mm512_shuffle_i32x4(v[0], v[1], 0xEE);  /* lanes 2, 3 */
        const __m512i c = _mm512_shuffle_i32x4(v[2], v[3], 0x44);
        const __m512i d = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
        _mm512_store_si512(dst + 64 * (0 + e), _mm512_shuffle_i32x4(a, c, 0x88));
        _mm512_store_si512(dst + 64 * (4 + e), _mm512_shuffle_i32x4(a, c, 0xDD));
        _mm512_store_si512(dst + 64 * (8 + e), _mm512_shuffle_i32x4(b, d, 0x88));
        _mm512_store_si512(dst + 64 * (12 + e), _mm512_shuffle_i32x4(b, d, 0xDD));
    }
}
#endif

/* Bytes of SPAN columns of a row (SPAN / 32 blocks, or one superblock). */
static int span_bytes(int qtype) {
    switch (qtype) {
    case T_Q8_0: return 8 * 34;
    case T_Q4_0: return 8 * 18;
    case T_Q4_1: return 8 * 20;
    case T_Q5_0: return 8 * 22;
    case T_Q5_1: return 8 * 24;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    default: return 210;  /* Q6_K */
    }
}

/* Columns [c0, c0 + span) of one row (ggml blocks at w, c0 a multiple of SPAN) into row
 * `lane` of u->tmp, and the row's lane of their scales / minima. */
static void decode_span(int qtype, const uint8_t *w, int c0, int span, chunk_t *u, int lane) {
    uint8_t *q = u->tmp + SPAN * lane;
    const int nb = span / 32, nsb = span / 256;
    float *sc32 = u->scale + 16 * (c0 / 32) + lane, *mn32 = u->minv + 16 * (c0 / 32) + lane;
    float *dd = u->dd + 32 * (c0 / 256) + lane;
    w += (int64_t)c0 / SPAN * span_bytes(qtype);
    switch (qtype) {
    case T_Q8_0: decode_q8_0(w, nb, q, sc32); break;
    case T_Q4_0: decode_q4_q5(w, nb, 0, 0, q, sc32, mn32); break;
    case T_Q4_1: decode_q4_q5(w, nb, 1, 0, q, sc32, mn32); break;
    case T_Q5_0: decode_q4_q5(w, nb, 0, 1, q, sc32, mn32); break;
    case T_Q5_1: decode_q4_q5(w, nb, 1, 1, q, sc32, mn32); break;
    case T_Q4_K: decode_qk(w, nsb, 0, q, (int32_t *)sc32, (int32_t *)mn32, dd); break;
    case T_Q5_K: decode_qk(w, nsb, 1, q, (int32_t *)sc32, (int32_t *)mn32, dd); break;
    case T_Q6_K: decode_q6k(w, nsb, q, (int32_t *)u->scale + 16 * (c0 / 16) + lane, dd); break;
    }
}

/* Rows [r0, r0 + nr) (nr <= 16) of w into u, a span of columns at a time so that the decoded
 * rows and their transpose stay in L1; lanes past nr hold zero weights and scales. */
static void unpack_chunk(int qtype, const uint8_t *w, int64_t row_bytes, int nr, int cols,
                         chunk_t *u) {
    if (nr < CHUNK_ROWS) {
        memset(u->tmp, 0, (size_t)CHUNK_ROWS * SPAN);
        memset(u->scale, 0, sizeof(float) * cols);
        memset(u->minv, 0, sizeof(float) * cols / 2);
        memset(u->dd, 0, sizeof(float) * ((cols + 255) / 256) * 32);
    }
    const int sbytes = span_bytes(qtype);
    for (int c0 = 0; c0 < cols; c0 += SPAN) {
        const int span = cols - c0 < SPAN ? cols - c0 : SPAN;
        /* the next span's blocks: 16 short runs, row_bytes apart, that the hardware
         * prefetchers miss (Q4_K 8960 x 1536 at 16 tokens: 140 GFLOP/s without, 170 with) */
        const uint8_t *next = w + (int64_t)(c0 / SPAN + 1) * sbytes;
        if (c0 + SPAN < cols)
            for (int r = 0; r < nr; r++)
                for (int b = 0; b < sbytes + 64; b += 64)
                    _mm_prefetch((const char *)next + r * row_bytes + b, _MM_HINT_T0);
        for (int r = 0; r < nr; r++) decode_span(qtype, w + r * row_bytes, c0, span, u, r);
        for (int c = 0; c < span; c += 64)  /* a last piece of 32 writes into q's padding */
            transpose16(u->tmp + c, SPAN, u->q + 16 * (int64_t)(c0 + c));
    }
}

#if defined(HAVE_GEMM)
/* ---- the register tile: 16 rows x T tokens over all columns -------------------------------
 * x, xc, f1, f2 point at the token tile's activations; the result goes to out[t * ldo + lane]
 * for the lanes in keep. */

/* acc += w . (x[0..3] broadcast to every lane), the broadcast folded into vpdpbusd's memory
 * operand ({1to16}): one fused uop per product instead of two (gcc 12 emits a separate
 * vpbroadcastd for _mm512_set1_epi32, measured 5-10% slower). */
static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t *x) {
    typedef struct { int8_t b[4]; } four_t;
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const four_t *)x));
    return acc;
}

/* The integer dot of one sub-block (L columns from column group k0) for each token. With few
 * tokens (decode) one accumulator per token would be a chain of dependent vpdpbusd, each
 * waiting out the last one's latency; CHAINS(T) independent partial sums per token are added
 * at the end instead (integers: the same result for any split, so a token's output does not
 * depend on the batch it came in). */
#define CHAINS(T) ((T) >= 4 ? 1 : (T) == 2 ? 2 : 4)

FORCE void sub_dots(const uint8_t *wq, const int8_t *x, const int32_t *xc, int k0, const int L,
                    const int T, const int off, __m512i *acc) {
    const int C = CHAINS(T);
    __m512i part[GEMM_T * 4];  /* (T, C): chain c of token t at part[t * C + c] */
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++)
            part[t * C + c] = off && c == 0 ? _mm512_set1_epi32(xc[t]) : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = k0; k < k0 + L / 4; k++) {
        const __m512i wv = _mm512_load_si512(wq + 64 * (int64_t)k);
        const int c = (k - k0) % C;
        for (int t = 0; t < T; t++)
            part[t * C + c] = dpbusd_bcast(part[t * C + c], wv, x + 4 * ((int64_t)k * T + t));
    }
    for (int t = 0; t < T; t++) {
        acc[t] = part[t * C];
        for (int c = 1; c < C; c++) acc[t] = _mm512_add_epi32(acc[t], part[t * C + c]);
    }
}

FORCE void tile_store(float *out, int64_t ldo, __mmask16 keep, const int T, const __m512 *acc) {
    for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(out + t * ldo, keep, acc[t]);
}

/* Per-block types (L = 32, an xd per 32 columns): nb blocks. */
FORCE void tile_blocks(const chunk_t *u, const int8_t *x, const int32_t *xc, const float *f1,
                       const float *f2, int nb, float *out, int64_t ldo, __mmask16 keep,
                       const int T, const int min) {
    __m512 acc[GEMM_T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int s = 0; s < nb; s++) {
        __m512i dot[GEMM_T];
        sub_dots(u->q, x, xc + s * T, 8 * s, 32, T, !min, dot);
        const __m512 sc = _mm512_load_ps(u->scale + 16 * s);
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]),
                                     _mm512_mul_ps(sc, _mm512_set1_ps(f1[s * T + t])), acc[t]);
        if (min) {
            const __m512 mn = _mm512_load_ps(u->minv + 16 * s);
            for (int t = 0; t < T; t++)
                acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(f2[s * T + t]), acc[t]);
        }
    }
    tile_store(out, ldo, keep, T, acc);
}

/* K-quants (an xd per 256 columns), as llama.cpp sums them: each sub-block's integer dot times
 * its integer scale, and the minimums times the activation sums, accumulated exactly in int32
 * over the superblock; only then are they scaled, by d xd and dmin xd. */
/* imin[t] += m_s * xc_s + m_s+1 * xc_s+1 for two sub-blocks s, s + 1 of each token t: mn holds
 * each lane's (m_s, m_s+1) as an int16 pair, xc the sums (xc_s for every token, then xc_s+1).
 * m <= 63 and |xc| <= 32 * 128 fit int16 and vpdpwssd sums in int32 exactly, so the result is
 * the same number as multiplying and adding each, with one instruction where two vpmulld
 * (2 uops each, on the port the dot products need) and adds took four. */
FORCE void min_pair_dots(__m512i mn, const int32_t *xc, const int T, __m512i *imin) {
    for (int t = 0; t < T; t++)
        imin[t] = _mm512_dpwssd_epi32(imin[t], mn, _mm512_set1_epi32((int32_t)(
                      ((uint32_t)xc[t] & 0xFFFFu) | ((uint32_t)xc[T + t] << 16))));
}

FORCE void kquant_fold(const __m512 d, const __m512 dmin, const float *f1, const int T,
                       const int min, const __m512i *isum, const __m512i *imin, __m512 *acc) {
    for (int t = 0; t < T; t++) {
        const __m512 xd = _mm512_set1_ps(f1[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, xd), acc[t]);
        if (min)
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[t]), _mm512_mul_ps(dmin, xd), acc[t]);
    }
}

FORCE void tile_kquant(const chunk_t *u, const int8_t *x, const int32_t *xc, const float *f1,
                       const float *f2, int nsb, float *out, int64_t ldo, __mmask16 keep,
                       const int T, const int L, const int min) {
    (void)f2;
    const int G = 256 / L;  /* sub-blocks per superblock */
    __m512 acc[GEMM_T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        __m512i isum[GEMM_T], imin[GEMM_T];
        for (int t = 0; t < T; t++) isum[t] = imin[t] = _mm512_setzero_si512();
        for (int j = 0; j < G; j++) {
            const int s = sb * G + j;
            __m512i dot[GEMM_T];
            sub_dots(u->q, x, xc + s * T, s * (L / 4), L, T, !min, dot);
            const __m512i sc = _mm512_load_si512(u->scale + 16 * s);
            for (int t = 0; t < T; t++)
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dot[t], sc));
        }
        for (int j = 0; min && j < G; j += 2) {
            const int s = sb * G + j;
            const __m512i mn = _mm512_or_si512(
                _mm512_and_si512(_mm512_load_si512(u->minv + 16 * s), _mm512_set1_epi32(0xFFFF)),
                _mm512_slli_epi32(_mm512_load_si512(u->minv + 16 * (s + 1)), 16));
            min_pair_dots(mn, xc + s * T, T, imin);
        }
        kquant_fold(_mm512_load_ps(u->dd + 32 * sb), _mm512_load_ps(u->dd + 32 * sb + 16),
                    f1 + sb * T, T, min, isum, imin, acc);
    }
    tile_store(out, ldo, keep, T, acc);
}

/* One (form, T) pair per compiled kernel; T is a constant in each. */
#define TILE_KERNEL(name, call)                                                              \
    static void name(const chunk_t *u, const int8_t *x, const int32_t *xc, const float *f1,  \
                     const float *f2, int units, float *out, int64_t ldo, __mmask16 keep,     \
                     int T) {                                                                 \
        switch (T) {                                                                          \
        case GEMM_T: call(GEMM_T); break;                                                     \
        case 7: call(7); break;                                                               \
        case 6: call(6); break;                                                               \
        case 5: call(5); break;                                                               \
        case 4: call(4); break;                                                               \
        case 3: call(3); break;                                                               \
        case 2: call(2); break;                                                               \
        default: call(1); break;                                                              \
        }                                                                                     \
    }
#define ARGS u, x, xc, f1, f2, units, out, ldo, keep
#define OFF_BLOCKS(T) tile_blocks(ARGS, T, 0)
#define MIN_BLOCKS(T) tile_blocks(ARGS, T, 1)
#define MIN_K32(T) tile_kquant(ARGS, T, 32, 1)
#define OFF_K16(T) tile_kquant(ARGS, T, 16, 0)
TILE_KERNEL(tile_off_blocks, OFF_BLOCKS)
TILE_KERNEL(tile_min_blocks, MIN_BLOCKS)
TILE_KERNEL(tile_min_k32, MIN_K32)
TILE_KERNEL(tile_off_k16, OFF_K16)
#undef ARGS

/* units: blocks of 32 (per-block types) or superblocks (K-quants) */
typedef void (*tile_fn)(const chunk_t *, const int8_t *, const int32_t *, const float *,
                        const float *, int, float *, int64_t, __mmask16, int);

static tile_fn tile_for(form_t f) {
    if (!f.kq) return f.min ? tile_min_blocks : tile_off_blocks;
    return f.L == 16 ? tile_off_k16 : tile_min_k32;
}

typedef struct {
    int qtype, rows, cols, n;
    int group;  /* chunks per unit of work */
    form_t form;
    const uint8_t *w;
    int64_t row_bytes;
    const gemm_acts_t *acts;
    float *out;  /* (n, rows) */
    int failed;
} gemm_job_t;

/* One unit of work: `group` chunks of 16 rows, unpacked, then each token tile against each of
 * them in turn, so a tile's activations are read from memory once per group, not per chunk
 * (at 8960 columns all tokens' activations, 4.5 MB for 512, overflow L2 and came from L3 for
 * every chunk: Q6_K 1536 x 8960 ran at 324 GFLOP/s with one chunk a unit, 355 with four).
 * parallel_rows hands out "rows" in CHUNK_ROWS units; unit u here is chunks
 * [u * group, (u + 1) * group). */
static void gemm_unit(const void *ctx, int v0, int v1) {
    gemm_job_t *j = (gemm_job_t *)ctx;
    (void)v1;
    const gemm_acts_t *a = j->acts;
    const int cols = j->cols, nb = cols / 32, ns = cols / j->form.L;
    const int r0 = v0 / CHUNK_ROWS * j->group * CHUNK_ROWS;
    const int r1 = r0 + j->group * CHUNK_ROWS < j->rows ? r0 + j->group * CHUNK_ROWS : j->rows;
    const int nch = (r1 - r0 + CHUNK_ROWS - 1) / CHUNK_ROWS;
    __mmask16 keep[GEMM_GROUP];
    for (int c = 0; c < nch; c++) {
        const int c0 = r0 + c * CHUNK_ROWS, nr = r1 - c0 < CHUNK_ROWS ? r1 - c0 : CHUNK_ROWS;
        if (!chunk_reserve(&tl_chunks[c], cols)) {
            j->failed = 1;
            return;
        }
        unpack_chunk(j->qtype, j->w + (int64_t)c0 * j->row_bytes, j->row_bytes, nr, cols,
                     &tl_chunks[c]);
        keep[c] = (__mmask16)((1u << nr) - 1);
    }
    const tile_fn tile = tile_for(j->form);
    const int units = cols / (j->form.kq ? 256 : 32);
    for (int t0 = 0, T; t0 < j->n; t0 += T) {
        T = tile_len(j->n - t0);
        for (int c = 0; c < nch; c++)
            tile(&tl_chunks[c], a->x + (int64_t)t0 * cols, a->xc + (int64_t)t0 * ns,
                 a->f1 + (int64_t)t0 * nb, a->f2 + (int64_t)t0 * nb, units,
                 j->out + (int64_t)t0 * j->rows + r0 + c * CHUNK_ROWS, j->rows, keep[c], T);
    }
}

/* out (n, rows) = w (rows, cols) . x (n, cols)^T from int8 activations (as matvec_mt: Q8_K
 * for K-quants, else Q8_0). Returns 0; -1 out of memory; -2 for a type it does not take. */
static int gemm_mt(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
                   const int8_t *xq, const float *xd, const int32_t *xs, int n, float *out,
                   int nthreads) {
    const form_t f = form_of(qtype);
    if (!f.L || cols % (f.kq ? 256 : 32)) return -2;
    gemm_acts_t a = {0};
    if (!acts_init(&a, f, xq, xd, xs, n, cols)) {
        acts_free(&a);
        return -1;
    }
    /* groups as large as GEMM_GROUP while every thread still gets >= 4 units to balance */
    const int nchunks = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    int group = nchunks / (4 * (nthreads > 1 ? nthreads : 1));
    group = group < 1 ? 1 : group > GEMM_GROUP ? GEMM_GROUP : group;
    const int units = (nchunks + group - 1) / group;
    gemm_job_t j = {qtype, rows, cols, n, group, f, w, row_bytes, &a, out, 0};
    parallel_rows(gemm_unit, &j, units * CHUNK_ROWS, nthreads);
    acts_free(&a);
    return j.failed ? -1 : 0;
}

#else  /* AVX2: prefill on the file's blocks stays on the mat-vec kernels (the packed types
        * take cpu_packed.c's tiles) */

static int gemm_mt(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
                   const int8_t *xq, const float *xd, const int32_t *xs, int n, float *out,
                   int nthreads) {
    (void)qtype; (void)w; (void)row_bytes; (void)rows; (void)cols; (void)xq; (void)xd;
    (void)xs; (void)n; (void)out; (void)nthreads;
    return -2;
}

#endif

/* The whole quantized matmul in one call: x (n, cols) f32 is rounded to int8 as llama.cpp
 * rounds activations (Q8_K per 256 against K-quants, else Q8_0 per 32), then multiplied by
 * the GEMM when n > gemm_min and it takes the type, else by the mat-vec kernels. out (n, rows).
 * Returns 0, -1 without memory, -2 for a type without C kernels. One call per matmul keeps
 * decode's per-op cost down. */
int ek_matmul_f32(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
                  const float *x, int n, float *out, int nthreads, int gemm_min) {
    if (!ek_supports(qtype) || cols % 32) return -2;
    acts8_t a;
    if (!acts8_round(&a, qtype, x, n, cols)) return -1;
    int status = n > gemm_min ? gemm_mt(qtype, w, row_bytes, rows, cols, a.xq, a.xd, a.xs, n,
                                        out, nthreads) : -2;
    if (status == -2)
        status = matvec_mt(qtype, w, row_bytes, rows, cols, a.xq, a.xd, a.xs, n, out, nthreads);
    acts8_free(&a);
    return status;
}
