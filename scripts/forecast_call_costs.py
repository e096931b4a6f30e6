#!/usr/bin/env python3
"""What each per-layer call of a forecast policy costs in the decode step (issue 47), measured two ways:

- in the step: the calling thread's CPU time (``time.thread_time``) inside each call during the decode of one
  ShareGPT prompt with the experts read from disk, per call and per step (the main thread's, except
  ``Prefetcher.fetch_waits`` / ``load_on_demand`` on a layer that reads while it computes: the overlap thread's,
  ``runtime.read_overlap``);
- alone: the same calls repeated on one forecast (``timeit``), with the caches warm; and cold: the median wall
  time of 30 calls, each right after FLUSH_MB were streamed through the caches (an in-place add over a buffer
  larger than the last-level cache: what a decode step's expert weights do between two layers; session 48).

    python scripts/forecast_call_costs.py [POLICY] [MODEL] [RESIDENCY] [FLUSH_MB] [XL_DEPTH] [numpy]
    # default xl+gate testbed-sparse-wide 0.25 400 and core.forecast.XL_DEPTH; "numpy": a forecast's intake in
    # numpy (the scheduler's candidates_kernel and probabilistic Belady's scores_kernel off; session 53's "before")

The gap between the warm and the in-step figures is what the calls pay for running between the experts' kernels,
which stream the experts' bytes through the caches: the interpreter's code and the decision core's arrays are
fetched again at each layer; the cold column bounds it.
"""

import collections
import sys
import time
import timeit

import torch

from moe_offload.core import prefetch_queue
from moe_offload.core.forecast import XL_DEPTH
from moe_offload.core.policy_spec import parse_policy
from moe_offload.generation.generate import run
from moe_offload.models.loader import load_offloaded
from moe_offload.predictor.blend import blend_forecast
from moe_offload.predictor.cross_layer import CrossLayerFeed, attach_forecasts
from moe_offload.testbed.resolve import resolve_model
from moe_offload.testbed.sharegpt import human_turns

policy = parse_policy(sys.argv[1] if len(sys.argv) > 1 else "xl+gate")
model = sys.argv[2] if len(sys.argv) > 2 else "testbed-sparse-wide"
residency = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
flush_mb = int(sys.argv[4]) if len(sys.argv) > 4 else 400
depth = int(sys.argv[5]) if len(sys.argv) > 5 else XL_DEPTH
if not policy.cross_layer:
    sys.exit("forecast_call_costs.py: a cross-layer policy (xl, xl+gate)")
torch.set_num_threads(2)
lm = load_offloaded(resolve_model(model, progress=False), residency=residency, policy=policy, host_store="disk",
                    progress=False)
attach_forecasts(lm, policy, None, xl_depth=depth)
eng = lm.engine
if len(sys.argv) > 6 and sys.argv[6] == "numpy":
    eng.prefetcher.scheduler.candidates_kernel = None
    eng.table.policy.scores_kernel = None
feed = next(o for o in eng.observers if isinstance(o, CrossLayerFeed))
pf, pol, table = eng.prefetcher, eng.table.policy, eng.table
cpu, calls = collections.Counter(), collections.Counter()


def timed(obj, name: str, label: str):
    """Wrap ``obj.name`` so that its calls' thread CPU time adds up under ``label``."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu[label] += time.thread_time_ns() - t0
            calls[label] += 1
    setattr(obj, name, wrapper)
    return fn


originals = {"forecast (router_forecast)": timed(feed.source, "probs", "forecast (router_forecast)")}
for c in feed.consumers:
    originals[f"{type(c).__name__}.observe"] = timed(c, "observe", f"{type(c).__name__}.observe")
for name in ("land_ready", "issue", "fetch_waits", "load_on_demand"):
    timed(pf, name, f"Prefetcher.{name}")
timed(table, "plan_layer", "SlotTable.plan_layer")
timed(table, "release", "SlotTable.release")
timed(feed, "deliver", "CrossLayerFeed.deliver")    # the forecast and its consumers below, and the blend
timed(pf, "settle", "Prefetcher.settle")
timed(eng, "_needed", "OffloadEngine._needed")
timed(eng.clock, "lap", "StepClock.lap")
# inside the calls above (their rows include these): the policy's events, the scheduler's choice, the reservations
for name in ("victim", "on_layer_access", "on_insert", "on_evict"):
    timed(pol, name, f"  {type(pol).__name__}.{name}")
timed(pf.scheduler, "select", "  scheduler.select")
timed(table, "prefetch", "  SlotTable.prefetch")
timed(pf.transfer, "submit", "  transfer.submit")
# a forecast's intake (session 53: native with the kernels, numpy with "numpy"), inside the consumers' observe rows
for name in ("_gated_tasks", "forecast_candidates"):
    timed(prefetch_queue, name, f"    prefetch_queue.{name}")
timed(pol, "update_forecast", f"    {type(pol).__name__}.update_forecast")
prompts = human_turns(1, offset=600)
run(lm, prompts, 8)  # warm-up
cpu.clear()
calls.clear()
_, stats = run(lm, prompts, 48)
steps = stats.decode_tokens
print(f"{policy.name} (cross-layer forecasts {depth} deep), {model} at residency {residency}: "
      f"{stats.decode_tokens_per_s:.2f} decode tok/s, {steps} steps\n")
print("| call | in the step: us per call | ms per step | calls per step | alone, warm: us per call | alone, cold: "
      "us per call |")
print("|---|---:|---:|---:|---:|---:|")
layer = 10
xl = originals["forecast (router_forecast)"](layer)
fc = blend_forecast(0, 5, layer, xl, None, feed.weights)
alone = {"forecast (router_forecast)": lambda: originals["forecast (router_forecast)"](layer)}
for c in feed.consumers:
    alone[f"{type(c).__name__}.observe"] = lambda c=c: originals[f"{type(c).__name__}.observe"](fc)
measured, counted = dict(cpu), dict(calls)
cpu, calls = collections.Counter(), collections.Counter()  # the "alone" timings below go through the same wrappers
flush = torch.empty(flush_mb << 20, dtype=torch.uint8)


def cold_us(fn) -> float:
    """Median wall microseconds of ``fn()`` right after ``flush_mb`` streamed through the caches."""
    times = []
    for _ in range(30):
        flush.add_(1)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


for label, ns in sorted(measured.items(), key=lambda kv: -kv[1]):
    fn = alone.get(label)
    warm_us = f"{timeit.timeit(fn, number=2000) / 2000 * 1e6:.1f}" if fn else "-"
    cold = f"{cold_us(fn):.1f}" if fn else "-"
    print(f"| {label} | {ns / 1e3 / counted[label]:.1f} | {ns / 1e6 / steps:.2f} | {counted[label] / steps:.1f} | "
          f"{warm_us} | {cold} |")
lm.close()
