// The probabilistic Belady victim (core/prob_belady.py, SeqMoE §7.1; issue 47): one pass over the per-expert arrays
// in one call, where ranking the resident experts in numpy (a lexsort per MoE layer, since the layer-cycle keys
// change as each layer runs) cost about 32 us per victim in the decode step on this machine, 2.5 ms per step.
// Reads the policy's own numpy arrays in place (no copy); holds the interpreter lock (it is a few microseconds).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

template <typename T>
using Array = py::array_t<T, py::array::c_style>;

// The resident expert not in `pinned` with the lowest rank key, -1 when there is none. Keys, compared in order
// (core/prob_belady_ranking.py: rank_keys): without layer_cycle (score, last use, id) ascending; with it (score, freq,
// -ahead, last use, id) ascending, where for expert i of layer p = i / E: freq = crf[i] - ran[p] / half_life (the
// log2 reuse frequency at its layer's last run; -inf: not used) and ahead = (p - cur - 1) mod L + 1 (layers until
// its layer runs again, L = ran's length); freq is computed as numpy does (a division, then a subtraction), so the
// two rank alike bit for bit. score float64 [N], last int64 [N], resident bool [N], crf float64 [N], ran int64 [L];
// pinned: an iterable of expert ids (ints, any outside [0, N) ignored); half_life in decode steps. Raises
// ValueError for arrays of different lengths, num_experts < 1, half_life <= 0 or, with layer_cycle, a resident
// expert whose layer is not in ran.
int64_t belady_victim(Array<double> score, Array<int64_t> last, Array<bool> resident, Array<int64_t> ran,
                      Array<double> crf, py::iterable pinned, int64_t cur, int64_t num_experts, bool layer_cycle,
                      double half_life) {
  const int64_t n = score.shape(0);
  if (score.ndim() != 1 || last.ndim() != 1 || resident.ndim() != 1 || crf.ndim() != 1 || ran.ndim() != 1 ||
      last.shape(0) != n || resident.shape(0) != n || crf.shape(0) != n)
    throw std::invalid_argument("belady_victim: score, last, resident and crf must be 1-D of one length");
  if (num_experts < 1) throw std::invalid_argument("belady_victim: num_experts must be >= 1");
  if (!(half_life > 0)) throw std::invalid_argument("belady_victim: half_life must be > 0");
  const double* s = score.data();
  const int64_t* la = last.data();
  const bool* in = resident.data();
  const double* cf = crf.data();
  const int64_t* rn = ran.data();
  const int64_t L = ran.shape(0);
  std::vector<char> skip(static_cast<size_t>(n), 0);
  for (py::handle h : pinned) {
    const int64_t e = h.cast<int64_t>();
    if (e >= 0 && e < n) skip[static_cast<size_t>(e)] = 1;
  }
  int64_t best = -1, b_ahead = 0;
  double b_freq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (!in[i] || skip[static_cast<size_t>(i)]) continue;
    double freq = 0.0;
    int64_t ahead = 0;
    if (layer_cycle) {
      const int64_t p = i / num_experts;
      if (p >= L) throw std::invalid_argument("belady_victim: a resident expert's layer is not in ran");
      freq = cf[i] - static_cast<double>(rn[p]) / half_life;
      ahead = ((p - cur - 1) % L + L) % L + 1;
    }
    if (best >= 0) {  // ascending i: on equal keys the smaller id (the one kept) wins
      if (s[i] != s[best]) {
        if (s[i] > s[best]) continue;
      } else if (layer_cycle && freq != b_freq) {
        if (freq > b_freq) continue;
      } else if (layer_cycle && ahead != b_ahead) {
        if (ahead < b_ahead) continue;
      } else if (la[i] >= la[best]) {
        continue;
      }
    }
    best = i;
    b_freq = freq;
    b_ahead = ahead;
  }
  return best;
}

void bind_belady_victim(py::module_& m) {
  m.def("belady_victim", &belady_victim, "probabilistic Belady's victim in one pass over its arrays",
        py::arg("score").noconvert(), py::arg("last").noconvert(), py::arg("resident").noconvert(),
        py::arg("ran").noconvert(), py::arg("crf").noconvert(), py::arg("pinned"), py::arg("cur"),
        py::arg("num_experts"), py::arg("layer_cycle"), py::arg("half_life"));
}
