"""``moe-offload bench decode``: decode speed across residencies against FullLoad, measured in one run."""

from __future__ import annotations

import gc
from pathlib import Path

from .generate import run
from .models.loader import load_full, load_offloaded


def bench_decode(path: Path, prompts: list[str], residencies: list[float], *, max_new_tokens: int = 64,
                 device: str | None = None, dtype: str | None = None, policy: str = "lru",
                 progress: bool = True, predictor: str | None = None, link_epl: float | None = None) -> str:
    """Run FullLoad and then the offloaded model at each residency and policy on the same prompts (greedy).

    Args:
        policy: one policy name or several, comma-separated (``seqmoe*`` policies need ``predictor``).
        predictor: a trained predictor directory, run with the forecast-driven policies (its time is included).
        link_epl: emulate the link regime in which one layer's FullLoad compute overlaps the transfer of this many
            experts (SeqMoE §2.2: 1.39 for Qwen3-30B-A3B-FP8 on an RTX 4090): the FullLoad run of this very
            benchmark gives the layer time ``t = decode s / (tokens * L)``, and every expert copy (on demand or
            prefetch) then takes at least ``t / link_epl`` seconds. None: copies at this machine's memcpy speed.

    Returns a markdown table: policy, residency, slots, decode tok/s, ratio to FullLoad (same run), hit rate, bytes
    loaded, mean TTFT, and whether the tokens equal FullLoad's. A warm-up request precedes each measurement.

    Raises:
        MoeOffloadError: as ``load_offloaded``; a forecast-driven policy without ``predictor``.
    """
    from .errors import MoeOffloadError
    from .models.loader import FORECAST_RUNTIME_POLICIES

    policies = [p.strip() for p in policy.split(",") if p.strip()]
    if any(p in FORECAST_RUNTIME_POLICIES for p in policies) and not predictor:
        raise MoeOffloadError("--policy " + ",".join(p for p in policies if p in FORECAST_RUNTIME_POLICIES)
                              + " needs --predictor DIR")

    def measure(lm):
        run(lm, prompts[:1], min(8, max_new_tokens))  # warm-up (allocator, kernels); not counted
        return run(lm, prompts, max_new_tokens, progress=progress)

    full = load_full(path, device=device, dtype=dtype)
    ref_out, ref = measure(full)
    ref_tokens = [o.token_ids for o in ref_out]
    total_bytes = full.num_moe_layers * full.num_experts * full.expert_bytes
    t_layer = ref.decode_s / max(1, ref.decode_tokens) / full.num_moe_layers
    spe = t_layer / link_epl if link_epl else None
    del full
    gc.collect()
    rows = [("FullLoad", "-", "all", ref.decode_tokens_per_s, 1.0, None, 0, sum(ref.ttft_s) / len(ref.ttft_s), True,
             total_bytes)]
    breakdowns = []
    for pol in policies:
        for r in residencies:
            lm = load_offloaded(path, device=device, dtype=dtype, residency=r, policy=pol, progress=False,
                                link_epl=link_epl or 2.0, seconds_per_expert=spe)
            if pol in FORECAST_RUNTIME_POLICIES:
                _attach_predictor(lm, predictor)
            if spe is not None and lm.engine.prefetcher is None:  # a prefetcher's TransferEngine paces its copies
                _emulate_on_demand(lm, spe)
            outs, s = measure(lm)
            label = lm.engine.policy_name if pol == "auto" else pol  # auto: its choice, e.g. auto:lfu
            breakdowns.append((label, r, lm.engine.breakdown.as_dict()))
            same = [o.token_ids for o in outs] == ref_tokens
            rows.append((label, f"{r:.2f}", str(lm.engine.pool.num_slots), s.decode_tokens_per_s,
                         s.decode_tokens_per_s / ref.decode_tokens_per_s, s.offload.hit_rate, s.offload.bytes_loaded,
                         sum(s.ttft_s) / len(s.ttft_s), same, lm.engine.pool.nbytes))
            if lm.engine.prefetcher is not None:
                lm.engine.prefetcher.close()
            del lm
            gc.collect()
    head = ("| policy | residency | slots | decode tok/s | vs FullLoad | hit rate | MiB loaded | mean TTFT s | "
            "same tokens | device expert MiB |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for pol, name, slots, tps, ratio, hr, nbytes, ttft, same, dev_bytes in rows:
        lines.append(f"| {pol} | {name} | {slots} | {tps:.2f} | {ratio:.3f} | {'-' if hr is None else f'{hr:.4f}'} | "
                     f"{nbytes / 2**20:.1f} | {ttft:.3f} | {'yes' if same else 'NO'} | {dev_bytes / 2**20:.1f} |")
    regime = (f"; emulated link: {link_epl} experts per layer time = {1e6 * spe:.0f} us per expert copy "
              f"(FullLoad layer time {1e6 * t_layer:.0f} us)" if spe else "")
    lines.append(f"\n{len(prompts)} prompts x {max_new_tokens} new tokens, model {path}"
                 + (f", predictor {predictor}" if predictor else "") + regime)
    return "\n".join(lines + ["", *breakdown_table(breakdowns)])


def breakdown_table(rows: list[tuple[str, float, dict]]) -> list[str]:
    """Markdown lines: per (policy, residency) the decode step time split into the phases of
    ``runtime.breakdown`` (ms per step, share in parentheses), measured by the engine's lap timers."""
    from .runtime.breakdown import PHASES

    out = ["| policy | residency | ms per decode step | " + " | ".join(p.replace("_", " ") for p in PHASES) + " |",
           "|---|---|---|" + "---|" * len(PHASES)]
    for pol, r, b in rows:
        ms = b["ms_per_step"]
        out.append(f"| {pol} | {r:.2f} | {sum(ms.values()):.2f} | "
                   + " | ".join(f"{ms[p]:.2f} ({b['shares'][p]:.0%})" for p in PHASES) + " |")
    return out


def _attach_predictor(lm, predictor: str) -> None:
    """Run ``predictor`` during generation; feed its forecasts to a forecast-driven policy and the prefetcher."""
    from .predictor.model import load_predictor
    from .predictor.runtime import ForecastFeed, PredictorRunner

    pset = load_predictor(predictor, model_id=lm.model_id, device=lm.device)
    eng = lm.engine
    consumers = [c for c in (eng.table.policy if hasattr(eng.table.policy, "observe") else None, eng.prefetcher)
                 if c is not None]
    if consumers:
        eng.observers.append(ForecastFeed(PredictorRunner(pset, rollout=7), *consumers))
        if eng.prefetcher is not None:  # prefill offloading by offline popularity (SeqMoE §8.4)
            eng.prefetcher.set_prefill_popularity(pset.header.prefill_popularity)
    else:
        eng.observers.append(PredictorRunner(pset))


def _emulate_on_demand(lm, seconds_per_expert: float) -> None:
    """Make every on-demand expert copy of a non-prefetching engine take at least ``seconds_per_expert``."""
    import time

    eng = lm.engine
    plain = eng._load

    def slow_load(loads):
        t0 = time.perf_counter()
        plain(loads)
        end = t0 + len(loads) * seconds_per_expert
        while time.perf_counter() < end:
            time.sleep(0)

    eng._load = slow_load
