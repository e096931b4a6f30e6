"""Command line of ``moe-offload serve`` and ``moe-offload bench serve`` (registered by ``moe_offload.cli``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cliargs import MODEL_HELP
from ..errors import MoeOffloadError


def _add_common(p: argparse.ArgumentParser, positive_int, float_) -> None:
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--served-model-name", help="the model name clients pass (default: --model as given)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    p.add_argument("--policy", default="auto", help="eviction policy: auto (default: the best of lru, lfu, lfru-H "
                   "simulated on the first request's own routing), lru, lfu, lfru[-H], prefill-hot; diffusion "
                   "models also reactive, tide-fixed[-T<n>], tide")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--residency", type=float_, help="device slots as a fraction of all routed experts, (0, 1] "
                      "(default: see --memory-budget)")
    size.add_argument("--slots", type=positive_int, help="number of device slots, >= top-k (default: see "
                      "--memory-budget)")
    size.add_argument("--memory-budget", type=float_, metavar="GB",
                      help="device-tier budget in GB (10^9 bytes): the slot pool gets what the non-expert weights, "
                      "the KV cache at --max-context and the measured activation peak leave (default on CUDA: 90%% "
                      "of the free device memory; on the CPU: residency 1.0)")
    p.add_argument("--host-store", choices=["pinned", "mmap"], default="pinned",
                   help="where the offloaded experts live on the host: pinned (default: a private copy, page-locked "
                   "on CUDA) or mmap (read from the safetensors files' memory maps: no private copy)")
    p.add_argument("--max-context", type=positive_int,
                   help="most tokens (prompt + completion) per request (default: min(1024, the model's positions))")
    p.add_argument("--max-batch", type=positive_int, metavar="N",
                   help="most requests decoding together (continuous batching; default: chosen by the memory plan, "
                   "at most 32, so the KV cache of N requests at --max-context takes at most half of what the "
                   "weights leave of --memory-budget; 1: one request at a time). Diffusion models run batch 1")
    p.add_argument("--block-length", type=int, help="diffusion models: positions per block (default 32)")
    p.add_argument("--steps", type=int, help="diffusion models: diffusion steps per block (default: block length)")
    p.add_argument("--threshold", type=float_, help="diffusion models: commit confidence in (0, 1] (default 0.95)")
    p.add_argument("--no-prefix-cache", action="store_true", help="diffusion models: recompute the whole prefix at "
                   "every diffusion step instead of caching the committed blocks' keys and values (same tokens)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_parsers(sub, bench_sub, positive_int, nonneg_int, float_) -> None:
    """Add ``serve`` to the top-level subparsers and ``serve`` to ``bench``'s."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server: streaming, live stats, memory budget")
    _add_common(s, positive_int, float_)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=nonneg_int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--track-memory", action="store_true",
                   help="on the CPU: measure the device-tier peak during requests (shown in /v1/stats; about 1.6x "
                   "slower decoding). On CUDA it is always measured")
    b = bench_sub.add_parser("serve", help="load test: concurrent streaming clients against a loopback server; "
                             "TTFT p50/p95, aggregate tok/s, tokens vs generate, peak device-tier memory")
    _add_common(b, positive_int, float_)
    b.add_argument("--clients", type=positive_int, default=32, help="concurrent streaming clients (default 32)")
    b.add_argument("--max-tokens", type=positive_int, default=32, help="completion tokens per request (default 32)")
    b.add_argument("--max-prompt-chars", type=positive_int, default=300,
                   help="prompts: the first --clients ShareGPT human turns at most this long (default 300)")
    b.add_argument("--no-track-memory", action="store_true",
                   help="skip the pass with the CPU device-tier tracker (on CUDA memory is always measured)")
    b.add_argument("--out", help="also write the report (markdown) to this new file (default: stdout only)")


def _config(args):
    from ..models.resolve import resolve_model
    from .server import ServeConfig

    path = resolve_model(args.model, progress=not args.quiet)
    return ServeConfig(model_dir=path, model_name=args.served_model_name or (args.model or "testbed"),
                       device=args.device, dtype=args.dtype, policy=args.policy, residency=args.residency,
                       slots=args.slots, memory_budget_gb=args.memory_budget, max_context=args.max_context,
                       block_length=args.block_length, steps=args.steps, threshold=args.threshold,
                       prefix_cache=not args.no_prefix_cache,
                       track_memory=getattr(args, "track_memory", False), progress=not args.quiet,
                       host_store=args.host_store, max_batch=args.max_batch)


def run(args) -> int:
    """``moe-offload serve`` (until Ctrl-C) or ``moe-offload bench serve``. Returns the exit status.

    Raises:
        MoeOffloadError: any bad option or checkpoint (printed as one line by ``moe_offload.cli.main``).
    """
    if getattr(args, "bench_cmd", None) == "serve":
        if args.out and Path(args.out).exists():
            raise MoeOffloadError(f"{args.out} already exists; choose a new --out")
        from .loadtest import run_load_test, prompts_for

        prompts = prompts_for(args.clients, args.max_prompt_chars)
        cfg = _config(args)
        cfg.track_memory = True  # the tracker is switched on only for its own pass
        from .server import load_for_serving

        state = load_for_serving(cfg)
        report = run_load_test(state, prompts, max_tokens=args.max_tokens, track_memory=not args.no_track_memory,
                               command=_command(args))
        print(report)
        if args.out:
            Path(args.out).write_text(report + "\n")
        return 0
    if not 0 <= args.port <= 65535:
        raise MoeOffloadError(f"--port must be in [0, 65535], got {args.port}")
    from .server import bind_socket, load_for_serving, serve_forever

    sock = bind_socket(args.host, args.port)  # a busy port fails before the model loads
    try:
        state = load_for_serving(_config(args))
        serve_forever(state, sock)
    finally:
        sock.close()
    return 0


def _command(args) -> str:
    """The ``bench serve`` command line that reproduces this run."""
    parts = ["moe-offload bench serve"]
    for name in ("model", "policy", "residency", "slots", "memory_budget", "max_context", "max_batch", "clients",
                 "max_tokens",
                 "max_prompt_chars", "device", "dtype", "block_length", "steps", "threshold"):
        v = getattr(args, name, None)
        if v is not None and not (name == "policy" and v == "auto"):
            parts.append(f"--{name.replace('_', '-')} {v}")
    if args.no_track_memory:
        parts.append("--no-track-memory")
    if args.no_prefix_cache:
        parts.append("--no-prefix-cache")
    return " ".join(parts)
