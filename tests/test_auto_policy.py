"""``--policy auto``: the history policy chosen from a simulation of the first prompt's own routing."""

import numpy as np

from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.core.auto_policy import DECODE_SAMPLE, choose_policy, token_needs


def test_token_needs_prefill_half_then_one_decode_step_per_token():
    routing = [np.array([[0, 1], [1, 2], [3, 3]]), np.array([[3, 3], [0, 1], [2, 0]])]
    assert token_needs(routing, 4) == [(0, 0, [[0, 1], [7]], [[1, 1], [2]]),
                                       (0, 1, [[1, 2], [4, 5]], [[1, 1], [1, 1]]),
                                       (0, 2, [[3], [4, 6]], [[1], [1, 1]])]


def test_token_needs_decode_sample_is_bounded():
    """A long prompt: everything but its last DECODE_SAMPLE tokens is the prefill step, then one decode step each."""
    T = 4 * DECODE_SAMPLE
    routing = [np.arange(T).reshape(T, 1)]
    needs = token_needs(routing, T)
    assert len(needs) == 1 + DECODE_SAMPLE
    assert needs[0] == (0, 0, [list(range(T - DECODE_SAMPLE))], [[1] * (T - DECODE_SAMPLE)])
    assert [n[2] for n in needs[1:]] == [[[t]] for t in range(T - DECODE_SAMPLE, T)]
    assert [n[1] for n in needs[1:]] == list(range(1, DECODE_SAMPLE + 1))


def test_choice_follows_the_routing():
    # 80 tokens routed to experts 100..179 (one each), then a hot expert 0 reused after 3 new ones each time; 3
    # slots: LRU evicts 0 just before each reuse (0 hits); frequency keeps it -> a frequency policy. The decode
    # sample is the last DECODE_SAMPLE (32) tokens, in which 0 comes 8 times: hit from its second access on at least
    seq = list(range(100, 180)) + [0 if t % 4 == 0 else 1 + t for t in range(80)]
    best, rates = choose_policy([np.array([[e] for e in seq])], num_experts=200, top_k=1, num_slots=3)
    assert rates["lru"] == 0.0 and best != "lru" and rates[best] >= 7 / DECODE_SAMPLE
    # strong recency (each expert reused right away, then never): the frequency policies tie with LRU; LRU wins ties
    runs = [np.array([[t // 3] for t in range(120)])]
    best, rates = choose_policy(runs, num_experts=40, top_k=1, num_slots=2)
    assert best == "lru" and rates["lru"] == max(rates.values())


def test_runtime_auto_is_lossless_and_reports_its_choice(tiny_dirs):
    d = tiny_dirs["qwen3_moe"]
    prompt = "Hello there, how are you today? The slot pool is shared by all MoE layers."
    full = load_full(d, device="cpu")
    ids = encode_prompt(full.tokenizer, prompt)
    ref = generate_ids(full, ids, 10)[0]
    lm = load_offloaded(d, device="cpu", residency=0.3, policy="auto", progress=False)
    assert generate_ids(lm, ids, 10)[0] == ref
    chooser = lm.engine.auto_policy
    assert chooser.choice is not None and lm.engine.policy_name == f"auto:{chooser.choice}"
    assert len(chooser.routing) == lm.num_moe_layers and chooser.routing[0].shape == (len(ids), lm.top_k)
    best, rates = choose_policy(chooser.routing, lm.num_experts, lm.top_k, lm.engine.pool.num_slots)
    assert (best, rates) == (chooser.choice, chooser.rates) and rates[best] >= rates["lru"]
