"""Command line of ``moe-offload simulate`` (registered by ``moe_offload.cli``; ``simulate-diffusion`` lives in
``sim/diffusion_cli.py``): replay routing traces through the decision core, with the model and hardware profiles
that match the trace when they are known, and say which ones were used."""

from __future__ import annotations

import math
from pathlib import Path

from ..common.cliargs import add_predictor_lag_arg, float_, int_in, split_floats
from ..errors import MoeOffloadError
from ..predictor.runtime import ROLLOUT_EVERY


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
                    "none). The policies xl and seqmoe-xl need traces collected with --xl-forecasts")
    sm.add_argument("--rollout-every", type=int_in(1, 64), default=ROLLOUT_EVERY,
                    help="with --predictor: decode steps between the predictor's recursive rollouts, as the runtime "
                    f"runs it (default {ROLLOUT_EVERY}; 1 = every step, as SeqMoE)")
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


def choose_profiles(args, traces: list) -> tuple:
    """The hardware and model profiles for ``traces`` and a line saying which were used and why: named ones, else
    the model profile matching the (first) trace's model type and geometry (``profiles.model_profile_for``) or
    qwen3-30b-a3b-fp8, and ``profiles.default_hardware`` for it. Returns ``(hardware, model_profile, line)``."""
    from ..core.profiles import default_hardware, load_hardware, load_model_profile, model_profile_for

    h = traces[0][1].header
    geo = (int(h["num_moe_layers"]), int(h["num_experts"]), int(h["top_k"]))
    same = all((t.num_moe_layers, t.num_experts, t.top_k) == geo for _, t in traces)
    model_type = str(h.get("model_id") or "").rsplit("-", 1)[0] or None
    geo_txt = f"{geo[0]} MoE layers x {geo[1]} experts, top-{geo[2]}"
    if args.model_profile:
        mp, why_m = load_model_profile(args.model_profile), "--model-profile"
    else:
        match = model_profile_for(*geo, model_type=None if h.get("synthetic") else model_type) if same else None
        if match:
            mp, why_m = load_model_profile(match), f"matches the trace: {model_type or '?'}, {geo_txt}"
        else:
            mp = load_model_profile("qwen3-30b-a3b-fp8")
            why_m = f"default: no shipped profile matches the trace's {geo_txt}; its miss rates are projected onto it"
    if args.hardware:
        hw, why_h = load_hardware(args.hardware), "--hardware"
    else:
        name, why_h = default_hardware(mp)
        hw = load_hardware(name)
    return hw, mp, f"profiles: model {mp.name} ({why_m}); hardware {hw.name} ({why_h})"


def _time_model(args, hw, mp):
    """The on-demand time model, or ``(None, reason)`` when no FullLoad speed is known for this pair."""
    from .timemodel import OnDemandTimeModel

    if args.full_load_tok_s is None and hw.name not in mp.full_load_tok_s:
        return None, (f"projected speed: not computed ({mp.name} has no FullLoad speed on {hw.name}; pass "
                      "--full-load-tok-s, e.g. as measured by `moe-offload bench decode --residencies 1.0`)")
    return OnDemandTimeModel(hw, mp, full_load_tok_s=args.full_load_tok_s), None


def _row(name: str, tr, mp, hw, policy: str, r: float, slots: int, res) -> dict:
    return {"trace": Path(name).name, "synthetic": bool(tr.header.get("synthetic")), "model": mp.name,
            "hardware": hw.name, "policy": policy, "residency": r, "slots": slots, "hit_rate": res.hit_rate,
            "decode_hit_rate": res.decode_hit_rate, "hits": res.hits, "misses": res.misses,
            "decode_misses": res.decode_misses, "accesses": res.accesses}


def run(args) -> int:
    """``moe-offload simulate``: replays, report files, and the table on stdout. Returns the exit status."""
    from ..trace.format import load_trace
    from .prefetch_sim import PREFETCH_POLICIES
    from .report import write_report
    from .simulator import build_policy

    residencies = split_floats(args.residency, "--residency")
    if any(not (0 < r <= 1) for r in residencies):
        raise MoeOffloadError(f"--residency values must be in (0, 1], got {args.residency}")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty directory; choose a new --out")
    model_id = None
    if args.model:
        from ..models.checkpoint import checkpoint_model_id
        from ..testbed.resolve import resolve_model

        model_id = checkpoint_model_id(resolve_model(args.model))
    traces = [(t, load_trace(t)) for t in args.trace]
    hw, mp, used = choose_profiles(args, traces)
    if args.link == "disk":
        from ..core.disk_link import over_disk

        hw = over_disk(hw, mp.expert_bytes)
        used += f"; link: {hw.link} at {hw.link_gbps:.2f} GB/s"
    print(used)
    tm, no_speed = _time_model(args, hw, mp)
    traces, forecasts, popularity, pset = _forecast_inputs(args, policies, traces)
    epl = _link_epl(args, hw, mp, tm, policies)
    for _, tr in traces:
        if model_id:
            tr.check_model(model_id)
        for p in policies:  # validate every name before the long loop
            if p.lower() not in PREFETCH_POLICIES:
                build_policy(p, tr, 1, needs=[])
    forecasts |= _xl_streams(traces, policies, pset, args.rollout_every)
    if pset is not None and "seqmoe-xl" in {p.lower() for p in policies}:
        from ..predictor.xl_weights import describe_xl_weights

        print(f"seqmoe-xl's cross-layer blend weights: {describe_xl_weights(pset)}")
    rows = _replays(traces, policies, residencies, mp, hw, tm, epl, forecasts, popularity,
                    _host_tier(args, hw, mp, policies))
    files = write_report(rows, out, f"Expert hit rate and projected decode speed ({mp.name} on {hw.name})")
    print((out / "results.md").read_text())
    if no_speed:
        print(no_speed)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _forecast_inputs(args, policies: list[str], traces: list) -> tuple[list, dict, object, object]:
    """``(traces, forecasts, popularity, pset)`` for the forecast-driven and prefetching ``policies``: with
    ``--predictor``, its forecasts of ``traces`` (``_predictor_replay_set``); else empty.

    Raises:
        MoeOffloadError: such a policy without ``--predictor`` (``xl`` needs none), or ``--predictor-lag`` without
            ``--predictor`` or without a seqmoe policy.
    """
    from .prefetch_sim import PREFETCH_POLICIES, XL_POLICIES
    from .simulator import FORECAST_POLICIES

    wants = [p for p in policies if (p.lower() in FORECAST_POLICIES or p.lower() in PREFETCH_POLICIES)
             and p.lower() != "xl"]
    if args.predictor:
        seq = [p for p in wants if p.lower() not in XL_POLICIES]
        if args.predictor_lag is not None and (len(seq) < len(wants) or not seq):
            raise MoeOffloadError("--predictor-lag replays the SeqMoE predictor's forecasts for the seqmoe policies, "
                                  "not --policy xl or seqmoe-xl (and needs one of them)")
        return _predictor_replay_set(args.predictor, traces, bool(seq), args.rollout_every, args.predictor_lag)
    if wants:
        raise MoeOffloadError(f"--policy {','.join(wants)} needs --predictor DIR")
    if args.predictor_lag is not None:
        raise MoeOffloadError("--predictor-lag needs --predictor")
    return traces, {}, None, None


def _link_epl(args, hw, mp, tm, policies: list[str]) -> float | None:
    """The link speed of the replays, experts per layer time: ``--link-epl``, else the paper's overlap figure for
    the hardware (not over a disk), else the time model's; None when none is known.

    Raises:
        MoeOffloadError: a speed that is not > 0, or none for a prefetching policy.
    """
    from .prefetch_sim import PREFETCH_POLICIES

    paper_epl = None if args.link == "disk" else mp.paper_overlap_experts_per_layer.get(hw.name)  # a PCIe figure
    epl = args.link_epl or paper_epl or (tm.experts_per_layer_compute if tm else None)
    if epl is not None and not epl > 0:
        raise MoeOffloadError(f"--link-epl must be > 0, got {epl}")
    prefetching = [p for p in policies if p.lower() in PREFETCH_POLICIES]
    if prefetching and epl is None:
        raise MoeOffloadError(f"--policy {','.join(prefetching)} needs a link speed: pass --link-epl (experts per "
                              "layer time, e.g. 1.39) or --full-load-tok-s, or profiles that have one (e.g. "
                              "--hardware rtx4090 --model-profile qwen3-30b-a3b-fp8)")
    return epl


def _host_tier(args, hw, mp, policies) -> tuple[float, float] | None:
    """``(host cache fraction, seconds of one expert's disk read)`` for ``--host-cache-frac``, else None.

    Raises:
        MoeOffloadError: a fraction outside (0, 1], with --link disk, with a prefetching policy, or a hardware
            profile without a disk entry.
    """
    frac = args.host_cache_frac
    if frac is None:
        return None
    from ..core.disk_link import disk_gbps
    from .prefetch_sim import PREFETCH_POLICIES

    if not 0 < frac <= 1:
        raise MoeOffloadError(f"--host-cache-frac must be in (0, 1], got {frac}")
    if args.link == "disk":
        raise MoeOffloadError("--host-cache-frac puts a host cache between the disk and the device: it replaces "
                              "--link disk (two tiers), keep the host link")
    pre = [p for p in policies if p.lower() in PREFETCH_POLICIES]
    if pre:
        raise MoeOffloadError(f"--host-cache-frac projects the history policies; not {', '.join(pre)} (their link "
                              "model has one tier)")
    disk = hw.extra.get("disk")
    if not disk:
        raise MoeOffloadError(f"hardware profile {hw.name} has no disk entry for the tier below the host cache")
    return frac, mp.expert_bytes / (disk_gbps(disk, mp.expert_bytes, 1) * 1e9)


def _three_tier_time(tm, host, tier, res, tr) -> dict:
    """The time model's decode time with ``tier``'s (``HostTierReplay``) hit rate folded into the per-miss cost."""
    import copy

    from .host_tier import three_tier_load_s

    tm3 = copy.copy(tm)
    tm3.t_load_s = three_tier_load_s(tm.t_load_s, host[1], tier.hit_rate)
    return tm3.decode_time(res.per_step, tr) | {"host_cache_rows": tier.rows, "host_cache_hit_rate": tier.hit_rate}


def _replays(traces, policies, residencies, mp, hw, tm, epl, forecasts, popularity, host=None) -> list[dict]:
    """One report row per (trace, policy, residency): hit counts, and projected speed where ``tm`` (the time model)
    and ``epl`` (the link speed) are known; with ``host`` (``_host_tier``) through a host cache tier."""
    from tqdm.auto import tqdm

    from .host_tier import HostTierReplay
    from .prefetch_sim import PREFETCH_POLICIES, replay_policy
    from .simulator import layer_needs

    rows, oracle = [], {}
    bar = tqdm(total=len(traces) * len(policies) * len(residencies), desc="replays", leave=False)
    for name, tr in traces:
        needs = layer_needs(tr)
        n_total = tr.num_moe_layers * tr.num_experts
        for p in policies:
            for r in residencies:
                slots = max(1, math.ceil(r * n_total - 1e-9))
                fc = forecasts.get((name, p.lower()), forecasts.get(name))
                if p.lower().endswith("-oracle") and fc is not None:
                    from .forecasts import oracle_stream

                    fc = oracle.setdefault(name, oracle_stream(fc, tr))
                tier = None if host is None else HostTierReplay(max(1, math.ceil(host[0] * n_total - 1e-9)))
                res, fraction = replay_policy(tr, p, slots, epl, forecasts=fc, needs=needs,
                                              prefill_popularity=None if p.lower() == "xl" else popularity,
                                              on_loads=tier)
                row = _row(name, tr, mp, hw, res.policy if p.lower() not in PREFETCH_POLICIES else p.lower(), r,
                           slots, res) | {"link_epl": epl, "decode_fraction_link_model": fraction}
                if p.lower() in PREFETCH_POLICIES:
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


def _predictor_replay_set(predictor: str, traces: list, need_forecasts: bool, rollout_every: int,
                          lag: int | None = None):
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
        print(f"replaying the predictor's {len(chosen)} held-out requests of {len(keys)} (all policies)")
        traces = [(name, merged)]
    fc = ({name: forecast_stream(pset, tr, rollout_every=rollout_every, progress=True, lag=lag) for name, tr in traces}
          if need_forecasts else {})
    return traces, fc, pset.header.prefill_popularity, pset


def _xl_streams(traces: list, policies: list[str], pset, rollout_every: int) -> dict:
    """``{(trace name, policy): forecast stream}`` for the cross-layer policies among ``policies``
    (``sim.forecasts.xl_stream``: ``xl`` alone, ``seqmoe-xl`` blended with ``pset``'s forecasts).

    Raises:
        MoeOffloadError: a trace without cross-layer forecasts.
    """
    from .forecasts import xl_stream
    from .prefetch_sim import XL_POLICIES

    out = {}
    for p in {p.lower() for p in policies} & set(XL_POLICIES):
        for name, tr in traces:
            out[(name, p)] = xl_stream(tr, pset if p == "seqmoe-xl" else None, rollout_every=rollout_every,
                                       progress=True)
    return out
