"""``moe-offload bench decode | link | diffusion | formats | graph | replay | disk-figure | gpu-check``: the options,
the calls into ``bench`` and the tables printed (``bench disk``: ``cli/bench_disk.py``; ``bench peers``:
``cli/bench_peers.py``; ``bench serve`` and
``bench replicas``: ``cli/serve.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..core.policy_spec import parse_policies, require_predictor
from ..errors import MoeOffloadError
from ..runtime.emulated_clock import WAIT_MODES
from ..testbed.prompts import load_prompts
from ..testbed.resolve import resolve_model
from .args import (add_model_args, add_predictor_lag_arg, add_prompt_args, add_rollout_every_arg, float_, int_in,
                   parse_intervals, positive_int, split_floats)

# --link-regime: experts whose transfer one layer's FullLoad compute overlaps (SeqMoE §2.2)
LINK_REGIMES = {"rtx4090": 1.39}


def add_parsers(sub):
    """Add ``bench`` and its benchmarks to the top-level subparsers; returns ``bench``'s subparsers (``serve``
    adds ``bench serve`` to them)."""
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    bd = bsub.add_parser("decode", help="decode tokens/s vs FullLoad across residencies")
    add_model_args(bd)
    bd.add_argument("--residencies", default="1.0,0.45,0.25,0.15",
                    help="comma-separated residencies; --policy may list several too")
    bd.add_argument("--out", help="also write the table (markdown) to this new file (default: stdout only)")
    bd.add_argument("--predictor", help="a trained predictor, run with the seqmoe* policies (which need it; default: "
                    "none)")
    add_rollout_every_arg(bd)
    add_predictor_lag_arg(bd)
    bd.add_argument("--host-store", choices=["pinned", "disk"], default="pinned",
                    help="where the offloaded rows' experts live: pinned (host RAM; default) or disk (direct reads "
                    "of the checkpoint: the disk is the link, which the scheduler models from the disk entry of the "
                    "this-machine profile, `bench link --disk DIR`, and the simulated column at the speed the baseline "
                    "policy's (lru's) misses were read in the run)")
    bd.add_argument("--link-regime", choices=["rtx4090"],
                    help="emulate the papers' link regime on this machine: one layer's FullLoad compute overlaps the "
                    "transfer of 1.39 experts (SeqMoE §2.2, Qwen3-30B-A3B-FP8 on an RTX 4090; default: no emulation)")
    add_waits_arg(bd)
    bd.add_argument("--rounds", type=int_in(1, 100), default=1,
                    help="measure every row this many times, in interleaved rounds (the rows in the given order, then "
                    "reversed; FullLoad first in each), and show the medians, each row's range of tok/s and its "
                    "median per-round ratio to lru's (when listed, else the first policy's; default 1)")
    bl = bsub.add_parser("link", help="measure host->device copy bandwidth; saves the this-machine profile")
    bl.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    bl.add_argument("--size-mb", type=int_in(1, 16384), default=256, help="MiB per timed copy, in [1, 16384]")
    bl.add_argument("--disk", metavar="DIR", help="measure the disk instead: direct-read GB/s by request size (4 KiB "
                    "- 4 MiB) and queue depth (1-8 threads) on the filesystem of DIR (a scratch file is written there "
                    "and removed); saved as the disk entry of the this-machine profile, which sets --host-store disk's "
                    "reader threads and the disk link of bench decode --host-store disk (default: measure the host->device link)")
    bl.add_argument("--file-mb", type=int_in(64, 65536), default=512, help="with --disk: scratch file MiB "
                    "(default 512)")
    from .bench_disk import add_parser as add_disk_parser

    add_disk_parser(bsub)
    from .bench_peers import add_parser as add_peers_parser

    add_peers_parser(bsub)
    bf = bsub.add_parser("diffusion", help="TIDE: diffusion tokens/s of FullLoad, reactive, tide-fixed-T<n> and tide "
                         "per budget under an emulated link and host-fallback regime, with and without the prefix "
                         "cache")
    bf.add_argument("--model", default="llada2-medium",
                    help="a diffusion checkpoint directory; default llada2-medium (built-in, built on first use)")
    bf.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    bf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    bf.add_argument("--budgets", default="0.25,0.5", help="experts per layer on the device, comma-separated "
                    "fractions in (0, 1] (default 0.25,0.5)")
    bf.add_argument("--intervals", default="1-8", help="tide-fixed intervals T: 'A-B' or comma-separated (default 1-8)")
    bf.add_argument("--hardware", default="rtx4090", help="hardware profile whose cost ratios are emulated")
    bf.add_argument("--model-profile", default="llada2.0-mini", help="model profile of the emulated costs")
    bf.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate per prompt at most")
    bf.add_argument("--block-length", type=positive_int, default=32, help="positions per diffusion block")
    bf.add_argument("--steps", type=positive_int, help="diffusion steps per block (default: --block-length)")
    bf.add_argument("--threshold", type=float_, default=0.95, help="commit confidence in (0, 1]")
    add_prompt_args(bf)
    bf.add_argument("--repeats", type=positive_int, default=1,
                    help="timed runs per row; the row reports their median and spread (default 1)")
    bf.add_argument("--loops", default="prefix-cache,recompute",
                    help="diffusion loops to measure, comma-separated: prefix-cache (the block-prefix KV cache), "
                    "recompute (the reference loop; --no-prefix-cache elsewhere); default both")
    bf.add_argument("--out", help="also write the table (markdown) to this new file (default: stdout only)")
    bf.add_argument("--quiet", action="store_true", help="no progress bars")
    add_waits_arg(bf)
    bq = bsub.add_parser("formats", help="bf16 / FP8 / MXFP4 experts: bytes per expert and decode speed vs FullLoad "
                         "under one emulated link; host memory of --host-store pinned vs mmap on a 2.4 GB checkpoint")
    bq.add_argument("--residency", type=float_, default=0.25, help="residency of the speed rows (default 0.25)")
    bq.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens per prompt (default 32)")
    bq.add_argument("--sharegpt", type=positive_int, default=3, metavar="N",
                    help="prompts: the first N short ShareGPT human turns (default 3)")
    bq.add_argument("--no-memory", action="store_true",
                    help="skip the host memory table (it writes a 2.4 GB checkpoint)")
    bq.add_argument("--work", help="directory for the generated checkpoints (default: a temporary one, removed)")
    bq.add_argument("--out", help="also write the tables (markdown) to this new file (default: none)")
    bg = bsub.add_parser("graph", help="graph mode: the compiled decode step vs compiled FullLoad, with the "
                         "management share of the step, replayed and (with residency 1.0) measured A/B against the "
                         "same step without decisions (issue 20)")
    add_model_args(bg)
    bg.set_defaults(policy="lru", max_new_tokens=32)
    bg.add_argument("--residencies", default="1.0,0.45", help="comma-separated residencies (default 1.0,0.45)")
    bg.add_argument("--rounds", type=int_in(1, 100), default=3, help="interleaved timed rounds (default 3)")
    bg.add_argument("--predictor", help="a trained predictor, run inside the step with --policy seqmoe-cacheonly "
                    "or seqmoe (which need it; seqmoe also prefetches through a CPU worker; default: none)")
    bg.add_argument("--graph-backend", choices=["inductor", "aot_eager"], default="inductor",
                    help="torch.compile backend (default inductor; aot_eager keeps eager kernels: FullLoad eager's "
                    "tokens bit for bit)")
    bg.add_argument("--out", help="also write the table (markdown) to this new file (default: stdout only)")
    br = bsub.add_parser("replay", help="simulator speed in expert accesses per second (synthetic 48x128x8)")
    br.add_argument("--seconds", type=float_, default=5.0, help="how long to replay")
    bfig = bsub.add_parser("disk-figure", help="one picture of several bench disk runs: decode tok/s against the share "
                           "of the expert bytes in memory, one panel per model, ours and llama.cpp's")
    bfig.add_argument("dirs", nargs="+", metavar="DIR", help="`bench disk --out` folders, each DIR or NAME=DIR (NAME: "
                      "the model, the panel's title; default: results.json's model, else the folder's name)")
    bfig.add_argument("--out", required=True, metavar="PNG", help="the picture to write")
    bfig.add_argument("--force", action="store_true", help="overwrite --out if it exists (default: refuse)")
    bc = bsub.add_parser("gpu-check", help="the GPU check (scripts/gpu-check.sh): lossless rows for every policy and "
                         "checkpoint format on CUDA, bench decode, bench link, graph mode; one markdown report")
    bc.add_argument("--dry-run", action="store_true", help="run on the CPU, smaller (tests the check itself)")
    bc.add_argument("--out", default="gpu-check.md", help="markdown report to write (default gpu-check.md)")
    return bsub


def add_waits_arg(p) -> None:
    """``--emulated-waits sleep|skip`` (``runtime.emulated_clock``)."""
    p.add_argument("--emulated-waits", choices=WAIT_MODES, default="sleep",
                   help="how the inference thread waits out the emulated link and host fallback: sleep (default; "
                   "wall clock) or skip (the clock jumps over each wait, no time passes: on a shared VM sleeping "
                   "lets other tenants evict the model from the cache, which slows the compute after each wait; "
                   "CPU only)")


def _link(args) -> int:
    from ..core.profiles import this_machine_path
    from ..bench.link import measure_link

    if args.disk:
        from ..core.disk_link import save_disk
        from ..bench.disk_link import disk_table, measure_disk

        entry = measure_disk(args.disk, file_mb=args.file_mb)
        print(f"direct reads on the filesystem of {entry['directory']}, GB/s (1e9 B/s), "
              f"{entry['seconds_per_cell']} s per cell, {entry['file_mb']} MiB scratch file:\n")
        print(disk_table(entry))
        print(f"moe-offload: wrote the disk entry of the this-machine hardware profile to {save_disk(entry)}",
              file=sys.stderr)
        return 0

    res = measure_link(device=args.device, size_mb=args.size_mb)
    print(json.dumps(res, indent=1))
    print(f"moe-offload: wrote the this-machine hardware profile to {this_machine_path()} (use it with --hardware "
          "this-machine)", file=sys.stderr)
    return 0


def _diffusion(args) -> int:
    from ..bench.diffusion import LOOPS, bench_diffusion

    budgets = split_floats(args.budgets, "--budgets")
    intervals = parse_intervals(args.intervals)
    loops = tuple(dict.fromkeys(x.strip() for x in args.loops.split(",") if x.strip()))
    if not loops or any(x not in LOOPS for x in loops):
        raise MoeOffloadError(f"--loops takes {' and/or '.join(LOOPS)}, comma-separated; got {args.loops!r}")
    prompts = load_prompts(args)
    path = resolve_model(args.model, progress=not args.quiet)
    return _table(args, bench_diffusion(path, prompts, budgets, intervals, max_new_tokens=args.max_new_tokens,
                                        block_length=args.block_length, steps=args.steps, threshold=args.threshold,
                                        hardware=args.hardware, model_profile=args.model_profile, device=args.device,
                                        dtype=args.dtype, progress=not args.quiet, repeats=args.repeats,
                                        loops=loops, skip_waits=args.emulated_waits == "skip"))


def _residencies_prompts_model(args):
    """``--residencies`` (each in (0, 1]), the prompts and the resolved model of ``bench decode`` / ``bench graph``."""
    residencies = split_floats(args.residencies, "--residencies")
    if any(not (0 < r <= 1) for r in residencies):
        raise MoeOffloadError(f"--residencies values must be in (0, 1], got {args.residencies}")
    return residencies, load_prompts(args), resolve_model(args.model, progress=not args.quiet)


def _decode(args) -> int:
    from ..bench.decode import bench_decode

    policies = parse_policies(args.policy)
    residencies, prompts, path = _residencies_prompts_model(args)
    return _table(args, bench_decode(path, prompts, residencies, max_new_tokens=args.max_new_tokens,
                                     device=args.device, dtype=args.dtype, policy=policies,
                                     progress=not args.quiet, predictor=args.predictor,
                                     link_epl=LINK_REGIMES.get(args.link_regime), rollout_every=args.rollout_every,
                                     skip_waits=args.emulated_waits == "skip", predictor_lag=args.predictor_lag,
                                     host_store=args.host_store, rounds=args.rounds))


def _graph(args) -> int:
    from ..bench.graph import bench_graph

    policies = parse_policies(args.policy)
    require_predictor(policies, args.predictor)
    residencies, prompts, path = _residencies_prompts_model(args)
    return _table(args, bench_graph(path, prompts, residencies, policy=policies, max_new_tokens=args.max_new_tokens,
                                    rounds=args.rounds, backend=args.graph_backend, device=args.device,
                                    dtype=args.dtype, predictor=args.predictor))


def _table(args, table: str) -> int:
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


def run(args) -> int:
    """``moe-offload bench decode | link | diffusion | replay``. Returns the exit status."""
    if args.bench_cmd == "link":
        return _link(args)
    if args.bench_cmd == "disk":
        from .bench_disk import run as bench_disk_run

        return bench_disk_run(args)
    if args.bench_cmd == "peers":
        from .bench_peers import run as bench_peers_run

        return bench_peers_run(args)
    if args.bench_cmd == "disk-figure":
        from ..bench.disk_figure import share_figure

        print(f"wrote {share_figure(args.dirs, Path(args.out), force=args.force)}")
        return 0
    if args.bench_cmd == "gpu-check":
        from ..bench.gpu_check import run_gpu_check

        return run_gpu_check(args.dry_run, args.out)
    if args.bench_cmd == "replay":
        from ..bench.replay_speed import bench_replay_speed

        print(json.dumps(bench_replay_speed(seconds=args.seconds), indent=1))
        return 0
    if args.out and Path(args.out).exists():
        raise MoeOffloadError(f"{args.out} already exists; choose a new --out")
    if args.bench_cmd == "formats":
        return _formats(args)
    if args.bench_cmd == "graph":
        return _graph(args)
    return _diffusion(args) if args.bench_cmd == "diffusion" else _decode(args)


def _formats(args) -> int:
    import tempfile

    from ..bench.formats import bench_formats
    from ..testbed.sharegpt import human_turns

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
