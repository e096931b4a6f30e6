"""The GPU check (``scripts/gpu-check.sh``): lossless runs on CUDA for every policy and checkpoint format, decode
speed against FullLoad, and the link, in one markdown report; ``--dry-run`` runs the same checks on the CPU
(smaller) so the script itself is tested where no GPU is lent.

Lossless rows: each checkpoint is written here (tiny, random, in its published layout: bf16/fp32, sharded bf16,
FP8 block Qwen3 and DeepSeek-V3 layouts, gpt-oss MXFP4, LLaDA2 for the diffusion planners), generated greedily by
transformers' own FullLoad and by the offloaded engine at a residency with misses, and compared token for token.
``seqmoe`` / ``seqmoe-infinity`` / ``seqmoe-cacheonly`` run with a small predictor trained here on a trace of the
same checkpoint (``trace.collect.collect_trace`` and ``predictor.train.train_on_traces``, what ``trace collect``
and ``predictor train`` run).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from ..core.policy_spec import parse_policy
from ..errors import MoeOffloadError

PROMPTS = ["Hello there, how are you today? The slot pool is shared by all MoE layers.", "Explain KV caches."]
AR_POLICIES = ("lru", "lfu", "seqmoe-cacheonly", "seqmoe", "seqmoe-infinity")
#: the disk tier (``--host-store disk``): LRU, and the cross-layer forecasts with the cost gate (prefetches)
DISK_RUNS = [("lru", "disk"), ("xl+gate", "disk")]


def _checkpoints(root: Path) -> dict[str, Path]:
    from ..models.tiny import make_tiny
    from ..models.tiny_quantized import reshard, write_fp8, write_mxfp4

    q3 = make_tiny("qwen3_moe", root / "qwen3")
    return {
        "qwen3-moe fp32": q3,
        "mixtral bf16 sharded": reshard(make_tiny("mixtral", root / "mx", dtype=torch.bfloat16), root / "mx-sh"),
        "deepseek-v3 fp32": make_tiny("deepseek_v3", root / "ds"),
        "qwen3-moe fp8": write_fp8(q3, root / "qwen3-fp8"),
        "deepseek-v3 fp8": write_fp8(root / "ds", root / "ds-fp8", block=(8, 16), scale_dtype=torch.float32,
                                     mtp_layer=True),
        "gpt-oss mxfp4": write_mxfp4(make_tiny("gpt_oss", root / "go"), root / "go-mx"),
        "llada2-moe fp32": make_tiny("llada2_moe", root / "llada2"),
    }


def _predictor(ckpt: Path, root: Path, device: str) -> Path:
    """Train a small predictor on a trace of ``ckpt``, as ``trace collect`` + ``predictor train`` would (12 ShareGPT
    prompts x 16 tokens, router probabilities; one epoch of each phase, hidden size 32)."""
    from ..models.loader import load_offloaded
    from ..predictor.train import TrainConfig, train_on_traces
    from ..testbed.sharegpt import human_turns
    from ..trace.collect import collect_trace

    out = root / f"pred-{ckpt.name}"
    if not out.exists():
        lm = load_offloaded(ckpt, device=device, progress=False)
        prompts = [t for t in human_turns(12) if len(t) <= 2000]
        tr = collect_trace(lm, prompts, 16, router_probs=True, source=f"gpu check on {ckpt}")
        lm.close()
        pset, _ = train_on_traces([tr], [f"{ckpt.name}.trace"], TrainConfig(epochs=1, ss_epochs=1), hidden_size=32)
        pset.save(out)
    return out


def _generate(lm, new_tokens: int, diffusion: bool) -> list[list[int]]:
    from ..generation.generate import encode_prompt, generate_ids

    if diffusion:
        from ..generation.diffusion import diffusion_generate_ids

        return [diffusion_generate_ids(lm, encode_prompt(lm.tokenizer, p), new_tokens, block_length=8, steps=4,
                                       request=i).token_ids for i, p in enumerate(PROMPTS)]
    return [generate_ids(lm, encode_prompt(lm.tokenizer, p), new_tokens)[0] for p in PROMPTS]


def lossless_rows(root: Path, device: str, new_tokens: int) -> list[str]:
    """One markdown row per (checkpoint, policy, host store): tokens vs FullLoad, misses, seconds."""
    from ..models.loader import load_full, load_offloaded
    from ..predictor.model import load_predictor
    from ..predictor.attach import attach_predictor
    from ..predictor.cross_layer import attach_forecasts

    rows = []
    for name, d in _checkpoints(root).items():
        diffusion = name.startswith("llada2")
        full = load_full(d, device=device)
        ref = _generate(full, new_tokens, diffusion)
        del full
        runs = ([(p, "pinned") for p in ("reactive", "tide-fixed-T2", "tide")] if diffusion else
                [(p, "pinned") for p in AR_POLICIES] + [("lru", "mmap")])
        if not diffusion and not name.startswith(("qwen3", "gpt-oss")):
            runs = runs[:1] + runs[-1:]  # every format with lru (pinned, mmap); every policy on qwen3 / gpt-oss
        if name == "qwen3-moe fp32":  # the disk tier's CUDA flow (issue 47): misses read at once into the slots on
            runs += DISK_RUNS         # the compute stream, prefetches read on the copy worker's side stream
        for policy, store in runs:
            t0 = time.perf_counter()
            try:
                lm = load_offloaded(d, device=device, residency=0.5 if diffusion else 0.3, policy=policy,
                                    progress=False, host_store=store)
                spec = parse_policy(policy)
                if spec.cross_layer:
                    attach_forecasts(lm, spec, None)
                elif spec.needs_predictor:
                    attach_predictor(lm.engine, load_predictor(_predictor(d, root, device), device=lm.device))
                got = _generate(lm, new_tokens, diffusion)
                st = lm.engine.stats
                ok = "PASS" if got == ref else "FAIL (tokens differ)"
                detail = f"{st.misses} misses, {lm.expert_bytes:,} B/expert"
                lm.close()
            except Exception as e:  # a check that crashes is reported, and the others still run
                ok, detail = "FAIL (error)", f"{type(e).__name__}: {e}".replace("|", "/")[:200]
                traceback.print_exc()
            rows.append(f"| lossless | {name} | {policy} | {store} | {ok} | {detail} | "
                        f"{time.perf_counter() - t0:.1f} |")
    return ["| check | checkpoint | policy | host store | result | detail | s |", "|---|---|---|---|---|---|---|",
            *rows]


def speed_lines(root: Path, device: str, dry_run: bool) -> list[str]:
    """``bench decode`` (FullLoad, residency 1.0 / 0.45 / 0.25, LRU) on a medium random Qwen3-MoE."""
    from .decode import bench_decode
    from .formats import SPEED_GEOMETRY, _random_checkpoint

    sizes = dict(SPEED_GEOMETRY, num_experts=64) if not dry_run else dict(SPEED_GEOMETRY, num_hidden_layers=2,
                                                                           num_experts=16)
    d = _random_checkpoint("qwen3_moe", sizes, root / "medium", torch.bfloat16)
    n, toks = (1, 8) if dry_run else (4, 64)
    return [bench_decode(d, PROMPTS[:1] * n, [1.0, 0.45, 0.25], max_new_tokens=toks, device=device, progress=False)]


def link_lines(device: str, dry_run: bool) -> list[str]:
    from .link import measure_link

    res = measure_link(device=device, size_mb=8 if dry_run else 256)
    return [f"host->device link ({res.get('link')}): {res['link_gbps']:.2f} GB/s on {res.get('device_name')}"]


def run_gpu_check(dry_run: bool, out: str | Path) -> int:
    """The GPU check (``moe-offload bench gpu-check``, ``scripts/gpu-check.sh``): writes the markdown report to
    ``out`` and prints it. Returns 0 when every lossless check passed, else 1.

    Raises:
        MoeOffloadError: no CUDA device and not ``dry_run``."""
    if not dry_run and not torch.cuda.is_available():
        raise MoeOffloadError("bench gpu-check: no CUDA device; use --dry-run to run the CPU-safe parts")
    device = "cpu" if dry_run else "cuda"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["MOE_OFFLOAD_CACHE"] = str(root / "cache")  # bench link writes its profile here, not the user's
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        lines = [f"# GPU check ({'dry run on the CPU' if dry_run else name}), torch {torch.__version__}", ""]
        lines += lossless_rows(root, device, 6 if dry_run else 16)
        lines += ["", "## bench decode", ""] + speed_lines(root, device, dry_run)
        lines += ["", "## bench link", ""] + link_lines(device, dry_run)
        from .gpu_check_graph import graph_lines

        lines += ["", "## graph mode (issue 20)", ""] + graph_lines(root, device, dry_run, PROMPTS)
    lines += ["", f"total {time.perf_counter() - t0:.0f} s"]
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any("FAIL" in ln for ln in lines) else 0
