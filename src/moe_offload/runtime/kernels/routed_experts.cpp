// The routed experts of one MoE layer in one call, computed from a slot pool (issue 46; SeqMoE §8.1 on a CPU).
//
//   out[t, :] = sum_j w[t, j] * down[s_tj] @ (silu(gate[s_tj] @ x_t) * (up[s_tj] @ x_t))
//
// for the tokens t of x [T, H] and their k routed (slot, weight) pairs (j in routing order), where gate_up
// [S, 2I, H] holds each slot's gate rows then its up rows (transformers' concatenated layout) and down [S, H, I].
// The slots' weights are read in place (strided views of the pool: any slot stride, contiguous rows), float32 or
// bfloat16; x and the result have x's dtype; the arithmetic is float32 (bfloat16 weights widen exactly).
//
// Determinism: every output element is computed by one thread, by the same code, in one fixed order (a dot
// product's 32 partial sums in a fixed lane order and a fixed tree; the k pairs in routing order), so the result
// depends neither on the thread count nor on which slot holds an expert: an offloaded run and FullLoad running this
// kernel agree bit for bit. A pair whose slot is -1 is skipped (a round of a layer that needs more experts than the
// pool holds); with ``pair_out`` the weighted outputs of the computed pairs are written there instead of summed,
// and ``sum_pairs`` adds them in routing order with the same float operations as the fused sum.
//
// Dispatch at run time: an AVX2 + FMA path (compiled for that target) where the CPU has it, else the portable path,
// which performs the same float operations in the same order (the two agree bit for bit; a test checks it). The
// interpreter lock is released while the kernel runs; its loops run on torch's intra-op threads.

#include "gil.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace moe_vec;

// The most bytes one call of routed_experts has allocated outside torch's dispatcher (its float32 copies of x,
// slots and weights, its result, its scratch), since the last reset: the memory profile of serving adds it to what
// its tracker sees (serve/memory_profile.py), since these allocations are not tensors an operator returns.
std::atomic<int64_t> g_workspace_peak{0};

void note_workspace(int64_t bytes) {
  int64_t prev = g_workspace_peak.load();
  while (bytes > prev && !g_workspace_peak.compare_exchange_weak(prev, bytes)) {
  }
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

struct Problem {
  const float* x;        // [T, H]
  const int64_t* slots;  // [T * k], -1: skip
  const float* weights;  // [T * k]
  int64_t T, H, k, I;
  bool fast;
};

// The computed pairs grouped by slot (stable: routing order within a group): the pairs of one slot share its rows,
// which stay in cache while each of the group's tokens is multiplied (a prefill's many tokens per expert).
struct Groups {
  std::vector<int64_t> order;   // computed pairs sorted by slot
  std::vector<int64_t> starts;  // group g is order[starts[g] .. starts[g + 1])
  int64_t count() const { return static_cast<int64_t>(starts.size()) - 1; }
};

Groups group_pairs(const Problem& p) {
  Groups gr;
  const int64_t n_pairs = p.T * p.k;
  gr.order.reserve(static_cast<size_t>(n_pairs));
  for (int64_t q = 0; q < n_pairs; ++q)
    if (p.slots[q] >= 0) gr.order.push_back(q);
  std::stable_sort(gr.order.begin(), gr.order.end(), [&](int64_t a, int64_t b) { return p.slots[a] < p.slots[b]; });
  for (size_t q = 0; q < gr.order.size(); ++q)
    if (q == 0 || p.slots[gr.order[q]] != p.slots[gr.order[q - 1]]) gr.starts.push_back(static_cast<int64_t>(q));
  gr.starts.push_back(static_cast<int64_t>(gr.order.size()));
  return gr;
}

// Blocking of phases 1 and 2: a work item is a block of kRows rows of one group's matrix; inside it the group's
// tokens go in chunks of kChunk, each chunk multiplied with every row of the block while its vectors stay in the L1
// cache (a prefill's hundred tokens per expert would otherwise stream them from L2 for every row). The arithmetic
// of each output is dot's, whatever the blocking.
constexpr int64_t kRows = 32;
constexpr int64_t kChunk = 8;

// For every group and every row r < n_rows of its slot's matrix (rows of row_len elements, slot_stride apart),
// store(r, pair, row_r . vecs[q]) for each pair q of the group; vecs[q] is the vector of the pair order[q].
template <typename W, typename Store>
void blocked_dots(const Problem& p, const Groups& gr, const W* matrix, int64_t slot_stride, int64_t row_len,
                  int64_t n_rows, const std::vector<const float*>& vecs, Store store) {
  const int64_t blocks = (n_rows + kRows - 1) / kRows;
  at::parallel_for(0, gr.count() * blocks, 1, [&](int64_t begin, int64_t end) {
    float v[kChunk];
    for (int64_t n = begin; n < end; ++n) {
      const int64_t grp = n / blocks, r0 = (n % blocks) * kRows, r1 = std::min(r0 + kRows, n_rows);
      const int64_t q0 = gr.starts[grp], q1 = gr.starts[grp + 1];
      const W* rows = matrix + p.slots[gr.order[q0]] * slot_stride;
      for (int64_t c = q0; c < q1; c += kChunk) {
        const int64_t m = std::min(kChunk, q1 - c);
        for (int64_t r = r0; r < r1; ++r) {
          dot_many(rows + r * row_len, vecs.data() + c, m, row_len, p.fast, v);
          for (int64_t q = 0; q < m; ++q) store(r, gr.order[c + q], v[q]);
        }
      }
    }
  });
}

// Phase 1: h[pair, i] = silu(gate_i . x_t) * (up_i . x_t) for every computed pair.
template <typename W>
void gate_up_phase(const Problem& p, const Groups& gr, const W* gate_up, int64_t gu_stride, std::vector<float>& h) {
  const int64_t I = p.I, H = p.H;
  std::vector<const float*> xs(gr.order.size());  // each grouped pair's token row
  for (size_t q = 0; q < gr.order.size(); ++q) xs[q] = p.x + (gr.order[q] / p.k) * H;
  std::vector<float> g(static_cast<size_t>(p.T * p.k * I));
  blocked_dots(p, gr, gate_up, gu_stride, H, 2 * I, xs, [&](int64_t r, int64_t pair, float v) {
    if (r < I) g[pair * I + r] = v;
    else h[pair * I + (r - I)] = v;
  });
  for (int64_t q : gr.order)
    for (int64_t i = 0; i < I; ++i) h[q * I + i] = silu(g[q * I + i]) * h[q * I + i];
}

// Phase 2: y[pair, c] = w[pair] * (down_c . h[pair]) for every computed pair into y [T * k, H]; rows of skipped
// pairs are left as they are.
template <typename W>
void down_phase(const Problem& p, const Groups& gr, const W* down, int64_t down_stride, const std::vector<float>& h,
                float* y) {
  const int64_t H = p.H, I = p.I;
  std::vector<const float*> hs(gr.order.size());
  for (size_t q = 0; q < gr.order.size(); ++q) hs[q] = h.data() + gr.order[q] * I;
  blocked_dots(p, gr, down, down_stride, I, H, hs,
               [&](int64_t c, int64_t pair, float v) { y[pair * H + c] = p.weights[pair] * v; });
}

// Phase 3: out[t, c] = sum over the computed pairs j of y[t * k + j, c], in routing order, starting from 0.
void sum_phase(const Problem& p, const float* y, float* out) {
  const int64_t H = p.H, k = p.k;
  at::parallel_for(0, p.T * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t t = n / H, c = n % H;
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j)
        if (p.slots[t * k + j] >= 0) acc = acc + y[(t * k + j) * H + c];
      out[n] = acc;
    }
  });
}

template <typename W>
void compute(const Problem& p, const W* gate_up, int64_t gu_stride, const W* down, int64_t down_stride, float* out,
             float* pair_out) {
  const Groups gr = group_pairs(p);
  std::vector<float> h(static_cast<size_t>(p.T * p.k * p.I));
  gate_up_phase<W>(p, gr, gate_up, gu_stride, h);
  if (pair_out) {
    down_phase<W>(p, gr, down, down_stride, h, pair_out);
    return;
  }
  std::vector<float> y(static_cast<size_t>(p.T * p.k * p.H));
  down_phase<W>(p, gr, down, down_stride, h, y.data());
  sum_phase(p, y.data(), out);
}

void check_rows(const torch::Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 3, name, " must be [S, rows, cols]");
  TORCH_CHECK(w.stride(2) == 1 && w.stride(1) == w.size(2), name, "'s rows must be contiguous");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}


}  // namespace

// x [T, H]; slots [T, k] int64 (rows of gate_up / down, -1: skip the pair); weights [T, k]; gate_up [S, 2I, H];
// down [S, H, I]; pair_out: None, or [T, k, H] float32 that receives the computed pairs' weighted outputs (then the
// result is pair_out itself); portable: the portable path even where AVX2 is there (tests).
// Returns [T, H] in x's dtype (or pair_out).
torch::Tensor routed_experts(torch::Tensor x, torch::Tensor slots, torch::Tensor weights, torch::Tensor gate_up,
                             torch::Tensor down, c10::optional<torch::Tensor> pair_out, bool portable) {
  TORCH_CHECK(x.device().is_cpu() && gate_up.device().is_cpu() && down.device().is_cpu(),
              "routed_experts runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && slots.dim() == 2 && weights.sizes() == slots.sizes() && slots.size(0) == x.size(0),
              "routed_experts: x [T, H], slots and weights [T, k]");
  check_rows(gate_up, "gate_up");
  check_rows(down, "down");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type(), "gate_up and down must have one dtype");
  const int64_t T = x.size(0), H = x.size(1), k = slots.size(1), I = down.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(1) == H,
              "routed_experts: gate_up [S, 2I, H] and down [S, H, I] must match x's H");
  FloatIn xs(x), ws(weights);
  auto ss = slots.scalar_type() == at::kLong && slots.is_contiguous() ? slots : slots.to(at::kLong).contiguous();
  const int64_t* sp = ss.data_ptr<int64_t>();
  const int64_t S = std::min(gate_up.size(0), down.size(0));
  for (int64_t n = 0; n < ss.numel(); ++n)
    TORCH_CHECK(sp[n] >= -1 && sp[n] < S, "routed_experts: slot ", sp[n], " out of range [0, ", S, ")");
  float* pout = nullptr;
  if (pair_out.has_value()) {
    TORCH_CHECK(pair_out->scalar_type() == at::kFloat && pair_out->is_contiguous() && pair_out->dim() == 3 &&
                    pair_out->size(0) == T && pair_out->size(1) == k && pair_out->size(2) == H,
                "routed_experts: pair_out must be a contiguous float32 [T, k, H]");
    pout = pair_out->data_ptr<float>();
  }
  c10::optional<FloatOut> out;
  if (!pout) out.emplace(at::IntArrayRef{T, H}, x.scalar_type());
  const int64_t pairs = T * k;  // x, slots, weights copies; result (and its cast); h and g; y; the sort's indices
  note_workspace(4 * T * H + 12 * pairs + (pout ? 0 : 8 * T * H) + 8 * pairs * I + (pout ? 0 : 4 * pairs * H) +
                 16 * pairs);
  Problem p{xs.get(), sp, ws.get(), T, H, k, I, use_fast(portable)};
  {
    moe_gil::ReleaseGil release;
    if (gate_up.scalar_type() == at::kFloat) {
      compute<float>(p, gate_up.data_ptr<float>(), gate_up.stride(0), down.data_ptr<float>(), down.stride(0),
                     pout ? nullptr : out->get(), pout);
    } else {
      compute<uint16_t>(p, reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>()), gate_up.stride(0),
                        reinterpret_cast<const uint16_t*>(down.data_ptr<at::BFloat16>()), down.stride(0),
                        pout ? nullptr : out->get(), pout);
    }
  }
  return pout ? *pair_out : out->finish();
}

// pair_out [T, k, H] float32 -> [T, H] in dtype: the pairs added in routing order, as the fused sum adds them.
torch::Tensor sum_pairs(torch::Tensor pair_out, at::ScalarType dtype) {
  TORCH_CHECK(pair_out.scalar_type() == at::kFloat && pair_out.is_contiguous() && pair_out.dim() == 3,
              "sum_pairs: a contiguous float32 [T, k, H]");
  const int64_t T = pair_out.size(0), k = pair_out.size(1), H = pair_out.size(2);
  auto out = torch::empty({T, H}, pair_out.options());
  const float* src = pair_out.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) acc = acc + src[(t * k + j) * H + c];
      dst[t * H + c] = acc;
    }
  return out.to(dtype);
}

// The peak of note_workspace since the last reset (bytes); reset: start counting again from 0.
int64_t workspace_peak_bytes(bool reset) { return reset ? g_workspace_peak.exchange(0) : g_workspace_peak.load(); }
