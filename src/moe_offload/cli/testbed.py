"""Command line of ``moe-offload testbed build`` and ``testbed tiny`` (registered by ``moe_offload.cli``)."""

from __future__ import annotations

import json
from pathlib import Path

from .args import seed
from ..errors import MoeOffloadError


def add_parser(sub) -> None:
    """Add ``testbed`` (``build``, ``tiny``) to the top-level subparsers."""
    t = sub.add_parser("testbed", help="the built-in testbed MoE made from SmolLM2-135M")
    tsub = t.add_subparsers(dest="testbed_cmd", required=True)
    tb = tsub.add_parser("build", help="convert SmolLM2-135M-Instruct into an MoE checkpoint and measure its held-out "
                         "perplexity (a testbed already built on first use is only evaluated)")
    tb.add_argument("--sparse", action="store_true", help="top-8 of 32 (testbed-sparse) instead of top-24")
    tb.add_argument("--out", help="directory to write (default: the user cache, $MOE_OFFLOAD_CACHE or "
                    "~/.cache/moe-offload)")
    tb.add_argument("--no-eval", action="store_true", help="skip the held-out perplexity evaluation")
    tb.add_argument("--quiet", action="store_true", help="no progress bars")
    tt = tsub.add_parser("tiny", help="write a tiny random checkpoint of an architecture")
    tt.add_argument("--arch", required=True, help="model_type: any MoE model type of the installed transformers "
                    "(moe-offload models lists them), e.g. qwen3_moe, gpt_oss, deepseek_v4, or llada2_moe")
    tt.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    tt.add_argument("--seed", type=seed, default=0, help="seed of the random weights")


def run(args) -> int:
    """``moe-offload testbed build`` / ``testbed tiny``. Returns the exit status."""
    if args.testbed_cmd == "tiny":
        from ..models.tiny import make_tiny

        out = make_tiny(args.arch, args.out, seed=args.seed)
        print(f"wrote a tiny random {args.arch} checkpoint to {out}")
        return 0
    from ..testbed.build import EVAL_TOKENS, VARIANTS, build_testbed, ensure_testbed, evaluate_testbed

    name = "testbed-sparse" if args.sparse else "testbed"
    eval_tokens = 0 if args.no_eval else EVAL_TOKENS
    if args.out:
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise MoeOffloadError(f"{out} already exists and is not empty; choose another --out")
        out = build_testbed(out, top_k=VARIANTS[name], progress=not args.quiet, eval_tokens=eval_tokens)
    else:
        out = ensure_testbed(name, progress=not args.quiet, eval_tokens=eval_tokens)
        if eval_tokens and json.loads((out / "testbed.json").read_text()).get("perplexity") is None:
            evaluate_testbed(out, progress=not args.quiet, eval_tokens=eval_tokens)
    ppl = json.loads((out / "testbed.json").read_text()).get("perplexity")
    tail = f"; held-out perplexity {ppl['moe']:.2f} (dense model {ppl['dense']:.2f})" if ppl else ""
    print(f"{name} checkpoint: {out}{tail}")
    return 0
