/* The thread pool every kernel file shares (portable C: x86 and aarch64), compiled first.
 *
 * Work is split into chunks of CHUNK_ROWS rows: their weight blocks stay in L1 across token
 * groups, and a chunk is also the unit the packed layouts and the GEMM tiles are built on.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define CHUNK_ROWS 16  /* rows per unit of work */

/* a spin-wait hint to the core (pause / yield) */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ---- a small thread pool without barriers -------------------------------------------------
 * A mat-vec is split into chunks of rows. The caller publishes the job and works through
 * chunks itself; helper threads claim chunks with a compare-and-swap on one 64-bit word
 * (generation | chunk count | next chunk), so a helper that wakes late finds the job taken and
 * costs nothing: on a busy machine nobody waits for a descheduled thread to arrive, only for
 * chunks already claimed to finish. Helpers spin briefly, then sleep on a condition variable.
 */

#define MAX_HELPERS 63
/* How long a helper spins for the next job before it sleeps. A decode step's ops are tens to
 * hundreds of microseconds apart (RoPE, the cache, one-thread attention in between); a
 * helper asleep by then is woken through the scheduler and joins its matmul late. Timed by
 * the clock: a pause instruction's length differs several-fold between cores. */
#define SPIN_NS 1000000

static uint64_t monotonic_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Each claim takes 1 / (GUIDED_PARTS * threads) of the chunks left: 2 threads and 1120 chunks
 * make ~60 claims; the last claims are single chunks, so no thread waits long for another. */
#define GUIDED_PARTS 4
/* A decode step's mat-vecs claim in halves of what is left per thread: its matrices are small
 * (Gemma's Q/K/V: 96 chunks) and each claim moves a cache line between the cores, which cost
 * more than the finer balance gained. Interleaved against GUIDED_PARTS on 2 Zen 5 cores:
 * decode Gemma 3 270M 7.03 -> 6.76 ms a token, 0.5B 9.97 -> 9.31, 1.5B 20.48 -> 19.27, the
 * 0.5B's 8-sequence step 18.78 -> 17.85; a prompt's GEMM lost 5-8% with halves, so it keeps
 * GUIDED_PARTS. */
#define MATVEC_PARTS 1
#define MATVEC_TOKENS 8  /* at most this many tokens make a decode step's mat-vec */

/* One parallel job: run(ctx, r0, r1) over row chunks [r0, r1) of CHUNK_ROWS rows. */
typedef void (*rows_fn)(const void *ctx, int r0, int r1);

typedef struct {
    rows_fn run;
    const void *ctx;
    int rows;
    int parts;  /* a claim takes 1/parts of the chunks left (claim_size) */
} job_t;

static job_t g_job;
/* The claim counter and the finished count on lines of their own: both cores write them, and
 * sharing a line (with each other or with g_job) makes every claim wait for the other core. */
static _Alignas(64) _Atomic uint64_t g_ctr;  /* gen (24 bits) | nchunks (20) | next (20) */
static _Alignas(64) atomic_int g_done;
static _Alignas(64) atomic_int g_sleeping;
static int g_helpers;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_call_mu = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */

#define CTR(gen, nch, next) (((uint64_t)(gen) << 40) | ((uint64_t)(nch) << 20) | (uint64_t)(next))

static void run_chunk(int c) {
    const job_t *j = &g_job;
    int r0 = c * CHUNK_ROWS, r1 = r0 + CHUNK_ROWS < j->rows ? r0 + CHUNK_ROWS : j->rows;
    j->run(j->ctx, r0, r1);
}

/* Chunks one claim takes: a share of those left (guided scheduling), so claims are large
 * while much is left and single chunks at the end, where they even out the threads' finish.
 * A claim is an atomic on a line both cores write; with one claim per chunk the 1.5B's
 * 1536-wide matrices (14 KB a chunk) ran at 28 GB/s against 52 for the 8960-wide down
 * projection, and its decode went 31.7 -> 42.5 t/s once claims were guided (2-core Zen 4). */
static inline uint64_t claim_size(uint64_t left, int parts) {
    const uint64_t take = left / (uint64_t)parts;
    return take ? take : 1;
}

/* Claim and run chunks of the job whose generation is gen, until none are left. */
static void work(uint64_t gen) {
    uint64_t v = atomic_load(&g_ctr);
    for (;;) {
        uint64_t nch = (v >> 20) & 0xFFFFF, next = v & 0xFFFFF;
        if ((v >> 40) != gen || next >= nch) return;
        const uint64_t take = claim_size(nch - next, g_job.parts);
        if (atomic_compare_exchange_weak(&g_ctr, &v, v + take)) {
            for (uint64_t c = next; c < next + take; c++) run_chunk((int)c);
            atomic_fetch_add(&g_done, (int)take);
            v = atomic_load(&g_ctr);
        }
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&g_ctr) >> 40;
    for (;;) {
        uint64_t gen = seen;
        const uint64_t until = monotonic_ns() + SPIN_NS;
        for (int i = 1; gen == seen; i++) {
            cpu_relax();
            gen = atomic_load(&g_ctr) >> 40;
            if (i % 64 == 0) {
                if (monotonic_ns() > until) break;
                sched_yield();
            }
        }
        if (gen == seen) {
            pthread_mutex_lock(&g_mu);
            atomic_fetch_add(&g_sleeping, 1);
            while ((gen = atomic_load(&g_ctr) >> 40) == seen) pthread_cond_wait(&g_cv, &g_mu);
            atomic_fetch_sub(&g_sleeping, 1);
            pthread_mutex_unlock(&g_mu);
        }
        seen = gen;
        work(gen);
    }
    return 0;
}

static void ensure_helpers(int n) {
    while (g_helpers < n && g_helpers < MAX_HELPERS) {
        pthread_t t;
        if (pthread_create(&t, 0, helper_main, 0) != 0) return;
        pthread_detach(t);
        g_helpers++;
    }
}

/* Run run(ctx, r0, r1) over all rows in chunks, on the caller and nthreads - 1 helpers; each
 * claim takes 1 / (parts * nthreads) of the chunks left. */
static void parallel_rows_parts(rows_fn run, const void *ctx, int rows, int nthreads,
                                int parts) {
    const int nchunks = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    if (nthreads <= 1 || nchunks < 2 || nchunks >= (1 << 20)) {
        for (int r = 0; r < rows; r += CHUNK_ROWS)
            run(ctx, r, r + CHUNK_ROWS < rows ? r + CHUNK_ROWS : rows);
        return;
    }
    pthread_mutex_lock(&g_call_mu);
    ensure_helpers(nthreads - 1);
    job_t j = {run, ctx, rows, parts * nthreads};
    g_job = j;
    atomic_store(&g_done, 0);
    uint64_t gen = ((atomic_load(&g_ctr) >> 40) + 1) & 0xFFFFFF;
    atomic_store(&g_ctr, CTR(gen, nchunks, 0));
    if (atomic_load(&g_sleeping) > 0) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    work(gen);
    while (atomic_load(&g_done) < nchunks) cpu_relax();
    pthread_mutex_unlock(&g_call_mu);
}

/* Any other job (a prompt's GEMM tiles, attention units, packing, elementwise passes):
 * GUIDED_PARTS claims a thread. */
static void parallel_rows(rows_fn run, const void *ctx, int rows, int nthreads) {
    parallel_rows_parts(run, ctx, rows, nthreads, GUIDED_PARTS);
}

/* A mat-vec over n tokens' activations: MATVEC_PARTS claims a thread for a decode step's few
 * tokens (memory-bound), GUIDED_PARTS for a prompt's (compute-bound). */
static void parallel_matvec(rows_fn run, const void *ctx, int rows, int nthreads, int n) {
    parallel_rows_parts(run, ctx, rows, nthreads,
                        n <= MATVEC_TOKENS ? MATVEC_PARTS : GUIDED_PARTS);
}
