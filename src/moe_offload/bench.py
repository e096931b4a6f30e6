"""``moe-offload bench diffusion``: TIDE against FullLoad on this machine under an emulated regime, in one run."""

from __future__ import annotations

import gc
from pathlib import Path

from .models.loader import load_full, load_offloaded


def diffusion_regime(trace, fullload_s: float, expert_bytes: int, hardware: str = "rtx4090",
                     model_profile: str = "llada2.0-mini"):
    """The emulated TIDE regime of ``bench diffusion``: a hardware/model profile's costs scaled onto this machine.

    ``core.costs.TideCosts.from_profiles(hardware, model_profile)`` gives the profile's seconds for swaps, device
    compute, host fallback and non-expert work (non-expert work per step scaled to the trace's MoE layers and mean
    tokens per forward). Charged on ``trace`` (``sim.diffusion_sim.fullload_seconds``), FullLoad takes ``P``
    modelled seconds; it took ``fullload_s`` measured seconds here, so every cost is multiplied by
    ``fullload_s / P``: swaps and host fallback then cost, relative to this machine's FullLoad compute, what they
    cost relative to the profile platform's.

    Returns:
        ``(costs, scale)``: the scaled ``TideCosts`` (seconds; its FullLoad time on ``trace`` equals ``fullload_s``)
        and the multiplier.

    Raises:
        MoeOffloadError: unknown profiles or a profile lacking a TIDE key; ``fullload_s <= 0``.
    """
    from .core.costs import TideCosts
    from .errors import MoeOffloadError
    from .sim.diffusion_sim import fullload_seconds
    from .sim.profiles import load_model_profile

    if not fullload_s > 0:
        raise MoeOffloadError(f"FullLoad seconds must be > 0, got {fullload_s}")
    mp = load_model_profile(model_profile)
    prof = TideCosts.from_profiles(hardware, mp, tokens_per_step=max(1, int(round(float(trace.tokens.mean())))))
    prof = prof.with_overrides(nonexpert_step_s=prof.nonexpert_step_s * trace.num_moe_layers / mp.num_moe_layers)
    scale = fullload_s / float(fullload_seconds(trace, prof).sum())
    fields = ("swap_s", "device_expert_s", "device_token_s", "fallback_expert_s", "fallback_token_s",
              "nonexpert_step_s")
    costs = TideCosts.from_numbers(
        expert_bytes, **{f: getattr(prof, f) * scale for f in fields},
        num_moe_layers=trace.num_moe_layers, num_experts=trace.num_experts, top_k=trace.top_k)
    return costs, scale


def bench_diffusion(path: Path, prompts: list[str], budgets: list[float], intervals: list[int], *,
                    max_new_tokens: int = 64, block_length: int = 32, steps: int | None = None,
                    threshold: float = 0.95, hardware: str = "rtx4090", model_profile: str = "llada2.0-mini",
                    device: str | None = None, dtype: str | None = None, progress: bool = True,
                    repeats: int = 1) -> str:
    """TIDE on this machine (``bench diffusion``): tokens/s of FullLoad, ``reactive``, ``tide-fixed-T<n>`` for every
    ``n`` in ``intervals`` and ``tide`` at each per-layer budget, greedy, measured in one run, tokens compared with
    FullLoad's, under the emulated regime of ``diffusion_regime`` (the link paced by the ``TransferEngine``'s
    ``seconds_per_expert``, host fallback by ``RefreshEngine``'s ``host_seconds_per_expert`` /
    ``host_seconds_per_token_expert``).

    FullLoad runs first while a ``trace.diffusion.DiffusionTraceRecorder`` records its routing (every lossless
    policy routes identically); the regime is derived from that run, and the simulator (``replay_diffusion``)
    replays the same trace through the same planners under the same costs, so each row also shows the modelled
    fraction of FullLoad next to the measured one. A short warm-up request precedes each measurement.

    Args:
        budgets: per-layer budgets as fractions of the experts, in (0, 1].
        intervals: tide-fixed intervals (diffusion steps), each >= 1.
        hardware, model_profile: the profiles whose cost ratios are emulated (default LLaDA2.0-mini on rtx4090).
        max_new_tokens, block_length, steps, threshold: the diffusion loop's parameters.
        repeats: timed runs per row (>= 1); a row's seconds are their median (the counters are the last run's).

    Returns:
        A markdown table (policy, budget, tok/s, vs FullLoad, vs reactive, modelled vs FullLoad, host token-expert
        share, blocking copies, prefetches, same tokens) and the regime's numbers.

    Raises:
        MoeOffloadError: a model that is not a diffusion model, bad budgets/intervals/diffusion parameters, or as
            ``load_offloaded``.
    """
    import statistics
    import time

    from .errors import MoeOffloadError
    from .models.diffusion import check_params, is_diffusion, run_diffusion
    from .sim.diffusion_sim import budget_experts, replay_diffusion
    from .core.refresh import make_refresh_planner
    from .trace.diffusion import DiffusionTraceRecorder

    steps = block_length if steps is None else steps
    check_params(max_new_tokens, block_length, steps, threshold)
    if not budgets or any(not (0 < b <= 1) for b in budgets):
        raise MoeOffloadError(f"budgets must be fractions in (0, 1], got {budgets}")
    if not intervals or any(t < 1 for t in intervals):
        raise MoeOffloadError(f"tide-fixed intervals must be >= 1, got {intervals}")
    if repeats < 1:
        raise MoeOffloadError(f"repeats must be >= 1, got {repeats}")
    kw = dict(block_length=block_length, steps=steps, threshold=threshold)

    def measure(lm, recorder=None):
        run_diffusion(lm, prompts[:1], min(8, max_new_tokens), **kw)  # warm-up; not counted
        times, tokens = [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            outs, stats, results = run_diffusion(lm, prompts, max_new_tokens, progress=progress,
                                                 recorder=recorder if r == 0 else None, **kw)
            times.append(time.perf_counter() - t0)
            tokens.append([o.token_ids for o in outs])
        if any(t != tokens[0] for t in tokens):
            raise RuntimeError("repeated runs of the same greedy requests gave different tokens")
        return outs, stats, results, statistics.median(times)

    full = load_full(path, device=device, dtype=dtype)
    if not is_diffusion(full):
        raise MoeOffloadError(f"{path} is not a diffusion model: bench diffusion needs one (e.g. llada2_moe)")
    with DiffusionTraceRecorder(full, block_length, source=f"moe-offload bench diffusion on {path}") as rec:
        ref_out, _, ref_res, ref_s = measure(full, rec)  # the recorder sees the first timed run only
        trace = rec.trace(ref_res)
    ref_tokens = [o.token_ids for o in ref_out]
    n_tokens = sum(len(t) for t in ref_tokens)
    expert_bytes = full.expert_bytes
    del full
    gc.collect()
    costs, scale = diffusion_regime(trace, ref_s, expert_bytes, hardware, model_profile)
    emulate = dict(seconds_per_expert=costs.swap_s, host_seconds_per_expert=costs.fallback_expert_s,
                   host_seconds_per_token_expert=costs.fallback_token_s)
    full_tps = n_tokens / ref_s
    rows = [("FullLoad", "all", full_tps, 1.0, None, 1.0, 0.0, 0, 0, True)]
    for b in budgets:
        per_layer = budget_experts(b, trace.num_experts)
        names = ["reactive"] + [f"tide-fixed-T{t}" for t in intervals] + ["tide"]
        reactive_tps = None
        for name in names:
            lm = load_offloaded(path, device=device, dtype=dtype, slots=per_layer * trace.num_moe_layers,
                                policy=name, progress=False, **emulate)
            try:
                outs, stats, _, secs = measure(lm)
            finally:
                lm.engine.close()
            st = stats.offload
            tps = sum(len(o.token_ids) for o in outs) / secs
            if name == "reactive":
                reactive_tps = tps
            planner = make_refresh_planner(name, trace.num_moe_layers, trace.num_experts, per_layer, costs=costs)
            modelled = replay_diffusion(trace, planner, costs).ratio
            host_share = st.host_tokens / max(1, st.host_tokens + st.device_tokens)
            rows.append((name, f"{per_layer} ({b:.0%})", tps, tps / full_tps, tps / reactive_tps, modelled,
                         host_share, st.blocking_loads, st.prefetches,
                         [o.token_ids for o in outs] == ref_tokens))
            del lm
            gc.collect()
    lines = ["| policy | experts per layer | tok/s | vs FullLoad | vs reactive | modelled vs FullLoad | "
             "host token-experts | blocking copies | prefetches | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, bud, tps, ratio, vs_r, modelled, host, blocking, pre, same in rows:
        lines.append(f"| {name} | {bud} | {tps:.2f} | {ratio:.3f} | {'-' if vs_r is None else f'{vs_r:.2f}x'} | "
                     f"{modelled:.3f} | {host:.1%} | {blocking} | {pre} | {'yes' if same else 'NO'} |")
    lines.append(
        f"\n{len(prompts)} prompts x {max_new_tokens} new tokens (block {block_length}, {steps} steps per block, "
        f"threshold {threshold}; median of {repeats} timed run{'s' if repeats > 1 else ''} per row), model {path}: "
        f"{trace.num_moe_layers} MoE layers x {trace.num_experts} experts, "
        f"top-{trace.top_k}; {trace.num_steps} diffusion steps, {float(trace.tokens.mean()):.0f} tokens per forward "
        f"on average, {float((trace.counts > 0).sum(-1).mean()):.1f} active experts per layer and step.\n"
        f"Emulated regime: {model_profile} on {hardware}, scaled x{scale:.2f} onto this machine's FullLoad "
        f"({1e3 * ref_s / trace.num_steps:.1f} ms per step): swap {1e6 * costs.swap_s:.0f} us per expert, host "
        f"fallback {1e6 * costs.fallback_expert_s:.0f} us per expert + {1e6 * costs.fallback_token_s:.1f} us per "
        f"token-expert, device {1e6 * costs.device_expert_s:.1f} us per expert + "
        f"{1e6 * costs.device_token_s:.2f} us per token-expert (modelled), non-expert "
        f"{1e3 * costs.nonexpert_step_s:.2f} ms per step (modelled).")
    return "\n".join(lines)
