"""``moe-offload bench decode``: decode speed across residencies against FullLoad, measured in one run."""

from __future__ import annotations

import gc
from pathlib import Path

from .generate import run
from .models.loader import load_full, load_offloaded


def bench_decode(path: Path, prompts: list[str], residencies: list[float], *, max_new_tokens: int = 64,
                 device: str | None = None, dtype: str | None = None, policy: str = "lru",
                 progress: bool = True) -> str:
    """Run FullLoad and then the offloaded model at each residency on the same prompts (greedy).

    Returns a markdown table: residency, slots, decode tok/s, ratio to FullLoad (same run), hit rate, bytes
    loaded, mean TTFT, and whether the tokens equal FullLoad's. A warm-up request precedes each measurement.

    Raises:
        MoeOffloadError: as ``load_offloaded``.
    """
    def measure(lm):
        run(lm, prompts[:1], min(8, max_new_tokens))  # warm-up (allocator, kernels); not counted
        return run(lm, prompts, max_new_tokens, progress=progress)

    full = load_full(path, device=device, dtype=dtype)
    ref_out, ref = measure(full)
    ref_tokens = [o.token_ids for o in ref_out]
    total_bytes = full.num_moe_layers * full.num_experts * full.expert_bytes
    del full
    gc.collect()
    rows = [("FullLoad", "all", ref.decode_tokens_per_s, 1.0, None, 0, sum(ref.ttft_s) / len(ref.ttft_s), True,
             total_bytes)]
    for r in residencies:
        lm = load_offloaded(path, device=device, dtype=dtype, residency=r, policy=policy, progress=False)
        outs, s = measure(lm)
        same = [o.token_ids for o in outs] == ref_tokens
        rows.append((f"{r:.2f}", str(lm.engine.pool.num_slots), s.decode_tokens_per_s,
                     s.decode_tokens_per_s / ref.decode_tokens_per_s, s.offload.hit_rate, s.offload.bytes_loaded,
                     sum(s.ttft_s) / len(s.ttft_s), same, lm.engine.pool.nbytes))
        del lm
        gc.collect()
    head = ("| residency | slots | decode tok/s | vs FullLoad | hit rate | MiB loaded | mean TTFT s | same tokens "
            "| device expert MiB |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for name, slots, tps, ratio, hr, nbytes, ttft, same, dev_bytes in rows:
        lines.append(f"| {name} | {slots} | {tps:.2f} | {ratio:.3f} | {'-' if hr is None else f'{hr:.4f}'} | "
                     f"{nbytes / 2**20:.1f} | {ttft:.3f} | {'yes' if same else 'NO'} | {dev_bytes / 2**20:.1f} |")
    lines.append(f"\n{len(prompts)} prompts x {max_new_tokens} new tokens, policy {policy}, model {path}")
    return "\n".join(lines)
