/* Kernel speed at real model sizes on random blocks of one type: the C mat-vec for TOKENS <= 8,
 * with weights larger than the L3 so they stream from DRAM, and the prefill GEMM (every type)
 * above that, on 3 copies (it is compute-bound). Compiled as one unit with the kernels (it
 * calls their internal functions):
 *
 *   cat native/cpu_pool.c native/cpu_kernels.c native/cpu_gemm.c benchmarks/native_matvec.c > /tmp/nm.c
 *   gcc -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni -pthread \
 *       /tmp/nm.c -o /tmp/nm -lm
 *   /tmp/nm QTYPE ROWS COLS TOKENS THREADS     e.g. /tmp/nm 8 151936 896 1 1 (Q8_0 output head)
 *
 * QTYPE is ggml's type id (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K);
 * e.g. /tmp/nm 12 8960 1536 512 1 for one thread's prefill GEMM. Add -DPREFETCH_AHEAD=N
 * to gcc to try another prefetch distance (0: none). Prints the best of 3
 * passes as ms per matmul, weight GB/s and GFLOP/s.
 */
#include <stdio.h>
#include <time.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s QTYPE ROWS COLS TOKENS THREADS\n", argv[0]);
        return 2;
    }
    const int qtype = atoi(argv[1]), rows = atoi(argv[2]), cols = atoi(argv[3]);
    const int n = atoi(argv[4]), threads = atoi(argv[5]);
    const int kq = is_kquant(qtype);
    const int block_bytes = qtype == T_Q4_K ? 144 : qtype == T_Q5_K ? 176 : qtype == T_Q6_K ? 210
                          : qtype == T_Q4_0 ? 18 : qtype == T_Q4_1 ? 20 : qtype == T_Q5_0 ? 22
                          : qtype == T_Q5_1 ? 24 : 34;
    const int64_t row_bytes = (int64_t)cols / (kq ? 256 : 32) * block_bytes;
    /* mat-vec: copies > L3 in all; the GEMM (TOKENS > MAXN) reads each weight once per call
     * and is compute-bound, so 3 copies keep a run short */
    int copies = (int)(1.2e9 / ((double)rows * row_bytes)) + 1;
    if (n > MAXN && copies > 3) copies = 3;
    uint8_t *w = malloc((size_t)copies * rows * row_bytes);
    srand(1);
    for (int64_t i = 0; i < (int64_t)copies * rows * row_bytes; i++) w[i] = (uint8_t)rand();
    const int scale_at = qtype == T_Q6_K ? 208 : 0;  /* small sane f16 scales (0x2000) */
    for (int64_t r = 0; r < (int64_t)copies * rows; r++)
        for (int b = 0; b < cols / (kq ? 256 : 32); b++) {
            uint8_t *p = w + r * row_bytes + (int64_t)b * block_bytes + scale_at;
            p[0] = 0, p[1] = 0x20;
            if (qtype == T_Q4_K || qtype == T_Q5_K) p[2] = 0, p[3] = 0x20;
        }
    float *x = malloc(sizeof(float) * n * cols), *out = malloc(sizeof(float) * n * rows);
    for (int64_t i = 0; i < (int64_t)n * cols; i++) x[i] = (rand() % 2001 - 1000) / 1000.0f;
    int8_t *xq = malloc((size_t)n * cols);
    float *xd = malloc(sizeof(float) * n * (cols / 32));
    int32_t *xs = malloc(sizeof(int32_t) * n * (cols / 16));
    if (kq) quantize_rows_q8k(x, n, cols, xq, xd, xs);
    else quantize_rows(x, n, cols, xq, xd, xs);
    double best = 1e9;
    for (int pass = 0; pass < 3; pass++) {
        const double t = now_s();
        for (int c = 0; c < copies; c++) {
            const uint8_t *wc = w + (int64_t)c * rows * row_bytes;
            if (n <= MAXN || gemm_mt(qtype, wc, row_bytes, rows, cols, xq, xd, xs, n, out,
                                     threads) == -2)
                matvec_mt(qtype, wc, row_bytes, rows, cols, xq, xd, xs, n, out, threads);
        }
        const double dt = (now_s() - t) / copies;
        if (dt < best) best = dt;
    }
    printf("type %d  %d x %d  tokens %d  threads %d:  %.3f ms  %.1f GB/s  %.1f GFLOP/s\n", qtype,
           rows, cols, n, threads, best * 1e3, rows * row_bytes / best / 1e9,
           2.0 * n * rows * cols / best / 1e9);
    return 0;
}
