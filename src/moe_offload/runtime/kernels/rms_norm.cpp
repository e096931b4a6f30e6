// RMSNorm (issue 46; runtime/fast_norm.py): transformers' standard RMSNorm (LlamaRMSNorm's arithmetic) of each row in
// one call, where the eager module runs seven operators of a few microseconds each, 61 times per decode step.
//
//   h = float(x); r = 1 / sqrt(mean(h * h) + eps); y = weight * to_dtype(h * r)
//
// in float32, the product weight * to_dtype(...) in x's dtype as torch computes it (bfloat16: both widened, multiplied
// in float32, rounded to nearest even). The sum of squares is the dot product of vec.h (a fixed order), so each row's
// result depends neither on the thread count nor on how many rows the call holds; it differs from torch's own
// reduction order in the last bits, the same for FullLoad and the offloaded engines, which both run it.

#include "gil.h"
#include "vec.h"

#include <ATen/Parallel.h>

using namespace moe_vec;

namespace {

inline float round_to(float v, bool bf16) { return bf16 ? static_cast<float>(at::BFloat16(v)) : v; }

}  // namespace

// x [..., H] and weight [H], both float32 or both bfloat16, x contiguous -> [..., H] in x's dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool portable) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm runs on the CPU");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x and weight both float32 or both bfloat16");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight [H] with x [..., H]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const torch::Tensor xc = x.contiguous(), wc = weight.contiguous();  // alive while FloatIn points into them
  FloatIn xin(xc), win(wc);
  FloatOut out(x.sizes(), x.scalar_type());
  const float* xp = xin.get();
  const float* wp = win.get();
  float* op = out.get();
  const int64_t M = H ? x.numel() / H : 0;
  const bool fast = use_fast(portable);
  const float feps = static_cast<float>(eps);
  {
    moe_gil::ReleaseGil release;
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const float* row = xp + m * H;
        const float mean = dot(row, row, H, fast) / static_cast<float>(H);
        const float r = 1.0f / std::sqrt(mean + feps);
        float* o = op + m * H;
        for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * round_to(row[i] * r, bf16);
      }
    });
  }
  return out.finish();
}
