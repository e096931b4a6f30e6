"""``moe-offload bench peers``: our decode step with the model in memory side by side with transformers' generate and
llama.cpp (``bench.peers``): options, inputs and the table printed."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import MoeOffloadError
from .args import int_in, positive_int
from .bench_disk import llama_inputs


def add_parser(bsub) -> None:
    """Register ``moe-offload bench peers`` on ``bench``'s subparsers."""
    bp = bsub.add_parser("peers", help="decode tok/s with the model in memory: our FullLoad and offloaded path at "
                         "residency 1.0 against transformers' eager generate and llama.cpp, at each thread count, "
                         "in one run")
    bp.add_argument("--model", default="testbed", help="checkpoint directory or built-in name (default: testbed)")
    bp.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    bp.add_argument("--repeats", type=int_in(1, 20), default=2, help="runs per cell, in alternating order (default 2)")
    bp.add_argument("--max-new-tokens", type=positive_int, default=64, help="per cell (default 64)")
    bp.add_argument("--prompt", help="the prompt (default: a ShareGPT human turn, --sharegpt-offset)")
    bp.add_argument("--sharegpt-offset", type=int_in(0, 10**6), default=600, help="the prompt: this ShareGPT human "
                    "turn (default 600)")
    bp.add_argument("--llama-cpp", metavar="PATH", help="llama.cpp's llama-completion, or a llama.cpp folder holding "
                    "it (default: no llama.cpp row)")
    bp.add_argument("--gguf", help="the checkpoint as GGUF (default: exported next to --out, or into the current "
                    "folder, with `export gguf`)")
    bp.add_argument("--gguf-type", default="bf16", choices=["f32", "bf16", "f16"],
                    help="tensor type of an exported GGUF (default bf16)")
    bp.add_argument("--graph", action="store_true", help="add our FullLoad and offloaded rows with the decode step "
                    "compiled (generate --graph; each cell compiles, or loads its compiled step from the cache, on a "
                    "first request and times a second)")
    bp.add_argument("--no-transformers", action="store_true", help="leave out transformers' generate")
    bp.add_argument("--cell-timeout", type=positive_int, default=900, help="seconds a cell may run (default 900)")
    bp.add_argument("--out", help="also write the table (markdown) to this new file (default: stdout only)")
    bp.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args) -> int:
    """``moe-offload bench peers``: resolve the inputs, run every cell, print the table; exit 0."""
    from ..bench.peers import PeerBench, markdown, run_peers
    from ..testbed.resolve import resolve_model
    from ..testbed.sharegpt import human_turns

    if args.out and Path(args.out).exists():
        raise MoeOffloadError(f"{args.out} already exists; choose a new --out")
    try:
        threads = tuple(int(t) for t in args.threads.split(","))
    except ValueError:
        threads = ()
    if not threads or min(threads) < 1:
        raise MoeOffloadError(f"--threads must be comma-separated counts >= 1, got {args.threads!r}")
    model = Path(resolve_model(args.model, progress=not args.quiet))
    text = args.prompt if args.prompt is not None else human_turns(1, offset=args.sharegpt_offset)[0]
    llama_bin, gguf, templated = llama_inputs(args, model, args.out or model.name, text)
    bench = PeerBench(model, text, args.max_new_tokens, threads, args.repeats, llama_bin, gguf, templated,
                      transformers=not args.no_transformers, graph=args.graph, timeout_s=args.cell_timeout)
    result = run_peers(bench, say=(lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr)))
    table = markdown(bench, result)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0
