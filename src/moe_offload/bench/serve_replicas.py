"""``moe-offload bench replicas``: aggregate throughput of N engine replicas on Ray Serve vs one replica.

For each replica count (``--replicas 1,2``) a private local Ray instance starts with one CPU per replica
(``serve.replicas.start_replicas``; each replica's torch uses one intra-op thread), every replica loads the model,
and the same concurrent streaming clients (the official ``openai`` client, ``bench.serve_load``) run once against the
one endpoint. Tokens of every request are compared with the first configuration's (greedy; each replica batches
the requests Ray routes to it, so the batch compositions differ between rows and timing: tokens equal up to the
near ties of ``batching``). One table, the ratio of each count to the first in its last column.
"""

from __future__ import annotations

import asyncio
import socket

from .serve_load import _concurrent, _f, _summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_replicas_bench(cfg, counts: list[int], prompts: list[str], max_tokens: int, command: str = "",
                       log=print) -> str:
    """Run the clients against ``n`` replicas of ``cfg`` (a ``server.ServeConfig``) for each ``n`` in ``counts``;
    returns the markdown report (module docstring).

    Raises:
        MoeOffloadError: Ray Serve or the ``openai`` client is missing, or replicas fail to start.
    """
    from ..generation.report import format_table
    from ..serve.replicas import start_replicas, stop_replicas

    rows, ref = [], None
    for n in counts:
        log(f"bench replicas: {n} replica(s), {len(prompts)} clients")
        port = _free_port()
        start_replicas(cfg, n, "127.0.0.1", port)
        try:
            run = asyncio.run(_concurrent(f"http://127.0.0.1:{port}", cfg.model_name, prompts, max_tokens))
        finally:
            stop_replicas()
        ids = [r["ids"] if isinstance(r, dict) else None for r in run["results"]]
        ref = ids if ref is None else ref
        summary = _summary(f"{n}", run, ref)
        summary["differ"] = sum(1 for a, b in zip(ids, ref) if a is None or a != b)
        rows.append((n, summary))
    base = rows[0][1]["tok_s"]
    table = [[n, s["clients"], s["completed"], s["errors"], "reference" if i == 0 else ("yes" if s["identical"]
              else f"NO ({s['differ']} differ)"), _f(s["ttft_p50"]), _f(s["ttft_p95"]), s["tokens"],
              _f(s["wall"], "{:.1f}"), _f(s["tok_s"]), _f(s["tok_s"] / base if base > 0 else None)]
             for i, (n, s) in enumerate(rows)]
    head = ["replicas", "clients", "completed", "errors", "tokens identical", "TTFT p50 s", "TTFT p95 s",
            "completion tokens", "wall s", "aggregate tok/s", f"vs {counts[0]} replica(s)"]
    errs = [s["first_error"] for _, s in rows if s["first_error"]]
    lines = [f"## bench replicas: {len(prompts)} concurrent streaming clients through Ray Serve", "",
             f"Command: `{command}`" if command else "", "",
             f"Model {cfg.model_name}; {len(prompts)} ShareGPT prompts, {max_tokens} completion tokens each, greedy; "
             "one CPU (one torch thread) per replica, a private local Ray instance per row.", "",
             format_table(head, table)]
    if errs:
        lines += ["", f"- first error: {errs[0]}"]
    return "\n".join(lines)
