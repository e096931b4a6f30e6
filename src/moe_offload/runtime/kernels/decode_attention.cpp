// Attention of a decode step (issue 46; runtime/decode_attention.py): one query per sequence and head against the
// keys and values cached so far, what scaled_dot_product_attention computes for a query length of 1:
//
//   out[b, 0, h, :] = sum_s p[s] * v[b, g(h), s, :],  p = softmax_s(scale * q[b, h, 0, :] . k[b, g(h), s, :] + mask)
//
// with g(h) = h / (Hq / Hkv) (grouped-query attention: no copy of the key/value heads). q is any float dtype; k and v
// float32 or bfloat16 with contiguous rows (any other strides); mask None, or broadcastable to [B, Hq, 1, S]: bool
// (true: attend) or floating (added to the scores). The arithmetic is float32; the result has q's dtype.
//
// Determinism: each (sequence, head) is computed by one thread in one fixed order (the scores by the dot product of
// vec.h, the maximum, the exponentials and their sum, then the values accumulated position after position), so the
// result does not depend on the thread count, the batch it is in, or the AVX2 or portable path. A row whose every
// position is masked gives zeros.

#include "gil.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

using namespace moe_vec;

namespace {

#if MOE_X86
// dot_avx2(k + s * ks, q, D) for kRowTile consecutive positions at once, bit for bit: each position has its own four
// accumulators and the same float operations in the same order; the positions' independent chains overlap.
constexpr int kRowTile = 4;

template <typename W>
__attribute__((target("avx2,fma"))) void dots_rows_avx2(const W* k, int64_t ks, const float* q, int64_t D,
                                                        float* out) {
  __m256 acc[kRowTile][kAcc];
  for (int r = 0; r < kRowTile; ++r)
    for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kStep <= D; i += kStep) {
#pragma GCC unroll 4
    for (int a = 0; a < kAcc; ++a) {
      const __m256 qv = _mm256_loadu_ps(q + i + a * kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < kRowTile; ++r) acc[r][a] = _mm256_fmadd_ps(load8(k + r * ks + i + a * kLanes), qv, acc[r][a]);
    }
  }
  for (; i + kLanes <= D; i += kLanes) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < kRowTile; ++r) acc[r][0] = _mm256_fmadd_ps(load8(k + r * ks + i), qv, acc[r][0]);
  }
  for (int r = 0; r < kRowTile; ++r) {
    float v = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
    for (int64_t j = i; j < D; ++j) v = std::fma(widen(k[r * ks + j]), q[j], v);
    out[r] = v;
  }
}

// The values' weighted sum of attend for Dv a multiple of 8 up to kMaxVecs vectors: out[d] = fma(p[s], v[s, d],
// out[d]) position after position, as axpy does, with out kept in registers instead of memory.
constexpr int kMaxVecs = 8;

template <typename W>
__attribute__((target("avx2,fma"))) void weighted_values_avx2(const float* p, const W* v, int64_t S, int64_t vs,
                                                               int64_t Dv, float* out) {
  __m256 o[kMaxVecs];
  const int nv = static_cast<int>(Dv / kLanes);
  for (int j = 0; j < kMaxVecs; ++j) o[j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    if (p[s] == 0.0f) continue;
    const __m256 ps = _mm256_set1_ps(p[s]);
    const W* row = v + s * vs;
#pragma GCC unroll 8
    for (int j = 0; j < kMaxVecs; ++j)
      if (j < nv) o[j] = _mm256_fmadd_ps(ps, load8(row + j * kLanes), o[j]);
  }
  for (int j = 0; j < nv; ++j) _mm256_storeu_ps(out + j * kLanes, o[j]);
}
#endif

// The scores scale * k[s] . q, s < S (the dot of vec.h).
template <typename W>
void scores(const float* q, const W* k, int64_t S, int64_t D, int64_t ks, float scale, bool fast, float* p) {
  int64_t s = 0;
#if MOE_X86
  if (fast)
    for (; s + kRowTile <= S; s += kRowTile) dots_rows_avx2<W>(k + s * ks, ks, q, D, p + s);
#endif
  for (; s < S; ++s) p[s] = dot(k + s * ks, q, D, fast);
  for (s = 0; s < S; ++s) p[s] = p[s] * scale;
}

template <typename W>
void attend(const float* q, const W* k, const W* v, const float* madd, const bool* mkeep, int64_t mstride,
            int64_t S, int64_t D, int64_t Dv, int64_t ks, int64_t vs, float scale, bool fast, float* out,
            std::vector<float>& p) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  scores(q, k, S, D, ks, scale, fast, p.data());
  for (int64_t s = 0; s < S; ++s) {
    float sc = p[s];
    if (mkeep && !mkeep[s * mstride]) sc = neg_inf;
    if (madd) sc = sc + madd[s * mstride];
    p[s] = sc;
    top = std::max(top, sc);
  }
  for (int64_t d = 0; d < Dv; ++d) out[d] = 0.0f;
  if (top == neg_inf) return;
  float sum = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    p[s] = std::exp(p[s] - top);
    sum = sum + p[s];
  }
#if MOE_X86
  if (fast && Dv % kLanes == 0 && Dv <= kMaxVecs * kLanes) {
    weighted_values_avx2<W>(p.data(), v, S, vs, Dv, out);
  } else
#endif
  {
    for (int64_t s = 0; s < S; ++s)
      if (p[s] != 0.0f) axpy(p[s], v + s * vs, out, Dv, fast);
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < Dv; ++d) out[d] = out[d] * inv;
}

}  // namespace

// q [B, Hq, 1, D]; k [B, Hkv, S, D]; v [B, Hkv, S, Dv]; mask: see the top of the file; scale: the scores' factor;
// portable: the portable path even where AVX2 is there (tests). Returns [B, 1, Hq, Dv] in q's dtype.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               double scale, bool portable) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1,
              "decode_attention: q [B, Hq, 1, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "decode_attention: k and v float32 or bfloat16, one dtype");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k and v rows must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D && Hkv > 0 &&
                  Hq % Hkv == 0,
              "decode_attention: shapes of q, k and v do not match");
  FloatIn qs(q);
  torch::Tensor m;
  const bool* keep = nullptr;
  const float* add = nullptr;
  if (mask.has_value() && mask->defined()) {
    m = mask->scalar_type() == at::kBool ? *mask : mask->to(at::kFloat);
    m = m.expand({B, Hq, 1, S});
    TORCH_CHECK(m.stride(3) == 1 || S == 1 || m.stride(3) == 0, "decode_attention: mask's last dimension strided");
    if (m.scalar_type() == at::kBool) keep = m.data_ptr<bool>();
    else add = m.data_ptr<float>();
  }
  FloatOut out({B, 1, Hq, Dv}, q.scalar_type());
  const bool fast = use_fast(portable);
  const float sc = static_cast<float>(scale);
  const int64_t group = Hq / Hkv;
  const float* qp = qs.get();
  float* op = out.get();
  {
    moe_gil::ReleaseGil release;
    auto run = [&](auto* kp, auto* vp) {
      at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> p(static_cast<size_t>(S));
        for (int64_t n = begin; n < end; ++n) {
          const int64_t b = n / Hq, h = n % Hq, g = h / group;
          const int64_t moff = m.defined() ? b * m.stride(0) + h * m.stride(1) : 0;
          attend(qp + n * D, kp + b * k.stride(0) + g * k.stride(1), vp + b * v.stride(0) + g * v.stride(1),
                 add ? add + moff : nullptr, keep ? keep + moff : nullptr, m.defined() ? m.stride(3) : 0, S, D, Dv,
                 k.stride(2), v.stride(2), sc, fast, op + (b * Hq + h) * Dv, p);
        }
      });
    };
    if (k.scalar_type() == at::kFloat) run(k.data_ptr<float>(), v.data_ptr<float>());
    else run(reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()));
  }
  return out.finish();
}
