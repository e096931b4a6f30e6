"""``moe-offload bench serve --residencies R,.. --batches B,..``: batch-1 server vs continuous batching in one run.

For every residency R (outer loop) and max batch B (inner loop) the server is loaded afresh (its own memory plan:
the KV cache of B sequences, the slot pool of R) and the same concurrent streaming clients (the official ``openai``
client, ``bench.serve_load``) run against it: a pass with the CPU device-tier tracker on (its peak is the memory
column; skipped with ``track_memory=False``; on CUDA memory is always measured) and the timed pass (engine
counters reset before it: hit rate and bytes loaded per generated token are the timed pass's own). One table, one
row per configuration, then the throughput ratio of each batched configuration to batch 1 at its residency.

Tokens: the batch-1 server runs each request through ``generation.generate.generate_ids`` alone, so its tokens are the
reference; every other row is compared with the batch-1 row of the same residency, and the batch-1 rows of all
residencies with each other (greedy; the batched rows may differ only by near ties, ``batching``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import urllib.request

from ..errors import MoeOffloadError
from .serve_load import _concurrent, _f, _summary
from ..serve.jobs import percentile


def _one(cfg, prompts: list[str], max_tokens: int, track_memory: bool, log) -> dict:
    """Load the server for ``cfg`` (a ``ServeConfig``) and run the passes; returns the timed pass's summary with
    ``ids`` (token ids per request), ``tpot`` (mean per-token latency after the first, seconds) and the server's
    ``/v1/stats`` after it."""
    from ..serve.server import ServerThread, load_for_serving

    cfg.track_memory = True  # the tracker is switched on only for its own pass
    state = load_for_serving(cfg, log=log)
    tracker, worker = state.tracker, state.worker
    worker.tracker = None
    with ServerThread(state) as srv:
        if track_memory and tracker is not None:
            worker.tracker = tracker
            asyncio.run(_concurrent(srv.base_url, state.model_name, prompts, max_tokens))
            worker.tracker = None
        state.lm.engine.reset_stats()
        run = asyncio.run(_concurrent(srv.base_url, state.model_name, prompts, max_tokens))
        with urllib.request.urlopen(srv.base_url + "/v1/stats") as r:
            stats = json.loads(r.read())
    res = run["results"]
    out = _summary("timed", run, [r["ids"] if isinstance(r, dict) else None for r in res])
    ok = [r for r in res if isinstance(r, dict)]
    gaps = [(r["end"] - r["start"] - r["ttft"]) / (len(r["ids"]) - 1) for r in ok
            if r["ttft"] is not None and len(r["ids"]) > 1]
    out |= {"ids": [r["ids"] if isinstance(r, dict) else None for r in res], "stats": stats,
            "tpot_p50": percentile(gaps, 0.5), "tpot_mean": sum(gaps) / len(gaps) if gaps else None}
    del state
    return out


def run_compare(base_cfg, residencies: list[float], batches: list[int], prompts: list[str], max_tokens: int,
                track_memory: bool = True, command: str = "", log=print) -> str:
    """Run every (residency, max batch) configuration (module docstring); returns the markdown report.

    Args:
        base_cfg: the ``ServeConfig`` of the other options (its residency / slots / budget / max_batch are set per
            configuration). residencies: fractions in (0, 1]. batches: max batch sizes (>= 1; 1 is the batch-1
            server and the token reference, so it is required).
        prompts: the clients' prompts (one request each). max_tokens: completion tokens per request.
    Raises:
        MoeOffloadError: ``batches`` lacks 1, the ``openai`` client is missing, or a configuration fails to load.
    """
    import dataclasses

    try:
        import openai  # noqa: F401
    except ImportError:
        raise MoeOffloadError("bench serve needs the openai client: pip install openai") from None
    if 1 not in batches:
        raise MoeOffloadError("--batches must include 1 (the batch-1 server is the token reference)")
    rows = {}
    for r in residencies:
        for b in sorted(batches):
            log(f"bench serve: residency {r}, max batch {b}")
            cfg = dataclasses.replace(base_cfg, residency=r, slots=None, memory_budget_gb=None, max_batch=b)
            row = rows[(r, b)] = _one(cfg, prompts, max_tokens, track_memory, log)
            log(f"bench serve: residency {r}, max batch {b}: {row['tok_s']:.2f} tok/s, TTFT p95 "
                f"{_f(row['ttft_p95'])} s, {row['errors']} errors")
            gc.collect()  # the previous configuration's model and pool
    return _report(rows, residencies, sorted(batches), prompts, max_tokens, command)


def _identical(rows: dict, r: float, b: int, ref_r: float) -> str:
    """'yes' when the row's tokens equal its residency's batch-1 row (and batch-1 rows equal the first
    residency's), else how many requests differ."""
    ref = rows[(r, 1)]["ids"] if b != 1 else rows[(ref_r, 1)]["ids"]
    got = rows[(r, b)]["ids"]
    bad = sum(1 for a, c in zip(got, ref) if a is None or a != c)
    if b == 1 and r == ref_r:
        return "reference"
    return "yes" if bad == 0 else f"NO ({bad} differ)"


def _ratio(r: float, b: int, row: dict, one: dict) -> str:
    """The line comparing max batch ``b`` (``row``) with batch 1 (``one``) at residency ``r``."""
    if one["tok_s"] <= 0:
        return f"- residency {r:g}: batch 1 made 0 tok/s"
    return (f"- residency {r:g}: max batch {b} / batch 1 = {row['tok_s'] / one['tok_s']:.2f}x aggregate tok/s "
            f"({row['tok_s']:.2f} vs {one['tok_s']:.2f}); TTFT p95 {_f(row['ttft_p95'])} s vs {_f(one['ttft_p95'])} s")


def _report(rows, residencies, batches, prompts, max_tokens, command) -> str:
    from ..generation.report import format_table

    ref_r = residencies[0]
    table, ratios = [], []
    for (r, b), row in rows.items():
        st = row["stats"]
        plan, meas = st["memory"]["plan"], st["memory"]["measured"]
        budget = plan["budget_bytes"] if plan["budget_bytes"] is not None else plan["total_bytes"]
        peak = meas["device_peak_bytes"]
        tokens = max(1, row["tokens"])
        table.append([f"{r:g}", b, st["slots"], row["completed"], row["errors"], _identical(rows, r, b, ref_r),
                      _f(row["tok_s"]), _f(row["ttft_p50"]), _f(row["ttft_p95"]),
                      _f(row["tpot_mean"] * 1e3 if row["tpot_mean"] is not None else None, "{:.0f}"),
                      _f(st["hit_rate"], "{:.4f}"), f"{st['bytes_loaded'] / tokens:,.0f}",
                      "-" if peak is None else f"{peak / 1e6:,.0f}", f"{budget / 1e6:,.0f}",
                      "-" if peak is None else ("yes" if peak <= budget else "NO")])
        if b != 1:
            ratios.append(_ratio(r, b, row, rows[(r, 1)]))
    head = ["residency", "max batch", "slots", "completed", "errors", "tokens identical", "aggregate tok/s",
            "TTFT p50 s", "TTFT p95 s", "per-token ms", "hit rate", "B loaded / token", "peak MB",
            "budget MB", "peak <= budget"]
    st = next(iter(rows.values()))["stats"]
    lines = [f"## bench serve: batch 1 vs continuous batching, {len(prompts)} concurrent streaming clients", "",
             f"Command: `{command}`" if command else "", "",
             f"Model {st['model']}, {st['device']}, {st['dtype']}, policy {st['policy']}; {len(prompts)} ShareGPT "
             f"prompts, {max_tokens} completion tokens each, greedy. Per-token ms: mean over requests of (last token "
             "- first token) / (tokens - 1). Hit rate and bytes loaded: the timed pass. Peak: device-tier peak of "
             "the tracked pass; budget: --memory-budget, else the memory plan's total.", "",
             format_table(head, table), "", *ratios]
    return "\n".join(lines)
