/* A decode step's whole transformer block in one call (portable C over the kernel API above).
 *
 * Between a decode step's matmuls the Python op path spent ~14 op calls a block on argument
 * checks, temporaries and cffi, with the caches cold from the weights just streamed: on Gemma
 * 3 270M (18 blocks) that was a fifth of the step. This runs the same kernels, with the same
 * arguments and in the same order as backends/cpu/backend.py's ops do for one block, so the
 * result is the op path's to the bit: norm, fused Q/K/V (+ biases), per-head Q/K norms, RoPE,
 * the KV store and attention (ek_attention_f16_append), the output projection, the optional
 * post-norm, the residual, then the MLP the same way. ek_decode_blocks runs consecutive blocks
 * in one call: the ~10 us of Python per block call, 24-28 times a token, were 2-4% of a
 * small model's decode step.
 */

typedef struct {
    int d, n_heads, n_kv, hd, ffn;  /* widths: model, heads, KV heads, head, MLP hidden */
    float eps, scale, softcap;
    int neox;                       /* RoPE on halves (1) or adjacent pairs (0) */
    int gelu;                       /* GeGLU-tanh (1) or SwiGLU (0) */
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;
    const int *qkv_types;           /* [3] */
    const uint8_t *const *qkv;      /* [3] packed Q, K, V */
    const float *const *qkv_bias;   /* [3], each may be NULL */
    int wo_type, gate_up_types[2], down_type;
    const uint8_t *wo, *down;
    const uint8_t *const *gate_up;  /* [2] */
} block_t;

static void add_rows(float *x, const float *h, int64_t size) {
    for (int64_t i = 0; i < size; i++) x[i] += h[i];
}

/* x (n, d), one token of each of n sequences, goes through the block in place. kc/vc, slot and
 * lo are ek_attention_f16_append's; cos/sin (n, hd/2) the step's RoPE table; scratch holds
 * block_scratch_floats(b, n) floats. attn_threads: the attention's threads (the op path picks
 * them by its size). 0, or a kernel's error (nothing of the block is undone then). */
int ek_decode_block(const block_t *b, float *x, int n, uint16_t *const *kc, uint16_t *const *vc,
                    const int *slot, const int *lo, const float *cos, const float *sin,
                    float *scratch, int nthreads, int attn_threads) {
    const int d = b->d, qd = b->n_heads * b->hd, kvd = b->n_kv * b->hd;
    const int qkv_rows[3] = {qd, kvd, kvd}, gu_rows[2] = {b->ffn, b->ffn};
    float *normed = scratch;                       /* (n, d) */
    float *qkv = normed + (int64_t)n * d;          /* (n, qd) (n, kvd) (n, kvd) one after another */
    float *q = qkv, *k = q + (int64_t)n * qd, *v = k + (int64_t)n * kvd;
    float *qr = v + (int64_t)n * kvd;              /* (n, qd) RoPE'd queries, then attention */
    float *kr = qr + (int64_t)n * qd;              /* (n, kvd) */
    float *att = kr + (int64_t)n * kvd;            /* (n, qd) */
    float *h = att + (int64_t)n * qd;              /* (n, d) */
    float *gu = h + (int64_t)n * d;                /* (n, ffn) gate then (n, ffn) up */
    float *act = gu + 2 * (int64_t)n * b->ffn;     /* (n, ffn) */
    int status;

    ek_rms_norm(x, b->attn_norm, normed, n, d, b->eps);
    status = ek_matmul_packed_multi(3, b->qkv_types, b->qkv, qkv_rows, d, normed, n, qkv,
                                    nthreads);
    if (status) return status;
    for (int i = 0; i < 3; i++) {
        if (!b->qkv_bias[i]) continue;
        float *y = i == 0 ? q : (i == 1 ? k : v);
        for (int t = 0; t < n; t++)
            add_rows(y + (int64_t)t * qkv_rows[i], b->qkv_bias[i], qkv_rows[i]);
    }
    if (b->q_norm) {  /* per head, in place as the op path's fresh arrays would hold them */
        ek_rms_norm(q, b->q_norm, q, (int64_t)n * b->n_heads, b->hd, b->eps);
        ek_rms_norm(k, b->k_norm, k, (int64_t)n * b->n_kv, b->hd, b->eps);
    }
    ek_rope(q, cos, sin, qr, n, b->n_heads, b->hd, b->neox);
    ek_rope(k, cos, sin, kr, n, b->n_kv, b->hd, b->neox);
    status = ek_attention_f16_append(n, qr, kr, v, kc, vc, slot, lo, b->n_heads, b->n_kv, b->hd,
                                     b->scale, b->softcap, att, attn_threads);
    if (status) return status;
    status = ek_matmul_packed(b->wo_type, b->wo, d, qd, att, n, h, nthreads);
    if (status) return status;
    if (b->post_attn_norm) ek_rms_norm(h, b->post_attn_norm, h, n, d, b->eps);
    add_rows(x, h, (int64_t)n * d);

    ek_rms_norm(x, b->ffn_norm, normed, n, d, b->eps);
    status = ek_matmul_packed_multi(2, b->gate_up_types, b->gate_up, gu_rows, d, normed, n, gu,
                                    nthreads);
    if (status) return status;
    const int64_t size = (int64_t)n * b->ffn;
    if (b->gelu) ek_gelu_tanh_mul(gu, gu + size, act, size, nthreads);
    else ek_silu_mul(gu, gu + size, act, size, nthreads);
    status = ek_matmul_packed(b->down_type, b->down, d, b->ffn, act, n, h, nthreads);
    if (status) return status;
    if (b->post_ffn_norm) ek_rms_norm(h, b->post_ffn_norm, h, n, d, b->eps);
    add_rows(x, h, (int64_t)n * d);
    return 0;
}

/* Blocks b[0..n_blocks) one after the other over x, each as ek_decode_block runs it: kc, vc,
 * slot and lo hold n entries per block (block-major), cos/sin and attn_threads one per block,
 * scratch what the largest block needs. 0, or the first error (earlier blocks stay done). */
int ek_decode_blocks(const block_t *const *b, int n_blocks, float *x, int n,
                     uint16_t *const *kc, uint16_t *const *vc, const int *slot, const int *lo,
                     const float *const *cos, const float *const *sin, float *scratch,
                     int nthreads, const int *attn_threads) {
    for (int l = 0; l < n_blocks; l++) {
        const int64_t at = (int64_t)l * n;
        int status = ek_decode_block(b[l], x, n, kc + at, vc + at, slot + at, lo + at, cos[l],
                                     sin[l], scratch, nthreads, attn_threads[l]);
        if (status) return status;
    }
    return 0;
}
