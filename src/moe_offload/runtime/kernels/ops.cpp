// The kernels as torch operators (issue 46; runtime/kernels/ops.py), for the graphs torch.compile captures: a call
// goes from the dispatcher straight into the kernel, where an operator with a Python body (torch.library.custom_op)
// costs ~14 us of interpreter time per call, ~180 calls per decode step. Registered once per process at run time
// (register_ops), not by a static initializer, so that loading a second copy of this module cannot register the
// namespace twice.

#include <torch/extension.h>

#include <memory>
#include <string>

torch::Tensor routed_experts(torch::Tensor x, torch::Tensor slots, torch::Tensor weights, torch::Tensor gate_up,
                             torch::Tensor down, c10::optional<torch::Tensor> pair_out, bool portable);
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, bool portable);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               double scale, bool portable);

namespace {

torch::Tensor routed_experts_op(torch::Tensor x, torch::Tensor slots, torch::Tensor weights, torch::Tensor gate_up,
                                torch::Tensor down) {
  return routed_experts(x, slots, weights, gate_up, down, c10::nullopt, false);
}

torch::Tensor linear_rows_op(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  return linear_rows(x, weight, bias, false);
}

torch::Tensor decode_attention_op(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                  c10::optional<torch::Tensor> mask, double scale) {
  return decode_attention(q, k, v, mask, scale, false);
}

// Kept for the life of the process: a Library unregisters its operators when it is destroyed.
std::unique_ptr<torch::Library> g_def, g_cpu;

}  // namespace

// Define the operators ns::routed_experts, ns::linear_rows and ns::decode_attention with their CPU kernels, unless
// the namespace already has them (another copy of this module registered them). Returns whether it registered.
bool register_ops(const std::string& ns) {
  if (c10::Dispatcher::singleton().findSchema({ns + "::linear_rows", ""}).has_value()) return false;
  g_def = std::make_unique<torch::Library>(torch::Library::DEF, ns, c10::nullopt, __FILE__, __LINE__);
  g_def->def("routed_experts(Tensor x, Tensor slots, Tensor weights, Tensor gate_up, Tensor down) -> Tensor");
  g_def->def("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  g_def->def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  g_cpu = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU, __FILE__, __LINE__);
  g_cpu->impl("routed_experts", TORCH_FN(routed_experts_op));
  g_cpu->impl("linear_rows", TORCH_FN(linear_rows_op));
  g_cpu->impl("decode_attention", TORCH_FN(decode_attention_op));
  return true;
}
