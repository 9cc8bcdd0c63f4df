/* Packed weights against the file's blocks, one thread: a Q8_0 / Q5_0 / Q4_K / Q6_K matrix of
 * random blocks, repacked with ek_pack, multiplied by n tokens with ek_matmul_packed (packed)
 * and ek_matmul_f32 (the mat-vec kernels on the file's blocks, n <= 8). Best of 20 each;
 * GB/s of the weights as stored. Compiled as one unit with the kernels:
 *
 *   cat native/cpu_pool.c native/cpu_kernels.c native/cpu_gemm.c native/cpu_packed.c \
 *       benchmarks/native_packed.c > /tmp/np.c
 *   gcc -O3 -fno-math-errno -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl \
 *       -mavx512vnni -pthread /tmp/np.c -o /tmp/np -lm
 *   /tmp/np QTYPE ROWS COLS TOKENS     e.g. /tmp/np 12 8960 1536 1 (Qwen2.5-1.5B's ffn_up)
 */
#include <stdio.h>
#include <time.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s QTYPE ROWS COLS TOKENS\n", argv[0]);
        return 2;
    }
    const int qtype = atoi(argv[1]), rows = atoi(argv[2]), cols = atoi(argv[3]), n = atoi(argv[4]);
    const int bb = qtype == T_Q4_K ? 144 : qtype == T_Q6_K ? 210 : qtype == T_Q5_0 ? 22 : 34;
    const int64_t rb = (int64_t)cols / (is_kquant(qtype) ? 256 : 32) * bb;
    uint8_t *w = malloc((size_t)rows * rb);
    srand(1);
    for (int64_t i = 0; i < rows * rb; i++) w[i] = (uint8_t)rand();
    for (int64_t r = 0; r < rows; r++)  /* small sane f16 scales (0x2000) */
        for (int64_t b = 0; b < rb / bb; b++) {
            uint8_t *p = w + r * rb + b * bb + (qtype == T_Q6_K ? 208 : 0);
            p[0] = 0;
            p[1] = 0x20;
            if (qtype == T_Q4_K) p[2] = 0, p[3] = 0x20;
        }
    const int64_t pb = ek_packed_bytes(qtype, rows, cols);
    if (!pb) {
        fprintf(stderr, "type %d is not packed\n", qtype);
        return 2;
    }
    uint8_t *pk = calloc(pb, 1);
    ek_pack(qtype, w, rb, rows, cols, pk, 1);
    float *x = malloc(sizeof(float) * n * cols), *out = malloc(sizeof(float) * n * rows);
    for (int i = 0; i < n * cols; i++) x[i] = (rand() % 1000) / 500.0f - 1;
    double best = 1e9, bestf = 1e9;
    for (int rep = 0; rep < 20; rep++) {
        double t = now_s();
        ek_matmul_packed(qtype, pk, rows, cols, x, n, out, 1);
        t = now_s() - t;
        if (t < best) best = t;
        t = now_s();
        ek_matmul_f32(qtype, w, rb, rows, cols, x, n, out, 1, 8);
        t = now_s() - t;
        if (t < bestf) bestf = t;
    }
    printf("type %d  %d x %d  tokens %d:  packed %.1f us (%.1f GB/s)  file blocks %.1f us "
           "(%.1f GB/s)\n", qtype, rows, cols, n, best * 1e6, pb / best / 1e9, bestf * 1e6,
           rows * rb / bestf / 1e9);
    return 0;
}
