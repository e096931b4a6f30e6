#!/usr/bin/env python3
"""The disk tier's misses read while the resident experts compute (``runtime.read_overlap``), against reading
first and computing after: one model loaded once, decode runs alternating ABAB (A: without the overlap, B: with),
the tokens of every run compared with the first.

    python scripts/read_overlap_ab.py [POLICY] [MODEL] [RESIDENCY] [ROUNDS]   # default lru testbed-sparse-wide 0.25 2

Prints one row per run (decode tok/s, the step's expert compute and stall in ms) and the B/A ratio of the mean
decode rates.
"""

import sys

import torch

from moe_offload.core.policy_spec import parse_policy
from moe_offload.generation.generate import run
from moe_offload.models.loader import load_offloaded
from moe_offload.predictor.cross_layer import attach_forecasts
from moe_offload.testbed.resolve import resolve_model
from moe_offload.testbed.sharegpt import human_turns

policy = parse_policy(sys.argv[1] if len(sys.argv) > 1 else "lru")
model = sys.argv[2] if len(sys.argv) > 2 else "testbed-sparse-wide"
residency = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
torch.set_num_threads(2)
lm = load_offloaded(resolve_model(model, progress=False), residency=residency, policy=policy, host_store="disk",
                    progress=False)
if policy.forecast_driven:
    attach_forecasts(lm, policy, None)
prompts = human_turns(1, offset=600)
run(lm, prompts, 8)  # warm-up
rates, first = {False: [], True: []}, None
print(f"{policy.name}, {model} at residency {residency}, 2 intra-op threads, experts read from disk\n")
print("| run | overlap | decode tok/s | expert compute ms | stall ms | same tokens |\n|---|---|---:|---:|---:|---|")
for i, enabled in enumerate([False, True] * rounds):
    lm.engine._overlap.enabled = enabled
    results, st = run(lm, prompts, 64)
    tokens = [r.token_ids for r in results]
    first = first or tokens
    ms = {k: v * 1e3 / lm.engine.breakdown.steps for k, v in lm.engine.breakdown.seconds.items()}
    rates[enabled].append(st.decode_tokens_per_s)
    print(f"| {i + 1} | {'B: on' if enabled else 'A: off'} | {st.decode_tokens_per_s:.2f} | "
          f"{ms['expert_compute']:.1f} | {ms['stall']:.1f} | {'yes' if tokens == first else 'NO'} |")
mean = {k: sum(v) / len(v) for k, v in rates.items()}
print(f"\nB / A (mean decode tok/s): {mean[True] / mean[False]:.3f}")
lm.close()
