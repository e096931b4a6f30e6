// Vector helpers shared by the native kernels (issue 46): the deterministic dot product (an AVX2 + FMA path and a
// portable path performing the same float operations in the same order, bit for bit), bfloat16 widening, and the
// run-time choice between the two paths. Everything is inline, in an anonymous namespace: each kernel source
// compiles its own copy.

#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOE_X86 1
#else
#define MOE_X86 0
#endif

namespace moe_vec {
namespace {

constexpr int kLanes = 8;   // floats per vector
constexpr int kAcc = 4;     // independent accumulators (vectors) per dot product
constexpr int kStep = kLanes * kAcc;

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 8 lanes summed in the tree the AVX2 path uses: ((0+4) + (2+6)) + ((1+5) + (3+7)).
inline float tree8(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// The portable dot product of n elements. Lane l of accumulator a takes elements i + 8a + l of every step of 32;
// the full chunks of 8 past the last full step go to accumulator 0; the accumulators are combined as (0 + 1) +
// (2 + 3) lane by lane, then the 8 lanes by tree8; the last n % 8 elements follow one by one.
template <typename W>
float dot_portable(const W* w, const float* x, int64_t n) {
  float acc[kAcc][kLanes] = {};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep)
    for (int a = 0; a < kAcc; ++a)
      for (int l = 0; l < kLanes; ++l) {
        int64_t e = i + a * kLanes + l;
        acc[a][l] = std::fma(widen(w[e]), x[e], acc[a][l]);
      }
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[0][l] = std::fma(widen(w[i + l]), x[i + l], acc[0][l]);
  float v[kLanes];
  for (int l = 0; l < kLanes; ++l) v[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
  float s = tree8(v);
  for (; i < n; ++i) s = std::fma(widen(w[i]), x[i], s);
  return s;
}

// A float32 tensor's values read as contiguous float32 (row-major over its shape): the tensor's own memory when it is
// float32 and contiguous, else a copy kept here (bfloat16 widened exactly; other dtypes through torch's conversion).
// Spares a decode step the dispatcher's conversion operators around every kernel call.
class FloatIn {
 public:
  explicit FloatIn(const torch::Tensor& t) {
    if (t.scalar_type() == at::kFloat && t.is_contiguous()) {
      ptr_ = t.data_ptr<float>();
    } else if (t.scalar_type() == at::kBFloat16 && t.is_contiguous()) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
      buf_.resize(static_cast<size_t>(t.numel()));
      for (int64_t i = 0; i < t.numel(); ++i) buf_[i] = widen(src[i]);
      ptr_ = buf_.data();
    } else {
      hold_ = t.to(at::kFloat).contiguous();
      ptr_ = hold_.data_ptr<float>();
    }
  }
  const float* get() const { return ptr_; }

 private:
  torch::Tensor hold_;
  std::vector<float> buf_;
  const float* ptr_ = nullptr;
};

// A result computed in float32 and returned in `dtype` (shape `sizes`): float32 results are written in place;
// bfloat16 ones are narrowed here with torch's rounding (to nearest even, c10::BFloat16), bit for bit what
// ``Tensor.to(torch.bfloat16)`` gives; other dtypes through torch's conversion.
class FloatOut {
 public:
  FloatOut(at::IntArrayRef sizes, at::ScalarType dtype) : dtype_(dtype) {
    auto f32 = at::TensorOptions().dtype(at::kFloat);
    if (dtype == at::kFloat) {
      out_ = torch::empty(sizes, f32);
      ptr_ = out_.data_ptr<float>();
    } else {
      scratch_ = torch::empty(sizes, f32);
      ptr_ = scratch_.data_ptr<float>();
    }
  }
  float* get() const { return ptr_; }
  // The result in its dtype; call once, after the computation, with the interpreter lock held.
  torch::Tensor finish() {
    if (dtype_ == at::kFloat) return out_;
    if (dtype_ != at::kBFloat16) return scratch_.to(dtype_);
    out_ = torch::empty(scratch_.sizes(), scratch_.options().dtype(at::kBFloat16));
    at::BFloat16* dst = out_.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < scratch_.numel(); ++i) dst[i] = at::BFloat16(ptr_[i]);
    return out_;
  }

 private:
  at::ScalarType dtype_;
  torch::Tensor out_, scratch_;
  float* ptr_ = nullptr;
};

#if MOE_X86
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 a = _mm_add_ps(lo, hi);                        // (0+4, 1+5, 2+6, 3+7)
  __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));         // ((0+4)+(2+6), (1+5)+(3+7), ...)
  __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 0x55));  // the two halves
  return _mm_cvtss_f32(c);
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }

__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* w) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename W>
__attribute__((target("avx2,fma"))) float dot_avx2(const W* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    a0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load8(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + kLanes <= n; i += kLanes) a0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(x + i), a0);
  float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s = std::fma(widen(w[i]), x[i], s);
  return s;
}

// dot_avx2 of one row w against kTile vectors x[0..kTile) at once: each bf16 chunk of the row is widened once and
// used kTile times (a prefill's tokens of one expert share its rows). Each out[t] is dot_avx2(w, x[t], n) bit for
// bit: the same accumulators, the same float operations in the same order.
constexpr int kTile = 3;

template <typename W>
__attribute__((target("avx2,fma"))) void dot_tile_avx2(const W* w, const float* const* x, int64_t n, float* out) {
  __m256 acc[kTile][kAcc];
  for (int t = 0; t < kTile; ++t)
    for (int a = 0; a < kAcc; ++a) acc[t][a] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
#pragma GCC unroll 4
    for (int a = 0; a < kAcc; ++a) {
      const __m256 wv = load8(w + i + a * kLanes);
#pragma GCC unroll 3
      for (int t = 0; t < kTile; ++t) acc[t][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + i + a * kLanes), acc[t][a]);
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 wv = load8(w + i);
    for (int t = 0; t < kTile; ++t) acc[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + i), acc[t][0]);
  }
  for (int t = 0; t < kTile; ++t) {
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3])));
    for (int64_t j = i; j < n; ++j) s = std::fma(widen(w[j]), x[t][j], s);
    out[t] = s;
  }
}

inline bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

template <typename W>
inline float dot(const W* w, const float* x, int64_t n, bool fast) {
#if MOE_X86
  if (fast) return dot_avx2<W>(w, x, n);
#endif
  (void)fast;
  return dot_portable<W>(w, x, n);
}

// out[t] = dot(w, x[t], n, fast) for t < count: full tiles of kTile vectors through dot_tile_avx2 on the fast
// path (the same results, the row's chunks widened once per tile), the rest one by one.
template <typename W>
inline void dot_many(const W* w, const float* const* x, int64_t count, int64_t n, bool fast, float* out) {
  int64_t t = 0;
#if MOE_X86
  if (fast)
    for (; t + kTile <= count; t += kTile) dot_tile_avx2<W>(w, x + t, n, out + t);
#endif
  for (; t < count; ++t) out[t] = dot(w, x[t], n, fast);
}

inline bool use_fast(bool portable) {
#if MOE_X86
  return !portable && have_avx2();
#else
  (void)portable;
  return false;
#endif
}

// y[i] = fma(a, x[i], y[i]) for i < n: elementwise, so the AVX2 and the portable path agree bit for bit.
template <typename W>
inline void axpy_portable(float a, const W* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, widen(x[i]), y[i]);
}

#if MOE_X86
template <typename W>
__attribute__((target("avx2,fma"))) void axpy_avx2(float a, const W* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = std::fma(a, widen(x[i]), y[i]);
}
#endif

template <typename W>
inline void axpy(float a, const W* x, float* y, int64_t n, bool fast) {
#if MOE_X86
  if (fast) return axpy_avx2<W>(a, x, y, n);
#endif
  (void)fast;
  axpy_portable<W>(a, x, y, n);
}

}  // namespace
}  // namespace moe_vec
