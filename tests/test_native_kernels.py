"""The native CPU kernels (issue 46, ``runtime.kernels``): the routed experts of a layer in one call from the slot
pool and the decode-step linears. Their values against a float64 reference; bit for bit the same whatever the thread
count, the slots the experts sit in, the AVX2 or the portable path, and one fused round or several; an offloaded model
and FullLoad running them agree bit for bit at two threads; against transformers' own experts the logits agree to a
tolerance and the greedy tokens are the same; without the kernel (no compiler, a failed build, or on purpose) the
torch path runs and the stats say so.
"""

import pytest
import torch
import torch.nn.functional as F

from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.runtime import kernels

kernel = kernels.native()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the native kernels are not built here")
PROMPT = "Hello there, how are you today? The slot pool is shared by all MoE layers."


def _problem(dtype, S=40, H=576, I=48, T=3, k=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(S, 2 * I, H, generator=g) * 0.05).to(dtype)
    down = (torch.randn(S, H, I, generator=g) * 0.05).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    slots = torch.randint(0, S, (T, k), generator=g)
    weights = torch.rand(T, k, generator=g)
    return x, slots, weights, gate_up, down


def _reference(x, slots, weights, gate_up, down):
    """float64: sum_j w_j * down_s (silu(gate_s x) * (up_s x)), skipping slots -1."""
    I = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            if s < 0:
                continue
            g = gate_up[s].double() @ x[t].double()
            out[t] += weights[t, j].double() * (down[s].double() @ (F.silu(g[:I]) * g[I:]))
    return out


def _same_at_1_and_2_threads(compute):
    """``compute()`` at 2 threads, asserted bit for bit equal at 1 thread; the thread count restored."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        base = compute()
        torch.set_num_threads(1)
        assert torch.equal(compute(), base)
    finally:
        torch.set_num_threads(before)
    return base


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("I", [48, 40, 100])  # full steps of 32, a chunk of 8, a tail of single elements
def test_routed_experts_values(dtype, tol, I):
    x, slots, weights, gate_up, down = _problem(dtype, I=I)
    slots[1, 3] = -1  # a pair of another round
    got = kernel.routed_experts(x, slots, weights, gate_up, down)
    ref = _reference(x, slots, weights, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.double() - ref).abs().max() <= tol * ref.abs().max()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_bit_for_bit_whatever_the_threads_slots_path_or_rounds(dtype):
    x, slots, weights, gate_up, down = _problem(dtype, I=40)
    base = _same_at_1_and_2_threads(lambda: kernel.routed_experts(x, slots, weights, gate_up, down))
    assert torch.equal(kernel.routed_experts(x, slots, weights, gate_up, down, portable=True), base)
    perm = torch.randperm(gate_up.shape[0], generator=torch.Generator().manual_seed(1))
    where = torch.empty_like(perm)
    where[perm] = torch.arange(len(perm))  # expert perm[i] now sits in slot i
    assert torch.equal(kernel.routed_experts(x, where[slots], weights, gate_up[perm], down[perm]), base)
    pairs = torch.zeros(x.shape[0], slots.shape[1], x.shape[1])
    first = slots < 20
    kernel.routed_experts(x, slots.masked_fill(~first, -1), weights, gate_up, down, pair_out=pairs)
    kernel.routed_experts(x, slots.masked_fill(first, -1), weights, gate_up, down, pair_out=pairs)
    assert torch.equal(kernel.sum_pairs(pairs, dtype), base)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_many_tokens_per_expert_as_one_by_one(dtype):
    """A prefill's shape: many tokens share each expert, so each row is multiplied with several tokens at once
    (vec.h's dot_many tiles). Each token's result is bit for bit what a call with that token alone gives (a decode
    step), on the AVX2 and the portable path and at 1 and 2 threads, and close to the float64 reference."""
    x, slots, weights, gate_up, down = _problem(dtype, S=4, I=40, T=37, k=2, seed=3)
    base = _same_at_1_and_2_threads(lambda: kernel.routed_experts(x, slots, weights, gate_up, down))
    assert torch.equal(kernel.routed_experts(x, slots, weights, gate_up, down, portable=True), base)
    alone = torch.cat([kernel.routed_experts(x[t:t + 1], slots[t:t + 1], weights[t:t + 1], gate_up, down)
                       for t in range(x.shape[0])])
    assert torch.equal(alone, base)
    ref = _reference(x, slots, weights, gate_up, down)
    assert (base.double() - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 1e-2) * ref.abs().max()


@needs_kernel
def test_routed_experts_refuses_bad_input():
    x, slots, weights, gate_up, down = _problem(torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.routed_experts(x, slots + 100, weights, gate_up, down)
    with pytest.raises(RuntimeError, match="must match"):
        kernel.routed_experts(x[:, :100], slots, weights, gate_up, down)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.routed_experts(x, slots, weights, gate_up.half(), down.half())


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_linear_rows(dtype, tol):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(300, 100, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype)
    x = torch.randn(2, 3, 100, generator=g).to(dtype)
    got = kernel.linear_rows(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert got.shape == (2, 3, 300) and (got.double() - ref).abs().max() <= tol * ref.abs().max()
    assert torch.equal(kernel.linear_rows(x, w, b, portable=True), got)
    assert torch.equal(kernel.linear_rows(x[0, :1], w, b), got[0, :1])  # one row alone: the same


def _logits(lm, ids, steps: int) -> list[torch.Tensor]:
    """The last position's logits of the prefill and of ``steps`` greedy decode steps."""
    out, seq, cache = [], torch.tensor([ids]), None
    with torch.no_grad():
        for step in range(steps + 1):
            if lm.engine is not None:
                lm.engine.begin_step(0, step)
            r = lm.model(input_ids=seq if cache is None else seq[:, -1:], cache=cache, use_cache=True)
            cache = r.past_key_values if hasattr(r, "past_key_values") else r.cache
            out.append(r.logits[0, -1])
            seq = torch.cat([seq, r.logits[:, -1:].argmax(-1)], dim=1)
    return out


@needs_kernel
@pytest.mark.parametrize("arch, dtype", [("qwen3_moe", None), ("mixtral", None), ("qwen3_moe", "bfloat16")])
def test_offloaded_equals_fullload_bit_for_bit_at_two_threads(tiny_dirs, arch, dtype):
    """The lossless claim at the default thread count: residency 0.3 (misses, scattered slots) and the smallest pool
    (a prefill in several rounds) give FullLoad's logits bit for bit, with two intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        full = load_full(tiny_dirs[arch], device="cpu", dtype=dtype)
        ids = encode_prompt(full.tokenizer, PROMPT)
        ref = _logits(full, ids, 6)
        for size in (dict(residency=0.3), dict(slots=full.top_k)):
            off = load_offloaded(tiny_dirs[arch], device="cpu", dtype=dtype, progress=False, **size)
            got = _logits(off, ids, 6)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), size
            assert off.engine.stats.misses > 0
            off.close()
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_against_transformers_own_experts(tiny_dirs, arch, torch_experts_full):
    """FullLoad on the kernels against transformers' own implementation (grouped GEMMs, ATen linears): float32
    logits within 1e-4 of their scale, the same greedy tokens."""
    ours = load_full(tiny_dirs[arch], device="cpu")
    theirs = torch_experts_full(tiny_dirs[arch])
    ids = encode_prompt(ours.tokenizer, PROMPT)
    a, b = _logits(ours, ids, 8), _logits(theirs, ids, 8)
    for x, y in zip(a, b):
        assert (x - y).abs().max() <= 1e-4 * y.abs().max()
    assert generate_ids(ours, ids, 12)[0] == generate_ids(theirs, ids, 12)[0]


@pytest.fixture
def torch_experts_full(monkeypatch):
    """Load FullLoad without the kernels (transformers' own experts and torch's linears)."""
    def load(path):
        with monkeypatch.context() as m:
            m.setattr(kernels, "_state", {})
            m.setenv("MOE_OFFLOAD_KERNELS", "torch")
            return load_full(path, device="cpu")
    return load


def test_without_the_kernel_the_torch_path_runs_and_says_so(tiny_dirs, monkeypatch, one_thread):
    from moe_offload.generation.generate import run
    from moe_offload.generation.report import stats_dict

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("MOE_OFFLOAD_KERNELS", "torch")
    assert kernels.native() is None
    assert kernels.describe() == "torch grouped GEMMs (the native kernel is not used: MOE_OFFLOAD_KERNELS=torch)"
    full = load_full(tiny_dirs["qwen3_moe"], device="cpu")
    off = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.3, progress=False)
    ids = encode_prompt(full.tokenizer, PROMPT)
    assert generate_ids(off, ids, 8)[0] == generate_ids(full, ids, 8)[0]
    _, st = run(off, [PROMPT], 4)
    assert stats_dict(off, st)["experts_compute"].startswith("torch grouped GEMMs (the native kernel is not used")


def test_a_failed_build_is_remembered_and_the_fallback_runs(tmp_path, monkeypatch):
    """No compiler (the build raises): one-line error, the reason kept beside the cache entry, no second attempt
    until ``force``; ``native()`` then gives None and ``describe`` the reason."""
    from torch.utils import cpp_extension

    calls = []

    def no_compiler(**kw):
        calls.append(kw["name"])
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setenv("MOE_OFFLOAD_KERNELS_DIR", str(tmp_path))
    monkeypatch.delenv("MOE_OFFLOAD_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.raises(MoeOffloadError, match="did not build: .*command not found"):
        kernels.build(say=lambda m: None)
    assert len(calls) == 1 and list(tmp_path.glob("*.failed"))
    assert kernels.native() is None and len(calls) == 1
    assert "failed to build before" in kernels.describe() and "command not found" in kernels.describe()
    with pytest.raises(MoeOffloadError, match="did not build"):
        kernels.build(force=True, say=lambda m: None)
    assert len(calls) == 2


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operators_are_the_bindings_bit_for_bit(dtype):
    """``runtime.kernels.ops``: the kernels as torch operators (entered from the dispatcher, the interpreter lock
    already released) give the bindings' bits, eager and inside a compiled graph (no graph break), and their fake
    kernels give the shapes; registering twice registers once."""
    from moe_offload.runtime.kernels.ops import NAMESPACE, native_ops

    ops = native_ops()
    assert ops is native_ops() and ops is getattr(torch.ops, NAMESPACE) and kernel.register_ops(NAMESPACE) is False
    x, slots, weights, gate_up, down = _problem(dtype)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, x.shape[1], generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    q = torch.randn(2, 6, 1, 64, generator=g).to(dtype)
    kv = [torch.randn(2, 3, 17, 64, generator=g).to(dtype) for _ in range(2)]
    mask = torch.rand(2, 1, 1, 17, generator=g) > 0.2

    def by_ops():
        return (ops.routed_experts(x, slots, weights, gate_up, down), ops.linear_rows(x, w, bias),
                ops.decode_attention(q, *kv, mask, 0.125))

    expected = (kernel.routed_experts(x, slots, weights, gate_up, down), kernel.linear_rows(x, w, bias),
                kernel.decode_attention(q, *kv, mask, 0.125))
    torch._dynamo.utils.counters.clear()
    for got in (by_ops(), torch.compile(by_ops, fullgraph=True, backend="aot_eager")()):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch._dynamo.utils.counters["graph_break"]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_forecast_equals_the_numpy_forecast(dtype):
    """``router_forecast``: n routers' one-token forecast in one call, the numpy path's values (to float32
    rounding) and top-k, bit for bit the same on the portable path; one line for a wrong shape."""
    from moe_offload.runtime.cross_layer import _one_token_mixture

    gen = torch.Generator().manual_seed(3)
    n, E, H, k = 3, 32, 576, 8
    w = (torch.randn(n * E, H, generator=gen) * 0.3).to(dtype)
    x = torch.randn(H, generator=gen).to(dtype)
    got = kernel.router_forecast(w, x, n, k)
    want = torch.from_numpy(_one_token_mixture(w.float().numpy(), x.float().numpy(), n, k))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert torch.equal(got.topk(k, -1).indices.sort(-1).values, want.topk(k, -1).indices.sort(-1).values)
    assert torch.allclose(got.sum(-1), torch.ones(n))
    assert torch.equal(kernel.router_forecast(w, x, n, k, portable=True), got)
    with pytest.raises(RuntimeError, match="n \\* E"):
        kernel.router_forecast(w, x, 5, k)
