#!/usr/bin/env python3
"""How the cost gate of `xl+gate` settles in the simulator, against `xl` without a gate (issue 47, session 49).

    python scripts/gate_calibration_probe.py TRACE RESIDENCY LRU_MS DECISION_MS PREFETCH_MS

TRACE: a trace of testbed-sparse-wide collected with ``--xl-forecasts`` (``scripts/project_decision_cost.py``'s);
RESIDENCY: the share of the experts in memory; LRU_MS: `lru`'s predictor + management (ms per decode step);
DECISION_MS: the cross-layer policies' (both charged the same); PREFETCH_MS: each prefetch's CPU (ms). The link and
the layer time are session 48's (2.69 experts per layer time, 3146 us). Prints, for `xl+gate` and `xl`, the
projected decode speed against `lru`'s, the prefetches and how many of them a layer used or the pool evicted unused
(``SlotTable.prefetches_used`` / ``prefetches_wasted``), and for `xl+gate` the gate's state every ~16 decode steps:
a miss's stall and a prefetch's CPU (layer times), the link's busy share, ``used_scale`` and the threshold a
forecast's chance of use must pass (``core.prefetch_cost``).
"""

import sys

from moe_offload.common.threads import compute_share
from moe_offload.core import prefetch_cost, slots
from moe_offload.core.policy_spec import parse_policy
from moe_offload.sim.forecasts import xl_stream
from moe_offload.sim.prefetch_sim import CoreCosts, replay_policy
from moe_offload.sim.simulator import layer_needs
from moe_offload.trace.format import load_trace

if len(sys.argv) != 6:
    sys.exit("usage: gate_calibration_probe.py TRACE RESIDENCY LRU_MS DECISION_MS PREFETCH_MS")
path, residency, lru_ms, ms, cpu = sys.argv[1], *map(float, sys.argv[2:6])
trace = load_trace(path)
needs, forecasts = layer_needs(trace), xl_stream(trace)
t, L, link = 3146e-6, trace.num_moe_layers, 2.69
n_slots = round(residency * L * trace.num_experts)
tables, states = [], []
table_init, cost_of = slots.SlotTable.__init__, prefetch_cost.CostMeter.cost.fget


def recording_init(self, *args, **kw):
    table_init(self, *args, **kw)
    tables.append(self)


def recording_cost(self):
    c = cost_of(self)
    if c is not None:
        states.append((c.miss_s, c.prefetch_cpu_s, c.link_busy, c.used_scale, c.threshold))
    return c


slots.SlotTable.__init__ = recording_init
prefetch_cost.CostMeter.cost = property(recording_cost)
_, lru = replay_policy(trace, parse_policy("lru"), n_slots, link, needs=needs,
                       costs=CoreCosts(overhead=lru_ms * 1e-3 / L / t))
print(f"residency {residency}, decision core {ms} ms per step (lru {lru_ms}), {cpu} ms per prefetch: "
      f"lru {lru:.3f} of FullLoad\n")
print("| policy | vs lru | prefetches | used | evicted unused |")
print("|---|---:|---:|---:|---:|")
for pol in ("xl+gate", "xl"):
    res, f = replay_policy(trace, parse_policy(pol), n_slots, link, forecasts=forecasts, needs=needs,
                           costs=CoreCosts(overhead=ms * 1e-3 / L / t, prefetch_cpu=cpu * 1e-3 * compute_share() / t))
    tb = tables[-1]
    print(f"| {pol} | {f / lru:.3f} | {res.prefetches} | {tb.prefetches_used} | {tb.prefetches_wasted} |")
print("\nxl+gate's gate, every ~16 decode steps: miss_s, prefetch_cpu_s (layer times), link_busy, used_scale, "
      "threshold")
for s in states[::max(1, len(states) // 12)]:
    print("  " + "  ".join(f"{x:.3f}" for x in s))
