#!/usr/bin/env python3
"""Where a forecast policy's per-step Python goes (issue 47): cProfile over the decode of one ShareGPT prompt with
the experts read from disk, the forecast, prefetch and eviction functions by cumulative time.

    python scripts/profile_forecast_cost.py [POLICY] [MODEL] [RESIDENCY]     # default xl+gate testbed-sparse-wide 0.25

cProfile inflates short Python calls (about 2x here); the decode step's CPU account (`generate`'s "decode step CPU")
gives the uninflated totals.
"""

import cProfile
import pstats
import sys

import torch

from moe_offload.core.policy_spec import parse_policy
from moe_offload.generation.generate import run
from moe_offload.models.loader import load_offloaded
from moe_offload.predictor.cross_layer import attach_forecasts
from moe_offload.testbed.resolve import resolve_model
from moe_offload.testbed.sharegpt import human_turns

policy = parse_policy(sys.argv[1] if len(sys.argv) > 1 else "xl+gate")
model = sys.argv[2] if len(sys.argv) > 2 else "testbed-sparse-wide"
residency = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
torch.set_num_threads(2)
lm = load_offloaded(resolve_model(model, progress=False), residency=residency, policy=policy, host_store="disk",
                    progress=False)
if policy.forecast_driven:
    attach_forecasts(lm, policy, None)
prompts = human_turns(1, offset=600)
run(lm, prompts, 8)  # warm-up
prof = cProfile.Profile()
prof.enable()
_, stats = run(lm, prompts, 48)
prof.disable()
print(f"{policy.name}: {stats.decode_tokens_per_s:.2f} decode tok/s under cProfile, {stats.decode_tokens} steps")
pstats.Stats(prof).sort_stats("cumtime").print_stats("core/|predictor/|runtime/(prefetch|cross|transfer|slots)", 25)
