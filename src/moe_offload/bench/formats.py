"""``moe-offload bench formats``: expert formats (bf16 / FP8 / MXFP4) and host store modes (pinned / mmap), one run.

Two tables:

1. **Speed per format.** The same tiny geometry written as Qwen3-MoE bf16 and FP8 (block 128) and as GPT-OSS bf16
   and MXFP4 (``models.tiny_quantized``): bytes per expert, and decode tokens/s at a residency against the format's
   own FullLoad (transformers' dequantizing ``from_pretrained``), with tokens compared. The link is emulated at one
   fixed bandwidth for every row, set so that one layer of the bf16 Qwen3 FullLoad overlaps the transfer of 1.39 bf16
   experts (SeqMoE §2.2, the rtx4090 regime): an on-demand copy takes ``expert_bytes / bandwidth``, so fewer bytes
   per expert show as fewer seconds per miss.
2. **Host memory while loading.** A synthetic bf16 checkpoint of at least 1.5 GB (8 MoE layers x 64 experts, per-expert
   keys, 1 GB shards) is loaded and run for a few tokens by ``generate`` in a fresh process per host store mode;
   the process's peak RSS (``VmHWM``) and peak anonymous (private) memory (``RssAnon`` sampled every 2 ms) are
   reported as fractions of the checkpoint size, with the interpreter's baseline before loading and the slot pool
   (device memory on a GPU; host memory on this CPU) stated beside them.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ..errors import MoeOffloadError

SPEED_GEOMETRY = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64, intermediate_size=1024, moe_intermediate_size=512, num_experts_per_tok=4,
                      max_position_embeddings=1024)
SPEED_EXPERTS = 32
MEMORY_GEOMETRY = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=64, intermediate_size=2048, moe_intermediate_size=768, num_experts=64,
                       num_experts_per_tok=8, max_position_embeddings=1024)
LINK_EPL = 1.39  # SeqMoE §2.2: experts whose transfer one layer's FullLoad compute overlaps (rtx4090 regime)


def _random_checkpoint(arch: str, sizes: dict, out: Path, dtype: torch.dtype, shard: str | None = None) -> Path:
    """A random checkpoint of ``arch`` with ``sizes`` (byte tokenizer, initializer_range 0.2) written with
    transformers' ``save_pretrained`` (published key layout)."""
    from transformers import AutoModelForCausalLM

    from ..models.tiny import _tokenizer_and_config

    tok, config = _tokenizer_and_config(arch, sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    tok.save_pretrained(out)
    del model
    gc.collect()
    return out


def format_checkpoints(root: Path) -> dict[str, Path]:
    """``{row name: checkpoint dir}`` of the speed table, written under ``root``."""
    from ..models.tiny_quantized import write_fp8, write_mxfp4

    q = _random_checkpoint("qwen3_moe", dict(SPEED_GEOMETRY, num_experts=SPEED_EXPERTS), root / "qwen3-bf16",
                           torch.bfloat16)
    g = _random_checkpoint("gpt_oss", dict(SPEED_GEOMETRY, num_local_experts=SPEED_EXPERTS, sliding_window=128),
                           root / "gpt-oss-bf16", torch.bfloat16)
    return {"qwen3-moe bf16": q, "qwen3-moe fp8 (block 128)": write_fp8(q, root / "qwen3-fp8", block=(128, 128)),
            "gpt-oss bf16": g, "gpt-oss mxfp4": write_mxfp4(g, root / "gpt-oss-mxfp4")}


def bench_format_speed(root: Path, prompts: list[str], residency: float, max_new_tokens: int,
                       progress: bool = False) -> list[str]:
    """Markdown lines of table 1 (module docstring)."""
    from .decode import _emulate_on_demand
    from ..generation.generate import run
    from ..models.loader import load_full, load_offloaded

    dirs = format_checkpoints(root)
    rows, link_bps = [], None
    for name, d in dirs.items():
        full = load_full(d, device="cpu")
        run(full, prompts[:1], 4)
        ref_out, ref = run(full, prompts, max_new_tokens, progress=progress)
        if link_bps is None:  # the link: one bf16 Qwen3 FullLoad layer overlaps 1.39 bf16 expert copies
            t_layer = ref.decode_s / max(1, ref.decode_tokens) / full.num_moe_layers
            link_bps = full.expert_bytes * LINK_EPL / t_layer
        del full
        gc.collect()
        lm = load_offloaded(d, device="cpu", residency=residency, progress=False)
        _emulate_on_demand(lm, lm.expert_bytes / link_bps)
        run(lm, prompts[:1], 4)
        out, s = run(lm, prompts, max_new_tokens, progress=progress)
        same = [o.token_ids for o in out] == [o.token_ids for o in ref_out]
        rows.append(f"| {name} | {lm.expert_bytes:,} | {' + '.join(lm.expert_dtypes)} | "
                    f"{ref.decode_tokens_per_s:.2f} | {s.decode_tokens_per_s:.2f} | "
                    f"{s.decode_tokens_per_s / ref.decode_tokens_per_s:.3f} | {s.offload.hit_rate:.3f} | "
                    f"{s.offload.bytes_loaded / 2**20:.1f} | "
                    f"{1e3 * s.offload.bytes_loaded / link_bps / max(1, s.decode_tokens + s.prompt_tokens):.2f} | "
                    f"{'yes' if same else 'NO'} |")
        del lm
        gc.collect()
    return ["| checkpoint | bytes per expert | stored as | FullLoad tok/s | offloaded tok/s | vs own FullLoad | "
            "hit rate | MiB loaded | link ms per token | same tokens |", "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            f"\nresidency {residency}, LRU, {len(prompts)} prompts x {max_new_tokens} new tokens, greedy; emulated "
            f"link {link_bps / 1e9:.3f} GB/s for every row (1.39 bf16 experts per bf16 FullLoad layer time)"]


def _sample_anon(stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], _status_kb("RssAnon"))
        time.sleep(0.002)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure_load(model_dir: str, host_store: str, residency: float) -> dict:
    """In this process: load ``model_dir`` offloaded and generate 4 tokens; peak RSS / anonymous bytes (Linux)."""
    from ..generation.generate import run
    from ..models.loader import load_offloaded

    base_rss, base_anon = _status_kb("VmRSS") * 1024, _status_kb("RssAnon") * 1024
    stop, peak = threading.Event(), [0]
    t = threading.Thread(target=_sample_anon, args=(stop, peak), daemon=True)
    t.start()
    t0 = time.perf_counter()
    lm = load_offloaded(model_dir, device="cpu", residency=residency, progress=False, host_store=host_store)
    load_s = time.perf_counter() - t0
    out, _ = run(lm, ["Hello there"], 4)
    stop.set()
    t.join()
    non_expert = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    return {"host_store": host_store, "load_s": load_s, "peak_rss": _status_kb("VmHWM") * 1024,
            "peak_anon": max(peak[0], _status_kb("RssAnon")) * 1024, "base_rss": base_rss, "base_anon": base_anon,
            "pool_bytes": lm.engine.pool.nbytes, "store_bytes": lm.engine.store.nbytes, "non_expert": non_expert,
            "tokens": out[0].token_ids}


def bench_host_memory(root: Path, residency: float) -> list[str]:
    """Markdown lines of table 2 (module docstring); each mode in a fresh interpreter."""
    d = root / "memory-bf16"
    if not d.exists():
        _random_checkpoint("qwen3_moe", MEMORY_GEOMETRY, d, torch.bfloat16, shard="1GB")
    ckpt = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    res = []
    for mode in ("pinned", "mmap"):
        code = ("import json, sys; from moe_offload.bench.formats import measure_load; "
                "print(json.dumps(measure_load(sys.argv[1], sys.argv[2], float(sys.argv[3]))))")
        p = subprocess.run([sys.executable, "-c", code, str(d), mode, str(residency)], capture_output=True, text=True)
        if p.returncode != 0:
            raise MoeOffloadError(f"memory measurement ({mode}) failed: {p.stderr.strip().splitlines()[-1:]}")
        res.append(json.loads(p.stdout.strip().splitlines()[-1]))
    same = res[0]["tokens"] == res[1]["tokens"]
    lines = ["| host store | load s | peak RSS | peak RSS / ckpt | (peak RSS - pool) / ckpt | "
             "(peak RSS - baseline - pool) / ckpt | peak anon | (peak anon - baseline anon - pool) / ckpt | "
             "private store | non-expert weights |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        lines.append(f"| {r['host_store']} | {r['load_s']:.1f} | {r['peak_rss'] / 2**30:.2f} GiB | "
                     f"{r['peak_rss'] / ckpt:.3f} | {(r['peak_rss'] - r['pool_bytes']) / ckpt:.3f} | "
                     f"{(r['peak_rss'] - r['base_rss'] - r['pool_bytes']) / ckpt:.3f} | "
                     f"{r['peak_anon'] / 2**30:.2f} GiB | "
                     f"{(r['peak_anon'] - r['base_anon'] - r['pool_bytes']) / ckpt:.3f} | "
                     f"{r['store_bytes'] / 2**30:.2f} GiB | {r['non_expert'] / 2**20:.1f} MiB |")
    lines.append(f"\ncheckpoint {ckpt / 2**30:.2f} GiB bf16 ({ckpt:,} B; 8 MoE layers x 64 experts, 1 GB shards), "
                 f"residency {residency}: slot pool {res[0]['pool_bytes'] / 2**30:.2f} GiB (host memory on this CPU, "
                 f"device memory on a GPU); interpreter baseline before loading {res[0]['base_rss'] / 2**30:.2f} GiB "
                 f"RSS / {res[0]['base_anon'] / 2**30:.2f} GiB anon; tokens pinned == mmap: {'yes' if same else 'NO'}")
    return lines


def bench_formats(root: Path, prompts: list[str], *, residency: float = 0.25, max_new_tokens: int = 32,
                  memory: bool = True, progress: bool = False) -> str:
    """Both tables as markdown (see the module docstring); checkpoints are written under ``root``."""
    lines = ["### Expert formats: bytes per expert and decode speed", ""]
    lines += bench_format_speed(root, prompts, residency, max_new_tokens, progress)
    if memory:
        lines += ["", "### Host memory while loading: pinned vs mmap", ""]
        lines += bench_host_memory(root, 0.2)
    return "\n".join(lines)
