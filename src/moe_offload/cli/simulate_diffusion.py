"""``moe-offload simulate-diffusion``: replay a diffusion (LLaDA2) trace, or a synthetic one, through the TIDE
refresh planners (``sim.diffusion_run``), write the report and print its table."""

from __future__ import annotations

from pathlib import Path

from ..core.policy_spec import parse_policies
from ..errors import MoeOffloadError
from .args import nonneg_int, parse_intervals, positive_int, split_floats


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
    from tqdm.auto import tqdm

    from ..sim.diffusion_run import diffusion_extra_md, diffusion_trace, simulate_diffusion
    from ..sim.diffusion_sim import write_diffusion_report

    budgets = split_floats(args.budget, "--budget")
    policies = parse_policies(args.policy)
    bad = [p.name for p in policies if not p.refresh]
    if bad:
        raise MoeOffloadError(f"unknown --policy {','.join(bad)}; choose among reactive, tide-fixed, tide")
    intervals = parse_intervals(args.intervals)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty directory; choose a new --out")
    hws = [h.strip() for h in args.hardware.split(",") if h.strip()]
    tr, name = diffusion_trace(args.trace, args.model_profile, requests=args.requests, blocks=args.blocks,
                               seed=args.seed)
    bars = []

    def progress(total: int):
        bars.append(tqdm(total=total, desc="replays", leave=False))
        return lambda: bars[0].update(1)

    try:
        rows, sweep, costs, model = simulate_diffusion(tr, name, args.model_profile, hws, budgets, policies,
                                                       intervals, tau_max=args.tau_max, overlap_host=args.overlap_host,
                                                       progress=progress)
    finally:
        for bar in bars:
            bar.close()
    extra = diffusion_extra_md(tr, name, budgets, costs, _command(args))
    files = write_diffusion_report(rows, sweep, out, f"TIDE refresh planners ({model})", extra_md=extra)
    if not args.trace:
        files.append(tr.save(out / "trace.safetensors"))
    print((out / "results.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _command(args) -> str:
    """The ``simulate-diffusion`` command line of this run, for the report."""
    cmd = "moe-offload simulate-diffusion " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("trace", args.trace), ("budget", args.budget),
                                                    ("policy", args.policy), ("intervals", args.intervals),
                                                    ("hardware", args.hardware), ("model_profile", args.model_profile),
                                                    ("tau_max", args.tau_max)) if v is not None)
    return cmd + (" --overlap-host" if args.overlap_host else "")
