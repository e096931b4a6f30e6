"""``moe-offload serve`` (the OpenAI and Anthropic APIs over the offloaded engine, ``serve.server``) and the load
tests ``bench serve`` / ``bench replicas`` (``bench.serve_load``, ``bench.serve_compare``, ``bench.serve_replicas``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core.policy_spec import parse_policy
from ..errors import MoeOffloadError
from ..serve.limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES
from .args import (MODEL_HELP, add_host_store_arg, add_memory_budget_arg, add_threads_arg, finite_float, nonneg_int,
                   positive_int)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--served-model-name", help="the model name clients pass (default: --model as given)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    p.add_argument("--policy", default="auto", help="eviction policy: auto (default: the best of lru, lfu, lfru-H "
                   "simulated on the first request's own routing), lru, lfu, lfru[-H], prefill-hot; with "
                   "--predictor seqmoe-cacheonly, seqmoe, seqmoe-infinity; diffusion models also reactive, "
                   "tide-fixed[-T<n>], tide")
    p.add_argument("--predictor", metavar="DIR", help="a trained SeqMoE predictor (`predictor train`) for the "
                   "forecast-driven policies seqmoe-cacheonly, seqmoe, seqmoe-infinity; with batching, the batch's "
                   "per-sequence forecasts are combined into one demand per expert (1 - prod(1 - p)); default: none)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--residency", type=finite_float, help="device slots as a fraction of all routed experts, (0, 1] "
                      "(default: see --memory-budget)")
    size.add_argument("--slots", type=positive_int, help="number of device slots, >= top-k (default: see "
                      "--memory-budget)")
    add_memory_budget_arg(size)
    add_host_store_arg(p)
    p.add_argument("--max-context", type=positive_int,
                   help="most tokens (prompt + completion) per request (default: min(1024, the model's positions))")
    p.add_argument("--max-batch", type=positive_int, metavar="N",
                   help="most requests decoding together (continuous batching; default: chosen by the memory plan, "
                   "at most 32, so the KV cache of N requests at --max-context takes at most half of what the "
                   "weights leave of --memory-budget; 1: one request at a time). Diffusion models run batch 1")
    p.add_argument("--block-length", type=int, help="diffusion models: positions per block (default 32)")
    p.add_argument("--steps", type=int, help="diffusion models: diffusion steps per block (default: block length)")
    p.add_argument("--threshold", type=finite_float, help="diffusion models: commit confidence in (0, 1] (default 0.95)")
    p.add_argument("--no-prefix-cache", action="store_true", help="diffusion models: recompute the whole prefix at "
                   "every diffusion step instead of caching the committed blocks' keys and values (same tokens)")
    add_threads_arg(p)
    p.add_argument("--graph", action="store_true", help="decode with graph mode's compiled step (torch.compile; "
                   "compiled once at start, about a minute the first time, then cached by torch): batch 1, the pool "
                   "from --residency / --slots, --host-store pinned, autoregressive models (default: the eager step)")
    p.add_argument("--graph-backend", choices=["inductor", "aot_eager"], default="inductor",
                   help="with --graph: the torch.compile backend (default inductor)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_parsers(sub, bench_sub) -> None:
    """Add ``serve`` to the top-level subparsers and ``serve`` to ``bench``'s."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server: streaming, live stats, memory budget")
    _add_common(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=nonneg_int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--replicas", type=positive_int, metavar="N",
                   help="run N engine replicas behind this one endpoint on Ray Serve (a private local Ray instance, "
                   "one CPU per replica; Ray routes and health-checks them; needs pip install 'ray[serve]'). "
                   "On a cluster use `serve run moe_offload.serve.replicas:build` (docs/usage.md, 'Replicas (Ray "
                   "Serve)'; default: one engine, no Ray)")
    s.add_argument("--track-memory", action="store_true",
                   help="on the CPU: measure the device-tier peak during requests (shown in /v1/stats; about 1.6x "
                   "slower decoding). On CUDA it is always measured")
    s.add_argument("--max-queue", type=nonneg_int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="most requests waiting for the engine; more get 503 (OpenAI API) / 529 overloaded (Anthropic "
                   f"API) with Retry-After, which clients retry (default {DEFAULT_MAX_QUEUE}; 0: no limit)")
    s.add_argument("--max-request-mb", type=finite_float, default=DEFAULT_MAX_REQUEST_BYTES / 1e6, metavar="MB",
                   help="most megabytes (10^6 bytes) of a request body; larger ones get 413 (default "
                   f"{DEFAULT_MAX_REQUEST_BYTES / 1e6:g}, Anthropic's limit)")
    s.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template replacing the model's (e.g. one "
                   "that renders tools; docs/usage.md, 'Tool calls'; default: the model's own)")
    s.add_argument("--response-template", metavar="FILE", help="a transformers response template (JSON) that parses "
                   "the model's tool calls (default: the tokenizer's own, else one of ours chosen from the chat "
                   "template: hermes, qwen3-coder, json)")
    s.add_argument("--cors-origins", default="*", metavar="ORIGIN[,ORIGIN...]",
                   help="browser origins allowed to call the API (CORS, preflight OPTIONS answered), e.g. "
                   "http://localhost:3000; none: no CORS headers (default *: any origin, no credentials)")
    b = bench_sub.add_parser("serve", help="load test: concurrent streaming clients against a loopback server; "
                             "TTFT p50/p95, aggregate tok/s, tokens vs generate, peak device-tier memory")
    _add_common(b)
    b.add_argument("--clients", type=positive_int, default=32, help="concurrent streaming clients (default 32)")
    b.add_argument("--max-tokens", type=positive_int, default=32, help="completion tokens per request (default 32)")
    b.add_argument("--max-prompt-chars", type=positive_int, default=300,
                   help="prompts: the first --clients ShareGPT human turns at most this long (default 300)")
    b.add_argument("--no-track-memory", action="store_true",
                   help="skip the pass with the CPU device-tier tracker (on CUDA memory is always measured)")
    b.add_argument("--residencies", metavar="R[,R...]",
                   help="compare configurations in one run: load the server at each residency (fractions in (0, 1]) "
                   "with each --batches size and print one table (tok/s, TTFT, per-token latency, hit rate, bytes "
                   "per token, peak memory) with the batched / batch-1 ratios. Replaces --residency/--slots/"
                   "--memory-budget/--max-batch (default: one configuration, those options)")
    b.add_argument("--batches", metavar="B[,B...]",
                   help="with --residencies: max batch sizes to compare, including 1 (default 1,32)")
    b.add_argument("--out", help="also write the report (markdown) to this new file (default: stdout only)")
    r = bench_sub.add_parser("replicas", help="aggregate throughput of N engine replicas on Ray Serve vs one "
                             "(concurrent streaming clients; needs pip install 'ray[serve]')")
    _add_common(r)
    r.add_argument("--replicas", default="1,2", metavar="N[,N...]", help="replica counts to compare (default 1,2)")
    r.add_argument("--clients", type=positive_int, default=64, help="concurrent streaming clients (default 64)")
    r.add_argument("--max-tokens", type=positive_int, default=32, help="completion tokens per request (default 32)")
    r.add_argument("--max-prompt-chars", type=positive_int, default=300,
                   help="prompts: the first --clients ShareGPT human turns at most this long (default 300)")
    r.add_argument("--out", help="also write the report (markdown) to this new file (default: stdout only)")


def _config(args):
    from ..testbed.resolve import resolve_model
    from ..serve.server import ServeConfig
    from ..serve.tool_formats import read_chat_template, read_response_template

    chat = getattr(args, "chat_template", None)  # read first: a bad file fails before the model is built or loaded
    chat = read_chat_template(chat) if chat else None
    resp = getattr(args, "response_template", None)
    resp = read_response_template(resp) if resp else None
    path = resolve_model(args.model, progress=not args.quiet)
    return ServeConfig(model_dir=path, model_name=args.served_model_name or (args.model or "testbed"),
                       device=args.device, dtype=args.dtype, policy=args.policy, residency=args.residency,
                       slots=args.slots, memory_budget_gb=args.memory_budget, max_context=args.max_context,
                       block_length=args.block_length, steps=args.steps, threshold=args.threshold,
                       prefix_cache=not args.no_prefix_cache,
                       track_memory=getattr(args, "track_memory", False), progress=not args.quiet,
                       host_store=args.host_store, host_cache_gb=args.host_cache, pack=args.pack, max_batch=args.max_batch,
                       predictor=args.predictor,
                       cors_origins=_origins(getattr(args, "cors_origins", "*")),
                       max_queue=getattr(args, "max_queue", DEFAULT_MAX_QUEUE) or None,
                       max_request_bytes=_request_bytes(getattr(args, "max_request_mb", None)),
                       chat_template=chat, response_template=resp, graph=args.graph,
                       graph_backend=args.graph_backend)


def _request_bytes(mb: float | None) -> int:
    """``--max-request-mb`` in bytes (None: the default).

    Raises:
        MoeOffloadError: a limit that is not positive."""
    if mb is None:
        return DEFAULT_MAX_REQUEST_BYTES
    if mb <= 0:
        raise MoeOffloadError(f"--max-request-mb must be positive, got {mb:g}")
    return int(mb * 1e6)


def _origins(text: str) -> tuple[str, ...]:
    """``--cors-origins`` as a tuple: comma-separated origins, ``*`` for any, ``none`` (or empty) for none."""
    items = tuple(o.strip() for o in text.split(",") if o.strip())
    return () if items in ((), ("none",)) else items


def run(args) -> int:
    """``moe-offload serve`` (until Ctrl-C) or ``moe-offload bench serve``. Returns the exit status.

    Raises:
        MoeOffloadError: any bad option or checkpoint (printed as one line by ``moe_offload.cli.main``).
    """
    args.policy = parse_policy(args.policy)
    if getattr(args, "bench_cmd", None) in ("serve", "replicas"):
        if args.out and Path(args.out).exists():
            raise MoeOffloadError(f"{args.out} already exists; choose a new --out")
        if args.bench_cmd == "replicas":
            return _bench_replicas(args)
        from ..bench.serve_load import run_load_test, prompts_for

        prompts = prompts_for(args.clients, args.max_prompt_chars)
        if args.residencies or args.batches:
            return _compare(args, prompts)
        cfg = _config(args)
        cfg.track_memory = True  # the tracker is switched on only for its own pass
        from ..serve.server import load_for_serving

        state = load_for_serving(cfg)
        report = run_load_test(state, prompts, max_tokens=args.max_tokens, track_memory=not args.no_track_memory,
                               command=_command(args))
        _emit(report, args.out)
        return 0
    if not 0 <= args.port <= 65535:
        raise MoeOffloadError(f"--port must be in [0, 65535], got {args.port}")
    if args.replicas:
        from ..serve.replicas import run_replicas

        run_replicas(_config(args), args.replicas, args.host, args.port)
        return 0
    from ..serve.server import bind_socket, load_for_serving, serve_forever

    sock = bind_socket(args.host, args.port)  # a busy port fails before the model loads
    try:
        state = load_for_serving(_config(args))
        serve_forever(state, sock)
    finally:
        sock.close()
    return 0


def _bench_replicas(args) -> int:
    """``bench replicas`` (``bench.serve_replicas``)."""
    from ..bench.serve_replicas import run_replicas_bench
    from ..bench.serve_load import prompts_for

    counts = _list(args.replicas, int, "--replicas")
    if not counts or any(n < 1 for n in counts):
        raise MoeOffloadError(f"--replicas must be positive integers, got {args.replicas!r}")
    prompts = prompts_for(args.clients, args.max_prompt_chars)
    report = run_replicas_bench(_config(args), counts, prompts, args.max_tokens,
                                command=_command(args).replace("bench serve", "bench replicas"))
    _emit(report, args.out)
    return 0


def _emit(report: str, out: str | None) -> None:
    """Print ``report`` and write it to ``out`` (when given)."""
    print(report)
    if out:
        Path(out).write_text(report + "\n")


def _list(text: str, kind, name: str) -> list:
    """``text`` ("a,b,...") as a list of ``kind``; raises MoeOffloadError naming ``name`` on bad input."""
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise MoeOffloadError(f"{name} must be a comma-separated list of numbers, got {text!r}") from None


def _compare(args, prompts) -> int:
    """``bench serve --residencies ... [--batches ...]`` (``bench.serve_compare``)."""
    from ..bench.serve_compare import run_compare

    if args.residency is not None or args.slots is not None or args.memory_budget is not None or args.max_batch:
        raise MoeOffloadError("--residencies/--batches replace --residency, --slots, --memory-budget and --max-batch")
    res = _list(args.residencies or "1.0", float, "--residencies")
    batches = _list(args.batches or "1,32", int, "--batches")
    if not res or any(not 0 < r <= 1 for r in res):
        raise MoeOffloadError(f"--residencies must be fractions in (0, 1], got {args.residencies!r}")
    if not batches or any(b < 1 for b in batches):
        raise MoeOffloadError(f"--batches must be positive integers, got {args.batches!r}")
    report = run_compare(_config(args), res, batches, prompts, args.max_tokens,
                         track_memory=not args.no_track_memory, command=_command(args))
    _emit(report, args.out)
    return 0


def _command(args) -> str:
    """The ``bench serve`` command line that reproduces this run."""
    parts = ["moe-offload bench serve"]
    for name in ("model", "policy", "predictor", "residency", "slots", "memory_budget", "residencies", "batches", "replicas",
                 "max_context", "max_batch", "clients",
                 "max_tokens",
                 "max_prompt_chars", "device", "dtype", "block_length", "steps", "threshold"):
        v = getattr(args, name, None)
        if v is not None and not (name == "policy" and v.family == "auto"):
            parts.append(f"--{name.replace('_', '-')} {v}")
    if getattr(args, "no_track_memory", False):
        parts.append("--no-track-memory")
    if args.no_prefix_cache:
        parts.append("--no-prefix-cache")
    return " ".join(parts)
