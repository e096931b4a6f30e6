"""``moe-offload generate``: text from a checkpoint with its experts offloaded (lossless), the stats of the run and
what they mean; ``--graph``: the compiled decode step (``graph.decode``); a diffusion model: the block-diffusion loop."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..core.forecast import XL_DEPTH
from ..core.policy_spec import parse_policy, require_predictor
from ..errors import MoeOffloadError
from ..testbed.prompts import load_prompts
from ..testbed.resolve import resolve_model
from .args import (add_diffusion_args, add_host_store_arg, add_memory_budget_arg, add_model_args, add_predictor_lag_arg,
                   finite_float, float_, nonneg_int, positive_int, seed)


def add_parser(sub) -> None:
    """Add ``generate`` to the top-level subparsers."""
    g = sub.add_parser("generate", help="generate text with experts offloaded (lossless)")
    add_model_args(g)
    size = g.add_mutually_exclusive_group()
    size.add_argument("--residency", type=float_, help="device slots as a fraction of all routed experts, (0, 1] "
                      "(default 1.0: every expert resident)")
    size.add_argument("--slots", type=positive_int, help="number of device slots, >= top-k (default: from "
                      "--residency)")
    add_memory_budget_arg(size)
    g.add_argument("--max-context", type=positive_int, help="with --memory-budget: the tokens (prompt + new) the "
                   "budget plans the KV cache and activations for (default: min(1024, the model's positions))")
    g.add_argument("--full-load", action="store_true", help="every weight on the device (the reference)")
    add_host_store_arg(g)
    g.add_argument("--temperature", type=finite_float, default=0.0, help="sampling temperature, >= 0; below 1e-5 "
                   "(0 included) = greedy (default 0)")
    g.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling: keep the smallest set of "
                   "most probable tokens whose probability reaches this, in [0, 1]; the most probable token is "
                   "always kept (0 = only it) (with --temperature >= 1e-5)")
    g.add_argument("--top-k", type=nonneg_int, default=0, metavar="K", help="keep the K most probable tokens, "
                   "applied before --top-p (0 = off, 1 = greedy; with --temperature >= 1e-5)")
    g.add_argument("--seed", type=seed, help="sampling seed, an integer in [0, 4294967295] (distinct seeds give "
                   "distinct sequences; default: unseeded)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text and a table")
    g.add_argument("--predictor", help="run this trained predictor during generation (see `predictor train`; "
                   "default: none)")
    g.add_argument("--rollout", type=nonneg_int, default=0,
                   help="with --predictor: recursive forecast steps per decode step (default 0; the seqmoe* policies "
                   "use at least 7: SeqMoE's c = 8 CacheScore rows)")
    add_predictor_lag_arg(g)
    g.add_argument("--xl-depth", type=positive_int, default=XL_DEPTH, metavar="D",
                   help="with --policy xl / seqmoe-xl: later MoE layers each layer's cross-layer forecast covers "
                   f"(default {XL_DEPTH})")
    g.add_argument("--link-gbps", type=float_, help="with --policy seqmoe*: emulate a host->device link of X GB/s "
                   "(every expert copy takes at least expert bytes / X; default: no emulation)")
    g.add_argument("--graph", action="store_true", help="graph mode: the decode step compiled whole (cache decisions "
                   "as tensor ops, torch.compile fullgraph), prefill eager; policies lru, lfu, seqmoe-cacheonly and "
                   "seqmoe (with --predictor; seqmoe prefetches through a CPU worker during decode steps, CPU only)")
    g.add_argument("--graph-backend", choices=["inductor", "aot_eager"], default="inductor",
                   help="with --graph: the torch.compile backend (default inductor; aot_eager keeps the eager "
                   "kernels, hence FullLoad eager's tokens bit for bit)")
    add_diffusion_args(g)


def _load(args, path: Path):
    from ..models.loader import load_full, load_offloaded

    if args.full_load:
        lm = load_full(path, device=args.device, dtype=args.dtype)
    elif args.memory_budget is not None:
        from ..serve.budget import load_for_generate

        diffusion = _diffusion_params(args, path)
        lm = load_for_generate(path, args.memory_budget, dict(
            device=args.device, dtype=args.dtype, policy=args.policy, progress=not args.quiet,
            link_gbps=args.link_gbps, host_store=args.host_store, host_cache_gb=args.host_cache, pack=args.pack),
            args.max_context,
            diffusion["block_length"] if diffusion else None,
            (lambda m: None) if args.quiet else (lambda m: print(f"moe-offload: {m}", file=sys.stderr)))
    else:
        lm = load_offloaded(path, device=args.device, dtype=args.dtype, residency=args.residency, slots=args.slots,
                            policy=args.policy, progress=not args.quiet, link_gbps=args.link_gbps,
                            host_store=args.host_store, host_cache_gb=args.host_cache, pack=args.pack)
    if lm.tokenizer is None:
        raise MoeOffloadError(f"{path} has no tokenizer: cannot encode prompts")
    return lm


def _attach_predictor(args, lm):
    """The predictor runner for ``--predictor`` (fed to the engine as an observer), or None."""
    if args.rollout and not args.predictor:
        raise MoeOffloadError("--rollout needs --predictor")
    if args.predictor_lag is not None and not args.predictor:
        raise MoeOffloadError("--predictor-lag needs --predictor")
    if not args.predictor and not (args.policy.cross_layer and lm.engine is not None):
        return None  # only the cross-layer policy xl is fed forecasts without a predictor
    if lm.engine is None:
        raise MoeOffloadError("--predictor needs the offloaded runtime (not --full-load)")
    from ..predictor.cross_layer import attach_forecasts
    from ..predictor.model import load_predictor

    pset = load_predictor(args.predictor, model_id=lm.model_id, device=lm.device) if args.predictor else None
    return attach_forecasts(lm, args.policy, pset, rollout=args.rollout, xl_depth=args.xl_depth,
                            lag=args.predictor_lag)


def _limit_notes(outputs, max_new_tokens: int) -> list[str]:
    """One line per output the model's position limit stopped short of ``--max-new-tokens``."""
    return [f"request {i}: stopped at the model's position limit of {o.position_limit} tokens ({o.prompt_tokens} "
            f"in the prompt + {len(o.token_ids)} new, of --max-new-tokens {max_new_tokens}); finish reason: length"
            for i, o in enumerate(outputs) if o.position_limit is not None]


def _print_outputs(args, path, outputs, info) -> bool:
    """Print ``generate``'s result: one JSON object (``--json``; returns True: nothing else to print) or the
    texts and the stats table (returns False). Lines for outputs stopped at the position limit join
    ``info["notes"]`` (printed by the caller, or in the JSON's stats)."""
    from ..generation.report import stats_table

    info["notes"] = _limit_notes(outputs, args.max_new_tokens) + info.get("notes", [])
    if args.json:
        print(json.dumps({"model": str(path), "outputs": [
            {"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids, "prompt_tokens": o.prompt_tokens,
             "ttft_s": o.ttft_s, "decode_s": o.decode_s, "finish_reason": o.finish_reason,
             "position_limit": o.position_limit} for o in outputs], "stats": info}))
        return True
    for o in outputs:
        n = len(o.token_ids)
        text = o.text if o.text.strip() else (f"(no text: the model ended with {n} token{'' if n == 1 else 's'} "
                                               f"that decode{'s' if n == 1 else ''} to nothing, finish reason "
                                               f"{o.finish_reason})")
        print(f"### prompt\n{o.prompt}\n### output\n{text}\n")
    print(stats_table(info))
    return False


def _generate_graph(args, path, prompts, diffusion) -> int:
    """``generate --graph``: graph mode (``graph.decode``); the same report as ``generate``."""
    from ..models.loader import load_full
    from ..generation.report import offload_notes, stats_dict
    from ..graph.decode import GraphDecoder, load_graph, run_graph

    if args.memory_budget is not None:
        raise MoeOffloadError("--graph sizes its pool from --residency or --slots, not --memory-budget")
    if diffusion is not None or args.link_gbps or args.host_store != "pinned":
        raise MoeOffloadError("--graph runs autoregressive models without --link-gbps and with --host-store pinned "
                              f"(not {args.host_store})" if args.host_store != "pinned" else
                              "--graph runs autoregressive models without --link-gbps")
    if args.predictor_lag is not None:
        raise MoeOffloadError("--predictor-lag runs the predictor beside the eager runtime; with --graph the "
                              "predictor runs inside the compiled step")
    if args.predictor and args.full_load:
        raise MoeOffloadError("--predictor needs the offloaded runtime (not --full-load)")
    if args.full_load:
        lm = load_full(path, device=args.device, dtype=args.dtype)
    else:
        lm = load_graph(path, policy=parse_policy("lru") if args.policy.family == "auto" else args.policy,
                        residency=args.residency,
                        slots=args.slots, device=args.device, dtype=args.dtype, progress=not args.quiet,
                        predictor=args.predictor)
    if lm.tokenizer is None:
        raise MoeOffloadError(f"{path} has no tokenizer: cannot encode prompts")
    decoder = GraphDecoder(lm, backend=args.graph_backend, progress=not args.quiet)
    outputs, stats = run_graph(lm, prompts, args.max_new_tokens, decoder=decoder, temperature=args.temperature,
                               top_p=args.top_p, top_k=args.top_k, seed=args.seed, progress=not args.quiet)
    info = stats_dict(lm, stats)
    info["graph"] = {"backend": args.graph_backend, "compile_s": round(decoder.compile_s, 3)}
    pf = getattr(lm.engine, "prefetcher", None)
    if pf is not None:  # graph mode's CPU prefetch worker (runtime.graph.prefetch)
        info["graph"]["prefetch"] = pf.counts()
    info["notes"] = offload_notes(info) + [f"graph mode: compiling the decode step took {decoder.compile_s:.1f} s "
                                           "(its first step; not in the decode rate or its token count)"]
    if pf is not None:
        p = info["graph"]["prefetch"]
        info["notes"].append(f"prefetch worker: requested {p['requested']} experts, copied {p['copied']} (not in "
                             f"bytes loaded: those are on-demand copies); {p['landed']} landed before their layer, "
                             f"{p['waited']} were waited for; no prefetching during prefills")
    if _print_outputs(args, path, outputs, info):
        return 0
    for note in info["notes"]:
        print(note)
    return 0


def run(args) -> int:
    """``moe-offload generate``: load, generate, print the texts and the stats (or ``--json``). Returns the exit
    status."""
    from ..generation.generate import run
    from ..generation.report import offload_notes, stats_dict

    args.policy = parse_policy(args.policy)
    if args.temperature < 0 or not (0 <= args.top_p <= 1):
        raise MoeOffloadError(f"--temperature must be >= 0 and --top-p in [0, 1], got {args.temperature} and "
                              f"{args.top_p}")
    if args.full_load and args.memory_budget is not None:
        raise MoeOffloadError("--memory-budget sizes the slot pool of the offloaded runtime; --full-load has none")
    if args.full_load and (args.host_store != "pinned" or args.host_cache is not None):
        raise MoeOffloadError("--host-store and --host-cache choose where offloaded experts live; --full-load keeps "
                              "every weight in memory")
    if not args.full_load:
        require_predictor(args.policy, args.predictor)
    prompts = load_prompts(args)
    path = resolve_model(args.model, progress=not args.quiet)
    diffusion = _diffusion_params(args, path)
    if args.graph:
        return _generate_graph(args, path, prompts, diffusion)
    lm = _load(args, path)
    runner = _attach_predictor(args, lm)
    if diffusion is not None:  # block diffusion (LLaDA2): blocks of mask tokens refined over diffusion steps
        from ..generation.diffusion import diffusion_summary, run_diffusion

        outputs, stats, results = run_diffusion(lm, prompts, args.max_new_tokens, temperature=args.temperature,
                                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                                progress=not args.quiet,
                                                **diffusion)
    else:
        outputs, stats = run(lm, prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, seed=args.seed, progress=not args.quiet)
    info = stats_dict(lm, stats)
    if diffusion is not None:
        info["diffusion"] = diffusion_summary(results, **diffusion)
    if runner is not None:
        info["predictor"] = _predictor_info(args, runner)
    info["notes"] = offload_notes(info)
    if _print_outputs(args, path, outputs, info):
        return 0
    if "predictor" in info:
        p = info["predictor"]
        lag = f", in its own process, forecasts used {p['lag_layers']} MoE layers late" if "lag_layers" in p else ""
        blend = f"; cross-layer blend weights {p['xl_blend_weights']}" if "xl_blend_weights" in p else ""
        print(f"predictor: {p['ms_per_decode_step']:.2f} ms per decode step ({p['decode_steps']} steps, "
              f"rollout {p['rollout']}{lag}), {p['prefill_s']:.3f} s in prefill{blend}")
    for note in info["notes"]:
        print(note)
    return 0


def _diffusion_params(args, path: Path) -> dict | None:
    """``generate`` on a diffusion model (config ``model_type`` of an Architecture flagged ``diffusion``, e.g.
    llada2_moe): the block-diffusion loop's keyword arguments (defaults block 32, steps = block length, threshold
    0.95), validated; None for an autoregressive model.

    Raises:
        MoeOffloadError: --block-length/--steps/--threshold given for an autoregressive model, --predictor for a
            diffusion model, or a bad value (``generation.diffusion.check_params``).
    """
    from ..generation.diffusion import loop_params
    from ..models.loader import read_config

    _, _, arch = read_config(path)
    params = loop_params(arch, args.block_length, args.steps, args.threshold, args.max_new_tokens, str(path),
                         prefix_cache=not args.no_prefix_cache)
    if params is not None and args.predictor:
        raise MoeOffloadError(f"--predictor is not supported for diffusion models ({arch.name}) yet")
    return params


def _predictor_info(args, runner) -> dict:
    """The stats' ``predictor`` entry: where the predictor ran and what it cost per decode step."""
    ps = runner.stats
    info = {"path": args.predictor, "rollout": runner.rollout, "prefill_s": ps.prefill_s, "decode_s": ps.decode_s,
            "decode_steps": ps.decode_steps, "ms_per_decode_step": 1e3 * ps.decode_s / max(1, ps.decode_steps)}
    if args.predictor_lag is not None:  # the predictor in its own process (predictor.lagged.LaggedFeed)
        info |= {"lag_layers": args.predictor_lag,
                 "ms_receiving_per_decode_step": 1e3 * runner.receive_s / max(1, ps.decode_steps)}
    if args.policy.cross_layer:  # seqmoe-xl: the predictor's forecasts blended with the cross-layer ones
        from ..predictor.xl_weights import describe_xl_weights

        info["xl_blend_weights"] = describe_xl_weights(runner.pset)
    return info
