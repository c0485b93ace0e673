// ParaLLM's native CPU kernels: MLX primitives for the decode step's elementwise-heavy parts.
//
// MLX's CPU backend runs its elementwise kernels one scalar at a time (exp ~10 ns per element on
// x86 Linux) and a batched matmul as one BLAS call per batch entry (96 tiny sgemm calls per layer
// for a batch-32 decode's attention). These primitives do the same math in one fused, vectorised
// pass (built with -march=native on the user's machine, see native/__init__.py):
//
//   decode_attention  softmax attention for one query position per row (decode), GQA, an optional
//                     boolean mask, and an optional prefix held once for the batch (cascade
//                     attention, kv_cache.SharedPrefix); work split over (row, KV head) pairs on
//                     a small thread pool.
//   swiglu            silu(gate) * x.
//   rope_rows         rotary embedding of one position per row from a cos/sin table.
//
// Numbers: every (row, KV head) is computed alone, from its unmasked keys in order (masked columns
// are skipped, not added as zeros), so a row's result does not depend on its left padding, on what
// else is in the batch, or on whether its prefix is held once or in the row: the scheduler's
// "batched greedy == sequential greedy" holds bitwise for the attention.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
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

static inline float dot(const float* a, const float* b, int n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

static inline void axpy(float a, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// ---------------------------------------------------------------------------------------------
// A small persistent thread pool: run(n, f) calls f(i) for i in [0, n) on the calling thread and
// the workers, and returns when all are done. One job at a time (MLX evaluates a stream's ops in
// order on one thread; a lock serialises streams that reach here together).

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
    {
      std::lock_guard<std::mutex> lk(m_);
      job_ = &f;
      n_ = n;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [&] { return active_ == 0; });
    job_ = nullptr;
  }

 private:
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
      stop_ = true;
      ++generation_;
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
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lk(m_);
      if (--active_ == 0) done_cv_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex job_mutex_, m_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  int n_ = 0;
  std::atomic<int> next_{0};
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// ---------------------------------------------------------------------------------------------
// Helpers for reading evaluated inputs

static void require_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + " must be float32");
}

// Inputs come as lazy views; their strides are known only here, at evaluation. Every kernel reads
// rows whose last axis is contiguous; anything else is copied once into a contiguous buffer.
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
  // Rare (a transposed view): gather element by element.
  size_t n = a.size();
  r.owned.resize(n);
  const float* src = a.data<float>();
  std::vector<int64_t> idx(a.ndim(), 0);
  for (size_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < a.ndim(); ++d) off += idx[d] * a.strides()[d];
    r.owned[i] = src[off];
    for (int d = a.ndim() - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  int64_t s = 1;
  for (int d = a.ndim() - 1; d >= 0; --d) {
    r.strides[d] = s;
    s *= a.shape(d);
  }
  r.data = r.owned.data();
  return r;
}

static mx::array contiguous_f32(const mx::array& a, mx::StreamOrDevice s) {
  return mx::contiguous(mx::astype(a, mx::float32, s), false, s);
}

// ---------------------------------------------------------------------------------------------
// decode_attention

class DecodeAttention : public mx::Primitive {
 public:
  DecodeAttention(mx::Stream stream, float scale, bool has_mask, bool has_shared, bool has_shared_mask)
      : mx::Primitive(stream),
        scale_(scale),
        has_mask_(has_mask),
        has_shared_(has_shared),
        has_shared_mask_(has_shared_mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("parallm decode_attention is a CPU kernel");
  }
  const char* name() const override { return "ParallmDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const DecodeAttention&>(other);
    return scale_ == o.scale_ && has_mask_ == o.has_mask_ && has_shared_ == o.has_shared_ &&
        has_shared_mask_ == o.has_shared_mask_;
  }

 private:
  float scale_;
  bool has_mask_, has_shared_, has_shared_mask_;
};

// What one (row, KV head) task reads. Strides in elements; keys/values rows are contiguous in D.
struct AttnArgs {
  const float* q;  // (B, H, D) contiguous
  const float* k;
  const float* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const float* sk = nullptr;  // shared prefix (KH, P, D) rows
  const float* sv = nullptr;
  int64_t sks1 = 0, sks2 = 0, svs1 = 0, svs2 = 0;
  int P = 0;
  const bool* mask = nullptr;  // row b's column t at mask[b * ms0 + t * ms3]
  int64_t ms0 = 0, ms3 = 0;
  const bool* shared_mask = nullptr;  // (B,)
  float* out;  // (B, H, Dv)
  int H, KH, T, D, Dv;
  float qscale;
};

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, unaligned loads allowed

static inline float hsum(v16 x) {
  typedef float v8 __attribute__((vector_size(32), aligned(4)));
  typedef float v4 __attribute__((vector_size(16), aligned(4)));
  v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

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

// One (row b, KV head kh): its `rep` query heads against the prefix (when the row continues it) and
// its unmasked own columns, in column order. NC = D / 16 when D is a multiple of 16 (vector path),
// 0 for any D (scalar path). The rep heads share every key and value load.
template <int NC>
static void attend(const AttnArgs& a, int b, int kh) {
  const int rep = a.H / a.KH, D = a.D, Dv = a.Dv;
  const bool use_prefix = a.sk && (!a.shared_mask || a.shared_mask[b]);
  const int cap = (use_prefix ? a.P : 0) + a.T;
  thread_local std::vector<const float*> krows, vrows;
  thread_local std::vector<float> qbuf, scores;
  krows.resize(cap);
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
    const float* kb = a.k + b * a.ks0 + kh * a.ks1;
    const float* vb = a.v + b * a.vs0 + kh * a.vs1;
    const bool* mrow = a.mask ? a.mask + b * a.ms0 : nullptr;
    for (int t = 0; t < a.T; ++t) {
      if (mrow && !mrow[t * a.ms3]) continue;  // skipped, not added as a zero: padding-invariant sums
      krows[n] = kb + t * a.ks2;
      vrows[n] = vb + t * a.vs2;
      ++n;
    }
  }
  float* out = a.out + (static_cast<int64_t>(b) * a.H + kh * rep) * Dv;
  if (n == 0) {  // nothing to attend to (a fully masked row): zeros, never NaN
    std::fill(out, out + static_cast<int64_t>(rep) * Dv, 0.0f);
    return;
  }
  qbuf.resize(static_cast<size_t>(rep) * D);
  scores.resize(static_cast<size_t>(rep) * n);
  const float* qrow = a.q + (static_cast<int64_t>(b) * a.H + kh * rep) * D;
  for (int i = 0; i < rep * D; ++i) qbuf[i] = qrow[i] * a.qscale;

  if constexpr (NC > 0) {
    constexpr int MAXREP = 8;
    for (int r0 = 0; r0 < rep; r0 += MAXREP) {
      const int nr = std::min(MAXREP, rep - r0);
      v16 q[MAXREP][NC];
      for (int r = 0; r < nr; ++r)
        for (int c = 0; c < NC; ++c) std::memcpy(&q[r][c], &qbuf[(r0 + r) * D + c * 16], sizeof(v16));
      for (int i = 0; i < n; ++i) {
        v16 k[NC];
        std::memcpy(k, krows[i], sizeof(k));
        for (int r = 0; r < nr; ++r) {
          v16 s = q[r][0] * k[0];
          for (int c = 1; c < NC; ++c) s += q[r][c] * k[c];
          scores[(r0 + r) * n + i] = hsum(s);
        }
      }
    }
  } else {
    for (int r = 0; r < rep; ++r)
      for (int i = 0; i < n; ++i) scores[r * n + i] = dot(&qbuf[r * D], krows[i], D);
  }
  thread_local std::vector<float> inv;
  inv.resize(rep);
  for (int r = 0; r < rep; ++r) inv[r] = softmax2(&scores[r * n], n);
  if constexpr (NC > 0) {
    if (Dv == 16 * NC) {  // the weighted values summed in registers, each value row loaded once
      constexpr int RV = NC <= 4 ? 4 : 2;
      for (int r0 = 0; r0 < rep; r0 += RV) {
        const int nr = std::min(RV, rep - r0);
        v16 o[RV][NC] = {};
        for (int i = 0; i < n; ++i) {
          v16 vv[NC];
          std::memcpy(vv, vrows[i], sizeof(vv));
          for (int r = 0; r < nr; ++r) {
            const float p = scores[(r0 + r) * n + i];
            for (int c = 0; c < NC; ++c) o[r][c] += p * vv[c];
          }
        }
        for (int r = 0; r < nr; ++r)
          for (int c = 0; c < NC; ++c) {
            v16 y = o[r][c] * inv[r0 + r];
            std::memcpy(out + (r0 + r) * Dv + c * 16, &y, sizeof(y));
          }
      }
      return;
    }
  }
  thread_local std::vector<float> acc;  // any Dv: the weighted values summed in memory
  acc.assign(static_cast<size_t>(rep) * Dv, 0.0f);
  for (int i = 0; i < n; ++i) {
    const float* vr = vrows[i];
    for (int r = 0; r < rep; ++r) axpy(scores[r * n + i], vr, &acc[r * Dv], Dv);
  }
  for (int r = 0; r < rep; ++r)
    for (int d = 0; d < Dv; ++d) out[r * Dv + d] = acc[r * Dv + d] * inv[r];
}

void DecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([inputs, out, scale = scale_, has_mask = has_mask_, has_shared = has_shared_,
                has_shared_mask = has_shared_mask_]() mutable {
    const mx::array& q = inputs[0];  // (B, H, 1, D), contiguous
    const mx::array& k = inputs[1];  // (B, KH, T, D)
    const mx::array& v = inputs[2];  // (B, KH, T, Dv)
    size_t next = 3;
    const mx::array* mask = has_mask ? &inputs[next++] : nullptr;  // bool, (B, 1, 1, T) view
    const mx::array* sk = has_shared ? &inputs[next++] : nullptr;  // (1, KH, P, D)
    const mx::array* sv = has_shared ? &inputs[next++] : nullptr;  // (1, KH, P, Dv)
    const mx::array* smask = has_shared_mask ? &inputs[next++] : nullptr;  // bool (B,), contiguous

    AttnArgs a;
    a.H = q.shape(1), a.D = q.shape(3), a.KH = k.shape(1), a.T = k.shape(2), a.Dv = v.shape(3);
    const int B = q.shape(0);
    Rows kr = rows_of(k), vr = rows_of(v), skr, svr;
    a.q = q.data<float>();
    a.k = kr.data, a.ks0 = kr.strides[0], a.ks1 = kr.strides[1], a.ks2 = kr.strides[2];
    a.v = vr.data, a.vs0 = vr.strides[0], a.vs1 = vr.strides[1], a.vs2 = vr.strides[2];
    if (sk) {
      skr = rows_of(*sk);
      svr = rows_of(*sv);
      a.sk = skr.data, a.sks1 = skr.strides[1], a.sks2 = skr.strides[2];
      a.sv = svr.data, a.svs1 = svr.strides[1], a.svs2 = svr.strides[2];
      a.P = sk->shape(2);
    }
    if (mask) {
      a.mask = mask->data<bool>();
      a.ms0 = mask->strides()[0], a.ms3 = mask->strides()[3];
    }
    a.shared_mask = smask ? smask->data<bool>() : nullptr;
    a.out = out.data<float>();
    a.qscale = scale * 1.4426950408889634f;  // scores in log2 units: exp -> exp2
    // Tasks KV-head-major: consecutive tasks on a thread read the same shared prefix head (in cache).
    if (a.D == 64) {
      Pool::get().run(B * a.KH, [&](int i) { attend<4>(a, i % B, i / B); });
    } else if (a.D == 128) {
      Pool::get().run(B * a.KH, [&](int i) { attend<8>(a, i % B, i / B); });
    } else {
      Pool::get().run(B * a.KH, [&](int i) { attend<0>(a, i % B, i / B); });
    }
  });
}

mx::array decode_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                           float scale, std::optional<mx::array> mask, std::optional<mx::array> shared_keys,
                           std::optional<mx::array> shared_values, std::optional<mx::array> shared_mask) {
  if (queries.ndim() != 4 || keys.ndim() != 4 || values.ndim() != 4)
    throw std::invalid_argument("decode_attention: queries, keys and values must be 4-D");
  const int B = queries.shape(0), H = queries.shape(1), L = queries.shape(2);
  const int KH = keys.shape(1), T = keys.shape(2), Dv = values.shape(3);
  if (L != 1) throw std::invalid_argument("decode_attention: one query position per row");
  if (keys.shape(0) != B || values.shape(0) != B || values.shape(1) != KH || values.shape(2) != T ||
      keys.shape(3) != queries.shape(3) || KH == 0 || H % KH != 0)
    throw std::invalid_argument("decode_attention: inconsistent shapes");
  for (auto* a : {&queries, &keys, &values}) require_f32(*a, "decode_attention inputs");
  auto stream = mx::default_stream(mx::default_device());
  std::vector<mx::array> inputs = {mx::contiguous(queries, false, stream), keys, values};
  if (mask) {
    if (mask->dtype() != mx::bool_) throw std::invalid_argument("decode_attention: mask must be boolean");
    if (mask->ndim() > 4 || (mask->ndim() == 4 && mask->shape(1) != 1))
      throw std::invalid_argument("decode_attention: the mask must be the same for every head, (B, 1, 1, T)");
    inputs.push_back(mx::broadcast_to(*mask, {B, 1, 1, T}, stream));
  }
  bool has_shared = shared_keys.has_value();
  if (has_shared) {
    if (!shared_values) throw std::invalid_argument("decode_attention: shared_values missing");
    const auto& sk = *shared_keys;
    const auto& sv = *shared_values;
    if (sk.ndim() != 4 || sk.shape(0) != 1 || sk.shape(1) != KH || sk.shape(3) != keys.shape(3) ||
        sv.ndim() != 4 || sv.shape(0) != 1 || sv.shape(1) != KH || sv.shape(2) != sk.shape(2) ||
        sv.shape(3) != Dv)
      throw std::invalid_argument("decode_attention: shared prefix shapes");
    require_f32(sk, "decode_attention shared_keys");
    require_f32(sv, "decode_attention shared_values");
    inputs.push_back(sk);
    inputs.push_back(sv);
  }
  bool has_smask = has_shared && shared_mask.has_value();
  if (has_smask) {
    if (shared_mask->dtype() != mx::bool_ || shared_mask->size() != static_cast<size_t>(B))
      throw std::invalid_argument("decode_attention: shared_mask must be (B,) boolean");
    inputs.push_back(mx::contiguous(mx::reshape(*shared_mask, {B}, stream), false, stream));
  }
  return mx::array({B, H, 1, Dv}, mx::float32,
                   std::make_shared<DecodeAttention>(stream, scale, mask.has_value(), has_shared, has_smask),
                   std::move(inputs));
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
    enc.dispatch([g = inputs[0].data<float>(), x = inputs[1].data<float>(), o = out.data<float>(),
                  n = static_cast<int64_t>(out.size())]() {
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
                   {mx::contiguous(gate, false, stream), mx::contiguous(x, false, stream)});
}

// ---------------------------------------------------------------------------------------------
// rope_rows: x (B, H, 1, D), position offsets (B,) int32, cos/sin tables (max_positions, dims/2):
// rotate the first `dims` features of row b by position offsets[b] (split halves, or interleaved
// pairs when traditional), copy the rest.

class RoPERows : public mx::UnaryPrimitive {
 public:
  RoPERows(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([x = inputs[0].data<float>(), pos = inputs[1].data<int32_t>(),
                  cs = inputs[2].data<float>(), sn = inputs[3].data<float>(), o = out.data<float>(),
                  B = out.shape(0), H = out.shape(1), D = out.shape(3), maxp = inputs[2].shape(0),
                  dims = dims_, traditional = traditional_, base = base_, scale = scale_]() {
      const int half = dims / 2;
      std::vector<float> cbuf(half), sbuf(half);
      for (int b = 0; b < B; ++b) {
        int p = pos[b];
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
          const float* xi = x + (static_cast<int64_t>(b) * H + h) * D;
          float* oi = o + (static_cast<int64_t>(b) * H + h) * D;
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
  if (x.ndim() != 4 || x.shape(2) != 1) throw std::invalid_argument("rope_rows: x must be (B, H, 1, D)");
  if (dims <= 0 || dims % 2 || dims > x.shape(3)) throw std::invalid_argument("rope_rows: bad dims");
  if (cos_table.ndim() != 2 || cos_table.shape(1) != dims / 2 || sin_table.shape() != cos_table.shape())
    throw std::invalid_argument("rope_rows: tables must be (max_positions, dims / 2)");
  require_f32(x, "rope_rows x");
  auto stream = mx::default_stream(mx::default_device());
  const int B = x.shape(0);
  auto pos = mx::contiguous(mx::astype(mx::broadcast_to(mx::reshape(positions, {-1}, stream), {B}, stream),
                                       mx::int32, stream),
                            false, stream);
  return mx::array(x.shape(), mx::float32, std::make_shared<RoPERows>(stream, dims, traditional, base, scale),
                   {mx::contiguous(x, false, stream), pos, contiguous_f32(cos_table, stream),
                    contiguous_f32(sin_table, stream)});
}

}  // namespace parallm

NB_MODULE(_parallm_native, m) {
  m.doc() = "ParaLLM's native CPU kernels (MLX primitives)";
  m.def("decode_attention", &parallm::decode_attention, nb::arg("queries"), nb::arg("keys"), nb::arg("values"),
        nb::arg("scale"), nb::arg("mask") = nb::none(), nb::arg("shared_keys") = nb::none(),
        nb::arg("shared_values") = nb::none(), nb::arg("shared_mask") = nb::none());
  m.def("swiglu", &parallm::swiglu, nb::arg("gate"), nb::arg("x"));
  m.def("rope_rows", &parallm::rope_rows, nb::arg("x"), nb::arg("positions"), nb::arg("cos_table"),
        nb::arg("sin_table"), nb::arg("dims"), nb::arg("traditional"), nb::arg("base"), nb::arg("scale"));
  m.def("threads", [] { return parallm::Pool::get().size(); });
}
