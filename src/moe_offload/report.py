"""Stats of a generation run as a dict (for ``--json``) and as a short text table."""

from __future__ import annotations

import torch

from .generate import RunStats
from .models.loader import LoadedModel


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
        "expert_bytes": lm.expert_bytes,
        "expert_dtypes": list(lm.expert_dtypes),
        "host_store": lm.host_store,
        "peak_slot_bytes": eng.pool.nbytes if eng else total * lm.expert_bytes,
        "host_store_bytes": eng.store.nbytes if eng else 0,
        "device_peak_bytes": torch.cuda.max_memory_reserved(lm.device) if lm.device.type == "cuda" else None,
    } | ({"time_breakdown": eng.breakdown.as_dict()} if getattr(eng, "breakdown", None) is not None
         and eng.breakdown.steps else {}) | ({"auto_policy": {"choice": eng.auto_policy.choice, "simulated_hit_rates": eng.auto_policy.rates}}
         if getattr(eng, "auto_policy", None) is not None else {}) | ({"host_fallback_experts": o.host_experts, "host_fallback_tokens": o.host_tokens,
          "fallback_s": o.fallback_s, "prefetches": o.prefetches, "diffusion_steps": o.steps}
         if hasattr(o, "host_experts") else {})


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
    rates = ", ".join(f"{k} {v:.3f}" for k, v in a["simulated_hit_rates"].items())
    return f"chose {a['choice']} (hit rates simulated on the first prompt's routing, token by token: {rates})"


def stats_table(d: dict) -> str:
    """A short two-column text table of ``stats_dict`` output."""
    rows = [
        ("mode", f"{d['mode']}" + (f" ({d['policy']})" if d["policy"] else "")),
        ("slots / routed experts", f"{d['slots']} / {d['routed_experts']} (residency {d['residency']:.2f})"),
        ("hit rate", f"{d['hit_rate']:.4f} ({d['hits']} hits, {d['misses']} misses)"),
        ("bytes loaded", f"{_fmt_bytes(d['bytes_loaded'])} in {d['load_time_s']:.3f} s"),
    ] + ([
        ("host fallback", f"{d['host_fallback_experts']} expert calls, {d['host_fallback_tokens']} token-experts in "
                          f"{d['fallback_s']:.3f} s; {d['prefetches']} expert{'' if d['prefetches'] == 1 else 's'} "
                          "prefetched"),
    ] if "host_fallback_experts" in d else []) + ([
        ("policy auto", _auto_line(d["auto_policy"])),
    ] if "auto_policy" in d else []) + [
    ] + ([
        ("decode step time", _breakdown_line(d["time_breakdown"])),
    ] if "time_breakdown" in d else []) + [
        ("TTFT (mean)", f"{d['ttft_s']:.3f} s"),
        ("decode", f"{d['decode_tokens_per_s']:.2f} tok/s ({d['decode_tokens']} tokens)"),
        ("peak slot bytes", _fmt_bytes(d["peak_slot_bytes"])),
        ("experts", f"{_fmt_bytes(d['expert_bytes'])} each, stored as {' + '.join(d['expert_dtypes'])}"
                    + (f"; host store {d['host_store']} ({_fmt_bytes(d['host_store_bytes'])} private)"
                       if d["host_store"] else "")),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def format_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table (pipes in cells escaped) of string cells: ``head`` then ``rows``."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(head), "|" + "---|" * len(head)] + [line(r) for r in rows])
