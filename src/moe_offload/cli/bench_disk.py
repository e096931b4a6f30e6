"""``moe-offload bench disk``: the disk regime side by side with llama.cpp (``bench.disk``): options, inputs, the
table printed and the result files written."""

from __future__ import annotations

import sys
from pathlib import Path

from ..bench.disk import DiskBench, llama_paths, run_bench
from ..bench.disk_report import markdown, write_results
from ..bench.gguf_export import export_gguf
from ..core.policy_spec import parse_policies, require_predictor
from ..errors import MoeOffloadError
from ..runtime.host_memory import child_cgroup_problem
from ..testbed.resolve import resolve_model
from ..testbed.sharegpt import human_turns
from .args import int_in, positive_int


def add_parser(bsub) -> None:
    """Register ``moe-offload bench disk`` on ``bench``'s subparsers."""
    bk = bsub.add_parser("disk", help="the disk regime side by side with llama.cpp: each engine in a memory cgroup "
                         "holding its baseline plus a share of the expert bytes; one table, csv and plot")
    bk.add_argument("--model", default="testbed-sparse-wide", help="checkpoint directory or built-in name (testbed "
                    "family; default: testbed-sparse-wide)")
    bk.add_argument("--out", required=True, help="new folder for results.md / .csv / .json and tok_s.png")
    bk.add_argument("--llama-cpp", metavar="PATH", help="llama.cpp's llama-completion binary, or a llama.cpp folder "
                    "holding it (build/bin); its convert_hf_to_gguf.py exports the GGUF when --gguf is not given "
                    "(default: no llama.cpp rows)")
    bk.add_argument("--gguf", help="the checkpoint as GGUF (default: exported into --out with `export gguf`)")
    bk.add_argument("--gguf-type", default="bf16", choices=["f32", "bf16", "f16"],
                    help="tensor type of an exported GGUF (default bf16)")
    bk.add_argument("--policies", default="lru,lfu,auto,xl,seqmoe", help="our disk-store rows (default: "
                    "lru,lfu,auto,xl,seqmoe; seqmoe* rows need --predictor)")
    bk.add_argument("--predictor", help="a predictor trained on the model's routing (testbed-sparse traces serve "
                    "testbed-sparse-wide: the same routers; default: none)")
    bk.add_argument("--fractions", default="1.0,0.45,0.25,0.1", help="shares of the expert bytes in memory "
                    "(default 1.0,0.45,0.25,0.1)")
    bk.add_argument("--max-new-tokens", type=positive_int, default=128, help="per cell (default 128)")
    bk.add_argument("--sharegpt-offset", type=int_in(0, 10**6), default=600, help="the prompt: this ShareGPT human "
                    "turn (default 600: unseen by predictors trained on the first 500)")
    bk.add_argument("--threads", type=positive_int, default=2, help="threads of every engine: ours (--threads) and llama.cpp's (-t) (default 2)")
    bk.add_argument("--reverse", action="store_true", help="run rows and limits in the opposite order")
    bk.add_argument("--no-peers", action="store_true", help="only our disk-store rows (no mmap, no llama.cpp)")
    bk.add_argument("--cell-timeout", type=positive_int, default=900, help="seconds a cell may run; one that does "
                    "not finish is reported as a timeout without a speed (default 900)")
    bk.add_argument("--quiet", action="store_true", help="no progress lines")


def llama_inputs(args, model, gguf_stem: str, text: str) -> tuple[Path | None, Path | None, str]:
    """``(llama-completion, GGUF, prompt as llama.cpp is given it)`` from ``--llama-cpp``, ``--gguf`` and
    ``--gguf-type`` (``bench disk``, ``bench peers``): without ``--gguf`` the checkpoint is exported once to
    ``{gguf_stem}.{type}.gguf`` (``export gguf``); the prompt is ``text`` in the model's chat template, when it has one.

    Raises:
        MoeOffloadError: ``--llama-cpp`` holds no llama-completion; ``--gguf`` is not a file; the export failed.
    """
    from transformers import AutoTokenizer

    llama_bin, converter = llama_paths(args.llama_cpp)
    gguf = Path(args.gguf) if args.gguf else None
    if gguf is not None and not gguf.is_file():
        raise MoeOffloadError(f"--gguf {gguf}: no such file")
    if gguf is None and llama_bin is not None:
        gguf = Path(f"{gguf_stem}.{args.gguf_type}.gguf")
        if not gguf.exists():
            export_gguf(model, gguf, args.gguf_type, converter)
    tok = AutoTokenizer.from_pretrained(model)
    templated = (tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False) if getattr(tok, "chat_template", None) else text)
    return llama_bin, gguf, templated


def run(args) -> int:
    """``moe-offload bench disk``: resolve the inputs, run, write and print the table; exit 0."""
    out = Path(args.out)
    if out.exists():
        raise MoeOffloadError(f"{out} already exists; choose a new --out")
    problem = child_cgroup_problem()
    if problem is not None:
        raise MoeOffloadError(f"bench disk runs each engine in a child memory cgroup: {problem}")
    fractions = tuple(float(x) for x in args.fractions.split(","))
    if any(not 0 < f <= 1 for f in fractions):
        raise MoeOffloadError(f"--fractions values must be in (0, 1], got {args.fractions}")
    policies = tuple(parse_policies(args.policies))
    require_predictor(policies, args.predictor)
    model = resolve_model(args.model, progress=not args.quiet)
    text = human_turns(1, offset=args.sharegpt_offset)[0]
    llama_bin, gguf, templated = llama_inputs(args, model, str(out), text)
    bench = DiskBench(model, gguf, llama_bin, text, args.max_new_tokens, args.threads, policies, args.predictor,
                      fractions, args.reverse, timeout_s=args.cell_timeout, llama_prompt=templated,
                      peers=not args.no_peers)
    result = run_bench(bench, say=(lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr)))
    files = write_results(result, out)
    print(markdown(result))
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0
