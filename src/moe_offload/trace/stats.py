"""Summary statistics of a routing trace (``moe-offload trace info``).

* popularity: per MoE layer, the share of all token activations that go to the most popular 10% of experts
  (uniform routing gives 0.10), averaged over layers;
* temporal overlap: per MoE layer, the Jaccard overlap ``|A_t ∩ A_{t+1}| / |A_t ∪ A_{t+1}|`` of the expert sets
  of consecutive decode steps of a request, averaged over layers and step pairs (the cross-step locality that
  SeqMoE §3.1 and TIDE exploit);
* reuse distance: for every decode-step activation of an expert, the number of decode steps since that expert
  (same layer) was last used in the same request; quantiles over all activations that had a previous use.
"""

from __future__ import annotations

import numpy as np

from .format import Trace


def step_counts(trace: Trace) -> dict:
    """How the trace's steps add up: ``steps`` = ``prefill_steps`` (one per request: the whole prompt in one forward
    pass, ``prefill_tokens`` tokens in all) + ``decode_steps`` (one generated token each)."""
    steps = trace.steps()
    prefill = sum(1 for s in steps if s[1] == 0)
    return {"steps": len(steps), "prefill_steps": prefill, "decode_steps": len(steps) - prefill,
            "prefill_tokens": int((trace.step == 0).sum())}


def trace_stats(trace: Trace) -> dict:
    """Statistics of ``trace`` as a dict (see the module docstring). Decode-only measures skip prefill rows."""
    L, E = trace.num_moe_layers, trace.num_experts
    ids = trace.expert_ids.astype(np.int64)
    counts = np.zeros((L, E), np.int64)
    for layer in range(L):
        counts[layer] = np.bincount(ids[:, layer, :].ravel(), minlength=E)
    top = max(1, int(round(0.10 * E)))
    share = np.sort(counts, axis=1)[:, ::-1][:, :top].sum(1) / np.maximum(counts.sum(1), 1)

    decode = trace.step > 0
    jacc, dists = [], []
    for r in range(trace.num_requests):
        rows = np.flatnonzero(decode & (trace.request == r))
        if len(rows) == 0:
            continue
        act = np.zeros((len(rows), L, E), bool)  # one row per decode step (one token each)
        np.put_along_axis(act, ids[rows], True, axis=2)
        if len(rows) > 1:
            inter = (act[1:] & act[:-1]).sum(-1)
            union = (act[1:] | act[:-1]).sum(-1)
            jacc.append((inter / np.maximum(union, 1)).ravel())
        last = np.full((L, E), -1, np.int64)
        for t in range(len(rows)):
            used = act[t]
            prev = last[used]
            dists.append(t - prev[prev >= 0])
            last[used] = t
    jacc_all = np.concatenate(jacc) if jacc else np.zeros(0)
    d_all = np.concatenate(dists) if dists else np.zeros(0)
    q = {f"p{int(p)}": float(np.percentile(d_all, p)) for p in (50, 90, 99)} if len(d_all) else {}
    return {
        "requests": trace.num_requests,
        **step_counts(trace),
        "num_moe_layers": L,
        "num_experts": E,
        "top_k": trace.top_k,
        "synthetic": bool(trace.header.get("synthetic")),
        "router_probs": trace.router_probs is not None,
        "xl_depth": 0 if trace.xl_probs is None else int(trace.xl_probs.shape[2]),
        "xl_forecasts": (trace.header.get("xl_forecasts") or "recorded") if trace.xl_probs is not None else None,
        "top10pct_share": float(share.mean()),
        "top10pct_share_per_layer": [float(x) for x in share],
        "mean_jaccard_consecutive": float(jacc_all.mean()) if len(jacc_all) else None,
        "reuse_distance_steps": q,
    }


def format_stats(s: dict) -> str:
    """Human-readable lines of ``trace_stats`` output."""
    lines = [
        f"model id:            {s.get('model_id', '?')}" if "model_id" in s else None,
        f"requests:            {s['requests']}" + ("  (SYNTHETIC)" if s["synthetic"] else ""),
        f"steps:               {s['steps']} = {s['prefill_steps']} prefill steps (one per request; "
        f"{s['prefill_tokens']} prompt tokens in all) + {s['decode_steps']} decode steps (one token each)",
        f"geometry:            {s['num_moe_layers']} MoE layers x {s['num_experts']} experts, top-{s['top_k']}",
        f"top-10% expert share: {s['top10pct_share']:.3f} (uniform: 0.100; per layer min "
        f"{min(s['top10pct_share_per_layer']):.3f}, max {max(s['top10pct_share_per_layer']):.3f})",
        "consecutive-step Jaccard: " + ("n/a" if s["mean_jaccard_consecutive"] is None
                                        else f"{s['mean_jaccard_consecutive']:.3f}"),
        "reuse distance (decode steps): " + (", ".join(f"{k} {v:g}" for k, v in s["reuse_distance_steps"].items())
                                              or "n/a"),
        "router probabilities: " + ("recorded" if s.get("router_probs") else "no (trace collect --router-probs)"),
        "cross-layer forecasts: " + (f"depth {s['xl_depth']}, {s['xl_forecasts']}" if s.get("xl_depth")
                                     else "no (trace collect --xl-forecasts)"),
    ]
    return "\n".join(ln for ln in lines if ln)


def diffusion_trace_info(dt) -> dict:
    """``trace info`` of a diffusion trace (``trace.diffusion.DiffusionTrace``): geometry, blocks, committed tokens,
    and the stability profile at per-layer budgets of 25% and 50% of the experts (8 steps after a refresh)."""
    from .diffusion import stability_profile

    return {"kind": "diffusion", "model_id": dt.header.get("model_id"), "synthetic": dt.synthetic,
            "num_moe_layers": dt.num_moe_layers, "num_experts": dt.num_experts, "top_k": dt.top_k,
            "block_length": dt.block_length, "diffusion_steps": dt.num_steps, "blocks": len(dt.blocks()),
            "tokens_committed": int(dt.committed.sum()),
            "stability": {f"budget_{b}": stability_profile(dt, max(1, round(b * dt.num_experts)), 8)
                          for b in (0.25, 0.5)}}

