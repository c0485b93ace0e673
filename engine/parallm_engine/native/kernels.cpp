// ParaLLM's native CPU kernels: MLX primitives for the forward pass on MLX's CPU backend.
//
// MLX's CPU backend runs its elementwise kernels one scalar at a time (exp ~10 ns per element on
// x86 Linux), a batched matmul as one BLAS call per batch entry (96 tiny sgemm calls per layer for
// a batch-32 decode's attention), and every GEMM through a BLAS that packs the weights on each call.
// These primitives do the same math in one fused, vectorised pass (built with -march=native on the
// user's machine, see native/__init__.py), split over a small thread pool where it pays:
//
//   attention   softmax attention, GQA, causal or a boolean mask, and an optional prefix held once
//               for the batch (cascade attention, kv_cache.SharedPrefix); keys and values either
//               per row or in a page pool read through a slot table (kv_pages); one task per (row, KV
//               head, block of up to 16 query positions): decode (one position) and prefill alike. A
//               position that sees none of its own columns is padding (a ragged verify step's cells
//               no row fills): zeros, not computed.
//   linear      x @ w.T (+ bias) for a decode step's few rows, reading nn.Linear's weights in place
//               (float32, or bfloat16 widened in registers: weights_dtype="bfloat16").
//   linear_bf16_packed  bf16(x) @ w.T with AVX512_BF16 on weights packed into panels at load
//               (weights_dtype="bfloat16-matmul"), every row count.
//   paged_write a decode step's new keys or values into a lane's page pool, in place.
//   rms_norm    nn.RMSNorm in one pass.
//   swiglu      silu(gate) * x.
//   rope_rows   rotary embedding of a few positions per row from a cos/sin table.
//
// Numbers: every (row, head, position) of the attention is computed from its own visible keys in
// order (masked columns are skipped, not added as zeros), and every element of linear is the same
// sum in the same order whatever the batch, so a row's result does not depend on its left padding,
// on what else is in the batch, or on whether its prefix is held once or in the row: the scheduler's
// "batched greedy == sequential greedy" holds bitwise for these kernels.

#include <dlfcn.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // AVX2 intrinsics (the linear's tiles, the attention's lane sums) on any x86 build
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace parallm {

// ---------------------------------------------------------------------------------------------
// Vectorisable math

// 2**x, relative error < 2e-7, x clamped to [-126, 127] (softmax after subtracting the max;
// SiLU's sigmoid): x = n + f with n = round(x), f in [-0.5, 0.5]; 2**f by its degree-7 Taylor
// polynomial in f*ln2; 2**n by building the float's exponent bits. Plain arithmetic, so loops over
// it vectorise.
static inline float exp2_fast(float x) {
  x = x < -126.0f ? -126.0f : (x > 127.0f ? 127.0f : x);
  float n = (x + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2**23), vectorisable
  float f = (x - n) * 0.69314718055994531f;
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

static inline void axpy(float a, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// ---------------------------------------------------------------------------------------------
// A small persistent thread pool: run(n, f) calls f(i) for i in [0, n) on the calling thread and
// the workers, and returns when all are done. One job at a time (MLX evaluates a stream's ops in
// order on one thread; a lock serialises streams that reach here together).
//
// A decode step hands it ~270 jobs of 20-500 us each with short gaps between them, so a worker
// that went to sleep on a condition variable after each job would spend much of every job waking
// up (tens of microseconds on a VM). Workers instead spin (yielding the core to any other runnable
// thread) for a while after a job, and only then sleep.

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int n, const std::function<void(int)>& f) {
    if (n <= 0) return;
    if (workers_.empty() || n == 1) {
      for (int i = 0; i < n; ++i) f(i);
      return;
    }
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    job_ = &f;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    active_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes the job
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(m_);
      cv_.notify_all();
    }
    work();
    // Wait for the workers, yielding the core now and then: on a busy machine (more runnable threads
    // than cores, e.g. two decode lanes each calling here) a worker may be waiting for this very core.
    for (int i = 1; active_.load(std::memory_order_acquire) != 0; ++i) {
      cpu_relax();
      if (i % 256 == 0) std::this_thread::yield();
    }
    job_ = nullptr;
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(2000);

  Pool() {
    int n = 1;
    if (const char* env = std::getenv("PARALLM_NATIVE_THREADS")) {
      n = std::max(1, std::atoi(env));
    } else {
      n = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
    }
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_.store(true);
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void work() {
    for (int i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*job_)(i);
  }

  void loop() {
    uint64_t seen = 0;
    while (true) {
      uint64_t g = generation_.load(std::memory_order_acquire);
      if (g == seen) {  // spin a while, then sleep until the next job
        const auto until = std::chrono::steady_clock::now() + kSpin;
        for (int i = 1; (g = generation_.load(std::memory_order_acquire)) == seen; ++i) {
          cpu_relax();
          if (i % 256 == 0) {
            if (std::chrono::steady_clock::now() > until) break;
            std::this_thread::yield();
          }
        }
        if (g == seen) {
          std::unique_lock<std::mutex> lk(m_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lk, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_relaxed);
          g = generation_.load(std::memory_order_acquire);
        }
      }
      if (stop_.load()) return;
      seen = g;
      work();
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex job_mutex_, m_;
  std::condition_variable cv_;
  const std::function<void(int)>* job_ = nullptr;
  int n_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> active_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

// ---------------------------------------------------------------------------------------------
// Helpers for reading evaluated inputs

static void require_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + " must be float32");
}

static void require_f32_or_bf16(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::bfloat16)
    throw std::invalid_argument(std::string(what) + " must be float32 or bfloat16");
}

// Inputs come as lazy views; their strides are known only here, at evaluation (the wrappers add no
// contiguous-copy nodes to the graph: a decode step would otherwise carry ~750 of them, each a
// dispatch of several microseconds). The usual case reads the input's own buffer; anything else
// (a transposed or broadcast view) is gathered once into a row-major copy.

template <typename T>
static void gather(const mx::array& a, T* dst) {
  const T* src = a.data<T>();
  const int nd = a.ndim();
  if (nd == 0) {
    dst[0] = src[0];
    return;
  }
  const int64_t inner = a.shape(nd - 1), step = a.strides()[nd - 1];
  const size_t rows = inner ? a.size() / inner : 0;
  std::vector<int64_t> idx(nd, 0);
  for (size_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; ++d) off += idx[d] * a.strides()[d];
    for (int64_t i = 0; i < inner; ++i) dst[r * inner + i] = src[off + i * step];
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
}

// The elements of `a` in row-major order: its own buffer when it is row-contiguous, else a copy in
// `buf` (of a type the size of T: std::vector<bool> has no buffer).
template <typename T, typename Buf>
static const T* dense(const mx::array& a, std::vector<Buf>& buf) {
  static_assert(sizeof(Buf) == sizeof(T));
  if (a.flags().row_contiguous) return a.data<T>();
  buf.resize(a.size());
  gather(a, reinterpret_cast<T*>(buf.data()));
  return reinterpret_cast<const T*>(buf.data());
}

// Rows whose last axis is contiguous, with the array's strides (the KV cache's strided views read
// in place); anything else gathered into a row-major copy.
struct Rows {
  const float* data;
  std::vector<int64_t> strides;  // in elements
  std::vector<float> owned;
};

static Rows rows_of(const mx::array& a) {
  Rows r;
  r.strides.assign(a.strides().begin(), a.strides().end());
  if (a.ndim() == 0 || a.strides().back() == 1 || a.shape().back() == 1) {
    r.data = a.data<float>();
    return r;
  }
  r.owned.resize(a.size());
  gather(a, r.owned.data());
  int64_t s = 1;
  for (int d = a.ndim() - 1; d >= 0; --d) {
    r.strides[d] = s;
    s *= a.shape(d);
  }
  r.data = r.owned.data();
  return r;
}

static mx::array as_f32(const mx::array& a, mx::StreamOrDevice s) {
  return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s);
}

// ---------------------------------------------------------------------------------------------
// Vector dot-product tiles, shared by the attention's scores and linear.
//
// Tile sizes follow the register file: with AVX-512's 32 zmm registers a 4 x 6 tile keeps its 24
// accumulators, 4 rows of x and a row of w in registers. A v16 is two registers on AVX2 and four on
// NEON (16 and 32 registers), so there the attention's score tiles are smaller. On AVX2 the linear
// uses 8-lane tiles instead (dot_tile8: 4 x 3 tiles, 12 ymm accumulators of the 16 registers); on
// other CPUs the native linear is not used by default (cpu_kernels asks `linear_lanes`).
#if defined(__AVX512F__)
constexpr bool kWideVectors = true;
constexpr int kLinearLanes = 16;
constexpr int kLinearMT = 4, kLinearNT = 6, kScoreTile = 16;
// Keep a v16 in a register: GCC would otherwise fold its load into every FMA that reads it.
#define PARALLM_IN_REGISTER(x) asm("" : "+v"(x))
#elif defined(__AVX2__) && defined(__FMA__)
constexpr bool kWideVectors = false;
constexpr int kLinearLanes = 8;
constexpr int kLinearMT = 4, kLinearNT = 3, kScoreTile = 4;
#define PARALLM_IN_REGISTER(x) ((void)0)  // a v16 spans several registers here
#define PARALLM_LINEAR8 1
#include <immintrin.h>
#else
constexpr bool kWideVectors = false;
constexpr int kLinearLanes = 0;  // not tuned: cpu_kernels keeps MLX's matmul
constexpr int kLinearMT = 2, kLinearNT = 2, kScoreTile = 4;
#define PARALLM_IN_REGISTER(x) ((void)0)  // a v16 spans several registers here
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, unaligned loads allowed

static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bfloat16 weights (engine option weights_dtype="bfloat16", stored as MLX's bfloat16: the high 16
// bits of a float32) are widened to float32 as they are loaded, exactly (shift left by 16); the
// products and sums stay float32. Half the bytes streamed per decode step for the same math on the
// widened values.
static inline float bf16_to_f32(uint16_t h) { return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16); }

static inline v16 load16(const uint16_t* p) {
  v16 v;
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) v[i] = bf16_to_f32(p[i]);
  return v;
}

// The first r < 16 elements at p, the rest zero.
template <typename T>
static inline v16 load16_partial(const T* p, int r) {
  v16 v = {};
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, r * sizeof(float));
  } else {
    for (int i = 0; i < r; ++i) v[i] = bf16_to_f32(p[i]);
  }
  return v;
}

// One level of the lane-sum network: in each block of 2H lanes, the low H lanes of a and of b
// (first half) plus their high H lanes.
template <int H>
static inline v16 fold(v16 a, v16 b) {
  if constexpr (H == 8)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  else if constexpr (H == 4)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
        __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  else if constexpr (H == 2)
    return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
        __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  else
    return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
        __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// The 16 lane sums of a[0..15]: lane i holds the sum of a[kBitRev[i]].
static constexpr int kBitRev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
static inline v16 lane_sums(const v16* a) {
  v16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) l1[i] = fold<8>(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) l2[i] = fold<4>(l1[2 * i], l1[2 * i + 1]);
  for (int i = 0; i < 2; ++i) l3[i] = fold<2>(l2[2 * i], l2[2 * i + 1]);
  return fold<1>(l3[0], l3[1]);
}

// y[i][j] = x[i] . w(j) (+ bias[j]) for MT rows of x and NT rows of w (`w(j)` points at row j),
// issuing `npf` prefetches of the cache lines at `pf` along the way. x stays in registers per K
// chunk and each w row is loaded once per chunk (PARALLM_IN_REGISTER); the fully unrolled loops let
// the accumulators live in registers. Every element is the same computation: 16 lanes of FMAs over
// K in order (a zero-padded last chunk), then the lane tree.
template <int MT, int NT, typename WRow>
static inline void dot_tile(const float* x, int64_t ldx, WRow w, const float* bias, float* y, int64_t ldy, int K,
                            const char* pf, int npf) {
  v16 acc[MT][NT] = {};
  const int KC = K / 16;
  int p = 0;
  for (int kc = 0; kc < KC; ++kc) {
    if (p < npf) __builtin_prefetch(pf + 64 * p++);
    v16 xv[MT];
    _Pragma("GCC unroll 8") for (int i = 0; i < MT; ++i) {
      xv[i] = load16(x + i * ldx + kc * 16);
      PARALLM_IN_REGISTER(xv[i]);
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; ++j) {
      v16 wv = load16(w(j) + kc * 16);
      PARALLM_IN_REGISTER(wv);
      _Pragma("GCC unroll 8") for (int i = 0; i < MT; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  for (; p < npf; ++p) __builtin_prefetch(pf + 64 * p);
  if (const int r = K % 16) {  // the last partial chunk, zero-padded
    v16 xv[MT] = {};
    for (int i = 0; i < MT; ++i) std::memcpy(&xv[i], x + i * ldx + KC * 16, r * sizeof(float));
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; ++j) {
      v16 wv = load16_partial(w(j) + KC * 16, r);
      _Pragma("GCC unroll 8") for (int i = 0; i < MT; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  constexpr int T = MT * NT;
  _Pragma("GCC unroll 4") for (int g = 0; g < (T + 15) / 16; ++g) {
    v16 all[16] = {};
    _Pragma("GCC unroll 16") for (int u = 0; u < 16; ++u) {
      const int t = g * 16 + u;
      if (t < T) all[kBitRev[u]] = acc[t / NT][t % NT];
    }
    const v16 s = lane_sums(all);
    _Pragma("GCC unroll 16") for (int u = 0; u < 16; ++u) {
      const int t = g * 16 + u;
      if (t < T) y[(t / NT) * ldy + t % NT] = bias ? s[u] + bias[t % NT] : s[u];
    }
  }
}

// The 8-lane variant of dot_tile for AVX2's 16 ymm registers (the linear's tiles there), in
// intrinsics (GCC's vector extensions spill these tiles to the stack): the same contract and the same
// per-element guarantee (8 lanes of FMAs over K in order, a zero-padded last chunk, then one fixed
// lane tree), so a row's result does not depend on M or on which tile computes it.
#if defined(PARALLM_LINEAR8)
// Lane i of the result holds the sum of the 8 lanes of a[kBitRev8[i]].
static constexpr int kBitRev8[8] = {0, 2, 4, 6, 1, 3, 5, 7};
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
// 8 bfloat16 -> float32: zero-extend each u16 to u32, shift into the high half.
static inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline __m256 lane_sums8(const __m256* a) {
  __m256 l1[4], l2[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: a[2i]'s halves added, lanes 4-7: a[2i + 1]'s
    l1[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                          _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    l2[i] = _mm256_add_ps(_mm256_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0x44),
                          _mm256_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(l2[0], l2[1], 0x88), _mm256_shuffle_ps(l2[0], l2[1], 0xDD));
}

template <int MT, int NT, typename WRow>
static inline void dot_tile8(const float* x, int64_t ldx, WRow w, const float* bias, float* y, int64_t ldy, int K,
                             const char* pf, int npf) {
  __m256 acc[MT][NT];
  _Pragma("GCC unroll 8") for (int i = 0; i < MT; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
  using WT = std::remove_cv_t<std::remove_pointer_t<decltype(w(0))>>;  // float or bfloat16 (uint16_t)
  const WT* wr[NT];
  _Pragma("GCC unroll 8") for (int j = 0; j < NT; ++j) wr[j] = w(j);
  const int KC = K / 8;
  int p = 0;
  for (int kc = 0; kc < KC; ++kc) {
    if (p < npf && (kc & 1) == 0) __builtin_prefetch(pf + 64 * p++);  // a cache line per 16 floats of K
    __m256 wv[NT];
    _Pragma("GCC unroll 8") for (int j = 0; j < NT; ++j) wv[j] = load8(wr[j] + kc * 8);
    _Pragma("GCC unroll 8") for (int i = 0; i < MT; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + kc * 8);
      _Pragma("GCC unroll 8") for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (; p < npf; ++p) __builtin_prefetch(pf + 64 * p);
  if (const int r = K % 8) {  // the last partial chunk, zero-padded
    alignas(32) float buf[8] = {};
    __m256 wv[NT];
    for (int j = 0; j < NT; ++j) {
      WT wbuf[8] = {};
      std::memcpy(wbuf, wr[j] + KC * 8, r * sizeof(WT));
      wv[j] = load8(wbuf);
    }
    for (int i = 0; i < MT; ++i) {
      std::memcpy(buf, x + i * ldx + KC * 8, r * sizeof(float));
      const __m256 xv = _mm256_load_ps(buf);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  constexpr int T = MT * NT;
  for (int g = 0; g < (T + 7) / 8; ++g) {
    __m256 all[8];
    for (int u = 0; u < 8; ++u) {
      const int t = g * 8 + u;
      all[kBitRev8[u]] = t < T ? acc[t / NT][t % NT] : _mm256_setzero_ps();
    }
    alignas(32) float s[8];
    _mm256_store_ps(s, lane_sums8(all));
    for (int u = 0; u < 8; ++u) {
      const int t = g * 8 + u;
      if (t < T) y[(t / NT) * ldy + t % NT] = bias ? s[u] + bias[t % NT] : s[u];
    }
  }
}
#endif

// The linear's tile: 8-lane on AVX2, dot_tile otherwise.
template <int MT, int NT, typename WRow>
static inline void linear_tile(const float* x, int64_t ldx, WRow w, const float* bias, float* y, int64_t ldy, int K,
                               const char* pf, int npf) {
#if defined(PARALLM_LINEAR8)
  dot_tile8<MT, NT>(x, ldx, w, bias, y, ldy, K, pf, npf);
#else
  dot_tile<MT, NT>(x, ldx, w, bias, y, ldy, K, pf, npf);
#endif
}

// ---------------------------------------------------------------------------------------------
// attention

class Attention : public mx::Primitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal, bool has_mask, bool has_shared, bool has_shared_mask,
            bool has_table)
      : mx::Primitive(stream),
        scale_(scale),
        causal_(causal),
        has_mask_(has_mask),
        has_shared_(has_shared),
        has_shared_mask_(has_shared_mask),
        has_table_(has_table) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("parallm attention is a CPU kernel");
  }
  const char* name() const override { return "ParallmAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && has_mask_ == o.has_mask_ && has_shared_ == o.has_shared_ &&
        has_shared_mask_ == o.has_shared_mask_ && has_table_ == o.has_table_;
  }

 private:
  float scale_;
  bool causal_, has_mask_, has_shared_, has_shared_mask_, has_table_;
};

// What one (row, KV head, position) task reads. Strides in elements; key/value rows are contiguous in D.
struct AttnArgs {
  const float* q;  // (B, H, L, D) contiguous
  const float* k;
  const float* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const float* sk = nullptr;  // shared prefix (KH, P, D) rows
  const float* sv = nullptr;
  int64_t sks1 = 0, sks2 = 0, svs1 = 0, svs2 = 0;
  int P = 0;
  const bool* mask = nullptr;  // row b, query l, column t at mask[b * ms0 + l * ms2 + t * ms3]
  int64_t ms0 = 0, ms2 = 0, ms3 = 0;
  bool causal = false;  // query l sees own columns t <= T - L + l
  const bool* shared_mask = nullptr;  // (B,)
  // Paged KV (kv_pages): k / v are the pools (KH, slots, D) and row b's column t is slot
  // table[b * T + t]; nullptr: column t of row b is k's own (b, :, t).
  const int32_t* table = nullptr;
  float* out;  // (B, H, L, Dv)
  int H, KH, L, T, D, Dv;
  float qscale;
};

// Softmax of n scores (log2 units) in place, returning 1 / their sum.
static inline float softmax2(float* s, int n) {
  float m = s[0];
#pragma omp simd reduction(max : m)
  for (int i = 1; i < n; ++i) m = s[i] > m ? s[i] : m;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) {
    s[i] = exp2_fast(s[i] - m);
    sum += s[i];
  }
  return 1.0f / sum;
}

// Scores of MT query heads (rows of q, stride D) against the n keys at krows (padded with zero rows
// to a multiple of NT), NT keys per tile: one lane-sum network per MT * NT <= 16 scores instead of a
// horizontal sum per score. Prefetches keys kAhead rows ahead and the values the scores will weigh.
constexpr int kAhead = 8;

template <int MT, int NT>
static void score_heads(const float* q, int D, const float* const* krows, const float* const* vrows, int n,
                        bool prefetch, float* scores, int64_t stride) {
  const int lines = (D * static_cast<int>(sizeof(float)) + 63) / 64;
  for (int i = 0; i < n; i += NT) {
    if (prefetch) {
      for (int j = i + kAhead; j < std::min(n, i + kAhead + NT); ++j)
        for (int c = 0; c < lines; ++c) __builtin_prefetch(reinterpret_cast<const char*>(krows[j]) + 64 * c);
      for (int j = i; j < std::min(n, i + NT); ++j)
        for (int c = 0; c < lines; ++c) __builtin_prefetch(reinterpret_cast<const char*>(vrows[j]) + 64 * c);
    }
    dot_tile<MT, NT>(q, D, [krows, i](int j) { return krows[i + j]; }, nullptr, scores + i, stride, D, nullptr, 0);
  }
}

// One (row b, KV head kh, query position l): its `rep` query heads against the prefix (when the row
// continues it) and its own columns it may see, in column order. The rep heads share every key and
// value load. NC = Dv / 16 when Dv is 64 or 128 (weighted values summed in registers), 0 otherwise
// (in memory).
template <int NC>
static void attend(const AttnArgs& a, int b, int kh, int l) {
  const int rep = a.H / a.KH, D = a.D, Dv = a.Dv;
  const bool use_prefix = a.sk && (!a.shared_mask || a.shared_mask[b]);
  const int cap = (use_prefix ? a.P : 0) + a.T;
  thread_local std::vector<const float*> krows, vrows;
  thread_local std::vector<float> qbuf, scores, zeros;
  krows.resize(cap + 16);
  vrows.resize(cap);
  int n = 0;
  if (use_prefix) {
    const float* kb = a.sk + kh * a.sks1;
    const float* vb = a.sv + kh * a.svs1;
    for (int t = 0; t < a.P; ++t, ++n) {
      krows[n] = kb + t * a.sks2;
      vrows[n] = vb + t * a.svs2;
    }
  }
  {
    const float* kb = a.k + (a.table ? 0 : b * a.ks0) + kh * a.ks1;
    const float* vb = a.v + (a.table ? 0 : b * a.vs0) + kh * a.vs1;
    const int32_t* trow = a.table ? a.table + static_cast<int64_t>(b) * a.T : nullptr;
    const bool* mrow = a.mask ? a.mask + b * a.ms0 + l * a.ms2 : nullptr;
    const int visible = a.causal ? a.T - a.L + l + 1 : a.T;
    for (int t = 0; t < visible; ++t) {
      if (mrow && !mrow[t * a.ms3]) continue;  // skipped, not added as a zero: padding-invariant sums
      const int64_t c = trow ? trow[t] : t;
      krows[n] = kb + c * a.ks2;
      vrows[n] = vb + c * a.vs2;
      ++n;
    }
  }
  // Head h = kh * rep + r of row b at position l: q/out rows ((b * H + h) * L + l), stride L rows per head.
  const int64_t first = (static_cast<int64_t>(b) * a.H + kh * rep) * a.L + l;
  float* out = a.out + first * Dv;
  const int64_t ostride = static_cast<int64_t>(a.L) * Dv;
  // Nothing to attend to (a fully masked row), or none of its own columns (a position that is padding,
  // e.g. a ragged verify step's rectangle cells no row fills; every real query sees its own key): zeros.
  if (n == 0 || n == (use_prefix ? a.P : 0)) {
    for (int r = 0; r < rep; ++r) std::fill(out + r * ostride, out + r * ostride + Dv, 0.0f);
    return;
  }
  zeros.assign(D, 0.0f);
  for (int i = n; i < n + 16; ++i) krows[i] = zeros.data();  // a tile's padding keys
  const int64_t stride = (n + 15) / 16 * 16 + 16;  // the last tile writes up to 15 padding scores
  qbuf.resize(static_cast<size_t>(rep) * D);
  scores.resize(static_cast<size_t>(rep) * stride);
  for (int r = 0; r < rep; ++r) {
    const float* qrow = a.q + (first + static_cast<int64_t>(r) * a.L) * D;
    for (int i = 0; i < D; ++i) qbuf[r * D + i] = qrow[i] * a.qscale;
  }
  for (int r0 = 0; r0 < rep; r0 += 4) {
    const float* q = &qbuf[static_cast<size_t>(r0) * D];
    float* s = &scores[r0 * stride];
    const bool pf = r0 == 0;
    switch (std::min(4, rep - r0)) {
      case 1: score_heads<1, kScoreTile>(q, D, krows.data(), vrows.data(), n, pf, s, stride); break;
      case 2: score_heads<2, std::max(1, kScoreTile / 2)>(q, D, krows.data(), vrows.data(), n, pf, s, stride); break;
      case 3: score_heads<3, std::max(1, kScoreTile / 3)>(q, D, krows.data(), vrows.data(), n, pf, s, stride); break;
      default: score_heads<4, std::max(1, kScoreTile / 4)>(q, D, krows.data(), vrows.data(), n, pf, s, stride); break;
    }
  }
  thread_local std::vector<float> inv;
  inv.resize(rep);
  for (int r = 0; r < rep; ++r) inv[r] = softmax2(&scores[r * stride], n);
  if constexpr (NC > 0) {
    // The weighted values summed in registers, each value row loaded once for RV heads.
    constexpr int RV = NC <= 4 ? 4 : 2;
    for (int r0 = 0; r0 < rep; r0 += RV) {
      const int nr = std::min(RV, rep - r0);
      v16 o[RV][NC] = {};
      for (int i = 0; i < n; ++i) {
        v16 vv[NC];
        std::memcpy(vv, vrows[i], sizeof(vv));
        for (int r = 0; r < nr; ++r) {
          const float p = scores[(r0 + r) * stride + i];
          for (int c = 0; c < NC; ++c) o[r][c] += p * vv[c];
        }
      }
      for (int r = 0; r < nr; ++r)
        for (int c = 0; c < NC; ++c) {
          v16 y = o[r][c] * inv[r0 + r];
          std::memcpy(out + (r0 + r) * ostride + c * 16, &y, sizeof(y));
        }
    }
    return;
  }
  thread_local std::vector<float> acc;  // any Dv: the weighted values summed in memory
  acc.assign(static_cast<size_t>(rep) * Dv, 0.0f);
  for (int i = 0; i < n; ++i) {
    const float* vr = vrows[i];
    for (int r = 0; r < rep; ++r) axpy(scores[r * stride + i], vr, &acc[r * Dv], Dv);
  }
  for (int r = 0; r < rep; ++r)
    for (int d = 0; d < Dv; ++d) out[r * ostride + d] = acc[r * Dv + d] * inv[r];
}

// Attention in blocks: one task per (row, KV head, block of up to kQB query positions), for every
// head size that is a multiple of 8 (`attend` above, one position per task, serves the others).
// `attend` reads every visible key and value once per position: at prefill sizes that streams a KV
// head (~1.3 MB at 2,500 tokens of 64-dim fp32) from L3 once per position (a 512-token chunk over
// 2,000 cached tokens took ~10 s on the 2-core CI machine; ~2.8 s here), and its accumulators and
// exp stay in memory / scalar (batch-32 decode over 2,000 tokens: 18 ms a layer; 7 ms here, 3 ms
// with the prefix held once). Here the block's query rows (rep heads x positions) are scored
// against each key once (2 query rows x 4 keys a register tile), each row's visible scores are
// gathered in column order and softmaxed (8 lanes), and the values are summed in that order, 8
// accumulators in registers, over 64-key tiles that stay in L1 while every row of the block reads them.
//
// Numbers: a score is one fixed sum (8 lanes over D in order, then the same lane tree) whatever tile
// computes it, and each query's softmax and weighted sum run over its own visible keys in column
// order: a position's result depends on its query and the keys it sees only. It has the same bits in
// a decode step, a speculative verification or a prefill chunk of any size, left-padded in any batch,
// with its prefix held once or in the row.
constexpr int kQB = 16, kVTile = 64;

typedef float v8 __attribute__((vector_size(32), aligned(4)));

// Lane sums of 8 accumulators, each by the same tree ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)).
static inline v8 lane_sums8x8(const v8* a) {
#if defined(__AVX2__)
  const __m256 t0 = _mm256_hadd_ps(__m256(a[0]), __m256(a[1])), t1 = _mm256_hadd_ps(__m256(a[2]), __m256(a[3]));
  const __m256 t2 = _mm256_hadd_ps(__m256(a[4]), __m256(a[5])), t3 = _mm256_hadd_ps(__m256(a[6]), __m256(a[7]));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return v8(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  v8 r;
  for (int j = 0; j < 8; ++j)
    r[j] = ((a[j][0] + a[j][1]) + (a[j][2] + a[j][3])) + ((a[j][4] + a[j][5]) + (a[j][6] + a[j][7]));
  return r;
#endif
}

// Scores of query rows q0, q1 (D floats, already scaled) against keys k[0..3]: s0[j], s1[j]. The eight
// accumulators live in registers (named: an array of them would be kept in memory).
static inline void score_2x4(const float* q0, const float* q1, const float* const* k, int D, float* s0, float* s1) {
  v8 acc[8];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
  for (int d = 0; d < D; d += 8) {
    const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
    __m256 kv = _mm256_loadu_ps(k0 + d);
    a0 = _mm256_fmadd_ps(x, kv, a0);
    b0 = _mm256_fmadd_ps(y, kv, b0);
    kv = _mm256_loadu_ps(k1 + d);
    a1 = _mm256_fmadd_ps(x, kv, a1);
    b1 = _mm256_fmadd_ps(y, kv, b1);
    kv = _mm256_loadu_ps(k2 + d);
    a2 = _mm256_fmadd_ps(x, kv, a2);
    b2 = _mm256_fmadd_ps(y, kv, b2);
    kv = _mm256_loadu_ps(k3 + d);
    a3 = _mm256_fmadd_ps(x, kv, a3);
    b3 = _mm256_fmadd_ps(y, kv, b3);
  }
  acc[0] = v8(a0), acc[1] = v8(a1), acc[2] = v8(a2), acc[3] = v8(a3);
  acc[4] = v8(b0), acc[5] = v8(b1), acc[6] = v8(b2), acc[7] = v8(b3);
#else
  for (auto& x : acc) x = v8{};
  for (int d = 0; d < D; d += 8) {
    v8 a, b;
    std::memcpy(&a, q0 + d, sizeof(v8));
    std::memcpy(&b, q1 + d, sizeof(v8));
    for (int j = 0; j < 4; ++j) {
      v8 kv;
      std::memcpy(&kv, k[j] + d, sizeof(v8));
      acc[j] += a * kv;
      acc[4 + j] += b * kv;
    }
  }
#endif
  const v8 r = lane_sums8x8(acc);
  for (int j = 0; j < 4; ++j) {
    s0[j] = r[j];
    s1[j] = r[4 + j];
  }
}

// softmax2 for the blocks, vectorised by hand (the compiler keeps `softmax2`'s exp scalar):
// the same exp2 polynomial, 8 lanes at a time, partial sums in lanes then a fixed tree. In place,
// returns 1 / the sum.
static inline float softmax2_rows(float* s, int n) {
#if defined(__AVX2__) && defined(__FMA__)
  int i = 0;
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
  float m = -INFINITY;
  for (int j = 0; j < 8; ++j) m = std::max(m, vm[j]);
  for (; i < n; ++i) m = std::max(m, s[i]);
  const __m256 mm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-126.0f), hi = _mm256_set1_ps(127.0f);
  const __m256 round = _mm256_set1_ps(12582912.0f), ln2 = _mm256_set1_ps(0.69314718055994531f);
  const float c[8] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
  __m256 vs = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    __m256 x = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), mm), lo), hi);
    const __m256 nf = _mm256_sub_ps(_mm256_add_ps(x, round), round);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, nf), ln2);
    __m256 p = _mm256_set1_ps(c[0]);
    for (int k = 1; k < 8; ++k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[k]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(nf), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    _mm256_storeu_ps(s + i, y);
    vs = _mm256_add_ps(vs, y);
  }
  float sum = ((vs[0] + vs[1]) + (vs[2] + vs[3])) + ((vs[4] + vs[5]) + (vs[6] + vs[7]));
  for (; i < n; ++i) {
    s[i] = exp2_fast(s[i] - m);
    sum += s[i];
  }
  return 1.0f / sum;
#else
  return softmax2(s, n);
#endif
}

// o[0..64) += p * v[0..64), the 8 accumulators in registers across `n` keys (p[j], vrows[idx[j]]).
static inline void weigh_values64(const float* p, const int* idx, int n, const float* const* vrows, int c0, float* o) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8), o2 = _mm256_loadu_ps(o + 16),
         o3 = _mm256_loadu_ps(o + 24), o4 = _mm256_loadu_ps(o + 32), o5 = _mm256_loadu_ps(o + 40),
         o6 = _mm256_loadu_ps(o + 48), o7 = _mm256_loadu_ps(o + 56);
  for (int j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    const float* v = vrows[idx[j]] + c0;
    o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), o0);
    o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), o1);
    o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), o2);
    o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), o3);
    o4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), o4);
    o5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), o5);
    o6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), o6);
    o7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), o7);
  }
  _mm256_storeu_ps(o, o0), _mm256_storeu_ps(o + 8, o1), _mm256_storeu_ps(o + 16, o2), _mm256_storeu_ps(o + 24, o3);
  _mm256_storeu_ps(o + 32, o4), _mm256_storeu_ps(o + 40, o5), _mm256_storeu_ps(o + 48, o6), _mm256_storeu_ps(o + 56, o7);
#else
  for (int j = 0; j < n; ++j) axpy(p[j], vrows[idx[j]] + c0, o, 64);
#endif
}

static void attend_block(const AttnArgs& a, int b, int kh, int l0, int l1) {
  const int rep = a.H / a.KH, D = a.D, Dv = a.Dv, nl = l1 - l0;
  const bool use_prefix = a.sk && (!a.shared_mask || a.shared_mask[b]);
  const int nP = use_prefix ? a.P : 0;
  const bool* mbase = a.mask ? a.mask + b * a.ms0 : nullptr;
  auto visible = [&](int t, int l) {  // own column t for query position l
    if (a.causal && t > a.T - a.L + l) return false;
    return !mbase || mbase[l * a.ms2 + t * a.ms3];
  };
  // The keys any query of the block sees, in column order: the prefix, then own columns.
  thread_local std::vector<const float*> krows, vrows;
  thread_local std::vector<int> cols;  // own column of key u - nP
  thread_local std::vector<float> qbuf, S, cs, acc, zeros;
  thread_local std::vector<int> vis;  // per position: its visible keys (indices into the union)
  thread_local std::vector<int> nvis;
  const int cap = nP + a.T;
  krows.resize(cap + 4);
  vrows.resize(cap);
  cols.clear();
  int nU = 0;
  if (use_prefix) {
    const float* kb = a.sk + kh * a.sks1;
    const float* vb = a.sv + kh * a.svs1;
    for (int t = 0; t < a.P; ++t, ++nU) {
      krows[nU] = kb + t * a.sks2;
      vrows[nU] = vb + t * a.svs2;
    }
  }
  {
    const float* kb = a.k + (a.table ? 0 : b * a.ks0) + kh * a.ks1;
    const float* vb = a.v + (a.table ? 0 : b * a.vs0) + kh * a.vs1;
    const int32_t* trow = a.table ? a.table + static_cast<int64_t>(b) * a.T : nullptr;
    const int last = a.causal ? std::min(a.T, a.T - a.L + l1) : a.T;
    for (int t = 0; t < last; ++t) {
      bool any = !mbase;
      for (int l = l0; l < l1 && !any; ++l) any = visible(t, l);
      if (!any) continue;
      const int64_t c = trow ? trow[t] : t;
      krows[nU] = kb + c * a.ks2;
      vrows[nU] = vb + c * a.vs2;
      cols.push_back(t);
      ++nU;
    }
  }
  vis.resize(static_cast<size_t>(nl) * std::max(nU, 1));
  nvis.assign(nl, 0);
  thread_local std::vector<int> pos;  // the block's positions that see one of their own columns
  pos.clear();
  for (int l = l0; l < l1; ++l) {
    int* v = &vis[static_cast<size_t>(l - l0) * nU];
    int n = 0;
    for (int u = 0; u < nP; ++u) v[n++] = u;
    for (int u = nP; u < nU; ++u)
      if (visible(cols[u - nP], l)) v[n++] = u;
    nvis[l - l0] = n;
    if (n > nP) pos.push_back(l);
  }
  // A position that sees none of its own columns is padding (every real query sees its own key: e.g. a
  // ragged verify step's rectangle cells no row fills): zeros, and not computed.
  for (int l = l0; l < l1; ++l)
    if (nvis[l - l0] == nP)
      for (int r = 0; r < rep; ++r) {
        float* out = a.out + ((static_cast<int64_t>(b) * a.H + kh * rep + r) * a.L + l) * Dv;
        std::fill(out, out + Dv, 0.0f);
      }
  const int rows = rep * static_cast<int>(pos.size());
  if (rows == 0) return;
  // Query rows: row i = (position pos[i / rep], head kh * rep + i % rep), scaled.
  const int rows2 = (rows + 1) / 2 * 2;
  qbuf.resize(static_cast<size_t>(rows2) * D);
  for (int i = 0; i < rows; ++i) {
    const int l = pos[i / rep], h = kh * rep + i % rep;
    const float* qrow = a.q + ((static_cast<int64_t>(b) * a.H + h) * a.L + l) * D;
    for (int d = 0; d < D; ++d) qbuf[static_cast<size_t>(i) * D + d] = qrow[d] * a.qscale;
  }
  if (rows2 > rows) std::copy(&qbuf[0], &qbuf[D], &qbuf[static_cast<size_t>(rows) * D]);  // a discarded twin
  const int ldS = (nU + 3) / 4 * 4;
  S.resize(static_cast<size_t>(rows2) * ldS);
  zeros.assign(D, 0.0f);
  for (int u = nU; u < nU + 4; ++u) krows[u] = zeros.data();
  for (int u = 0; u < nU; u += 4)
    for (int i = 0; i < rows2; i += 2)
      score_2x4(&qbuf[static_cast<size_t>(i) * D], &qbuf[static_cast<size_t>(i + 1) * D], &krows[u], D,
                &S[static_cast<size_t>(i) * ldS + u], &S[static_cast<size_t>(i + 1) * ldS + u]);
  // Each row's visible scores in column order, softmaxed in place (cs, stride ldc).
  const int ldc = (nU + 15) / 16 * 16 + 16;
  cs.resize(static_cast<size_t>(rows) * ldc);
  thread_local std::vector<float> inv;
  inv.resize(rows);
  for (int i = 0; i < rows; ++i) {
    const int li = pos[i / rep] - l0, n = nvis[li];
    const int* v = &vis[static_cast<size_t>(li) * nU];
    float* c = &cs[static_cast<size_t>(i) * ldc];
    const float* srow = &S[static_cast<size_t>(i) * ldS];
    for (int j = 0; j < n; ++j) c[j] = srow[v[j]];
    inv[i] = n ? softmax2_rows(c, n) : 0.0f;
  }
  // Weighted values, in each row's column order, over value tiles every row reads while in L1.
  acc.assign(static_cast<size_t>(rows) * Dv, 0.0f);
  thread_local std::vector<int> cursor;
  cursor.assign(rows, 0);
  for (int u0 = 0; u0 < nU; u0 += kVTile) {
    const int u1 = std::min(nU, u0 + kVTile);
    for (int i = 0; i < rows; ++i) {
      const int li = pos[i / rep] - l0, n = nvis[li];
      const int* v = &vis[static_cast<size_t>(li) * nU];
      const float* p = &cs[static_cast<size_t>(i) * ldc];
      float* o = &acc[static_cast<size_t>(i) * Dv];
      const int j0 = cursor[i];
      int j = j0;
      while (j < n && v[j] < u1) ++j;
      int c0 = 0;
      for (; c0 + 64 <= Dv; c0 += 64) weigh_values64(p + j0, v + j0, j - j0, vrows.data(), c0, o + c0);
      if (c0 < Dv)  // the last Dv % 64 columns
        for (int jj = j0; jj < j; ++jj) axpy(p[jj], vrows[v[jj]] + c0, o + c0, Dv - c0);
      cursor[i] = j;
    }
  }
  for (int i = 0; i < rows; ++i) {
    const int l = pos[i / rep], h = kh * rep + i % rep;
    float* out = a.out + ((static_cast<int64_t>(b) * a.H + h) * a.L + l) * Dv;
    const float* o = &acc[static_cast<size_t>(i) * Dv];
    for (int d = 0; d < Dv; ++d) out[d] = o[d] * inv[i];  // a row that sees nothing: zeros, never NaN
  }
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([inputs, out, scale = scale_, causal = causal_, has_mask = has_mask_, has_shared = has_shared_,
                has_shared_mask = has_shared_mask_, has_table = has_table_]() mutable {
    const mx::array& q = inputs[0];  // (B, H, L, D)
    const mx::array& k = inputs[1];  // (B, KH, T, D)
    const mx::array& v = inputs[2];  // (B, KH, T, Dv)
    size_t next = 3;
    const mx::array* mask = has_mask ? &inputs[next++] : nullptr;  // bool, broadcastable to (B, 1, L, T)
    const mx::array* sk = has_shared ? &inputs[next++] : nullptr;  // (1, KH, P, D)
    const mx::array* sv = has_shared ? &inputs[next++] : nullptr;  // (1, KH, P, Dv)
    const mx::array* smask = has_shared_mask ? &inputs[next++] : nullptr;  // bool, B elements
    const mx::array* table = has_table ? &inputs[next++] : nullptr;  // int32 (B, T): k, v are (1, KH, slots, D)

    AttnArgs a;
    a.H = q.shape(1), a.L = q.shape(2), a.D = q.shape(3), a.KH = k.shape(1), a.Dv = v.shape(3);
    a.T = table ? table->shape(1) : k.shape(2);
    std::vector<int32_t> tbuf;
    a.table = table ? dense<int32_t>(*table, tbuf) : nullptr;
    a.causal = causal;
    const int B = q.shape(0);
    Rows kr = rows_of(k), vr = rows_of(v), skr, svr;
    std::vector<float> qbuf;
    std::vector<uint8_t> smbuf;
    a.q = dense<float>(q, qbuf);
    a.k = kr.data, a.ks0 = kr.strides[0], a.ks1 = kr.strides[1], a.ks2 = kr.strides[2];
    a.v = vr.data, a.vs0 = vr.strides[0], a.vs1 = vr.strides[1], a.vs2 = vr.strides[2];
    if (sk) {
      skr = rows_of(*sk);
      svr = rows_of(*sv);
      a.sk = skr.data, a.sks1 = skr.strides[1], a.sks2 = skr.strides[2];
      a.sv = svr.data, a.svs1 = svr.strides[1], a.svs2 = svr.strides[2];
      a.P = sk->shape(2);
    }
    if (mask) {  // read through its strides: a size-1 axis broadcasts (stride 0)
      const int nd = mask->ndim();
      a.mask = mask->data<bool>();
      a.ms0 = nd == 4 && mask->shape(0) > 1 ? mask->strides()[0] : 0;
      a.ms2 = nd >= 2 && mask->shape(nd - 2) > 1 ? mask->strides()[nd - 2] : 0;
      a.ms3 = mask->shape(nd - 1) > 1 ? mask->strides()[nd - 1] : 0;
    }
    a.shared_mask = smask ? dense<bool>(*smask, smbuf) : nullptr;
    a.out = out.data<float>();
    a.qscale = scale * 1.4426950408889634f;  // scores in log2 units: exp -> exp2
    // Tasks KV-head-major, then row, then query position: consecutive tasks on a thread read the
    // same shared prefix head and the same row's keys (in cache).
    if (a.D % 8 == 0) {  // blocks of positions (attend_block); `attend` for other head sizes
      const int blocks = (a.L + kQB - 1) / kQB, n = B * a.KH * blocks;
      Pool::get().run(n, [&](int i) {
        const int blk = i % blocks, b = (i / blocks) % B, kh = i / (blocks * B);
        attend_block(a, b, kh, blk * kQB, std::min(a.L, (blk + 1) * kQB));
      });
      return;
    }
    const int L = a.L, tasks = B * a.KH * L;
    auto run = [&](auto nc) {
      Pool::get().run(tasks, [&](int i) { attend<decltype(nc)::value>(a, (i / L) % B, i / (L * B), i % L); });
    };
    if (a.Dv == 64) {
      run(std::integral_constant<int, 4>());
    } else if (a.Dv == 128) {
      run(std::integral_constant<int, 8>());
    } else {
      run(std::integral_constant<int, 0>());
    }
  });
}

mx::array attention(const mx::array& queries, const mx::array& keys, const mx::array& values, float scale,
                    std::optional<mx::array> mask, bool causal, std::optional<mx::array> shared_keys,
                    std::optional<mx::array> shared_values, std::optional<mx::array> shared_mask,
                    std::optional<mx::array> table) {
  if (queries.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4)
    throw std::invalid_argument("attention: queries, keys and values must be 4-D");
  const int B = queries.shape(0), H = queries.shape(1), L = queries.shape(2);
  const int KH = keys.shape(1), Dv = values.shape(3);
  // Paged KV: keys and values are (1, KH, slots, D) pools read through the (B, T) int32 slot table.
  const int KB = table ? 1 : B;
  if (table && (table->ndim() != 2 || table->shape(0) != B || table->dtype() != mx::int32))
    throw std::invalid_argument("attention: table must be (B, T) int32");
  const int T = table ? table->shape(1) : keys.shape(2);
  if (keys.shape(0) != KB || values.shape(0) != KB || values.shape(1) != KH || values.shape(2) != keys.shape(2) ||
      keys.shape(3) != queries.shape(3) || KH == 0 || H % KH != 0)
    throw std::invalid_argument("attention: inconsistent shapes");
  if (causal && (mask || L > T)) throw std::invalid_argument("attention: causal takes no mask and L <= T");
  for (auto* a : {&queries, &keys, &values}) require_f32(*a, "attention inputs");
  auto stream = mx::default_stream(mx::default_device());
  std::vector<mx::array> inputs = {queries, keys, values};
  if (mask) {
    if (mask->dtype() != mx::bool_) throw std::invalid_argument("attention: mask must be boolean");
    const int nd = mask->ndim();
    if (nd < 1 || nd > 4 || (mask->shape(nd - 1) != T && mask->shape(nd - 1) != 1) ||
        (nd >= 2 && mask->shape(nd - 2) != L && mask->shape(nd - 2) != 1) || (nd >= 3 && mask->shape(nd - 3) != 1) ||
        (nd == 4 && mask->shape(0) != B && mask->shape(0) != 1))
      throw std::invalid_argument("attention: the mask must be the same for every head, (B, 1, L, T)");
    inputs.push_back(*mask);
  }
  bool has_shared = shared_keys.has_value();
  if (has_shared) {
    if (!shared_values) throw std::invalid_argument("attention: shared_values missing");
    const auto& sk = *shared_keys;
    const auto& sv = *shared_values;
    if (sk.ndim() != 4 || sk.shape(0) != 1 || sk.shape(1) != KH || sk.shape(3) != keys.shape(3) ||
        sv.ndim() != 4 || sv.shape(0) != 1 || sv.shape(1) != KH || sv.shape(2) != sk.shape(2) ||
        sv.shape(3) != Dv)
      throw std::invalid_argument("attention: shared prefix shapes");
    require_f32(sk, "attention shared_keys");
    require_f32(sv, "attention shared_values");
    inputs.push_back(sk);
    inputs.push_back(sv);
  }
  bool has_smask = has_shared && shared_mask.has_value();
  if (has_smask) {
    if (shared_mask->dtype() != mx::bool_ || shared_mask->size() != static_cast<size_t>(B))
      throw std::invalid_argument("attention: shared_mask must be (B,) boolean");
    inputs.push_back(*shared_mask);
  }
  if (table) inputs.push_back(*table);
  return mx::array({B, H, L, Dv}, mx::float32,
                   std::make_shared<Attention>(stream, scale, causal, mask.has_value(), has_shared, has_smask,
                                               table.has_value()),
                   std::move(inputs));
}

// ---------------------------------------------------------------------------------------------
// linear: y = x @ w.T (+ bias), x (..., K), w (N, K) as nn.Linear stores it.
//
// OpenBLAS packs both operands on every call; with a decode step's few rows (M = the batch) that
// packing of the weights costs about as much as the multiply, and the weights stream from memory
// once per step anyway (batch-32 decode GEMMs ran at ~180 GFLOP/s of the ~240 a large GEMM reaches
// here; batch 1 read the weights at ~22 GB/s). This kernel reads the weights in place: the output
// columns are split over the pool's threads; each thread takes 6 weight rows at a time (in L1)
// against 4 rows of x at a time (24 vector accumulators of dot products along K, summed across
// lanes at the end by one shuffle network per 16), and prefetches the next 6 weight rows spread
// over the passes of this block. Measured on the 2-core CI machine, the decode step's 211 GEMMs at
// batch 32 went from 48 ms to ~33 ms, at batch 1 from 25 ms to ~14 ms.
//
// Numbers: every output element is the same sum in the same order (16 lanes over K in order, then
// the same lane tree), whatever M is, wherever the row sits in the batch and whichever tile computes
// it: a row's result does not depend on what else is in the batch.

// All M rows against NT rows of w; the prefetch of `pf_bytes` at `pf` is shared out over the row tiles.
template <int NT, typename WT>
static void linear_rows(const float* x, int64_t ldx, const WT* w, int64_t ldw, const float* bias, float* y,
                        int64_t ldy, int K, int M, const char* pf, int64_t pf_bytes) {
  const int tiles = (M + kLinearMT - 1) / kLinearMT;
  const int lines = static_cast<int>(pf_bytes / 64), per = (lines + tiles - 1) / tiles;
  auto share = [&](int t, int& n) {
    const int a = std::min(lines, t * per);
    n = std::min(lines, a + per) - a;
    return pf + 64 * static_cast<int64_t>(a);
  };
  auto wrow = [w, ldw](int j) { return w + j * ldw; };
  int m = 0, t = 0, n = 0;
  for (; m + kLinearMT <= M; m += kLinearMT, ++t) {
    const char* p = share(t, n);
    linear_tile<kLinearMT, NT>(x + m * ldx, ldx, wrow, bias, y + m * ldy, ldy, K, p, n);
  }
  const char* p = share(t, n);
  switch (M - m) {
    case 3: linear_tile<std::min(3, kLinearMT), NT>(x + m * ldx, ldx, wrow, bias, y + m * ldy, ldy, K, p, n); break;
    case 2: linear_tile<std::min(2, kLinearMT), NT>(x + m * ldx, ldx, wrow, bias, y + m * ldy, ldy, K, p, n); break;
    case 1: linear_tile<1, NT>(x + m * ldx, ldx, wrow, bias, y + m * ldy, ldy, K, p, n); break;
    default: break;
  }
}

// Output columns [n0, n1) for rows [m0, m1).
template <typename WT>
static void linear_block(const float* x, const WT* w, const float* bias, float* y, int K, int N, int m0,
                         int m1, int n0, int n1) {
  const int M = m1 - m0;
  const float* xb = x + static_cast<int64_t>(m0) * K;
  float* yb = y + static_cast<int64_t>(m0) * N;
  constexpr int NT = kLinearNT;
  for (int n = n0; n < n1; n += NT) {
    const WT* wn = w + static_cast<int64_t>(n) * K;
    const float* bn = bias ? bias + n : nullptr;
    // The weights stream from memory once per step: the next NT rows are fetched while these work.
    const int ahead = n + NT;
    const char* pf = reinterpret_cast<const char*>(w + static_cast<int64_t>(ahead) * K);
    const int64_t pf_bytes = ahead < n1 ? static_cast<int64_t>(std::min(NT, n1 - ahead)) * K * sizeof(WT) : 0;
    switch (std::min(NT, n1 - n)) {
      case 6: linear_rows<std::min(6, NT)>(xb, K, wn, K, bn, yb + n, N, K, M, pf, pf_bytes); break;
      case 5: linear_rows<std::min(5, NT)>(xb, K, wn, K, bn, yb + n, N, K, M, pf, pf_bytes); break;
      case 4: linear_rows<std::min(4, NT)>(xb, K, wn, K, bn, yb + n, N, K, M, pf, pf_bytes); break;
      case 3: linear_rows<std::min(3, NT)>(xb, K, wn, K, bn, yb + n, N, K, M, pf, pf_bytes); break;
      case 2: linear_rows<2>(xb, K, wn, K, bn, yb + n, N, K, M, pf, pf_bytes); break;
      default: linear_rows<1>(xb, K, wn, K, bn, yb + n, N, K, M, pf, pf_bytes); break;
    }
  }
}

// What the linear primitives (Linear, LinearBf16Packed, GemmSplit) share: x (..., K) @ w (N, K).T (+ bias) with
// the output allocated and the encoder told what is read and written; x and the bias made dense on the
// stream's thread before the primitive's own `compute` (a static function: the dispatched task must not
// hold the primitive); two nodes equivalent when both have a bias or neither; no GPU version.
class LinearPrimitive : public mx::UnaryPrimitive {
 public:
  using Compute = void (*)(const float* x, const mx::array& w, const float* bias, float* y, int M, int K, int N);
  LinearPrimitive(mx::Stream stream, bool has_bias) : mx::UnaryPrimitive(stream), has_bias_(has_bias) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    const auto [K, N] = dims(inputs);
    const int M = K > 0 ? static_cast<int>(inputs[0].size() / K) : static_cast<int>(out.size() / std::max(N, 1));
    enc.dispatch([xa = inputs[0], wa = inputs[1], ba = has_bias_ ? inputs[2] : inputs[1], has_bias = has_bias_,
                  y = out.data<float>(), M, K, N, compute = compute_fn()]() {
      if (M == 0 || N == 0) return;
      std::vector<float> xbuf, bbuf;
      const float* x = dense<float>(xa, xbuf);
      const float* b = has_bias ? dense<float>(ba, bbuf) : nullptr;
      compute(x, wa, b, y, M, K, N);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string(name()) + " is a CPU kernel");
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return has_bias_ == static_cast<const LinearPrimitive&>(other).has_bias_;
  }

 protected:
  virtual Compute compute_fn() const = 0;
  // (K, N): the weight's (N, K) shape; a packed weight (LinearBf16Packed) knows them instead.
  virtual std::pair<int, int> dims(const std::vector<mx::array>& inputs) const {
    return {inputs[1].shape(1), inputs[1].shape(0)};
  }
  bool has_bias_;
};

class Linear : public LinearPrimitive {
 public:
  using LinearPrimitive::LinearPrimitive;
  static void compute(const float* x, const mx::array& wa, const float* b, float* y, int M, int K, int N) {
    if (wa.dtype() == mx::bfloat16) {
      std::vector<uint16_t> wbuf;
      run(x, dense<uint16_t>(wa, wbuf), b, y, M, K, N);
    } else {
      std::vector<float> wbuf;
      run(x, dense<float>(wa, wbuf), b, y, M, K, N);
    }
  }
  template <typename WT>
  static void run(const float* x, const WT* w, const float* b, float* y, int M, int K, int N) {
      // Rows in blocks of 64 (x's block stays in L2 while the weights stream past it), columns in
      // multiples of the tile's 6 rows of w, about 8 column blocks per thread for balance.
      constexpr int MB = 64;
      const int mblocks = (M + MB - 1) / MB;
      const int want = std::max(1, Pool::get().size() * 8 / mblocks);
      const int nb = std::max(kLinearNT, ((N + want - 1) / want + kLinearNT - 1) / kLinearNT * kLinearNT);
      const int nblocks = (N + nb - 1) / nb;
      Pool::get().run(mblocks * nblocks, [&](int t) {
        const int mi = t / nblocks, ni = t % nblocks;
        linear_block(x, w, b, y, K, N, mi * MB, std::min(M, (mi + 1) * MB), ni * nb, std::min(N, (ni + 1) * nb));
      });
  }
  const char* name() const override { return "ParallmLinear"; }

 protected:
  Compute compute_fn() const override { return &Linear::compute; }
};

// The graph node of primitive P (built with `args` after the stream and the bias flag): inputs x, the
// weight as stored and the bias; the output is x's shape with N last. The checks every linear shares.
template <typename P, typename... Args>
static mx::array linear_graph_node(const std::string& what, const mx::array& x, const mx::array& weight,
                                   std::optional<mx::array> bias, int N, Args... args) {
  require_f32(x, (what + " x").c_str());
  auto stream = mx::default_stream(mx::default_device());
  std::vector<mx::array> inputs = {x, weight};
  if (bias) {
    if (bias->ndim() != 1 || bias->shape(0) != N) throw std::invalid_argument(what + ": bias must be (N,)");
    require_f32(*bias, (what + " bias").c_str());
    inputs.push_back(*bias);
  }
  auto shape = x.shape();
  shape.back() = N;
  return mx::array(shape, mx::float32, std::make_shared<P>(stream, bias.has_value(), args...), std::move(inputs));
}

// x (..., K) @ weight (N, K).T (+ bias (N,)) as primitive P: `linear` and `gemm_split`.
template <typename P>
static mx::array linear_node(const char* name, const mx::array& x, const mx::array& weight,
                             std::optional<mx::array> bias) {
  const std::string what(name);
  if (x.ndim() < 1 || weight.ndim() != 2) throw std::invalid_argument(what + ": x (..., K) and weight (N, K)");
  const int K = weight.shape(1), N = weight.shape(0);
  if (x.shape(-1) != K) throw std::invalid_argument(what + ": x's last axis must equal weight's second");
  require_f32_or_bf16(weight, (what + " weight").c_str());
  return linear_graph_node<P>(what, x, weight, bias, N);
}

mx::array linear(const mx::array& x, const mx::array& weight, std::optional<mx::array> bias) {
  return linear_node<Linear>("linear", x, weight, bias);
}

// ---------------------------------------------------------------------------------------------
// linear_bf16_packed: y = bf16(x) @ w.T (+ bias) for bfloat16 weights, with AVX512_BF16's vdpbf16ps.
//
// `linear` widens bfloat16 weights to float32 and keeps float32 FMAs (16 multiply-adds per
// instruction); vdpbf16ps multiplies pairs of bfloat16 values into float32 sums, 32 multiply-adds per
// instruction, but both operands are bfloat16: x is rounded to bfloat16 (nearest even) once per call.
// That rounding is the accuracy cost (an input rounded to 8 bits of mantissa, as in every bf16 GEMM
// of oneDNN / transformers' bf16 CPU path); the products are exact and accumulate in float32. Used for
// every row count, the prefill's too (one kernel, no BLAS). Built only where the compiler targets
// AVX512_BF16 (`has_bf16_dot`); elsewhere weights_dtype runs the same math in MLX ops.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBf16Dot = true;

// x (M x K float32) rounded to bfloat16, each row zero-padded to Kp (a multiple of 32).
static void to_bf16_rows(const float* x, int M, int K, int Kp, uint16_t* out) {
  for (int m = 0; m < M; ++m) {
    const float* src = x + static_cast<int64_t>(m) * K;
    uint16_t* dst = out + static_cast<int64_t>(m) * Kp;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
      _mm512_storeu_si512(dst + k, reinterpret_cast<const __m512i&>(v));
    }
    if (k < Kp) {
      const int r = K - k;  // 0 < r < 32 (Kp - K zero columns follow)
      const __mmask16 lo = r >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << r) - 1);
      const __mmask16 hi = r > 16 ? static_cast<__mmask16>((1u << (r - 16)) - 1) : 0;
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + k + 16), _mm512_maskz_loadu_ps(lo, src + k));
      _mm512_storeu_si512(dst + k, reinterpret_cast<const __m512i&>(v));
    }
  }
}

// The weights are packed once (weights_dtype.pack_panels) into 64-column panels: element [p][q][c][j] =
// w[64p + c][2q + j] (zero past N and K), so one 512-bit load holds 16 columns' values for one pair of
// k. The microkernel is broadcast form: each row's pair (x[2q], x[2q + 1]) is broadcast to all lanes and
// `vdpbf16ps` adds it times 16 columns into 16 float32 sums, 6 rows x 64 columns (24 accumulators) at a
// time. No lane reduction at the end (a dot-form kernel on the unpacked weight, measured 1.3-1.5x
// slower at decode sizes, spent a share of every tile reducing 16 lanes to one), and each output is one
// sum over k in order whatever M is: a row's bits do not depend on its batch.
template <int MR>
static inline void bf16p_tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int Kq, const float* bias,
                              float* y, int64_t ldy, int ncols) {
  __m512 acc[MR][4];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int q = 0; q < Kq; ++q) {
    const uint16_t* wq = panel + static_cast<int64_t>(q) * 128;
    __m512bh wv[4];
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wq + 32 * j);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * q, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int left = ncols - 16 * j;
    if (left <= 0) break;
    const __mmask16 m = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy + 16 * j, m, _mm512_add_ps(acc[i][j], b));
  }
}

class LinearBf16Packed : public LinearPrimitive {
 public:
  LinearBf16Packed(mx::Stream stream, bool has_bias, int k, int n) : LinearPrimitive(stream, has_bias), k_(k), n_(n) {}
  static void compute(const float* x, const mx::array& wa, const float* b, float* y, int M, int K, int N) {
    std::vector<uint16_t> wbuf;
    const uint16_t* w = dense<uint16_t>(wa, wbuf);
    const int Kq = (K + 1) / 2, P = (N + 63) / 64;
    const int Kp = (K + 31) / 32 * 32;  // to_bf16_rows pads rows to 32 (zeros: the odd K's last pair)
    std::vector<uint16_t> xb(static_cast<size_t>(M) * Kp);
    to_bf16_rows(x, M, K, Kp, xb.data());
    // Tasks: one panel x a block of rows, about 4 per thread (a few panels at decode sizes: the rows
    // are split too); each task runs its rows 6 at a time over the whole panel (in L2).
    constexpr int MR = 6;
    const int threads = Pool::get().size();
    const int mtiles = (M + MR - 1) / MR;
    const int mblocks = std::min(mtiles, std::max((4 * threads + P - 1) / P, (M + 95) / 96));
    const int mb = (mtiles + mblocks - 1) / mblocks * MR;
    const int nblk = (M + mb - 1) / mb;
    Pool::get().run(P * nblk, [&](int t) {
      const int p = t / nblk, m0 = (t % nblk) * mb, m1 = std::min(M, m0 + mb);
      const uint16_t* panel = w + static_cast<int64_t>(p) * Kq * 128;
      const int ncols = std::min(64, N - 64 * p);
      const float* bp = b ? b + 64 * p : nullptr;
      for (int m = m0; m < m1; m += MR) {
        const uint16_t* xm = xb.data() + static_cast<int64_t>(m) * Kp;
        float* ym = y + static_cast<int64_t>(m) * N + 64 * p;
        switch (std::min(MR, m1 - m)) {
          case 6: bf16p_tile<6>(xm, Kp, panel, Kq, bp, ym, N, ncols); break;
          case 5: bf16p_tile<5>(xm, Kp, panel, Kq, bp, ym, N, ncols); break;
          case 4: bf16p_tile<4>(xm, Kp, panel, Kq, bp, ym, N, ncols); break;
          case 3: bf16p_tile<3>(xm, Kp, panel, Kq, bp, ym, N, ncols); break;
          case 2: bf16p_tile<2>(xm, Kp, panel, Kq, bp, ym, N, ncols); break;
          default: bf16p_tile<1>(xm, Kp, panel, Kq, bp, ym, N, ncols); break;
        }
      }
    });
  }
  const char* name() const override { return "ParallmLinearBf16Packed"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const LinearBf16Packed&>(other);
    return LinearPrimitive::is_equivalent(other) && k_ == o.k_ && n_ == o.n_;
  }

 protected:
  Compute compute_fn() const override { return &LinearBf16Packed::compute; }
  std::pair<int, int> dims(const std::vector<mx::array>&) const override { return {k_, n_}; }
  int k_, n_;
};

// x (..., K) against a weight of (N, K) packed as (ceil(N / 64), ceil(K / 2), 64, 2) bfloat16 panels.
mx::array linear_bf16_packed(const mx::array& x, const mx::array& packed, int n, std::optional<mx::array> bias) {
  const int K = x.ndim() ? x.shape(-1) : 0;
  if (packed.dtype() != mx::bfloat16 || packed.ndim() != 4 || packed.shape(0) != (n + 63) / 64 ||
      packed.shape(1) != (K + 1) / 2 || packed.shape(2) != 64 || packed.shape(3) != 2)
    throw std::invalid_argument("linear_bf16_packed: packed must be (ceil(N/64), ceil(K/2), 64, 2) bfloat16");
  return linear_graph_node<LinearBf16Packed>("linear_bf16_packed", x, packed, bias, n, K, n);
}
#else
constexpr bool kBf16Dot = false;

mx::array linear_bf16_packed(const mx::array&, const mx::array&, int, std::optional<mx::array>) {
  throw std::runtime_error("linear_bf16_packed: these kernels were not built for AVX512_BF16 (see has_bf16_dot)");
}
#endif

// ---------------------------------------------------------------------------------------------
// gemm_split: y = x @ w.T (+ bias) for a prefill's many rows, on every core.
//
// Each decode lane calls the BLAS from its own thread, so MKL runs single-threaded (backend.py): a
// prefill chunk, which runs on one lane, left the other core idle (the 135M model prefilled ~150
// tokens/s on the 2-core CI machine). Here the output columns are split over the pool's threads,
// each calling the process's single-threaded cblas_sgemm (found at run time: the BLAS MLX itself
// calls) on its share. Every output element is computed by one sgemm over all of K.

using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);

static SgemmFn find_sgemm() {
  static SgemmFn fn = reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return fn;
}

class GemmSplit : public LinearPrimitive {
 public:
  using LinearPrimitive::LinearPrimitive;
  static void compute(const float* x, const mx::array& wa, const float* b, float* y, int M, int K, int N) {
    if (K == 0) {  // an empty sum (the BLAS refuses lda = 0): the bias, or zeros
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) y[static_cast<int64_t>(m) * N + n] = b ? b[n] : 0.0f;
      return;
    }
    std::vector<float> wbuf;
    std::vector<uint16_t> wbuf16;
    const bool bf16 = wa.dtype() == mx::bfloat16;
    const float* w = bf16 ? nullptr : dense<float>(wa, wbuf);
    const uint16_t* w16 = bf16 ? dense<uint16_t>(wa, wbuf16) : nullptr;
    const SgemmFn sgemm = find_sgemm();
    const int parts = std::max(1, std::min(Pool::get().size(), N / 64));
    const int nb = (N / parts + 15) / 16 * 16;
    Pool::get().run(parts, [&](int t) {
      const int n0 = t * nb, n1 = t + 1 == parts ? N : std::min(N, (t + 1) * nb);
      if (n1 <= n0) return;
      if (bf16) {
        // bfloat16 weights: widened to float32 a block of rows at a time into a scratch buffer that
        // stays in cache while the sgemm reads it.
        constexpr int kBlock = 256;
        std::vector<float> scratch(static_cast<size_t>(std::min(kBlock, n1 - n0)) * K);
        for (int c0 = n0; c0 < n1; c0 += kBlock) {
          const int c1 = std::min(n1, c0 + kBlock);
          const uint16_t* src = w16 + static_cast<int64_t>(c0) * K;
          const int64_t count = static_cast<int64_t>(c1 - c0) * K;
#pragma omp simd
          for (int64_t i = 0; i < count; ++i) scratch[i] = bf16_to_f32(src[i]);
          sgemm(101, 111, 112, M, c1 - c0, K, 1.0f, x, K, scratch.data(), K, 0.0f, y + c0, N);
        }
      } else {
        // Row-major: y[:, n0:n1] = x (M x K) @ w[n0:n1].T (K x (n1 - n0)).
        sgemm(101 /* RowMajor */, 111 /* NoTrans */, 112 /* Trans */, M, n1 - n0, K, 1.0f, x, K,
              w + static_cast<int64_t>(n0) * K, K, 0.0f, y + n0, N);
      }
      if (b)
        for (int m = 0; m < M; ++m) {
          float* row = y + static_cast<int64_t>(m) * N;
          for (int n = n0; n < n1; ++n) row[n] += b[n];
        }
    });
  }
  const char* name() const override { return "ParallmGemmSplit"; }

 protected:
  Compute compute_fn() const override { return &GemmSplit::compute; }
};

mx::array gemm_split(const mx::array& x, const mx::array& weight, std::optional<mx::array> bias) {
  if (!find_sgemm()) throw std::runtime_error("gemm_split: no cblas_sgemm in this process");
  return linear_node<GemmSplit>("gemm_split", x, weight, bias);
}

// ---------------------------------------------------------------------------------------------
// swiglu: silu(gate) * x = gate / (1 + 2**(-gate * log2 e)) * x

static void swiglu_range(const float* __restrict g, const float* __restrict x, float* __restrict o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + exp2_fast(g[i] * -1.4426950408889634f)) * x[i];
}

class SwiGLU : public mx::UnaryPrimitive {
 public:
  explicit SwiGLU(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(inputs[0]);
    enc.set_input_array(inputs[1]);
    enc.set_output_array(out);
    enc.dispatch([ga = inputs[0], xa = inputs[1], o = out.data<float>(), n = static_cast<int64_t>(out.size())]() {
      std::vector<float> gbuf, xbuf;
      const float* g = dense<float>(ga, gbuf);
      const float* x = dense<float>(xa, xbuf);
      const int64_t chunk = 1 << 14;
      const int tasks = static_cast<int>((n + chunk - 1) / chunk);
      Pool::get().run(tasks, [&](int t) {
        const int64_t a = t * chunk;
        swiglu_range(g + a, x + a, o + a, std::min(chunk, n - a));
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("parallm swiglu is a CPU kernel");
  }
  const char* name() const override { return "ParallmSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.shape() != x.shape()) throw std::invalid_argument("swiglu: gate and x shapes differ");
  require_f32(gate, "swiglu gate");
  require_f32(x, "swiglu x");
  auto stream = mx::default_stream(mx::default_device());
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(stream),
                   {gate, x});
}

// ---------------------------------------------------------------------------------------------
// rope_rows: x (B, H, L, D), position offsets (B,) int32, cos/sin tables (max_positions, dims/2):
// rotate the first `dims` features of row b, position l by position offsets[b] + l (split halves, or
// interleaved pairs when traditional), copy the rest. Decode (L = 1) and speculative verification's
// few positions per row alike. Products and sums are rounded one by one (no FMA contraction), as the
// MLX ops of cpu_kernels.RoPETable round them: the same bits as the table's prefill path.

__attribute__((optimize("fp-contract=off"))) static void rope_head(const float* xi, float* oi, const float* c,
                                                                 const float* s, int half, int dims, int D,
                                                                 bool traditional) {
  if (traditional) {
    for (int i = 0; i < half; ++i) {
      float x1 = xi[2 * i], x2 = xi[2 * i + 1];
      oi[2 * i] = x1 * c[i] - x2 * s[i];
      oi[2 * i + 1] = x1 * s[i] + x2 * c[i];
    }
  } else {
#pragma omp simd
    for (int i = 0; i < half; ++i) {
      float x1 = xi[i], x2 = xi[i + half];
      oi[i] = x1 * c[i] - x2 * s[i];
      oi[i + half] = x1 * s[i] + x2 * c[i];
    }
  }
  for (int d = dims; d < D; ++d) oi[d] = xi[d];
}

class RoPERows : public mx::UnaryPrimitive {
 public:
  RoPERows(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([xa = inputs[0], pa = inputs[1], ca = inputs[2], sa = inputs[3], o = out.data<float>(),
                  B = out.shape(0), H = out.shape(1), L = out.shape(2), D = out.shape(3), maxp = inputs[2].shape(0),
                  dims = dims_, traditional = traditional_, base = base_, scale = scale_]() {
      std::vector<float> xbuf, cbuf_all, sbuf_all;
      std::vector<int32_t> pbuf;
      const float* x = dense<float>(xa, xbuf);
      const int32_t* pos = dense<int32_t>(pa, pbuf);
      const float* cs = dense<float>(ca, cbuf_all);
      const float* sn = dense<float>(sa, sbuf_all);
      const int half = dims / 2;
      std::vector<float> cbuf(half), sbuf(half);
      for (int b = 0; b < B; ++b) {
        for (int l = 0; l < L; ++l) {
          const int p = pos[b] + l;
          const float* c = cs + static_cast<int64_t>(p) * half;
          const float* s = sn + static_cast<int64_t>(p) * half;
          if (p < 0 || p >= maxp) {  // past the table (it covers the context window): compute directly
            for (int i = 0; i < half; ++i) {
              double angle = p * static_cast<double>(scale) * std::pow(static_cast<double>(base), -2.0 * i / dims);
              cbuf[i] = static_cast<float>(std::cos(angle));
              sbuf[i] = static_cast<float>(std::sin(angle));
            }
            c = cbuf.data();
            s = sbuf.data();
          }
          for (int h = 0; h < H; ++h) {
            const int64_t row = (static_cast<int64_t>(b) * H + h) * L + l;
            rope_head(x + row * D, o + row * D, c, s, half, dims, D, traditional);
          }
        }
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("parallm rope_rows is a CPU kernel");
  }
  const char* name() const override { return "ParallmRoPERows"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RoPERows&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
};

mx::array rope_rows(const mx::array& x, const mx::array& positions, const mx::array& cos_table,
                    const mx::array& sin_table, int dims, bool traditional, float base, float scale) {
  if (x.ndim() != 4) throw std::invalid_argument("rope_rows: x must be (B, H, L, D)");
  if (dims <= 0 || dims % 2 || dims > x.shape(3)) throw std::invalid_argument("rope_rows: bad dims");
  if (cos_table.ndim() != 2 || cos_table.shape(1) != dims / 2 || sin_table.shape() != cos_table.shape())
    throw std::invalid_argument("rope_rows: tables must be (max_positions, dims / 2)");
  require_f32(x, "rope_rows x");
  auto stream = mx::default_stream(mx::default_device());
  const int B = x.shape(0);
  // Positions: (B,) int32 as the batch cache keeps them goes in as it is (no extra graph nodes).
  mx::array pos = positions;
  if (pos.dtype() != mx::int32) pos = mx::astype(pos, mx::int32, stream);
  if (pos.ndim() != 1 || pos.shape(0) != B) {
    if (pos.size() != 1 && pos.size() != static_cast<size_t>(B))
      throw std::invalid_argument("rope_rows: positions must be one per row (or one for all)");
    pos = mx::broadcast_to(mx::reshape(pos, {-1}, stream), {B}, stream);
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RoPERows>(stream, dims, traditional, base, scale),
                   {x, pos, as_f32(cos_table, stream), as_f32(sin_table, stream)});
}

// ---------------------------------------------------------------------------------------------
// rms_norm: y = x / sqrt(mean(x**2) + eps) * weight over the last axis (nn.RMSNorm): one graph node
// where MLX's CPU fallback for mx.fast.rms_norm builds eight.

static void rms_norm_rows(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t rows,
                          int D, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    if (w) {
#pragma omp simd
      for (int i = 0; i < D; ++i) yr[i] = xr[i] * inv * w[i];
    } else {
#pragma omp simd
      for (int i = 0; i < D; ++i) yr[i] = xr[i] * inv;
    }
  }
}

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps, bool has_weight)
      : mx::UnaryPrimitive(stream), eps_(eps), has_weight_(has_weight) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([xa = inputs[0], wa = has_weight_ ? inputs[1] : inputs[0], has_weight = has_weight_,
                  y = out.data<float>(), eps = eps_]() {
      const int D = xa.shape(-1);
      if (D == 0 || xa.size() == 0) return;
      const int64_t rows = static_cast<int64_t>(xa.size()) / D;
      std::vector<float> xbuf, wbuf;
      const float* x = dense<float>(xa, xbuf);
      const float* w = has_weight ? dense<float>(wa, wbuf) : nullptr;
      const int64_t chunk = std::max<int64_t>(1, (1 << 16) / D);  // rows per task: small batches stay on one thread
      const int tasks = static_cast<int>((rows + chunk - 1) / chunk);
      Pool::get().run(tasks, [&](int t) {
        const int64_t r0 = t * chunk;
        rms_norm_rows(x + r0 * D, w, y + r0 * D, std::min(chunk, rows - r0), D, eps);
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("parallm rms_norm is a CPU kernel");
  }
  const char* name() const override { return "ParallmRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RMSNorm&>(other);
    return eps_ == o.eps_ && has_weight_ == o.has_weight_;
  }

 private:
  float eps_;
  bool has_weight_;
};

mx::array rms_norm(const mx::array& x, std::optional<mx::array> weight, float eps) {
  if (x.ndim() < 1) throw std::invalid_argument("rms_norm: x must have at least one axis");
  require_f32(x, "rms_norm x");
  std::vector<mx::array> inputs = {x};
  if (weight) {
    if (weight->ndim() != 1 || weight->shape(0) != x.shape(-1))
      throw std::invalid_argument("rms_norm: weight must be (D,) for x (..., D)");
    require_f32(*weight, "rms_norm weight");
    inputs.push_back(*weight);
  }
  auto stream = mx::default_stream(mx::default_device());
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(stream, eps, weight.has_value()),
                   std::move(inputs));
}

// ---------------------------------------------------------------------------------------------
// paged_write: a decode lane's page pool (kv_pages) with this step's new keys (or values) written at
// their slots. MLX's own scatter computes every element's index separately (a visible share of a
// decode step at batch 32); this copies each (row, position, head) as one run of D floats, and
// transposes on the way (the pool is head-major, the model's keys (B, KH, n, D)). The pool's buffer is
// reused when nothing else holds it (the usual case: the lane's layer held the only reference).

class PagedWrite : public mx::UnaryPrimitive {
 public:
  explicit PagedWrite(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& pool = inputs[0];  // (KH, S, D)
    if (pool.is_donatable() && pool.flags().row_contiguous) {
      out.copy_shared_buffer(pool);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    const bool copy_pool = out.data<float>() != pool.data<float>();
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([pool, rows = inputs[1], slots = inputs[2], y = out.data<float>(), copy_pool]() {
      const int64_t KH = pool.shape(0), S = pool.shape(1), D = pool.shape(2);
      if (copy_pool) {
        std::vector<float> buf;
        const float* src = dense<float>(pool, buf);
        std::memcpy(y, src, pool.nbytes());
      }
      const int B = rows.shape(0), n = rows.shape(2);
      Rows r = rows_of(rows);
      std::vector<int32_t> sbuf;
      const int32_t* slot = dense<int32_t>(slots, sbuf);
      for (int b = 0; b < B; ++b)
        for (int j = 0; j < n; ++j) {
          const int64_t s = slot[static_cast<int64_t>(b) * n + j];
          if (s < 0 || s >= S) continue;  // never: kv_pages sizes the pool before writing (guards memory)
          for (int64_t kh = 0; kh < KH; ++kh)
            std::memcpy(y + (kh * S + s) * D, r.data + b * r.strides[0] + kh * r.strides[1] + j * r.strides[2],
                        D * sizeof(float));
        }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("parallm paged_write is a CPU kernel");
  }
  const char* name() const override { return "ParallmPagedWrite"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array paged_write(const mx::array& pool, const mx::array& rows, const mx::array& slots) {
  if (pool.ndim() != 3 || rows.ndim() != 4 || rows.shape(1) != pool.shape(0) || rows.shape(3) != pool.shape(2))
    throw std::invalid_argument("paged_write: pool (KH, S, D) and rows (B, KH, n, D)");
  if (slots.dtype() != mx::int32 || slots.size() != static_cast<size_t>(rows.shape(0)) * rows.shape(2))
    throw std::invalid_argument("paged_write: slots must be B * n int32");
  require_f32(pool, "paged_write pool");
  require_f32(rows, "paged_write rows");
  auto stream = mx::default_stream(mx::default_device());
  return mx::array(pool.shape(), mx::float32, std::make_shared<PagedWrite>(stream), {pool, rows, slots});
}

}  // namespace parallm

NB_MODULE(_parallm_native, m) {
  m.doc() = "ParaLLM's native CPU kernels (MLX primitives)";
  m.def("attention", &parallm::attention, nb::arg("queries"), nb::arg("keys"), nb::arg("values"),
        nb::arg("scale"), nb::arg("mask") = nb::none(), nb::arg("causal") = false, nb::arg("shared_keys") = nb::none(),
        nb::arg("shared_values") = nb::none(), nb::arg("shared_mask") = nb::none(), nb::arg("table") = nb::none());
  m.def("linear", &parallm::linear, nb::arg("x"), nb::arg("weight"), nb::arg("bias") = nb::none());
  m.def("gemm_split", &parallm::gemm_split, nb::arg("x"), nb::arg("weight"), nb::arg("bias") = nb::none());
  m.def("has_sgemm", [] { return parallm::find_sgemm() != nullptr; });
  m.def("linear_bf16_packed", &parallm::linear_bf16_packed, nb::arg("x"), nb::arg("packed"), nb::arg("n"),
        nb::arg("bias") = nb::none());
  m.def("has_bf16_dot", [] { return parallm::kBf16Dot; });
  m.def("paged_write", &parallm::paged_write, nb::arg("pool"), nb::arg("rows"), nb::arg("slots"));
  m.def("rms_norm", &parallm::rms_norm, nb::arg("x"), nb::arg("weight") = nb::none(), nb::arg("eps"));
  m.def("swiglu", &parallm::swiglu, nb::arg("gate"), nb::arg("x"));
  m.def("rope_rows", &parallm::rope_rows, nb::arg("x"), nb::arg("positions"), nb::arg("cos_table"),
        nb::arg("sin_table"), nb::arg("dims"), nb::arg("traditional"), nb::arg("base"), nb::arg("scale"));
  m.def("wide_vectors", [] { return parallm::kWideVectors; });
  m.def("linear_lanes", [] { return parallm::kLinearLanes; });
  m.def("threads", [] { return parallm::Pool::get().size(); });
}
