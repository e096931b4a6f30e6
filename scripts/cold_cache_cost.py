#!/usr/bin/env python3
"""What a cross-layer forecast's hand-over costs with the caches warm and with them cold (issue 47, session 48).

    python scripts/cold_cache_cost.py [RESIDENCY] [FLUSH_MB]     # default 0.45 400

Loads testbed-sparse-wide with ``xl+gate`` from disk, decodes a few tokens, then times each call of the deliver
path (the routers' forecast, probabilistic Belady's ``observe``, the prefetcher's ``observe``, the blend that makes
the ``Forecast``) on one forecast: 200 times back to back (warm), and 30 times each right after streaming FLUSH_MB
through the caches (an in-place add over a buffer larger than the last-level cache: what a decode step's expert
weights do between two layers). Medians in microseconds. ``scripts/forecast_call_costs.py`` gives the same calls'
CPU time inside the decode step, which falls between the two.
"""

import sys
import time

import numpy as np
import torch

from moe_offload.core.policy_spec import parse_policy
from moe_offload.generation.generate import run
from moe_offload.models.loader import load_offloaded
from moe_offload.predictor.blend import blend_forecast
from moe_offload.predictor.cross_layer import CrossLayerFeed, attach_forecasts
from moe_offload.testbed.resolve import resolve_model
from moe_offload.testbed.sharegpt import human_turns

residency = float(sys.argv[1]) if len(sys.argv) > 1 else 0.45
flush_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 400
policy = parse_policy("xl+gate")
torch.set_num_threads(2)
lm = load_offloaded(resolve_model("testbed-sparse-wide", progress=False), residency=residency, policy=policy,
                    host_store="disk", progress=False)
attach_forecasts(lm, policy, None)
feed = next(o for o in lm.engine.observers if isinstance(o, CrossLayerFeed))
run(lm, human_turns(1, offset=600), 8)  # a decode step ran: every router's input is captured
layer = 10
buf = torch.empty(flush_mb << 20, dtype=torch.uint8)
xl = feed.source.probs(layer)
forecast = blend_forecast(0, 5, layer, xl, None, feed.weights)
calls = {"router forecast (CrossLayerForecaster.probs)": lambda: feed.source.probs(layer),
         "blend_forecast": lambda: blend_forecast(0, 5, layer, xl, None, feed.weights)}
for c in feed.consumers:
    calls[f"{type(c).__name__}.observe"] = lambda c=c: c.observe(forecast)
print(f"xl+gate, testbed-sparse-wide at residency {residency}; cold: after {flush_mb} MB streamed\n")
print("| call | warm, us | cold, us |")
print("|---|---:|---:|")
for name, fn in calls.items():
    warm, cold = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t0)
    for _ in range(30):
        buf.add_(1)
        t0 = time.perf_counter()
        fn()
        cold.append(time.perf_counter() - t0)
    print(f"| {name} | {np.median(warm) * 1e6:.1f} | {np.median(cold) * 1e6:.1f} |")
lm.close()
