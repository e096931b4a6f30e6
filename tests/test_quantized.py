"""Published checkpoint layouts: FP8 block quantization (Qwen3-30B-A3B-FP8, DeepSeek-V3), gpt-oss MXFP4 and a bf16
checkpoint sharded through a layer's experts. Experts stay in their native precision in the host store and the
slots; the oracle is transformers' own dequantizing ``from_pretrained`` of the same directory (greedy, one thread)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import experts_modules, load_full, load_offloaded
from moe_offload.models.tiny import make_tiny
from moe_offload.models.tiny_quantized import reshard, write_fp8, write_mxfp4
from moe_offload.runtime.formats import ExpertRows

PROMPT = "Hello there, how are you today? The slot pool is shared by all MoE layers."
NEW = 12
SHARED_CASE = Path(__file__).resolve().parents[2] / "shared" / "cases" / "qwen3-moe-fp8-tiny"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {
        "qwen3-fp8": write_fp8(make_tiny("qwen3_moe", root / "q3"), root / "q3-fp8", block=(32, 32)),
        "deepseek-v3-fp8": write_fp8(make_tiny("deepseek_v3", root / "ds"), root / "ds-fp8", block=(8, 16),
                                     scale_dtype=torch.float32, mtp_layer=True),
        "gpt-oss-mxfp4": write_mxfp4(make_tiny("gpt_oss", root / "go"), root / "go-mxfp4"),
        "mixtral-bf16-sharded": reshard(make_tiny("mixtral", root / "mx", dtype=torch.bfloat16), root / "mx-sh"),
    }


@pytest.fixture(scope="module")
def references(layouts):
    torch.set_num_threads(1)
    out = {}
    for name, d in layouts.items():
        full = load_full(d, device="cpu")
        out[name] = generate_ids(full, encode_prompt(full.tokenizer, PROMPT), NEW)[0], full
    return out


def _stored_bytes(d: Path) -> int:
    """Bytes of MoE layer 1 expert 0 in the checkpoint (all its tensors, scales included; fused rows counted)."""
    total = 0
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if ".layers.1.mlp.experts." not in k and ".layers.1.block_sparse_moe.experts." not in k:
                    continue
                t = h.get_tensor(k)
                if ".experts.0." in k:
                    total += t.numel() * t.element_size()
                elif ".experts." in k and not any(f".experts.{i}." in k for i in range(1, 64)):  # fused [E, ...]
                    total += t[0].numel() * t.element_size()
    return total


@pytest.mark.parametrize("name", ["qwen3-fp8", "deepseek-v3-fp8", "gpt-oss-mxfp4", "mixtral-bf16-sharded"])
@pytest.mark.parametrize("host_store", ["pinned", "mmap", "disk"])
def test_tokens_equal_transformers_with_misses(layouts, references, name, host_store):
    ref, full = references[name]
    lm = load_offloaded(layouts[name], device="cpu", residency=0.3, progress=False, host_store=host_store)
    got = generate_ids(lm, encode_prompt(lm.tokenizer, PROMPT), NEW)[0]
    assert got == ref and len(set(ref)) > 1
    st = lm.engine.stats
    assert st.misses > 0 and st.bytes_loaded == st.misses * lm.expert_bytes
    assert lm.host_store == host_store
    assert lm.engine.store.nbytes == (0 if host_store in ("mmap", "disk") else lm.num_moe_layers * lm.num_experts
                                      * lm.expert_bytes)
    # bytes per expert are the checkpoint's own (native precision), padded to 16-byte field alignment
    native = _stored_bytes(layouts[name])
    n_fields = len(lm.engine.pool.format.layout.fields)
    assert native <= lm.expert_bytes < native + 16 * n_fields
    if name != "mixtral-bf16-sharded":
        assert lm.expert_bytes < 0.6 * full.expert_bytes  # FP8 ~1/2, MXFP4 ~1/4 of the dequantized expert


@pytest.mark.parametrize("name", ["qwen3-fp8", "deepseek-v3-fp8", "gpt-oss-mxfp4"])
def test_dequantized_experts_bitwise_equal_transformers(layouts, references, name):
    """Every expert decoded from the host store equals the parameter transformers' loader dequantized."""
    _, full = references[name]
    lm = load_offloaded(layouts[name], device="cpu", residency=0.3, progress=False)
    rows = ExpertRows(lm.engine.pool.format, lm.engine.store.buf)
    E = lm.num_experts
    for layer, (_, mod) in enumerate(experts_modules(full.model)):
        for pname in lm.engine.pool.format.params:
            got = rows.weight(pname, slice(layer * E, (layer + 1) * E))
            assert got.dtype == getattr(mod, pname).dtype
            assert torch.equal(got, getattr(mod, pname)), (layer, pname)
    assert set(lm.expert_dtypes) == ({"bfloat16", "uint8"} if "mxfp4" in name else
                                     {"float8_e4m3fn", "bfloat16" if "qwen" in name else "float32"})


def test_non_expert_fp8_weights_dequantized(layouts, references):
    """Attention, dense-MLP and shared-expert FP8 linears load dequantized exactly as transformers loads them."""
    _, full = references["deepseek-v3-fp8"]
    lm = load_offloaded(layouts["deepseek-v3-fp8"], device="cpu", residency=0.3, progress=False)
    ours = dict(lm.model.named_parameters())
    for n, p in full.model.named_parameters():
        if ".experts." in n and "shared" not in n:
            continue
        assert torch.equal(ours[n], p), n


@pytest.mark.skipif(not SHARED_CASE.is_dir(), reason="shared/cases not laid beside the checkout")
def test_shared_case_qwen3_fp8(tmp_path):
    """The reported failing input: offloaded tokens equal --full-load's."""
    def ids(*extra):
        out = subprocess.run([sys.executable, "-m", "moe_offload.cli", "generate", "--model", str(SHARED_CASE),
                              "--prompt", "Hello there", "--max-new-tokens", "8", "--json", "--quiet", *extra],
                             capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    full, off = ids("--full-load"), ids("--residency", "0.3")
    assert off["outputs"][0]["token_ids"] == full["outputs"][0]["token_ids"]
    assert off["stats"]["misses"] > 0 and "float8_e4m3fn" in off["stats"]["expert_dtypes"]
    assert off["stats"]["host_store"] == "pinned"


def _edit(src: Path, dst: Path, config=None, drop=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop is not None:
        f = dst / "model.safetensors"
        with safe_open(str(f), "pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys() if k != drop}
        save_file(tensors, str(f))
    return dst


def test_unsupported_or_inconsistent_quantization_is_one_line_error(layouts, tmp_path):
    q3 = layouts["qwen3-fp8"]
    cases = [
        (_edit(q3, tmp_path / "gptq", lambda c: c["quantization_config"].update(quant_method="gptq")),
         "quantization 'gptq' is not supported"),
        (_edit(q3, tmp_path / "static", lambda c: c["quantization_config"].update(activation_scheme="static")),
         "activation_scheme 'static' is not supported"),
        (_edit(q3, tmp_path / "noquant", lambda c: c.pop("quantization_config")),
         "float8_e4m3fn but config.json has no fp8 quantization_config"),
        (_edit(q3, tmp_path / "noscale", drop="model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"),
         "is FP8 without its weight_scale_inv"),
        (_edit(q3, tmp_path / "noscale-attn", drop="model.layers.0.self_attn.o_proj.weight_scale_inv"),
         "without its weight_scale_inv"),
        (_edit(layouts["gpt-oss-mxfp4"], tmp_path / "mx-noquant", lambda c: c.pop("quantization_config")),
         "MXFP4"),
    ]
    for d, msg in cases:
        with pytest.raises(MoeOffloadError, match=msg):
            load_offloaded(d, device="cpu", residency=0.3, progress=False)
        out = subprocess.run([sys.executable, "-m", "moe_offload.cli", "generate", "--model", str(d), "--prompt",
                              "hi", "--max-new-tokens", "2", "--residency", "0.3", "--quiet"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and msg.split()[0] in out.stderr
