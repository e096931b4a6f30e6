"""LLaDA2-MoE (models/llada2_moe.py): published config and checkpoint key layout, the router's selection rules
(expert_bias for selection only, group-limited top-k), and lossless offloading of its block-diffusion generation."""

import math

import pytest
import torch
from safetensors import safe_open

from moe_offload.generation.generate import encode_prompt
from moe_offload.generation.diffusion import block_causal_mask, diffusion_generate_ids
from moe_offload.models.llada2_moe import LLaDA2MoeConfig, LLaDA2MoeGate, LLaDA2MoeModelLM
from moe_offload.models.loader import experts_modules, load_full, load_offloaded

PROMPTS = ["Hello there, how are you today?", "The slot pool is shared by all MoE layers. " * 2]

# LLaDA2.0-mini's published config.json (the keys that shape the model)
PUBLISHED = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "dtype": "bfloat16", "first_k_dense_replace": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
    "max_position_embeddings": 16384, "moe_intermediate_size": 512, "moe_router_enable_expert_bias": True,
    "n_group": 8, "norm_head": False, "norm_softmax": False, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 20, "num_key_value_heads": 4,
    "num_shared_experts": 1, "pad_token_id": 156892, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 600000, "rotary_dim": 64, "routed_scaling_factor": 2.5,
    "router_dtype": "fp32", "score_function": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
    "use_bias": False, "use_qkv_bias": False, "use_qk_norm": True, "vocab_size": 157184, "use_cache": False,
}


def published_keys(cfg) -> set[str]:
    """Every checkpoint key of a LLaDA2-MoE checkpoint, per the published layout."""
    keys = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                 p + "attention.query_key_value.weight", p + "attention.dense.weight",
                 p + "attention.query_layernorm.weight", p + "attention.key_layernorm.weight"}
        if i < cfg.first_k_dense_replace:
            keys |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
            continue
        keys |= {p + "mlp.gate.weight", p + "mlp.gate.expert_bias"}
        keys |= {p + f"mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}
        keys |= {p + f"mlp.experts.{e}.{n}_proj.weight" for e in range(cfg.num_experts) for n in ("gate", "up", "down")}
    return keys


def test_tiny_checkpoint_has_the_published_key_names(tiny_dirs):
    d = tiny_dirs["llada2_moe"]
    full = load_full(d, device="cpu")
    cfg = full.model.config
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert keys == published_keys(cfg)
        assert tuple(f.get_slice("model.layers.1.attention.query_key_value.weight").get_shape()) == (
            (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.hidden_size)
        assert tuple(f.get_slice("model.layers.2.mlp.experts.5.gate_proj.weight").get_shape()) == (32, 64)
        assert tuple(f.get_slice("model.layers.2.mlp.experts.5.down_proj.weight").get_shape()) == (64, 32)
    assert cfg.model_type == "llada2_moe" and cfg.architectures == ["LLaDA2MoeModelLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.num_experts) == (64, 3, 1, 16)
    assert (cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.num_shared_experts) == (4, 4, 2, 1)
    assert full.top_k == 4 and full.num_moe_layers == 2
    assert cfg.mask_token_id == full.tokenizer.mask_token_id < cfg.vocab_size == len(full.tokenizer)
    # the loaded model holds the experts fused; expert 5 of the first MoE layer is gate;up of the checkpoint
    mod = experts_modules(full.model)[0][1]
    assert tuple(mod.gate_up_proj.shape) == (16, 64, 64) and tuple(mod.down_proj.shape) == (16, 64, 32)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        gate, up = f.get_tensor("model.layers.1.mlp.experts.5.gate_proj.weight"), f.get_tensor(
            "model.layers.1.mlp.experts.5.up_proj.weight")
        assert torch.equal(mod.gate_up_proj[5], torch.cat([gate, up]))
        assert torch.any(f.get_tensor("model.layers.1.mlp.gate.expert_bias") != 0)  # a random bias: loading matters


def test_save_pretrained_round_trip(tiny_dirs, tmp_path):
    """save_pretrained of a loaded model writes the per-expert layout again (transformers' reversed conversion),
    and the config keeps the published top-level rope keys."""
    full = load_full(tiny_dirs["llada2_moe"], device="cpu")
    full.model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == published_keys(full.model.config)
    import json

    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == 600000.0 and saved["partial_rotary_factor"] == 0.5
    again = load_full(tmp_path, device="cpu")
    ids = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, full.model(ids).logits)


def test_published_config_builds_the_published_shapes():
    cfg = LLaDA2MoeConfig(**{k: v for k, v in PUBLISHED.items() if k != "model_type"})
    assert cfg.rope_parameters["rope_theta"] == 600000 and cfg.rope_parameters["partial_rotary_factor"] == 0.5
    assert (cfg.mask_token_id, cfg.eos_token_id) == (156895, 156892)
    with torch.device("meta"):
        model = LLaDA2MoeModelLM(cfg)
    sd = model.state_dict()
    assert tuple(sd["model.layers.1.attention.query_key_value.weight"].shape) == ((16 + 2 * 4) * 128, 2048)
    assert tuple(sd["model.layers.1.attention.dense.weight"].shape) == (2048, 2048)
    assert tuple(sd["model.layers.1.mlp.experts.gate_up_proj"].shape) == (256, 1024, 2048)
    assert tuple(sd["model.layers.1.mlp.experts.down_proj"].shape) == (256, 2048, 512)
    assert tuple(sd["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape) == (512, 2048)
    assert tuple(sd["model.layers.0.mlp.gate_proj.weight"].shape) == (5120, 2048)
    assert tuple(sd["model.layers.19.mlp.gate.expert_bias"].shape) == (256,)
    assert sd["model.layers.19.mlp.gate.expert_bias"].dtype == torch.float32
    assert model.model.rotary_emb.inv_freq.shape == (32,)  # rotary on the first 64 of 128 channels
    assert len(experts_modules(model)) == 19


def _gate(scores: list[float], bias: list[float] | None = None, top_k=2, n_group=4, topk_group=2):
    """A router whose logits for a one-hot hidden state are logit(scores): the sigmoid scores are ``scores``."""
    e = len(scores)
    cfg = LLaDA2MoeConfig(hidden_size=e, num_attention_heads=1, num_key_value_heads=1, num_experts=e,
                          num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    gate = LLaDA2MoeGate(cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.diag(torch.tensor([math.log(s / (1 - s)) for s in scores])))
        if bias is not None:
            gate.expert_bias.copy_(torch.tensor(bias))
    _, w, idx = gate(torch.ones(1, e))
    order = idx[0].argsort()
    return idx[0][order].tolist(), w[0][order]


# sigmoid scores of 8 experts in 4 groups of 2: group top-2 sums 1.0, 1.5, 1.1, 1.05
SCORES = [0.9, 0.1, 0.8, 0.7, 0.6, 0.5, 0.2, 0.85]


def test_group_limited_top_k_by_hand():
    # groups 1 and 2 win (1.5, 1.1): experts 0 (0.9) and 7 (0.85) score higher than 3 (0.7) but their groups lose
    idx, w = _gate(SCORES)
    assert idx == [2, 3]
    assert torch.allclose(w, torch.tensor([0.8, 0.7]) / 1.5 * 2.5)
    # without group limiting (one group) the best two overall are chosen
    idx, w = _gate(SCORES, n_group=1, topk_group=1)
    assert idx == [0, 7]
    assert torch.allclose(w, torch.tensor([0.9, 0.85]) / 1.75 * 2.5)


def test_expert_bias_changes_selection_not_weights():
    # +0.5 on expert 7: group 3's biased sum 0.2 + 1.35 = 1.55 now beats group 2; experts 7 and 2 win
    idx, w = _gate(SCORES, bias=[0, 0, 0, 0, 0, 0, 0, 0.5])
    assert idx == [2, 7]
    assert torch.allclose(w, torch.tensor([0.8, 0.85]) / 1.65 * 2.5)  # unbiased scores, renormalised, scaled
    # a bias that leaves the selection alone leaves the weights alone
    same_idx, same_w = _gate(SCORES, bias=[0.3] * 8)
    base_idx, base_w = _gate(SCORES)
    assert same_idx == base_idx and torch.equal(same_w, base_w)


def test_non_causal_attention_and_block_mask(tiny_dirs):
    """Without a mask every position sees every token (a later token changes earlier logits); with the block-causal
    mask an edit in a later block leaves earlier blocks' logits unchanged but changes its own block's."""
    m = load_full(tiny_dirs["llada2_moe"], device="cpu").model
    ids = torch.tensor([list(range(10, 22))])
    edit = ids.clone()
    edit[0, 9] = 100  # position 9: block 2 of blocks of 4
    mask = block_causal_mask(12, 4)[None, None]
    with torch.no_grad():
        a, b = m(ids).logits, m(edit).logits
        assert not torch.allclose(a[0, :4], b[0, :4])
        a, b = m(ids, attention_mask=mask).logits, m(edit, attention_mask=mask).logits
    # (equal up to float rounding: the experts' GEMMs batch a different set of tokens)
    assert torch.allclose(a[0, :8], b[0, :8], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[0, 8:], b[0, 8:], rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    full = load_full(tiny_dirs["llada2_moe"], device="cpu")
    toks = [diffusion_generate_ids(full, encode_prompt(full.tokenizer, p), 20, block_length=8, steps=4).token_ids
            for p in PROMPTS]
    ids = torch.tensor([encode_prompt(full.tokenizer, PROMPTS[1])[:40]])
    with torch.no_grad():
        logits = full.model(ids, attention_mask=block_causal_mask(ids.shape[1], 8)[None, None]).logits
    return toks, ids, logits


@pytest.mark.parametrize("size", [dict(residency=0.3), dict(residency=0.6), dict(slots="top_k")])
def test_offloaded_diffusion_equals_full_load(tiny_dirs, reference, size):
    if size.get("slots") == "top_k":
        size = dict(slots=4)  # top-k
    toks, ids, logits = reference
    lm = load_offloaded(tiny_dirs["llada2_moe"], device="cpu", policy="lru", progress=False, **size)
    got = [diffusion_generate_ids(lm, encode_prompt(lm.tokenizer, p), 20, block_length=8, steps=4).token_ids
           for p in PROMPTS]
    assert got == toks
    assert all(len(t) == 20 and len(set(t)) > 1 for t in got)  # the text varies, so routing varies
    with torch.no_grad():
        out = lm.model(ids, attention_mask=block_causal_mask(ids.shape[1], 8)[None, None]).logits
    assert torch.allclose(out, logits, rtol=1e-5, atol=1e-5)
    st = lm.engine.stats
    assert st.misses > 0 and st.layer_calls > 0
    if "slots" in size:  # more distinct experts per layer than slots: the layer runs in rounds
        assert st.rounds > st.layer_calls


def test_eager_attention_equals_sdpa(tiny_dirs):
    """The additive block mask means the same to transformers' eager and SDPA attention."""
    m = load_full(tiny_dirs["llada2_moe"], device="cpu").model
    ids = torch.tensor([list(range(10, 30))])
    mask = block_causal_mask(20, 8)[None, None]
    with torch.no_grad():
        sdpa = m(ids, attention_mask=mask).logits
        m.set_attn_implementation("eager")
        eager = m(ids, attention_mask=mask).logits
    assert m.config._attn_implementation == "eager"
    assert torch.allclose(sdpa, eager, rtol=1e-4, atol=1e-4)


def test_config_rejects_inconsistent_geometry():
    from huggingface_hub.errors import StrictDataclassClassValidationError

    for bad in (dict(num_experts=10), dict(topk_group=9), dict(score_function="relu"), dict(norm_head=True)):
        with pytest.raises(StrictDataclassClassValidationError):
            LLaDA2MoeConfig(**bad)
