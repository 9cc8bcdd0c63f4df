/* The attention entry points: a batch of sequences in one job, each query row against its own
 * sequence's cache, and one sequence as its case (portable C: compiled after cpu_kernels.c or
 * cpu_neon.c, whose units it runs).
 *
 * Why: a batched decode step has one new token per sequence, each against its own keys. One
 * ek_attention_f16 call per sequence per layer is 8 streams x 24 layers = 192 calls of
 * ~20 us a step, each too small to wake a second thread. Here every sequence's units (a KV
 * head x a block of 16 of its tokens) form one job the pool shares out. Each unit is computed
 * exactly as ek_attention_f16 computes it, so a sequence's output is the same bits alone or
 * in any batch. The unit driver is here, shared by both builds; load_key_block and
 * fold_key_block are each architecture's. */

/* One unit: KV head kh, query heads g_lo..g_hi of its group of G, tokens t0.. of a block of
 * ATTN_QBLOCK. work holds kt (hd, 16), vb (16, hd), acc (R, hd), mx and sum (R,) for the
 * block's R = tokens x G rows. Each row's arithmetic is its own (fold_key_block treats the
 * rows it is given independently), so a row's result is the same whichever unit, head group
 * or batch it is computed in. */
static void attn_unit(const attn_units_t *p, int t0, int kh, int g_lo, int g_hi, float *work) {
    const attn_job_t *a = &p->a;
    const int G = a->n_heads / a->n_kv, hd = a->hd, T = a->T;
    const int nt = p->n - t0 < ATTN_QBLOCK ? p->n - t0 : ATTN_QBLOCK, R = nt * G;
    float *kt = work, *vb = kt + ATTN_KBLOCK * hd, *acc = vb + ATTN_KBLOCK * hd;
    float *mx = acc + (int64_t)R * hd, *sum = mx + R;
    int lo = T, hi = 0;  /* the span of keys any row of the unit attends to */
    for (int t = 0; t < nt; t++) {
        const uint8_t *m = a->mask + (int64_t)(t0 + t) * T;
        int j = 0;
        while (j < lo && !m[j]) j++;
        lo = j < lo ? j : lo;
        j = T;
        while (j > hi && !m[j - 1]) j--;
        hi = j > hi ? j : hi;
    }
    for (int i = 0; i < R * hd; i++) acc[i] = 0.0f;
    for (int r = 0; r < R; r++) mx[r] = -INFINITY, sum[r] = 0.0f;
    for (int j0 = lo - lo % ATTN_KBLOCK; j0 < hi; j0 += ATTN_KBLOCK) {
        load_key_block(a, kh, j0, kt, vb);
        for (int t = 0; t < nt; t++) {
            const uint8_t *m = a->mask + (int64_t)(t0 + t) * T + j0;
            float bias[ATTN_KBLOCK];
            int any = 0;
            for (int jj = 0; jj < ATTN_KBLOCK; jj++) {
                const int ok = j0 + jj < T && m[jj];
                bias[jj] = ok ? 0.0f : -INFINITY;
                any |= ok;
            }
            if (!any) continue;
            const float *q = a->q + ((int64_t)(t0 + t) * a->n_heads + (int64_t)kh * G) * hd;
            for (int g0 = g_lo; g0 < g_hi; g0 += 4) {
                const int r = t * G + g0;
                fold_key_block(a, q + (int64_t)g0 * hd, g_hi - g0 < 4 ? g_hi - g0 : 4, kt, vb,
                               bias, acc + (int64_t)r * hd, mx + r, sum + r);
            }
        }
    }
    for (int t = 0; t < nt; t++)
        for (int g = g_lo; g < g_hi; g++) {
            const int r = t * G + g;
            const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;  /* no key: zeros */
            float *o = a->out + ((int64_t)(t0 + t) * a->n_heads + (int64_t)kh * G + g) * hd;
            for (int d = 0; d < hd; d++) o[d] = acc[(int64_t)r * hd + d] * inv;
        }
}

/* chunk c is unit c: (token block, KV head, head group), the last token blocks (the longest
 * under a causal mask) first */
static void attn_units(const void *ctx, int r0, int r1) {
    (void)r1;
    attn_units_t *p = (attn_units_t *)ctx;
    const int unit = r0 / CHUNK_ROWS, n_kv = p->a.n_kv, G = p->a.n_heads / n_kv;
    const int per_block = n_kv * p->hgroups, hd = p->a.hd;
    const int block = p->nblocks - 1 - unit / per_block, kh = unit % per_block / p->hgroups;
    const int hg = unit % p->hgroups;
    float *work = malloc(sizeof(float) * ((int64_t)2 * ATTN_KBLOCK * hd +
                                          (int64_t)ATTN_QBLOCK * G * (hd + 2)));
    if (!work) {
        p->a.failed = 1;
        return;
    }
    attn_unit(p, block * ATTN_QBLOCK, kh, G * hg / p->hgroups, G * (hg + 1) / p->hgroups, work);
    free(work);
}

/* Head groups per KV head: 1, unless the job has fewer units than threads (one sequence's
 * decode token with one KV head, as Gemma 3's: one unit, one busy core). Then a KV head's
 * query heads are shared out; each unit converts the head's keys itself, so this only pays
 * where a core would otherwise wait. The results are the same bits either way. */
static int attn_head_groups(int units, int G, int nthreads) {
    if (nthreads < 2 || units >= nthreads || G < 2) return 1;
    const int want = (nthreads + units - 1) / units;
    return want < G ? want : G;
}

typedef struct {
    attn_units_t *seq;  /* (count,) one sequence's job each */
    const int *first;   /* (count + 1,) each sequence's first unit in the batch */
} attn_batch_t;

static void attn_batch_units(const void *ctx, int r0, int r1) {
    const attn_batch_t *b = (const attn_batch_t *)ctx;
    const int unit = r0 / CHUNK_ROWS;
    int s = 0;
    while (unit >= b->first[s + 1]) s++;
    attn_units(&b->seq[s], (unit - b->first[s]) * CHUNK_ROWS, r1);
}

/* q and out (sum n, n_heads, hd): the sequences' rows one after another; sequence s has n[s]
 * rows, keys and values k[s], v[s] (T[s], n_kv, hd) f16 and mask[s] (n[s], T[s]).
 * Returns 0, -1 without memory, -2 for a head layout (or an empty sequence) it does not take. */
int ek_attention_f16_batch(int count, const float *q, const uint16_t *const *k,
                           const uint16_t *const *v, const uint8_t *const *mask, const int *n,
                           const int *T, int n_heads, int n_kv, int hd, float scale,
                           float softcap, float *out, int nthreads) {
    if (hd % 8 || n_kv < 1 || n_heads % n_kv || count < 1) return -2;
    for (int s = 0; s < count; s++)
        if (n[s] < 1) return -2;
    attn_units_t *seq = malloc(sizeof(attn_units_t) * (size_t)count);
    int *first = malloc(sizeof(int) * ((size_t)count + 1));
    if (!seq || !first) {
        free(seq);
        free(first);
        return -1;
    }
    int64_t row = 0, base = 0;
    for (int s = 0; s < count; s++) base += (int64_t)(n[s] + ATTN_QBLOCK - 1) / ATTN_QBLOCK * n_kv;
    const int hgroups = attn_head_groups(base < nthreads ? (int)base : nthreads,
                                         n_heads / n_kv, nthreads);
    first[0] = 0;
    for (int s = 0; s < count; s++) {
        const int64_t at = row * n_heads * hd;
        const attn_job_t a = {q + at, k[s], v[s], mask[s], n_heads, n_kv, hd, T[s], scale,
                              softcap, out + at, 0};
        seq[s] = (attn_units_t){a, n[s], (n[s] + ATTN_QBLOCK - 1) / ATTN_QBLOCK, hgroups};
        first[s + 1] = first[s] + seq[s].nblocks * n_kv * hgroups;
        row += n[s];
    }
    const attn_batch_t b = {seq, first};
    parallel_rows(attn_batch_units, &b, first[count] * CHUNK_ROWS, nthreads);
    int failed = 0;
    for (int s = 0; s < count; s++) failed |= seq[s].a.failed;
    free(seq);
    free(first);
    return failed ? -1 : 0;
}

/* One sequence: q and out (n, n_heads, hd), k and v (T, n_kv, hd) f16, mask (n, T).
 * Returns 0, -1 without memory, -2 for a head layout it does not take. */
int ek_attention_f16(const float *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask,
                     int n, int n_heads, int n_kv, int hd, int T, float scale, float softcap,
                     float *out, int nthreads) {
    return ek_attention_f16_batch(1, q, &k, &v, &mask, &n, &T, n_heads, n_kv, hd, scale,
                                  softcap, out, nthreads);
}

/* A decode step's attention with its own keys written first: sequence s has one query row
 * (n_heads, hd) of q; its new key and value rows k_new[s], v_new[s] (n_kv, hd) f32 are stored
 * as f16 in slot[s] of its cache kc[s], vc[s] (slots, n_kv, hd), and the row attends to
 * slots lo[s]..slot[s] (keys past a window hidden below lo). The same bits as storing the rows
 * and calling ek_attention_f16_batch with masks of ones over [lo, slot]; one call a layer
 * instead of a cache update and its mask per sequence. Returns as ek_attention_f16_batch. */
int ek_attention_f16_append(int count, const float *q, const float *k_new, const float *v_new,
                            uint16_t *const *kc, uint16_t *const *vc, const int *slot,
                            const int *lo, int n_heads, int n_kv, int hd, float scale,
                            float softcap, float *out, int nthreads) {
    if (hd % 8 || n_kv < 1 || n_heads % n_kv || count < 1) return -2;  /* nothing written */
    const int64_t row = (int64_t)n_kv * hd;
    int64_t total = 0;
    for (int s = 0; s < count; s++) {
        if (slot[s] < 0 || lo[s] < 0 || lo[s] > slot[s]) return -2;
        total += slot[s] + 1;
    }
    uint8_t *bits = malloc((size_t)total);
    const uint8_t **mask = malloc(sizeof(uint8_t *) * (size_t)count);
    int *n = malloc(sizeof(int) * (size_t)count), *T = malloc(sizeof(int) * (size_t)count);
    int status = -1;
    if (bits && mask && n && T) {
        uint8_t *m = bits;
        for (int s = 0; s < count; s++) {
            f16_store_row(kc[s] + (int64_t)slot[s] * row, k_new + s * row, row);
            f16_store_row(vc[s] + (int64_t)slot[s] * row, v_new + s * row, row);
            T[s] = slot[s] + 1;
            n[s] = 1;
            memset(m, 0, (size_t)lo[s]);
            memset(m + lo[s], 1, (size_t)(T[s] - lo[s]));
            mask[s] = m;
            m += T[s];
        }
        status = ek_attention_f16_batch(count, q, (const uint16_t *const *)kc,
                                        (const uint16_t *const *)vc, mask, n, T, n_heads, n_kv,
                                        hd, scale, softcap, out, nthreads);
    }
    free(bits);
    free(mask);
    free(n);
    free(T);
    return status;
}
