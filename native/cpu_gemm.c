/* Prefill GEMM: many tokens against a quantized weight, int8 x int8 on AVX-512 VNNI.
 *
 * Compiled as one unit after cpu_kernels.c (it uses its block helpers and thread pool).
 *
 * The mat-vec kernels unpack every weight block for each group of 8 tokens and spend several
 * instructions per 32 products; at prefill sizes that is compute-bound. Here each chunk of
 * CHUNK_ROWS rows is unpacked once into a flat layout (one unsigned byte per weight plus its
 * scales), then a register tile of GEMM_R rows x GEMM_T tokens runs over it with 64-byte
 * vectors, so each weight vector load serves GEMM_T tokens and each activation load GEMM_R
 * rows.
 *
 * Two arithmetic forms, the same as llama.cpp's (so the rounding matches the mat-vec path's):
 *   K-quants (Q4_K, Q5_K, Q6_K) against Q8_K activations (one scale per 256):
 *       w = d * sc_g * q - dmin * m_g     per 16-element group g, q unsigned, sc_g, m_g ints
 *       sum(w x) = xd * (d * sum_g sc_g * dot(q, xq)_g - dmin * sum_g m_g * sum(xq)_g)
 *     the group scales are applied in int32 (vpmaddubsw, then vpdpwssd by sc_g), one float
 *     step per 256; Q6_K is q - 32 with int8 scales: m_g = 32 * sc_g, dmin = d.
 *   The other types against Q8_0 activations (a float scale per 32):
 *       w = d_b * q + m_b     per block b   (Q4_0: m = -8 d, Q5_0: -16 d, Q8_0: q + 128, m = -128 d)
 *       sum(w x) = sum_b d_b xd_b dot(q, xq)_b + sum_b m_b xd_b sum(xq)_b
 *     vpdpbusd per 64 bytes (two blocks), scaled per lane in float.
 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_GEMM 1

#define GEMM_R 4  /* rows per register tile */
#define GEMM_T 4  /* tokens per register tile */

static int is_kquant(int qtype) { return qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K; }

/* Activations of all tokens, in tiles of GEMM_T tokens (zero-padded), cols padded to 64. */
typedef struct {
    int n, ntiles, cols, cols64;
    int8_t *x;      /* (ntiles, cols64 / 64, GEMM_T, 64) */
    float *xd;      /* K: (ntiles, cols / 256, GEMM_T);  else: (ntiles, cols64 / 64, GEMM_T, 16) */
    int16_t *xs16;  /* K: (ntiles, cols / 256, GEMM_T, 16) group sums */
    float *xsum;    /* else: (ntiles * GEMM_T, cols64 / 32): xd_b * sum(xq)_b */
} gemm_acts_t;

static void acts_free(gemm_acts_t *a) {
    free(a->x);
    free(a->xd);
    free(a->xs16);
    free(a->xsum);
}

static int acts_init(gemm_acts_t *a, int kq, const int8_t *xq, const float *xd,
                     const int32_t *xs, int n, int cols) {
    const int nb = cols / 32, c64 = (cols + 63) / 64, nt = (n + GEMM_T - 1) / GEMM_T;
    memset(a, 0, sizeof *a);
    a->n = n;
    a->ntiles = nt;
    a->cols = cols;
    a->cols64 = 64 * c64;
    a->x = calloc((size_t)nt * c64 * GEMM_T * 64, 1);
    if (kq) {
        a->xd = calloc((size_t)nt * (cols / 256) * GEMM_T, sizeof(float));
        a->xs16 = calloc((size_t)nt * (cols / 256) * GEMM_T * 16, sizeof(int16_t));
    } else {
        a->xd = calloc((size_t)nt * c64 * GEMM_T * 16, sizeof(float));
        a->xsum = calloc((size_t)nt * GEMM_T * 2 * c64, sizeof(float));
    }
    if (!a->x || !a->xd || (kq ? !a->xs16 : !a->xsum)) return 0;
    for (int t = 0; t < n; t++) {
        const int tile = t / GEMM_T, u = t % GEMM_T;
        const int8_t *q = xq + (int64_t)t * cols;
        const float *d = xd + (int64_t)t * nb;
        const int32_t *s = xs + (int64_t)t * 2 * nb;
        for (int c = 0; c < c64; c++) {
            const int len = cols - 64 * c < 64 ? cols - 64 * c : 64;
            memcpy(a->x + (((int64_t)tile * c64 + c) * GEMM_T + u) * 64, q + 64 * c, len);
        }
        if (kq) {
            for (int sb = 0; sb < cols / 256; sb++) {
                const int64_t at = ((int64_t)tile * (cols / 256) + sb) * GEMM_T + u;
                a->xd[at] = d[8 * sb];
                for (int g = 0; g < 16; g++) a->xs16[16 * at + g] = (int16_t)s[16 * sb + g];
            }
        } else {
            for (int b = 0; b < nb; b++) {
                float *lane = a->xd + (((int64_t)tile * c64 + b / 2) * GEMM_T + u) * 16 + 8 * (b % 2);
                for (int i = 0; i < 8; i++) lane[i] = d[b];
                a->xsum[(int64_t)t * 2 * c64 + b] = d[b] * (float)(s[2 * b] + s[2 * b + 1]);
            }
        }
    }
    return 1;
}

/* CHUNK_ROWS rows unpacked: one unsigned byte per weight and the scales of the chosen form. */
typedef struct {
    uint8_t *q;     /* (CHUNK_ROWS, cols64) */
    int16_t *sc;    /* K: (CHUNK_ROWS, cols64 / 2): sc_g for each int16 lane after vpmaddubsw */
    int16_t *m;     /* K: (CHUNK_ROWS, cols / 16) */
    float *d, *dmin;/* K: (CHUNK_ROWS, cols / 256) */
    float *dl;      /* else: (CHUNK_ROWS, cols64 / 64, 16): d_b per int32 lane */
    float *mb;      /* else: (CHUNK_ROWS, cols64 / 32) */
    size_t cap;
} unpacked_t;

static __thread unpacked_t tl_unpacked;  /* grown on demand, one per thread, never freed */

static int unpacked_reserve(unpacked_t *u, int cols64) {
    const size_t need = (size_t)cols64;
    if (u->cap >= need) return 1;
    free(u->q); free(u->sc); free(u->m); free(u->d); free(u->dmin); free(u->dl); free(u->mb);
    const size_t R = CHUNK_ROWS;
    u->q = calloc(R * need, 1);
    u->sc = calloc(R * need / 2, sizeof(int16_t));
    u->m = calloc(R * need / 16, sizeof(int16_t));
    u->d = calloc(R * need / 256 + R, sizeof(float));
    u->dmin = calloc(R * need / 256 + R, sizeof(float));
    u->dl = calloc(R * need / 4, sizeof(float));
    u->mb = calloc(R * need / 32, sizeof(float));
    u->cap = u->q && u->sc && u->m && u->d && u->dmin && u->dl && u->mb ? need : 0;
    return u->cap != 0;
}

/* Row `row` of a K-quant matrix into slot r of u. */
static void unpack_k_row(int qtype, const uint8_t *w, int cols, int cols64, unpacked_t *u, int r) {
    uint8_t *q = u->q + (int64_t)r * cols64;
    int16_t *sc = u->sc + (int64_t)r * cols64 / 2, *m = u->m + (int64_t)r * cols / 16;
    float *d = u->d + (int64_t)r * (cols / 256), *dmin = u->dmin + (int64_t)r * (cols / 256);
    for (int sb = 0; sb < cols / 256; sb++, q += 256, sc += 128, m += 16) {
        int gsc[16], gm[16];
        if (qtype == T_Q6_K) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *s8 = (const int8_t *)(w + 192);
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], hb = qh[32 * h + l];
                    q[128 * h + l] = (lo & 0xF) | ((hb & 3) << 4);
                    q[128 * h + 32 + l] = (hi & 0xF) | (((hb >> 2) & 3) << 4);
                    q[128 * h + 64 + l] = (lo >> 4) | (((hb >> 4) & 3) << 4);
                    q[128 * h + 96 + l] = (hi >> 4) | (((hb >> 6) & 3) << 4);
                }
            for (int g = 0; g < 16; g++) { gsc[g] = s8[g]; gm[g] = 32 * s8[g]; }
            d[sb] = dmin[sb] = f16(w + 208);
            w += 210;
        } else {
            const int five = qtype == T_Q5_K;
            const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
                    if (five) {
                        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                    }
                    q[64 * j + l] = (uint8_t)lo;
                    q[64 * j + 32 + l] = (uint8_t)hi;
                }
            for (int j = 0; j < 8; j++) {
                uint8_t s, mn;
                scale_min_k4(j, w + 4, &s, &mn);
                gsc[2 * j] = gsc[2 * j + 1] = s;
                gm[2 * j] = gm[2 * j + 1] = mn;
            }
            d[sb] = f16(w);
            dmin[sb] = f16(w + 2);
            w += five ? 176 : 144;
        }
        /* after vpmaddubsw, int16 lane i holds bytes 2i, 2i + 1: group (2i) / 16 */
        for (int i = 0; i < 128; i++) sc[i] = (int16_t)gsc[i / 8];
        for (int g = 0; g < 16; g++) m[g] = (int16_t)gm[g];
    }
}

/* Row of a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrix into slot r of u. */
static void unpack_b_row(int qtype, const uint8_t *w, int cols, int cols64, unpacked_t *u, int r) {
    uint8_t *q = u->q + (int64_t)r * cols64;
    float *dl = u->dl + (int64_t)r * (cols64 / 4), *mb = u->mb + (int64_t)r * (cols64 / 32);
    for (int b = 0; b < cols / 32; b++, q += 32) {
        float d = f16(w), m;
        if (qtype == T_Q8_0) {
            for (int i = 0; i < 32; i++) q[i] = (uint8_t)(w[2 + i] ^ 0x80);  /* q + 128 */
            m = -128.0f * d;
            w += 34;
        } else {
            const int one = qtype == T_Q4_1 || qtype == T_Q5_1;
            const int five = qtype == T_Q5_0 || qtype == T_Q5_1;
            const uint8_t *qs = w + 2 + 2 * one + 4 * five;
            uint32_t qh = 0;
            if (five) memcpy(&qh, w + 2 + 2 * one, 4);
            for (int i = 0; i < 16; i++) {
                q[i] = (uint8_t)((qs[i] & 0xF) | (((qh >> i) & 1) << 4));
                q[i + 16] = (uint8_t)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
            }
            m = one ? f16(w + 2) : -(five ? 16.0f : 8.0f) * d;
            w += 18 + 2 * one + 4 * five;
        }
        for (int i = 0; i < 8; i++) dl[16 * (b / 2) + 8 * (b % 2) + i] = d;
        mb[b] = m;
    }
}

static inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

/* Rows r..r+GEMM_R-1 of u (K form) x token tile `tile`: out[t][r]. */
static void tile_k(const unpacked_t *u, int r, const gemm_acts_t *a, int tile, int cols,
                   float res[GEMM_R][GEMM_T]) {
    const int c64 = a->cols64 / 64, nsb = cols / 256;
    __m512 acc[GEMM_R][GEMM_T];
    __m256 accm[GEMM_R][GEMM_T];
    for (int i = 0; i < GEMM_R; i++)
        for (int t = 0; t < GEMM_T; t++) {
            acc[i][t] = _mm512_setzero_ps();
            accm[i][t] = _mm256_setzero_ps();
        }
    const int8_t *x = a->x + (int64_t)tile * c64 * GEMM_T * 64;
    for (int sb = 0; sb < nsb; sb++) {
        __m512i isum[GEMM_R][GEMM_T];
        for (int i = 0; i < GEMM_R; i++)
            for (int t = 0; t < GEMM_T; t++) isum[i][t] = _mm512_setzero_si512();
        for (int c = 4 * sb; c < 4 * sb + 4; c++) {
            __m512i xv[GEMM_T];
            for (int t = 0; t < GEMM_T; t++)
                xv[t] = _mm512_loadu_si512(x + ((int64_t)c * GEMM_T + t) * 64);
            for (int i = 0; i < GEMM_R; i++) {
                const __m512i qv = _mm512_loadu_si512(u->q + (int64_t)(r + i) * a->cols64 + 64 * c);
                const __m512i sv = _mm512_loadu_si512(u->sc + (int64_t)(r + i) * a->cols64 / 2 + 32 * c);
                for (int t = 0; t < GEMM_T; t++)
                    isum[i][t] = _mm512_dpwssd_epi32(isum[i][t], _mm512_maddubs_epi16(qv, xv[t]), sv);
            }
        }
        const int64_t at = ((int64_t)tile * nsb + sb) * GEMM_T;
        for (int i = 0; i < GEMM_R; i++) {
            const float d = u->d[(r + i) * nsb + sb], dmin = u->dmin[(r + i) * nsb + sb];
            const __m256i mv = _mm256_loadu_si256((const __m256i *)(u->m + (int64_t)(r + i) * (cols / 16) + 16 * sb));
            for (int t = 0; t < GEMM_T; t++) {
                const float D = a->xd[at + t];
                const __m256i xs = _mm256_loadu_si256((const __m256i *)(a->xs16 + 16 * (at + t)));
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][t]), _mm512_set1_ps(d * D), acc[i][t]);
                accm[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mv, xs)),
                                             _mm256_set1_ps(dmin * D), accm[i][t]);
            }
        }
    }
    for (int i = 0; i < GEMM_R; i++)
        for (int t = 0; t < GEMM_T; t++) res[i][t] = hsum16(acc[i][t]) - hsum8(accm[i][t]);
}

/* Rows r..r+GEMM_R-1 of u (per-block form) x token tile `tile`: out[t][r]. */
static void tile_b(const unpacked_t *u, int r, const gemm_acts_t *a, int tile,
                   float res[GEMM_R][GEMM_T]) {
    const int c64 = a->cols64 / 64;
    __m512 acc[GEMM_R][GEMM_T];
    for (int i = 0; i < GEMM_R; i++)
        for (int t = 0; t < GEMM_T; t++) acc[i][t] = _mm512_setzero_ps();
    const int8_t *x = a->x + (int64_t)tile * c64 * GEMM_T * 64;
    const float *xd = a->xd + (int64_t)tile * c64 * GEMM_T * 16;
    for (int c = 0; c < c64; c++) {
        __m512i xv[GEMM_T];
        __m512 xs[GEMM_T];
        for (int t = 0; t < GEMM_T; t++) {
            xv[t] = _mm512_loadu_si512(x + ((int64_t)c * GEMM_T + t) * 64);
            xs[t] = _mm512_loadu_ps(xd + ((int64_t)c * GEMM_T + t) * 16);
        }
        for (int i = 0; i < GEMM_R; i++) {
            const __m512i qv = _mm512_loadu_si512(u->q + (int64_t)(r + i) * a->cols64 + 64 * c);
            const __m512 dv = _mm512_loadu_ps(u->dl + (int64_t)(r + i) * (a->cols64 / 4) + 16 * c);
            for (int t = 0; t < GEMM_T; t++) {
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qv, xv[t]);
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv, xs[t]), acc[i][t]);
            }
        }
    }
    const int nb32 = a->cols64 / 32;
    for (int i = 0; i < GEMM_R; i++) {
        const float *mb = u->mb + (int64_t)(r + i) * nb32;
        for (int t = 0; t < GEMM_T; t++) {
            const float *xsum = a->xsum + ((int64_t)tile * GEMM_T + t) * nb32;
            __m512 mm = _mm512_setzero_ps();
            int b = 0;
            for (; b + 16 <= nb32; b += 16)
                mm = _mm512_fmadd_ps(_mm512_loadu_ps(mb + b), _mm512_loadu_ps(xsum + b), mm);
            float tail = 0.0f;
            for (; b < nb32; b++) tail += mb[b] * xsum[b];
            res[i][t] = hsum16(acc[i][t]) + hsum16(mm) + tail;
        }
    }
}

typedef struct {
    int qtype, kq, rows, cols;
    const uint8_t *w;
    int64_t row_bytes;
    const gemm_acts_t *acts;
    float *out;  /* (n, rows) */
    int failed;
} gemm_job_t;

static void gemm_rows(const void *ctx, int r0, int r1) {
    gemm_job_t *j = (gemm_job_t *)ctx;
    const gemm_acts_t *a = j->acts;
    unpacked_t *u = &tl_unpacked;
    if (!unpacked_reserve(u, a->cols64)) {
        j->failed = 1;
        return;
    }
    const int nr = r1 - r0;
    /* padding (rows past the chunk's end, columns past cols) multiplies as zero */
    memset(u->q, 0, (size_t)CHUNK_ROWS * a->cols64);
    if (!j->kq) {
        memset(u->dl, 0, sizeof(float) * CHUNK_ROWS * (a->cols64 / 4));
        memset(u->mb, 0, sizeof(float) * CHUNK_ROWS * (a->cols64 / 32));
    }
    for (int r = 0; r < nr; r++) {
        const uint8_t *w = j->w + (int64_t)(r0 + r) * j->row_bytes;
        if (j->kq) unpack_k_row(j->qtype, w, j->cols, a->cols64, u, r);
        else unpack_b_row(j->qtype, w, j->cols, a->cols64, u, r);
    }
    for (int tile = 0; tile < a->ntiles; tile++) {
        for (int r = 0; r < nr; r += GEMM_R) {
            float res[GEMM_R][GEMM_T];
            if (j->kq) tile_k(u, r, a, tile, j->cols, res);
            else tile_b(u, r, a, tile, res);
            for (int t = 0; t < GEMM_T && tile * GEMM_T + t < a->n; t++)
                for (int i = 0; i < GEMM_R && r + i < nr; i++)
                    j->out[(int64_t)(tile * GEMM_T + t) * j->rows + r0 + r + i] = res[i][t];
        }
    }
}

/* out (n, rows) = w (rows, cols) . x (n, cols)^T from the quantized activations (as
 * ek_matvec_mt). Returns 0; -1 out of memory; -2 where this build or type has no GEMM. */
int ek_gemm_mt(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
               const int8_t *xq, const float *xd, const int32_t *xs, int n, float *out,
               int nthreads) {
    if (!dot_for(qtype) || cols % 32) return -2;
    const int kq = is_kquant(qtype);
    if (kq) /* the K form needs Q8_K activations: one scale per 256 */
        for (int64_t i = 0; i < (int64_t)n * (cols / 32); i++)
            if (xd[i] != xd[i & ~(int64_t)7]) return -2;
    gemm_acts_t a;
    if (!acts_init(&a, kq, xq, xd, xs, n, cols)) {
        acts_free(&a);
        return -1;
    }
    gemm_job_t j = {qtype, kq, rows, cols, w, row_bytes, &a, out, 0};
    parallel_rows(gemm_rows, &j, rows, nthreads);
    acts_free(&a);
    return j.failed ? -1 : 0;
}

int ek_has_gemm(void) { return 1; }

#else  /* AVX2 only: prefill stays on the mat-vec kernels */

int ek_gemm_mt(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
               const int8_t *xq, const float *xd, const int32_t *xs, int n, float *out,
               int nthreads) {
    (void)qtype; (void)w; (void)row_bytes; (void)rows; (void)cols; (void)xq; (void)xd;
    (void)xs; (void)n; (void)out; (void)nthreads;
    return -2;
}

int ek_has_gemm(void) { return 0; }

#endif
