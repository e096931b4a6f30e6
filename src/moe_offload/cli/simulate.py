"""``moe-offload simulate``: replay routing traces through the decision core (``sim.run.simulate``), say which
profiles were used, write the report (``sim.report``) and print its table."""

from __future__ import annotations

from pathlib import Path

from ..core.policy_spec import parse_policies
from ..errors import MoeOffloadError
from .args import add_predictor_lag_arg, add_rollout_every_arg, float_, positive_int, split_floats


def add_parser(sub) -> None:
    """Add ``simulate`` to the top-level subparsers."""
    sm = sub.add_parser("simulate", help="replay traces through the decision core; hit rates and projected speed")
    sm.add_argument("--trace", required=True, action="append", help="trace file (repeatable)")
    sm.add_argument("--residency", default="0.15,0.25,0.35,0.45", help="comma-separated fractions in (0, 1]")
    sm.add_argument("--policy", default="lru,lfu,lfru,prefill-hot,belady,belady-8",
                    help="comma-separated policies (default lru,lfu,lfru,prefill-hot,belady,belady-8)")
    sm.add_argument("--model-profile",
                    help="model profile for the time model (default: the shipped profile with the trace's model type "
                    "and geometry, e.g. testbed-sparse; else qwen3-30b-a3b-fp8, onto which the trace's miss rates "
                    "are projected)")
    sm.add_argument("--hardware",
                    help="hardware profile (see docs/traces-and-simulator.md), or this-machine (default: a platform "
                    "the model profile has a FullLoad speed on, rtx4090 first; for the testbed profiles this-machine "
                    "when `bench link` measured it, else rtx4090)")
    sm.add_argument("--full-load-tok-s", type=float_,
                    help="FullLoad decode tok/s when the profile has none (default: the profile's; without one the "
                    "speed columns stay empty)")
    sm.add_argument("--model", help="check that every trace was recorded on this checkpoint directory (default: no "
                    "check)")
    sm.add_argument("--predictor", help="a trained predictor (for seqmoe-cacheonly, seqmoe, seqmoe-infinity, "
                    "seqmoe-xl, and seqmoe-oracle: its forecasts replaced by the true future, an upper bound); when "
                    "the traces are its training traces, every policy replays only its held-out requests (default: "
                    "none). The policies xl, seqmoe-xl and xl-oracle (xl's forecasts replaced by the true future, "
                    "no predictor) need traces collected with --xl-forecasts")
    add_rollout_every_arg(sm, ", as the runtime runs it")
    sm.add_argument("--xl-depth", type=positive_int, default=None, metavar="D",
                    help="with --policy xl / seqmoe-xl / xl-oracle: later MoE layers each cross-layer forecast covers, "
                    "as generate --xl-depth (default: the runtime's, or what a trace recorded when that is less)")
    add_predictor_lag_arg(sm)
    sm.add_argument("--link", choices=["host", "disk"], default="host",
                    help="the link a miss crosses: host (default: the hardware profile's host->device link, experts "
                    "in host RAM) or disk (experts streamed from the profile's disk, its measured speed for one "
                    "expert's read at queue depth 1, `bench link --disk`)")
    sm.add_argument("--host-cache-frac", type=float_, metavar="F",
                    help="three tiers: a host cache holding this fraction of all routed experts (LRU, as --host-cache) "
                    "between the hardware profile's disk and the device slots; a device miss costs the host->device "
                    "copy plus, when the host cache misses too, a disk read (history policies; default: none)")
    sm.add_argument("--link-epl", type=float_,
                    help="link speed in experts per layer compute time for the prefetching replay (default: the model "
                    "profile's measured value on --hardware, SeqMoE §2.2: 1.39 for qwen3-30b-a3b-fp8 on rtx4090)")
    sm.add_argument("--out", required=True, help="new (or empty) directory for CSV, markdown and PNG plots")


def run(args) -> int:
    """``moe-offload simulate``: replays, report files, and the table on stdout. Returns the exit status."""
    from ..sim.report import write_report
    from ..sim.run import SimulateRequest, simulate
    from ..trace.format import load_trace

    residencies = split_floats(args.residency, "--residency")
    policies = parse_policies(args.policy)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty directory; choose a new --out")
    traces = [(t, load_trace(t)) for t in args.trace]
    if args.model:
        from ..models.checkpoint import checkpoint_model_id
        from ..testbed.resolve import resolve_model

        model_id = checkpoint_model_id(resolve_model(args.model))
        for _, tr in traces:
            tr.check_model(model_id)
    req = SimulateRequest(traces, policies, residencies, model_profile=args.model_profile, hardware=args.hardware,
                          full_load_tok_s=args.full_load_tok_s, predictor=args.predictor,
                          rollout_every=args.rollout_every, predictor_lag=args.predictor_lag, link=args.link,
                          host_cache_frac=args.host_cache_frac, link_epl=args.link_epl, xl_depth=args.xl_depth)
    rows, title, no_speed = simulate(req)
    files = write_report(rows, out, title)
    print((out / "results.md").read_text())
    if no_speed:
        print(no_speed)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
