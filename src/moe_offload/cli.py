"""moe-offload command line: generate, models, testbed, trace, simulate, predictor, bench, serve.

Every user error is one line on stderr and exit status 2 (no traceback); nothing is written except into the
cache directory or an ``--out`` the user named, and an existing non-empty ``--out`` is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from .errors import MoeOffloadError

BUILTIN_MODELS = ("testbed", "testbed-sparse", "llada2-medium")
DEFAULT_PROMPTS = 3


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s}")
    return v


def _nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {s}")
    return v


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message>`` (and a pointer to ``--help``), exit status 2,
    instead of the usage block (subcommand parsers inherit the class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _float(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None


def resolve_model(name: str | None, progress: bool = True) -> Path:
    """A checkpoint directory for ``--model``: a path, or a built-in name (built into the cache on first use)."""
    name = name or "testbed"
    if name == "llada2-medium" and not Path(name).exists():
        from .models.tiny import ensure_llada2_medium

        return ensure_llada2_medium(progress=progress)
    if name in BUILTIN_MODELS and not Path(name).exists():
        from .testbed.build import ensure_testbed

        return ensure_testbed(name, progress=progress)
    return Path(name)


def load_prompts(args) -> list[str]:
    """Prompts from ``--prompt``, ``--prompts FILE`` or ``--sharegpt N``; default: a few short ShareGPT turns."""
    prompts: list[str] = list(args.prompt or [])
    if args.prompts:
        try:
            lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise MoeOffloadError(f"cannot read prompts file {args.prompts}: {e.__class__.__name__}: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
        prompts += [ln for ln in lines if ln.strip()]
        if not prompts:
            raise MoeOffloadError(f"prompts file {args.prompts} holds no prompt")
    if args.sharegpt:
        from .testbed.sharegpt import human_turns

        prompts += human_turns(args.sharegpt, offset=args.sharegpt_offset)
    if not prompts:
        from .testbed.sharegpt import human_turns

        prompts = [t for t in human_turns(50) if len(t) <= 300][:DEFAULT_PROMPTS]
    return prompts


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (any MoE model type of the installed transformers that "
                   "`moe-offload models` lists as served; a multimodal checkpoint is served for text-only prompts), or "
                   "a built-in name: testbed (default), testbed-sparse")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    p.add_argument("--policy", default="auto",
                   help="eviction policy: auto (default: the best of lru, lfu, lfru-H on a simulation of the first "
                   "prompt's own routing), lru, lfu, lfru[-H] (frequency-recency, half-life H decode steps, 8), "
                   "prefill-hot; with --predictor: seqmoe-cacheonly (probabilistic Belady), seqmoe (+ JSD "
                   "prefetching), seqmoe-infinity; diffusion models: reactive, tide-fixed-T<n>, tide")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE", help="file with one prompt per line")
    p.add_argument("--sharegpt", type=_positive_int, metavar="N", help="the first N human turns of ShareGPT")
    p.add_argument("--sharegpt-offset", type=_nonneg_int, default=0, metavar="K",
                   help="with --sharegpt: skip the first K human turns (for disjoint prompt sets)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineErrorParser(prog="moe-offload", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text with experts offloaded (lossless)")
    _add_model_args(g)
    size = g.add_mutually_exclusive_group()
    size.add_argument("--residency", type=_float, help="device slots as a fraction of all routed experts, (0, 1]")
    size.add_argument("--slots", type=int, help="number of device slots (>= top-k)")
    g.add_argument("--full-load", action="store_true", help="every weight on the device (the reference)")
    g.add_argument("--host-store", choices=["pinned", "mmap"], default="pinned",
                   help="where the offloaded experts live on the host: pinned (default: a private copy, page-locked "
                   "on CUDA) or mmap (read from the safetensors files' memory maps: no private copy)")
    g.add_argument("--temperature", type=_float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=_float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text and a table")
    g.add_argument("--predictor", help="run this trained predictor during generation (see `predictor train`)")
    g.add_argument("--rollout", type=_nonneg_int, default=0,
                   help="with --predictor: recursive forecast steps per decode step (default 0; the seqmoe* policies "
                   "use at least 7: SeqMoE's c = 8 CacheScore rows)")
    g.add_argument("--link-gbps", type=_float, help="with --policy seqmoe*: emulate a host->device link of X GB/s "
                   "(every expert copy takes at least expert bytes / X)")
    g.add_argument("--block-length", type=int, help="diffusion models (LLaDA2): positions per block (default 32)")
    g.add_argument("--steps", type=int, help="diffusion models: diffusion steps per block, at most --block-length "
                   "(default: --block-length)")
    g.add_argument("--threshold", type=_float, help="diffusion models: commit every masked token whose confidence "
                   "exceeds this, in (0, 1] (default 0.95)")

    t = sub.add_parser("testbed", help="the built-in testbed MoE made from SmolLM2-135M")
    tsub = t.add_subparsers(dest="testbed_cmd", required=True)
    tb = tsub.add_parser("build", help="convert SmolLM2-135M-Instruct into an MoE checkpoint")
    tb.add_argument("--sparse", action="store_true", help="top-8 of 32 (testbed-sparse) instead of top-24")
    tb.add_argument("--out", help="directory to write (default: the user cache)")
    tb.add_argument("--quiet", action="store_true", help="no progress bars")
    tt = tsub.add_parser("tiny", help="write a tiny random checkpoint of an architecture")
    tt.add_argument("--arch", required=True, help="model_type: any MoE model type of the installed transformers "
                    "(moe-offload models lists them), e.g. qwen3_moe, gpt_oss, deepseek_v4, or llada2_moe")
    tt.add_argument("--out", required=True)
    tt.add_argument("--seed", type=int, default=0)

    tr = sub.add_parser("trace", help="routing traces: collect, info")
    trsub = tr.add_subparsers(dest="trace_cmd", required=True)
    tc = trsub.add_parser("collect", help="record routing while generating (through the runtime's router hook)")
    _add_model_args(tc)
    tc.add_argument("--out", required=True, help="trace file to write (must not exist)")
    tc.add_argument("--router-probs", action="store_true", help="also record softmax router probabilities")
    tc.add_argument("--max-prompt-chars", type=_positive_int, default=2000,
                    help="skip prompts longer than this (ShareGPT has very long turns); default 2000")
    ti = trsub.add_parser("info", help="summary statistics of a trace")
    ti.add_argument("file")
    ti.add_argument("--json", action="store_true")

    sm = sub.add_parser("simulate", help="replay traces through the decision core; hit rates and projected speed")
    sm.add_argument("--trace", required=True, action="append", help="trace file (repeatable)")
    sm.add_argument("--residency", default="0.15,0.25,0.35,0.45", help="comma-separated fractions in (0, 1]")
    sm.add_argument("--policy", default="lru,lfu,lfru,prefill-hot,belady,belady-8",
                    help="comma-separated policies (default lru,lfu,lfru,prefill-hot,belady,belady-8)")
    sm.add_argument("--hardware", default="rtx4090", help="hardware profile (see docs/traces-and-simulator.md), or this-machine")
    sm.add_argument("--model-profile", default="qwen3-30b-a3b-fp8", help="model profile for the time model")
    sm.add_argument("--full-load-tok-s", type=_float, help="FullLoad decode tok/s when the profile has none")
    sm.add_argument("--model", help="check that every trace was recorded on this checkpoint directory")
    sm.add_argument("--predictor", help="a trained predictor (for seqmoe-cacheonly, seqmoe, seqmoe-infinity, and "
                    "seqmoe-oracle: its forecasts replaced by the true future, an upper bound); when the "
                    "traces are its training "
                    "traces, every policy replays only its held-out requests")
    sm.add_argument("--link-epl", type=_float,
                    help="link speed in experts per layer compute time for the prefetching replay (default: the model "
                    "profile's measured value on --hardware, SeqMoE §2.2: 1.39 for qwen3-30b-a3b-fp8 on rtx4090)")
    sm.add_argument("--out", required=True, help="new (or empty) directory for CSV, markdown and PNG plots")

    sd = sub.add_parser("simulate-diffusion", help="replay a diffusion (LLaDA2) trace through the TIDE refresh "
                        "planners: hit rate, swaps, fallbacks, modelled tok/s, interval sweep")
    sd.add_argument("--trace", help="diffusion trace file (trace.diffusion format); default: a synthetic trace")
    sd.add_argument("--requests", type=_positive_int, default=4, help="synthetic trace: requests (default 4)")
    sd.add_argument("--blocks", type=_positive_int, default=8, help="synthetic trace: blocks per request (default 8)")
    sd.add_argument("--seed", type=_nonneg_int, default=0, help="synthetic trace: seed (default 0)")
    sd.add_argument("--policy", default="reactive,tide-fixed,tide", help="comma-separated: reactive, tide-fixed, tide")
    sd.add_argument("--intervals", default="1-16",
                    help="tide-fixed intervals T: 'A-B' or comma-separated (default 1-16)")
    sd.add_argument("--budget", default="0.25,0.5", help="experts per layer on the device, comma-separated fractions "
                    "in (0, 1] (default 0.25,0.5)")
    sd.add_argument("--hardware", default="rtx4090,h200",
                    help="comma-separated hardware profiles (default rtx4090,h200)")
    sd.add_argument("--model-profile", default="llada2.0-mini", help="model profile for the cost model")
    sd.add_argument("--tau-max", type=_positive_int, default=16, help="tide: longest interval considered (default 16)")
    sd.add_argument("--overlap-host", action="store_true", help="host fallback overlaps the layer's device compute")
    sd.add_argument("--out", required=True, help="new (or empty) directory for CSV, markdown and PNG plots")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    bd = bsub.add_parser("decode", help="decode tokens/s vs FullLoad across residencies")
    _add_model_args(bd)
    bd.add_argument("--residencies", default="1.0,0.45,0.25,0.15",
                    help="comma-separated residencies (default 1.0,0.45,0.25,0.15); --policy may list several too")
    bd.add_argument("--out", help="also write the table (markdown) to this new file")
    bd.add_argument("--predictor", help="a trained predictor, run with the seqmoe* policies (which need it)")
    bd.add_argument("--link-regime", choices=["rtx4090"],
                    help="emulate the papers' link regime on this machine: one layer's FullLoad compute overlaps the "
                    "transfer of 1.39 experts (SeqMoE §2.2, Qwen3-30B-A3B-FP8 on an RTX 4090)")
    bl = bsub.add_parser("link", help="measure host->device copy bandwidth; saves the this-machine profile")
    bl.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    bl.add_argument("--size-mb", type=_positive_int, default=256)
    bf = bsub.add_parser("diffusion", help="TIDE: diffusion tokens/s of FullLoad, reactive, tide-fixed-T<n> and tide "
                         "per budget under an emulated link and host-fallback regime")
    bf.add_argument("--model", default="llada2-medium",
                    help="a diffusion checkpoint directory; default llada2-medium (built-in, built on first use)")
    bf.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    bf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    bf.add_argument("--budgets", default="0.25,0.5", help="experts per layer on the device, comma-separated "
                    "fractions in (0, 1] (default 0.25,0.5)")
    bf.add_argument("--intervals", default="1-8", help="tide-fixed intervals T: 'A-B' or comma-separated (default 1-8)")
    bf.add_argument("--hardware", default="rtx4090", help="hardware profile whose cost ratios are emulated")
    bf.add_argument("--model-profile", default="llada2.0-mini", help="model profile of the emulated costs")
    bf.add_argument("--max-new-tokens", type=_positive_int, default=64)
    bf.add_argument("--block-length", type=_positive_int, default=32)
    bf.add_argument("--steps", type=_positive_int, help="diffusion steps per block (default: --block-length)")
    bf.add_argument("--threshold", type=_float, default=0.95)
    bf.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    bf.add_argument("--prompts", metavar="FILE", help="file with one prompt per line")
    bf.add_argument("--sharegpt", type=_positive_int, metavar="N", help="the first N human turns of ShareGPT")
    bf.add_argument("--sharegpt-offset", type=_nonneg_int, default=0, metavar="K")
    bf.add_argument("--repeats", type=_positive_int, default=1,
                    help="timed runs per row; the row reports their median (default 1)")
    bf.add_argument("--out", help="also write the table (markdown) to this new file")
    bf.add_argument("--quiet", action="store_true", help="no progress bars")
    bq = bsub.add_parser("formats", help="bf16 / FP8 / MXFP4 experts: bytes per expert and decode speed vs FullLoad "
                         "under one emulated link; host memory of --host-store pinned vs mmap on a 2.4 GB checkpoint")
    bq.add_argument("--residency", type=_float, default=0.25, help="residency of the speed rows (default 0.25)")
    bq.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens per prompt (default 32)")
    bq.add_argument("--sharegpt", type=_positive_int, default=3, metavar="N",
                    help="prompts: the first N short ShareGPT human turns (default 3)")
    bq.add_argument("--no-memory", action="store_true",
                    help="skip the host memory table (it writes a 2.4 GB checkpoint)")
    bq.add_argument("--work", help="directory for the generated checkpoints (default: a temporary one, removed)")
    bq.add_argument("--out", help="also write the tables (markdown) to this new file")
    br = bsub.add_parser("replay", help="simulator speed in expert accesses per second (synthetic 48x128x8)")
    br.add_argument("--seconds", type=_float, default=5.0)
    from .predictor.cli import add_parser as add_predictor_parser

    add_predictor_parser(sub, _positive_int, _nonneg_int, _float)
    from .serve.cli import add_parsers as add_serve_parsers

    add_serve_parsers(sub, bsub, _positive_int, _nonneg_int, _float)
    from .models.supported import add_parser as add_models_parser

    add_models_parser(sub)
    return ap


def _cmd_generate(args) -> int:
    from .generate import run
    from .models.loader import load_full, load_offloaded
    from .report import stats_dict, stats_table

    if args.temperature < 0 or not (0 < args.top_p <= 1):
        raise MoeOffloadError("--temperature must be >= 0 and --top-p in (0, 1]")
    from .models.loader import FORECAST_RUNTIME_POLICIES

    if args.policy in FORECAST_RUNTIME_POLICIES and not args.predictor and not args.full_load:
        raise MoeOffloadError(f"--policy {args.policy} needs --predictor DIR (it evicts by the predictor's forecast)")
    prompts = load_prompts(args)
    path = resolve_model(args.model, progress=not args.quiet)
    diffusion = _diffusion_params(args, path)
    if args.full_load:
        lm = load_full(path, device=args.device, dtype=args.dtype)
    else:
        lm = load_offloaded(path, device=args.device, dtype=args.dtype, residency=args.residency, slots=args.slots,
                            policy=args.policy, progress=not args.quiet, link_gbps=args.link_gbps,
                            host_store=args.host_store)
    if lm.tokenizer is None:
        raise MoeOffloadError(f"{path} has no tokenizer: cannot encode prompts")
    runner = None
    if args.rollout and not args.predictor:
        raise MoeOffloadError("--rollout needs --predictor")
    forecast_policy = lm.engine is not None and hasattr(getattr(lm.engine.table, "policy", None), "observe")
    if forecast_policy and not args.predictor:
        raise MoeOffloadError(f"--policy {args.policy} needs --predictor DIR (it evicts by the predictor's forecast)")
    if args.predictor:
        if lm.engine is None:
            raise MoeOffloadError("--predictor needs the offloaded runtime (not --full-load)")
        from .predictor.model import load_predictor
        from .predictor.runtime import ForecastFeed, PredictorRunner

        pset = load_predictor(args.predictor, model_id=lm.model_id, device=lm.device)
        if forecast_policy:  # c = 8 CacheScore rows: the one-step row + 7 recursive ones (SeqMoE §7.1)
            runner = PredictorRunner(pset, rollout=max(args.rollout, 7))
            consumers = [lm.engine.table.policy] + ([lm.engine.prefetcher] if lm.engine.prefetcher else [])
            lm.engine.observers.append(ForecastFeed(runner, *consumers))
            if lm.engine.prefetcher is not None:  # prefill offloading by offline popularity (SeqMoE §8.4)
                lm.engine.prefetcher.set_prefill_popularity(pset.header.prefill_popularity)
        else:
            runner = PredictorRunner(pset, rollout=args.rollout)
            lm.engine.observers.append(runner)
    if diffusion is not None:  # block diffusion (LLaDA2): blocks of mask tokens refined over diffusion steps
        from .models.diffusion import diffusion_summary, run_diffusion

        outputs, stats, results = run_diffusion(lm, prompts, args.max_new_tokens, temperature=args.temperature,
                                                top_p=args.top_p, seed=args.seed, progress=not args.quiet,
                                                **diffusion)
    else:
        outputs, stats = run(lm, prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed, progress=not args.quiet)
    info = stats_dict(lm, stats)
    if diffusion is not None:
        info["diffusion"] = diffusion_summary(results, **diffusion)
    if runner is not None:
        ps = runner.stats
        info["predictor"] = {"path": args.predictor, "rollout": runner.rollout, "prefill_s": ps.prefill_s,
                             "decode_s": ps.decode_s, "decode_steps": ps.decode_steps,
                             "ms_per_decode_step": 1e3 * ps.decode_s / max(1, ps.decode_steps)}
    if args.json:
        print(json.dumps({"model": str(path), "outputs": [
            {"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids, "prompt_tokens": o.prompt_tokens,
             "ttft_s": o.ttft_s, "decode_s": o.decode_s} for o in outputs], "stats": info}))
    else:
        for o in outputs:
            print(f"### prompt\n{o.prompt}\n### output\n{o.text}\n")
        print(stats_table(info))
        if "predictor" in info:
            p = info["predictor"]
            print(f"predictor: {p['ms_per_decode_step']:.2f} ms per decode step ({p['decode_steps']} steps, "
                  f"rollout {p['rollout']}), {p['prefill_s']:.3f} s in prefill")
        if "diffusion" in info:
            from .models.diffusion import format_summary

            print(format_summary(info["diffusion"]))
    return 0


def _diffusion_params(args, path: Path) -> dict | None:
    """``generate`` on a diffusion model (config ``model_type`` of an Architecture flagged ``diffusion``, e.g.
    llada2_moe): the block-diffusion loop's keyword arguments (defaults block 32, steps = block length, threshold
    0.95), validated; None for an autoregressive model.

    Raises:
        MoeOffloadError: --block-length/--steps/--threshold given for an autoregressive model, --predictor for a
            diffusion model, or a bad value (``models.diffusion.check_params``).
    """
    from .models.diffusion import loop_params
    from .models.loader import read_config

    _, _, arch = read_config(path)
    params = loop_params(arch, args.block_length, args.steps, args.threshold, args.max_new_tokens, str(path))
    if params is not None and args.predictor:
        raise MoeOffloadError(f"--predictor is not supported for diffusion models ({arch.name}) yet")
    return params


def _cmd_testbed(args) -> int:
    if args.testbed_cmd == "tiny":
        from .models.tiny import make_tiny

        out = make_tiny(args.arch, args.out, seed=args.seed)
        print(f"wrote a tiny random {args.arch} checkpoint to {out}")
        return 0
    from .testbed.build import VARIANTS, build_testbed, ensure_testbed

    name = "testbed-sparse" if args.sparse else "testbed"
    if args.out:
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise MoeOffloadError(f"{out} already exists and is not empty; choose another --out")
        out = build_testbed(out, top_k=VARIANTS[name], progress=not args.quiet)
    else:
        out = ensure_testbed(name, progress=not args.quiet)
    print(f"{name} checkpoint: {out}")
    return 0


def _cmd_trace(args) -> int:
    from .trace.format import load_trace
    from .trace.stats import format_stats, trace_stats

    if args.trace_cmd == "info":
        try:
            tr = load_trace(args.file)
        except MoeOffloadError as err:
            from .trace.diffusion import load_diffusion_trace, stability_profile

            try:
                dt = load_diffusion_trace(args.file)
            except MoeOffloadError:
                raise err from None
            st = {"kind": "diffusion", "model_id": dt.header.get("model_id"), "synthetic": dt.synthetic,
                  "num_moe_layers": dt.num_moe_layers, "num_experts": dt.num_experts, "top_k": dt.top_k,
                  "block_length": dt.block_length, "diffusion_steps": dt.num_steps, "blocks": len(dt.blocks()),
                  "tokens_committed": int(dt.committed.sum()),
                  "stability": {f"budget_{b}": stability_profile(dt, max(1, round(b * dt.num_experts)), 8)
                                for b in (0.25, 0.5)}}
            print(json.dumps(st) if args.json else json.dumps(st, indent=1))
            return 0
        st = dict(trace_stats(tr), model_id=tr.header.get("model_id"))
        print(json.dumps(st) if args.json else format_stats(st))
        return 0
    from .generate import run
    from .models.loader import load_offloaded
    from .trace.collect import TraceRecorder

    out = Path(args.out)
    if out.exists():
        raise MoeOffloadError(f"{out} already exists; choose a new --out")
    prompts = [p for p in load_prompts(args) if len(p) <= args.max_prompt_chars]
    if not prompts:
        raise MoeOffloadError(f"no prompt is at most --max-prompt-chars {args.max_prompt_chars} characters long")
    path = resolve_model(args.model, progress=not args.quiet)
    from .models.loader import read_config

    if read_config(path)[2].diffusion:  # a diffusion trace (per block, step, layer: expert token counts)
        from .models.diffusion import run_diffusion
        from .models.loader import load_full
        from .trace.diffusion import DiffusionTraceRecorder

        from .models.diffusion import loop_params

        params = loop_params(read_config(path)[2], None, None, None, args.max_new_tokens, str(path))
        lm = load_full(path, device=args.device, dtype=args.dtype)
        with DiffusionTraceRecorder(lm, params["block_length"], source=f"moe-offload trace collect on {path}") as rec:
            _, _, results = run_diffusion(lm, prompts, args.max_new_tokens, progress=not args.quiet, recorder=rec,
                                          **params)
            tr = rec.trace(results)
        tr.save(out)
        print(f"wrote {out}: diffusion trace, {len(results)} requests, {tr.num_steps} diffusion steps "
              f"({', '.join(f'{k} {v}' for k, v in params.items())}), {tr.num_moe_layers} MoE layers x "
              f"{tr.num_experts} experts, top-{tr.top_k}")
        return 0
    lm = load_offloaded(path, device=args.device, dtype=args.dtype, policy=args.policy, progress=not args.quiet)
    with TraceRecorder(lm, router_probs=args.router_probs, source=f"moe-offload trace collect on {path}") as rec:
        run(lm, prompts, args.max_new_tokens, progress=not args.quiet, recorder=rec)
        tr = rec.trace()
    tr.save(out)
    print(f"wrote {out}: {tr.num_requests} requests, {len(tr.steps())} steps, "
          f"{tr.num_moe_layers} MoE layers x {tr.num_experts} experts, top-{tr.top_k}")
    return 0


def _split_floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MoeOffloadError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not vals:
        raise MoeOffloadError(f"{what} is empty")
    return vals


def _cmd_simulate(args) -> int:
    from .sim.profiles import load_hardware, load_model_profile
    from .sim.report import write_report
    from .sim.prefetch_sim import PREFETCH_POLICIES, replay_with_prefetch
    from .sim.simulator import FORECAST_POLICIES, build_policy, layer_needs, replay
    from .sim.timemodel import OnDemandTimeModel
    from .trace.format import load_trace

    residencies = _split_floats(args.residency, "--residency")
    if any(not (0 < r <= 1) for r in residencies):
        raise MoeOffloadError(f"--residency values must be in (0, 1], got {args.residency}")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty directory; choose a new --out")
    hw, mp = load_hardware(args.hardware), load_model_profile(args.model_profile)
    tm = OnDemandTimeModel(hw, mp, full_load_tok_s=args.full_load_tok_s)
    model_id = None
    if args.model:
        from .trace.format import model_fingerprint

        model_id = model_fingerprint(json.loads((resolve_model(args.model) / "config.json").read_text()))
    traces = [(t, load_trace(t)) for t in args.trace]
    forecasts, popularity, oracle = {}, None, {}
    wants = [p for p in policies if p.lower() in FORECAST_POLICIES or p.lower() in PREFETCH_POLICIES]
    if args.predictor:
        traces, forecasts, popularity = _predictor_replay_set(args.predictor, traces, bool(wants))
    elif wants:
        raise MoeOffloadError(f"--policy {','.join(wants)} needs --predictor DIR")
    epl = args.link_epl or mp.paper_overlap_experts_per_layer.get(hw.name) or tm.experts_per_layer_compute
    if not epl > 0:
        raise MoeOffloadError(f"--link-epl must be > 0, got {epl}")
    for _, tr in traces:
        if model_id:
            tr.check_model(model_id)
        for p in policies:  # validate every name before the long loop
            if p.lower() not in PREFETCH_POLICIES:
                build_policy(p, tr, 1, needs=[])
    rows = []
    from tqdm.auto import tqdm

    bar = tqdm(total=len(traces) * len(policies) * len(residencies), desc="replays", leave=False)
    for name, tr in traces:
        needs = layer_needs(tr)
        n_total = tr.num_moe_layers * tr.num_experts
        for p in policies:
            for r in residencies:
                slots = max(1, math.ceil(r * n_total - 1e-9))
                if p.lower() in PREFETCH_POLICIES:
                    evict, sched = PREFETCH_POLICIES[p.lower()]
                    fc = forecasts.get(name)
                    if p.lower().endswith("-oracle") and fc is not None:
                        from .sim.forecasts import oracle_stream

                        fc = oracle.setdefault(name, oracle_stream(fc, tr))
                    pr = replay_with_prefetch(tr, slots, evict, epl, forecasts=fc, scheduler=sched,
                                              needs=needs, prefill_popularity=popularity)
                    rows.append({"trace": Path(name).name, "synthetic": bool(tr.header.get("synthetic")),
                                 "model": mp.name, "hardware": hw.name, "policy": p.lower(), "residency": r,
                                 "slots": slots, "hit_rate": pr.hit_rate, "decode_hit_rate": pr.decode_hit_rate,
                                 "hits": pr.hits, "misses": pr.misses, "decode_misses": pr.decode_misses,
                                 "accesses": pr.accesses, "link_epl": epl,
                                 "decode_fraction_link_model": pr.decode_fraction_of_full_load,
                                 "prefetches": pr.prefetches, "prefetch_accuracy": pr.prefetch_accuracy,
                                 "late": pr.decode_late})
                    bar.update(1)
                    continue
                res = replay(tr, slots, p, needs=needs,
                             forecasts=forecasts.get(name) if p.lower() in FORECAST_POLICIES else None)
                t = tm.decode_time(res.per_step, tr)
                rows.append({"trace": Path(name).name, "synthetic": bool(tr.header.get("synthetic")),
                             "model": mp.name, "hardware": hw.name, "policy": res.policy, "residency": r,
                             "slots": slots, "hit_rate": res.hit_rate, "decode_hit_rate": res.decode_hit_rate,
                             "hits": res.hits, "misses": res.misses, "decode_misses": res.decode_misses,
                             "accesses": res.accesses, "projection": t["projection"],
                             "projected_tok_s": t["projected_tok_s"], "full_load_tok_s": t["full_load_tok_s"],
                             "fraction_of_full_load": t["fraction_of_full_load"], "link_epl": epl,
                             "decode_fraction_link_model": _link_fraction(res, tr, epl),
                             "stall_s_per_step": t["stall_s_per_step"]})
                bar.update(1)
    bar.close()
    files = write_report(rows, out, f"Expert hit rate and projected decode speed ({mp.name} on {hw.name})")
    print((out / "results.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _parse_intervals(text: str) -> list[int]:
    try:
        if "-" in text:
            a, b = (int(x) for x in text.split("-", 1))
            vals = list(range(a, b + 1))
        else:
            vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MoeOffloadError(f"--intervals must be 'A-B' or comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise MoeOffloadError(f"--intervals must be integers >= 1, got {text!r}")
    return vals


def _cmd_simulate_diffusion(args) -> int:
    from .core.costs import TideCosts
    from .sim.diffusion_sim import budget_experts, run_diffusion_sweep, write_diffusion_report
    from .sim.profiles import load_model_profile
    from .trace.diffusion import load_diffusion_trace, stability_profile, synthetic_diffusion_trace

    budgets = _split_floats(args.budget, "--budget")
    if any(not (0 < b <= 1) for b in budgets):
        raise MoeOffloadError(f"--budget values must be in (0, 1], got {args.budget}")
    policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in ("reactive", "tide-fixed", "tide")]
    if bad or not policies:
        raise MoeOffloadError(f"unknown --policy {','.join(bad) or args.policy!r}; "
                              "choose among reactive, tide-fixed, tide")
    intervals = _parse_intervals(args.intervals)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty directory; choose a new --out")
    mp = load_model_profile(args.model_profile)
    hws = [h.strip() for h in args.hardware.split(",") if h.strip()]
    if not hws:
        raise MoeOffloadError("--hardware is empty")
    if args.trace:
        tr, name = load_diffusion_trace(args.trace), Path(args.trace).name
    else:
        tr = synthetic_diffusion_trace(mp.num_moe_layers, mp.num_experts, mp.top_k, requests=args.requests,
                                       blocks=args.blocks, block_length=int(mp.extra.get("block_length", 32)),
                                       seed=args.seed)
        name = "synthetic"
    geo = (tr.num_moe_layers, tr.num_experts, tr.top_k)
    if geo != (mp.num_moe_layers, mp.num_experts, mp.top_k):
        raise MoeOffloadError(f"trace geometry {geo[0]}x{geo[1]} top-{geo[2]} differs from model profile {mp.name} "
                              f"({mp.num_moe_layers}x{mp.num_experts} top-{mp.top_k}); pass a matching --model-profile")
    costs = {h: TideCosts.from_profiles(h, mp, overlap_host=args.overlap_host) for h in hws}
    from tqdm.auto import tqdm

    n = len(hws) * len(budgets) * sum(len(intervals) if p == "tide-fixed" else 1 for p in policies)
    bar = tqdm(total=n, desc="replays", leave=False)
    rows, sweep = run_diffusion_sweep(tr, costs, budgets, policies, intervals, tau_max=args.tau_max,
                                      trace_name=name, model=mp.name, progress=lambda: bar.update(1))
    bar.close()
    stab = ["## Trace stability (trace.diffusion.stability_profile)", "",
            "coverage(d): share of token-experts at step r+d whose expert is among the budget experts with the most "
            "tokens at step r (same block).", "", "| budget | d=0 | d=1 | d=2 | d=4 | d=8 | Jaccard(next) | "
            "active/layer/step | steps/block |", "|---|---|---|---|---|---|---|---|---|"]
    for b in budgets:
        sp = stability_profile(tr, budget_experts(b, tr.num_experts), 8)
        cv = sp["coverage"]
        f = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        stab.append(f"| {100 * b:g}% | {f(cv[0])} | {f(cv[1])} | {f(cv[2])} | {f(cv[4])} | {f(cv[8])} | "
                    f"{sp['jaccard_next']:.3f} | {sp['active_per_layer_step']:.1f} | {sp['steps_per_block']:.1f} |")
    cost_md = ["## Cost model (core.costs.TideCosts.from_profiles; modelled, see the profiles' unsourced fields)", "",
               "| hardware | swap us | device us/expert | device us/token-expert | fallback us/expert | "
               "fallback us/token-expert | non-expert ms/step |", "|---|---|---|---|---|---|---|"]
    for h, c in costs.items():
        cost_md.append(f"| {h} | {1e6 * c.swap_s:.1f} | {1e6 * c.device_expert_s:.2f} | {1e6 * c.device_token_s:.3f} "
                       f"| {1e6 * c.fallback_expert_s:.1f} | {1e6 * c.fallback_token_s:.2f} | "
                       f"{1e3 * c.nonexpert_step_s:.2f} |")
    cmd = "moe-offload simulate-diffusion " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("trace", args.trace), ("budget", args.budget),
                                                    ("policy", args.policy), ("intervals", args.intervals),
                                                    ("hardware", args.hardware), ("model_profile", args.model_profile),
                                                    ("tau_max", args.tau_max)) if v is not None)
    extra = "\n".join(["", f"Command: `{cmd}{' --overlap-host' if args.overlap_host else ''}`", "",
                       f"Trace: {name} ({tr.header.get('source', '')}), {tr.num_steps} steps in {len(tr.blocks())} "
                       "blocks.", ""] + stab + [""] + cost_md)
    files = write_diffusion_report(rows, sweep, out, f"TIDE refresh planners ({mp.name})", extra_md=extra)
    if not args.trace:
        files.append(tr.save(out / "trace.safetensors"))
    print((out / "results.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _link_fraction(res, tr, epl: float) -> float:
    """Decode speed as a fraction of FullLoad under ``sim.prefetch_sim``'s link model for a replay without
    prefetching: every decode miss stalls its layer by ``1 / epl`` layer times (the link is idle at layer start)."""
    layers = int((res.per_step.step > 0).sum()) * tr.num_moe_layers
    return layers / (layers + res.decode_misses / epl) if layers else 1.0


def _predictor_replay_set(predictor: str, traces: list, need_forecasts: bool):
    """For ``simulate --predictor``: the traces to replay (the predictor's held-out requests merged into one trace
    when these are its training traces, else all of them), if needed the forecasts for each, and the predictor's
    prefill popularity profile (SeqMoE §8.4; None for a predictor saved without one)."""
    from .predictor.features import trace_sequences, training_split
    from .predictor.model import load_predictor
    from .sim.forecasts import forecast_stream
    from .trace.format import merge_requests

    pset = load_predictor(predictor, model_id=traces[0][1].header.get("model_id"))
    keys = [s.key for i, (_, tr) in enumerate(traces) for s in trace_sequences(tr, i)]
    split = training_split(pset.header.training, [tr for _, tr in traces], keys)
    if split is not None:
        _, test = split
        chosen = [keys[j] for j in test]
        merged = merge_requests([(tr, [r for t_i, r in chosen if t_i == i]) for i, (_, tr) in enumerate(traces)],
                                source="held-out requests of " + ", ".join(Path(n).name for n, _ in traces))
        name = f"heldout-{len(chosen)}-of-{len(keys)}"
        print(f"replaying the predictor's {len(chosen)} held-out requests of {len(keys)} (all policies)")
        traces = [(name, merged)]
    fc = {name: forecast_stream(pset, tr, progress=True) for name, tr in traces} if need_forecasts else {}
    return traces, fc, pset.header.prefill_popularity


# --link-regime: experts whose transfer one layer's FullLoad compute overlaps (SeqMoE §2.2)
LINK_REGIMES = {"rtx4090": 1.39}


def _cmd_bench(args) -> int:
    if args.bench_cmd == "link":
        from .sim.profiles import measure_link

        res = measure_link(device=args.device, size_mb=args.size_mb)
        print(json.dumps(res, indent=1))
        return 0
    if args.bench_cmd == "replay":
        from .sim.speed import bench_replay_speed

        print(json.dumps(bench_replay_speed(seconds=args.seconds), indent=1))
        return 0
    if args.out and Path(args.out).exists():
        raise MoeOffloadError(f"{args.out} already exists; choose a new --out")
    if args.bench_cmd == "formats":
        return _bench_formats(args)
    if args.bench_cmd == "diffusion":
        from .bench import bench_diffusion

        budgets = _split_floats(args.budgets, "--budgets")
        intervals = _parse_intervals(args.intervals)
        prompts = load_prompts(args)
        path = resolve_model(args.model, progress=not args.quiet)
        table = bench_diffusion(path, prompts, budgets, intervals, max_new_tokens=args.max_new_tokens,
                                block_length=args.block_length, steps=args.steps, threshold=args.threshold,
                                hardware=args.hardware, model_profile=args.model_profile, device=args.device,
                                dtype=args.dtype, progress=not args.quiet, repeats=args.repeats)
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
        return 0
    from .bench import bench_decode

    try:
        residencies = [float(x) for x in args.residencies.split(",")]
    except ValueError:
        raise MoeOffloadError(f"--residencies must be comma-separated numbers, got {args.residencies!r}") from None
    if any(not (0 < r <= 1) for r in residencies):
        raise MoeOffloadError(f"--residencies values must be in (0, 1], got {args.residencies}")
    prompts = load_prompts(args)
    path = resolve_model(args.model, progress=not args.quiet)
    table = bench_decode(path, prompts, residencies, max_new_tokens=args.max_new_tokens, device=args.device,
                         dtype=args.dtype, policy=args.policy, progress=not args.quiet, predictor=args.predictor,
                         link_epl=LINK_REGIMES.get(args.link_regime))
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


def _bench_formats(args) -> int:
    import tempfile

    from .bench_formats import bench_formats
    from .testbed.sharegpt import human_turns

    if not (0 < args.residency <= 1):
        raise MoeOffloadError(f"--residency must be in (0, 1], got {args.residency}")
    prompts = [t for t in human_turns(50) if len(t) <= 300][:args.sharegpt]
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        table = bench_formats(Path(work), prompts, residency=args.residency, max_new_tokens=args.max_new_tokens,
                              memory=not args.no_memory)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moe-offload`` console script. Returns the exit status."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        if args.cmd == "generate":
            return _cmd_generate(args)
        if args.cmd == "testbed":
            return _cmd_testbed(args)
        if args.cmd == "models":
            from .models.supported import run as run_models

            return run_models(args)
        if args.cmd == "trace":
            return _cmd_trace(args)
        if args.cmd == "simulate":
            return _cmd_simulate(args)
        if args.cmd == "simulate-diffusion":
            return _cmd_simulate_diffusion(args)
        if args.cmd == "predictor":
            from .predictor.cli import run as run_predictor

            return run_predictor(args)
        if args.cmd == "serve" or getattr(args, "bench_cmd", None) == "serve":
            from .serve.cli import run as run_serve

            return run_serve(args)
        return _cmd_bench(args)
    except MoeOffloadError as e:
        print(f"moe-offload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moe-offload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
