// The cross-layer forecast of one decode token (runtime/cross_layer.py, issue 47): n linear softmax top-k routers
// applied to one router input in one call, where the same arithmetic in numpy took a dozen operator calls per MoE
// layer (about 140 us each step's layer on this machine, its caches cold from the experts' streams).

#include "vec.h"

#include <algorithm>
#include <numeric>

using namespace moe_vec;

// weight [n * E, H] float32 or bfloat16 with contiguous rows (the n routers stacked), x [H] (any float dtype) ->
// float32 [n, E]: per router r, p = (1 - eps) * onehot(top-k of softmax(logits_r)) / k + eps * softmax(logits_r),
// eps = 1 / (2 (k + 1)) (runtime/cross_layer.py: xl_probabilities). Each logit is one deterministic dot product
// (vec.h); the top-k takes the larger probability first, the smaller expert id among equal ones.
torch::Tensor router_forecast(torch::Tensor weight, torch::Tensor x, int64_t n, int64_t k, bool portable) {
  TORCH_CHECK(weight.device().is_cpu() && x.device().is_cpu(), "router_forecast runs on the CPU");
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, "router_forecast: weight [n * E, H] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "router_forecast: float32 or bfloat16 weights");
  const int64_t H = weight.size(1), ld = weight.stride(0);
  TORCH_CHECK(n >= 1 && weight.size(0) % n == 0, "router_forecast: weight rows must be n * E");
  const int64_t E = weight.size(0) / n;
  TORCH_CHECK(k >= 1 && k <= E, "router_forecast: 1 <= k <= E");
  TORCH_CHECK(x.numel() == H, "router_forecast: x must hold H values");
  FloatIn xin(x.reshape({H}));
  const float* xp = xin.get();
  const bool fast = use_fast(portable);
  auto out = torch::empty({n, E}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const float eps = 1.0f / static_cast<float>(2 * (k + 1));
  const float top_add = (1.0f - eps) / static_cast<float>(k);
  std::vector<int64_t> order(E);
  auto run = [&](auto* w) {
    for (int64_t r = 0; r < n; ++r) {
      float* p = op + r * E;
      for (int64_t e = 0; e < E; ++e) p[e] = dot(w + (r * E + e) * ld, xp, H, fast);
      const float mx = *std::max_element(p, p + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        p[e] = std::exp(p[e] - mx);
        sum += p[e];
      }
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [p](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      for (int64_t e = 0; e < E; ++e) p[e] *= eps;
      for (int64_t i = 0; i < k; ++i) p[order[i]] += top_add;
    }
  };
  if (weight.scalar_type() == at::kFloat) run(weight.data_ptr<float>());
  else run(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()));
  return out;
}
