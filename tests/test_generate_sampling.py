"""Sampling edges through ``generate`` (issue 34): the shared sampler (``moe_offload.generation.sampling``) in the batch-1
autoregressive loop (``generate.generate_ids`` / ``run``), the block-diffusion loop (``diffusion_generate_ids`` /
``run_diffusion``) and ``moe-offload generate``: a temperature below ``GREEDY_TEMPERATURE`` is greedy, ``top_k`` 1 is
greedy, ``top_k`` k draws only among the k most probable tokens, ``top_p`` 0 keeps only the most probable token; a
non-finite ``--temperature`` / ``--top-p`` is a one-line CLI error."""

import json

import pytest
import torch

import moe_offload.generation.diffusion as diffusion
from moe_offload.cli import main
from moe_offload.generation.generate import GREEDY_TEMPERATURE, generate_ids, run
from moe_offload.generation.diffusion import diffusion_generate_ids, run_diffusion
from moe_offload.models.loader import load_full

PROMPT = "Hello there, how are you today?"
TINY_TEMPERATURES = (-0.0, 1e-40, 5e-324, 1e-30, 1e-6, GREEDY_TEMPERATURE / 2)
N = 8


@pytest.fixture(scope="module")
def ar(tiny_dirs):
    lm = load_full(tiny_dirs["qwen3_moe"], device="cpu")
    return lm, lm.tokenizer(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def dlm(tiny_dirs):
    lm = load_full(tiny_dirs["llada2_moe"], device="cpu")
    return lm, lm.tokenizer(PROMPT)["input_ids"]


def _chosen_from(lm, ids, **kw) -> list[tuple[int, torch.Tensor]]:
    """``(token, logits [V])`` of every step of ``generate_ids(lm, ids, N, **kw)`` (a forward hook on the model)."""
    seen = []
    hook = lm.model.register_forward_hook(lambda m, a, out: seen.append(out.logits[0, -1].float().clone()))
    try:
        new = generate_ids(lm, ids, N, **kw)[0]
    finally:
        hook.remove()
    assert len(new) == len(seen)
    return list(zip(new, seen))


def test_autoregressive_tiny_temperature_is_greedy(ar):
    lm, ids = ar
    want = generate_ids(lm, ids, N)[0]
    assert len(want) == N
    for t in TINY_TEMPERATURES:
        assert generate_ids(lm, ids, N, temperature=t, seed=1)[0] == want, t
    assert generate_ids(lm, ids, N, temperature=2.0, top_p=0.0, seed=1)[0] == want


def test_autoregressive_top_k(ar):
    lm, ids = ar
    want = generate_ids(lm, ids, N)[0]
    for s in range(3):
        assert generate_ids(lm, ids, N, temperature=2.0, top_k=1, seed=s)[0] == want
    plain_outside = False
    for s in range(4):
        steps = _chosen_from(lm, ids, temperature=2.0, top_k=3, seed=s)
        assert all(t in lg.topk(3).indices.tolist() for t, lg in steps), s
        assert [t for t, _ in steps] == generate_ids(lm, ids, N, temperature=2.0, top_k=3, seed=s)[0]  # seeded
        plain = _chosen_from(lm, ids, temperature=2.0, seed=s)
        plain_outside |= any(t not in lg.topk(3).indices.tolist() for t, lg in plain)
    assert plain_outside  # without top_k these settings leave the top 3: the check above has teeth
    for k in (0, -1, int(lm.model.config.vocab_size)):  # off
        assert generate_ids(lm, ids, N, temperature=1.0, top_k=k, seed=2)[0] == generate_ids(
            lm, ids, N, temperature=1.0, seed=2)[0]
    outs, _ = run(lm, [PROMPT], N, temperature=2.0, top_k=1, seed=5)  # run passes top_k on
    assert outs[0].token_ids == run(lm, [PROMPT], N)[0][0].token_ids


DIFF = dict(block_length=8, steps=4, threshold=0.95)


def _diffusion(lm, ids, **kw) -> list[int]:
    return diffusion_generate_ids(lm, ids, 16, **(DIFF | kw)).token_ids


def test_diffusion_tiny_temperature_and_top_k_one_are_greedy(dlm):
    lm, ids = dlm
    want = _diffusion(lm, ids)
    assert len(want) >= 8
    for t in TINY_TEMPERATURES:
        assert _diffusion(lm, ids, temperature=t, seed=1) == want, t
    for t in (GREEDY_TEMPERATURE, 1.0, 2.0):
        assert _diffusion(lm, ids, temperature=t, top_k=1, seed=1) == want, t
    outs, _, _ = run_diffusion(lm, [PROMPT], 16, temperature=1e-30, **DIFF)
    assert outs[0].token_ids == run_diffusion(lm, [PROMPT], 16, **DIFF)[0][0].token_ids


@pytest.mark.parametrize("top_p", [0.0, 1e-300])
def test_diffusion_top_p_zero_commits_the_top_tokens_at_once(dlm, top_p):
    """``top_p`` 0 keeps only the most probable token, with probability (confidence) 1 at every position: each
    block's first step commits every masked position, its argmax — greedy with one step per block."""
    lm, ids = dlm
    assert _diffusion(lm, ids, temperature=1.0, top_p=top_p, seed=2) == _diffusion(lm, ids, steps=1)


def test_diffusion_top_k_draws_among_the_k_most_probable(dlm, monkeypatch):
    lm, ids = dlm
    calls, real = [], diffusion.choose

    def spy(logits, *sampling):  # every step's logits [B, V] and chosen tokens [B], and its top_k
        tok, conf = real(logits, *sampling)
        calls.append((logits.float().clone(), tok.clone(), sampling[3]))
        return tok, conf

    monkeypatch.setattr(diffusion, "choose", spy)
    plain_outside = False
    for s in range(3):
        calls.clear()
        got = _diffusion(lm, ids, temperature=2.0, top_k=3, seed=s)
        assert calls and all(k == 3 for _, _, k in calls)
        for logits, tok, _ in calls:
            top = logits.topk(3, dim=-1).indices
            assert all(int(t) in top[i].tolist() for i, t in enumerate(tok))
        assert got == _diffusion(lm, ids, temperature=2.0, top_k=3, seed=s)  # seeded
        calls.clear()
        _diffusion(lm, ids, temperature=2.0, seed=s)
        plain_outside |= any(int(t) not in lg.topk(3, dim=-1).indices[i].tolist()
                             for lg, tok, _ in calls for i, t in enumerate(tok))
    assert plain_outside


def _gen_json(capsys, model, *extra) -> list[int]:
    assert main(["generate", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", "8", "--quiet",
                 "--device", "cpu", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]


@pytest.mark.parametrize("arch,extra", [("qwen3_moe", []), ("llada2_moe", ["--block-length", "8", "--steps", "4"])])
def test_cli_generate_edges_are_greedy(capsys, tiny_dirs, arch, extra):
    want = _gen_json(capsys, tiny_dirs[arch], *extra)
    assert _gen_json(capsys, tiny_dirs[arch], *extra, "--temperature", "1e-30", "--seed", "1") == want
    assert _gen_json(capsys, tiny_dirs[arch], *extra, "--temperature", "2", "--top-k", "1", "--seed", "1") == want
    if arch == "qwen3_moe":
        assert _gen_json(capsys, tiny_dirs[arch], "--temperature", "2", "--top-p", "0", "--seed", "1") == want


@pytest.mark.parametrize("argv,needle", [
    (["--temperature", "nan"], "argument --temperature: expected a finite number, got 'nan'"),
    (["--temperature", "inf"], "argument --temperature: expected a finite number, got 'inf'"),
    (["--temperature=-inf"], "argument --temperature: expected a finite number, got '-inf'"),
    (["--temperature", "1e999"], "argument --temperature: expected a finite number, got '1e999'"),
    (["--top-p", "nan"], "argument --top-p: expected a finite number, got 'nan'"),
    (["--top-p", "inf"], "argument --top-p: expected a finite number, got 'inf'"),
    (["--temperature", "hot"], "argument --temperature: expected a number, got 'hot'"),
    (["--top-k", "-1"], "argument --top-k: expected a non-negative integer, got -1"),
    (["--top-k", "2.5"], "argument --top-k: expected a non-negative integer, got '2.5'"),
    (["--temperature", "-0.5"], "--temperature must be >= 0 and --top-p in [0, 1], got -0.5 and 1.0"),
    (["--top-p", "1.5"], "--temperature must be >= 0 and --top-p in [0, 1], got 0.0 and 1.5"),
])
def test_cli_bad_sampling_settings_are_one_line_errors(capsys, tiny_dirs, argv, needle):
    try:  # argparse's type errors exit (``moe-offload generate: error: ...``), later checks return 2
        code = main(["generate", "--model", str(tiny_dirs["qwen3_moe"]), "--prompt", "hi", "--quiet", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moe-offload"), err
    assert "error: " in lines[0] and needle in lines[0] and "Traceback" not in err, err
