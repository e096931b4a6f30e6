// The linear layers of a decode step (issue 46; runtime/fast_linear.py): x @ weight.T + bias for a few rows, each
// output one deterministic dot product (vec.h) by one thread.

#include "gil.h"
#include "vec.h"

#include <ATen/Parallel.h>

using namespace moe_vec;

// x [M, K] (any float dtype), weight [O, K] float32 or bfloat16 with contiguous rows, bias [O] or None ->
// x @ weight.T + bias, [M, O] in x's dtype: every output one dot product by one thread (the routed experts' dot), so
// the result depends neither on the thread count nor on M. For the few rows of a decode step (torch's GEMM runs a
// large matrix times one row, e.g. an LM head, well below the memory's bandwidth on this kind of CPU).
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, bool portable) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_rows runs on the CPU");
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, "linear_rows: weight [O, K] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "linear_rows: float32 or bfloat16 weights");
  const int64_t K = weight.size(1), O = weight.size(0), ld = weight.stride(0);
  TORCH_CHECK(x.size(-1) == K, "linear_rows: x's last dimension must be the weight's");
  const auto x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  FloatIn xin(x2);
  c10::optional<FloatIn> bin;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == O, "linear_rows: bias [O]");
    bin.emplace(*bias);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = O;
  FloatOut out(sizes, x.scalar_type());
  const float* xp = xin.get();
  const float* bp = bin.has_value() ? bin->get() : nullptr;
  float* op = out.get();
  const bool fast = use_fast(portable);
  {
    moe_gil::ReleaseGil release;
    auto run = [&](auto* w) {
      at::parallel_for(0, M * O, 64, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          int64_t m = n / O, o = n % O;
          float v = dot(w + o * ld, xp + m * K, K, fast);
          op[n] = bp ? v + bp[o] : v;
        }
      });
    };
    if (weight.scalar_type() == at::kFloat) run(weight.data_ptr<float>());
    else run(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()));
  }
  return out.finish();
}

std::string kernel_path() { return use_fast(false) ? "avx2+fma" : "portable"; }

