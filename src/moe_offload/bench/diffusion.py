"""``moe-offload bench diffusion``: TIDE's refresh planners against FullLoad and reactive on a diffusion model, with
the block-prefix KV cache and with the reference loop that recomputes the prefix (issues 6 and 19)."""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..core.policy_spec import PolicySpec
from ..models.loader import load_full, load_offloaded
from ..runtime.emulated_clock import check_skip_device, now, skipping_waits

#: the diffusion loops ``bench diffusion`` can run: with the block-prefix KV cache, and recomputing the prefix
LOOPS = ("prefix-cache", "recompute")


def diffusion_regime(trace, fullload_s: float, expert_bytes: int, hardware: str = "rtx4090",
                     model_profile: str = "llada2.0-mini", overlap_host: bool = True):
    """The emulated TIDE regime of ``bench diffusion``: a hardware/model profile's costs scaled onto this machine.

    ``sim.diffusion_sim.profile_costs_on_trace(trace, hardware, model_profile)`` gives the profile's seconds for
    swaps, device compute, host fallback and non-expert work (non-expert work per step scaled to the trace's MoE
    layers and mean tokens per forward). Charged on ``trace`` (``sim.diffusion_sim.fullload_seconds``), FullLoad takes ``P``
    modelled seconds; it took ``fullload_s`` measured seconds here, so every cost is multiplied by
    ``fullload_s / P``: swaps and host fallback then cost, relative to this machine's FullLoad compute, what they
    cost relative to the profile platform's. ``overlap_host`` (default True, how ``RefreshEngine`` runs host
    fallback: beside the device compute, ``runtime.host_fallback``) is passed to the cost model, so the simulator
    charges a layer ``max(device, host)`` as the runtime spends it.

    Returns:
        ``(costs, scale)``: the scaled ``TideCosts`` (seconds; its FullLoad time on ``trace`` equals ``fullload_s``)
        and the multiplier.

    Raises:
        MoeOffloadError: unknown profiles or a profile lacking a TIDE key; ``fullload_s <= 0``.
    """
    from ..core.costs import TideCosts
    from ..errors import MoeOffloadError
    from ..sim.diffusion_sim import fullload_seconds, profile_costs_on_trace

    if not fullload_s > 0:
        raise MoeOffloadError(f"FullLoad seconds must be > 0, got {fullload_s}")
    prof = profile_costs_on_trace(trace, hardware, model_profile)
    scale = fullload_s / float(fullload_seconds(trace, prof).sum())
    fields = ("swap_s", "device_expert_s", "device_token_s", "fallback_expert_s", "fallback_token_s",
              "nonexpert_step_s")
    costs = TideCosts.from_numbers(
        expert_bytes, **{f: getattr(prof, f) * scale for f in fields},
        num_moe_layers=trace.num_moe_layers, num_experts=trace.num_experts, top_k=trace.top_k,
        overlap_host=overlap_host)
    return costs, scale


@dataclass
class Row:
    """One measured row: ``tps`` (median tok/s), ``spread`` ((max - min) / median of the timed runs' tok/s),
    ``modelled`` (the simulator's fraction of FullLoad), ``host`` (host token-expert share), ``blocking`` /
    ``prefetches`` (expert copies), ``same`` (FullLoad's tokens), ``replayed`` (True / False: the runtime's
    counters equal the simulator's for a planner whose decisions do not depend on time; None otherwise)."""

    loop: str
    policy: PolicySpec | str
    budget: str
    tps: float
    spread: float
    ratio: float
    vs_reactive: float | None
    modelled: float
    host: float
    blocking: int
    prefetches: int
    same: bool
    replayed: bool | None


def _measure(lm, prompts, max_new_tokens, kw, repeats, progress, recorder=None, planner=None):
    """Warm-up request, then ``repeats`` timed runs, each from a cold engine with a fresh planner from
    ``planner()`` (``RefreshEngine.restart``: as the simulator replays); returns ``(outputs, stats, results, tok/s
    of each run)``."""
    from ..generation.diffusion import run_diffusion

    run_diffusion(lm, prompts[:1], min(8, max_new_tokens), **kw)  # warm-up; not counted
    rates, tokens = [], []
    for r in range(repeats):
        if planner is not None:
            lm.engine.restart(planner())
        t0 = now()
        outs, stats, results = run_diffusion(lm, prompts, max_new_tokens, progress=progress,
                                             recorder=recorder if r == 0 else None, **kw)
        secs = now() - t0
        tokens.append([o.token_ids for o in outs])
        rates.append(sum(len(t) for t in tokens[-1]) / secs)
    if any(t != tokens[0] for t in tokens):
        raise RuntimeError("repeated runs of the same greedy requests gave different tokens")
    return outs, stats, results, rates


def _replayed(spec: PolicySpec, st, sim) -> bool | None:
    """Whether the runtime ran as the simulator replays it: same host / device token-experts and copies (planners
    whose decisions depend on measured time, i.e. tide, are not compared: None)."""
    if spec.family == "tide":
        return None
    return (st.host_tokens, st.device_tokens, st.blocking_loads, st.prefetches) == (
        sim.fallback_token_experts, sim.device_token_experts, sim.blocking_swaps, sim.prefetch_swaps)


def _bench_loop(path, prompts, budgets, intervals, loop, kw, opts) -> tuple[list[Row], str, float]:
    """Every row of one loop (``loop`` in ``LOOPS``); returns ``(rows, footer, tokens per forward)``. The runtime's
    planners get the regime's cost model, as the simulator's do (not the one ``load_offloaded`` calibrates)."""
    from ..core.refresh import make_refresh_planner
    from ..errors import MoeOffloadError
    from ..generation.diffusion import is_diffusion
    from ..sim.diffusion_sim import budget_experts, replay_diffusion
    from ..trace.diffusion import DiffusionTraceRecorder

    kw = dict(kw, prefix_cache=loop == "prefix-cache")
    run = dict(max_new_tokens=opts["max_new_tokens"], kw=kw, repeats=opts["repeats"], progress=opts["progress"])
    full = load_full(path, device=opts["device"], dtype=opts["dtype"])
    if not is_diffusion(full):
        raise MoeOffloadError(f"{path} is not a diffusion model: bench diffusion needs one (e.g. llada2_moe)")
    with DiffusionTraceRecorder(full, kw["block_length"], source=f"moe-offload bench diffusion on {path}") as rec:
        # the recorder sees the first timed run; greedy runs repeat its blocks and steps exactly
        ref_out, _, ref_res, rates = _measure(full, prompts, recorder=rec, **run)
        trace = rec.trace(ref_res)
    ref_tokens = [o.token_ids for o in ref_out]
    expert_bytes = full.expert_bytes
    del full
    gc.collect()
    full_tps = statistics.median(rates)
    ref_s = sum(len(t) for t in ref_tokens) / full_tps
    costs, scale = diffusion_regime(trace, ref_s, expert_bytes, opts["hardware"], opts["model_profile"])
    emulate = dict(seconds_per_expert=costs.swap_s, host_seconds_per_expert=costs.fallback_expert_s,
                   host_seconds_per_token_expert=costs.fallback_token_s)
    rows = [Row(loop, "FullLoad", "all", full_tps, _spread(rates), 1.0, None, 1.0, 0.0, 0, 0, True, None)]
    for b in budgets:
        per_layer = budget_experts(b, trace.num_experts)
        reactive_tps = None
        for spec in ([PolicySpec("reactive")] + [PolicySpec("tide-fixed", interval=t) for t in intervals]
                     + [PolicySpec("tide")]):
            lm = load_offloaded(path, device=opts["device"], dtype=opts["dtype"], progress=False, policy=spec,
                                slots=per_layer * trace.num_moe_layers, **emulate)
            def planner():
                return make_refresh_planner(spec, trace.num_moe_layers, trace.num_experts, per_layer, costs=costs)

            try:
                with skipping_waits(opts["skip_waits"]):
                    outs, stats, _, rates = _measure(lm, prompts, planner=planner, **run)
            finally:
                lm.engine.close()
            st, tps = stats.offload, statistics.median(rates)
            reactive_tps = tps if spec.family == "reactive" else reactive_tps
            sim = replay_diffusion(trace, planner(), costs)
            rows.append(Row(loop, spec, f"{per_layer} ({b:.0%})", tps, _spread(rates), tps / full_tps,
                            tps / reactive_tps, sim.ratio, st.host_tokens / max(1, st.host_tokens + st.device_tokens),
                            st.blocking_loads, st.prefetches, [o.token_ids for o in outs] == ref_tokens,
                            _replayed(spec, st, sim)))
            del lm
            gc.collect()
    tpf = float(trace.tokens.mean())
    return rows, _loop_footer(loop, trace, tpf, opts, scale, ref_s, costs), tpf


def _loop_footer(loop: str, trace, tpf: float, opts: dict, scale: float, ref_s: float, costs) -> str:
    """The line under one loop's rows: its trace (steps, tokens per forward, active experts) and the emulated
    regime (``costs``, scaled ``scale`` times onto FullLoad's ``ref_s`` seconds)."""
    return (f"{loop}: {trace.num_steps} diffusion steps, {tpf:.1f} tokens per forward on average, "
            f"{float((trace.counts > 0).sum(-1).mean()):.1f} active experts per layer and step; emulated regime "
            f"{opts['model_profile']} on {opts['hardware']} scaled x{scale:.3g} onto this machine's FullLoad "
            f"({1e3 * ref_s / trace.num_steps:.1f} ms per step): swap {1e6 * costs.swap_s:.0f} us per expert, host "
            f"fallback {1e6 * costs.fallback_expert_s:.0f} us per expert + {1e6 * costs.fallback_token_s:.1f} us "
            f"per token-expert, non-expert {1e3 * costs.nonexpert_step_s:.2f} ms per step (modelled); host fallback "
            f"{'beside' if costs.overlap_host else 'after'} the layer's device compute; emulated waits "
            f"{'skipped on a virtual clock' if opts['skip_waits'] else 'slept'}.")


def _spread(rates: list[float]) -> float:
    return (max(rates) - min(rates)) / statistics.median(rates) if len(rates) > 1 else 0.0


def bench_diffusion(path: Path, prompts: list[str], budgets: list[float], intervals: list[int], *,
                    max_new_tokens: int = 64, block_length: int = 32, steps: int | None = None,
                    threshold: float = 0.95, hardware: str = "rtx4090", model_profile: str = "llada2.0-mini",
                    device: str | None = None, dtype: str | None = None, progress: bool = True,
                    repeats: int = 1, loops: tuple[str, ...] = LOOPS, skip_waits: bool = False) -> str:
    """TIDE on this machine (``bench diffusion``), for each diffusion loop of ``loops`` (``"prefix-cache"``: the
    block-prefix KV cache; ``"recompute"``: the reference loop): tokens/s of FullLoad, ``reactive``,
    ``tide-fixed-T<n>`` for every ``n`` in ``intervals`` and ``tide`` at each per-layer budget, greedy, measured in
    one run, tokens compared with FullLoad's, under the emulated regime of ``diffusion_regime`` (the link paced by
    the ``TransferEngine``'s ``seconds_per_expert``, host fallback by ``RefreshEngine``'s
    ``host_seconds_per_expert`` / ``host_seconds_per_token_expert``).

    Per loop, FullLoad runs first while a ``trace.diffusion.DiffusionTraceRecorder`` records its routing (every
    lossless policy routes identically); that loop's regime is derived from that run (each loop's costs are the
    profile's relative to its own FullLoad), and the simulator (``replay_diffusion``) replays the same trace
    through the same planners under the same costs, so each row also shows the modelled fraction of FullLoad next
    to the measured one. A short warm-up request precedes each measurement; every timed run starts from a cold
    engine with a fresh planner built as the replay's (tide: with the regime's cost model), and for the planners
    whose decisions do not depend on time (reactive, tide-fixed) the runtime's counters are checked against the
    replay's (column "replayed").

    Args:
        budgets: per-layer budgets as fractions of the experts, in (0, 1].
        intervals: tide-fixed intervals (diffusion steps), each >= 1.
        hardware, model_profile: the profiles whose cost ratios are emulated (default LLaDA2.0-mini on rtx4090).
        max_new_tokens, block_length, steps, threshold: the diffusion loop's parameters.
        repeats: timed runs per row (>= 1); a row's tok/s is their median, its spread (max - min) / median (the
            counters are the last run's).
        loops: a non-empty subset of ``LOOPS``.
        skip_waits: the emulated waits (copies, host fallback) skipped on a virtual clock instead of slept
            (``runtime.emulated_clock``; CPU only): every timer, tok/s included, reads that clock.

    Returns:
        Markdown: the summary table (per loop and budget: FullLoad, reactive, best and worst fixed interval, tide),
        the table of every row, and the loops' numbers (tokens per forward, regime, FullLoad speed-up of the cache).

    Raises:
        MoeOffloadError: a model that is not a diffusion model, bad budgets/intervals/loops/diffusion parameters, or
            as ``load_offloaded``; ``skip_waits`` on a device that is not the CPU.
    """
    from ..errors import MoeOffloadError
    from ..generation.diffusion import check_params
    from ..models.loader import resolve_device

    steps = block_length if steps is None else steps
    check_params(max_new_tokens, block_length, steps, threshold)
    if not budgets or any(not (0 < b <= 1) for b in budgets):
        raise MoeOffloadError(f"budgets must be fractions in (0, 1], got {budgets}")
    if not intervals or any(t < 1 for t in intervals):
        raise MoeOffloadError(f"tide-fixed intervals must be >= 1, got {intervals}")
    if repeats < 1:
        raise MoeOffloadError(f"repeats must be >= 1, got {repeats}")
    if not loops or any(lp not in LOOPS for lp in loops):
        raise MoeOffloadError(f"loops must be among {', '.join(LOOPS)}, got {', '.join(loops) or 'none'}")
    check_skip_device(skip_waits, resolve_device(device))
    kw = dict(block_length=block_length, steps=steps, threshold=threshold)
    opts = dict(max_new_tokens=max_new_tokens, repeats=repeats, progress=progress, device=device, dtype=dtype,
                hardware=hardware, model_profile=model_profile, skip_waits=skip_waits)
    rows, footers, tpf = [], [], {}
    for loop in loops:
        r, f, tpf[loop] = _bench_loop(path, prompts, budgets, intervals, loop, kw, opts)
        rows += r
        footers.append(f)
    lines = ["| loop | policy | experts per layer | tok/s (spread) | vs FullLoad | vs reactive | modelled vs FullLoad | "
             "host token-experts | copies | same tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_line(r, label, False) for r, label in _summary(rows)]
    lines += ["", "Every row (copies = blocking + prefetched; replayed = the runtime's counters equal the "
              "simulator's):", "",
              "| loop | policy | experts per layer | tok/s (spread) | vs FullLoad | vs reactive | modelled vs FullLoad | "
              "host token-experts | blocking copies | prefetches | same tokens | replayed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_line(r, str(r.policy), True) for r in rows]
    lines.append(f"\n{len(prompts)} prompts x {max_new_tokens} new tokens (block {block_length}, {steps} steps per "
                 f"block, threshold {threshold}; median of {repeats} timed run{'s' if repeats > 1 else ''} per row), "
                 f"model {path}.")
    lines += [f"- {f}" for f in footers]
    full = {r.loop: r.tps for r in rows if str(r.policy) == "FullLoad"}
    if len(full) == 2:
        lines.append(f"- prefix cache: FullLoad {full['prefix-cache']:.2f} vs {full['recompute']:.2f} tok/s "
                     f"({full['prefix-cache'] / full['recompute']:.2f}x); tokens per forward "
                     f"{tpf['recompute']:.1f} -> {tpf['prefix-cache']:.1f}.")
    return "\n".join(lines)


def _summary(rows: list[Row]) -> list[tuple[Row, str]]:
    """Per loop and budget: FullLoad, reactive, the best and the worst tide-fixed interval, tide."""
    out = []
    for loop in dict.fromkeys(r.loop for r in rows):
        mine = [r for r in rows if r.loop == loop]
        out.append((mine[0], "FullLoad"))
        for bud in dict.fromkeys(r.budget for r in mine[1:]):
            group = [r for r in mine if r.budget == bud]
            fixed = [r for r in group if r.policy.family == "tide-fixed"]
            best, worst = max(fixed, key=lambda r: r.tps), min(fixed, key=lambda r: r.tps)
            out += [(group[0], "reactive"), (best, f"tide-fixed, best T (T={best.policy.interval})"),
                    (worst, f"tide-fixed, worst T (T={worst.policy.interval})"),
                    (group[-1], "**tide**")]
    return out


def _line(r: Row, label: str, full: bool) -> str:
    vs_r = "-" if r.vs_reactive is None else f"{r.vs_reactive:.2f}x"
    spread = f" (±{50 * r.spread:.1f}%)" if r.spread else ""
    cells = [r.loop, label, r.budget, f"{r.tps:.2f}{spread}", f"{r.ratio:.3f}", vs_r, f"{r.modelled:.3f}",
             f"{r.host:.1%}"]
    cells += [str(r.blocking), str(r.prefetches)] if full else [str(r.blocking + r.prefetches)]
    cells.append("yes" if r.same else "NO")
    if full:
        cells.append("-" if r.replayed is None else "yes" if r.replayed else "NO")
    return "| " + " | ".join(cells) + " |"
