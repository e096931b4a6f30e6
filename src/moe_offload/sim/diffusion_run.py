"""``simulate-diffusion``, the library side: a diffusion (LLaDA2) trace, or a synthetic one of the model profile's
geometry, replayed through the TIDE refresh planners per hardware profile and budget (``sim.diffusion_sim``), and
the report's text after the table (the trace's stability, the cost model). ``cli/simulate_diffusion.py`` parses the
options and writes the report."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..core.costs import TideCosts
from ..core.policy_spec import PolicySpec
from ..core.profiles import load_model_profile
from ..errors import MoeOffloadError
from ..trace.diffusion import DiffusionTrace, load_diffusion_trace, stability_profile
from ..trace.diffusion_synthetic import synthetic_diffusion_trace
from .diffusion_sim import budget_experts, profile_costs_on_trace, run_diffusion_sweep


def diffusion_trace(path: str | None, model_profile: str, *, requests: int = 4, blocks: int = 8,
                    seed: int = 0) -> tuple[DiffusionTrace, str]:
    """``(trace, name)``: the diffusion trace at ``path``, else a synthetic one with ``model_profile``'s geometry
    (``requests`` x ``blocks`` blocks, ``seed``), named ``synthetic``.

    Raises:
        MoeOffloadError: an unreadable trace or profile."""
    if path:
        return load_diffusion_trace(path), Path(path).name
    mp = load_model_profile(model_profile)
    tr = synthetic_diffusion_trace(mp.num_moe_layers, mp.num_experts, mp.top_k, requests=requests, blocks=blocks,
                                   block_length=int(mp.extra.get("block_length", 32)), seed=seed)
    return tr, "synthetic"


def simulate_diffusion(tr: DiffusionTrace, name: str, model_profile: str, hardware: list[str], budgets: list[float],
                       policies: list[PolicySpec], intervals: list[int], *, tau_max: int = 16,
                       overlap_host: bool = False, say: Callable[[str], None] = print,
                       progress: Callable[[int], Callable[[], None]] | None = None
                       ) -> tuple[list[dict], list[dict], dict, str]:
    """Replay ``tr`` per hardware profile and budget fraction through ``policies`` (``run_diffusion_sweep``), with
    the costs of ``model_profile`` on each hardware (``TideCosts.from_profiles``; on a trace with fewer MoE layers
    than the profile, ``profile_costs_on_trace``). ``say`` is told the profiles used; ``progress(total)``, called once
    the inputs are checked, returns what to call after each of the ``total`` replays.

    Returns:
        ``(rows, sweep, costs by hardware, model profile name)``.
    Raises:
        MoeOffloadError: a budget outside (0, 1], no hardware, a trace whose experts per layer or top-k differ from
            the profile's, or as ``run_diffusion_sweep``.
    """
    if any(not (0 < b <= 1) for b in budgets):
        raise MoeOffloadError(f"--budget values must be in (0, 1], got {','.join(map(str, budgets))}")
    if not hardware:
        raise MoeOffloadError("--hardware is empty")
    mp = load_model_profile(model_profile)
    geo = (tr.num_moe_layers, tr.num_experts, tr.top_k)
    if geo[1:] != (mp.num_experts, mp.top_k):
        raise MoeOffloadError(f"trace geometry {geo[0]}x{geo[1]} top-{geo[2]} differs from model profile {mp.name} "
                              f"({mp.num_moe_layers}x{mp.num_experts} top-{mp.top_k}); pass a --model-profile with "
                              "the trace's experts per layer and top-k")
    if geo[0] == mp.num_moe_layers:
        costs = {h: TideCosts.from_profiles(h, mp, overlap_host=overlap_host) for h in hardware}
        say(f"profiles: model {mp.name}; hardware {', '.join(hardware)}")
    else:  # e.g. llada2-medium: the profile's experts, fewer layers (as bench diffusion charges it)
        costs = {h: profile_costs_on_trace(tr, h, mp, overlap_host=overlap_host) for h in hardware}
        say(f"profiles: model {mp.name} (its per-expert costs; non-expert work scaled to the trace's "
            f"{geo[0]} MoE layers and {float(tr.tokens.mean()):.1f} tokens per step); hardware {', '.join(hardware)}")
    per = sum((len(intervals) if p.interval is None else 1) if p.family == "tide-fixed" else 1 for p in policies)
    tick = progress(len(hardware) * len(budgets) * per) if progress else None
    rows, sweep = run_diffusion_sweep(tr, costs, budgets, policies, intervals, tau_max=tau_max, trace_name=name,
                                      model=mp.name, progress=tick)
    return rows, sweep, costs, mp.name


def diffusion_extra_md(tr: DiffusionTrace, name: str, budgets: list[float], costs: dict, command: str) -> str:
    """The report's text after the table: the command, the trace, its stability profile and the cost model."""
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
    return "\n".join(["", f"Command: `{command}`", "",
                      f"Trace: {name} ({tr.header.get('source', '')}), {tr.num_steps} steps in {len(tr.blocks())} "
                      "blocks.", ""] + stab + [""] + cost_md)
