"""TIDE benchmark plumbing: the runtime diffusion-trace recorder, the emulated regime, router balancing, and
``bench diffusion`` / ``trace collect`` on tiny LLaDA2 checkpoints (correctness only; speed is not asserted)."""

import numpy as np
import pytest
import torch

from moe_offload.bench.diffusion import bench_diffusion, diffusion_regime
from moe_offload.cli import main
from moe_offload.core.costs import TideCosts
from moe_offload.generation.diffusion import run_diffusion
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.sim.diffusion_sim import fullload_seconds
from moe_offload.trace.diffusion import DiffusionTraceRecorder, load_diffusion_trace

PROMPTS = ["hello world", "the cat sat on"]


def _record(lm):
    with DiffusionTraceRecorder(lm, 8, source="test") as rec:
        outs, _, results = run_diffusion(lm, PROMPTS, 16, block_length=8, steps=4, recorder=rec)
        return outs, results, rec.trace(results)


def test_recorder_same_trace_for_fullload_and_offloaded(tiny_dirs):
    """The recorder sees the same routing on FullLoad and on an offloaded engine with host fallback; rows follow the
    results' blocks and steps; each layer's row sums to tokens x top-k; committed tokens add up."""
    path = tiny_dirs["llada2_moe"]
    full = load_full(path)
    outs, results, tr = _record(full)
    off = load_offloaded(path, residency=0.25, policy="tide-fixed-T2", progress=False)
    outs2, _, tr2 = _record(off)
    off.engine.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in outs2]
    assert np.array_equal(tr.counts, tr2.counts)
    assert tr.num_steps == sum(r.steps for r in results)
    assert (tr.num_moe_layers, tr.num_experts, tr.top_k, tr.block_length) == (2, 16, 4, 8)
    want = [(i, b.index, s) for i, r in enumerate(results) for b in r.blocks for s in range(b.steps)]
    assert list(zip(tr.request.tolist(), tr.block.tolist(), tr.step.tolist())) == want
    assert np.array_equal(tr.counts.sum(axis=2), np.repeat(tr.tokens[:, None] * 4, 2, axis=1))
    assert int(tr.committed.sum()) == sum(sum(r.tokens_per_step) for r in results)
    # tokens per forward: the first step's covers the prompt's complete blocks and the first block; later steps
    # the block (and at a block's first step the block committed before it): the block-prefix KV cache
    assert tr.tokens.tolist() == [t for r in results for b in r.blocks for t in b.forward_tokens]
    assert tr.tokens[0] == results[0].blocks[0].start + 8 and set(tr.tokens[1:].tolist()) <= {8, 16}


def test_recorder_rejects_mismatched_results(tiny_dirs):
    full = load_full(tiny_dirs["llada2_moe"])
    with DiffusionTraceRecorder(full, 8) as rec:
        _, _, results = run_diffusion(full, PROMPTS[:1], 8, block_length=8, steps=4, recorder=rec)
        with pytest.raises(Exception, match="recorded"):
            rec.trace(results + results)


def test_regime_scales_profile_costs_to_measured_fullload(tiny_dirs):
    """Every cost is the profile's times one factor, chosen so that FullLoad of the trace takes the measured
    seconds."""
    _, _, tr = _record(load_full(tiny_dirs["llada2_moe"]))
    costs, scale = diffusion_regime(tr, 2.0, expert_bytes=1234)
    assert fullload_seconds(tr, costs).sum() == pytest.approx(2.0, rel=1e-9)
    prof = TideCosts.from_profiles("rtx4090", "llada2.0-mini", tokens_per_step=round(float(tr.tokens.mean())))
    for f in ("swap_s", "fallback_expert_s", "fallback_token_s", "device_expert_s", "device_token_s"):
        assert getattr(costs, f) == pytest.approx(getattr(prof, f) * scale, rel=1e-12)
    # non-expert work: the 19-MoE-layer profile's, per MoE layer of the 2-layer trace
    assert costs.nonexpert_step_s == pytest.approx(prof.nonexpert_step_s * 2 / 19 * scale, rel=1e-12)
    assert costs.expert_bytes == 1234


def test_balance_expert_bias_reduces_load_imbalance():
    from transformers import AutoModelForCausalLM

    from moe_offload.models.tiny import balance_expert_bias, tiny_config

    _, cfg = tiny_config("llada2_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    batches = [torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    hist = balance_expert_bias(model, batches, iters=30, rate=0.02)
    assert len(hist) == 30 and all(h >= 1.0 for h in hist)
    assert hist[-1] < hist[0]


def test_bench_diffusion_table(tiny_dirs):
    """One budget, two fixed intervals: every row is there with FullLoad's tokens."""
    table = bench_diffusion(tiny_dirs["llada2_moe"], PROMPTS, [0.5], [1, 3], max_new_tokens=16, block_length=8,
                            steps=4, progress=False, repeats=2)
    summary, every = table.split("Every row")
    rows = [ln.split(" | ") for ln in every.splitlines() if ln.startswith("| ") and not ln.startswith("| loop")]
    names = ["FullLoad", "reactive", "tide-fixed-T1", "tide-fixed-T3", "tide"]
    assert [(r[0].strip("| "), r[1]) for r in rows] == [(lp, n) for lp in ("prefix-cache", "recompute") for n in names]
    assert all(r[-2] == "yes" for r in rows)  # FullLoad's tokens
    assert [r[-1].strip(" |") for r in rows] == ["-", "yes", "yes", "yes", "-"] * 2  # the simulator's counters
    labels = [ln.split(" | ")[1] for ln in summary.splitlines() if ln.startswith("| ") and not ln.startswith("| loop")]
    assert len(labels) == 10 and labels[0] == "FullLoad" and labels[4] == "**tide**"
    assert labels[2].startswith("tide-fixed, best T (T=") and labels[3].startswith("tide-fixed, worst T (T=")
    assert "emulated regime llada2.0-mini on rtx4090" in table and "tokens per forward" in table
    assert "- prefix cache: FullLoad" in table and "emulated waits slept" in table
    only = bench_diffusion(tiny_dirs["llada2_moe"], PROMPTS[:1], [0.5], [2], max_new_tokens=8, block_length=8,
                           steps=4, progress=False, loops=("recompute",), skip_waits=True)
    assert "| prefix-cache |" not in only and "| recompute | tide |" in only
    assert "emulated waits skipped on a virtual clock" in only
    rows = [ln.split(" | ") for ln in only.split("Every row")[1].splitlines() if ln.startswith("| recompute")]
    assert [(r[-2], r[-1].strip(" |")) for r in rows] == [("yes", "-"), ("yes", "yes"), ("yes", "yes"), ("yes", "-")]


def test_bench_diffusion_cli_errors(tiny_dirs, capsys):
    assert main(["bench", "diffusion", "--model", str(tiny_dirs["qwen3_moe"]), "--quiet"]) == 2
    assert "not a diffusion model" in capsys.readouterr().err
    assert main(["bench", "diffusion", "--model", str(tiny_dirs["llada2_moe"]), "--budgets", "0,0.5"]) == 2
    assert "budgets" in capsys.readouterr().err
    assert main(["bench", "diffusion", "--model", str(tiny_dirs["llada2_moe"]), "--intervals", "0-3"]) == 2
    assert "--intervals" in capsys.readouterr().err
    assert main(["bench", "diffusion", "--model", str(tiny_dirs["llada2_moe"]), "--loops", "cache"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--loops takes prefix-cache and/or recompute" in err[0]


def test_trace_collect_diffusion(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "d.trace"
    assert main(["trace", "collect", "--model", str(tiny_dirs["llada2_moe"]), "--prompt", "hi there",
                 "--max-new-tokens", "8", "--out", str(out), "--quiet"]) == 0
    tr = load_diffusion_trace(out)
    assert tr.num_experts == 16 and tr.num_steps >= 1 and not tr.synthetic
    assert main(["trace", "info", str(out), "--json"]) == 0
    assert '"kind": "diffusion"' in capsys.readouterr().out


def test_trace_collect_diffusion_loop_options(tiny_dirs, tmp_path, capsys):
    """trace collect records the loop generate runs with --block-length/--steps/--threshold; an autoregressive model
    refuses them with one line (nothing written)."""
    out = tmp_path / "d.trace"
    assert main(["trace", "collect", "--model", str(tiny_dirs["llada2_moe"]), "--prompt", "hi there",
                 "--max-new-tokens", "8", "--block-length", "8", "--steps", "4", "--out", str(out), "--quiet"]) == 0
    tr = load_diffusion_trace(out)
    assert tr.block_length == 8 and tr.num_steps == 4  # one block of 8 tokens in 4 steps (threshold 0.95)
    assert "steps 4" in capsys.readouterr().out
    bad = tmp_path / "ar.trace"
    assert main(["trace", "collect", "--model", str(tiny_dirs["qwen3_moe"]), "--prompt", "hi", "--steps", "4",
                 "--out", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps only apply to diffusion models" in err[0] and not bad.exists()
