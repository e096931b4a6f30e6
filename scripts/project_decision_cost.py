#!/usr/bin/env python3
"""What the cross-layer policies would decode against `lru` if their decision core or their reads cost less (issue 47,
session 48): the simulator's projection (``sim.prefetch_sim.replay_policy`` with ``CoreCosts``) on a trace with
cross-layer forecasts, charged the costs `bench decode` measured, then with the decision core at LRU's cost and each
prefetch's CPU set lower, for `xl+gate` and for `xl` (no gate: every task the scheduler picks is prefetched).

    python scripts/project_decision_cost.py TRACE LAYER_US LINK_EPL RESIDENCY LRU_MS XLGATE_MS PREFETCH_MS

TRACE: a trace of testbed-sparse-wide collected with ``--xl-forecasts``; LAYER_US: the FullLoad layer time (us) and
LINK_EPL: the disk link in experts per layer time, both from a `bench decode --host-store disk` footer; LRU_MS and
XLGATE_MS: the rows' predictor + management (ms per decode step, its time breakdown); PREFETCH_MS: `xl+gate`'s
prefetch reads' CPU per prefetched expert (ms: its CPU account's prefetch reads over the MB prefetched / 2.654),
charged times the share of the cores the compute uses (``common.threads.compute_share``, as `bench decode` does).
The lower prefetch costs tried: 0.3, 0.2, 0.09 (a bare direct read of one expert here, ``scripts/read_cpu_cost.py``),
0.05 and 0 ms. Prints the projected decode fraction of FullLoad of each variant, its ratio to `lru`'s and its
prefetches.
"""

import sys

from moe_offload.common.threads import compute_share
from moe_offload.core.policy_spec import parse_policy
from moe_offload.sim.forecasts import xl_stream
from moe_offload.sim.prefetch_sim import CoreCosts, replay_policy
from moe_offload.sim.simulator import layer_needs
from moe_offload.trace.format import load_trace

if len(sys.argv) != 8:
    sys.exit("usage: project_decision_cost.py TRACE LAYER_US LINK_EPL RESIDENCY LRU_MS XLGATE_MS PREFETCH_MS")
path, layer_us, link, residency, lru_ms, xg_ms, pf_ms = sys.argv[1], *map(float, sys.argv[2:8])
trace = load_trace(path)
needs, forecasts = layer_needs(trace), xl_stream(trace)
t = layer_us * 1e-6
slots = round(residency * trace.num_moe_layers * trace.num_experts)


def per_layer(ms_per_step: float) -> float:
    """ms per decode step -> layer times per MoE layer (``CoreCosts.overhead``)."""
    return ms_per_step * 1e-3 / trace.num_moe_layers / t


_, lru = replay_policy(trace, parse_policy("lru"), slots, link, needs=needs, costs=CoreCosts(overhead=per_layer(lru_ms)))
print(f"residency {residency}, link {link} experts per layer time: lru {lru:.3f} of FullLoad\n")
print("| policy | decision core | prefetch CPU per expert, ms | projected vs FullLoad | vs lru | prefetches |")
print("|---|---|---:|---:|---:|---:|")
variants = [("xl+gate", "as measured", xg_ms, pf_ms)]
variants += [(pol, "at lru's cost", lru_ms, cpu) for pol in ("xl+gate", "xl") for cpu in (pf_ms, 0.3, 0.2, 0.09, 0.05, 0.0)]
for pol, label, ms, cpu in variants:
    res, f = replay_policy(trace, parse_policy(pol), slots, link, forecasts=forecasts, needs=needs,
                           costs=CoreCosts(overhead=per_layer(ms), prefetch_cpu=cpu * 1e-3 * compute_share() / t))
    print(f"| {pol} | {label} | {cpu:.3f} | {f:.3f} | {f / lru:.3f} | {res.prefetches} |")
