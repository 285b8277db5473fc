// MLX primitives of our own for MLX's CPU backend: a masked softmax, the attention of a few
// query rows over a long cache, and the MLP's SiLU gate.
//
// MLX's CPU backend computes exp one element at a time on x86 (no SIMD type there), and a
// forward of T tokens takes layers x T x intermediate of them in its SiLU gates alone
// (benchmarks/HISTORY.md). These primitives run a vectorised exp (Cephes' expf: range
// reduction by ln 2, a degree-6 polynomial, the power of two in the exponent bits).
//
// masked_softmax(scores, visible): scores (..., R, N) float32; visible None or (T, T) bool,
// which masks the last T columns: row r sees column N - T + j where visible[r % T, j] (the
// attention's query groups are rows h * T + t). Returns probs of the shape of scores. One pass
// per row in cache, rows split over threads when there are many (prompt chunks).
//
// Built on first use by redrafter_mlx/backend/cpu/kernels.py against the installed MLX.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <immintrin.h>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

constexpr int LANES = 16;
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int vi __attribute__((vector_size(LANES * sizeof(int))));
// AVX2's width, which the tree kernel computes in where AVX-512 is missing: there a 16-float
// vector is a pair of registers, 16 accumulators and a query spill, and 16-lane shuffles turn
// into moves through memory.
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef int vi8 __attribute__((vector_size(8 * sizeof(int))));

template <typename V>
struct IntsOf;
template <>
struct IntsOf<vf> {
  using type = vi;
};
template <>
struct IntsOf<vf8> {
  using type = vi8;
};

// Helpers are always inlined: an out-of-line copy would miss its caller's ISA.
#define ALWAYS_INLINE inline __attribute__((always_inline))

constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float ROUND = 12582912.0f;  // 1.5 * 2**23: adding and subtracting it rounds
constexpr float UNDER = -87.0f;       // below it exp(x) is under 2**-125: returned as 0
constexpr float P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                        4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// 2**n for integral n >= -126 (the caller clamps), from the exponent bits.
template <typename V>
ALWAYS_INLINE V power_of_two(V n) {
  return (V)((__builtin_convertvector(n, typename IntsOf<V>::type) + 127) << 23);
}

ALWAYS_INLINE float power_of_two(float n) {
  int bits = (static_cast<int>(n) + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// e where x >= UNDER, else 0 (-inf and NaN garbage included).
template <typename V>
ALWAYS_INLINE V zero_below(V e, V x) {
  return (V)((typename IntsOf<V>::type)e & (x >= UNDER));
}

ALWAYS_INLINE float zero_below(float e, float x) { return x >= UNDER ? e : 0.0f; }

template <typename V>
ALWAYS_INLINE V at_least(V n, float low) {
  return n < low ? V{} + low : n;
}

ALWAYS_INLINE float at_least(float n, float low) { return n < low ? low : n; }

// exp(x) for x <= 0 (the scores less their row's maximum), 0 below UNDER and for -inf.
// Written once for one float and once for LANES of them with the same operations in the same
// order (contracted into fused multiply-adds alike where the ISA has them), so both give the
// same bits.
template <typename V>
ALWAYS_INLINE V exp_nonpositive(V x) {
  V n = at_least((x * LOG2E + ROUND) - ROUND, -126.0f);
  V r = (x - n * LN2_HI) - n * LN2_LO;
  V p = V{} + P[0];
  p = p * r + P[1];
  p = p * r + P[2];
  p = p * r + P[3];
  p = p * r + P[4];
  p = p * r + P[5];
  p = (p * (r * r) + r) + 1.0f;
  return zero_below(p * power_of_two(n), x);
}

template <typename V = vf>
ALWAYS_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
ALWAYS_INLINE void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// The largest of x[0 .. n): lanes first (a serial max waits on each compare), the order
// immaterial (a maximum is exact).
template <typename V = vf>
ALWAYS_INLINE float row_peak(const float* x, int n) {
  constexpr int W = sizeof(V) / sizeof(float);
  V peak_v = V{} - INFINITY;
  int j = 0;
  for (; j + W <= n; j += W) {
    V v = load<V>(x + j);
    peak_v = v > peak_v ? v : peak_v;
  }
  float peak = -INFINITY;
  for (int k = 0; k < W; ++k) peak = std::max(peak, peak_v[k]);
  for (; j < n; ++j) peak = std::max(peak, x[j]);
  return peak;
}

// One row: y = softmax(x) over n columns, the last t masked by visible (t bools) if given.
#if defined(__x86_64__)
__attribute__((target_clones("avx512f", "arch=haswell", "default")))
#endif
void softmax_row(const float* x, float* y, int n, const bool* visible, int t) {
  std::memcpy(y, x, sizeof(float) * n);
  if (visible != nullptr) {
    for (int j = 0; j < t; ++j) {
      if (!visible[j]) y[n - t + j] = -INFINITY;
    }
  }
  int full = n - n % LANES;
  float peak = row_peak(y, n);
  if (peak == -INFINITY) {  // nothing visible: no weights (attention never asks this)
    std::memset(y, 0, sizeof(float) * n);
    return;
  }
  vf total_v = vf{};
  for (int j = 0; j < full; j += LANES) {
    vf e = exp_nonpositive<vf>(load(y + j) - peak);
    store(y + j, e);
    total_v += e;
  }
  float total = 0.0f;
  for (int k = 0; k < LANES; ++k) total += total_v[k];
  for (int j = full; j < n; ++j) {
    y[j] = exp_nonpositive<float>(y[j] - peak);
    total += y[j];
  }
  float inverse = 1.0f / total;
  for (int j = 0; j < full; j += LANES) store(y + j, load(y + j) * inverse);
  for (int j = full; j < n; ++j) y[j] *= inverse;
}

// ---- Threads kept from call to call ----
//
// A thread started per call costs its start and, as glibc gives a finished thread's stack
// pages back to the kernel, a page fault for every stack page the next one touches (a tree
// chunk's scores: 2 KB a row): 4-7 faults per call, 30 calls per forward. These threads stay:
// after a job each spins a while (the next layer's call comes within a millisecond), then
// sleeps until the next.

class Pool {
 public:
  // fn(i) for every i < items, on the calling thread and the pool's; items are claimed one at
  // a time, so which thread runs which does not matter to the caller. A second caller while a
  // job runs (another stream) runs its items alone.
  void run(int items, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> busy(run_lock_, std::try_to_lock);
    if (items < 2 || !busy.owns_lock() || workers() == 0) {
      for (int i = 0; i < items; ++i) fn(i);
      return;
    }
    // Close the last generation before rewriting the job (a worker still claiming from it
    // then fails its compare-and-swap), then publish the job with the next generation.
    counter_.fetch_or(0xFFFFFFFFull, std::memory_order_acq_rel);
    job_ = &fn;
    items_ = items;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (counter_.load(std::memory_order_relaxed) >> 32) + 1;
    counter_.store(gen << 32, std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_release);
    wake_.notify_all();
    claim(static_cast<uint32_t>(gen));
    while (done_.load(std::memory_order_acquire) < items) _mm_pause();
  }

 private:
  int workers() {
    std::call_once(started_, [this] {
      int n = static_cast<int>(std::min(std::max(1u, std::thread::hardware_concurrency()), 8u));
      for (int i = 1; i < n; ++i) std::thread([this] { serve(); }).detach();
      workers_ = n - 1;
    });
    return workers_;
  }

  void claim(uint32_t gen) {
    for (;;) {
      uint64_t v = counter_.load(std::memory_order_acquire);
      // Unsigned: a closed generation's index is 0xFFFFFFFF (run()'s fetch_or), past any job's
      // items; read as an int it was -1, and a late worker claimed item -1 of the next job.
      if (static_cast<uint32_t>(v >> 32) != gen ||
          static_cast<uint32_t>(v & 0xFFFFFFFFu) >= static_cast<uint32_t>(items_)) {
        return;
      }
      if (!counter_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      (*job_)(static_cast<int>(v & 0xFFFFFFFFu));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void serve() {
    uint32_t seen = 0;
    for (;;) {
      const uint32_t asleep = wake_.load(std::memory_order_acquire);
      const auto idle_since = std::chrono::steady_clock::now();
      for (unsigned spins = 1;; ++spins) {
        const auto gen = static_cast<uint32_t>(counter_.load(std::memory_order_acquire) >> 32);
        if (gen != seen) {
          seen = gen;
          claim(gen);
          break;
        }
        if (spins % 256 == 0 &&
            std::chrono::steady_clock::now() - idle_since > std::chrono::microseconds(50)) {
          wake_.wait(asleep, std::memory_order_acquire);
          break;
        }
        _mm_pause();
      }
    }
  }

  std::mutex run_lock_;
  std::once_flag started_;
  int workers_ = 0;
  const std::function<void(int)>* job_ = nullptr;
  int items_ = 0;
  std::atomic<uint64_t> counter_{0};  // high 32 bits: the job's generation; low: next item
  std::atomic<int> done_{0};
  std::atomic<uint32_t> wake_{0};  // bumped with each job: what sleeping workers wait on
};

Pool& pool() {
  static Pool* threads = new Pool;  // never destroyed: its threads outlive static teardown
  return *threads;
}

// Below this many scores one thread does it all: waking threads costs more.
constexpr long THREADED_MIN = 1 << 20;

void softmax_rows(const float* x, float* y, long rows, int n, const bool* visible, int t) {
  auto run = [=](long begin, long end) {
    for (long r = begin; r < end; ++r) {
      const bool* row_visible = visible ? visible + (r % t) * t : nullptr;
      softmax_row(x + r * n, y + r * n, n, row_visible, t);
    }
  };
  if (rows * n < THREADED_MIN || rows < 2) {
    run(0, rows);
    return;
  }
  const long per = std::max<long>(1, rows / 16);  // 16 blocks of rows, claimed by the threads
  const int blocks = static_cast<int>((rows + per - 1) / per);
  pool().run(blocks, [&](int b) { run(b * per, std::min(rows, (b + 1) * per)); });
}

class MaskedSoftmax : public mx::UnaryPrimitive {
 public:
  MaskedSoftmax(mx::Stream stream, int t) : mx::UnaryPrimitive(stream), t_(t) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& scores = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(scores);
    const bool* visible = nullptr;
    if (inputs.size() > 1) {
      encoder.set_input_array(inputs[1]);
      visible = inputs[1].data<bool>();
    }
    encoder.set_output_array(out);
    int n = scores.shape(-1);
    long rows = n ? static_cast<long>(scores.size() / n) : 0;
    encoder.dispatch([x = scores.data<float>(), y = out.data<float>(), rows, n, visible,
                      t = t_]() { softmax_rows(x, y, rows, n, visible, t); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("masked_softmax runs on the CPU stream only");
  }

  const char* name() const override { return "MaskedSoftmax"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return t_ == static_cast<const MaskedSoftmax&>(other).t_;
  }

 private:
  int t_;
};

mx::array masked_softmax(const mx::array& scores, std::optional<mx::array> visible) {
  if (scores.dtype() != mx::float32) throw std::invalid_argument("scores must be float32");
  if (scores.ndim() < 2) throw std::invalid_argument("scores must have rows and columns");
  mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::contiguous(scores, false, cpu)};
  int t = 1;
  if (visible) {
    t = visible->shape(0);
    if (visible->ndim() != 2 || visible->shape(1) != t || t > scores.shape(-1) ||
        scores.shape(-2) % t != 0) {
      throw std::invalid_argument("visible must be (T, T), T dividing the rows and <= columns");
    }
    inputs.push_back(mx::contiguous(mx::astype(*visible, mx::bool_, cpu), false, cpu));
  }
  return mx::array(scores.shape(), mx::float32, std::make_shared<MaskedSoftmax>(cpu, t),
                   std::move(inputs));
}


// ---- Attention of a few query rows (decode steps, verified trees) over a long cache ----
//
// tree_attention(queries, keys, values, scale, visible): queries (1, H, T, D), keys and values
// (1, KV, S + T, D) (the cache's strided views, read in place), visible None or (T, T) bool
// over the last T keys. Each K/V head's query group (rows i * T + t) reads each key and value
// once: scores for a vector's width of keys at a time (16 with AVX-512, else 8: partial sums
// over D in vector lanes, reduced together by a transposing tree of shuffles), their softmax
// and the weighted values per chunk of CHUNK keys, chunks combined in key order (their maxima,
// sums and outputs), so the result does not depend on how many threads ran the chunks, nor a
// row's on how many masked keys follow its own (a verified tree's row and a one-token step
// agree bit for bit).

constexpr int CHUNK = 512;  // keys per work item
static_assert(CHUNK % 16 == 0, "a chunk holds whole vector blocks of keys");
constexpr int MAX_ROWS = 32;  // query rows per K/V head (group * T)

template <typename V>
ALWAYS_INLINE V shuffle(V a, V b, typename IntsOf<V>::type mask) {
  return __builtin_shuffle(a, b, mask);
}

// The 16 lane sums of acc[0..15] as one vector (lane k: the sum of acc[k]'s lanes). Every
// lane is summed by the same tree ((x0 + x8) + (x4 + x12)) ..., whichever acc it sits in: a
// key's score does not depend on its place in a block.
ALWAYS_INLINE vf lane_sums(vf* acc) {
  const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vf c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: 8 partials of acc[2i], 8-15: of acc[2i + 1]
    c[i] = shuffle(acc[2 * i], acc[2 * i + 1], lo8) + shuffle(acc[2 * i], acc[2 * i + 1], hi8);
  }
  for (int i = 0; i < 4; ++i) {  // 4 lanes per key, keys 4i .. 4i + 3
    d[i] = shuffle(c[2 * i], c[2 * i + 1], lo4) + shuffle(c[2 * i], c[2 * i + 1], hi4);
  }
  for (int i = 0; i < 2; ++i) {  // 2 lanes per key, keys 8i .. 8i + 7
    e[i] = shuffle(d[2 * i], d[2 * i + 1], lo2) + shuffle(d[2 * i], d[2 * i + 1], hi2);
  }
  return shuffle(e[0], e[1], even) + shuffle(e[0], e[1], odd);
}

// The 8 lane sums of acc[0..7] (lane k: acc[k]'s), by the same tree for every lane: halves
// (vperm2f128 on AVX2), pairs and neighbours (vshufps, within 128-bit lanes), which leave the
// keys in the order 0 2 4 6 1 3 5 7, then one permutation back.
ALWAYS_INLINE vf8 lane_sums(vf8* acc) {
  const vi8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11};
  const vi8 hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  const vi8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13};
  const vi8 hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const vi8 even = {0, 2, 8, 10, 4, 6, 12, 14};
  const vi8 odd = {1, 3, 9, 11, 5, 7, 13, 15};
  const vi8 keys = {0, 4, 1, 5, 2, 6, 3, 7};
  vf8 c[4], d[2];
  for (int i = 0; i < 4; ++i) {  // lanes 0-3: 4 partials of acc[2i], 4-7: of acc[2i + 1]
    c[i] = shuffle(acc[2 * i], acc[2 * i + 1], lo4) + shuffle(acc[2 * i], acc[2 * i + 1], hi4);
  }
  for (int i = 0; i < 2; ++i) {  // lane pairs: keys 4i, 4i + 2, 4i + 1, 4i + 3
    d[i] = shuffle(c[2 * i], c[2 * i + 1], lo2) + shuffle(c[2 * i], c[2 * i + 1], hi2);
  }
  vf8 e = shuffle(d[0], d[1], even) + shuffle(d[0], d[1], odd);
  return __builtin_shuffle(e, keys);
}

struct TreeJob {
  const float* q;  // query row t of head h at q[(h * q_rows + t) * D], scale folded in
  const float* k;  // key (h, j, d) at k[h * k_head + j * k_row + d]
  const float* v;
  long k_head, k_row, v_head, v_row;
  const bool* visible;  // (T, T) or null
  float* out;  // laid out as q
  int heads, kv_heads, t, d, keys;  // keys: S + T
  int q_rows;  // rows per head in q and out: T, or a joint forward's N (q and out offset)
};

// A chunk's share of one K/V head: for each of its rows the chunk's maximum score, the sum of
// exp(score - maximum) and the sum of those weights times the values (rows x d).
struct Partial {
  float peak[MAX_ROWS];
  float total[MAX_ROWS];
  std::vector<float> out;
};

constexpr int VALUE_TILE = 64;  // keys whose values (16-32 KB) stay in L1 across row blocks

// out[i] += sum over keys j of weights[i * CHUNK + j] * values[j] for M rows (M x D floats),
// the keys in order.
template <int D, int M, typename V>
ALWAYS_INLINE void weigh_values(const float* values, long row, const float* weights, int keys,
                                float* out) {
  constexpr int W = sizeof(V) / sizeof(float), X = D / W;
  V o[M][X];
  for (int i = 0; i < M; ++i) {
    for (int x = 0; x < X; ++x) o[i][x] = load<V>(out + i * D + x * W);
  }
  for (int j = 0; j < keys; ++j) {
    const float* vj = values + j * row;
    V vals[X];
    for (int x = 0; x < X; ++x) vals[x] = load<V>(vj + x * W);
    for (int i = 0; i < M; ++i) {
      float p = weights[i * CHUNK + j];
      for (int x = 0; x < X; ++x) o[i][x] += p * vals[x];
    }
  }
  for (int i = 0; i < M; ++i) {
    for (int x = 0; x < X; ++x) store(out + i * D + x * W, o[i][x]);
  }
}

// W keys' scores against one query row (scale folded in) into scores[0 .. W).
template <int D, typename V>
ALWAYS_INLINE void block_scores(const float* qr, const float* k, long k_row, float* scores) {
  constexpr int W = sizeof(V) / sizeof(float), X = D / W;
  V acc[W];
  const V q0 = load<V>(qr);
  for (int i = 0; i < W; ++i) acc[i] = q0 * load<V>(k + i * k_row);
  for (int x = 1; x < X; ++x) {  // one query slice against the W keys' (memory operands)
    const V qx = load<V>(qr + x * W);
    for (int i = 0; i < W; ++i) acc[i] += qx * load<V>(k + i * k_row + x * W);
  }
  store(scores, lane_sums(acc));
}

// exp(scores - peak) in place over n scores (n rounded up to W is within the row: the pad is
// -inf, so it weighs 0) -> their sum, its lanes added in one order whatever n is: a row's
// total is the same whether the chunk ends at its key or later keys are masked.
template <typename V>
ALWAYS_INLINE float exp_and_total(float* scores, int n, float peak) {
  constexpr int W = sizeof(V) / sizeof(float);
  const int padded = (n + W - 1) / W * W;
  for (int j = n; j < padded; ++j) scores[j] = -INFINITY;
  V total_v = V{};
  for (int j = 0; j < padded; j += W) {
    V e = exp_nonpositive<V>(load<V>(scores + j) - peak);
    store(scores + j, e);
    total_v += e;
  }
  float total = 0.0f;
  for (int i = 0; i < W; ++i) total += total_v[i];
  return total;
}

// One chunk of one K/V head in vectors V (16 floats where AVX-512 is, else 8).
template <int D, typename V>
ALWAYS_INLINE void chunk_in(const TreeJob& job, int g, int c, Partial& part) {
  constexpr int W = sizeof(V) / sizeof(float);
  const int group = job.heads / job.kv_heads, t = job.t, rows = group * t;
  const int begin = c * CHUNK, end = std::min(job.keys, begin + CHUNK), n = end - begin;
  const int cached = job.keys - t;
  const float* k = job.k + g * job.k_head;
  const float* v = job.v + g * job.v_head;
  alignas(64) float scores[MAX_ROWS][CHUNK];
  auto query = [&](int r) { return job.q + ((g * group + r / t) * job.q_rows + r % t) * D; };
  // The last n % W keys are scored as a full block of keys zero-padded, and by the same
  // inlined code as every other block: two copies could contract q0 * k0 + q1 * k1 into a
  // fused multiply-add of different products, and a key's score would then depend on whether
  // later keys follow it (a one-token step's last keys are a tree row's unmasked ones).
  alignas(64) float tail[W * D];
  const int whole = n - n % W;
  if (whole < n) {
    std::fill_n(tail, W * D, 0.0f);
    for (int i = 0; i < n - whole; ++i) {
      std::copy_n(k + (begin + whole + i) * job.k_row, D, tail + i * D);
    }
  }
  for (int j = 0; j < n; j += W) {  // W keys (in L1) against every row (CHUNK % W == 0: a
    // padded block's W scores fit in the row)
    const bool padded = j == whole;
    const float* kj = padded ? tail : k + (begin + j) * job.k_row;
    const long k_row = padded ? D : job.k_row;
    for (int r = 0; r < rows; ++r) block_scores<D, V>(query(r), kj, k_row, &scores[r][j]);
  }
  for (int r = 0; r < rows; ++r) {
    if (job.visible != nullptr && end > cached) {  // the new tokens' block
      const bool* seen = job.visible + (r % t) * t;
      for (int jj = std::max(begin, cached); jj < end; ++jj) {
        if (!seen[jj - cached]) scores[r][jj - begin] = -INFINITY;
      }
    }
    const float peak = row_peak<V>(scores[r], n);
    part.peak[r] = peak;
    if (peak == -INFINITY) {
      for (int jj = 0; jj < n; ++jj) scores[r][jj] = 0.0f;
      part.total[r] = 0.0f;
    } else {
      part.total[r] = exp_and_total<V>(scores[r], n, peak);
    }
  }
  part.out.assign(static_cast<size_t>(rows) * D, 0.0f);
  // Rows in blocks whose outputs stay in registers (AVX2's 16 hold one row of D = 64), the
  // values in tiles that stay in L1 while every block passes over them; each row still sums
  // its keys in order.
  constexpr int BLOCK = W == 16 ? (D == 64 ? 6 : 3) : 1;
  const int blocks = (rows + BLOCK - 1) / BLOCK;
  for (int t0 = 0; t0 < n; t0 += VALUE_TILE) {
    const int keys = std::min(VALUE_TILE, n - t0);
    const float* vt = v + (begin + t0) * job.v_row;
    for (int b = 0, r0 = 0; b < blocks; ++b) {
      const int m = (rows - r0) / (blocks - b);  // blocks of even sizes
      const float* weights = &scores[r0][t0];
      float* out = &part.out[r0 * D];
      switch (m) {
        case 1: weigh_values<D, 1, V>(vt, job.v_row, weights, keys, out); break;
        case 2: weigh_values<D, 2, V>(vt, job.v_row, weights, keys, out); break;
        case 3: weigh_values<D, 3, V>(vt, job.v_row, weights, keys, out); break;
        case 4: weigh_values<D, 4, V>(vt, job.v_row, weights, keys, out); break;
        case 5: weigh_values<D, 5, V>(vt, job.v_row, weights, keys, out); break;
        default: weigh_values<D, 6, V>(vt, job.v_row, weights, keys, out); break;
      }
      r0 += m;
    }
  }
}

// The chunk function per ISA, chosen once at run time (``target_clones`` would compile one
// vector width for all: 16-float vectors cost AVX2 pairs of registers and memory shuffles).
using ChunkFn = void (*)(const TreeJob&, int, int, Partial&);

#if defined(__x86_64__)
template <int D>
__attribute__((target("avx512f"))) void chunk_avx512(const TreeJob& job, int g, int c,
                                                     Partial& part) {
  chunk_in<D, vf>(job, g, c, part);
}

template <int D>
__attribute__((target("avx2,fma"))) void chunk_avx2(const TreeJob& job, int g, int c,
                                                    Partial& part) {
  chunk_in<D, vf8>(job, g, c, part);
}
#endif

template <int D>
void chunk_default(const TreeJob& job, int g, int c, Partial& part) {
  chunk_in<D, vf8>(job, g, c, part);
}

#if defined(__x86_64__)
// AVX-512's 16-float code where the CPU has it, unless REDRAFTER_KERNEL_VECTORS=8 asks for the
// 8-float code (so tests on an AVX-512 machine run both).
bool use_avx512() {
  const char* asked = std::getenv("REDRAFTER_KERNEL_VECTORS");
  return __builtin_cpu_supports("avx512f") && !(asked != nullptr && std::strcmp(asked, "8") == 0);
}
#endif

template <int D>
ChunkFn chunk_for_this_cpu() {
#if defined(__x86_64__)
  if (use_avx512()) return chunk_avx512<D>;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return chunk_avx2<D>;
#endif
  return chunk_default<D>;
}

// Below this many key-rows one thread runs every chunk.
constexpr long TREE_THREADED_MIN = 1 << 15;

template <int D>
void tree_attention_run(const TreeJob& job) {
  const int group = job.heads / job.kv_heads, rows = group * job.t;
  const int chunks = (job.keys + CHUNK - 1) / CHUNK, items = job.kv_heads * chunks;
  std::vector<Partial> parts(items);
  static const ChunkFn run_chunk = chunk_for_this_cpu<D>();
  auto chunk = [&](int w) { run_chunk(job, w / chunks, w % chunks, parts[w]); };
  if (static_cast<long>(job.keys) * rows * job.kv_heads < TREE_THREADED_MIN) {
    for (int w = 0; w < items; ++w) chunk(w);
  } else {
    pool().run(items, chunk);
  }
  for (int g = 0; g < job.kv_heads; ++g) {
    for (int r = 0; r < rows; ++r) {
      float peak = -INFINITY;
      for (int c = 0; c < chunks; ++c) peak = std::max(peak, parts[g * chunks + c].peak[r]);
      float total = 0.0f, out[D] = {};
      for (int c = 0; c < chunks; ++c) {
        const Partial& part = parts[g * chunks + c];
        if (part.peak[r] == -INFINITY) continue;
        float w = exp_nonpositive<float>(part.peak[r] - peak);
        total += part.total[r] * w;
        for (int x = 0; x < D; ++x) out[x] += part.out[r * D + x] * w;
      }
      float inverse = 1.0f / total;
      float* dst = job.out + ((g * group + r / job.t) * job.q_rows + r % job.t) * D;
      for (int x = 0; x < D; ++x) dst[x] = out[x] * inverse;
    }
  }
}

void run_tree_job(const TreeJob& job) {
  if (job.d == 64) {
    tree_attention_run<64>(job);
  } else {
    tree_attention_run<128>(job);
  }
}

class TreeAttention : public mx::UnaryPrimitive {
 public:
  TreeAttention(mx::Stream stream, int t) : mx::UnaryPrimitive(stream), t_(t) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& x : inputs) encoder.set_input_array(x);
    encoder.set_output_array(out);
    if (k.strides(3) != 1 || v.strides(3) != 1) {
      throw std::runtime_error("tree_attention: keys and values need unit strides along D");
    }
    TreeJob job{q.data<float>(), k.data<float>(), v.data<float>(),
                static_cast<long>(k.strides(1)), static_cast<long>(k.strides(2)),
                static_cast<long>(v.strides(1)), static_cast<long>(v.strides(2)),
                inputs.size() > 3 ? inputs[3].data<bool>() : nullptr, out.data<float>(),
                q.shape(1), k.shape(1), q.shape(2), q.shape(3), k.shape(2), q.shape(2)};
    encoder.dispatch([job]() { run_tree_job(job); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("tree_attention runs on the CPU stream only");
  }

  const char* name() const override { return "TreeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return t_ == static_cast<const TreeAttention&>(other).t_;
  }

 private:
  int t_;
};

// ValueError unless keys and values (1, KV, S + T, D) can serve T query rows of queries
// (1, H, *, D) float32, and visible is None or (T, T).
void check_tree(const mx::array& queries, const mx::array& keys, const mx::array& values, int t,
                const std::optional<mx::array>& visible) {
  for (const auto* x : {&queries, &keys, &values}) {
    if (x->dtype() != mx::float32 || x->ndim() != 4 || x->shape(0) != 1) {
      throw std::invalid_argument("queries, keys and values must be float32 (1, heads, n, D)");
    }
  }
  int heads = queries.shape(1), d = queries.shape(3), kv_heads = keys.shape(1);
  if (d != 64 && d != 128) throw std::invalid_argument("head size D must be 64 or 128");
  if (keys.shape() != values.shape() || keys.shape(3) != d || keys.shape(2) < t ||
      heads % kv_heads != 0 || heads / kv_heads * t > MAX_ROWS) {
    throw std::invalid_argument("shapes: keys = values (1, KV, S + T, D), heads / KV * T <= 32");
  }
  if (visible && (visible->ndim() != 2 || visible->shape(0) != t || visible->shape(1) != t)) {
    throw std::invalid_argument("visible must be (T, T)");
  }
}

mx::array scaled_queries(const mx::array& queries, float scale, mx::Stream cpu) {
  return mx::contiguous(mx::multiply(queries, mx::array(scale), cpu), false, cpu);
}

mx::array visible_input(const mx::array& visible, mx::Stream cpu) {
  return mx::contiguous(mx::astype(visible, mx::bool_, cpu), false, cpu);
}

mx::array tree_attention(const mx::array& queries, const mx::array& keys,
                         const mx::array& values, float scale, std::optional<mx::array> visible) {
  mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  int t = queries.ndim() == 4 ? queries.shape(2) : 0;
  check_tree(queries, keys, values, t, visible);
  std::vector<mx::array> inputs = {scaled_queries(queries, scale, cpu), keys, values};
  if (visible) inputs.push_back(visible_input(*visible, cpu));
  return mx::array(queries.shape(), mx::float32, std::make_shared<TreeAttention>(cpu, t),
                   std::move(inputs));
}

// ---- Several sequences' trees in one call (a joint forward's layer) ----
//
// joint_attention(queries, keys, values, counts, scale, visible): queries (1, H, N, D), the
// rows of segment i the counts[i] after those before it; keys[i], values[i] (1, KV, S_i + T_i,
// D) its sequence's cache; visible[i] None or (T_i, T_i). Each segment is attended as
// tree_attention attends it alone (the same bits); rows past the counts' sum (padding) are 0.

class JointAttention : public mx::UnaryPrimitive {
 public:
  JointAttention(mx::Stream stream, std::vector<int> counts, std::vector<bool> masked)
      : mx::UnaryPrimitive(stream), counts_(std::move(counts)), masked_(std::move(masked)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& q = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& x : inputs) encoder.set_input_array(x);
    encoder.set_output_array(out);
    const int n = q.shape(2), d = q.shape(3);
    std::vector<TreeJob> jobs;
    size_t next_visible = 1 + 2 * counts_.size();
    int start = 0;
    for (size_t i = 0; i < counts_.size(); ++i) {
      const mx::array &k = inputs[1 + 2 * i], &v = inputs[2 + 2 * i];
      if (k.strides(3) != 1 || v.strides(3) != 1) {
        throw std::runtime_error("joint_attention: keys and values need unit strides along D");
      }
      const bool* visible = masked_[i] ? inputs[next_visible++].data<bool>() : nullptr;
      jobs.push_back(TreeJob{q.data<float>() + start * d, k.data<float>(), v.data<float>(),
                             static_cast<long>(k.strides(1)), static_cast<long>(k.strides(2)),
                             static_cast<long>(v.strides(1)), static_cast<long>(v.strides(2)),
                             visible, out.data<float>() + start * d, q.shape(1), k.shape(1),
                             counts_[i], d, k.shape(2), n});
      start += counts_[i];
    }
    encoder.dispatch([jobs = std::move(jobs), y = out.data<float>(), heads = q.shape(1), n, d,
                      used = start]() {
      for (int h = 0; h < heads; ++h) {  // padding rows
        std::memset(y + (static_cast<long>(h) * n + used) * d, 0, sizeof(float) * (n - used) * d);
      }
      for (const TreeJob& job : jobs) run_tree_job(job);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("joint_attention runs on the CPU stream only");
  }

  const char* name() const override { return "JointAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const JointAttention&>(other);
    return counts_ == o.counts_ && masked_ == o.masked_;
  }

 private:
  std::vector<int> counts_;
  std::vector<bool> masked_;
};

mx::array joint_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                          const std::vector<mx::array>& values, const std::vector<int>& counts,
                          float scale, const std::vector<std::optional<mx::array>>& visible) {
  const size_t b = counts.size();
  if (b == 0 || keys.size() != b || values.size() != b || visible.size() != b) {
    throw std::invalid_argument("one count, keys, values and visible per segment");
  }
  long total = 0;
  for (int c : counts) {
    if (c < 1) throw std::invalid_argument("every segment needs a row");
    total += c;
  }
  if (queries.ndim() != 4 || total > queries.shape(2)) {
    throw std::invalid_argument("queries must be (1, H, N, D), N at least the counts' sum");
  }
  mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {scaled_queries(queries, scale, cpu)};
  std::vector<bool> masked;
  for (size_t i = 0; i < b; ++i) {
    check_tree(queries, keys[i], values[i], counts[i], visible[i]);
    inputs.push_back(keys[i]);
    inputs.push_back(values[i]);
    masked.push_back(visible[i].has_value());
  }
  for (const auto& x : visible) {
    if (x) inputs.push_back(visible_input(*x, cpu));
  }
  return mx::array(queries.shape(), mx::float32,
                   std::make_shared<JointAttention>(cpu, counts, std::move(masked)),
                   std::move(inputs));
}


// ---- The MLP's gate: silu(gate) * up ----
//
// swiglu(gate_up): gate_up (..., 2 I) float32, each row its gate's I columns then its up's
// (the fused gate/up product) -> (..., I): gate * sigmoid(gate) * up. Elementwise, so a row's
// bits do not depend on the rows beside it (a tree's row and a one-token step agree); a row's
// last partial vector is computed through the same lanes, padded.

// sigmoid(g) = 1 / (1 + exp(-g)) for g >= 0, exp(g) / (1 + exp(g)) below: exp of -|g| only,
// which never overflows.
template <typename V>
ALWAYS_INLINE V swiglu_lanes(V gate, V up) {
  V e = exp_nonpositive<V>(gate < 0.0f ? gate : -gate);
  V top = gate < 0.0f ? e : V{} + 1.0f;
  return gate * (top / (e + 1.0f)) * up;
}

template <typename V>
ALWAYS_INLINE void swiglu_in(const float* x, float* y, long rows, int n) {
  constexpr int W = sizeof(V) / sizeof(float);
  for (long r = 0; r < rows; ++r) {
    const float *gate = x + r * 2 * n, *up = gate + n;
    float* out = y + r * n;
    int j = 0;
    for (; j + W <= n; j += W) store(out + j, swiglu_lanes<V>(load<V>(gate + j), load<V>(up + j)));
    if (j < n) {
      float g[W] = {}, u[W] = {}, o[W];
      std::memcpy(g, gate + j, sizeof(float) * (n - j));
      std::memcpy(u, up + j, sizeof(float) * (n - j));
      store(o, swiglu_lanes<V>(load<V>(g), load<V>(u)));
      std::memcpy(out + j, o, sizeof(float) * (n - j));
    }
  }
}

using SwigluFn = void (*)(const float*, float*, long, int);

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void swiglu_avx512(const float* x, float* y, long rows,
                                                      int n) {
  swiglu_in<vf>(x, y, rows, n);
}

__attribute__((target("avx2,fma"))) void swiglu_avx2(const float* x, float* y, long rows,
                                                    int n) {
  swiglu_in<vf8>(x, y, rows, n);
}
#endif

void swiglu_default(const float* x, float* y, long rows, int n) { swiglu_in<vf8>(x, y, rows, n); }

SwigluFn swiglu_for_this_cpu() {
#if defined(__x86_64__)
  if (use_avx512()) return swiglu_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return swiglu_avx2;
#endif
  return swiglu_default;
}

class Swiglu : public mx::UnaryPrimitive {
 public:
  explicit Swiglu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    int n = out.shape(-1);
    long rows = n ? static_cast<long>(out.size() / n) : 0;
    static const SwigluFn run = swiglu_for_this_cpu();
    encoder.dispatch([x = x.data<float>(), y = out.data<float>(), rows, n]() { run(x, y, rows, n); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("swiglu runs on the CPU stream only");
  }

  const char* name() const override { return "Swiglu"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array swiglu(const mx::array& gate_up) {
  if (gate_up.dtype() != mx::float32) throw std::invalid_argument("gate_up must be float32");
  if (gate_up.ndim() < 1 || gate_up.shape(-1) % 2 != 0) {
    throw std::invalid_argument("gate_up's last axis must be even: gate, then up");
  }
  mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = gate_up.shape();
  shape.back() /= 2;
  return mx::array(shape, mx::float32, std::make_shared<Swiglu>(cpu),
                   {mx::contiguous(gate_up, false, cpu)});
}

}  // namespace

NB_MODULE(_primitives, m) {
  m.doc() = "Attention and SiLU-gate primitives for MLX's CPU backend";
  m.def("masked_softmax", &masked_softmax, nb::arg("scores"), nb::arg("visible") = nb::none(),
        "Softmax over the last axis of float32 scores (..., R, N); visible (T, T) masks the "
        "last T columns of row r by visible[r % T].");
  m.def("tree_attention", &tree_attention, nb::arg("queries"), nb::arg("keys"),
        nb::arg("values"), nb::arg("scale"), nb::arg("visible") = nb::none(),
        "Attention of queries (1, H, T, D) over keys and values (1, KV, S + T, D), the last T "
        "keys masked by visible (T, T).");
  m.def("joint_attention", &joint_attention, nb::arg("queries"), nb::arg("keys"),
        nb::arg("values"), nb::arg("counts"), nb::arg("scale"), nb::arg("visible"),
        "Segments of queries (1, H, N, D), counts[i] rows each, attended over their own keys[i] "
        "and values[i] (1, KV, S_i + T_i, D) as tree_attention attends each; padding rows 0.");
  m.def("swiglu", &swiglu, nb::arg("gate_up"),
        "silu(gate) * up from float32 gate_up (..., 2 I): each row's gate, then its up.");
}
