#!/usr/bin/env python3
"""How far above `lru` forecasts could take one trace, at best (issue 47, session 50): the simulator's projection
(``sim.prefetch_sim.replay_policy`` with ``CoreCosts``) of each policy against `lru`, every policy charged `lru`'s
decision core (so only the forecasts and the reads differ), each prefetch charged PREFETCH_MS of CPU (a bare direct
read of one expert here is 0.09 ms, ``scripts/read_cpu_cost.py``) and 0:

- `belady`: eviction by the true future, no prefetching (the simulator's oracle);
- `xl`, `xl+gate`: the cross-layer forecasts the trace recorded (``trace collect --xl-forecasts``);
- `xl-oracle`, `xl-oracle+gate`: the same forecasts with their probabilities replaced by the true experts
  (``sim.forecasts.oracle_stream(weighted=False)``): perfect cross-layer forecasts;
- with PREDICTOR (a trained SeqMoE predictor of the trace's model): `seqmoe-cacheonly` (its forecasts evict, no
  prefetching), `seqmoe`, `seqmoe-xl` and `seqmoe-xl+gate` (its forecasts blended with the cross-layer ones).

    python scripts/forecast_ceiling.py TRACE LAYER_US LINK_EPL LRU_MS PREFETCH_MS [PREDICTOR] [--xl-depth D]
        [--preempt P] [--policies P1,P2] [--half-life H]

LAYER_US: the FullLoad layer time (us) and LINK_EPL: the disk link in experts per layer time, both from a
`bench decode --host-store disk` footer (one value, or two comma-separated: at 25% and at 45%); LRU_MS: `lru`'s
predictor + management (ms per decode step). Prints, per residency (0.25, 0.45), each policy's projected decode
fraction of FullLoad, its ratio to `lru`'s, its decode misses and prefetches. ``--xl-depth D``: the cross-layer
forecasts replayed D rows deep (``sim.forecasts.TraceXL``; default: as the trace recorded them). ``--half-life H``:
the cross-layer policies' eviction with the reuse frequency's half-life H decode steps
(``core.prob_belady.CYCLE_HALF_LIFE_STEPS``; session 52's sweep). The projection and
the runtime agree within 15% on this machine (docs/benchmarks.md, session 49), so a policy whose ceiling here is
below a target cannot reach it at runtime with these forecasts.
"""

import argparse

from moe_offload.common.threads import compute_share
from moe_offload.core import prob_belady
from moe_offload.core.forecast import ROLLOUT_EVERY
from moe_offload.core.policy_spec import parse_policy
from moe_offload.models.loader import num_slots_for
from moe_offload.sim.forecasts import forecast_stream, oracle_stream, xl_stream
from moe_offload.sim.prefetch_sim import CoreCosts, replay_policy
from moe_offload.sim.simulator import layer_needs
from moe_offload.trace.format import load_trace

ap = argparse.ArgumentParser(description="what forecasts could give a trace at lru's decision cost")
ap.add_argument("trace")
ap.add_argument("layer_us", type=float)
ap.add_argument("link_epl")
ap.add_argument("lru_ms", type=float)
ap.add_argument("prefetch_ms", type=float)
ap.add_argument("predictor", nargs="?")
ap.add_argument("--xl-depth", type=int, default=None)
ap.add_argument("--preempt", type=float, default=None,
                help="share of one copy a miss waits behind a prefetch in flight (default: the emulated link's 1/8; "
                     "the disk tier's DiskStore.preempt_share: 1 for experts up to its 4 MiB requests)")
ap.add_argument("--policies", default=None, help="comma-separated: only these of the policies above (and lru)")
ap.add_argument("--half-life", type=float, default=None,
                help="the cross-layer policies' reuse-frequency half-life in decode steps (default: "
                     "core.prob_belady.CYCLE_HALF_LIFE_STEPS)")
args = ap.parse_args()
if args.half_life is not None:
    if not args.half_life > 0:
        ap.error(f"--half-life must be > 0, got {args.half_life}")
    prob_belady.CYCLE_HALF_LIFE_STEPS = args.half_life
if args.preempt is not None and not 0.0 < args.preempt <= 1.0:
    ap.error(f"--preempt must be in (0, 1], got {args.preempt}")
link_opts = {} if args.preempt is None else {"preempt": args.preempt}
path, layer_us, lru_ms, pf_ms = args.trace, args.layer_us, args.lru_ms, args.prefetch_ms
links = [float(x) for x in args.link_epl.split(",")]
trace = load_trace(path)
needs = layer_needs(trace)
t = layer_us * 1e-6
overhead = lru_ms * 1e-3 / trace.num_moe_layers / t   # ms per decode step -> layer times per MoE layer
streams = {"xl": xl_stream(trace, depth=args.xl_depth)}
streams["xl-oracle"] = oracle_stream(streams["xl"], trace, weighted=False)
popularity = None
if args.predictor:
    from moe_offload.predictor.model import load_predictor

    pset = load_predictor(args.predictor, model_id=trace.header.get("model_id"))
    streams["seqmoe"] = streams["seqmoe-cacheonly"] = forecast_stream(pset, trace, rollout_every=ROLLOUT_EVERY)
    streams["seqmoe-xl"] = xl_stream(trace, pset, depth=args.xl_depth)
    popularity = pset.header.prefill_popularity  # SeqMoE §8.4's prefill prefetching, as simulate and the runtime
policies = ["belady"] + [p + g for p in streams for g in ("", "+gate") if parse_policy(p).prefetch or not g]
if args.policies:
    wanted = args.policies.split(",")
    if unknown := [p for p in wanted if p not in policies]:
        ap.error(f"--policies: {', '.join(unknown)} not among {', '.join(policies)}")
    policies = wanted

for residency, link in zip((0.25, 0.45), links * 2 if len(links) == 1 else links):
    slots = num_slots_for(trace.num_moe_layers * trace.num_experts, trace.top_k, residency, None)  # as the runtime
    res, lru = replay_policy(trace, parse_policy("lru"), slots, link, needs=needs, costs=CoreCosts(overhead=overhead))
    print(f"\nresidency {residency}, link {link} experts per layer time: lru {lru:.3f} of FullLoad, "
          f"{res.decode_misses} decode misses\n")
    print("| policy | prefetch CPU per expert, ms | projected vs FullLoad | vs lru | decode misses | prefetches |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in policies:
        spec = parse_policy(name)
        for cpu in ((pf_ms, 0.0) if spec.prefetch else (0.0,)):
            costs = CoreCosts(overhead=overhead, prefetch_cpu=cpu * 1e-3 * compute_share() / t)
            r, f = replay_policy(trace, spec, slots, link, forecasts=streams.get(spec.family), needs=needs,
                                 costs=costs, prefill_popularity=popularity if spec.needs_predictor else None,
                                 **link_opts)
            print(f"| {name} | {cpu:.2f} | {f:.3f} | {f / lru:.3f} | {r.decode_misses} | "
                  f"{getattr(r, 'prefetches', 0)} |", flush=True)
