"""``moe-offload bench serve``: a bounded load test on the loopback interface.

1. Reference: each prompt through ``generate``'s own loop (``generation.generate.generate_ids``, or the block-diffusion loop),
   one after another, greedy, in-process (no server running yet).
2. With the CPU tracker on (``serve.memory_profile.DeviceTierTracker``; skipped on CUDA, where memory is always measured):
   all clients at once, streaming, through the official ``openai`` client; tokens checked, device-tier peak kept.
3. The timed pass: the same clients at once again, tracker off: TTFT (from sending the request to the first
   streamed token) p50 / p95 and aggregate tokens/s (all completion tokens / wall time of the pass).

Every request asks for ``return_token_ids`` so the streamed token ids can be compared with the reference exactly.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from ..errors import MoeOffloadError
from ..generation.generate import encode_prompt, generate_ids
from ..serve.jobs import percentile


def prompts_for(n: int, max_chars: int) -> list[str]:
    """The first ``n`` ShareGPT human turns of at most ``max_chars`` characters.

    Raises:
        MoeOffloadError: the data set is missing or has too few such turns.
    """
    from ..testbed.sharegpt import human_turns

    turns = [t for t in human_turns(max(200, 10 * n)) if t.strip() and len(t) <= max_chars]
    if len(turns) < n:
        raise MoeOffloadError(f"only {len(turns)} ShareGPT turns are at most {max_chars} characters long; "
                              "raise --max-prompt-chars or lower --clients")
    return turns[:n]


def _reference(state, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float, list[float]]:
    """Greedy tokens of each prompt from ``generate``'s loop, sequentially (``serve --graph``: the server's own
    compiled step, as ``generate --graph``); the wall time and each request's TTFT (prefill / first block; seconds)."""
    lm, graph = state.lm, getattr(state.worker, "graph_decoder", None)
    out, ttft = [], []
    t0 = time.perf_counter()
    for p in prompts:
        ids = encode_prompt(lm.tokenizer, p)
        if len(ids) + max_tokens > state.max_context:
            raise MoeOffloadError(f"a prompt of {len(ids)} tokens + --max-tokens {max_tokens} exceeds --max-context "
                                  f"{state.max_context}")
        if graph is not None:
            new, first, _ = graph.generate_ids(ids, max_tokens)
        elif state.diffusion is None:
            new, first, _ = generate_ids(lm, ids, max_tokens)
        else:
            from ..generation.diffusion import diffusion_generate_ids

            res = diffusion_generate_ids(lm, ids, max_tokens, **state.diffusion)
            new, first = res.token_ids, res.first_block_s
        out.append(new)
        ttft.append(first)
    return out, time.perf_counter() - t0, ttft


async def _client(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    ttft, ids, text, usage = None, [], [], None
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            new = getattr(c, "token_ids", None) or []
            if new and ttft is None:
                ttft = time.perf_counter() - t0
            ids += new
            if c.delta.content:
                text.append(c.delta.content)
    return {"ttft": ttft, "ids": ids, "text": "".join(text), "start": t0, "end": time.perf_counter(), "usage": usage}


async def _concurrent(base_url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=3600) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*[_client(client, model, p, max_tokens) for p in prompts], return_exceptions=True)
        wall = time.perf_counter() - t0
    return {"results": res, "wall": wall}


def _summary(name: str, run: dict, refs: list[list[int]]) -> dict:
    res = run["results"]
    ok = [r for r in res if isinstance(r, dict)]
    errors = [r for r in res if not isinstance(r, dict)]
    same = len(ok) == len(refs) and all(r["ids"] == ref for r, ref in zip(res, refs))
    tokens = sum(len(r["ids"]) for r in ok)
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    usage_ok = all(r["usage"] is not None and r["usage"].completion_tokens == len(r["ids"]) for r in ok)
    return {"pass": name, "clients": len(res), "completed": len(ok), "errors": len(errors),
            "first_error": repr(errors[0]) if errors else None, "identical": same, "usage_ok": usage_ok,
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95), "tokens": tokens,
            "wall": run["wall"], "tok_s": tokens / run["wall"] if run["wall"] > 0 else 0.0}


def run_load_test(state, prompts: list[str], max_tokens: int, track_memory: bool = True, command: str = "") -> str:
    """Run the load test (module docstring) against ``state`` (a ``state.ServeState``); returns a markdown report.

    Raises:
        MoeOffloadError: the ``openai`` client is not installed, or a prompt does not fit ``--max-context``.
    """
    try:
        import openai  # noqa: F401
    except ImportError:
        raise MoeOffloadError("bench serve needs the openai client: pip install openai") from None
    refs, seq_wall, seq_ttft = _reference(state, prompts, max_tokens)
    seq_tokens = sum(len(r) for r in refs)
    state.lm.engine.reset_stats()  # the server totals below count the served passes only
    tracker = state.tracker
    state.worker.tracker = None
    passes = []
    from ..serve.server import ServerThread

    with ServerThread(state) as srv:
        if track_memory and tracker is not None:
            state.worker.tracker = tracker
            passes.append(_summary("concurrent, CPU memory tracker on", asyncio.run(
                _concurrent(srv.base_url, state.model_name, prompts, max_tokens)), refs))
            state.worker.tracker = None
        passes.append(_summary("concurrent (timed)", asyncio.run(
            _concurrent(srv.base_url, state.model_name, prompts, max_tokens)), refs))
        with urllib.request.urlopen(srv.base_url + "/v1/stats") as r:
            stats = json.loads(r.read())
    return _report(state, prompts, max_tokens, refs, seq_wall, seq_ttft, seq_tokens, passes, stats, command)


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _report(state, prompts, max_tokens, refs, seq_wall, seq_ttft, seq_tokens, passes, stats, command) -> str:
    from ..generation.report import format_table

    rows = [[f"sequential `generate{' --graph' if getattr(state.worker, 'graph_decoder', None) else ''}` "
             "(reference, no server)", 1, len(refs), 0, "reference",
             _f(percentile(seq_ttft, 0.5)), _f(percentile(seq_ttft, 0.95)), seq_tokens,
             _f(seq_wall, "{:.1f}"), _f(seq_tokens / seq_wall if seq_wall > 0 else 0.0)]]
    for p in passes:
        rows.append([p["pass"], p["clients"], p["completed"], p["errors"],
                     ("yes" if p["identical"] else "NO") + ("" if p["usage_ok"] else " (usage mismatch)"),
                     _f(p["ttft_p50"]), _f(p["ttft_p95"]), p["tokens"], _f(p["wall"], "{:.1f}"), _f(p["tok_s"])])
    table = format_table(["pass", "clients", "completed", "errors", "tokens identical", "TTFT p50 s", "TTFT p95 s",
                          "completion tokens", "wall s", "aggregate tok/s"], rows)
    mem = stats["memory"]
    plan, meas = mem["plan"], mem["measured"]
    budget = plan["budget_bytes"]
    peak = meas["device_peak_bytes"]
    mem_lines = [f"- memory plan ({plan['source']}): non-expert {plan['non_expert_bytes']:,} B + lookup "
                 f"{plan['lookup_bytes']:,} B + KV cache {plan['kv_cache_bytes']:,} B ({plan['max_context']} tokens) + "
                 f"activations {plan['activation_bytes']:,} B + slot pool {plan['slots']} x {plan['expert_bytes']:,} B "
                 f"= {plan['total_bytes']:,} B" + (f" of a budget of {budget:,} B" if budget is not None else "")]
    if peak is not None:
        extra = (f" = static {meas['static_bytes']:,} B + request peak {meas['request_peak_bytes']:,} B"
                 if meas.get("static_bytes") is not None and meas.get("request_peak_bytes") is not None else "")
        verdict = "" if budget is None else (f" — {peak / budget:.1%} of the budget, "
                                             f"{'within' if peak <= budget else 'OVER'} it")
        mem_lines.append(f"- measured peak device-tier memory: {peak:,} B{extra}{verdict} ({meas['method']})")
    else:
        mem_lines.append(f"- measured peak device-tier memory: {meas['method']}")
    errs = [p["first_error"] for p in passes if p["first_error"]]
    lines = [f"## bench serve: {len(prompts)} concurrent streaming clients", "",
             f"Command: `{command}`" if command else "", "",
             f"Model {state.model_name}, {stats['device']}, {stats['dtype']}, policy {stats['policy']}, "
             f"{stats['slots']} of {stats['routed_experts']} slots (residency {stats['residency']:.3f}); "
             f"{len(prompts)} ShareGPT prompts, {max_tokens} completion tokens each, greedy; {stats['scheduling']}.",
             "", table, "",
             f"- server totals: {stats['requests_served']} requests served, {stats['requests_cancelled']} cancelled, "
             f"{stats['requests_failed']} failed; hit rate {stats['hit_rate']:.4f} ({stats['hits']} hits, "
             f"{stats['misses']} misses), {stats['bytes_loaded']:,} B loaded; decode "
             f"{stats['decode_tokens_per_s']:.2f} tok/s; mean prefill (TTFT without queueing) {stats['ttft_s']:.3f} s",
             *mem_lines]
    if errs:
        lines.append(f"- first error: {errs[0]}")
    return "\n".join(lines)
