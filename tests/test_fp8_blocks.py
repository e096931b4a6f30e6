"""Block-FP8 dequantized in the config's ``weight_block_size`` blocks, a partial ("ragged") last block included
(issue 34): a weight dimension that is not a multiple of the block, offloaded and FullLoad alike.

The oracle is independent of the loader and of transformers: each dense weight the checkpoint was quantized from is
quantized and dequantized here, block by block with explicit slices (scale = block amax / 448 in the scale dtype,
code = float8(weight / scale), value = float32(code) * float32(scale), cast to the compute dtype)."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import experts_modules, load_full, load_offloaded
from moe_offload.models.tiny import make_tiny
from moe_offload.models.tiny_quantized import write_fp8
from moe_offload.runtime.formats import ExpertRows, dequantize_fp8

PROMPT = "Hello there, how are you today? The slot pool is shared by all MoE layers."
NEW = 10


def oracle(w: torch.Tensor, block, scale_dtype, dtype) -> torch.Tensor:
    """``w [rows, cols]`` quantized to FP8 e4m3 in ``block`` blocks (the last ones partial) and dequantized."""
    bm, bn = block
    rows, cols = w.shape
    w = w.float()
    out = torch.empty(rows, cols, dtype=dtype)
    for i in range(0, rows, bm):
        for j in range(0, cols, bn):
            blk = w[i:i + bm, j:j + bn]
            scale = (blk.abs().max() / 448.0).clamp(min=1e-8).to(scale_dtype).float()
            codes = (blk / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            out[i:i + bm, j:j + bn] = (codes.float() * scale).to(dtype)
    return out


# (name, config overrides, weight_block_size, scale dtype): I = moe_intermediate_size, H = hidden_size
CASES = [
    ("I40-32x32-bf16", dict(moe_intermediate_size=40), (32, 32), torch.bfloat16),
    ("I40-48x48-f32", dict(moe_intermediate_size=40), (48, 48), torch.float32),
    ("I40-16x32-bf16", dict(moe_intermediate_size=40), (16, 32), torch.bfloat16),
    ("I40-16x32-f32", dict(moe_intermediate_size=40), (16, 32), torch.float32),
    ("H40-I40-32x32-f32", dict(moe_intermediate_size=40, hidden_size=40), (32, 32), torch.float32),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def ragged(request, tmp_path_factory):
    """A tiny qwen3_moe written dense (float32), as FP8 with ragged blocks, and as a bf16 checkpoint holding the
    oracle's dequantized weights; the FP8 checkpoint loaded FullLoad and offloaded (30% residency)."""
    name, overrides, block, scale_dtype = request.param
    root = tmp_path_factory.mktemp(name)
    dense = make_tiny("qwen3_moe", root / "dense", config_overrides=overrides)
    fp8 = write_fp8(dense, root / "fp8", block=block, scale_dtype=scale_dtype)
    cfg = json.loads((dense / "config.json").read_text())
    assert cfg["moe_intermediate_size"] % block[0] or cfg["moe_intermediate_size"] % block[1]
    dense_w, stored = load_file(str(dense / "model.safetensors")), load_file(str(fp8 / "model.safetensors"))
    quantized = sorted(k for k in stored if k + "_scale_inv" in stored)
    expect = {k: oracle(dense_w[k], block, scale_dtype, torch.bfloat16) for k in quantized}
    # the same model with the oracle's weights, unquantized (bf16): FullLoad of it is the token reference
    ref_dir = root / "oracle-bf16"
    ref_dir.mkdir()
    for f in dense.iterdir():
        if f.suffix != ".safetensors":
            (ref_dir / f.name).write_bytes(f.read_bytes())
    save_file({k: expect.get(k, t.to(torch.bfloat16)) for k, t in dense_w.items()}, str(ref_dir / "model.safetensors"))
    cfg.update(dtype="bfloat16", torch_dtype="bfloat16")
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    torch.set_num_threads(1)
    return dict(block=block, expect=expect, ref_dir=ref_dir, num_layers=cfg["num_hidden_layers"],
                full=load_full(fp8, device="cpu"),
                off=load_offloaded(fp8, device="cpu", residency=0.3, progress=False))


def _expert_expect(expect: dict, layer: int, E: int, pname: str) -> torch.Tensor:
    """``[E, ...]`` oracle of a qwen3_moe experts parameter (``gate_up_proj`` = gate ; up along rows)."""
    pre = f"model.layers.{layer}.mlp.experts"
    parts = ("gate_proj", "up_proj") if pname == "gate_up_proj" else ("down_proj",)
    return torch.stack([torch.cat([expect[f"{pre}.{e}.{p}.weight"] for p in parts]) for e in range(E)])


def test_dequantized_weights_equal_the_oracle(ragged):
    """(a) Every FP8 weight, expert and non-expert, FullLoad and offloaded, equals the dense weight quantized and
    dequantized in ``weight_block_size`` blocks, bit for bit."""
    expect, full, off = ragged["expect"], ragged["full"], ragged["off"]
    off_params, full_params = dict(off.model.named_parameters()), dict(full.model.named_parameters())
    non_expert = [k for k in expect if ".mlp.experts." not in k]
    assert any("self_attn" in k for k in non_expert)
    for k in non_expert:
        assert torch.equal(full_params[k], expect[k]), k
        assert torch.equal(off_params[k], expect[k]), k
    E = off.num_experts
    rows = ExpertRows(off.engine.pool.format, off.engine.store.buf)
    for layer, (_, mod) in enumerate(experts_modules(full.model)):
        for pname in ("gate_up_proj", "down_proj"):
            want = _expert_expect(expect, layer, E, pname)
            assert torch.equal(getattr(mod, pname), want), (layer, pname)
            assert torch.equal(rows.weight(pname, slice(layer * E, (layer + 1) * E)), want), (layer, pname)


def test_prefill_logits_offloaded_equal_fullload_bit_for_bit(ragged):
    """The offloaded prefill (several rounds at 30% residency, misses) gives FullLoad's logits bit for bit: both run
    the same experts code on the same decoded weights."""
    full, off = ragged["full"], ragged["off"]
    ids = torch.tensor([encode_prompt(full.tokenizer, PROMPT)])
    with torch.no_grad():
        assert torch.equal(full.model(input_ids=ids).logits, off.model(input_ids=ids).logits)


def test_tokens_offloaded_equal_fullload_and_the_oracle_model(ragged):
    """(b) Offloaded tokens (with misses) == FullLoad's == those of the bf16 model holding the oracle's weights."""
    full, off = ragged["full"], ragged["off"]
    ids = encode_prompt(full.tokenizer, PROMPT)
    want = generate_ids(full, ids, NEW)[0]
    got = generate_ids(off, ids, NEW)[0]
    assert got == want and len(set(want)) > 1
    assert off.engine.stats.misses > 0
    ref = load_full(ragged["ref_dir"], device="cpu")
    assert generate_ids(ref, ids, NEW)[0] == want


@pytest.mark.parametrize("shape", [(40, 64), (64, 40), (40, 40), (33, 17), (64, 64), (1, 5)])
@pytest.mark.parametrize("block", [(32, 32), (48, 48), (16, 32), (8, 16)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_matches_the_oracle(shape, block, scale_dtype):
    """``dequantize_fp8`` on its own, batched ``[G, rows, cols]``: every value is code * its block's scale."""
    torch.manual_seed(math.prod(shape) + block[0])
    w = torch.randn(3, *shape) * 0.3
    gr, gc = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    codes, scales = [], []
    for g in range(3):
        s = torch.empty(gr, gc)
        for i in range(gr):
            for j in range(gc):
                s[i, j] = w[g, i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs().max() / 448
        s = s.clamp(min=1e-8).to(scale_dtype)
        full = s.float().repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]
        codes.append((w[g] / full).clamp(-448, 448).to(torch.float8_e4m3fn))
        scales.append(s)
    codes, scales = torch.stack(codes), torch.stack(scales)
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_fp8(codes, scales, dtype, block)
        want = torch.stack([oracle(w[g], block, scale_dtype, dtype) for g in range(3)])
        assert got.shape == (3, *shape) and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, want)
        assert torch.equal(dequantize_fp8(codes[1], scales[1], dtype, block), want[1])


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_whole_blocks_bitwise_transformers(scale_dtype):
    """Shapes of whole blocks: exactly transformers' ``Fp8Dequantize._dequantize_one`` (unchanged arithmetic)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    codes = (torch.randn(4, 64, 96) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = (torch.rand(4, 2, 3) * 1e-2).to(scale_dtype)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_fp8(codes, scales, dtype, (32, 32)),
                           Fp8Dequantize(None)._dequantize_one(codes, scales, output_dtype=dtype))


def test_scale_grid_that_does_not_fit_is_one_line_error(tmp_path):
    """A weight_scale_inv grid that is not ceil(rows/bm) x ceil(cols/bn) is refused at load, naming the tensor."""
    src = make_tiny("qwen3_moe", tmp_path / "dense", config_overrides=dict(moe_intermediate_size=40))
    d = write_fp8(src, tmp_path / "fp8", block=(32, 32))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [16, 32]  # the scales were written for 32x32
    (d / "config.json").write_text(json.dumps(cfg))
    for load in (load_offloaded, load_full):
        with pytest.raises(MoeOffloadError, match=r"weight_block_size \[16, 32\] blocks needs a \(3, 2\)"):
            load(d, device="cpu", **({"progress": False} if load is load_offloaded else {}))


def test_write_fp8_keeps_ragged_shapes(tmp_path):
    """The tiny maker writes ragged FP8: codes of the weight's shape, one scale per (partial) block."""
    src = make_tiny("qwen3_moe", tmp_path / "dense", config_overrides=dict(moe_intermediate_size=40))
    d = write_fp8(src, tmp_path / "fp8", block=(16, 32), scale_dtype=torch.float32)
    t = load_file(str(Path(d) / "model.safetensors"))
    k = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert t[k].shape == (40, 64) and t[k].dtype == torch.float8_e4m3fn
    assert t[k + "_scale_inv"].shape == (3, 2) and t[k + "_scale_inv"].dtype == torch.float32
    k = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert t[k].shape == (64, 40) and t[k + "_scale_inv"].shape == (4, 2)


def test_without_weight_block_size_the_grid_gives_the_block(tmp_path):
    """No weight_block_size in config.json: both paths derive the block from the scale grid (as transformers does),
    not FineGrainedFP8Config's default 128 x 128; a ragged checkpoint is then refused on one line, both paths."""
    def fp8(name, block, **overrides):
        d = write_fp8(make_tiny("qwen3_moe", tmp_path / f"{name}-dense", config_overrides=overrides),
                      tmp_path / name, block=block)
        cfg = json.loads((d / "config.json").read_text())
        del cfg["quantization_config"]["weight_block_size"]
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    torch.set_num_threads(1)
    d = fp8("whole", (32, 32))
    full, off = load_full(d, device="cpu"), load_offloaded(d, device="cpu", residency=0.3, progress=False)
    ids = encode_prompt(full.tokenizer, PROMPT)
    assert generate_ids(off, ids, NEW)[0] == generate_ids(full, ids, NEW)[0]
    d = fp8("ragged", (16, 32), moe_intermediate_size=40)  # 40 rows in a grid of 3
    for load in (load_offloaded, load_full):
        with pytest.raises(MoeOffloadError, match=r"\(40, 64\) is not a whole number of blocks of its \(3, 2\) "
                                                  "weight_scale_inv grid, and config.json has no weight_block_size"):
            load(d, device="cpu", **({"progress": False} if load is load_offloaded else {}))
