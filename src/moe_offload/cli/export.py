"""``moe-offload export gguf``: a testbed-family checkpoint as GGUF for llama.cpp (``bench.gguf_export``), and
``--check`` of its greedy text against ours."""

from __future__ import annotations

from pathlib import Path

from ..bench.gguf_export import OUTTYPES, check_tokens, export_gguf
from ..errors import MoeOffloadError
from ..testbed.resolve import resolve_model
from ..testbed.sharegpt import human_turns


def add_parser(sub) -> None:
    """Register ``moe-offload export gguf``."""
    p = sub.add_parser("export", help="write a checkpoint in another engine's format (for side-by-side runs)")
    esub = p.add_subparsers(dest="export_cmd", required=True)
    g = esub.add_parser("gguf", help="a testbed-family (Mixtral layout) checkpoint as GGUF for llama.cpp, through "
                        "llama.cpp's own convert_hf_to_gguf.py")
    g.add_argument("--model", default="testbed", help="checkpoint directory or built-in name (default: testbed)")
    g.add_argument("--out", required=True, help="the GGUF file to write (must not exist)")
    g.add_argument("--outtype", default="f32", choices=OUTTYPES, help="tensor type in the file (default: f32)")
    g.add_argument("--converter", help="llama.cpp's convert_hf_to_gguf.py or its folder (default: $LLAMA_CPP_DIR, "
                   "then PATH)")
    g.add_argument("--check", metavar="LLAMA_COMPLETION", help="then check the file with llama.cpp's llama-completion: "
                   "its greedy text against our FullLoad's (one thread) on --check-prompts ShareGPT prompts (default: no "
                   "check)")
    g.add_argument("--check-prompts", type=int, default=10, help="with --check: prompts (default 10)")
    g.add_argument("--check-tokens", type=int, default=16, help="with --check: tokens per prompt (default 16)")
    g.add_argument("--check-controls", type=int, default=4, help="with --check: runs of our own FullLoad with its router "
                   "probabilities moved by at most one ulp, the control that says whether a disagreement is a router "
                   "near tie (default 4)")


def run(args) -> int:
    """``moe-offload export gguf``: convert, print the file written; exit 0."""
    if args.check and not Path(args.check).is_file():
        raise MoeOffloadError(f"--check {args.check}: no such file")
    if args.check_controls < 0:
        raise MoeOffloadError(f"--check-controls must be 0 or more, got {args.check_controls}")
    model = resolve_model(args.model)
    out = export_gguf(model, args.out, args.outtype, args.converter)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB, {args.outtype})")
    if args.check:
        prompts = [t for t in human_turns(4 * args.check_prompts) if len(t) <= 300][:args.check_prompts]
        rows = check_tokens(model, out, Path(args.check), prompts, args.check_tokens, controls=args.check_controls)
        print("| prompt | tokens agreeing | ours with router probabilities moved <= 1 ulp | explained | ours | "
              "llama.cpp |\n|---|---|---|---|---|---|")
        for r in rows:
            cut = (lambda t: t.replace("\n", " ").replace("|", "/")[:60])
            print(f"| {cut(r['prompt'])} | {r['agree']} / {r['n']} | {', '.join(map(str, r['control']))} | "
                  f"{'yes' if r['explained'] else 'no'} | {cut(r['ours'])} | {cut(r['llama'])} |")
        full = sum(r["agree"] == r["n"] for r in rows)
        print(f"{full} of {len(rows)} prompts agree on all their first tokens; "
              f"{sum(r['explained'] for r in rows)} of {len(rows)} agree or part where our own run parts when its "
              "router probabilities move by one ulp")
        t = {k: sum(r["router_ties"][k] for r in rows) for k in ("decisions", "near", "exact")}
        print(f"our router decisions: {t['decisions']}; the k-th and (k+1)-th probabilities within 2 ulp: {t['near']} "
              f"(equal: {t['exact']})")
    return 0


