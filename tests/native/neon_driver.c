/* Test driver for the aarch64 kernels (native/cpu_neon.c), run under qemu-aarch64 by
 * tests/test_neon_qemu.py: reads a stream of jobs on stdin, runs each through the kernels'
 * C API and writes the results to stdout, in order (little-endian, no framing beyond what
 * each job's shape implies).
 *
 * Built with -I native so that it includes the kernel sources as one unit, as the cffi build
 * does: the activation rounding (static there) is reachable too.
 *
 * A job is int32 op, int32 nthreads, then by op:
 *   1 matmul: int32 qtype, rows, cols, n; int64 row_bytes; w (rows * row_bytes) u8; x (n, cols)
 *             f32                                 -> int32 status, out (n, rows) f32
 *   2 multi:  int32 count, cols, n; count x (int32 qtype, rows; int64 row_bytes; w u8);
 *             x (n, cols) f32                     -> int32 status, out (n * sum(rows)) f32
 *   3 acts:   int32 kq (1: Q8_K, 0: Q8_0), n, cols; x (n, cols) f32
 *                                                 -> xq (n, cols) i8, xd (n, cols/32) f32,
 *                                                    xs (n, cols/16) i32
 *   4 rms:    int32 rows, d; f32 eps; x (rows, d), w (d,)       -> out (rows, d) f32
 *   5 rope:   int32 n, heads, hd, neox; x (n, heads, hd), cos, sin (n, hd/2)
 *                                                 -> out (n, heads, hd) f32
 *   6 silu / 7 gelu: int32 n; gate (n,), up (n,)   -> out (n,) f32
 *   8 attention: int32 n, heads, kv_heads, hd, T; f32 scale, softcap; q (n, heads, hd) f32,
 *             k, v (T, kv_heads, hd) f16 bits, mask (n, T) u8
 *                                                 -> int32 status, out (n, heads, hd) f32
 *  10 append: int32 count, heads, kv_heads, hd, slots; f32 scale; q (count, heads, hd),
 *             k_new, v_new (count, kv_heads, hd) f32; slot, lo (count,) int32; caches k, v
 *             (count, slots, kv_heads, hd) f16 bits
 *                                                 -> int32 status, out (count, heads, hd) f32,
 *                                                    the caches k, v after (f16 bits)
 *   9 packed: (nothing)                           -> int64 ek_packed_bytes(Q8_0, 16, 32), int32
 *             status of ek_pack, ek_matmul_packed, ek_packed_rows, ek_matmul_packed_multi
 *   0 end.
 */
#include "cpu_pool.c"
#include "cpu_neon.c"
#include "cpu_attention_batch.c"  /* compiled with -Werror on each variant */

#include <stdio.h>

static void *read_n(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, stdin) != bytes) {
        fprintf(stderr, "neon_driver: short input\n");
        exit(2);
    }
    return p;
}

static int32_t read_i32(void) {
    int32_t v;
    if (fread(&v, 4, 1, stdin) != 1) {
        fprintf(stderr, "neon_driver: short input\n");
        exit(2);
    }
    return v;
}

static int64_t read_i64(void) {
    int64_t v;
    if (fread(&v, 8, 1, stdin) != 1) {
        fprintf(stderr, "neon_driver: short input\n");
        exit(2);
    }
    return v;
}

static float read_f32(void) {
    int32_t v = read_i32();
    float f;
    memcpy(&f, &v, 4);
    return f;
}

static void write_n(const void *p, size_t bytes) { fwrite(p, 1, bytes, stdout); }

static void write_i32(int32_t v) { write_n(&v, 4); }

static void job_matmul(int nthreads) {
    const int qtype = read_i32(), rows = read_i32(), cols = read_i32(), n = read_i32();
    const int64_t row_bytes = read_i64();
    uint8_t *w = read_n((size_t)rows * row_bytes);
    float *x = read_n(sizeof(float) * n * cols), *out = calloc((size_t)n * rows, sizeof(float));
    write_i32(ek_matmul_f32(qtype, w, row_bytes, rows, cols, x, n, out, nthreads, 0));
    write_n(out, sizeof(float) * n * rows);
    free(w), free(x), free(out);
}

static void job_multi(int nthreads) {
    const int count = read_i32(), cols = read_i32(), n = read_i32();
    int qtypes[MULTI_MAX], rows[MULTI_MAX], total = 0;
    int64_t row_bytes[MULTI_MAX];
    const uint8_t *ws[MULTI_MAX];
    for (int i = 0; i < count && i < MULTI_MAX; i++) {
        qtypes[i] = read_i32();
        rows[i] = read_i32();
        row_bytes[i] = read_i64();
        ws[i] = read_n((size_t)rows[i] * row_bytes[i]);
        total += rows[i];
    }
    float *x = read_n(sizeof(float) * n * cols), *out = calloc((size_t)n * total, sizeof(float));
    write_i32(ek_matvec_multi(count, qtypes, ws, row_bytes, rows, cols, x, n, out, nthreads));
    write_n(out, sizeof(float) * n * total);
    for (int i = 0; i < count && i < MULTI_MAX; i++) free((void *)ws[i]);
    free(x), free(out);
}

static void job_acts(void) {
    const int kq = read_i32(), n = read_i32(), cols = read_i32();
    float *x = read_n(sizeof(float) * n * cols);
    acts8_t a;
    if (!acts8_alloc(&a, n, cols)) exit(3);
    acts8_round(&a, kq, x, n, cols);
    write_n(a.xq, (size_t)n * cols);
    write_n(a.xd, sizeof(float) * n * (cols / 32));
    write_n(a.xs, sizeof(int32_t) * n * (cols / 16));
    acts8_free(&a);
    free(x);
}

static void job_rms(void) {
    const int rows = read_i32(), d = read_i32();
    const float eps = read_f32();
    float *x = read_n(sizeof(float) * rows * d), *w = read_n(sizeof(float) * d);
    float *out = malloc(sizeof(float) * rows * d);
    ek_rms_norm(x, w, out, rows, d, eps);
    write_n(out, sizeof(float) * rows * d);
    free(x), free(w), free(out);
}

static void job_rope(void) {
    const int n = read_i32(), heads = read_i32(), hd = read_i32(), neox = read_i32();
    const size_t nx = (size_t)n * heads * hd, nc = (size_t)n * (hd / 2);
    float *x = read_n(sizeof(float) * nx), *c = read_n(sizeof(float) * nc);
    float *s = read_n(sizeof(float) * nc), *out = malloc(sizeof(float) * nx);
    ek_rope(x, c, s, out, n, heads, hd, neox);
    write_n(out, sizeof(float) * nx);
    free(x), free(c), free(s), free(out);
}

static void job_gated(int gelu, int nthreads) {
    const int n = read_i32();
    float *g = read_n(sizeof(float) * n), *u = read_n(sizeof(float) * n);
    float *out = malloc(sizeof(float) * n);
    if (gelu) ek_gelu_tanh_mul(g, u, out, n, nthreads);
    else ek_silu_mul(g, u, out, n, nthreads);
    write_n(out, sizeof(float) * n);
    free(g), free(u), free(out);
}

static void job_attention(int nthreads) {
    const int n = read_i32(), heads = read_i32(), kv = read_i32(), hd = read_i32(), T = read_i32();
    const float scale = read_f32(), softcap = read_f32();
    const size_t nq = (size_t)n * heads * hd, nk = (size_t)T * kv * hd;
    float *q = read_n(sizeof(float) * nq), *out = calloc(nq, sizeof(float));
    uint16_t *k = read_n(2 * nk), *v = read_n(2 * nk);
    uint8_t *mask = read_n((size_t)n * T);
    write_i32(ek_attention_f16(q, k, v, mask, n, heads, kv, hd, T, scale, softcap, out,
                               nthreads));
    write_n(out, sizeof(float) * nq);
    free(q), free(out), free(k), free(v), free(mask);
}

static void job_append(int nthreads) {
    const int count = read_i32(), heads = read_i32(), kv = read_i32(), hd = read_i32();
    const int slots = read_i32();
    const float scale = read_f32();
    const size_t nq = (size_t)count * heads * hd, nn = (size_t)count * kv * hd;
    const size_t one = (size_t)slots * kv * hd;
    float *q = read_n(sizeof(float) * nq), *kn = read_n(sizeof(float) * nn);
    float *vn = read_n(sizeof(float) * nn), *out = calloc(nq, sizeof(float));
    int32_t *slot = read_n(4 * (size_t)count), *lo = read_n(4 * (size_t)count);
    uint16_t *k = read_n(2 * one * count), *v = read_n(2 * one * count);
    uint16_t **kc = malloc(sizeof(uint16_t *) * count), **vc = malloc(sizeof(uint16_t *) * count);
    for (int s = 0; s < count; s++) kc[s] = k + one * s, vc[s] = v + one * s;
    write_i32(ek_attention_f16_append(count, q, kn, vn, kc, vc, slot, lo, heads, kv, hd, scale,
                                      0.0f, out, nthreads));
    write_n(out, sizeof(float) * nq);
    write_n(k, 2 * one * count);
    write_n(v, 2 * one * count);
    free(q), free(kn), free(vn), free(out), free(slot), free(lo), free(k), free(v), free(kc);
    free(vc);
}

static void job_packed(void) {
    uint8_t w[34 * 16] = {0}, dst[64];
    float x[32] = {0}, out[16];
    const int qt = T_Q8_0, rows = 16;
    const uint8_t *ws[1] = {w};
    const int64_t ids[1] = {0};
    const int64_t bytes = ek_packed_bytes(qt, 16, 32);
    write_n(&bytes, 8);
    write_i32(ek_pack(qt, w, 34, 16, 32, dst, 1));
    write_i32(ek_matmul_packed(qt, w, 16, 32, x, 1, out, 1));
    write_i32(ek_packed_rows(qt, w, 16, 32, ids, 1, out));
    write_i32(ek_matmul_packed_multi(1, &qt, ws, &rows, 32, x, 1, out, 1));
}

int main(void) {
    for (;;) {
        const int op = read_i32();
        if (op == 0) break;
        const int nthreads = read_i32();
        switch (op) {
        case 1: job_matmul(nthreads); break;
        case 2: job_multi(nthreads); break;
        case 3: job_acts(); break;
        case 4: job_rms(); break;
        case 5: job_rope(); break;
        case 6: job_gated(0, nthreads); break;
        case 7: job_gated(1, nthreads); break;
        case 8: job_attention(nthreads); break;
        case 9: job_packed(); break;
        case 10: job_append(nthreads); break;
        default: fprintf(stderr, "neon_driver: unknown op %d\n", op); return 2;
        }
    }
    fflush(stdout);
    return 0;
}
