"""The block-prefix KV cache of the diffusion loop (issue 19) on tiny LLaDA2 checkpoints: the same tokens as the
reference loop that recomputes the prefix, and every request shape (early EOS, a block cut by max_new_tokens, a
prompt ending on a block boundary) replayed by the simulator and by ``bench diffusion`` as the runtime ran it."""

import json
import shutil

import pytest
import torch

from moe_offload.bench.diffusion import bench_diffusion
from moe_offload.cli import main
from moe_offload.core.costs import TideCosts
from moe_offload.core.refresh import make_refresh_planner
from moe_offload.generation.generate import encode_prompt
from moe_offload.generation.diffusion import block_causal_mask, diffusion_generate_ids, run_diffusion
from moe_offload.generation.diffusion_forward import StepForward
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.sim.diffusion_sim import replay_diffusion
from moe_offload.trace.diffusion import DiffusionTraceRecorder


@pytest.fixture(scope="module")
def full(tiny_dirs):
    return load_full(tiny_dirs["llada2_moe"])


@pytest.mark.parametrize("prompt_len", [1, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("steps, threshold", [(8, 1.0), (4, 0.95), (3, 0.5), (1, 0.95)])
def test_same_tokens_with_and_without_the_prefix_cache(full, prompt_len, steps, threshold):
    """Prompts ending before, on and after block boundaries (block 8), schedules of 1-8 steps, thresholds that
    commit early or only the schedule, outputs ending inside and on a block: identical tokens and commits."""
    ids = [3 + (5 * i) % 200 for i in range(prompt_len)]
    for n in (5, 8, 19):
        kw = dict(block_length=8, steps=steps, threshold=threshold)
        cached = diffusion_generate_ids(full, ids, n, **kw)
        ref = diffusion_generate_ids(full, ids, n, prefix_cache=False, **kw)
        assert cached.token_ids == ref.token_ids and len(cached.token_ids) == n
        assert cached.tokens_per_step == ref.tokens_per_step
        first = prompt_len // 8 * 8 + 8  # the forward of the first step covers the prompt's blocks and the block
        assert cached.blocks[0].forward_tokens[0] == first == ref.blocks[0].forward_tokens[0]
        assert all(t == 8 for b in cached.blocks for t in b.forward_tokens[1:])
        assert all(b.forward_tokens[0] == 16 for b in cached.blocks[1:])


def test_cached_logits_equal_recomputed_ones(full):
    """Block by block, the current block's float32 logits from the cache equal the recomputed ones up to the
    rounding of GEMMs of other shapes (the keys and values are the same), and so do their argmax tokens."""
    x = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = block_causal_mask(40, 8)
    cached, ref = StepForward(full.model, 40, 8, mask, True), StepForward(full.model, 40, 8, mask, False)
    with torch.no_grad():
        for b in range(1, 5):
            for _ in range(2):  # two steps of the block: the second runs the block alone against the cache
                a, r = cached(x, 8 * b, 8 * b + 8), ref(x, 8 * b, 8 * b + 8)
                assert a.dtype == torch.float32 and a.shape == r.shape == (8, full.model.config.vocab_size)
                assert torch.allclose(a, r, rtol=0, atol=1e-5)
                assert torch.equal(a.argmax(-1), r.argmax(-1))
    assert cached.cache.length == 32 and ref.cache is None


@pytest.mark.parametrize("policy", ["reactive", "tide-fixed-T2", "tide"])
def test_offloaded_with_the_prefix_cache_gives_the_reference_tokens(tiny_dirs, full, policy):
    prompts = ["hello world", "the cat sat on"]
    ref, _, _ = run_diffusion(full, prompts, 20, block_length=8, steps=4, prefix_cache=False)
    lm = load_offloaded(tiny_dirs["llada2_moe"], residency=0.25, policy=policy, progress=False,
                        seconds_per_expert=1e-4)
    outs, st, _ = run_diffusion(lm, prompts, 20, block_length=8, steps=4)
    lm.engine.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert st.offload.steps == sum(r.steps for r in _)


def test_cli_no_prefix_cache(tiny_dirs, capsys):
    d = str(tiny_dirs["llada2_moe"])
    out = {}
    for flag in ([], ["--no-prefix-cache"]):
        assert main(["generate", "--model", d, "--prompt", "hi", "--max-new-tokens", "12", "--block-length", "8",
                     "--steps", "4", "--json", "--quiet", *flag]) == 0
        out[bool(flag)] = json.loads(capsys.readouterr().out)
    assert out[False]["outputs"][0]["token_ids"] == out[True]["outputs"][0]["token_ids"]
    g0, g1 = out[False]["stats"]["diffusion"], out[True]["stats"]["diffusion"]
    assert g0["prefix_cache"] is True and g1["prefix_cache"] is False
    assert g0["tokens_per_forward"] < g1["tokens_per_forward"]
    assert main(["generate", "--model", str(tiny_dirs["mixtral"]), "--prompt", "hi", "--max-new-tokens", "4",
                 "--quiet", "--no-prefix-cache"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--no-prefix-cache only apply to diffusion models" in err[0]


# ---------------------------------------------------------------------------------------------- request shapes


def _prompt(tok, remainder: int) -> str:
    """A prompt whose encoding has ``remainder`` tokens mod 8 (the byte-level tiny tokenizer: one token a byte)."""
    for n in range(1, 40):
        text = "ab " * n
        if len(encode_prompt(tok, text)) % 8 == remainder:
            return text
    raise AssertionError("no prompt of that length")


@pytest.fixture(scope="module")
def shapes(tiny_dirs, full, tmp_path_factory):
    """``{shape: (checkpoint, prompt, max_new_tokens)}``: ``early-eos`` (a copy of the checkpoint whose EOS is the
    token the first block produces: the request ends in its first block), ``cut`` (the last block is cut by
    max_new_tokens), ``boundary`` (the prompt ends exactly on a block boundary)."""
    src = tiny_dirs["llada2_moe"]
    prompt = _prompt(full.tokenizer, 3)
    ids = encode_prompt(full.tokenizer, prompt)
    res = diffusion_generate_ids(full, ids, 24, block_length=8, steps=4)
    eos_dir = tmp_path_factory.mktemp("eos") / "ckpt"
    shutil.copytree(src, eos_dir)
    for name in ("config.json", "generation_config.json"):
        f = eos_dir / name
        cfg = json.loads(f.read_text())
        cfg["eos_token_id"] = res.token_ids[2]
        f.write_text(json.dumps(cfg))
    return {"early-eos": (eos_dir, prompt, 24), "cut": (src, _prompt(full.tokenizer, 5), 6),
            "boundary": (src, _prompt(full.tokenizer, 0), 12)}


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("shape", ["early-eos", "cut", "boundary"])
def test_request_shapes_replay_as_they_ran(shapes, shape, prefix_cache):
    """Each shape, twice in a row on one engine (as a benchmark's warm-up and timed run: the same request and block
    numbers again), then cold: the runtime's host / device token-experts and copies equal the simulator's replay
    of the recorded trace, for the planners whose decisions do not depend on time."""
    path, prompt, n = shapes[shape]
    kw = dict(block_length=8, steps=4, prefix_cache=prefix_cache)
    for policy in ("reactive", "tide-fixed-T2"):
        lm = load_offloaded(path, residency=0.25, policy=policy, progress=False)
        for _ in range(2):  # request 0 again on a warm engine (early-eos: it ends in the block it began, the
            run_diffusion(lm, [prompt], n, **kw)  # reported 'diffusion step 0 after step 9')
        lm.engine.restart()
        with DiffusionTraceRecorder(lm, 8) as rec:
            outs, st, res = run_diffusion(lm, [prompt], n, recorder=rec, **kw)
            tr = rec.trace(res)
        lm.engine.close()
        r = res[0]
        if shape == "early-eos":
            assert len(r.blocks) == 1 and len(outs[0].token_ids) < n
        elif shape == "cut":
            assert len(outs[0].token_ids) == n and r.prompt_tokens + n < r.blocks[-1].start + 8
        else:
            assert r.prompt_tokens % 8 == 0 and r.blocks[0].masks == 8
        sim = replay_diffusion(tr, make_refresh_planner(policy, tr.num_moe_layers, tr.num_experts, lm.engine.budget),
                               TideCosts.from_numbers(1, swap_s=1e-3))
        o = st.offload
        assert (o.host_tokens, o.device_tokens, o.blocking_loads, o.steps) == (
            sim.fallback_token_experts, sim.device_token_experts, sim.blocking_swaps, sim.steps)


@pytest.mark.parametrize("shape", ["early-eos", "cut", "boundary"])
def test_bench_diffusion_runs_every_request_shape(shapes, shape):
    """``bench diffusion`` on one request of each shape (early-eos: its warm-up ends in the timed run's first block,
    the reported 'diffusion step 0 after step 9' failure), both loops: every row has FullLoad's tokens and the
    deterministic planners' counters equal the simulator's."""
    path, prompt, n = shapes[shape]
    table = bench_diffusion(path, [prompt], [0.25], [2], max_new_tokens=n, block_length=8, steps=4, progress=False)
    rows = [ln.split(" | ") for ln in table.split("Every row")[1].splitlines() if ln.startswith("| ") and
            not ln.startswith("| loop")]
    assert [(r[0].strip("| "), r[1]) for r in rows] == [(lp, p) for lp in ("prefix-cache", "recompute") for p in
                                                       ("FullLoad", "reactive", "tide-fixed-T2", "tide")]
    assert all(r[-2] == "yes" for r in rows)
    assert [r[-1].strip(" |") for r in rows] == ["-", "yes", "yes", "-"] * 2
