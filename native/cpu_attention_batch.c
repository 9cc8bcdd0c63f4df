/* The attention entry points: a batch of sequences in one job, each query row against its own
 * sequence's cache, and one sequence as its case (portable C: compiled after cpu_kernels.c or
 * cpu_neon.c, whose units it runs).
 *
 * Why: a batched decode step has one new token per sequence, each against its own keys. One
 * ek_attention_f16 call per sequence per layer is 8 streams x 24 layers = 192 calls of
 * ~20 us a step, each too small to wake a second thread. Here every sequence's units (a KV
 * head x a block of 16 of its tokens) form one job the pool shares out. Each unit is computed
 * exactly as ek_attention_f16 computes it, so a sequence's output is the same bits alone or
 * in any batch. */

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
    int64_t row = 0;
    first[0] = 0;
    for (int s = 0; s < count; s++) {
        const int64_t at = row * n_heads * hd;
        const attn_job_t a = {q + at, k[s], v[s], mask[s], n_heads, n_kv, hd, T[s], scale,
                              softcap, out + at, 0};
        seq[s] = (attn_units_t){a, n[s], (n[s] + ATTN_QBLOCK - 1) / ATTN_QBLOCK};
        first[s + 1] = first[s] + seq[s].nblocks * n_kv;
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
