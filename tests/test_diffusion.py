"""The block-diffusion loop (generation/diffusion.py): schedule, block-causal mask, commit rule, EOS truncation, hooks,
parameter errors and the CLI. A scripted stand-in model makes the loop's decisions checkable by hand."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.generation.diffusion import (block_causal_mask, commit_positions, diffusion_generate_ids,
                                              run_diffusion, transfer_schedule)
from moe_offload.models.loader import LoadedModel, load_offloaded
from moe_offload.models.registry import architecture_for

MASK, EOS, VOCAB = 50, 49, 64


class Scripted(torch.nn.Module):
    """Stand-in model: at absolute position p it predicts token ``target(p)`` with probability about ``conf(p)``
    (softmax of one large logit). Records every call's input length and attention mask."""

    def __init__(self, target, conf):
        super().__init__()
        self.target, self.conf = target, conf
        self.config = SimpleNamespace(mask_token_id=MASK, eos_token_id=EOS)
        self.generation_config = SimpleNamespace(eos_token_id=EOS)
        self.calls = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, past_key_values=None):
        n = input_ids.shape[1]
        self.calls.append((n, attention_mask))
        if past_key_values is not None:  # a stand-in layer: keys/values [1, 1, n, 1]
            past_key_values.update(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), 0)
        logits = torch.zeros(1, n, VOCAB)
        for i, p in enumerate(position_ids[0].tolist()):
            c = self.conf(p)  # logit gap g with p = e^g / (e^g + V - 1)
            logits[0, i, self.target(p)] = math.log(c * (VOCAB - 2) / (1 - c))  # V - 2: the mask token is excluded
        return SimpleNamespace(logits=logits)


class Engine:
    """Records ``begin_step`` calls (as the offload engine, or as one of its observers)."""

    def __init__(self):
        self.steps = []

    def begin_step(self, request, step):
        self.steps.append((request, step))

    def __call__(self, moe_layer, top_k_index, top_k_weights):  # engine observer protocol
        pass


def fake_lm(tmp_path, target=lambda p: 10 + p % 7, conf=lambda p: 0.5, engine=None):
    return LoadedModel(Scripted(target, conf), None, engine, architecture_for("llada2_moe"), torch.device("cpu"),
                       torch.float32, 0, 0, 0, 0, Path(tmp_path))


def test_transfer_schedule():
    assert transfer_schedule(32, 32) == [1] * 32
    assert transfer_schedule(8, 4) == [2, 2, 2, 2]
    assert transfer_schedule(8, 3) == [3, 3, 2]
    assert transfer_schedule(5, 1) == [5]


def test_block_causal_mask_by_hand():
    expect = torch.tensor([[1, 1, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0, 0],
                           [1, 1, 1, 1, 0, 0],
                           [1, 1, 1, 1, 0, 0],
                           [1, 1, 1, 1, 1, 1],
                           [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(block_causal_mask(6, 2), expect)
    assert torch.equal(block_causal_mask(5, 2), expect[:5, :5])
    assert bool(block_causal_mask(4, 4).all())


def test_commit_rule():
    conf = torch.tensor([0.99, 0.2, 0.97, 0.5, 0.96, 0.1])
    masked = torch.tensor([True, True, True, True, False, True])
    # three masked positions above 0.95 >= 2 scheduled: all of them... position 4 is not masked
    assert commit_positions(conf, masked, 2, 0.95).tolist() == [True, False, True, False, False, False]
    # fewer above the threshold than scheduled: the scheduled count of most confident masked ones
    assert commit_positions(conf, masked, 3, 0.95).tolist() == [True, False, True, True, False, False]
    assert commit_positions(conf, masked, 2, 1.0).tolist() == [True, False, True, False, False, False]
    # never more than the masked positions
    assert commit_positions(conf, torch.tensor([False, True] + [False] * 4), 3, 1.0).sum() == 1


def test_threshold_one_commits_exactly_the_schedule(tmp_path):
    eng = Engine()
    lm = fake_lm(tmp_path, conf=lambda p: 0.999, engine=eng)
    seen, ended = [], []
    res = diffusion_generate_ids(lm, list(range(1, 9)), 24, block_length=8, steps=3, threshold=1.0,
                                 on_step=lambda *a: seen.append(a), on_step_end=lambda *a: ended.append(a),
                                 prefix_cache=False)
    assert res.tokens_per_step == [3, 3, 2] * 3 and res.steps_per_block == [3, 3, 3]
    assert res.token_ids == [10 + p % 7 for p in range(8, 32)]
    assert [b.start for b in res.blocks] == [8, 16, 24] and [b.masks for b in res.blocks] == [8, 8, 8]
    assert eng.steps == [(0, g) for g in range(9)]  # begin_step before every step, global across blocks
    assert seen == ended == [(b, s, 3 * b + s) for b in range(3) for s in range(3)]
    assert len(res.step_seconds) == 9 and res.first_block_s > 0 and res.seconds >= res.first_block_s
    # each step runs on the prefix up to the end of the current block, with the block-causal mask
    calls = lm.model.calls
    assert [n for n, _ in calls] == [16] * 3 + [24] * 3 + [32] * 3
    assert all(torch.equal(m[0, 0], block_causal_mask(n, 8)) for n, m in calls)
    assert [b.forward_tokens for b in res.blocks] == [[16] * 3, [24] * 3, [32] * 3]


def test_prefix_cache_runs_each_step_over_the_block_only(tmp_path):
    """With the block-prefix KV cache (the default) the first step computes the prompt's complete block with the
    current one, each later step the current block only, and a block's first step also the block committed just
    before (its keys and values, final now, are cached from then on); the rows of the block-causal mask are those
    of the recomputed positions. Same tokens and commits as the reference loop."""
    lm = fake_lm(tmp_path, conf=lambda p: 0.999)
    res = diffusion_generate_ids(lm, list(range(1, 9)), 24, block_length=8, steps=3, threshold=1.0)
    assert [n for n, _ in lm.model.calls] == [16, 8, 8] + [16, 8, 8] * 2
    assert [b.forward_tokens for b in res.blocks] == [[16, 8, 8]] * 3
    ends = [16] * 3 + [24] * 3 + [32] * 3
    starts = [0, 8, 8, 8, 16, 16, 16, 24, 24]
    assert all(torch.equal(m[0, 0], block_causal_mask(e, 8)[s:e]) for (_, m), s, e in zip(lm.model.calls, starts, ends))
    ref = diffusion_generate_ids(fake_lm(tmp_path, conf=lambda p: 0.999), list(range(1, 9)), 24, block_length=8,
                                 steps=3, threshold=1.0, prefix_cache=False)
    assert res.token_ids == ref.token_ids and res.tokens_per_step == ref.tokens_per_step


def test_prefix_cache_needs_a_model_that_takes_one(tmp_path):
    lm = fake_lm(tmp_path)
    lm.model.forward = lambda input_ids, attention_mask=None, position_ids=None, use_cache=False: None
    with pytest.raises(MoeOffloadError, match="--no-prefix-cache"):
        diffusion_generate_ids(lm, [1, 2], 4, block_length=4, steps=2)


def test_confident_tokens_commit_above_the_schedule(tmp_path):
    # positions 8..15: confidence 0.99 at even positions, 0.3 at odd ones; one token scheduled per step
    lm = fake_lm(tmp_path, conf=lambda p: 0.99 if p % 2 == 0 else 0.3)
    res = diffusion_generate_ids(lm, list(range(1, 9)), 8, block_length=8, steps=8, threshold=0.95)
    assert res.tokens_per_step == [4, 1, 1, 1, 1]  # all four confident ones at once, then one per step
    assert res.steps_per_block == [5]


def test_partial_first_block_and_max_new_tokens(tmp_path):
    # a 5-token prompt leaves 3 mask tokens in block 0; 6 new tokens end inside block 1, which is still completed
    lm = fake_lm(tmp_path)
    res = diffusion_generate_ids(lm, [1, 2, 3, 4, 5], 6, block_length=8, steps=4, threshold=1.0)
    assert [(b.start, b.masks, b.committed) for b in res.blocks] == [(0, 3, [2, 1]), (8, 8, [2, 2, 2, 2])]
    assert res.token_ids == [10 + p % 7 for p in range(5, 11)]


def test_stops_after_the_block_holding_eos_and_truncates(tmp_path):
    lm = fake_lm(tmp_path, target=lambda p: EOS if p == 13 else 10 + p % 7)
    res = diffusion_generate_ids(lm, list(range(1, 5)), 40, block_length=4, steps=2)
    assert [b.start for b in res.blocks] == [4, 8, 12]  # block [12, 16) holds the EOS: no further block
    assert res.token_ids == [10 + p % 7 for p in range(4, 13)] + [EOS]


def test_mask_token_is_never_committed(tmp_path):
    lm = fake_lm(tmp_path, target=lambda p: MASK if p % 3 else 10)
    res = diffusion_generate_ids(lm, [1, 2, 3, 4], 8, block_length=4, steps=4)
    assert MASK not in res.token_ids and len(res.token_ids) == 8
    assert res.steps_per_block == [4, 4]


def test_sampling_is_seeded(tmp_path):
    lm = fake_lm(tmp_path, conf=lambda p: 0.3)
    runs = [diffusion_generate_ids(lm, [1, 2, 3, 4], 8, block_length=4, steps=2, temperature=1.0, top_p=0.9,
                                   seed=s).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert all(t != MASK for t in runs[0])


@pytest.mark.parametrize("kw, needle", [
    (dict(block_length=0), "--block-length must be a positive integer"),
    (dict(block_length=-8), "--block-length must be a positive integer"),
    (dict(block_length=8, steps=0), "--steps must be an integer in [1, --block-length = 8]"),
    (dict(block_length=8, steps=9), "--steps must be an integer in [1, --block-length = 8]"),
    (dict(threshold=0.0), "--threshold must be in (0, 1]"),
    (dict(threshold=1.5), "--threshold must be in (0, 1]"),
    (dict(threshold=float("nan")), "--threshold must be in (0, 1]"),
    (dict(max_new_tokens=0), "--max-new-tokens must be a positive integer"),
])
def test_bad_parameters(tmp_path, kw, needle):
    lm = fake_lm(tmp_path)
    n = kw.pop("max_new_tokens", 8)
    with pytest.raises(MoeOffloadError) as e:
        diffusion_generate_ids(lm, [1, 2], n, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not lm.model.calls


def test_run_diffusion_on_offloaded_llada2(tiny_dirs):
    lm = load_offloaded(tiny_dirs["llada2_moe"], device="cpu", residency=0.5, progress=False)
    obs = Engine()
    lm.engine.observers.append(obs)
    outs, st, res = run_diffusion(lm, ["hi", "Hello there"], 12, block_length=8, steps=4)
    assert [len(o.token_ids) for o in outs] == [12, 12]
    assert st.requests == 2 and st.offload.layer_calls == lm.num_moe_layers * sum(r.steps for r in res)
    assert obs.steps == [(i, g) for i, r in enumerate(res) for g in range(r.steps)]


def _cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, [ln for ln in out.err.splitlines() if ln.strip()]


def test_cli_generate_diffusion(capsys, tiny_dirs):
    d = str(tiny_dirs["llada2_moe"])
    code, out, err = _cli(capsys, "generate", "--model", d, "--prompt", "hi", "--max-new-tokens", "16",
                          "--block-length", "8", "--steps", "4", "--residency", "0.5", "--quiet")
    assert code == 0, err
    assert "### output" in out and "hit rate" in out
    # a diffusion run reports its own throughput and policy, not an autoregressive decode rate
    row = next(ln for ln in out.splitlines() if ln.startswith("diffusion "))
    assert "tok/s" in row and "steps/s" in row and "3 blocks of 8" in row
    assert not any(ln.startswith(("decode ", "TTFT")) for ln in out.splitlines())
    assert any(ln.startswith("first block (mean)") for ln in out.splitlines())
    assert "mode                    offload, policy lru (evicts the least recently used expert" in out
    code, out, err = _cli(capsys, "generate", "--model", d, "--prompt", "hi", "--max-new-tokens", "16",
                          "--block-length", "8", "--steps", "4", "--residency", "0.5", "--policy", "tide", "--quiet")
    assert code == 0, err
    assert "offload, policy tide (TIDE: per-layer budgets refreshed at I/O-aware intervals" in out
    code, out, err = _cli(capsys, "generate", "--model", d, "--prompt", "hi", "--max-new-tokens", "8",
                          "--block-length", "8", "--steps", "4", "--threshold", "1.0", "--json", "--quiet")
    assert code == 0, err
    info = json.loads(out)
    # "hi" is 2 tokens: block 0 holds 6 mask tokens (3 steps of 2), block 1 eight (4 steps of 2)
    g = info["stats"]["diffusion"]
    assert g["tokens_per_step_each"] == [[2] * 7]
    assert g["steps_per_s"] == pytest.approx(g["diffusion_steps"] / g["seconds"])
    assert g["output_tokens_per_s"] == pytest.approx(8 / g["seconds"]) and g["blocks"] == 2
    assert len(info["outputs"][0]["token_ids"]) == 8


@pytest.mark.parametrize("extra, needle", [
    (("--block-length", "8", "--steps", "9"), "--steps must be an integer in [1, --block-length = 8]"),
    (("--steps", "40"), "--steps must be an integer in [1, --block-length = 32]"),
    (("--block-length", "0"), "--block-length must be a positive integer"),
    (("--threshold", "0"), "--threshold must be in (0, 1]"),
    (("--threshold", "1.01"), "--threshold must be in (0, 1]"),
    (("--predictor", "nowhere"), "--predictor is not supported for diffusion models"),
])
def test_cli_bad_diffusion_values(capsys, tiny_dirs, extra, needle):
    code, _, err = _cli(capsys, "generate", "--model", str(tiny_dirs["llada2_moe"]), "--prompt", "hi",
                        "--max-new-tokens", "4", "--quiet", *extra)
    assert code == 2 and len(err) == 1 and err[0].startswith("moe-offload: error: ") and needle in err[0], err


def test_cli_diffusion_options_refused_for_autoregressive_models(capsys, tiny_dirs):
    code, _, err = _cli(capsys, "generate", "--model", str(tiny_dirs["mixtral"]), "--prompt", "hi",
                        "--max-new-tokens", "4", "--quiet", "--steps", "4", "--threshold", "0.9")
    assert code == 2 and len(err) == 1 and "--steps, --threshold only apply to diffusion models" in err[0], err
