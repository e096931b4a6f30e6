"""Command line of ``moe-offload simulate-diffusion`` (registered by ``moe_offload.cli``): replay a diffusion (LLaDA2)
trace, or a synthetic one, through the TIDE refresh planners."""

from __future__ import annotations

from pathlib import Path

from ..common.cliargs import nonneg_int, parse_intervals, positive_int, split_floats
from ..errors import MoeOffloadError


def add_parser(sub) -> None:
    """Add ``simulate-diffusion`` to the top-level subparsers."""
    sd = sub.add_parser("simulate-diffusion", help="replay a diffusion (LLaDA2) trace through the TIDE refresh "
                        "planners: hit rate, swaps, fallbacks, modelled tok/s, interval sweep")
    sd.add_argument("--trace", help="diffusion trace file (trace.diffusion format); default: a synthetic trace")
    sd.add_argument("--requests", type=positive_int, default=4, help="synthetic trace: requests (default 4)")
    sd.add_argument("--blocks", type=positive_int, default=8, help="synthetic trace: blocks per request (default 8)")
    sd.add_argument("--seed", type=nonneg_int, default=0, help="synthetic trace: seed (default 0)")
    sd.add_argument("--policy", default="reactive,tide-fixed,tide", help="comma-separated: reactive, tide-fixed, tide")
    sd.add_argument("--intervals", default="1-16",
                    help="tide-fixed intervals T: 'A-B' or comma-separated (default 1-16)")
    sd.add_argument("--budget", default="0.25,0.5", help="experts per layer on the device, comma-separated fractions "
                    "in (0, 1] (default 0.25,0.5)")
    sd.add_argument("--hardware", default="rtx4090,h200",
                    help="comma-separated hardware profiles (default rtx4090,h200)")
    sd.add_argument("--model-profile", default="llada2.0-mini", help="model profile for the cost model")
    sd.add_argument("--tau-max", type=positive_int, default=16, help="tide: longest interval considered (default 16)")
    sd.add_argument("--overlap-host", action="store_true", help="host fallback overlaps the layer's device compute")
    sd.add_argument("--out", required=True, help="new (or empty) directory for CSV, markdown and PNG plots")


def run(args) -> int:
    """``moe-offload simulate-diffusion``: replays, report files, and the table on stdout. Returns the exit status."""
    from ..core.costs import TideCosts
    from ..trace.diffusion import load_diffusion_trace
    from ..trace.diffusion_synthetic import synthetic_diffusion_trace
    from .diffusion_sim import profile_costs_on_trace, run_diffusion_sweep, write_diffusion_report
    from ..core.profiles import load_model_profile

    budgets = split_floats(args.budget, "--budget")
    if any(not (0 < b <= 1) for b in budgets):
        raise MoeOffloadError(f"--budget values must be in (0, 1], got {args.budget}")
    policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in ("reactive", "tide-fixed", "tide")]
    if bad or not policies:
        raise MoeOffloadError(f"unknown --policy {','.join(bad) or args.policy!r}; "
                              "choose among reactive, tide-fixed, tide")
    intervals = parse_intervals(args.intervals)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty directory; choose a new --out")
    mp = load_model_profile(args.model_profile)
    hws = [h.strip() for h in args.hardware.split(",") if h.strip()]
    if not hws:
        raise MoeOffloadError("--hardware is empty")
    if args.trace:
        tr, name = load_diffusion_trace(args.trace), Path(args.trace).name
    else:
        tr = synthetic_diffusion_trace(mp.num_moe_layers, mp.num_experts, mp.top_k, requests=args.requests,
                                       blocks=args.blocks, block_length=int(mp.extra.get("block_length", 32)),
                                       seed=args.seed)
        name = "synthetic"
    geo = (tr.num_moe_layers, tr.num_experts, tr.top_k)
    if geo[1:] != (mp.num_experts, mp.top_k):
        raise MoeOffloadError(f"trace geometry {geo[0]}x{geo[1]} top-{geo[2]} differs from model profile {mp.name} "
                              f"({mp.num_moe_layers}x{mp.num_experts} top-{mp.top_k}); pass a --model-profile with "
                              "the trace's experts per layer and top-k")
    if geo[0] == mp.num_moe_layers:
        costs = {h: TideCosts.from_profiles(h, mp, overlap_host=args.overlap_host) for h in hws}
        print(f"profiles: model {mp.name}; hardware {', '.join(hws)}")
    else:  # e.g. llada2-medium: the profile's experts, fewer layers (as bench diffusion charges it)
        costs = {h: profile_costs_on_trace(tr, h, mp, overlap_host=args.overlap_host) for h in hws}
        print(f"profiles: model {mp.name} (its per-expert costs; non-expert work scaled to the trace's "
              f"{geo[0]} MoE layers and {float(tr.tokens.mean()):.1f} tokens per step); hardware {', '.join(hws)}")
    from tqdm.auto import tqdm

    n = len(hws) * len(budgets) * sum(len(intervals) if p == "tide-fixed" else 1 for p in policies)
    bar = tqdm(total=n, desc="replays", leave=False)
    rows, sweep = run_diffusion_sweep(tr, costs, budgets, policies, intervals, tau_max=args.tau_max,
                                      trace_name=name, model=mp.name, progress=lambda: bar.update(1))
    bar.close()
    extra = _extra_md(args, tr, name, budgets, costs)
    files = write_diffusion_report(rows, sweep, out, f"TIDE refresh planners ({mp.name})", extra_md=extra)
    if not args.trace:
        files.append(tr.save(out / "trace.safetensors"))
    print((out / "results.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _extra_md(args, tr, name: str, budgets: list[float], costs: dict) -> str:
    """The report's text after the table: the command, the trace, its stability profile and the cost model."""
    from ..trace.diffusion import stability_profile
    from .diffusion_sim import budget_experts

    stab = ["## Trace stability (trace.diffusion.stability_profile)", "",
            "coverage(d): share of token-experts at step r+d whose expert is among the budget experts with the most "
            "tokens at step r (same block).", "", "| budget | d=0 | d=1 | d=2 | d=4 | d=8 | Jaccard(next) | "
            "active/layer/step | steps/block |", "|---|---|---|---|---|---|---|---|---|"]
    for b in budgets:
        sp = stability_profile(tr, budget_experts(b, tr.num_experts), 8)
        cv = sp["coverage"]
        f = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        stab.append(f"| {100 * b:g}% | {f(cv[0])} | {f(cv[1])} | {f(cv[2])} | {f(cv[4])} | {f(cv[8])} | "
                    f"{sp['jaccard_next']:.3f} | {sp['active_per_layer_step']:.1f} | {sp['steps_per_block']:.1f} |")
    cost_md = ["## Cost model (core.costs.TideCosts.from_profiles; modelled, see the profiles' unsourced fields)", "",
               "| hardware | swap us | device us/expert | device us/token-expert | fallback us/expert | "
               "fallback us/token-expert | non-expert ms/step |", "|---|---|---|---|---|---|---|"]
    for h, c in costs.items():
        cost_md.append(f"| {h} | {1e6 * c.swap_s:.1f} | {1e6 * c.device_expert_s:.2f} | {1e6 * c.device_token_s:.3f} "
                       f"| {1e6 * c.fallback_expert_s:.1f} | {1e6 * c.fallback_token_s:.2f} | "
                       f"{1e3 * c.nonexpert_step_s:.2f} |")
    cmd = "moe-offload simulate-diffusion " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("trace", args.trace), ("budget", args.budget),
                                                    ("policy", args.policy), ("intervals", args.intervals),
                                                    ("hardware", args.hardware), ("model_profile", args.model_profile),
                                                    ("tau_max", args.tau_max)) if v is not None)
    return "\n".join(["", f"Command: `{cmd}{' --overlap-host' if args.overlap_host else ''}`", "",
                      f"Trace: {name} ({tr.header.get('source', '')}), {tr.num_steps} steps in {len(tr.blocks())} "
                      "blocks.", ""] + stab + [""] + cost_md)
