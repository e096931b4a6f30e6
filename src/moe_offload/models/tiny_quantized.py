"""Tiny checkpoints in published quantized and sharded on-disk layouts (test fixtures and benchmark inputs).

From a float checkpoint (``models.tiny.make_tiny`` or any Hugging Face directory) write the same weights as they
ship in the wild:

* ``write_fp8``: block-wise FP8 (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size``): every linear weight
  except the routers, embeddings and head becomes ``float8_e4m3fn`` codes plus ``<w>_scale_inv`` per block —
  Qwen3-30B-A3B-FP8's layout (bf16 scales, ``modules_to_not_convert`` naming the routers and ``lm_head``) or
  DeepSeek-V3's (float32 scales; optionally an MTP layer past ``num_hidden_layers`` that loaders must ignore);
* ``write_mxfp4``: gpt-oss's MXFP4 (``quant_method: mxfp4``): fused experts as ``*_blocks [E, rows, cols/32, 16]``
  packed e2m1 pairs and ``*_scales [E, rows, cols/32]`` e8m0 exponents, biases and everything else bf16;
* ``reshard``: the same tensors split across several files with ``model.safetensors.index.json``, cut in the middle
  of a layer's experts.

The quantizers round to nearest; their exact rounding does not matter for the tests, whose oracle is transformers'
own dequantizing ``from_pretrained`` of the written directory.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import MoeOffloadError

FP8_MAX = 448.0
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_NOT_QUANTIZED = re.compile(r"(embed_tokens|lm_head|mlp\.gate\.|mlp\.router\.|norm|bias)")


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype):
    """``w [rows, cols]`` float -> ``(codes [rows, cols] float8_e4m3fn, scale_inv [ceil(rows/bm), ceil(cols/bn)])``
    with ``w ~= codes * scale_inv`` per ``bm x bn`` block (scale = block amax / 448); when ``rows`` or ``cols`` is
    not a multiple of the block, the last block row / column is partial ("ragged")."""
    rows, cols = w.shape
    bm, bn = block
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(gr * bm, gc * bn, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(gr, bm, gc, bn)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-8).to(scale_dtype).float()
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gr * bm, gc * bn)[:rows, :cols]
    return codes.to(torch.float8_e4m3fn), scale.to(scale_dtype)


def quantize_mxfp4(w: torch.Tensor):
    """``w [..., rows, cols]`` float (cols a multiple of 32) -> ``(blocks [..., rows, cols/32, 16] uint8,
    scales [..., rows, cols/32] uint8)``: per 32 values one e8m0 exponent (``scale + 127``) and e2m1 codes, the even
    element in the low nibble."""
    *lead, cols = w.shape
    if cols % 32:
        raise MoeOffloadError(f"MXFP4 needs a multiple of 32 columns, got {cols}")
    g = w.float().reshape(*lead, cols // 32, 32)
    amax = g.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    v = g / torch.exp2(exp)[..., None]
    idx = (v.abs()[..., None] - _E2M1).abs().argmin(dim=-1) + 8 * (v < 0).long()
    packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def _read_all(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _copy_side_files(src: Path, out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise MoeOffloadError(f"{out} already exists and is not empty; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)


def _write_config(out: Path, **extra) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(extra)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def write_fp8(src: str | Path, out: str | Path, *, block: tuple[int, int] = (32, 32),
              scale_dtype: torch.dtype = torch.bfloat16, mtp_layer: bool = False, overwrite: bool = False) -> Path:
    """Write ``src`` (a float checkpoint) block-FP8-quantized to ``out`` (Qwen3-FP8 layout with bf16 scales;
    DeepSeek-V3's with ``scale_dtype=torch.float32`` and ``mtp_layer=True``). Non-quantized tensors become bf16."""
    src, out = Path(src), Path(out)
    _copy_side_files(src, out, overwrite)
    tensors, new, skipped = _read_all(src), {}, set()
    for k, t in tensors.items():
        if t.dim() == 2 and k.endswith(".weight") and not _NOT_QUANTIZED.search(k):
            new[k], new[k + "_scale_inv"] = quantize_fp8_blocks(t, block, scale_dtype)
        else:
            new[k] = t.to(torch.bfloat16) if t.is_floating_point() else t
            if k.endswith(".weight") and t.dim() == 2:
                skipped.add(k.rsplit(".", 1)[0])
    if mtp_layer:  # DeepSeek-V3 ships its multi-token-prediction module as one more layer: loaders ignore it
        n = json.loads((out / "config.json").read_text())["num_hidden_layers"]
        for k in [k for k in new if k.startswith(f"model.layers.{n - 1}.")]:
            new[k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.", 1)] = new[k].clone()
        for extra in ("enorm", "hnorm"):
            new[f"model.layers.{n}.{extra}.weight"] = torch.ones(new["model.norm.weight"].shape, dtype=torch.bfloat16)
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_config(out, torch_dtype="bfloat16", dtype="bfloat16", quantization_config={
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block),
        "modules_to_not_convert": sorted(skipped)})
    return out


def write_mxfp4(src: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write a float gpt-oss checkpoint ``src`` with its fused experts in gpt-oss's MXFP4 layout to ``out``."""
    src, out = Path(src), Path(out)
    _copy_side_files(src, out, overwrite)
    new = {}
    for k, t in _read_all(src).items():
        m = re.search(r"\.experts\.(gate_up_proj|down_proj)$", k)
        if m:  # the module's [E, in, out] parameter is stored as blocks of its [E, out, in] transpose
            new[k + "_blocks"], new[k + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            new[k] = t.to(torch.bfloat16) if t.is_floating_point() else t
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_config(out, torch_dtype="bfloat16", dtype="bfloat16", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]})
    return out


def reshard(src: str | Path, out: str | Path, *, split_layer: int = 1, overwrite: bool = False) -> Path:
    """Write ``src``'s tensors to ``out`` as two shards plus ``model.safetensors.index.json``, cut in the middle of
    MoE layer ``split_layer``'s experts (so that one layer's experts span two files)."""
    src, out = Path(src), Path(out)
    _copy_side_files(src, out, overwrite)
    tensors = _read_all(src)
    keys = sorted(tensors)
    layer_experts = [i for i, k in enumerate(keys) if f"layers.{split_layer}." in k and ".experts." in k]
    if not layer_experts:
        raise MoeOffloadError(f"no experts in layer {split_layer} to split")
    cut = layer_experts[len(layer_experts) // 2]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for name, part in zip(names, (keys[:cut], keys[cut:])):
        save_file({k: tensors[k].contiguous() for k in part}, str(out / name), metadata={"format": "pt"})
        weight_map |= {k: name for k in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out
