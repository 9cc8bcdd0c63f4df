/* Prefill GEMM for the per-block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on AVX-512 VNNI.
 *
 * Compiled as one unit after cpu_kernels.c (it uses its block helpers and thread pool).
 *
 * Against these types the mat-vec kernels spend several instructions per 32 products on
 * per-block float scaling, 8 tokens at a time. Here each chunk of CHUNK_ROWS rows is unpacked
 * once into one unsigned byte per weight plus per-lane scales, then a register tile of GEMM_R
 * rows x GEMM_T tokens runs over it with 64-byte vectors (two blocks per vpdpbusd), so each
 * weight load serves GEMM_T tokens and each activation load GEMM_R rows:
 *       w = d_b * q + m_b     per block b   (Q4_0: m = -8 d, Q5_0: -16 d, Q8_0: q + 128, m = -128 d)
 *       sum(w x) = sum_b d_b xd_b dot(q, xq)_b + sum_b m_b xd_b sum(xq)_b
 * K-quants stay on the mat-vec kernels, which are faster for them (their scales are applied
 * in int32 per superblock already): one thread, 2048 x 1536 Q4_K, 512 tokens, 110 GFLOP/s
 * against 95 for a K form of this tile.
 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_GEMM 1

#ifndef GEMM_R
#define GEMM_R 4  /* rows per register tile */
#endif
#ifndef GEMM_T
#define GEMM_T 4  /* tokens per register tile */
#endif
_Static_assert(CHUNK_ROWS % GEMM_R == 0, "a chunk's unpacked rows must fill whole tiles");

/* Activations of all tokens, in tiles of GEMM_T tokens (zero-padded), cols padded to 64. */
typedef struct {
    int n, ntiles, cols, cols64;
    int8_t *x;    /* (ntiles, cols64 / 64, GEMM_T, 64) */
    float *xd;    /* (ntiles, cols64 / 64, GEMM_T, 16): xd_b per int32 lane of vpdpbusd */
    float *xsum;  /* (ntiles * GEMM_T, cols64 / 32): xd_b * sum(xq)_b */
} gemm_acts_t;

static void acts_free(gemm_acts_t *a) {
    free(a->x);
    free(a->xd);
    free(a->xsum);
}

static int acts_init(gemm_acts_t *a, const int8_t *xq, const float *xd, const int32_t *xs,
                     int n, int cols) {
    const int nb = cols / 32, c64 = (cols + 63) / 64, nt = (n + GEMM_T - 1) / GEMM_T;
    memset(a, 0, sizeof *a);
    a->n = n;
    a->ntiles = nt;
    a->cols = cols;
    a->cols64 = 64 * c64;
    a->x = calloc((size_t)nt * c64 * GEMM_T * 64, 1);
    a->xd = calloc((size_t)nt * c64 * GEMM_T * 16, sizeof(float));
    a->xsum = calloc((size_t)nt * GEMM_T * 2 * c64, sizeof(float));
    if (!a->x || !a->xd || !a->xsum) return 0;
    for (int t = 0; t < n; t++) {
        const int tile = t / GEMM_T, u = t % GEMM_T;
        const int8_t *q = xq + (int64_t)t * cols;
        const float *d = xd + (int64_t)t * nb;
        const int32_t *s = xs + (int64_t)t * 2 * nb;
        for (int c = 0; c < c64; c++) {
            const int len = cols - 64 * c < 64 ? cols - 64 * c : 64;
            memcpy(a->x + (((int64_t)tile * c64 + c) * GEMM_T + u) * 64, q + 64 * c, len);
        }
        for (int b = 0; b < nb; b++) {
            float *lane = a->xd + (((int64_t)tile * c64 + b / 2) * GEMM_T + u) * 16 + 8 * (b % 2);
            for (int i = 0; i < 8; i++) lane[i] = d[b];
            a->xsum[(int64_t)t * 2 * c64 + b] = d[b] * (float)(s[2 * b] + s[2 * b + 1]);
        }
    }
    return 1;
}

/* CHUNK_ROWS rows unpacked: one unsigned byte per weight and per-block scales. */
typedef struct {
    uint8_t *q;  /* (CHUNK_ROWS, cols64) */
    float *dl;   /* (CHUNK_ROWS, cols64 / 64, 16): d_b per int32 lane */
    float *mb;   /* (CHUNK_ROWS, cols64 / 32) */
    size_t cap;
} unpacked_t;

static __thread unpacked_t tl_unpacked;  /* grown on demand, one per thread, never freed */

static int unpacked_reserve(unpacked_t *u, int cols64) {
    const size_t need = (size_t)cols64, R = CHUNK_ROWS;
    if (u->cap >= need) return 1;
    free(u->q);
    free(u->dl);
    free(u->mb);
    u->q = calloc(R * need, 1);
    u->dl = calloc(R * need / 4, sizeof(float));
    u->mb = calloc(R * need / 32, sizeof(float));
    u->cap = u->q && u->dl && u->mb ? need : 0;
    return u->cap != 0;
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
            res[i][t] = _mm512_reduce_add_ps(acc[i][t]) + _mm512_reduce_add_ps(mm) + tail;
        }
    }
}

typedef struct {
    int qtype, rows, cols;
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
    memset(u->dl, 0, sizeof(float) * CHUNK_ROWS * (a->cols64 / 4));
    memset(u->mb, 0, sizeof(float) * CHUNK_ROWS * (a->cols64 / 32));
    for (int r = 0; r < nr; r++)
        unpack_b_row(j->qtype, j->w + (int64_t)(r0 + r) * j->row_bytes, j->cols, a->cols64, u, r);
    for (int tile = 0; tile < a->ntiles; tile++) {
        for (int r = 0; r < nr; r += GEMM_R) {
            float res[GEMM_R][GEMM_T];
            tile_b(u, r, a, tile, res);
            for (int t = 0; t < GEMM_T && tile * GEMM_T + t < a->n; t++)
                for (int i = 0; i < GEMM_R && r + i < nr; i++)
                    j->out[(int64_t)(tile * GEMM_T + t) * j->rows + r0 + r + i] = res[i][t];
        }
    }
}

/* out (n, rows) = w (rows, cols) . x (n, cols)^T from Q8_0 activations (as matvec_mt).
 * Returns 0; -1 out of memory; -2 for a type this GEMM does not take (K-quants, which run
 * faster on the mat-vec kernels) or a build without AVX-512 VNNI. */
static int gemm_mt(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
                   const int8_t *xq, const float *xd, const int32_t *xs, int n, float *out,
                   int nthreads) {
    if (!(qtype == T_Q4_0 || qtype == T_Q4_1 || qtype == T_Q5_0 || qtype == T_Q5_1 ||
          qtype == T_Q8_0) || cols % 32)
        return -2;
    gemm_acts_t a;
    if (!acts_init(&a, xq, xd, xs, n, cols)) {
        acts_free(&a);
        return -1;
    }
    gemm_job_t j = {qtype, rows, cols, w, row_bytes, &a, out, 0};
    parallel_rows(gemm_rows, &j, rows, nthreads);
    acts_free(&a);
    return j.failed ? -1 : 0;
}



#else  /* AVX2 only: prefill stays on the mat-vec kernels */

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
    int8_t *xq = malloc((size_t)n * cols);
    float *xd = malloc(sizeof(float) * n * (cols / 32));
    int32_t *xs = malloc(sizeof(int32_t) * n * (cols / 16));
    int status = -1;
    if (xq && xd && xs) {
        if (is_kquant(qtype)) quantize_rows_q8k(x, n, cols, xq, xd, xs);
        else quantize_rows(x, n, cols, xq, xd, xs);
        status = n > gemm_min ? gemm_mt(qtype, w, row_bytes, rows, cols, xq, xd, xs, n, out,
                                        nthreads) : -2;
        if (status == -2)
            status = matvec_mt(qtype, w, row_bytes, rows, cols, xq, xd, xs, n, out, nthreads);
    }
    free(xq);
    free(xd);
    free(xs);
    return status;
}
