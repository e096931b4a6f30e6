"""Every tensor of a checkpoint is accounted for (issue 34): an expert id beyond the config's experts, a key that is no
weight of the model, a missing weight are one-line errors naming the tensor, offloaded and --full-load alike (FullLoad
used to give an IndexError traceback or silently random-initialise missing weights); keys transformers ignores
(MTP layers past num_hidden_layers, ``_keys_to_ignore_on_load_unexpected`` patterns, rotary ``inv_freq``) are
ignored as transformers ignores them."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_offload.cli import main
from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.capability import build_meta
from moe_offload.models.checkpoint_keys import ignored_by_transformers
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.models.tiny import make_tiny, tiny_config

E999 = "model.layers.1.mlp.experts.999.down_proj.weight"


def _edit(src, dst, add=None, drop=()):
    """A copy of checkpoint ``src`` with tensors added (``{key: existing key or tensor}``) and keys dropped."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(str(f))
    for k, v in (add or {}).items():
        t[k] = (t[v] if isinstance(v, str) else v).clone()
    for k in drop:
        del t[k]
    save_file(t, str(f), metadata={"format": "pt"})
    return dst


def _both_refuse(d, needle):
    with pytest.raises(MoeOffloadError, match=needle):
        load_offloaded(d, device="cpu", residency=0.5, progress=False)
    with pytest.raises(MoeOffloadError, match=needle):
        load_full(d, device="cpu")


def _cli_error(capsys, d, *extra):
    code = main(["generate", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "2", "--quiet", *extra])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moe-offload: error: "), lines
    return lines[0]


@pytest.mark.parametrize("extra", [("--residency", "0.5"), ("--full-load",)], ids=["offloaded", "full-load"])
def test_expert_beyond_the_config_is_one_line_cli_error(tiny_dirs, tmp_path, capsys, extra):
    d = _edit(tiny_dirs["qwen3_moe"], tmp_path / "m", add={E999: "model.layers.1.mlp.experts.0.down_proj.weight"})
    line = _cli_error(capsys, d, *extra)
    assert f"checkpoint tensor {E999} is expert 999" in line and "16 experts per MoE layer (ids 0-15)" in line


def test_expert_beyond_the_config_through_the_loader(tiny_dirs, tmp_path):
    d = _edit(tiny_dirs["qwen3_moe"], tmp_path / "m", add={E999: "model.layers.1.mlp.experts.0.down_proj.weight"})
    _both_refuse(d, f"checkpoint tensor {E999} is expert 999, but the model built from config.json has 16 experts")


def test_fused_experts_of_another_count(tiny_dirs, tmp_path):
    """gpt-oss stores its experts fused ``[E, ...]``: a tensor of E + 1 rows is not read past the config's E."""
    key = "model.layers.0.mlp.experts.down_proj"
    t = load_file(str(tiny_dirs["gpt_oss"] / "model.safetensors"))[key]
    d = _edit(tiny_dirs["gpt_oss"], tmp_path / "m", add={key: torch.cat([t, t[:1]])})
    _both_refuse(d, rf"checkpoint tensor {key} \[{t.shape[0] + 1}, .* holds {t.shape[0] + 1} experts, the model built"
                    rf" from config.json has {t.shape[0]} per MoE layer")


def test_unknown_key(tiny_dirs, tmp_path, capsys):
    key = "model.layers.0.self_attn.q_norm_extra.weight"
    d = _edit(tiny_dirs["qwen3_moe"], tmp_path / "m", add={key: "model.layers.0.self_attn.q_norm.weight"})
    _both_refuse(d, f"checkpoint tensor {key} is not a weight of Qwen3MoeForCausalLM built from config.json")
    assert key in _cli_error(capsys, d, "--full-load")


def test_experts_in_a_dense_layer_are_unknown(tmp_path):
    """Expert keys for a layer the config makes dense (mlp_only_layers) are not the model's."""
    src = make_tiny("qwen3_moe", tmp_path / "src", config_overrides=dict(mlp_only_layers=[0]))
    key = "model.layers.0.mlp.experts.0.up_proj.weight"
    d = _edit(src, tmp_path / "m", add={key: "model.layers.1.mlp.experts.0.up_proj.weight"})
    _both_refuse(d, f"checkpoint tensor {key} is not a weight of Qwen3MoeForCausalLM")


@pytest.mark.parametrize("key,needle", [
    ("model.layers.0.self_attn.q_proj.weight", "checkpoint lacks 1 weights, e.g. model.layers.0.self_attn.q_proj"),
    ("model.layers.2.mlp.experts.5.up_proj.weight", "MoE layer 2 expert 5 gate_up_proj"),
])
def test_missing_weight(tiny_dirs, tmp_path, key, needle):
    """FullLoad used to initialise a missing weight at random and generate."""
    d = _edit(tiny_dirs["qwen3_moe"], tmp_path / "m", drop=[key])
    _both_refuse(d, needle)


def test_keys_transformers_ignores_are_ignored(tiny_dirs, tmp_path):
    """Old rotary ``inv_freq`` buffers, an MTP layer past num_hidden_layers: loaded as transformers loads them, the
    same tokens as the clean checkpoint."""
    src = tiny_dirs["qwen3_moe"]
    d = _edit(src, tmp_path / "m", add={
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
        "model.rotary_emb.inv_freq": torch.ones(8),
        "model.layers.3.mlp.experts.0.up_proj.weight": "model.layers.2.mlp.experts.0.up_proj.weight",
        "model.layers.3.eh_proj.weight": torch.zeros(4, 4)})
    torch.set_num_threads(1)
    clean = load_full(src, device="cpu")
    ids = encode_prompt(clean.tokenizer, "Hello there, how are you?")
    want = generate_ids(clean, ids, 6)[0]
    assert generate_ids(load_full(d, device="cpu"), ids, 6)[0] == want
    assert generate_ids(load_offloaded(d, device="cpu", residency=0.5, progress=False), ids, 6)[0] == want


def test_ignore_patterns_of_the_model_class():
    """``_keys_to_ignore_on_load_unexpected`` (e.g. Qwen3-Next's ``^mtp.*``) is honoured, nothing more."""
    model = build_meta(tiny_config("qwen3_moe")[1])
    assert not ignored_by_transformers(model, "mtp.fc.weight", "mtp.fc.weight")
    model._keys_to_ignore_on_load_unexpected = {r"^mtp.*"}
    assert ignored_by_transformers(model, "mtp.fc.weight", "mtp.fc.weight")
    assert not ignored_by_transformers(model, "model.mtp.fc.weight", "model.mtp.fc.weight")
    assert ignored_by_transformers(model, "model.layers.3.x.weight", "model.layers.3.x.weight")  # past 3 layers
    assert not ignored_by_transformers(model, "model.layers.2.x.weight", "model.layers.2.x.weight")
