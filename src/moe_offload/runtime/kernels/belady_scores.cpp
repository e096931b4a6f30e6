// Probabilistic Belady's intake of a one-row forecast under the layer cycle (core/prob_belady.py
// ``ProbabilisticBelady.update_forecast``, SeqMoE §7.1; issue 47, session 53): a cross-layer forecast (``xl``)
// arrives at every MoE layer of a decode step, and numpy's conversion, finiteness test, layer test and slice write
// cost about 55 us per forecast in the decode step on this machine (1.6 ms per step; with this call the whole
// update_forecast 18 us, docs/results/forecast-call-costs-s53-*.txt). Holds the interpreter lock (about a
// microsecond). Writes the same float64 values numpy's path writes (each float32 widened exactly).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>

namespace py = pybind11;

namespace {

template <typename T>
int64_t intake(const T* p, int64_t count, double* score, int64_t offset, bool write) {
  for (int64_t i = 0; i < count; ++i)
    if (!std::isfinite(static_cast<double>(p[i]))) return -1;
  if (!write) return 0;
  for (int64_t i = 0; i < count; ++i) score[offset + i] = static_cast<double>(p[i]);
  return 1;
}

}  // namespace

// score: the policy's float64 [N] scores (written in place); ran: int64 [>= hi] the step each MoE layer last ran in;
// probs: float32 or float64 [R, hi - lo, e], C-contiguous (the forecast's rows); first: the step of row 0. Returns
// -2 when probs is another dtype, layout or shape (the caller takes numpy's path, which raises its own errors), -1
// when a value is not finite (likewise), 1 when it wrote the scores of layers lo .. hi - 1 (one row, none of those
// layers ran in step ``first`` or later: the row is their score), 0 when it wrote nothing (several rows, or one of
// the layers ran already: numpy's per-layer path). Raises ValueError when score cannot hold layer hi - 1 or ran is
// shorter than hi.
int64_t belady_scores(py::array_t<double, py::array::c_style> score, py::array_t<int64_t, py::array::c_style> ran,
                      py::array probs, int64_t lo, int64_t hi, int64_t num_experts, int64_t first) {
  if (probs.ndim() != 3 || lo < 0 || hi <= lo || num_experts < 1 || probs.shape(0) < 1 ||
      probs.shape(1) != hi - lo || probs.shape(2) != num_experts || !(probs.flags() & py::array::c_style))
    return -2;
  if (score.ndim() != 1 || score.shape(0) < hi * num_experts || ran.ndim() != 1 || ran.shape(0) < hi)
    throw std::invalid_argument("belady_scores: score or ran too short for the forecast's layers");
  const int64_t* rn = ran.data();
  bool write = probs.shape(0) == 1;
  for (int64_t p = lo; p < hi && write; ++p) write = rn[p] < first;
  const int64_t count = probs.shape(0) * (hi - lo) * num_experts;  // every row is checked, one is written
  double* s = score.mutable_data();
  if (py::isinstance<py::array_t<float>>(probs))
    return intake(static_cast<const float*>(probs.data()), count, s, lo * num_experts, write);
  if (py::isinstance<py::array_t<double>>(probs))
    return intake(static_cast<const double*>(probs.data()), count, s, lo * num_experts, write);
  return -2;
}

void bind_belady_scores(py::module_& m) {
  m.def("belady_scores", &belady_scores, "probabilistic Belady's scores from a one-row forecast, in place",
        py::arg("score").noconvert(), py::arg("ran").noconvert(), py::arg("probs"), py::arg("lo"), py::arg("hi"),
        py::arg("num_experts"), py::arg("first"));
}
