// A forecast's prefetch candidates in one call (core/prefetch_tasks.py ``forecast_candidates``, SeqMoE §6.1;
// issue 47, session 53): per forecast layer the top-k' experts (best first, ties to the smaller index), their
// confidences, their chance of use and a cost gate's verdict, where numpy's argsort, fancy indexing, row sums and
// comparisons cost about 79 us per forecast in the decode step on this machine (2.2 ms per step; this call 16 us,
// docs/results/forecast-call-costs-s53-*.txt). Holds the interpreter lock (a few microseconds). Bit for bit
// numpy's results: the confidences are the float32 values widened, each row's sum is numpy's pairwise summation of
// float64 (``pairwise_sum`` below, numpy's ``@TYPE@_pairwise_sum`` for a contiguous row), and every other operation
// is the one ``chance_of_use`` and ``PrefetchCost.worth`` write, in their order.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace {

// numpy's pairwise summation of n doubles (numpy/_core/src/umath/loops_utils.h.src, PW_BLOCKSIZE 128): below 8
// terms in order from 0.0, up to 128 in eight interleaved partial sums, beyond that the two halves (split at a
// multiple of 8) summed alike.
double pairwise_sum(const double* a, int64_t n) {
  if (n < 8) {
    double res = 0.0;
    for (int64_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

template <typename T>
bool widen_rows(const py::array& probs, std::vector<double>& out) {
  auto a = py::array_t<T, py::array::c_style>::ensure(probs);
  if (!a) return false;
  const T* p = a.data();
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(p[i]);
  return true;
}

}  // namespace

// probs: float32 or float64 [n, e], C-contiguous (another dtype, layout or shape: None, and the caller takes numpy's
// path, which raises its own errors); width: k', the candidates per row (1 <= width <= e); top_k: k (the scale of
// the chance of use); chances: whether to compute the chance of use (and the gate's verdict); gate_mode: 0 no gate,
// 1 the gate's test min(1, chance * used_scale) > threshold, 2 a closed gate (every candidate refused). Returns
// None when a value is not finite (numpy's path raises the error), else (experts [n][width] ints, confidences
// [n][width] floats, chances [n][width] floats or None, verdicts [n][width] bools or None: Python lists).
py::object forecast_candidates(py::array probs, int64_t width, int64_t top_k, bool chances, int64_t gate_mode,
                               double used_scale, double threshold) {
  if (probs.ndim() != 2) return py::none();
  const int64_t n = probs.shape(0), e = probs.shape(1);
  if (n < 1 || e < 1 || width < 1 || width > e) return py::none();
  std::vector<double> a(static_cast<size_t>(n * e));
  const bool is32 = py::isinstance<py::array_t<float>>(probs), is64 = py::isinstance<py::array_t<double>>(probs);
  if (!(is32 ? widen_rows<float>(probs, a) : is64 ? widen_rows<double>(probs, a) : false)) return py::none();
  for (double v : a)
    if (!std::isfinite(v)) return py::none();
  const double k = static_cast<double>(top_k);
  py::list tops(n), confs(n);
  py::object chance_rows = py::none(), worth_rows = py::none();
  py::list ch_list, wo_list;
  if (chances) {
    ch_list = py::list(n);
    chance_rows = ch_list;
    if (gate_mode != 0) {
      wo_list = py::list(n);
      worth_rows = wo_list;
    }
  }
  std::vector<int64_t> idx(static_cast<size_t>(e));
  for (int64_t r = 0; r < n; ++r) {
    const double* row = a.data() + r * e;
    for (int64_t q = 0; q < e; ++q) idx[static_cast<size_t>(q)] = q;
    // argsort(-row, kind="stable")[:width]: descending value, ties to the smaller index (a strict total order)
    std::partial_sort(idx.begin(), idx.begin() + width, idx.end(), [row](int64_t x, int64_t y) {
      return row[x] > row[y] || (row[x] == row[y] && x < y);
    });
    py::list t(width), c(width);
    for (int64_t j = 0; j < width; ++j) {
      t[j] = py::int_(idx[static_cast<size_t>(j)]);
      c[j] = py::float_(row[idx[static_cast<size_t>(j)]]);
    }
    tops[r] = t;
    confs[r] = c;
    if (!chances) continue;
    const double s = pairwise_sum(row, e);
    const double div = s > 0 ? s : 1.0;
    py::list ch(width), wo(gate_mode != 0 ? width : 0);
    for (int64_t j = 0; j < width; ++j) {
      const double x = row[idx[static_cast<size_t>(j)]] * k / div;  // NaN when a float64 row's sum overflows
      const double chance = std::isnan(x) ? x : (x < 1.0 ? x : 1.0);  // np.minimum(1.0, x) keeps a NaN
      ch[j] = py::float_(chance);
      if (gate_mode == 1) {
        const double y = chance * used_scale;  // np.minimum(1.0, y) keeps a NaN (e.g. 0 * inf), which then fails
        wo[j] = py::bool_((std::isnan(y) ? y : (y < 1.0 ? y : 1.0)) > threshold);
      } else if (gate_mode == 2) {
        wo[j] = py::bool_(false);
      }
    }
    ch_list[r] = ch;
    if (gate_mode != 0) wo_list[r] = wo;
  }
  return py::make_tuple(tops, confs, chance_rows, worth_rows);
}

void bind_forecast_candidates(py::module_& m) {
  m.def("forecast_candidates", &forecast_candidates, "a forecast's top-k' prefetch candidates per layer",
        py::arg("probs"), py::arg("width"), py::arg("top_k"), py::arg("chances"), py::arg("gate_mode"),
        py::arg("used_scale"), py::arg("threshold"));
}
