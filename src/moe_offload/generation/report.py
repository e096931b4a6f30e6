"""Stats of a generation run as a dict (for ``--json``), as a short text table, and the notes that say what the
offloading numbers mean (and when a policy thrashes)."""

from __future__ import annotations

import torch

from ..common.threads import io_priority
from ..core.policy_spec import parse_policy
from ..errors import MoeOffloadError
from ..models.capability import experts_modules
from ..models.loader import LoadedModel
from ..runtime.cpu_account import summary_line
from ..runtime.fused_experts import experts_path
from .generate import RunStats

#: what each runtime policy does, for the report's mode line
POLICY_WORDS = {
    "lru": "evicts the least recently used expert from one slot pool shared by all layers",
    "lfu": "evicts the least frequently used expert from one slot pool shared by all layers",
    "prefill-hot": "keeps the experts the prefill used most; the rest share the remaining slots",
    "seqmoe-cacheonly": "evicts by the predictor's forecast (SeqMoE's probabilistic Belady)",
    "seqmoe": "evicts by the predictor's forecast and prefetches over an asynchronous copy engine (SeqMoE)",
    "seqmoe-infinity": "SeqMoE with MoE-Infinity's prefetch order",
    "xl": "evicts and prefetches by the next layers' routers applied to each layer's hidden state (cross-layer)",
    "seqmoe-xl": "SeqMoE with its next-layer forecasts blended with the next layers' routers (cross-layer)",
    "reactive": "per-layer budgets, on-demand loads at each diffusion step",
    "tide-fixed": "per-layer budgets refreshed every fixed number of diffusion steps, misses computed on the host",
    "tide": "TIDE: per-layer budgets refreshed at I/O-aware intervals; a miss is computed on the host or swapped in",
}
#: below this hit rate an offloading run with LRU is reported as thrashing
THRASH_HIT_RATE = 0.05


def stats_dict(lm: LoadedModel, s: RunStats) -> dict:
    """Run statistics: counts, bytes, seconds, tokens/s; ``slots``/``residency`` describe the slot pool
    (FullLoad: every routed expert resident, ``slots`` = all of them)."""
    total = lm.num_moe_layers * lm.num_experts
    eng = lm.engine
    o = s.offload
    slots = eng.pool.num_slots if eng else total
    return {
        "mode": "offload" if eng else "full-load",
        "policy": eng.policy_name if eng else None,
        "device": str(lm.device),
        "dtype": str(lm.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "io_priority": io_priority(),
        "experts_compute": experts_path([m for _, m in experts_modules(lm.model)], lm.dtype, lm.device),
        "requests": s.requests,
        "prompt_tokens": s.prompt_tokens,
        "decode_tokens": s.decode_tokens,
        "hits": o.hits,
        "misses": o.misses,
        "hit_rate": o.hit_rate,
        "bytes_loaded": o.bytes_loaded,
        "load_time_s": o.load_time_s,
        "ttft_s": (sum(s.ttft_s) / len(s.ttft_s)) if s.ttft_s else 0.0,
        "prefill_s": s.prefill_s,
        "decode_s": s.decode_s,
        "decode_tokens_per_s": s.decode_tokens_per_s,
        "slots": slots,
        "routed_experts": total,
        "residency": slots / total,
        "num_moe_layers": lm.num_moe_layers,
        "top_k": lm.top_k,
        "expert_bytes": lm.expert_bytes,
        "expert_dtypes": list(lm.expert_dtypes),
        "host_store": lm.host_store,
        "peak_slot_bytes": eng.pool.nbytes if eng else total * lm.expert_bytes,
        "host_store_bytes": eng.store.nbytes if eng else 0,
        "device_peak_bytes": torch.cuda.max_memory_reserved(lm.device) if lm.device.type == "cuda" else None,
    } | ({"time_breakdown": eng.breakdown.as_dict()} if getattr(eng, "breakdown", None) is not None
         and eng.breakdown.steps else {}) | ({"cpu_account": eng.account.as_dict(eng.breakdown.steps)}
                                             if getattr(eng, "account", None) is not None and eng.breakdown.steps
                                             else {}) | ({"auto_policy": {"choice": eng.auto_policy.choice, "simulated_hit_rates": eng.auto_policy.rates,
                          "decide_s": eng.auto_policy.decide_s}}
         if getattr(eng, "auto_policy", None) is not None else {}) | ({"host_fallback_experts": o.host_experts, "host_fallback_tokens": o.host_tokens,
          "fallback_s": o.fallback_s, "prefetches": o.prefetches, "diffusion_steps": o.steps}
         if hasattr(o, "host_experts") else {}) | tier_stats(lm)


def tier_stats(lm) -> dict:
    """``memory_plan`` (``--memory-budget``: ``serve.memory.MemoryPlan.as_dict``) and ``disk`` (``--host-store
    disk``: the store's read counters, ``runtime.disk_store.DiskReadStats``; bytes, seconds, GB/s), where they apply."""
    out = {}
    if lm.memory_plan is not None:
        out["memory_plan"] = lm.memory_plan.as_dict()
    store = getattr(lm.engine, "store", None)
    if getattr(store, "mode", None) == "disk":
        st = store.stats
        cache = getattr(store, "cache_stats", None)
        if cache is not None:
            out["host_cache"] = {"rows": store.rows, "bytes": store.nbytes, "hits": cache.hits,
                                 "misses": cache.misses, "bypasses": cache.bypasses, "waits": cache.waits,
                                 "evictions": cache.evictions, "hit_rate": cache.hit_rate}
        out["disk"] = {"requests": st.requests, "bytes_read": st.bytes_read, "expert_bytes": st.expert_bytes,
                       "experts": st.experts, "busy_s": st.busy_s, "gbps_per_reader": st.gbps,
                       "readers": store.readers, "direct_io": store.buffered_reason is None,
                       "demand_s": st.demand_s, "demand_bytes": st.demand_bytes, "demand_gbps": st.demand_gbps,
                       "demand_vs_measured": _demand_vs_measured(st),
                       "prefetch_yields": st.prefetch_yields, "prefetch_cancelled": st.prefetch_cancelled,
                       "pack": None if store.pack is None else str(store.pack), "in_place": st.in_place}
    return out


def _demand_vs_measured(st) -> float | None:
    """``DiskReadStats.demand_efficiency`` against this machine's ``bench link --disk`` measurement (None: no
    measurement, or no on-demand read)."""
    from ..core.disk_link import disk_gbps, this_machine_disk

    disk = this_machine_disk()
    if not disk or "table_gbps" not in disk:
        return None
    return st.demand_efficiency(lambda size, depth: disk_gbps(disk, size, depth))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _breakdown_line(b: dict) -> str:
    ms = b["ms_per_step"]
    return f"{sum(ms.values()):.2f} ms: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f} ({b['shares'][k]:.0%})"
                                                      for k, v in ms.items())


def _auto_line(a: dict) -> str:
    if a["choice"] is None:
        return "no choice yet (it is made when the first decode step begins): LRU so far"
    if not a["simulated_hit_rates"]:
        return f"chose {a['choice']} (the pool holds every expert: no eviction to choose)"
    rates = ", ".join(f"{k} {v:.3f}" for k, v in a["simulated_hit_rates"].items())
    return (f"chose {a['choice']} in {a.get('decide_s', 0.0):.3f} s (decode hit rates simulated on the first "
            f"prompt's routing: {rates})")


def _family(policy: str | None) -> str | None:
    """The family of the policy a run's stats name (``core.policy_spec``), None for FullLoad or ``auto:<choice>``."""
    try:
        return parse_policy(policy).family if policy else None
    except MoeOffloadError:
        return None


def _mode(d: dict) -> str:
    if not d["policy"]:
        return d["mode"]
    words = POLICY_WORDS.get(_family(d["policy"]))
    return f"{d['mode']}, policy {d['policy']}" + (f" ({words})" if words else "")


def _diffusion_row(g: dict) -> str:
    return (f"{g['output_tokens_per_s']:.2f} tok/s, {g['steps_per_s']:.2f} steps/s; {g['blocks']} "
            f"block{'' if g['blocks'] == 1 else 's'} of {g['block_length']}, {g['diffusion_steps']} steps "
            f"(<= {g['steps']} per block, mean {g['steps_per_block']:.2f}), {g['tokens_per_step']:.2f} tokens/step "
            f"(threshold {g['threshold']})")


def _disk_line(k: dict) -> str:
    return (f"{k['experts']} experts, {_fmt_bytes(k['bytes_read'])} read in {k['requests']} requests "
            f"({k['bytes_read'] / max(1, k['requests']) / 1024:.0f} KiB each: whole 4 KiB pages around the expert's "
            f"bytes), {k['gbps_per_reader']:.2f} GB/s per reader while reading, up to {k['readers']} readers at "
            f"once, {'direct I/O' if k['direct_io'] else 'buffered + fadvise DONTNEED'}; on-demand reads "
            f"{k['demand_gbps']:.2f} GB/s while outstanding"
            + (f" ({k['demand_vs_measured']:.0%} of `bench link --disk` at that request size and queue depth)"
               if k.get("demand_vs_measured") is not None else "")
            + (f"; prefetches yielded {k['prefetch_yields']} chunks to on-demand reads" if k["prefetch_yields"]
               else "")
            + (f"; from the expert pack {k['pack']} ({k['in_place']} experts read in place, without a staging copy)"
               if k.get("pack") else ""))


def _cache_line(c: dict) -> str:
    return (f"{c['rows']} experts ({_fmt_bytes(c['bytes'])}), hit rate {c['hit_rate']:.4f} ({c['hits']} hits, "
            f"{c['misses']} read from disk, {c['bypasses']} bypassed, {c['waits']} waited for a read in flight)")


def stats_table(d: dict) -> str:
    """A short two-column text table of ``stats_dict`` output. A diffusion run (``d["diffusion"]``, from
    ``generation.diffusion.diffusion_summary``) reports its own throughput (tokens/s, steps/s, blocks) instead of the
    autoregressive decode rate."""
    diff = d.get("diffusion")
    rows = [
        ("mode", _mode(d)),
        ("slots / routed experts", f"{d['slots']} / {d['routed_experts']} (residency {d['residency']:.2f})"),
        ("hit rate", f"{d['hit_rate']:.4f} ({d['hits']} hits, {d['misses']} misses)"),
        ("bytes loaded", f"{_fmt_bytes(d['bytes_loaded'])} in {d['load_time_s']:.3f} s"),
    ] + ([
        ("host fallback", f"{d['host_fallback_experts']} expert calls, {d['host_fallback_tokens']} token-experts in "
                          f"{d['fallback_s']:.3f} s; {d['prefetches']} expert{'' if d['prefetches'] == 1 else 's'} "
                          "prefetched"),
    ] if "host_fallback_experts" in d else []) + ([
        ("policy auto", _auto_line(d["auto_policy"])),
    ] if "auto_policy" in d else []) + ([
        ("decode step time", _breakdown_line(d["time_breakdown"])),
    ] if "time_breakdown" in d and not diff else []) + ([
        ("decode step CPU", summary_line(d["cpu_account"])),
    ] if "cpu_account" in d and not diff else []) + ([
        ("first block (mean)", f"{d['ttft_s']:.3f} s"),
        ("diffusion", _diffusion_row(diff)),
    ] if diff else [
        ("TTFT (mean)", f"{d['ttft_s']:.3f} s"),
        ("decode", f"{d['decode_tokens_per_s']:.2f} tok/s ({d['decode_tokens']} tokens"
                   + (f", {d['threads']} intra-op thread{'' if d['threads'] == 1 else 's'}" if "threads" in d else "")
                   + ("; expert readers real-time" if d.get("io_priority") == "realtime" else "") + ")"),
    ]) + [
        ("experts compute", d["experts_compute"]),
        ("peak slot bytes", _fmt_bytes(d["peak_slot_bytes"])),
        ("experts", f"{_fmt_bytes(d['expert_bytes'])} each, stored as {' + '.join(d['expert_dtypes'])}"
                    + (f"; host store {d['host_store']} ({_fmt_bytes(d['host_store_bytes'])} private)"
                       if d["host_store"] else "")),
    ] + ([("disk reads", _disk_line(d["disk"]))] if "disk" in d else []) + (
        [("host cache", _cache_line(d["host_cache"]))] if "host_cache" in d else [])
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def offload_notes(d: dict) -> list[str]:
    """One line saying what the hit rate of an offloading run (residency < 1) means, and one more when LRU
    thrashes: its hit rate is below ``THRASH_HIT_RATE`` while one decode step needs more experts than the pool
    holds, so the layers' experts cycle through the pool and each is evicted before its next use."""
    lookups = d["hits"] + d["misses"]
    if d["mode"] != "offload" or d["residency"] >= 1 or not lookups:
        return []
    notes = [f"hit rate {d['hit_rate']:.1%}: {d['hits']} of the {lookups} times a layer needed an expert, it was "
             f"already in the {d['slots']} device slots; the {d['misses']} misses were "
             + ("read from disk" if d.get("host_store") == "disk" else "copied from the host store")
             + f" ({_fmt_bytes(d['bytes_loaded'])})"]
    per_step = d["num_moe_layers"] * d["top_k"]
    if _family(d["policy"]) == "lru" and d["hit_rate"] < THRASH_HIT_RATE and d["slots"] < per_step:
        notes.append(f"LRU evicts every expert before its reuse at this residency (a step needs up to {per_step} "
                     f"experts, {d['num_moe_layers']} layers x top-{d['top_k']}, and they cycle through "
                     f"{d['slots']} slots): try --policy lfu")
    return notes


def format_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table (pipes in cells escaped) of string cells: ``head`` then ``rows``."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(head), "|" + "---|" * len(head)] + [line(r) for r in rows])
