// The native kernels' Python module (runtime/kernels/__init__.py builds it from these sources): one binding per
// kernel; each kernel's arithmetic is described in its own source file.

#include <torch/extension.h>

#include <string>

torch::Tensor routed_experts(torch::Tensor x, torch::Tensor slots, torch::Tensor weights, torch::Tensor gate_up,
                             torch::Tensor down, c10::optional<torch::Tensor> pair_out, bool portable);
torch::Tensor sum_pairs(torch::Tensor pair_out, at::ScalarType dtype);
int64_t workspace_peak_bytes(bool reset);
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, bool portable);
std::string kernel_path();
std::tuple<int64_t, double, double, double, double, int64_t, int64_t, int64_t, int64_t, int64_t> read_expert(
    std::vector<int64_t> fds, std::vector<bool> direct, torch::Tensor spans, torch::Tensor pieces,
    torch::Tensor staging, torch::Tensor dst, c10::optional<torch::Tensor> demand, c10::optional<torch::Tensor> stop,
    int64_t chunk);
void futex_wake(torch::Tensor flag);
torch::Tensor router_forecast(torch::Tensor weight, torch::Tensor x, int64_t n, int64_t k, bool portable);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool portable);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               double scale, bool portable);
bool register_ops(const std::string& ns);
void bind_belady_victim(pybind11::module_& m);
void bind_forecast_candidates(pybind11::module_& m);
void bind_belady_scores(pybind11::module_& m);
void bind_prefetch_queue(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("routed_experts", &routed_experts, "the routed experts of one MoE layer from a slot pool",
        pybind11::arg("x"), pybind11::arg("slots"), pybind11::arg("weights"), pybind11::arg("gate_up"),
        pybind11::arg("down"), pybind11::arg("pair_out") = pybind11::none(), pybind11::arg("portable") = false);
  m.def("sum_pairs", &sum_pairs, "weighted pair outputs summed per token in routing order");
  m.def("workspace_peak_bytes", &workspace_peak_bytes, "routed_experts' largest allocation outside the dispatcher",
        pybind11::arg("reset") = false);
  m.def("linear_rows", &linear_rows, "x @ weight.T + bias for a few rows, deterministic",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("portable") = false);
  m.def("decode_attention", &decode_attention, "one query per sequence and head against its key/value cache",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask") = pybind11::none(),
        pybind11::arg("scale") = 1.0, pybind11::arg("portable") = false);
  m.def("router_forecast", &router_forecast, "n linear softmax top-k routers' forecast of one token",
        pybind11::arg("weight"), pybind11::arg("x"), pybind11::arg("n"), pybind11::arg("k"),
        pybind11::arg("portable") = false);
  m.def("rms_norm", &rms_norm, "transformers' standard RMSNorm of each row, deterministic",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("portable") = false);
  m.def("read_expert", &read_expert, "one expert's spans read from disk and its fields copied, without the GIL",
        pybind11::arg("fds"), pybind11::arg("direct"), pybind11::arg("spans"), pybind11::arg("pieces"),
        pybind11::arg("staging"), pybind11::arg("dst"), pybind11::arg("demand") = pybind11::none(),
        pybind11::arg("stop") = pybind11::none(), pybind11::arg("chunk") = 0);
  m.def("futex_wake", &futex_wake, "wake the native prefetch reads waiting for on-demand reads to end");
  m.def("kernel_path", &kernel_path, "which path the kernels run on this CPU");
  bind_belady_victim(m);
  bind_forecast_candidates(m);
  bind_belady_scores(m);
  bind_prefetch_queue(m);
  m.def("register_ops", &register_ops, "the kernels as torch operators in namespace ns (once per process)");
}
