"""``moe-offload trace collect``, ``trace info`` and ``trace xl-accuracy``: the options, the calls into ``trace``
(``collect.collect_trace``, ``stats``, ``xl_accuracy``) and what they print."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.forecast import XL_DEPTH
from ..core.policy_spec import parse_policy
from ..errors import MoeOffloadError
from ..testbed.prompts import load_prompts
from ..testbed.resolve import resolve_model
from .args import add_diffusion_args, add_host_store_arg, add_model_args, float_, positive_int, seed, split_floats


def add_parser(sub) -> None:
    """Add ``trace`` (``collect``, ``info``, ``xl-accuracy``) to the top-level subparsers."""
    tr = sub.add_parser("trace", help="routing traces: collect, info, xl-accuracy")
    trsub = tr.add_subparsers(dest="trace_cmd", required=True)
    tc = trsub.add_parser("collect", help="record routing while generating (through the runtime's router hook)")
    add_model_args(tc)
    tc.add_argument("--out", required=True, help="trace file to write (must not exist)")
    tc.add_argument("--router-probs", action="store_true", help="also record softmax router probabilities")
    add_host_store_arg(tc)
    tc.add_argument("--residency", type=float_, default=1.0,
                    help="device slots as a fraction of all routed experts while recording, (0, 1] (default 1.0; a "
                    "lossless run routes the same at any residency: lower it with --host-store disk for a model "
                    "larger than memory)")
    tc.add_argument("--xl-forecasts", action="store_true",
                    help="also record the cross-layer forecasts of every decode step (the next --xl-depth layers' "
                    "routers on each MoE layer's router input), for simulate --policy xl,seqmoe-xl and predictor eval")
    tc.add_argument("--xl-depth", type=positive_int, default=None, metavar="D",
                    help=f"with --xl-forecasts: later MoE layers forecast by each layer (default {XL_DEPTH})")
    tc.add_argument("--max-prompt-chars", type=positive_int, default=2000,
                    help="skip prompts longer than this (ShareGPT has very long turns)")
    add_diffusion_args(tc)
    ti = trsub.add_parser("info", help="summary statistics of a trace")
    ti.add_argument("file", help="a trace file (routing or diffusion)")
    ti.add_argument("--json", action="store_true", help="one JSON object instead of text")
    tx = trsub.add_parser("xl-accuracy", help="what-if: a copy of a trace whose cross-layer forecasts are its true "
                          "routing with experts swapped at chosen rates (marked synthetic)")
    tx.add_argument("trace", help="a routing trace (its recorded cross-layer forecasts, if any, rank the rest)")
    tx.add_argument("--swap", required=True, metavar="Q1,Q2,...",
                    help="per layer distance 1, 2, ...: the probability that each forecast expert is a wrong one "
                    "(e.g. 0.03,0.08,0.13); their count is the forecast depth")
    tx.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    tx.add_argument("--out", required=True, help="trace file to write (must not exist)")


def run(args) -> int:
    """``moe-offload trace info`` / ``trace collect``. Returns the exit status."""
    if args.trace_cmd == "info":
        return _info(args)
    if args.trace_cmd == "xl-accuracy":
        return _xl_accuracy(args)
    return _collect(args)


def _xl_accuracy(args) -> int:
    from ..trace.format import load_trace
    from ..trace.xl_accuracy import with_xl_accuracy

    out = Path(args.out)
    if out.exists():
        raise MoeOffloadError(f"{out} already exists; choose a new --out")
    swap = split_floats(args.swap, "--swap")
    src = load_trace(args.trace)
    tr = with_xl_accuracy(src, swap, args.seed)
    tr.save(out)
    if src.xl_probs is None:
        tail = "; the experts beyond the top-k are uniform (the input has no cross-layer forecasts)"
    elif src.xl_probs.shape[2] != len(swap):
        tail = (f"; the experts beyond the top-k are uniform (the input's forecasts have depth "
                f"{src.xl_probs.shape[2]}, not {len(swap)})")
    else:
        tail = "; the experts beyond the top-k keep the recorded forecasts' order"
    print(f"wrote {out}: {args.trace}'s routing with what-if cross-layer forecasts (depth {len(swap)}, experts "
          f"swapped at {', '.join(f'{q:g}' for q in swap)}){tail}; marked synthetic")
    return 0


def _info(args) -> int:
    from ..trace.format import load_trace
    from ..trace.stats import format_stats, trace_stats

    try:
        tr = load_trace(args.file)
    except MoeOffloadError as err:
        from ..trace.diffusion import load_diffusion_trace
        from ..trace.stats import diffusion_trace_info

        try:
            dt = load_diffusion_trace(args.file)
        except MoeOffloadError:
            raise err from None
        st = diffusion_trace_info(dt)
        print(json.dumps(st) if args.json else json.dumps(st, indent=1))
        return 0
    st = dict(trace_stats(tr), model_id=tr.header.get("model_id"))
    print(json.dumps(st) if args.json else format_stats(st))
    return 0


def _collect(args) -> int:
    from ..generation.diffusion import loop_params
    from ..models.loader import load_full, load_offloaded, read_config
    from ..trace.collect import collect_diffusion_trace, collect_trace
    from ..trace.stats import step_counts

    out = Path(args.out)
    if out.exists():
        raise MoeOffloadError(f"{out} already exists; choose a new --out")
    prompts = [p for p in load_prompts(args) if len(p) <= args.max_prompt_chars]
    if not prompts:
        raise MoeOffloadError(f"no prompt is at most --max-prompt-chars {args.max_prompt_chars} characters long")
    path = resolve_model(args.model, progress=not args.quiet)
    params = loop_params(read_config(path)[2], args.block_length, args.steps, args.threshold, args.max_new_tokens,
                         str(path), prefix_cache=not args.no_prefix_cache)
    if params is not None and (args.host_store != "pinned" or args.host_cache is not None or args.residency != 1.0):
        raise MoeOffloadError("a diffusion trace is recorded with every weight in memory (FullLoad): --host-store, "
                              "--host-cache and --residency do not apply")
    source = f"moe-offload trace collect on {path}"
    if params is not None:  # a diffusion trace (per block, step, layer: expert token counts)
        lm = load_full(path, device=args.device, dtype=args.dtype)
        tr, results = collect_diffusion_trace(lm, prompts, args.max_new_tokens, params, source=source,
                                              progress=not args.quiet)
        tr.save(out)
        print(f"wrote {out}: diffusion trace, {len(results)} requests, {tr.num_steps} diffusion steps "
              f"({', '.join(f'{k} {v}' for k, v in params.items())}), {tr.num_moe_layers} MoE layers x "
              f"{tr.num_experts} experts, top-{tr.top_k}")
        return 0
    if args.xl_depth and not args.xl_forecasts:
        raise MoeOffloadError("--xl-depth needs --xl-forecasts")
    lm = load_offloaded(path, device=args.device, dtype=args.dtype, policy=parse_policy(args.policy),
                        progress=not args.quiet, host_store=args.host_store, host_cache_gb=args.host_cache,
                        residency=args.residency, pack=args.pack)
    if args.xl_depth and args.xl_depth > lm.num_moe_layers - 1:
        raise MoeOffloadError(f"--xl-depth {args.xl_depth}: the model's {lm.num_moe_layers} MoE layers have at most "
                              f"{lm.num_moe_layers - 1} later layers to forecast")
    tr = collect_trace(lm, prompts, args.max_new_tokens, router_probs=args.router_probs, source=source,
                       xl_depth=(args.xl_depth or XL_DEPTH) if args.xl_forecasts else 0, progress=not args.quiet)
    tr.save(out)
    st = step_counts(tr)
    print(f"wrote {out}: {tr.num_requests} requests, {st['steps']} steps ({st['prefill_steps']} prefill steps + "
          f"{st['decode_steps']} decode steps), {tr.num_moe_layers} MoE layers x {tr.num_experts} experts, "
          f"top-{tr.top_k}")
    return 0
