// A CBLAS sgemm shim for decode steps on x86-64 CPUs (Linux, MLX's CPU backend).
//
// Loaded with LD_PRELOAD before the real BLAS (redrafter_mlx/blas.py builds and preloads it).
// A decode step multiplies 1-8 activation rows by every weight matrix of the model: a product
// of a big matrix (out, K) with a few rows (n, K), bound by how fast the weights stream from
// memory. OpenBLAS reads them at ~17 GB/s on the 2-core box this was written on (its 2-row
// products slower still); the loop below reads them at ~50 GB/s. It also takes attention's
// query-key products (a few query rows against the cached keys). Every other product (prompt
// chunks, attention's probabilities times values, transposed activations) goes to the next BLAS in the search order, untouched.
//
// Each output is one row of the big matrix dotted with one small row, summed in the same order
// whatever n is and however the rows are split between threads: a token's logits do not
// depend on how many tokens are verified with it.
//
// Threads: the calling thread and up to REDRAFTER_SMALLROWS_THREADS - 1 workers take chunks
// of rows from a shared counter; a worker that is late finds none left, so the caller never
// waits for a thread the OS has not scheduled. Idle workers spin ~50 us
// (REDRAFTER_SMALLROWS_SPIN_US), then sleep on a futex.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { MAX_SMALL = 8, CHUNK_BYTES = 64 * 1024, MIN_SPLIT_BYTES = 256 * 1024, MAX_THREADS = 16 };
// Software prefetch distance in the weight stream (2 KB). All decode products of the 135M model
// through MLX here: 34 GB/s with the hardware prefetchers alone, 37-39 GB/s with this (128
// floats: slower, 256-1024: alike, 2048-4096: 35-36).
enum { PREFETCH_FLOATS = 512 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

// One product, with small rows small[t] (t < n) of length k:
// - dots: C[r * c_big + t * c_small] = alpha * big[r] . small[t], r < items (rows of big);
// - axpys: C[t * c_small + col] = alpha * sum_i small[t][i] * big[i][col], col < items (big is
//   k rows of items columns).
// Plus beta * C when beta is not 0 (MLX's addmm, a Linear with a bias, passes the bias in C
// with beta 1). ``fn`` computes items [i0, i1); threads take chunks of ``chunk`` items.
typedef struct job job_t;
struct job {
  void (*fn)(const job_t *, int, int);
  const float *big, *small;
  float *c;
  float alpha, beta;
  long ld_big, ld_small, c_big, c_small;
  int items, n, k, chunk, chunks;
};

static inline float finish(const job_t *j, float sum, const float *out) {
  return j->beta == 0.0f ? j->alpha * sum : j->alpha * sum + j->beta * *out;
}

#define DEFINE_DOTS(N)                                                                        \
  __attribute__((target("avx2,fma"))) static void dots_##N(const job_t *j, int r0, int r1) {                                      \
    for (int r = r0; r < r1; r++) {                                                           \
      const float *w = j->big + r * j->ld_big;                                                \
      __m256 acc[N];                                                                          \
      for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();                               \
      int k = 0;                                                                              \
      for (; k + 16 <= j->k; k += 16) { /* a cache line per pass, prefetched rows ahead */    \
        _mm_prefetch((const char *)(w + k + PREFETCH_FLOATS), _MM_HINT_T0);                   \
        __m256 wv = _mm256_loadu_ps(w + k), wv2 = _mm256_loadu_ps(w + k + 8);                 \
        for (int t = 0; t < N; t++) {                                                         \
          const float *x = j->small + t * j->ld_small + k;                                    \
          acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x), acc[t]);                           \
          acc[t] = _mm256_fmadd_ps(wv2, _mm256_loadu_ps(x + 8), acc[t]);                      \
        }                                                                                     \
      }                                                                                       \
      for (; k + 8 <= j->k; k += 8) {                                                         \
        __m256 wv = _mm256_loadu_ps(w + k);                                                   \
        for (int t = 0; t < N; t++)                                                           \
          acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(j->small + t * j->ld_small + k), acc[t]); \
      }                                                                                       \
      for (int t = 0; t < N; t++) {                                                           \
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1)); \
        s = _mm_hadd_ps(s, s);                                                                \
        s = _mm_hadd_ps(s, s);                                                                \
        float sum = _mm_cvtss_f32(s);                                                         \
        for (int kk = k; kk < j->k; kk++) sum += w[kk] * j->small[t * j->ld_small + kk];     \
        float *out = j->c + r * j->c_big + t * j->c_small;                                    \
        *out = finish(j, sum, out);                                                           \
      }                                                                                       \
    }                                                                                         \
  }
DEFINE_DOTS(1)
DEFINE_DOTS(2)
DEFINE_DOTS(3)
DEFINE_DOTS(4)
DEFINE_DOTS(5)
DEFINE_DOTS(6)
DEFINE_DOTS(7)
DEFINE_DOTS(8)

static void (*const DOTS[MAX_SMALL + 1])(const job_t *, int, int) = {
    0, dots_1, dots_2, dots_3, dots_4, dots_5, dots_6, dots_7, dots_8};

// Columns [c0, c1) of every small row's product with big (k, items): 32 columns at a time in
// registers, each column summed over i in order (so a column's value never depends on the
// split), then 8 at a time, then one at a time with the same fused multiply-adds.
__attribute__((target("avx2,fma"))) static void axpys(const job_t *j, int c0, int c1) {
  for (int t = 0; t < j->n; t++) {
    const float *a = j->small + t * j->ld_small;
    float *row = j->c + t * j->c_small;
    int col = c0;
    for (; col + 32 <= c1; col += 32) {
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
      for (int i = 0; i < j->k; i++) {
        __m256 av = _mm256_broadcast_ss(a + i);
        const float *b = j->big + i * j->ld_big + col;
        for (int q = 0; q < 4; q++) acc[q] = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + 8 * q), acc[q]);
      }
      float sums[32];
      for (int q = 0; q < 4; q++) _mm256_storeu_ps(sums + 8 * q, acc[q]);
      for (int q = 0; q < 32; q++) row[col + q] = finish(j, sums[q], row + col + q);
    }
    for (; col < c1; col++) {
      float sum = 0.0f;
      for (int i = 0; i < j->k; i++) sum = __builtin_fmaf(a[i], j->big[i * j->ld_big + col], sum);
      row[col] = finish(j, sum, row + col);
    }
  }
}

// Shared state: the job, and a counter whose high 32 bits are the job's generation and low 32
// bits the next unclaimed chunk. A claim succeeds only while the generation is unchanged, and
// the caller publishes a new job only after every chunk of the last one is done, so a worker
// that holds a claim reads the job it claimed from.
static job_t job;
static _Atomic uint64_t counter;
static atomic_int done_chunks;
static atomic_int wake_word;  // futex: bumped with every job
static atomic_int sleepers;
static int workers = -1;  // -1: not started
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_long calls_mine, calls_forwarded;

static int claim_and_run(uint32_t gen) {
  int ran = 0;
  for (;;) {
    uint64_t v = atomic_load(&counter);
    if ((uint32_t)(v >> 32) != gen || (uint32_t)v >= (uint32_t)job.chunks) return ran;
    if (!atomic_compare_exchange_weak(&counter, &v, v + 1)) continue;
    int i0 = (int)(uint32_t)v * job.chunk, i1 = i0 + job.chunk;
    job.fn(&job, i0, i1 < job.items ? i1 : job.items);
    atomic_fetch_add(&done_chunks, 1);
    ran = 1;
  }
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static double spin_us(void) {
  static double cached = -1;
  if (cached < 0) {
    const char *env = getenv("REDRAFTER_SMALLROWS_SPIN_US");
    cached = env ? atof(env) : 50.0;
  }
  return cached;
}

static void *worker_main(void *unused) {
  (void)unused;
  uint32_t seen = 0;
  for (;;) {
    double idle_since = now_us();
    for (unsigned spins = 1;; spins++) {
      uint32_t gen = (uint32_t)(atomic_load(&counter) >> 32);
      if (gen != seen) {
        seen = gen;
        claim_and_run(gen);
        idle_since = now_us();
        continue;
      }
      if (spins % 256 == 0 && now_us() - idle_since > spin_us()) break;
      _mm_pause();
    }
    int word = atomic_load(&wake_word);
    atomic_fetch_add(&sleepers, 1);
    if ((uint32_t)(atomic_load(&counter) >> 32) == seen)
      syscall(SYS_futex, &wake_word, FUTEX_WAIT_PRIVATE, word, NULL, NULL, 0);
    atomic_fetch_sub(&sleepers, 1);
  }
  return NULL;
}

static int thread_count(void) {  // read once: sysconf opens a /sys file per call
  static int cached = 0;
  if (!cached) {
    const char *env = getenv("REDRAFTER_SMALLROWS_THREADS");
    long n = env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    cached = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
  }
  return cached;
}

static void start_workers(void) {
  pthread_mutex_lock(&start_lock);
  if (workers < 0) {
    int want = thread_count() - 1, started = 0;
    for (int i = 0; i < want; i++) {
      pthread_t t;
      if (pthread_create(&t, NULL, worker_main, NULL) != 0) break;
      pthread_detach(t);
      started++;
    }
    workers = started;
  }
  pthread_mutex_unlock(&start_lock);
}

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;

// Run a job on this thread, or split into chunks of ~CHUNK_BYTES of big (a multiple of
// ``align`` items) over the workers too.
static void run(const job_t *j, int align) {
  size_t item_bytes = (size_t)j->k * sizeof(float);
  if (item_bytes * j->items < MIN_SPLIT_BYTES || thread_count() < 2) {
    j->fn(j, 0, j->items);
    return;
  }
  if (workers < 0) start_workers();
  if (workers == 0 || pthread_mutex_trylock(&run_lock) != 0) {  // busy: another thread's job
    j->fn(j, 0, j->items);
    return;
  }
  // Close the last generation before rewriting the job: a worker still in claim_and_run for it
  // would otherwise compare a stale chunk index with the new job's count and claim a chunk of
  // the new job under the old generation (found by an audit with injected delays).
  atomic_store(&counter, atomic_load(&counter) | 0xFFFFFFFFu);
  job = *j;
  int chunk = (int)(CHUNK_BYTES / item_bytes);
  job.chunk = chunk < align ? align : chunk / align * align;
  job.chunks = (j->items + job.chunk - 1) / job.chunk;
  atomic_store(&done_chunks, 0);
  uint32_t gen = (uint32_t)(atomic_load(&counter) >> 32) + 1;
  atomic_store(&counter, (uint64_t)gen << 32);
  atomic_fetch_add(&wake_word, 1);
  if (atomic_load(&sleepers) > 0)
    syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, workers, NULL, NULL, 0);
  claim_and_run(gen);
  while (atomic_load(&done_chunks) < job.chunks) _mm_pause();
  pthread_mutex_unlock(&run_lock);
}

static sgemm_fn next_sgemm(void) {
  static sgemm_fn next;
  if (!next) {
    next = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    const char *path = getenv("REDRAFTER_SMALLROWS_NEXT");
    if (!next && path) {
      void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
      if (lib) next = (sgemm_fn)dlsym(lib, "cblas_sgemm");
    }
    if (!next) {  // blas.py preloads this file only with a BLAS to pass products on to
      fprintf(stderr, "redrafter smallrows: no cblas_sgemm after this library (set %s)\n",
              "REDRAFTER_NO_SMALLROWS=1");
      abort();
    }
  }
  return next;
}

static atomic_int enabled = 1;

static int usable(void) {
  static int cpu = -1;
  if (cpu < 0) cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return cpu && atomic_load_explicit(&enabled, memory_order_relaxed);
}

// The products this file takes (row-major, A untransposed, every size positive):
// - B transposed (both operands rows of length K) and one side of at most MAX_SMALL rows;
// - B untransposed (K rows) and A of at most MAX_SMALL rows.
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  int ours = usable() && order == ROW_MAJOR && trans_a == NO_TRANS && m > 0 && n > 0 && k > 0 &&
             alpha != 0.0f &&  // BLAS reads neither A nor B then (NaN/Inf must not leak)
             ((trans_b == TRANS && (m <= MAX_SMALL || n <= MAX_SMALL)) ||
              (trans_b == NO_TRANS && m <= MAX_SMALL));
  if (!ours) {
    atomic_fetch_add(&calls_forwarded, 1);
    next_sgemm()(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  atomic_fetch_add(&calls_mine, 1);
  job_t j = {.c = c, .alpha = alpha, .beta = beta, .k = k};
  if (trans_b == NO_TRANS) {  // C (m, n) = A (m, k) B (k, n): columns of B as items
    j.fn = axpys, j.big = b, j.small = a, j.ld_big = ldb, j.ld_small = lda, j.c_small = ldc;
    j.items = n, j.n = m;
    run(&j, 32);
  } else if (m <= n) {  // C (m, n): small rows from A, big rows from B
    j.fn = DOTS[m], j.big = b, j.small = a, j.ld_big = ldb, j.ld_small = lda, j.c_big = 1;
    j.c_small = ldc, j.items = n, j.n = m;
    run(&j, 1);
  } else {
    j.fn = DOTS[n], j.big = a, j.small = b, j.ld_big = lda, j.ld_small = ldb, j.c_big = ldc;
    j.c_small = 1, j.items = m, j.n = n;
    run(&j, 1);
  }
}

// Switch this file's products off (0) or on again (1): benchmarks time a baseline with the
// next BLAS alone in the same process. Returns the previous setting.
int redrafter_smallrows_enable(int on) { return atomic_exchange(&enabled, on != 0); }

// For tests: how many products this file computed and how many it passed on.
void redrafter_smallrows_counts(long *mine, long *forwarded) {
  *mine = atomic_load(&calls_mine);
  *forwarded = atomic_load(&calls_forwarded);
}
