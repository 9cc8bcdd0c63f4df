/* Weights repacked once at load ("packed"), for decode and prefill alike (AVX-512 VNNI).
 *
 * Compiled as one unit after cpu_gemm.c: it feeds that file's register tiles (rows in lanes,
 * 16 rows x T tokens) from a compact copy of the weights instead of the file's blocks.
 *
 * Why: on the file's blocks, a decode mat-vec spends most of its instructions taking each
 * 32-weight block apart (nibbles, fifth bits, per-block scales) and summing it horizontally,
 * for every row and again for every token of a verification batch; one core then manages
 * ~9 GB/s of Q5_0 and the extra tokens of a speculative check cost ~15% each. Packed, each
 * chunk of 16 rows keeps the tile's layout, 4-bit values two to a byte: one 64-byte load
 * becomes 128 weights of 16 rows with an and, a shift and an and, every vpdpbusd then serves
 * one token for 64 weights, and no sums run across lanes. The tile kernels are the GEMM's, so
 * a token's result is the same alone or in any batch (speculative decoding relies on it).
 *
 * A chunk is a run of records in column order, each the layout of the tile's column groups
 * (4 columns x 16 rows x 1 byte; a "nibble vector" holds groups 2i in its low nibbles and
 * 2i + 1 in its high ones) followed by the raw scales of the 16 rows:
 *   Q8_0, 32 columns:  8 x 64 q+128 bytes | d f16[16]                              544 bytes
 *   Q5_0, 32 columns:  4 x 64 nibbles | 64 bytes of fifth bits | d f16[16]              352
 *                      (AVX-512: a u64 mask per group, bit k for byte k; AVX2: a plane whose
 *                      byte k holds byte k's fifth bit of group i in bit i, so one shift and
 *                      an and give a group's 0x10s, as Q6_K's top bits)
 *   Q4_K, 256 columns: 32 x 64 nibbles | sc u8[8][16] | m u8[8][16] | d, dmin f16[16]   2368
 *   Q6_K, 256 columns: 32 x 64 nibbles | 16 x 64 top-2-bit bytes (groups 4h..4h+3 in bits
 *                      0-1, 2-3, 4-5, 6-7) | sc i8[16][16] | d f16[16]                 3360
 * the same bytes as the file's blocks (Q4_K: +3%), so resident memory stays near the file
 * size once the file's pages are let go (the caller's job). Rows past the end are zero.
 */

static int64_t packed_record_bytes(int qtype) {
    switch (qtype) {
    case T_Q8_0: return 544;
    case T_Q5_0: return 352;
    case T_Q4_K: return 2368;
    case T_Q6_K: return 3360;
    default: return 0;
    }
}

static int packed_record_cols(int qtype) { return qtype == T_Q4_K || qtype == T_Q6_K ? 256 : 32; }

static int64_t packed_chunk_bytes(int qtype, int cols) {
    return (int64_t)cols / packed_record_cols(qtype) * packed_record_bytes(qtype);
}

/* Bytes of a packed rows x cols matrix of qtype, or 0 for a type (or width) it does not take. */
int64_t ek_packed_bytes(int qtype, int rows, int cols) {
    if (!packed_record_bytes(qtype) || cols % packed_record_cols(qtype)) return 0;
    return packed_chunk_bytes(qtype, cols) * ((rows + CHUNK_ROWS - 1) / CHUNK_ROWS);
}

/* ---- packing (once, at load) ------------------------------------------------------------- */

/* Column group g of a chunk in the tile layout: 64 bytes, 4 columns x 16 rows. */
static inline const uint8_t *group_at(const chunk_t *u, int g) { return u->q + 64 * (int64_t)g; }

/* groups g, g + 1 as one nibble vector (plain loops: packing runs once, at load, and gcc
 * vectorises them for whichever build this is) */
static void pack_nibbles(const chunk_t *u, int g, uint8_t *dst) {
    const uint8_t *lo = group_at(u, g), *hi = group_at(u, g + 1);
    for (int k = 0; k < 64; k++) dst[k] = (uint8_t)((lo[k] & 0x0F) | (hi[k] & 0x0F) << 4);
}

/* Q5_0: the fifth bits of groups g0..g0+7 into the record's 64 bytes (layout above) */
static void pack_fifth_bits(const chunk_t *u, int g0, uint8_t *dst) {
#if defined(HAVE_GEMM)
    for (int g = 0; g < 8; g++) {
        const uint8_t *q = group_at(u, g0 + g);
        uint64_t bits = 0;
        for (int k = 0; k < 64; k++) bits |= (uint64_t)((q[k] >> 4) & 1) << k;
        memcpy(dst + 8 * g, &bits, 8);
    }
#else
    for (int k = 0; k < 64; k++) {
        uint8_t b = 0;
        for (int g = 0; g < 8; g++) b |= (uint8_t)(((group_at(u, g0 + g)[k] >> 4) & 1) << g);
        dst[k] = b;
    }
#endif
}

/* Q5_0: the fifth bit of byte `at` of group g of a record */
static int fifth_bit(const uint8_t *rec, int g, int at) {
#if defined(HAVE_GEMM)
    uint64_t bits;
    memcpy(&bits, rec + 256 + 8 * g, 8);
    return (int)((bits >> at) & 1);
#else
    return (rec[256 + at] >> g) & 1;
#endif
}

/* Q6_K: bits 4-5 of groups g..g+3 as bits 0-1, 2-3, 4-5, 6-7 of each byte */
static void pack_top_bits(const chunk_t *u, int g, uint8_t *dst) {
    for (int k = 0; k < 64; k++) {
        uint8_t b = 0;
        for (int i = 0; i < 4; i++) b |= (uint8_t)(((group_at(u, g + i)[k] >> 4) & 3) << (2 * i));
        dst[k] = b;
    }
}

/* The raw scales of row r's record starting at column c0, into the record's scale area. */
static void pack_scales(int qtype, const uint8_t *row, int c0, int r, uint8_t *area) {
    if (qtype == T_Q8_0 || qtype == T_Q5_0) {
        const uint8_t *blk = row + (int64_t)c0 / 32 * (qtype == T_Q8_0 ? 34 : 22);
        memcpy(area + 2 * r, blk, 2);
    } else if (qtype == T_Q4_K) {
        const uint8_t *blk = row + (int64_t)c0 / 256 * 144;
        uint8_t sc[8], mn[8];
        scales_mins_k4(blk + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            area[16 * j + r] = sc[j];
            area[128 + 16 * j + r] = mn[j];
        }
        memcpy(area + 256 + 2 * r, blk, 2);
        memcpy(area + 288 + 2 * r, blk + 2, 2);
    } else {  /* Q6_K */
        const uint8_t *blk = row + (int64_t)c0 / 256 * 210;
        for (int j = 0; j < 16; j++) area[16 * j + r] = blk[192 + j];
        memcpy(area + 256 + 2 * r, blk + 208, 2);
    }
}

/* One chunk: rows [r0, r0 + nr) of the file's blocks w into its packed records at dst. */
static void pack_chunk(int qtype, const uint8_t *w, int64_t row_bytes, int nr, int cols,
                       chunk_t *u, uint8_t *dst) {
    unpack_chunk(qtype, w, row_bytes, nr, cols, u);  /* the tile layout, q unsigned */
    const int rc = packed_record_cols(qtype);
    for (int c0 = 0; c0 < cols; c0 += rc, dst += packed_record_bytes(qtype)) {
        const int g0 = c0 / 4, groups = rc / 4;
        uint8_t *scales = dst;
        if (qtype == T_Q8_0) {
            memcpy(dst, u->q + 64 * (int64_t)g0, 512);
            scales = dst + 512;
        } else {
            for (int i = 0; i < groups / 2; i++) pack_nibbles(u, g0 + 2 * i, dst + 64 * i);
            scales = dst + 32 * groups;
            if (qtype == T_Q5_0) {  /* each group's fifth bits: one bit per byte of the group */
                pack_fifth_bits(u, g0, scales);
                scales += 8 * groups;
            } else if (qtype == T_Q6_K) {  /* bits 4-5 of groups 4h..4h+3 in one byte */
                for (int h = 0; h < groups / 4; h++) pack_top_bits(u, g0 + 4 * h, scales + 64 * h);
                scales += 16 * groups;
            }
        }
        for (int r = 0; r < nr; r++) pack_scales(qtype, w + r * row_bytes, c0, r, scales);
    }
}

typedef struct {
    int qtype, rows, cols;
    const uint8_t *w;
    int64_t row_bytes;
    uint8_t *dst;
    int failed;
} pack_job_t;

static void pack_rows(const void *ctx, int r0, int r1) {
    pack_job_t *j = (pack_job_t *)ctx;
    chunk_t *u = &tl_chunks[0];
    if (!chunk_reserve(u, j->cols)) {
        j->failed = 1;
        return;
    }
    pack_chunk(j->qtype, j->w + (int64_t)r0 * j->row_bytes, j->row_bytes, r1 - r0, j->cols, u,
               j->dst + (int64_t)(r0 / CHUNK_ROWS) * packed_chunk_bytes(j->qtype, j->cols));
}

/* w (rows, row_bytes) in the file's blocks -> dst (ek_packed_bytes, zeroed by the caller).
 * Returns 0, -1 without memory, -2 for a type it does not pack. */
int ek_pack(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols, uint8_t *dst,
            int nthreads) {
    if (!ek_packed_bytes(qtype, rows, cols)) return -2;
    pack_job_t j = {qtype, rows, cols, w, row_bytes, dst, 0};
    parallel_rows(pack_rows, &j, rows, nthreads);
    return j.failed ? -1 : 0;
}

#if defined(HAVE_GEMM)
/* ---- expanding a packed chunk into the tile layout (per call, per thread) ----------------- */

static inline __m512i load_group(const chunk_t *u, int g) {
    return _mm512_load_si512(u->q + 64 * (int64_t)g);
}


static inline void store_group(chunk_t *u, int g, __m512i v) {
    _mm512_store_si512(u->q + 64 * (int64_t)g, v);
}

static inline __m512 f16x16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static void expand_chunk(int qtype, const uint8_t *src, int cols, chunk_t *u) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    const int rc = packed_record_cols(qtype), groups = rc / 4;
    for (int c0 = 0; c0 < cols; c0 += rc, src += packed_record_bytes(qtype)) {
        const int g0 = c0 / 4;
        if (qtype == T_Q8_0) {
            for (int g = 0; g < 8; g++) store_group(u, g0 + g, _mm512_loadu_si512(src + 64 * g));
            _mm512_store_ps(u->scale + 16 * (c0 / 32), f16x16(src + 512));
            continue;
        }
        for (int i = 0; i < groups / 2; i++) {
            const __m512i v = _mm512_loadu_si512(src + 64 * i);
            __m512i lo = _mm512_and_si512(v, low4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if (qtype == T_Q5_0) {
                uint64_t m0, m1;
                memcpy(&m0, src + 256 + 16 * i, 8);
                memcpy(&m1, src + 256 + 16 * i + 8, 8);
                lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(m0, bit4));
                hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(m1, bit4));
            }
            store_group(u, g0 + 2 * i, lo);
            store_group(u, g0 + 2 * i + 1, hi);
        }
        if (qtype == T_Q5_0) {
            _mm512_store_ps(u->scale + 16 * (c0 / 32), f16x16(src + 320));
        } else if (qtype == T_Q6_K) {
            const uint8_t *hbits = src + 2048, *sc = src + 3072;
            const __m512i top = _mm512_set1_epi8(0x30);
            for (int h = 0; h < 16; h++) {
                const __m512i hb = _mm512_loadu_si512(hbits + 64 * h);
                const int g = g0 + 4 * h;
                const __m512i add[4] = {_mm512_slli_epi16(hb, 4), _mm512_slli_epi16(hb, 2), hb,
                                        _mm512_srli_epi16(hb, 2)};
                for (int k = 0; k < 4; k++)
                    store_group(u, g + k, _mm512_or_si512(load_group(u, g + k),
                                                          _mm512_and_si512(add[k], top)));
            }
            for (int j = 0; j < 16; j++)
                _mm512_store_si512(u->scale + 16 * (c0 / 16 + j), _mm512_cvtepi8_epi32(
                                       _mm_loadu_si128((const __m128i *)(sc + 16 * j))));
            _mm512_store_ps(u->dd + 32 * (c0 / 256), f16x16(src + 3328));
        } else {  /* Q4_K */
            const uint8_t *sc = src + 2048, *mn = src + 2176;
            for (int j = 0; j < 8; j++) {
                _mm512_store_si512(u->scale + 16 * (c0 / 32 + j), _mm512_cvtepu8_epi32(
                                       _mm_loadu_si128((const __m128i *)(sc + 16 * j))));
                _mm512_store_si512(u->minv + 16 * (c0 / 32 + j), _mm512_cvtepu8_epi32(
                                       _mm_loadu_si128((const __m128i *)(mn + 16 * j))));
            }
            _mm512_store_ps(u->dd + 32 * (c0 / 256), f16x16(src + 2304));
            _mm512_store_ps(u->dd + 32 * (c0 / 256) + 16, f16x16(src + 2336));
        }
    }
}

/* ---- decode: the tile straight from the packed records ------------------------------------
 * With a few tokens, expanding a chunk into memory first costs more than the products (its
 * stores are the bottleneck: ~15 GB/s of packed input against ~45 for the tile alone), so
 * decode expands each vector in registers and uses it at once. The float steps are the
 * tile kernels' own, in the same order, so prefill (expand + tile) and decode give a token
 * the same result. */

/* acc[t] = init + dot of groups g[0..G) (column groups k0..k0+G) with token t's activations */
FORCE void group_dots(const __m512i *g, const int G, const int8_t *x, int k0, const int T,
                      const int32_t *xc, __m512i *acc) {
    const int C = CHAINS(T);
    __m512i part[GEMM_T * 4];
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++)
            part[t * C + c] = xc && c == 0 ? _mm512_set1_epi32(xc[t]) : _mm512_setzero_si512();
    for (int i = 0; i < G; i++) {
        const int c = i % C;
        for (int t = 0; t < T; t++)
            part[t * C + c] = dpbusd_bcast(part[t * C + c], g[i], x + 4 * ((int64_t)(k0 + i) * T + t));
    }
    for (int t = 0; t < T; t++) {
        acc[t] = part[t * C];
        for (int c = 1; c < C; c++) acc[t] = _mm512_add_epi32(acc[t], part[t * C + c]);
    }
}

/* nibble vector v -> its two column groups; fifth bits from two masks where given */
FORCE void split_nibbles(const uint8_t *p, __m512i *g) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(p);
    g[0] = _mm512_and_si512(v, low4);
    g[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
}

/* Per-block types (Q8_0, Q5_0): as tile_blocks with the offset start. */
FORCE void dtile_blocks(int qtype, const uint8_t *src, int nb, const int8_t *x, const int32_t *xc,
                        const float *f1, float *out, int64_t ldo, __mmask16 keep, const int T) {
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[GEMM_T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    const int64_t rec = packed_record_bytes(qtype);
    for (int s = 0; s < nb; s++, src += rec) {
        PREFETCH(src, rec);
        __m512i g[8], dot[GEMM_T];
        __m512 sc;
        if (qtype == T_Q8_0) {
            for (int i = 0; i < 8; i++) g[i] = _mm512_loadu_si512(src + 64 * i);
            sc = f16x16(src + 512);
        } else {
            for (int i = 0; i < 4; i++) {
                uint64_t m0, m1;
                split_nibbles(src + 64 * i, g + 2 * i);
                memcpy(&m0, src + 256 + 16 * i, 8);
                memcpy(&m1, src + 256 + 16 * i + 8, 8);
                g[2 * i] = _mm512_or_si512(g[2 * i], _mm512_maskz_mov_epi8(m0, bit4));
                g[2 * i + 1] = _mm512_or_si512(g[2 * i + 1], _mm512_maskz_mov_epi8(m1, bit4));
            }
            sc = f16x16(src + 320);
        }
        group_dots(g, 8, x, 8 * s, T, xc + s * T, dot);
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]),
                                     _mm512_mul_ps(sc, _mm512_set1_ps(f1[s * T + t])), acc[t]);
    }
    tile_store(out, ldo, keep, T, acc);
}

/* Q4_K: as tile_kquant (L = 32, minimums, two sub-blocks at a time: min_pair_dots; xc holds
 * the activation sums) */
FORCE void dtile_q4k(const uint8_t *src, int nsb, const int8_t *x, const int32_t *xc,
                     const float *f1, float *out, int64_t ldo, __mmask16 keep, const int T) {
    /* (mn[2p][r], mn[2p + 1][r]) as the int16 pair of lane r, from 32 bytes mn[2p], mn[2p+1] */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                           25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                           18, 2, 17, 1, 16, 0);
    __m512 acc[GEMM_T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++, src += 2368) {
        PREFETCH(src, 2368);
        const uint8_t *sc8 = src + 2048, *mn8 = src + 2176;
        __m512i isum[GEMM_T], imin[GEMM_T];
        for (int t = 0; t < T; t++) isum[t] = imin[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const int s = sb * 8 + j;
            __m512i g[8], dot[GEMM_T];
            for (int i = 0; i < 4; i++) split_nibbles(src + 64 * (4 * j + i), g + 2 * i);
            group_dots(g, 8, x, 8 * s, T, NULL, dot);
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc8 + 16 * j)));
            for (int t = 0; t < T; t++)
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dot[t], sc));
        }
        for (int p = 0; p < 4; p++) {
            const __m512i mn = _mm512_permutexvar_epi16(pairs, _mm512_cvtepu8_epi16(
                                   _mm256_loadu_si256((const __m256i *)(mn8 + 32 * p))));
            min_pair_dots(mn, xc + (sb * 8 + 2 * p) * T, T, imin);
        }
        kquant_fold(f16x16(src + 2304), f16x16(src + 2336), f1 + sb * T, T, 1, isum, imin, acc);
    }
    tile_store(out, ldo, keep, T, acc);
}

/* Q6_K: as tile_kquant (L = 16, offset 32) */
FORCE void dtile_q6k(const uint8_t *src, int nsb, const int8_t *x, const int32_t *xc,
                     const float *f1, float *out, int64_t ldo, __mmask16 keep, const int T) {
    const __m512i top = _mm512_set1_epi8(0x30);
    __m512 acc[GEMM_T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++, src += 3360) {
        PREFETCH(src, 3360);
        __m512i isum[GEMM_T];
        for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
        for (int j = 0; j < 16; j++) {
            const int s = sb * 16 + j;
            const __m512i hb = _mm512_loadu_si512(src + 2048 + 64 * j);
            __m512i g[4], dot[GEMM_T];
            split_nibbles(src + 64 * (2 * j), g);
            split_nibbles(src + 64 * (2 * j + 1), g + 2);
            g[0] = _mm512_or_si512(g[0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), top));
            g[1] = _mm512_or_si512(g[1], _mm512_and_si512(_mm512_slli_epi16(hb, 2), top));
            g[2] = _mm512_or_si512(g[2], _mm512_and_si512(hb, top));
            g[3] = _mm512_or_si512(g[3], _mm512_and_si512(_mm512_srli_epi16(hb, 2), top));
            group_dots(g, 4, x, 4 * s, T, xc + s * T, dot);
            const __m512i sc = _mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(src + 3072 + 16 * j)));
            for (int t = 0; t < T; t++)
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dot[t], sc));
        }
        kquant_fold(f16x16(src + 3328), _mm512_setzero_ps(), f1 + sb * T, T, 0, isum, isum, acc);
    }
    tile_store(out, ldo, keep, T, acc);
}

FORCE void dtile_any(int qtype, const uint8_t *src, int cols, const int8_t *x, const int32_t *xc,
                     const int32_t *xp, const float *f1, const float *f2, float *out, int64_t ldo,
                     __mmask16 keep, const int T) {
    (void)f2;  /* the per-block minimum types are not packed */
    (void)xp;
    switch (qtype) {
    case T_Q4_K: dtile_q4k(src, cols / 256, x, xc, f1, out, ldo, keep, T); break;
    case T_Q6_K: dtile_q6k(src, cols / 256, x, xc, f1, out, ldo, keep, T); break;
    default: dtile_blocks(qtype, src, cols / 32, x, xc, f1, out, ldo, keep, T); break;
    }
}

#else  /* AVX2: the same records, each 64-byte column group read as two halves of 8 rows */

/* ---- decode (and prefill) tiles on AVX2 ---------------------------------------------------
 * A ymm holds 8 int32 lanes, so a chunk's 16 rows are done as two halves, each reading its
 * 32 bytes of every column group (rows 8h..8h+7).
 * There is no vpdpbusd: vpmaddubsw multiplies a half's bytes by a token's 4 activations
 * (broadcast) and adds neighbours into int16 pairs, and vpmaddwd adds the pairs into the
 * lane's int32, by 1 or by the lane's sub-block scale. The int16 pairs stay exact while
 * summed over several groups first (|x| <= 127): 8 groups of 4-bit weights (2 * 15 * 127 * 8
 * = 30480), 4 of 5-bit, 2 of 6-bit; Q8_0 (|q| up to 128) takes the sign trick (|q| . x sign
 * q) one group at a time. Every sum is an exact integer before it meets floats, and the
 * float steps are the AVX-512 tiles' own, so a token's result does not depend on its batch,
 * and prefill (these tiles, 8 tokens at a time) gives it the same bits as decode. */

static inline __m256i half_at(const uint8_t *p, int h) {
    return _mm256_loadu_si256((const __m256i *)(p + 32 * h));
}

/* a token's 4 activations x[0..3] in every int32 lane */
static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

#if defined(__AVXVNNI__)
/* With AVX-VNNI (the VEX vpdpbusd of Intel's laptop chips since Alder Lake and AMD's since
 * Zen 4) each group is one instruction into int32 lanes, as on AVX-512: no int16 pairs to
 * bound, no vpmaddwd, and the sub-block scales multiply the group sums (vpmulld) instead of
 * the pairs. The integers are the same exact sums, so the floats and the results are the
 * AVX2 build's, bit for bit. */

/* acc + bytes . token's 4 activations (x[0..3] broadcast), per int32 lane */
static inline __m256i dpbusd_bcast8(__m256i acc, __m256i w, const int8_t *x) {
    return _mm256_dpbusd_avx_epi32(acc, w, bcast4(x));
}

/* start + groups g[0..G) (G even) . token t's activations, in two chains: decode has one
 * token, and a single chain would wait out every vpdpbusd's latency */
FORCE __m256i group_sum(const __m256i *g, const int G, const int8_t *xs, const int T, int t,
                        __m256i start) {
    __m256i a = start, b = _mm256_setzero_si256();
    for (int i = 0; i < G; i += 2) {
        a = dpbusd_bcast8(a, g[i], xs + 4 * (i * T + t));
        b = dpbusd_bcast8(b, g[i + 1], xs + 4 * ((i + 1) * T + t));
    }
    return _mm256_add_epi32(a, b);
}

/* isum[t] += sc * (groups g[0..G) . token t's activations) for the T tokens: one K-quant
 * sub-block of G groups, each lane times its row's sub-block scale */
FORCE void add_scaled_sums(__m256i *isum, const __m256i *g, const int G, const int8_t *xs,
                           const int T, __m256i sc) {
    for (int t = 0; t < T; t++)
        isum[t] = _mm256_add_epi32(
            isum[t], _mm256_mullo_epi32(group_sum(g, G, xs, T, t, _mm256_setzero_si256()), sc));
}

/* a half's 8 lanes of a row of 16 scale bytes, widened to int32 */
static inline __m256i lane_scales(const uint8_t *p, int h, int sign) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)(p + 8 * h));
    return sign ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}
#endif

/* bytes . token's 4 activations (x[0..3] broadcast) -> 16 int16 pair sums */
static inline __m256i maddubs_bcast(__m256i w, const int8_t *x) {
    return _mm256_maddubs_epi16(w, bcast4(x));
}

/* the two column groups of a nibble vector's half */
FORCE void split_half(const uint8_t *p, int h, __m256i *g) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), v = half_at(p, h);
    g[0] = _mm256_and_si256(v, low4);
    g[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}

/* int16 pairs (a_r, b_r) for the half's lanes r from two rows of 16 scale bytes */
static inline __m256i lane_pairs(const uint8_t *a, const uint8_t *b, int h, int sign) {
    const __m128i v = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(a + 8 * h)),
                                        _mm_loadl_epi64((const __m128i *)(b + 8 * h)));
    return sign ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
}

/* out[t * ldo + lane] for the half's 8 lanes whose bit is set in keep8 */
static inline void store_half(float *out, unsigned keep8, __m256 v) {
    if (keep8 == 0xFF) {
        _mm256_storeu_ps(out, v);
        return;
    }
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_and_si256(_mm256_set1_epi32((int)keep8), bit);
    const __m256i mask = _mm256_cmpeq_epi32(set, bit);
    _mm256_maskstore_ps(out, mask, v);
}

/* Both halves go through each record together (a half's pass alone would leave the other
 * waiting on a second read of the chunk: 1536 x 8960 Q4_K ran at half the speed of
 * 8960 x 1536); acc[h * GEMM_T + t] is half h's accumulator for token t. */

/* Q8_0: 8 groups per block, sign trick, scale per block as the AVX-512 tile. */
FORCE void dtile_q8_0(const uint8_t *src, int nb, int nh, const int8_t *x, const int32_t *xc,
                      const float *f1, __m256 *acc, const int T) {
#if !defined(__AVXVNNI__)
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    (void)xc;  /* the sign trick needs no offset */
#endif
    for (int s = 0; s < nb; s++, src += 544) {
        PREFETCH(src, 544);
        for (int h = 0; h < nh; h++) {
            __m256i dot[GEMM_T];
#if defined(__AVXVNNI__)  /* the records' q + 128 against x, less 128 sum(x) (xc) */
            __m256i g[8];
            for (int i = 0; i < 8; i++) g[i] = half_at(src + 64 * i, h);
            for (int t = 0; t < T; t++)
                dot[t] = group_sum(g, 8, x + 4 * (int64_t)(8 * s) * T, T, t,
                                   _mm256_set1_epi32(xc[s * T + t]));
#else
            for (int t = 0; t < T; t++) dot[t] = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                const __m256i q = _mm256_xor_si256(half_at(src + 64 * i, h), flip);  /* signed */
                const __m256i qa = _mm256_abs_epi8(q);
                for (int t = 0; t < T; t++) {
                    const __m256i xs =
                        _mm256_sign_epi8(bcast4(x + 4 * ((int64_t)(8 * s + i) * T + t)), q);
                    dot[t] = _mm256_add_epi32(
                        dot[t], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xs), ones));
                }
            }
#endif
            const __m256 sc = load_f16x8((const uint16_t *)(src + 512 + 16 * h));
            for (int t = 0; t < T; t++)
                acc[h * GEMM_T + t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(sc, _mm256_set1_ps(f1[s * T + t])),
                    acc[h * GEMM_T + t]);
        }
    }
}

/* Q5_0: q unsigned (0..31), offset 16 from xc; group i's fifth bits are bit i of the plane's
 * bytes, moved to bit 4 by a 16-bit shift (the bits a shift carries across bytes land
 * outside bit 4, so the and drops them). */
FORCE void dtile_q5_0(const uint8_t *src, int nb, int nh, const int8_t *x, const int32_t *xc,
                      const float *f1, __m256 *acc, const int T) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    for (int s = 0; s < nb; s++, src += 352) {
        PREFETCH(src, 352);
        const int8_t *xs = x + 4 * (int64_t)(8 * s) * T;
        for (int h = 0; h < nh; h++) {
            __m256i g[8];
            for (int i = 0; i < 4; i++) split_half(src + 64 * i, h, g + 2 * i);
            const __m256i plane = half_at(src + 256, h);
            g[0] = _mm256_or_si256(g[0], _mm256_and_si256(_mm256_slli_epi16(plane, 4), bit4));
            g[1] = _mm256_or_si256(g[1], _mm256_and_si256(_mm256_slli_epi16(plane, 3), bit4));
            g[2] = _mm256_or_si256(g[2], _mm256_and_si256(_mm256_slli_epi16(plane, 2), bit4));
            g[3] = _mm256_or_si256(g[3], _mm256_and_si256(_mm256_slli_epi16(plane, 1), bit4));
            g[4] = _mm256_or_si256(g[4], _mm256_and_si256(plane, bit4));
            g[5] = _mm256_or_si256(g[5], _mm256_and_si256(_mm256_srli_epi16(plane, 1), bit4));
            g[6] = _mm256_or_si256(g[6], _mm256_and_si256(_mm256_srli_epi16(plane, 2), bit4));
            g[7] = _mm256_or_si256(g[7], _mm256_and_si256(_mm256_srli_epi16(plane, 3), bit4));
            const __m256 sc = load_f16x8((const uint16_t *)(src + 320 + 16 * h));
            for (int t = 0; t < T; t++) {
#if defined(__AVXVNNI__)
                const __m256i dot = group_sum(g, 8, xs, T, t, _mm256_set1_epi32(xc[s * T + t]));
#else
                const __m256i ones = _mm256_set1_epi16(1);
                __m256i dot = _mm256_set1_epi32(xc[s * T + t]);
                for (int k = 0; k < 8; k += 4) {  /* 4 groups of 5-bit products fit int16 */
                    __m256i p = maddubs_bcast(g[k], xs + 4 * (k * T + t));
                    for (int i = k + 1; i < k + 4; i++)
                        p = _mm256_add_epi16(p, maddubs_bcast(g[i], xs + 4 * (i * T + t)));
                    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
                }
#endif
                acc[h * GEMM_T + t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_set1_ps(f1[s * T + t])),
                    acc[h * GEMM_T + t]);
            }
        }
    }
}

#if defined(__AVXVNNI__)
/* Q5_0 for one token (decode), on AVX-VNNI: each group merged with its fifth bits and summed
 * as soon as it is built, the sums in registers. The tile above holds 8 groups and an
 * accumulator array indexed by the half: 16 ymm registers do not hold them, and the spills to
 * the stack made the loop run at 27-31 GB/s a core where AVX-512 ran at 55-61. The same exact
 * integer sums and the same float steps in the same order: the same bits.
 *
 * The one-token tiles below all take a record's (or superblock's) NH halves together: each
 * activation is broadcast once for both, and the two halves' chains are independent work
 * for the core while one waits on its vpdpbusd. Hot, one thread, against one half at a time:
 * Q4_K 33-37 -> 39-45 GB/s, Q6_K 33-36 -> 39-41. */
FORCE __m256i q5_group(__m256i nibbles, __m256i fifth) {
    return _mm256_or_si256(_mm256_and_si256(nibbles, _mm256_set1_epi8(0x0F)),
                           _mm256_and_si256(fifth, _mm256_set1_epi8(0x10)));
}

FORCE void q5_0_one(const uint8_t *src, const int NH, const int8_t *xs, int32_t xc, float f1,
                    __m256 *acc) {
    __m256i a[2], b[2], plane[2];
    for (int h = 0; h < NH; h++) {
        a[h] = _mm256_set1_epi32(xc), b[h] = _mm256_setzero_si256();
        plane[h] = half_at(src + 256, h);
    }
    for (int i = 0; i < 4; i++) {  /* nibble vector i: groups 2i, 2i + 1 */
        const __m256i xl = bcast4(xs + 8 * i), xh = bcast4(xs + 8 * i + 4);
        for (int h = 0; h < NH; h++) {
            const __m256i v = half_at(src + 64 * i, h);
            /* group g's fifth bits are bit g of the plane's bytes: to bit 4 */
            const __m256i f_lo = i < 2 ? _mm256_slli_epi16(plane[h], 4 - 2 * i)
                                       : _mm256_srli_epi16(plane[h], 2 * i - 4);
            const __m256i f_hi = i < 2 ? _mm256_slli_epi16(plane[h], 3 - 2 * i)
                                       : _mm256_srli_epi16(plane[h], 2 * i - 3);
            a[h] = _mm256_dpbusd_avx_epi32(a[h], q5_group(v, f_lo), xl);
            b[h] = _mm256_dpbusd_avx_epi32(b[h], q5_group(_mm256_srli_epi16(v, 4), f_hi), xh);
        }
    }
    for (int h = 0; h < NH; h++) {
        const __m256 sc = load_f16x8((const uint16_t *)(src + 320 + 16 * h));
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a[h], b[h])),
                                 _mm256_mul_ps(sc, _mm256_set1_ps(f1)), acc[h]);
    }
}

/* Q8_0 for one token (decode), on AVX-VNNI, as q5_0_one: the records' q + 128 against x less
 * 128 sum(x) (xc), in two chains a half, the sums in registers. The T-token tile it replaces
 * for one token keeps its accumulators in an array indexed by half and token: hot, one
 * thread, 896 columns, it ran at 49-51 GB/s, this at 86-88. The same integer sums and float
 * steps: the same bits. */
FORCE void q8_0_one(const uint8_t *src, const int NH, const int8_t *xs, int32_t xc, float f1,
                    __m256 *acc) {
    __m256i a[2], b[2];
    for (int h = 0; h < NH; h++) a[h] = _mm256_set1_epi32(xc), b[h] = _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {
        const __m256i xl = bcast4(xs + 4 * i), xh = bcast4(xs + 4 * i + 4);
        for (int h = 0; h < NH; h++) {
            a[h] = _mm256_dpbusd_avx_epi32(a[h], half_at(src + 64 * i, h), xl);
            b[h] = _mm256_dpbusd_avx_epi32(b[h], half_at(src + 64 * (i + 1), h), xh);
        }
    }
    for (int h = 0; h < NH; h++) {
        const __m256 sc = load_f16x8((const uint16_t *)(src + 512 + 16 * h));
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a[h], b[h])),
                                 _mm256_mul_ps(sc, _mm256_set1_ps(f1)), acc[h]);
    }
}

#endif

/* Q4_K: per sub-block of 32 (8 groups) the int16 pairs times the lanes' 6-bit scales; the
 * minimums times the activation sums (xp), two sub-blocks per vpmaddwd; once per superblock
 * acc += isum d xd - imin dmin xd, as the AVX-512 tile. */
FORCE void dtile_q4k(const uint8_t *src, int nsb, int nh, const int8_t *x, const int32_t *xp,
                     const float *f1, __m256 *acc, const int T) {
    for (int sb = 0; sb < nsb; sb++, src += 2368) {
        PREFETCH(src, 2368);
        __m256i isum[2 * GEMM_T], imin[2 * GEMM_T];
        for (int t = 0; t < 2 * GEMM_T; t++) isum[t] = imin[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const int8_t *xs = x + 4 * (int64_t)(8 * (sb * 8 + j)) * T;
            for (int h = 0; h < nh; h++) {
                __m256i g[8];
                for (int i = 0; i < 4; i++) split_half(src + 64 * (4 * j + i), h, g + 2 * i);
#if defined(__AVXVNNI__)
                add_scaled_sums(isum + h * GEMM_T, g, 8, xs, T,
                                lane_scales(src + 2048 + 16 * j, h, 0));
#else
                const __m256i sc = lane_pairs(src + 2048 + 16 * j, src + 2048 + 16 * j, h, 0);
                for (int t = 0; t < T; t++) {
                    __m256i p = maddubs_bcast(g[0], xs + 4 * t);
                    for (int i = 1; i < 8; i++)
                        p = _mm256_add_epi16(p, maddubs_bcast(g[i], xs + 4 * (i * T + t)));
                    isum[h * GEMM_T + t] = _mm256_add_epi32(isum[h * GEMM_T + t],
                                                            _mm256_madd_epi16(p, sc));
                }
#endif
            }
        }
        for (int h = 0; h < nh; h++) {
            for (int p = 0; p < 4; p++) {
                const __m256i mn = lane_pairs(src + 2176 + 32 * p, src + 2176 + 32 * p + 16, h, 0);
                for (int t = 0; t < T; t++)
                    imin[h * GEMM_T + t] = _mm256_add_epi32(imin[h * GEMM_T + t], _mm256_madd_epi16(
                        mn, _mm256_set1_epi32(xp[(sb * 4 + p) * T + t])));
            }
            const __m256 d = load_f16x8((const uint16_t *)(src + 2304 + 16 * h));
            const __m256 dmin = load_f16x8((const uint16_t *)(src + 2336 + 16 * h));
            for (int t = 0; t < T; t++) {
                const __m256 xd = _mm256_set1_ps(f1[sb * T + t]);
                __m256 *a = &acc[h * GEMM_T + t];
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h * GEMM_T + t]),
                                     _mm256_mul_ps(d, xd), *a);
                *a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[h * GEMM_T + t]),
                                      _mm256_mul_ps(dmin, xd), *a);
            }
        }
    }
}

/* Q6_K: sub-blocks of 16 (4 groups, int16 pairs over 2 at a time) times the lanes' int8
 * scales; the offset 32 as 32 sum_s sc_s sum_s(x), two sub-blocks per vpmaddwd, from the
 * activation sums (xp); once per superblock acc += (isum - 32 ioff) d xd. */
FORCE void dtile_q6k(const uint8_t *src, int nsb, int nh, const int8_t *x, const int32_t *xp,
                     const float *f1, __m256 *acc, const int T) {
    const __m256i top = _mm256_set1_epi8(0x30);
    for (int sb = 0; sb < nsb; sb++, src += 3360) {
        PREFETCH(src, 3360);
        __m256i isum[2 * GEMM_T], ioff[2 * GEMM_T];
        for (int t = 0; t < 2 * GEMM_T; t++) isum[t] = ioff[t] = _mm256_setzero_si256();
        for (int j = 0; j < 16; j++) {
            const int8_t *xs = x + 4 * (int64_t)(4 * (sb * 16 + j)) * T;
            for (int h = 0; h < nh; h++) {
                __m256i g[4];
                split_half(src + 64 * (2 * j), h, g);
                split_half(src + 64 * (2 * j + 1), h, g + 2);
                const __m256i hb = half_at(src + 2048 + 64 * j, h);
                g[0] = _mm256_or_si256(g[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
                g[1] = _mm256_or_si256(g[1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
                g[2] = _mm256_or_si256(g[2], _mm256_and_si256(hb, top));
                g[3] = _mm256_or_si256(g[3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
#if defined(__AVXVNNI__)
                add_scaled_sums(isum + h * GEMM_T, g, 4, xs, T,
                                lane_scales(src + 3072 + 16 * j, h, 1));
#else
                const __m256i sc = lane_pairs(src + 3072 + 16 * j, src + 3072 + 16 * j, h, 1);
                for (int t = 0; t < T; t++) {
                    const __m256i p0 = _mm256_add_epi16(maddubs_bcast(g[0], xs + 4 * t),
                                                        maddubs_bcast(g[1], xs + 4 * (T + t)));
                    const __m256i p1 = _mm256_add_epi16(maddubs_bcast(g[2], xs + 4 * (2 * T + t)),
                                                        maddubs_bcast(g[3], xs + 4 * (3 * T + t)));
                    isum[h * GEMM_T + t] = _mm256_add_epi32(
                        isum[h * GEMM_T + t],
                        _mm256_add_epi32(_mm256_madd_epi16(p0, sc), _mm256_madd_epi16(p1, sc)));
                }
#endif
            }
        }
        for (int h = 0; h < nh; h++) {
            for (int p = 0; p < 8; p++) {
                const __m256i sc = lane_pairs(src + 3072 + 32 * p, src + 3072 + 32 * p + 16, h, 1);
                for (int t = 0; t < T; t++)
                    ioff[h * GEMM_T + t] = _mm256_add_epi32(ioff[h * GEMM_T + t], _mm256_madd_epi16(
                        sc, _mm256_set1_epi32(xp[(sb * 8 + p) * T + t])));
            }
            const __m256 d = load_f16x8((const uint16_t *)(src + 3328 + 16 * h));
            for (int t = 0; t < T; t++) {
                const __m256i tot = _mm256_sub_epi32(isum[h * GEMM_T + t],
                                                     _mm256_slli_epi32(ioff[h * GEMM_T + t], 5));
                acc[h * GEMM_T + t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(tot), _mm256_mul_ps(d, _mm256_set1_ps(f1[sb * T + t])),
                    acc[h * GEMM_T + t]);
            }
        }
    }
}

#if defined(__AVXVNNI__)
/* sum over p < pairs of the half's int16 pairs of scale rows (base + 32 p, base + 32 p + 16)
 * times the activation sums xp[p]: a K-quant superblock's minimums (Q4_K) or offsets (Q6_K),
 * as the T-token tiles sum them */
FORCE __m256i pair_sums(const uint8_t *base, int pairs, int h, int sign, const int32_t *xp) {
    __m256i sum = _mm256_setzero_si256();
    for (int p = 0; p < pairs; p++)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(
            lane_pairs(base + 32 * p, base + 32 * p + 16, h, sign), _mm256_set1_epi32(xp[p])));
    return sum;
}

/* Q4_K for one token (decode), on AVX-VNNI: a superblock's NH halves together, their sums in
 * registers (as q5_0_one). The T-token tile ran at 28-29 GB/s hot on one thread (AVX-512:
 * 47-52). The same integer sums and float steps per half. */
FORCE void q4k_super(const uint8_t *src, const int NH, const int8_t *x, const int32_t *xp,
                     float f1, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 8; j++) {
        const int8_t *xs = x + 32 * j;
        __m256i a[2], b[2];
        for (int h = 0; h < NH; h++) a[h] = b[h] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i xl = bcast4(xs + 8 * i), xh = bcast4(xs + 8 * i + 4);
            for (int h = 0; h < NH; h++) {
                const __m256i v = half_at(src + 64 * (4 * j + i), h);
                a[h] = _mm256_dpbusd_avx_epi32(a[h], _mm256_and_si256(v, low4), xl);
                b[h] = _mm256_dpbusd_avx_epi32(
                    b[h], _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), xh);
            }
        }
        for (int h = 0; h < NH; h++)
            isum[h] = _mm256_add_epi32(isum[h], _mm256_mullo_epi32(
                _mm256_add_epi32(a[h], b[h]), lane_scales(src + 2048 + 16 * j, h, 0)));
    }
    const __m256 xd = _mm256_set1_ps(f1);
    for (int h = 0; h < NH; h++) {
        const __m256i imin = pair_sums(src + 2176, 4, h, 0, xp);
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), _mm256_mul_ps(
            load_f16x8((const uint16_t *)(src + 2304 + 16 * h)), xd), acc[h]);
        acc[h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(
            load_f16x8((const uint16_t *)(src + 2336 + 16 * h)), xd), acc[h]);
    }
}

/* Q6_K for one token, a superblock's NH halves together as q4k_super: the integer sums of
 * dtile_q6k, and its float steps in its order (the same bits). The T-token tile ran at 31-33
 * GB/s hot on one thread. */
FORCE void q6k_super(const uint8_t *src, const int NH, const int8_t *x, const int32_t *xp,
                     float f1, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 16; j++) {  /* sub-blocks of 16: 4 groups, two chains a half */
        const int8_t *xs = x + 16 * j;
        const __m256i x0 = bcast4(xs), x1 = bcast4(xs + 4), x2 = bcast4(xs + 8);
        const __m256i x3 = bcast4(xs + 12);
        for (int h = 0; h < NH; h++) {
            const __m256i v0 = half_at(src + 128 * j, h), v1 = half_at(src + 128 * j + 64, h);
            const __m256i hb = half_at(src + 2048 + 64 * j, h);
            __m256i a = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_or_si256(
                _mm256_and_si256(v0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top)), x0);
            __m256i b = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4),
                _mm256_and_si256(_mm256_slli_epi16(hb, 2), top)), x1);
            a = _mm256_dpbusd_avx_epi32(a, _mm256_or_si256(_mm256_and_si256(v1, low4),
                                                           _mm256_and_si256(hb, top)), x2);
            b = _mm256_dpbusd_avx_epi32(b, _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4),
                _mm256_and_si256(_mm256_srli_epi16(hb, 2), top)), x3);
            isum[h] = _mm256_add_epi32(isum[h], _mm256_mullo_epi32(
                _mm256_add_epi32(a, b), lane_scales(src + 3072 + 16 * j, h, 1)));
        }
    }
    for (int h = 0; h < NH; h++) {
        const __m256i ioff = pair_sums(src + 3072, 8, h, 1, xp);
        const __m256i tot = _mm256_sub_epi32(isum[h], _mm256_slli_epi32(ioff, 5));
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(
            load_f16x8((const uint16_t *)(src + 3328 + 16 * h)), _mm256_set1_ps(f1)), acc[h]);
    }
}

/* One token (decode) over all columns of a chunk of qtype (a constant in each compiled body),
 * the accumulators of its nh halves in two registers */
FORCE void dtile_one(const int qtype, const uint8_t *src, int cols, const int nh,
                     const int8_t *x, const int32_t *xc, const int32_t *xp, const float *f1,
                     float *out, uint16_t keep) {
    const int nrec = cols / packed_record_cols(qtype);
    const int64_t rec = packed_record_bytes(qtype);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int r = 0; r < nrec; r++, src += rec) {
        PREFETCH(src, rec);
        if (qtype == T_Q4_K) q4k_super(src, nh, x + 256 * (int64_t)r, xp + 4 * r, f1[r], acc);
        else if (qtype == T_Q6_K) q6k_super(src, nh, x + 256 * (int64_t)r, xp + 8 * r, f1[r], acc);
        else if (qtype == T_Q5_0) q5_0_one(src, nh, x + 32 * (int64_t)r, xc[r], f1[r], acc);
        else q8_0_one(src, nh, x + 32 * (int64_t)r, xc[r], f1[r], acc);
    }
    store_half(out, keep & 0xFF, acc[0]);
    if (nh == 2) store_half(out + 8, keep >> 8, acc[1]);
}
#endif

/* 16 rows (two halves; one where the chunk has <= 8 rows) x T tokens over all columns */
FORCE void dtile_any(int qtype, const uint8_t *src, int cols, const int8_t *x, const int32_t *xc,
                     const int32_t *xp, const float *f1, const float *f2, float *out, int64_t ldo,
                     uint16_t keep, const int T) {
    (void)f2;  /* the per-block minimum types are not packed */
    const int nh = keep >> 8 ? 2 : 1;
#if defined(__AVXVNNI__)
    if (T == 1) {  /* decode: the one-token tiles, a body per type and half count */
#define ONE(QT) (nh == 2 ? dtile_one(QT, src, cols, 2, x, xc, xp, f1, out, keep) \
                         : dtile_one(QT, src, cols, 1, x, xc, xp, f1, out, keep))
        switch (qtype) {
        case T_Q4_K: ONE(T_Q4_K); break;
        case T_Q6_K: ONE(T_Q6_K); break;
        case T_Q5_0: ONE(T_Q5_0); break;
        default: ONE(T_Q8_0); break;
        }
#undef ONE
        return;
    }
#endif
    __m256 acc[2 * GEMM_T];
    for (int t = 0; t < 2 * GEMM_T; t++) acc[t] = _mm256_setzero_ps();
    switch (qtype) {
    case T_Q4_K: dtile_q4k(src, cols / 256, nh, x, xp, f1, acc, T); break;
    case T_Q6_K: dtile_q6k(src, cols / 256, nh, x, xp, f1, acc, T); break;
    case T_Q5_0: dtile_q5_0(src, cols / 32, nh, x, xc, f1, acc, T); break;
    default: dtile_q8_0(src, cols / 32, nh, x, xc, f1, acc, T); break;
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < T; t++)
            store_half(out + t * ldo + 8 * h, (keep >> (8 * h)) & 0xFF, acc[h * GEMM_T + t]);
}

#endif

/* one compiled body per tile length */
static void dtile(int qtype, const uint8_t *src, int cols, const int8_t *x, const int32_t *xc,
                  const int32_t *xp, const float *f1, const float *f2, float *out, int64_t ldo,
                  uint16_t keep, int T) {
#define DTILE(T) dtile_any(qtype, src, cols, x, xc, xp, f1, f2, out, ldo, keep, T)
    switch (T) {
    case GEMM_T: DTILE(GEMM_T); break;
    case 7: DTILE(7); break;
    case 6: DTILE(6); break;
    case 5: DTILE(5); break;
    case 4: DTILE(4); break;
    case 3: DTILE(3); break;
    case 2: DTILE(2); break;
    default: DTILE(1); break;
    }
#undef DTILE
}

/* ---- the matmul on packed weights ------------------------------------------------------- */


typedef struct {
    int qtype, rows, cols, n;
    form_t form;
    const uint8_t *packed;
    const gemm_acts_t *acts;
    float *out;  /* (n, rows) */
    int failed;
} packed_job_t;

/* Decode: each token tile straight from the chunk's records. */
static void packed_chunk_decode(const void *ctx, int r0, int r1) {
    const packed_job_t *j = (const packed_job_t *)ctx;
    const gemm_acts_t *a = j->acts;
    const int cols = j->cols, nb = cols / 32, ns = cols / j->form.L;
    const uint8_t *src = j->packed + (int64_t)(r0 / CHUNK_ROWS) * packed_chunk_bytes(j->qtype, cols);
    const uint16_t keep = (uint16_t)((1u << (r1 - r0)) - 1);
    /* The records' prefetches run ahead of the one being read, so the last ones of a chunk
     * fetch the next chunk, which another thread usually claims: a chunk's own first bytes
     * would come in cold, one demand miss at a time. Asked for here, they arrive together. */
    const int64_t head = packed_chunk_bytes(j->qtype, cols) < g_prefetch_ahead
                             ? packed_chunk_bytes(j->qtype, cols) : g_prefetch_ahead;
    for (int64_t b = 0; b < head; b += 64) _mm_prefetch((const char *)src + b, PREFETCH_HINT);
    for (int t0 = 0, T; t0 < j->n; t0 += T) {
        T = tile_len(j->n - t0);
        dtile(j->qtype, src, cols, a->x + (int64_t)t0 * cols, a->xc + (int64_t)t0 * ns,
              a->xp + (int64_t)t0 * (ns / 2), a->f1 + (int64_t)t0 * nb, a->f2 + (int64_t)t0 * nb,
              j->out + (int64_t)t0 * j->rows + r0, j->rows, keep, T);
    }
}

#if defined(HAVE_GEMM)
/* Prefill: one chunk of 16 rows expanded once, then every token tile against it. */
static void packed_chunk_rows(const void *ctx, int r0, int r1) {
    packed_job_t *j = (packed_job_t *)ctx;
    const gemm_acts_t *a = j->acts;
    chunk_t *u = &tl_chunks[0];
    if (!chunk_reserve(u, j->cols)) {
        j->failed = 1;
        return;
    }
    const int cols = j->cols, nb = cols / 32, ns = cols / j->form.L;
    expand_chunk(j->qtype, j->packed + (int64_t)(r0 / CHUNK_ROWS) *
                 packed_chunk_bytes(j->qtype, cols), cols, u);
    const tile_fn tile = tile_for(j->form);
    const int units = cols / (j->form.kq ? 256 : 32);
    const __mmask16 keep = (__mmask16)((1u << (r1 - r0)) - 1);
    for (int t0 = 0, T; t0 < j->n; t0 += T) {
        T = tile_len(j->n - t0);
        tile(u, a->x + (int64_t)t0 * cols, a->xc + (int64_t)t0 * ns, a->f1 + (int64_t)t0 * nb,
             a->f2 + (int64_t)t0 * nb, units, j->out + (int64_t)t0 * j->rows + r0, j->rows,
             keep, T);
    }
}

#endif

/* up to this many tokens (a decode step, a speculative check) the tiles read the records
 * directly; past it each chunk is expanded once for all the token tiles */
#define PACKED_DECODE_MAX 8

static int packed_mt(int qtype, const uint8_t *packed, int rows, int cols, const int8_t *xq,
                     const float *xd, const int32_t *xs, int n, float *out, int nthreads) {
    const form_t f = form_of(qtype);
    gemm_acts_t a = {0};
    if (!acts_init(&a, f, xq, xd, xs, n, cols)) {
        acts_free(&a);
        return -1;
    }
    packed_job_t j = {qtype, rows, cols, n, f, packed, &a, out, 0};
#if defined(HAVE_GEMM)
    if (n <= PACKED_DECODE_MAX) parallel_matvec(packed_chunk_decode, &j, rows, nthreads, n);
    else parallel_rows(packed_chunk_rows, &j, rows, nthreads);
#else  /* AVX2: the records are cheap to re-read from cache for each tile of tokens */
    parallel_matvec(packed_chunk_decode, &j, rows, nthreads, n);
#endif
    acts_free(&a);
    return j.failed ? -1 : 0;
}

/* out (n, rows) = w . x^T for packed weights (ek_pack), x (n, cols) f32 rounded to int8 as
 * ek_matmul_f32 rounds it. Returns 0, -1 without memory, -2 for a type it does not take. */
int ek_matmul_packed(int qtype, const uint8_t *packed, int rows, int cols, const float *x,
                     int n, float *out, int nthreads) {
    if (!ek_packed_bytes(qtype, rows, cols)) return -2;
    acts8_t a;
    if (!acts8_round(&a, qtype, x, n, cols)) return -1;
    const int status = packed_mt(qtype, packed, rows, cols, a.xq, a.xd, a.xs, n, out, nthreads);
    acts8_free(&a);
    return status;
}

/* Several packed matrices of the same width against the same x in one job (decode's Q/K/V and
 * gate/up): x rounded once per type, the threads woken once, the small K/V chunks shared out
 * with Q's. Matrix i's (n, rows[i]) result is stored at out + n * (rows[0] + .. + rows[i-1]);
 * each is bit-identical to its own ek_matmul_packed. Returns 0, -1 without memory, -2 for a
 * type or size it does not take (n > PACKED_DECODE_MAX, count > MULTI_MAX). */
typedef struct {
    int count;
    int first_chunk[MULTI_MAX + 1];
    int rows[MULTI_MAX];
    packed_job_t jobs[MULTI_MAX];
} packed_multi_t;

static void packed_multi_rows(const void *ctx, int r0, int r1) {
    (void)r1;
    const packed_multi_t *m = ctx;
    int lr0, lr1;
    const int i = chunk_owner(m->first_chunk, m->rows, r0 / CHUNK_ROWS, &lr0, &lr1);
    packed_chunk_decode(&m->jobs[i], lr0, lr1);
}

int ek_matmul_packed_multi(int count, const int *qtypes, const uint8_t *const *packed,
                           const int *rows, int cols, const float *x, int n, float *out,
                           int nthreads) {
    if (count < 1 || count > MULTI_MAX || n < 1 || n > PACKED_DECODE_MAX) return -2;
    for (int i = 0; i < count; i++)
        if (!ek_packed_bytes(qtypes[i], rows[i], cols)) return -2;
    /* x rounded and laid out once per distinct type (Q and K usually share one) */
    gemm_acts_t acts[MULTI_MAX];
    int owner[MULTI_MAX], status = 0;
    memset(acts, 0, sizeof acts);
    packed_multi_t m = {.count = count};
    int64_t offset = 0;
    for (int i = 0; i < count && status == 0; i++) {
        owner[i] = i;
        for (int k = 0; k < i; k++)
            if (qtypes[k] == qtypes[i]) owner[i] = owner[k];
        const form_t f = form_of(qtypes[i]);
        if (owner[i] == i) {
            acts8_t r;
            if (!acts8_round(&r, qtypes[i], x, n, cols)) status = -1;
            else {
                if (!acts_init(&acts[i], f, r.xq, r.xd, r.xs, n, cols)) status = -1;
                acts8_free(&r);
            }
        }
        packed_job_t j = {qtypes[i], rows[i], cols, n, f, packed[i], &acts[owner[i]],
                          out + offset, 0};
        m.jobs[i] = j;
        m.rows[i] = rows[i];
        m.first_chunk[i + 1] = m.first_chunk[i] + (rows[i] + CHUNK_ROWS - 1) / CHUNK_ROWS;
        offset += (int64_t)n * rows[i];
    }
    if (status == 0)
        parallel_matvec(packed_multi_rows, &m, m.first_chunk[count] * CHUNK_ROWS, nthreads,
                        n);
    for (int i = 0; i < count; i++) acts_free(&acts[i]);
    return status;
}

/* ---- rows back out (embedding lookups from a tied output matrix) -------------------------
 * out (n, cols) f32 = rows ids of the packed matrix, dequantized with gguf-py's arithmetic
 * (d * q; Q4_K (d * sc) * q - dmin * m; Q6_K (d * sc) * (q - 32)), so a tied embedding needs
 * no file pages of its own. Returns 0, or -2 for a type it does not pack. */
static float packed_value(int qtype, const uint8_t *rec, int lane, int c) {
    const int g = c / 4, j = c % 4, at = 4 * lane + j;
    if (qtype == T_Q8_0)
        return _cvtsh_ss(((const uint16_t *)(rec + 512))[lane]) *
               (float)(int8_t)(rec[64 * g + at] ^ 0x80);
    const uint8_t byte = rec[64 * (g / 2) + at];
    int q = g % 2 ? byte >> 4 : byte & 0x0F;
    if (qtype == T_Q5_0) {
        q |= fifth_bit(rec, g, at) << 4;
        return _cvtsh_ss(((const uint16_t *)(rec + 320))[lane]) * (float)(q - 16);
    }
    if (qtype == T_Q4_K) {
        const int sub = c / 32;
        const float d = _cvtsh_ss(((const uint16_t *)(rec + 2304))[lane]);
        const float dmin = _cvtsh_ss(((const uint16_t *)(rec + 2336))[lane]);
        return d * (float)rec[2048 + 16 * sub + lane] * (float)q -
               dmin * (float)rec[2176 + 16 * sub + lane];
    }
    /* Q6_K */
    q |= ((rec[2048 + 64 * (g / 4) + at] >> (2 * (g % 4))) & 3) << 4;
    const float d = _cvtsh_ss(((const uint16_t *)(rec + 3328))[lane]);
    return d * (float)(int8_t)rec[3072 + 16 * (c / 16) + lane] * (float)(q - 32);
}

int ek_packed_rows(int qtype, const uint8_t *packed, int rows, int cols, const int64_t *ids,
                   int n, float *out) {
    if (!ek_packed_bytes(qtype, rows, cols)) return -2;
    const int rc = packed_record_cols(qtype);
    const int64_t rec_bytes = packed_record_bytes(qtype), chunk = packed_chunk_bytes(qtype, cols);
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= rows) return -1;
        const uint8_t *base = packed + ids[i] / CHUNK_ROWS * chunk;
        const int lane = (int)(ids[i] % CHUNK_ROWS);
        for (int c = 0; c < cols; c++)
            out[(int64_t)i * cols + c] = packed_value(qtype, base + c / rc * rec_bytes, lane,
                                                      c % rc);
    }
    return 0;
}
