"""Diffusion-trace replay through the TIDE refresh planners with a time model (DESIGN.md §6; TIDE).

``replay_diffusion`` walks a diffusion trace block by block, step by step and, inside a step, MoE layer by MoE
layer, and drives one ``core.refresh`` planner exactly as the runtime does (``begin_block``, ``begin_step``,
``route``, ``land``, ``end_step``). Time is charged on one modelled clock (``core.costs.TideCosts``):

* each step: non-expert work ``nonexpert_step_s``, spread evenly before each MoE layer and after the last;
* each MoE layer: device compute of the experts it computes on the device plus host fallback compute of the others
  (their sum, or their maximum with ``overlap_host``), after any *blocking* copies (reactive on-demand loads,
  tide-fixed / block-start refreshes), which stall the layer for ``n x swap_s``;
* asynchronous prefetches (tide) go through one FIFO host->device link that overlaps compute: copy ``j`` of a
  plan lands ``swap_s`` after the previous copy finished (or after it was issued, if the link was idle); a layer
  sees the copies landed by the time it runs (``planner.land``), and computes a not yet landed expert on the host;
  a blocking copy pre-empts the link (pending prefetches land later by its duration; SeqMoE §8.3 pauses prefetch
  on on-demand misses the same way).

FullLoad (every expert resident, no copy, no fallback) is charged by the same model, so ``ratio`` = FullLoad time /
policy time. Throughput = tokens committed (the trace's ``committed``) / modelled seconds. Everything here is
modelled: a synthetic trace plus profile-derived costs (see ``core.costs``) describe the generator and the
assumed platform, not a measured system.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.costs import TideCosts
from ..core.policy_spec import parse_policy
from ..core.refresh import RefreshPlanner, make_refresh_planner
from ..errors import MoeOffloadError
from ..trace.diffusion import DiffusionTrace


@dataclass
class DiffusionReplayResult:
    """Totals of one replay (seconds, token-experts, experts, bytes).

    Attributes:
        policy: the planner's name; budget: experts per layer; budget_fraction: budget / num_experts.
        steps: diffusion steps replayed; tokens: tokens committed (generated).
        token_experts: all (token, expert) pairs routed; hit_token_experts: those whose expert was resident before
            any blocking copy of its layer; device_token_experts / fallback_token_experts: computed on the device /
            on the host; fallback_experts: (layer, step, expert) host computations.
        swaps: expert copies (blocking + prefetch); blocking_swaps; prefetch_swaps; swap_bytes.
        time_s: modelled seconds; nonexpert_s, device_s, host_s, stall_s: its parts (host_s is the host time that
            is on the critical path).
        fullload_s: FullLoad seconds of the same trace.
        refreshes: layer refreshes; mean_interval: steps x layers / refreshes (None without refresh).
        step_s: float64 ``[steps]`` modelled seconds of each step.
    """

    policy: str
    budget: int
    budget_fraction: float
    steps: int = 0
    tokens: int = 0
    token_experts: int = 0
    hit_token_experts: int = 0
    device_token_experts: int = 0
    fallback_token_experts: int = 0
    fallback_experts: int = 0
    swaps: int = 0
    blocking_swaps: int = 0
    prefetch_swaps: int = 0
    swap_bytes: int = 0
    time_s: float = 0.0
    nonexpert_s: float = 0.0
    device_s: float = 0.0
    host_s: float = 0.0
    stall_s: float = 0.0
    fullload_s: float = 0.0
    refreshes: int = 0
    mean_interval: float | None = None
    step_s: np.ndarray | None = field(default=None, repr=False)

    @property
    def hit_rate(self) -> float:
        """Token-expert hits / all token-experts."""
        return self.hit_token_experts / self.token_experts if self.token_experts else 1.0

    @property
    def device_rate(self) -> float:
        """Token-experts computed on the device / all (the TIDE authors' ``gpu_tokens / (gpu + cpu tokens)``)."""
        return self.device_token_experts / self.token_experts if self.token_experts else 1.0

    @property
    def tok_s(self) -> float:
        """Modelled throughput, committed tokens per second."""
        return self.tokens / self.time_s if self.time_s > 0 else float("inf")

    @property
    def fullload_tok_s(self) -> float:
        return self.tokens / self.fullload_s if self.fullload_s > 0 else float("inf")

    @property
    def ratio(self) -> float:
        """Throughput as a fraction of FullLoad's (FullLoad seconds / policy seconds)."""
        return self.fullload_s / self.time_s if self.time_s > 0 else 1.0

    def row(self) -> dict:
        """The result as a flat dict (report columns)."""
        n = max(self.steps, 1)
        return {
            "policy": self.policy, "residency": self.budget_fraction, "budget": self.budget,
            "hit_rate": self.hit_rate, "device_rate": self.device_rate, "swaps": self.swaps,
            "prefetch_swaps": self.prefetch_swaps, "swap_gb": self.swap_bytes / 1e9,
            "fallback_token_experts": self.fallback_token_experts, "fallback_experts": self.fallback_experts,
            "ms_per_step": 1e3 * self.time_s / n, "stall_ms_per_step": 1e3 * self.stall_s / n,
            "host_ms_per_step": 1e3 * self.host_s / n, "device_ms_per_step": 1e3 * self.device_s / n,
            "projected_tok_s": self.tok_s, "full_load_tok_s": self.fullload_tok_s,
            "fraction_of_full_load": self.ratio, "refreshes": self.refreshes, "mean_interval": self.mean_interval,
            "steps": self.steps, "tokens": self.tokens,
        }


def fullload_seconds(trace: DiffusionTrace, costs: TideCosts) -> np.ndarray:
    """FullLoad seconds of each step (float64 ``[steps]``): non-expert work plus every layer computing all its
    active experts on the device."""
    c = trace.counts
    tok = c.sum(axis=2, dtype=np.int64)      # [N, L]
    act = (c > 0).sum(axis=2)               # [N, L]
    return costs.nonexpert_step_s + (act * costs.device_expert_s + tok * costs.device_token_s).sum(axis=1)


def profile_costs_on_trace(trace: DiffusionTrace, hardware, model_profile, overlap_host: bool = False) -> TideCosts:
    """A model profile's TIDE costs (``core.costs.TideCosts.from_profiles``) charged on a trace of a model with
    another number of MoE layers — e.g. the built-in ``llada2-medium`` (4 MoE layers of LLaDA2.0-mini's 256
    experts, top-8) under ``llada2.0-mini``: the per-expert costs (swap, device, host fallback; seconds) are the
    profile's, and a step's non-expert work is one forward of the trace's mean tokens per step, scaled from the
    profile's MoE layers to the trace's. ``bench diffusion`` scales every cost onto its measured FullLoad
    (``bench.diffusion.diffusion_regime``); ``simulate-diffusion`` uses these costs when only the layer count
    differs.

    Raises:
        MoeOffloadError: unknown profiles, or a profile lacking a TIDE key.
    """
    from ..core.profiles import load_model_profile

    mp = load_model_profile(model_profile) if isinstance(model_profile, str) else model_profile
    prof = TideCosts.from_profiles(hardware, mp, tokens_per_step=max(1, int(round(float(trace.tokens.mean())))),
                                   overlap_host=overlap_host)
    return prof.with_overrides(nonexpert_step_s=prof.nonexpert_step_s * trace.num_moe_layers / mp.num_moe_layers)


def budget_experts(fraction: float, num_experts: int) -> int:
    """Experts per layer for a budget fraction in (0, 1]: ``ceil(fraction * E)`` (at least 1).

    Raises MoeOffloadError for a fraction outside (0, 1]."""
    if not 0 < fraction <= 1:
        raise MoeOffloadError(f"budget fractions must be in (0, 1], got {fraction}")
    return max(1, math.ceil(fraction * num_experts - 1e-9))


def replay_diffusion(trace: DiffusionTrace, planner: RefreshPlanner, costs: TideCosts) -> DiffusionReplayResult:
    """Replay ``trace`` through ``planner`` (a fresh one) and charge modelled time (module docstring).

    Raises:
        MoeOffloadError: the planner's geometry differs from the trace's.
    """
    L, E = trace.num_moe_layers, trace.num_experts
    if planner.num_layers != L or planner.num_experts != E:
        raise MoeOffloadError(f"planner for {planner.num_layers}x{planner.num_experts} experts, trace has {L}x{E}")
    res = DiffusionReplayResult(policy=planner.name, budget=planner.budget, budget_fraction=planner.budget / E)
    replay = _RefreshReplay(planner, costs, res, L)
    step_times = np.zeros(trace.num_steps)
    for request, block, a, b in trace.blocks():
        planner.begin_block(request, block)
        for row in range(a, b):
            t0 = replay.now
            replay.step(int(trace.step[row]), trace.counts[row])
            step_times[row] = replay.now - t0
            planner.end_step(replay.now - t0)
    st = planner.stats
    res.steps = trace.num_steps
    res.tokens = int(trace.committed.sum())
    res.swaps = int(st["swaps"])
    res.blocking_swaps = int(st["blocking_swaps"])
    res.prefetch_swaps = int(st["prefetch_swaps"])
    res.swap_bytes = res.swaps * costs.expert_bytes
    res.time_s = replay.now
    res.fullload_s = float(fullload_seconds(trace, costs).sum())
    res.refreshes = int(st["refreshes"])
    if res.refreshes:
        res.mean_interval = trace.num_steps * L / res.refreshes
    res.step_s = step_times
    return res


class _RefreshReplay:
    """The modelled clock and link of one ``replay_diffusion`` (seconds): a step's refresh copies queued on the link,
    then each layer's non-expert slice, the copies that landed by then, the planner's routing and its costs."""

    def __init__(self, planner: RefreshPlanner, costs: TideCosts, res: DiffusionReplayResult, num_layers: int):
        self.planner, self.costs, self.res, self.L = planner, costs, res, num_layers
        self.swap = costs.swap_s
        self.slice_s = costs.nonexpert_step_s / (num_layers + 1)
        self.now = 0.0
        self.link_free = 0.0
        self.pending: list[dict[int, float]] = [dict() for _ in range(num_layers)]  # layer -> {expert: land time}

    def step(self, step: int, counts: np.ndarray) -> None:
        """One diffusion step numbered ``step`` whose layers route ``counts`` (int ``[L, E]``)."""
        plan = self.planner.begin_step(step)
        if plan is not None:
            for tr in plan.transfers:
                p = self.pending[tr.layer]
                for e in tr.evict:
                    p.pop(e, None)  # a cancelled copy (approximation: its link time is not refunded)
                for e in tr.load:
                    self.link_free = max(self.link_free, self.now) + self.swap
                    p[e] = self.link_free
        for layer in range(self.L):
            self.layer(layer, counts[layer])
        self.now += self.slice_s
        self.res.nonexpert_s += self.slice_s

    def layer(self, layer: int, c: np.ndarray) -> None:
        """One MoE layer routing ``c`` (tokens per expert): land finished copies, route, charge its time."""
        planner, costs, res = self.planner, self.costs, self.res
        self.now += self.slice_s
        res.nonexpert_s += self.slice_s
        p = self.pending[layer]
        if p:
            done = [e for e, t in p.items() if t <= self.now]
            if done:
                planner.land(layer, done)
                for e in done:
                    del p[e]
        dec = planner.route(layer, c)
        stall = self.blocking(dec.transfer, p) if dec.transfer is not None and dec.transfer.blocking else 0.0
        dev_t = costs.device_time(dec.device_tokens, len(dec.device))
        host_t = costs.fallback_time(dec.host_tokens, len(dec.host))
        lt = costs.layer_time(dev_t, host_t)
        self.now += stall + lt
        res.stall_s += stall
        res.device_s += dev_t
        res.host_s += lt - dev_t
        res.token_experts += dec.device_tokens + dec.host_tokens
        res.hit_token_experts += dec.hit_tokens
        res.device_token_experts += dec.device_tokens
        res.fallback_token_experts += dec.host_tokens
        res.fallback_experts += len(dec.host)

    def blocking(self, transfer, p: dict[int, float]) -> float:
        """A blocking transfer of the layer (whose pending copies are ``p``): its copies replace the pending ones
        and pre-empt the link; returns the stall (seconds)."""
        for e in transfer.evict:
            p.pop(e, None)
        for e in transfer.load:
            p.pop(e, None)
        if not transfer.load:
            return 0.0
        stall = len(transfer.load) * self.swap
        for q in self.pending:  # pre-empt the link: pending prefetches land later
            for e, t in q.items():
                if t > self.now:
                    q[e] = t + stall
        self.link_free = max(self.link_free, self.now) + stall
        return stall


# ------------------------------------------------------------------------------------------------ sweeps


def run_diffusion_sweep(trace: DiffusionTrace, costs_by_hw: dict, budgets: list[float], policies: list[str],
                        intervals: list[int], tau_max: int = 16, trace_name: str = "trace", model: str = "",
                        progress=None) -> tuple[list[dict], list[dict]]:
    """Replay ``trace`` for every hardware, budget and policy.

    Args:
        trace: the diffusion trace.
        costs_by_hw: ``{hardware name: TideCosts}``.
        budgets: budget fractions in (0, 1].
        policies: refresh policies (``core.policy_spec``; names are parsed): ``reactive``, ``tide-fixed`` (swept
            over ``intervals``; ``tide-fixed-T<n>``: that interval alone), ``tide``.
        intervals: tide-fixed intervals T.
        tau_max: the tide optimiser's longest interval.
        trace_name, model: labels for the rows.
        progress: optional callable ``progress()`` called after each replay.

    Returns:
        ``(rows, sweep)``: ``rows`` for the main table — per hardware and budget: ``reactive``, ``tide-fixed`` at
        its best T (``policy`` "tide-fixed(best T=..)", ``interval`` T) and ``tide`` (``interval`` its mean
        interval); ``sweep`` — one row per tide-fixed T plus the tide and reactive rows, for the interval plot.

    Raises:
        MoeOffloadError: an unknown policy, a bad budget, or no interval for tide-fixed.
    """
    pols = [parse_policy(p) for p in policies]
    for p in pols:
        if not p.refresh:
            raise MoeOffloadError(f"unknown policy {p.name!r} for a diffusion replay; choose among reactive, "
                                  "tide-fixed, tide")
    if any(p.family == "tide-fixed" and p.interval is None for p in pols) and not intervals:
        raise MoeOffloadError("tide-fixed needs at least one interval")
    L, E = trace.num_moe_layers, trace.num_experts
    rows, sweep = [], []
    for hw, costs in costs_by_hw.items():
        for frac in budgets:
            B = budget_experts(frac, E)
            base = {"trace": f"{trace_name} / {hw}", "synthetic": trace.synthetic, "model": model, "hardware": hw}
            fixed = []
            for p in pols:
                if p.family == "tide-fixed":
                    for T in (intervals if p.interval is None else [p.interval]):
                        r = replay_diffusion(trace, make_refresh_planner(p, L, E, B, interval=T), costs)
                        fixed.append((T, r))
                        sweep.append({**base, **r.row(), "policy": "tide-fixed", "interval": T})
                        if progress:
                            progress()
                    T, best = max(fixed, key=lambda x: (x[1].tok_s, -x[0]))
                    rows.append({**base, **best.row(), "policy": "tide-fixed(best T)", "interval": T})
                else:
                    pl = make_refresh_planner(p, L, E, B, costs=costs, tau_max=tau_max)
                    r = replay_diffusion(trace, pl, costs)
                    row = {**base, **r.row(), "interval": r.mean_interval if p.family == "tide" else None}
                    rows.append(row)
                    sweep.append(dict(row))
                    if progress:
                        progress()
    return rows, sweep


def write_diffusion_report(rows: list[dict], sweep: list[dict], out_dir, title: str, extra_md: str = "") -> list[Path]:
    """Write the main table (``sim.report.write_report``: ``results.csv``, ``results.md``, ``hit_rate.png``,
    ``decode_speed.png`` against the budget) plus the TIDE interval sweep: ``interval_sweep.csv``,
    ``interval_sweep.md`` and ``interval_sweep.png`` (throughput vs tide-fixed T per hardware and budget, tide's
    throughput drawn at its mean interval, reactive as a horizontal line, FullLoad's throughput in the panel
    title).

    Raises:
        MoeOffloadError: no rows, or ``out_dir`` exists and is a file or not empty (never overwrites).
    """
    from .report import table_lines, write_csv, write_report

    files = write_report(rows, out_dir, title)
    out = Path(out_dir)
    if extra_md:
        md = out / "results.md"
        md.write_text(md.read_text() + "\n" + extra_md.rstrip() + "\n")
    if not sweep:
        return files
    files.append(write_csv(sweep, out / "interval_sweep.csv"))
    keep = ["hardware", "residency", "policy", "interval", "projected_tok_s", "fraction_of_full_load", "hit_rate",
            "device_rate", "swaps", "fallback_token_experts", "ms_per_step"]
    lines = [f"# TIDE interval sweep — {title}", "",
             "tide-fixed refreshes every T steps (the authors' jump_steps); tide's interval is its mean interval "
             "(steps x layers / refreshes).", ""] + table_lines(sweep, keep)
    p = out / "interval_sweep.md"
    p.write_text("\n".join(lines) + "\n")
    files.append(p)
    files.append(_sweep_plot(sweep, out / "interval_sweep.png", title))
    return files


def _sweep_plot(sweep: list[dict], path: Path, title: str) -> Path:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict = {}
    for r in sweep:
        panels.setdefault((r["hardware"], r["residency"]), []).append(r)
    keys = sorted(panels, key=lambda k: (str(k[0]), float(k[1])))
    n = len(keys)
    ncol = min(n, 2)
    nrow = math.ceil(n / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol + 0.6, 3.6 * nrow), squeeze=False)
    for ax, key in zip(axes.ravel(), keys):
        rs = panels[key]
        fx = sorted((r["interval"], r["projected_tok_s"]) for r in rs if r["policy"] == "tide-fixed")
        if fx:
            ax.plot([x for x, _ in fx], [y for _, y in fx], marker="o", label="tide-fixed (T)")
        for r in rs:
            if r["policy"] == "tide":
                ax.axhline(r["projected_tok_s"], color="tab:red", linewidth=1)
                if r.get("interval"):
                    ax.plot([r["interval"]], [r["projected_tok_s"]], marker="*", markersize=13, color="tab:red",
                            linestyle="none", label=f"tide (mean interval {r['interval']:.1f})")
            elif r["policy"] == "reactive":
                ax.axhline(r["projected_tok_s"], color="tab:gray", linestyle=":", label="reactive (LRU)")
        fl = sorted({r.get("full_load_tok_s") for r in rs} - {None})
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
        fl_txt = f", FullLoad {fl[0]:.0f} tok/s" if fl else ""
        ax.set_title(f"{key[0]}, budget {100 * float(key[1]):.0f}%{fl_txt}", fontsize=9)
        ax.set_xlabel("refresh interval T (steps)")
        ax.set_ylabel("modelled tok/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    if any(r.get("synthetic") for r in sweep):
        title = f"{title} — SYNTHETIC trace"
    fig.suptitle(textwrap.fill(f"TIDE interval sweep: {title}", width=int(42 * ncol + 6)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
