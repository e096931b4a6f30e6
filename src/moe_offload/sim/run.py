"""``simulate``, the library side: replay routing traces under policies and residencies through the decision core,
with the model and hardware profiles that match the traces when they are known, the forecasts the forecast-driven
policies need, and a time model where a FullLoad speed is known; one report row per (trace, policy, residency).
``cli/simulate.py`` parses the options into a ``SimulateRequest`` and writes the report (``sim.report``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.forecast import ROLLOUT_EVERY, XL_DEPTH
from ..core.policy_spec import PolicySpec, require_predictor
from ..errors import MoeOffloadError


@dataclass
class SimulateRequest:
    """What ``simulate`` replays and how (the options of ``moe-offload simulate``; units in the field names).

    Attributes:
        traces: ``[(name, Trace)]``, routing traces of one model.
        policies: the policies to replay (``core.policy_spec``).
        residencies: device slots as fractions of all routed experts, each in (0, 1].
        model_profile, hardware: profile names (None: chosen to match the traces, ``choose_profiles``).
        full_load_tok_s: FullLoad decode tok/s when the profile has none.
        predictor: a trained predictor directory (the seqmoe policies need it).
        rollout_every: decode steps between the predictor's recursive rollouts.
        predictor_lag: MoE layers a forecast arrives late (the predictor in its own process), or None.
        link: ``host`` (the profile's host->device link) or ``disk`` (the profile's disk, two tiers).
        host_cache_frac: three tiers, a host cache of this fraction of all routed experts, or None.
        link_epl: the prefetching replay's link speed in experts per layer time, or None (the profiles').
        xl_depth: the later layers each cross-layer forecast covers (None: the runtime's ``XL_DEPTH``, or what a
            trace recorded when that is less).
    """

    traces: list
    policies: list[PolicySpec]
    residencies: list[float]
    model_profile: str | None = None
    hardware: str | None = None
    full_load_tok_s: float | None = None
    predictor: str | None = None
    rollout_every: int = ROLLOUT_EVERY
    predictor_lag: int | None = None
    link: str = "host"
    host_cache_frac: float | None = None
    link_epl: float | None = None
    xl_depth: int | None = None


def choose_profiles(req: SimulateRequest) -> tuple:
    """The hardware and model profiles for ``req.traces`` and a line saying which were used and why: named ones,
    else the model profile matching the (first) trace's model type and geometry (``profiles.model_profile_for``) or
    qwen3-30b-a3b-fp8, and ``profiles.default_hardware`` for it. Returns ``(hardware, model_profile, line)``."""
    from ..core.profiles import default_hardware, load_hardware, load_model_profile, model_profile_for

    traces = req.traces
    h = traces[0][1].header
    geo = (int(h["num_moe_layers"]), int(h["num_experts"]), int(h["top_k"]))
    same = all((t.num_moe_layers, t.num_experts, t.top_k) == geo for _, t in traces)
    model_type = str(h.get("model_id") or "").rsplit("-", 1)[0] or None
    geo_txt = f"{geo[0]} MoE layers x {geo[1]} experts, top-{geo[2]}"
    if req.model_profile:
        mp, why_m = load_model_profile(req.model_profile), "--model-profile"
    else:
        match = model_profile_for(*geo, model_type=None if h.get("synthetic") else model_type) if same else None
        if match:
            mp, why_m = load_model_profile(match), f"matches the trace: {model_type or '?'}, {geo_txt}"
        else:
            mp = load_model_profile("qwen3-30b-a3b-fp8")
            why_m = f"default: no shipped profile matches the trace's {geo_txt}; its miss rates are projected onto it"
    if req.hardware:
        hw, why_h = load_hardware(req.hardware), "--hardware"
    else:
        name, why_h = default_hardware(mp)
        hw = load_hardware(name)
    return hw, mp, f"profiles: model {mp.name} ({why_m}); hardware {hw.name} ({why_h})"


def simulate(req: SimulateRequest, say: Callable[[str], None] = print) -> tuple[list[dict], str, str | None]:
    """Replay every (trace, policy, residency) of ``req``.

    Args:
        say: told the profiles used, the held-out requests replayed and the blend weights (one line each).
    Returns:
        ``(rows, title, note)``: the report rows (``sim.report.write_report``), the report's title, and a line
        saying why the speed columns are empty (None when they are not).
    Raises:
        MoeOffloadError: a residency outside (0, 1]; a policy the simulator cannot replay here (a refresh planner,
            auto), one that needs ``predictor`` without it, a prefetching one without a link speed; bad options
            of the link and host tiers (``link_epl``, ``host_tier``); unreadable profiles or predictor.
    """
    from .simulator import build_policy

    if any(not (0 < r <= 1) for r in req.residencies):
        raise MoeOffloadError(f"--residency values must be in (0, 1], got {','.join(map(str, req.residencies))}")
    for spec in req.policies:
        if spec.kind in ("refresh", "auto"):
            raise MoeOffloadError(f"simulate replays eviction and prefetching policies; --policy {spec.name} is "
                                  + ("a diffusion refresh planner (simulate-diffusion)" if spec.refresh else
                                     "chosen by the runtime on the first prompt (replay lru, lfu, lfru, prefill-hot)"))
    hw, mp, used = choose_profiles(req)
    if req.link == "disk":
        from ..core.disk_link import over_disk

        hw = over_disk(hw, mp.expert_bytes)
        used += f"; link: {hw.link} at {hw.link_gbps:.2f} GB/s"
    say(used)
    tm, no_speed = time_model(req, hw, mp)
    traces, forecasts, popularity, pset = forecast_inputs(req, say)
    epl = link_epl(req, hw, mp, tm)
    for _, tr in traces:
        for spec in req.policies:  # every policy's object builds before the long loop
            if not spec.prefetch:
                build_policy(spec, tr, 1, needs=[])
    forecasts |= xl_streams(traces, req.policies, pset, req.rollout_every, req.xl_depth)
    if pset is not None and any(s.family == "seqmoe-xl" for s in req.policies):
        from ..predictor.xl_weights import describe_xl_weights

        say(f"seqmoe-xl's cross-layer blend weights: {describe_xl_weights(pset)}")
    rows = replays(traces, req.policies, req.residencies, mp, hw, tm, epl, forecasts, popularity,
                   host_tier(req, hw, mp))
    return rows, f"Expert hit rate and projected decode speed ({mp.name} on {hw.name})", no_speed


def time_model(req: SimulateRequest, hw, mp):
    """The on-demand time model, or ``(None, reason)`` when no FullLoad speed is known for this pair."""
    from .timemodel import OnDemandTimeModel

    if req.full_load_tok_s is None and hw.name not in mp.full_load_tok_s:
        return None, (f"projected speed: not computed ({mp.name} has no FullLoad speed on {hw.name}; pass "
                      "--full-load-tok-s, e.g. as measured by `moe-offload bench decode --residencies 1.0`)")
    return OnDemandTimeModel(hw, mp, full_load_tok_s=req.full_load_tok_s), None


def forecast_inputs(req: SimulateRequest, say: Callable[[str], None]) -> tuple[list, dict, object, object]:
    """``(traces, forecasts, popularity, pset)`` for the policies of ``req`` a predictor drives: with
    ``req.predictor``, its forecasts of the traces (``predictor_replay_set``); else empty.

    Raises:
        MoeOffloadError: such a policy without a predictor (``xl`` needs none), or a predictor lag without a
            predictor or without a seqmoe policy (or with a cross-layer one).
    """
    wants = [s for s in req.policies if s.needs_predictor]
    if req.predictor:
        seq = [s for s in wants if not s.cross_layer]
        if req.predictor_lag is not None and (len(seq) < len(wants) or not seq):
            raise MoeOffloadError("--predictor-lag replays the SeqMoE predictor's forecasts for the seqmoe policies, "
                                  "not --policy xl or seqmoe-xl (and needs one of them)")
        return predictor_replay_set(req.predictor, req.traces, bool(seq), req.rollout_every, req.predictor_lag, say)
    require_predictor(wants, None)
    if req.predictor_lag is not None:
        raise MoeOffloadError("--predictor-lag needs --predictor")
    return req.traces, {}, None, None


def link_epl(req: SimulateRequest, hw, mp, tm) -> float | None:
    """The link speed of the replays, experts per layer time: ``req.link_epl``, else the paper's overlap figure for
    the hardware (not over a disk), else the time model's; None when none is known.

    Raises:
        MoeOffloadError: a speed that is not > 0, or none for a prefetching policy.
    """
    paper_epl = None if req.link == "disk" else mp.paper_overlap_experts_per_layer.get(hw.name)  # a PCIe figure
    epl = req.link_epl or paper_epl or (tm.experts_per_layer_compute if tm else None)
    if epl is not None and not epl > 0:
        raise MoeOffloadError(f"--link-epl must be > 0, got {epl}")
    prefetching = [s.name for s in req.policies if s.prefetch]
    if prefetching and epl is None:
        raise MoeOffloadError(f"--policy {','.join(prefetching)} needs a link speed: pass --link-epl (experts per "
                              "layer time, e.g. 1.39) or --full-load-tok-s, or profiles that have one (e.g. "
                              "--hardware rtx4090 --model-profile qwen3-30b-a3b-fp8)")
    return epl


def host_tier(req: SimulateRequest, hw, mp) -> tuple[float, float] | None:
    """``(host cache fraction, seconds of one expert's disk read)`` for ``req.host_cache_frac``, else None.

    Raises:
        MoeOffloadError: a fraction outside (0, 1], with the disk link, with a prefetching policy, or a hardware
            profile without a disk entry.
    """
    frac = req.host_cache_frac
    if frac is None:
        return None
    from ..core.disk_link import disk_gbps

    if not 0 < frac <= 1:
        raise MoeOffloadError(f"--host-cache-frac must be in (0, 1], got {frac}")
    if req.link == "disk":
        raise MoeOffloadError("--host-cache-frac puts a host cache between the disk and the device: it replaces "
                              "--link disk (two tiers), keep the host link")
    pre = [s.name for s in req.policies if s.prefetch]
    if pre:
        raise MoeOffloadError(f"--host-cache-frac projects the history policies; not {', '.join(pre)} (their link "
                              "model has one tier)")
    disk = hw.extra.get("disk")
    if not disk:
        raise MoeOffloadError(f"hardware profile {hw.name} has no disk entry for the tier below the host cache")
    return frac, mp.expert_bytes / (disk_gbps(disk, mp.expert_bytes, 1) * 1e9)


def _three_tier_time(tm, host, tier, res, tr) -> dict:
    """The time model's decode time with ``tier``'s (``HostTierReplay``) hit rate folded into the per-miss cost."""
    from .host_tier import three_tier_load_s

    tm3 = copy.copy(tm)
    tm3.t_load_s = three_tier_load_s(tm.t_load_s, host[1], tier.hit_rate)
    return tm3.decode_time(res.per_step, tr) | {"host_cache_rows": tier.rows, "host_cache_hit_rate": tier.hit_rate}


def _row(name: str, tr, mp, hw, policy: str, r: float, slots: int, res) -> dict:
    return {"trace": Path(name).name, "synthetic": bool(tr.header.get("synthetic")), "model": mp.name,
            "hardware": hw.name, "policy": policy, "residency": r, "slots": slots, "hit_rate": res.hit_rate,
            "decode_hit_rate": res.decode_hit_rate, "hits": res.hits, "misses": res.misses,
            "decode_misses": res.decode_misses, "accesses": res.accesses}


def replays(traces, policies: list[PolicySpec], residencies, mp, hw, tm, epl, forecasts, popularity,
            host=None) -> list[dict]:
    """One report row per (trace, policy, residency): hit counts, and projected speed where ``tm`` (the time model)
    and ``epl`` (the link speed) are known; with ``host`` (``host_tier``) through a host cache tier."""
    from tqdm.auto import tqdm

    from .host_tier import HostTierReplay
    from .prefetch_sim import replay_policy
    from .simulator import layer_needs

    rows, oracle = [], {}
    bar = tqdm(total=len(traces) * len(policies) * len(residencies), desc="replays", leave=False)
    for name, tr in traces:
        needs = layer_needs(tr)
        n_total = tr.num_moe_layers * tr.num_experts
        for spec in policies:
            for r in residencies:
                slots = max(1, math.ceil(r * n_total - 1e-9))
                fc = forecasts.get((name, spec.name), forecasts.get(name))
                if spec.oracle and fc is not None:
                    from .forecasts import oracle_stream

                    # a cross-layer oracle names the true experts 1/k each: a chance of use of exactly 1
                    fc = oracle.setdefault((name, spec.family), oracle_stream(fc, tr, weighted=not spec.cross_layer))
                tier = None if host is None else HostTierReplay(max(1, math.ceil(host[0] * n_total - 1e-9)))
                res, fraction = replay_policy(tr, spec, slots, epl, forecasts=fc, needs=needs,
                                              prefill_popularity=popularity if spec.needs_predictor else None,
                                              on_loads=tier)
                row = _row(name, tr, mp, hw, spec.name if spec.prefetch else res.policy, r, slots, res) | {
                    "link_epl": epl, "decode_fraction_link_model": fraction}
                if spec.prefetch:
                    row |= {"prefetches": res.prefetches, "prefetch_accuracy": res.prefetch_accuracy,
                            "late": res.decode_late}
                else:
                    t = {} if tm is None else (tm.decode_time(res.per_step, tr) if tier is None else
                                               _three_tier_time(tm, host, tier, res, tr))
                    row |= {k: t[k] for k in ("projection", "projected_tok_s", "full_load_tok_s",
                                              "fraction_of_full_load", "stall_s_per_step", "host_cache_rows",
                                              "host_cache_hit_rate") if k in t}
                rows.append(row)
                bar.update(1)
    bar.close()
    return rows


def predictor_replay_set(predictor: str, traces: list, need_forecasts: bool, rollout_every: int,
                         lag: int | None = None, say: Callable[[str], None] = print):
    """For ``simulate --predictor``: the traces to replay (the predictor's held-out requests merged into one trace
    when these are its training traces, else all of them), if needed the forecasts for each, and the predictor's
    prefill popularity profile (SeqMoE §8.4; None for a predictor saved without one). ``lag``: as
    ``sim.forecasts.forecast_stream``."""
    from ..predictor.features import trace_sequences, training_split
    from ..predictor.model import load_predictor
    from ..trace.format import merge_requests
    from .forecasts import forecast_stream

    pset = load_predictor(predictor, model_id=traces[0][1].header.get("model_id"))
    keys = [s.key for i, (_, tr) in enumerate(traces) for s in trace_sequences(tr, i)]
    split = training_split(pset.header.training, [tr for _, tr in traces], keys)
    if split is not None:
        _, test = split
        chosen = [keys[j] for j in test]
        merged = merge_requests([(tr, [r for t_i, r in chosen if t_i == i]) for i, (_, tr) in enumerate(traces)],
                                source="held-out requests of " + ", ".join(Path(n).name for n, _ in traces))
        name = f"heldout-{len(chosen)}-of-{len(keys)}"
        say(f"replaying the predictor's {len(chosen)} held-out requests of {len(keys)} (all policies)")
        traces = [(name, merged)]
    fc = ({name: forecast_stream(pset, tr, rollout_every=rollout_every, progress=True, lag=lag) for name, tr in traces}
          if need_forecasts else {})
    return traces, fc, pset.header.prefill_popularity, pset


def xl_streams(traces: list, policies: list[PolicySpec], pset, rollout_every: int, depth: int | None = None) -> dict:
    """``{(trace name, policy name): forecast stream}`` for the cross-layer policies among ``policies``
    (``sim.forecasts.xl_stream``: ``xl`` alone, ``seqmoe-xl`` blended with ``pset``'s forecasts, ``xl-oracle``
    those of ``xl``, whose probabilities ``replays`` replaces by the truth), each forecast ``depth`` layers deep
    (None: the runtime's ``core.forecast.XL_DEPTH``, or a trace's recorded depth when that is less).

    Raises:
        MoeOffloadError: a trace without cross-layer forecasts, or recorded less than ``depth`` deep.
    """
    from .forecasts import xl_stream

    out = {}
    for spec in {s for s in policies if s.cross_layer}:
        for name, tr in traces:
            d = depth if depth is not None or tr.xl_probs is None else min(XL_DEPTH, tr.xl_probs.shape[2])
            out[(name, spec.name)] = xl_stream(tr, pset if spec.family == "seqmoe-xl" else None,
                                               rollout_every=rollout_every, progress=True, depth=d)
    return out
