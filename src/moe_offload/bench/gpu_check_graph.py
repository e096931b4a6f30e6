"""The GPU check's graph-mode section (issue 20, ``scripts/gpu-check.sh``): eager vs compiled decode, token for
token against FullLoad eager, then compiled with CUDA graph capture, and ``bench graph`` on a medium checkpoint.
``--dry-run`` runs the same on the CPU, smaller, compiled with ``aot_eager`` (no CUDA graphs there).

Status of the GPU path (what this check is for): the cache decisions are fixed-shape tensor ops and capture as
they are; the two custom ops (``runtime.graph.engine``) read the pairs' slot ids and the copy count on the host,
which a CUDA graph cannot capture — the rows with ``cuda graphs`` are expected to report that until a
device-side copy kernel (mapped host memory) and a fixed-shape grouped GEMM replace the ops' bodies on CUDA.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from ..core.policy_spec import parse_policy

#: (policy, residency) of the lossless graph-mode rows (the seqmoe ones run an untrained predictor: the forecasts
#: are arbitrary, the tokens must still be FullLoad's)
GRAPH_ROWS = tuple((parse_policy(p), r) for p, r in (("lru", 1.0), ("lru", 0.45), ("lfu", 0.45),
                                                     ("seqmoe-cacheonly", 0.45), ("seqmoe", 0.45)))


def _tokens(lm, prompts, new_tokens, decoder=None):
    from ..generation.generate import run
    from ..graph.decode import run_graph

    if decoder is None:
        return [o.token_ids for o in run(lm, prompts, new_tokens)[0]]
    return [o.token_ids for o in run_graph(lm, prompts, new_tokens, decoder=decoder)[0]]


def graph_lines(root: Path, device: str, dry_run: bool, prompts: list[str]) -> list[str]:
    """Markdown lines: one row per (policy, residency, mode) with tokens equal to FullLoad eager's or not, then the
    ``bench graph`` table. A row that crashes is reported as FAIL with its error."""
    from ..models.loader import load_full
    from ..models.tiny import make_tiny
    from ..graph.decode import GraphDecoder, load_graph

    ckpt = make_tiny("qwen3_moe", root / "graph-qwen3")
    new = 6 if dry_run else 16
    backend = "aot_eager" if dry_run else "inductor"  # the dry run keeps compiling cheap
    ref = _tokens(load_full(ckpt, device=device), prompts, new)
    pred = _random_predictor(ckpt, root / "graph-qwen3-predictor", device)
    rows = ["| policy | residency | mode | result | s |", "|---|---|---|---|---|"]
    modes = [("eager", None), ("compiled", False)] + ([] if device == "cpu" else [("cuda graphs", True)])
    for policy, r in GRAPH_ROWS:
        if policy.prefetch and device != "cpu":
            rows.append(f"| {policy} | {r:.2f} | - | not built on CUDA: the prefetch worker's control region needs "
                        "pinned, mapped host memory | 0 |")
            continue
        for mode, graphs in modes:
            t0 = time.perf_counter()
            try:
                lm = load_graph(ckpt, policy=policy, residency=r, device=device,
                                predictor=pred if policy.needs_predictor else None)
                dec = None if graphs is None else GraphDecoder(lm, backend=backend, cuda_graphs=graphs)
                got = _tokens(lm, prompts, new, dec)
                result = "pass" if got == ref else "FAIL (tokens differ from FullLoad eager)"
                lm.close()
            except Exception as e:
                result = "FAIL (error) " + f"{type(e).__name__}: {e}".replace("|", "/").replace("\n", " ")[:160]
                traceback.print_exc()
            rows.append(f"| {policy} | {r:.2f} | {mode} | {result} | {time.perf_counter() - t0:.1f} |")
    rows += ["", "seqmoe-cacheonly and seqmoe: an untrained predictor inside the step (arbitrary forecasts, the tokens "
             "must still be FullLoad's); seqmoe also prefetches through its CPU worker", ""]
    return rows + [_bench(root, device, dry_run, prompts)]


def _random_predictor(ckpt: Path, out: Path, device: str) -> str:
    """An untrained two-range predictor set for the checkpoint (seed 0), saved to ``out``; returns its path."""
    from ..predictor.model import PredictorHeader, PredictorSet, PredictorSpec, default_ranges
    from ..graph.decode import load_graph

    lm = load_graph(ckpt, policy="lru", device=device)
    h = PredictorHeader(model_id=lm.model_id, model_type=lm.model.config.model_type, num_moe_layers=lm.num_moe_layers,
                        num_experts=lm.num_experts, top_k=lm.top_k,
                        specs=[PredictorSpec(layers=r, hidden_size=32, state_size=16, head_dim=16)
                               for r in default_ranges(lm.num_moe_layers, 2)])
    lm.close()
    torch.manual_seed(0)
    return str(PredictorSet(h).eval().save(out))


def _bench(root: Path, device: str, dry_run: bool, prompts: list[str]) -> str:
    from .formats import SPEED_GEOMETRY, _random_checkpoint
    from .graph import bench_graph

    sizes = dict(SPEED_GEOMETRY, num_experts=64) if not dry_run else dict(SPEED_GEOMETRY, num_hidden_layers=2,
                                                                           num_experts=16)
    d = _random_checkpoint("qwen3_moe", sizes, root / "graph-medium", torch.bfloat16)
    try:
        # the dry run's model has 2 x 16 experts: 0.5 keeps one layer's experts in slots
        return bench_graph(d, prompts[:1], [1.0, 0.5 if dry_run else 0.45], max_new_tokens=8 if dry_run else 64,
                           rounds=1 if dry_run else 3, device=device,
                           backend="aot_eager" if dry_run else "inductor")
    except Exception as e:
        traceback.print_exc()
        return f"bench graph: FAIL (error) {type(e).__name__}: {e}"[:300]
