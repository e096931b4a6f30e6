"""The architecture sweep (issue 16): every MoE model type of the installed transformers, found by scanning its
modeling files for ``@use_experts_implementation`` (``architectures.verify.sweep_types``), gets a tiny random checkpoint
from a generic shrink of its default configuration; served ones must give the offloaded greedy tokens of FullLoad at
residency 0.3 (with misses), one intra-op thread, and a routing trace; the others must be refused (or fail to build
tiny) with a one-line reason. The statuses must equal the record behind ``moe-offload models`` and
docs/architectures.md (data/architectures.json), so that table cannot drift from what the code does."""

import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moe_offload.cli import main
from moe_offload.generation.generate import encode_prompt, generate_ids, run
from moe_offload.models.capability import experts_modules, inspect_model, text_config
from moe_offload.models.loader import load_full, load_offloaded
from moe_offload.architectures.supported import load_record
from moe_offload.models.tiny import make_tiny, tiny_config
from moe_offload.architectures.verify import PROMPTS, TypeResult, families, sweep_types, verify

TYPES = sweep_types()
_REC = load_record()
RECORDED = {r["model_type"]: r for r in _REC["types"]} \
    if _REC and _REC["transformers"] == transformers.__version__ else {}
#: the SeqMoE paper's families (Qwen3-30B-A3B, Qwen3.5/3.6-35B-A3B, GPT-OSS, DeepSeek-V4-Flash) and TIDE's LLaDA2
PAPER_TYPES = ["qwen3_moe", "qwen3_5_moe", "gpt_oss", "deepseek_v4", "llada2_moe"]


@pytest.mark.parametrize("family,model_type", TYPES, ids=[t for _, t in TYPES])
def test_model_type(family, model_type, tmp_path_factory):
    res = verify(model_type, tmp_path_factory.mktemp("sweep"), family=family)
    assert res.status != "failed", res.reason
    if res.status == "served":
        assert res.misses > 0 and not res.reason
    else:
        assert res.reason and "\n" not in res.reason
    expected = RECORDED.get(model_type)
    if expected is not None and expected["status"] == "untested":  # e.g. an optional dependency was missing
        assert res.status in ("untested", "served"), res.reason
    elif expected is not None:  # the record (moe-offload models, docs/architectures.md) says the same
        assert (res.status, res.reason) == (expected["status"], expected["reason"])


def test_sweep_covers_every_family_and_the_record_counts():
    assert {f for f, _ in TYPES} >= set(families()) and len(families()) >= 60
    assert RECORDED, "data/architectures.json is missing or for another transformers version"
    assert set(RECORDED) == {t for _, t in TYPES}
    served = [t for t, r in RECORDED.items() if r["status"] == "served"]
    assert len(served) >= 55 and set(PAPER_TYPES) <= set(served)
    names = {f.name for f in fields(TypeResult)}
    assert all(set(r) == names for r in RECORDED.values())


def _dummy_checkpoint(d, config_json: dict):
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_json))
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("model_type", [t for t, r in RECORDED.items() if r["status"] == "refused"])
def test_refused_types_get_their_reason_on_one_line(model_type, tmp_path, capsys):
    """A checkpoint of a refused model type gets its reason as the CLI's one-line error (exit 2)."""
    cfg = transformers.CONFIG_MAPPING[model_type]().to_dict()
    d = _dummy_checkpoint(tmp_path / "m", cfg)
    assert main(["generate", "--model", str(d), "--prompt", "hi", "--quiet"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("moe-offload: error: ")
    assert RECORDED[model_type]["reason"].split(":")[-1].strip()[:40] in err[0]


def test_remote_code_and_unknown_types_are_refused(tmp_path, capsys):
    d = _dummy_checkpoint(tmp_path / "remote", {"model_type": "acme_moe", "auto_map": {
        "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}})
    assert main(["generate", "--model", str(d), "--prompt", "hi"]) == 2
    assert "needs remote code (config.json auto_map), which moe-offload does not run" in capsys.readouterr().err
    d = _dummy_checkpoint(tmp_path / "unknown", {"model_type": "acme_moe"})
    assert main(["generate", "--model", str(d), "--prompt", "hi"]) == 2
    assert "'acme_moe' is not known to the installed transformers" in capsys.readouterr().err


def _lossless(d, residency=0.3):
    torch.set_num_threads(1)
    full = load_full(d, device="cpu")
    ref = [generate_ids(full, encode_prompt(full.tokenizer, p), 8)[0] for p in PROMPTS]
    lm = load_offloaded(d, device="cpu", residency=residency, progress=False)
    outs, stats = run(lm, PROMPTS, 8)
    assert [o.token_ids for o in outs] == ref and stats.offload.misses > 0
    return lm


def test_dense_and_moe_layers_mixed(tmp_path):
    """decoder_sparse_step and mlp_only_layers: the MoE layers and the dense ones are read from the built model."""
    d = make_tiny("qwen2_moe", tmp_path / "q", config_overrides=dict(num_hidden_layers=6, decoder_sparse_step=2,
                                                                     mlp_only_layers=[3]))
    lm = _lossless(d)
    _, _, geo = inspect_model(lm.model.config)
    assert geo.moe_layers == (1, 5) and geo.dense_layers == (0, 2, 3, 4) and lm.num_moe_layers == 2


def test_checkpoint_extras_are_ignored(tmp_path):
    """An MTP layer past num_hidden_layers (DeepSeek-V3's layer 61: experts, norms, projections) is not loaded."""
    d = make_tiny("deepseek_v3", tmp_path / "ds")
    sd = load_file(str(d / "model.safetensors"))
    n = text_config(tiny_config("deepseek_v3")[1]).num_hidden_layers
    last = f"model.layers.{n - 1}."
    extra = {k.replace(last, f"model.layers.{n}."): v.clone() for k, v in sd.items() if k.startswith(last)}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    assert any(".experts.0." in k for k in extra)
    save_file(extra, str(d / "mtp.safetensors"))
    _lossless(d)


def test_routes_per_row_are_observed_as_the_routers_routing(tmp_path):
    """Ergo's experts call gets one route per row ([T * k, 1], unit weights, runtime.route_rows): observers still see
    the router's [T, k] indices and weights, so the trace has one row per token and the simulator's replay of it
    counts the runtime's hits and misses exactly."""
    from moe_offload.runtime.route_rows import routes_per_row
    from moe_offload.sim.simulator import replay
    from moe_offload.trace.collect import TraceRecorder

    d = make_tiny("ergo", tmp_path / "ergo")
    _lossless(d)
    lm = load_offloaded(d, device="cpu", residency=0.3, progress=False)
    assert all(routes_per_row(m) for _, m in experts_modules(lm.model))
    with TraceRecorder(lm) as rec:
        outs, stats = run(lm, PROMPTS, 6, recorder=rec)
        tr = rec.trace()
    rows = sum(len(encode_prompt(lm.tokenizer, p)) + 5 for p in PROMPTS)
    assert tr.expert_ids.shape == (rows, lm.num_moe_layers, lm.top_k) == (rows, 3, 4)
    scale = text_config(lm.model.config).moe_routed_scaling_factor  # Ergo's weights: normalised top-k times this
    assert np.allclose(tr.expert_weights.astype(np.float32).sum(-1), scale, rtol=2e-3)
    assert all(len(set(r)) == 4 for r in tr.expert_ids.reshape(-1, 4).tolist())
    sim = replay(tr, lm.engine.pool.num_slots, "lru")
    assert (sim.hits, sim.misses) == (stats.offload.hits, stats.offload.misses) and sim.misses > 0


def test_setup_pins_the_recorded_transformers():
    """scripts/setup.sh installs the transformers the sweep's record was made with (scripts/constraints.txt)."""
    pins = (Path(__file__).parents[1] / "scripts" / "constraints.txt").read_text()
    assert f"transformers=={_REC['transformers']}" in pins.split()


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "deepseek_v4"])
def test_research_commands_on_new_families(model_type, tmp_path, capsys):
    """trace collect -> simulate (runtime hits == simulator hits) -> predictor train -> generate with it, bench
    decode, serve's memory plan: unchanged on a hybrid multimodal (Qwen3.5-MoE) and on DeepSeek-V4."""
    from moe_offload.serve.server import ServeConfig, load_for_serving
    from moe_offload.sim.simulator import replay
    from moe_offload.trace.collect import TraceRecorder
    from moe_offload.trace.format import load_trace

    d = make_tiny(model_type, tmp_path / "m")
    t = tmp_path / "t.trace"
    assert main(["trace", "collect", "--model", str(d), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                 "--max-new-tokens", "6", "--out", str(t), "--quiet"]) == 0
    lm = load_offloaded(d, device="cpu", residency=0.3, progress=False)
    with TraceRecorder(lm) as rec:
        _, stats = run(lm, PROMPTS, 6, recorder=rec)
        tr = rec.trace()
    sim = replay(tr, lm.engine.pool.num_slots, "lru")
    assert (sim.hits, sim.misses) == (stats.offload.hits, stats.offload.misses) and sim.misses > 0
    assert load_trace(t).expert_ids.shape[1:] == (lm.num_moe_layers, lm.top_k)
    assert main(["simulate", "--trace", str(t), "--policy", "lru,belady", "--residency", "0.3",
                 "--out", str(tmp_path / "sim")]) == 0
    assert main(["predictor", "train", "--traces", str(t), "--out", str(tmp_path / "p"), "--epochs", "1",
                 "--ss-epochs", "0", "--hidden-size", "16", "--test-fraction", "0.5", "--quiet"]) == 0
    assert main(["generate", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "3", "--quiet",
                 "--predictor", str(tmp_path / "p"), "--policy", "seqmoe", "--residency", "0.3"]) == 0
    assert main(["bench", "decode", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "3", "--quiet",
                 "--residencies", "1.0,0.3"]) == 0
    capsys.readouterr()
    state = load_for_serving(ServeConfig(d, memory_budget_gb=0.05, max_context=128), log=lambda m: None)
    assert state.plan.slots >= lm.top_k and state.lm.engine.pool.num_slots == state.plan.slots


def test_models_command(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# recorded sweep (transformers ")
    assert "78 served, tested lossless" in out and "67 of 72 served" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("openai_privacy_filter "))
    assert "refused" in row and "token-classification" in row
    assert main(["models", "--type", "qwen3_moe", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| `qwen3_moe` | qwen3_moe | served, tested lossless |" in out and "1 model types" in out
    assert main(["models", "--all"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dbrx "))
    assert "refused" in row and "declares no experts through ExpertsInterface" in row
    assert main(["models", "--record", "x.json"]) == 2
    assert "--record needs --verify" in capsys.readouterr().err
    assert main(["models", "--type", "no_such_type"]) == 2
    assert "no model type of the sweep matches no_such_type" in capsys.readouterr().err


def test_converted_experts_need_a_private_host_store(tmp_path):
    """Qwen3-VL-MoE's fused experts are stored transposed: converted per expert into the pinned store; the mmap store
    (the checkpoint's own bytes) cannot hold them and says so on one line."""
    from moe_offload.errors import MoeOffloadError

    d = make_tiny("qwen3_vl_moe", tmp_path / "vl")
    with pytest.raises(MoeOffloadError, match="converted from the checkpoint's layout .*Transpose.* --host-store "
                                              "pinned"):
        load_offloaded(d, device="cpu", host_store="mmap", progress=False)
    lm = _lossless(d)
    assert lm.multimodal


def test_models_config_checks_a_config_json_alone(tmp_path, capsys):
    """Before downloading the weights: the real-size model is built on the meta device from config.json alone."""
    cfg = transformers.CONFIG_MAPPING["qwen3_moe"](num_hidden_layers=4, hidden_size=256, moe_intermediate_size=64,
                                                   num_local_experts=8, num_experts_per_tok=2, vocab_size=1000,
                                                   mlp_only_layers=[0], dtype="bfloat16")
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    assert main(["models", "--config", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("qwen3_moe (Qwen3Moe): served, tested lossless")
    assert out[1] == "  decoder layers 4: 3 MoE layers; dense layers: 0"
    per_expert_mb = 3 * 64 * 256 * 2 / 1e6  # gate;up [2I, H] + down [H, I], bfloat16
    assert f"8 per MoE layer, top-2; 24 in all, about {per_expert_mb:,.1f} MB each (bfloat16)" in out[2]
    llama = transformers.CONFIG_MAPPING["llama"](num_hidden_layers=1)
    (tmp_path / "llama.json").write_text(llama.to_json_string())
    assert main(["models", "--config", str(tmp_path / "llama.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama declares no experts through transformers' ExpertsInterface" in err[0]
