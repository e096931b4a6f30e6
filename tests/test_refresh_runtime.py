"""The diffusion refresh planners in the real runtime (runtime/refresh_engine.py): reactive, tide-fixed and tide
on tiny LLaDA2-MoE checkpoints give FullLoad's tokens; host fallback computes what the device path computes."""

import pytest
import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.generation.diffusion import run_diffusion
from moe_offload.runtime.formats import ExpertRows
from moe_offload.models.loader import load_full, load_offloaded

PROMPTS = ["hello world", "the cat sat on"]


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    outs, _, _ = run_diffusion(load_full(tiny_dirs["llada2_moe"]), PROMPTS, 16, block_length=8, steps=4)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("policy", ["reactive", "tide-fixed", "tide-fixed-T3", "tide"])
@pytest.mark.parametrize("residency", [0.25, 0.5])
def test_refresh_policies_are_lossless(tiny_dirs, reference, policy, residency):
    """Greedy diffusion tokens equal FullLoad's; the counters add up: every active expert of every layer call is a
    hit or a miss, tide* compute misses on the host (reactive never does), asynchronous copies went through the
    link emulation."""
    # a slow link (2 ms per expert): on this CPU host and device compute cost the same, so tide's calibrated
    # per-miss choice keeps its misses on the host whatever the timing noise
    lm = load_offloaded(tiny_dirs["llada2_moe"], residency=residency, policy=policy, progress=False,
                        seconds_per_expert=2e-3)
    eng = lm.engine
    # tiny llada2: 2 MoE layers (the first of 3 is dense) of 16 experts, top-4: budget = ceil(ceil(r * 32) / 2)
    assert eng.budget == {0.25: 4, 0.5: 8}[residency] and eng.pool.num_slots == 2 * eng.budget
    outs, st, _ = run_diffusion(lm, PROMPTS, 16, block_length=8, steps=4)
    eng.close()
    assert [o.token_ids for o in outs] == reference
    o = st.offload
    assert o.hits > 0 and o.misses > 0 and o.steps > 0
    if policy == "reactive":
        assert o.host_experts == 0 and o.blocking_loads == o.misses
    else:
        assert o.host_experts > 0 and o.host_tokens >= o.host_experts


@pytest.mark.parametrize("residency", [0.25, 0.5])
def test_tide_on_demand_rounds_are_lossless(tiny_dirs, reference, residency):
    """A fast link and a slow emulated host make tide swap misses in on demand, in rounds that reuse the slots of
    experts already computed in the step: tokens stay FullLoad's."""
    lm = load_offloaded(tiny_dirs["llada2_moe"], residency=residency, policy="tide", progress=False,
                        seconds_per_expert=1e-5, host_seconds_per_expert=2e-3)
    assert lm.engine.planner.on_demand
    outs, st, _ = run_diffusion(lm, PROMPTS, 16, block_length=8, steps=4)
    lm.engine.close()
    assert [o.token_ids for o in outs] == reference
    o = st.offload
    assert o.blocking_loads > 0 and o.rounds > o.layer_calls  # some layer calls ran several rounds


def test_full_budget_never_copies_or_falls_back(tiny_dirs, reference):
    for policy in ("reactive", "tide-fixed", "tide"):
        lm = load_offloaded(tiny_dirs["llada2_moe"], residency=1.0, policy=policy, progress=False)
        outs, st, _ = run_diffusion(lm, PROMPTS, 16, block_length=8, steps=4)
        lm.engine.close()
        assert [o.token_ids for o in outs] == reference
        assert st.offload.misses == 0 and st.offload.host_experts == 0 and st.offload.bytes_loaded == 0, policy


def test_host_fallback_equals_device_path(tiny_dirs):
    """One layer's token-expert pairs computed from the host store and from the slots (all experts resident)."""
    lm = load_offloaded(tiny_dirs["llada2_moe"], residency=1.0, policy="tide-fixed", progress=False)
    eng = lm.engine
    mod = next(m for m in lm.model.modules() if getattr(m, "_moe_offload", None) == (eng, 1))
    torch.manual_seed(0)
    T, k, E = 5, lm.top_k, lm.num_experts
    hidden = torch.randn(T, lm.model.config.hidden_size)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    gid = (idx + E).reshape(-1)
    w = torch.rand(T * k)
    mask = torch.ones(T * k, dtype=torch.bool)
    dev = torch.zeros(T * k, hidden.shape[1])
    host = torch.zeros_like(dev)
    eng._accumulate(dev, mod, eng.pool.rows, hidden, eng.pool.lookup[gid], mask, w, k,
                    sorted(set(eng.pool.lookup[gid].tolist())))
    eng._accumulate(host, mod, ExpertRows(eng.pool.format, eng.store.buf), hidden, gid, mask, w, k,
                    sorted(set(gid.tolist())))
    eng.close()
    assert torch.allclose(dev, host, atol=1e-6) and dev.abs().sum() > 0


def test_bad_refresh_policy_names(tiny_dirs):
    with pytest.raises(MoeOffloadError, match="tide-fixed-T"):
        load_offloaded(tiny_dirs["llada2_moe"], residency=0.5, policy="tide-fixed-Tx", progress=False)


def test_refresh_policy_refused_for_autoregressive_models(tiny_dirs):
    with pytest.raises(MoeOffloadError, match="for diffusion models"):
        load_offloaded(tiny_dirs["mixtral"], residency=0.5, policy="tide", progress=False)


@pytest.mark.parametrize("overlap, started, blocked, want", [
    (True, 10.0, 0.0, 10.0 + 5e-3),         # host part counted from the start of the device compute
    (True, 10.0, 2e-3, 10.0 + 7e-3),        # ... plus blocking copies the layer waited for after that
    (True, None, 0.0, 20.0 + 5e-3),         # no device compute in the layer: from the start of the host part
    (False, 10.0, 2e-3, 20.0 + 5e-3),       # the authors' order: after the device part
])
def test_host_fallback_emulated_deadline(monkeypatch, overlap, started, blocked, want):
    """The emulated host duration of a layer (3 token-experts x 1 ms + 1 expert x 2 ms = 5 ms) ends at the
    deadline the overlap rule gives (runtime.host_fallback), with the pairs computed by the given accumulate."""
    import moe_offload.runtime.host_fallback as hf

    clock = iter([started if started is not None else 0.0, 20.0, 20.0])
    deadlines = []
    monkeypatch.setattr(hf, "now", lambda: next(clock))
    monkeypatch.setattr(hf, "wait_until", deadlines.append)
    monkeypatch.setattr(hf, "host_expert_rows", lambda store, fmt, g, m, eids: (None, g, eids))
    calls = []
    fb = hf.HostFallback(None, None, token_s=1e-3, expert_s=2e-3, overlap=overlap,
                         accumulate=lambda pairs, *a: (calls.append(a), pairs.add_(1.0)))
    fb.begin_layer()
    if started is not None:
        fb.device_starts()
        fb.blocked(blocked)
    else:
        next(clock)  # keep the clock sequence aligned
    staged = fb.stage(torch.zeros(2, 4), torch.tensor([7, 9, 7, 9]), torch.ones(4), torch.tensor([1, 0, 1, 0]).bool(),
                      [9, 7], tokens=3, experts=1)
    pairs = torch.zeros(4, 4)
    fb.compute(pairs, None, staged)
    assert deadlines == [pytest.approx(want)] and staged.eids == [7, 9] and len(calls) == 1
    assert torch.equal(pairs, torch.ones(4, 4))
