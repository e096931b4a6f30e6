"""Expert formats: how an expert's stored bytes become the weights its grouped GEMM multiplies (DESIGN.md §11).

A routed expert's compute parameters (``gate_up_proj``, ``down_proj``, optional biases, as on the transformers
experts module) are each the concatenation, along one per-expert dim, of *parts*: the checkpoint's pieces (e.g.
Qwen3's per-expert ``gate_proj`` and ``up_proj``, or GPT-OSS's fused ``gate_up_proj``). Each part has a codec:

* ``plain``: a float tensor (bf16 / fp16 / fp32), cast to the compute dtype only if it differs;
* ``fp8``: FP8 e4m3 codes + per-block ``weight_scale_inv`` (``quant_method: fp8``; Qwen3-30B-A3B-FP8, DeepSeek-V3),
  dequantized with transformers' own ``Fp8Dequantize`` arithmetic (``integrations.finegrained_fp8``) in the
  config's ``weight_block_size`` blocks, a partial last block included (``dequantize_fp8``);
* ``mxfp4``: packed e2m1 ``*_blocks`` + e8m0 ``*_scales`` (``quant_method: mxfp4``; gpt-oss), dequantized with
  transformers' ``convert_moe_packed_tensors`` (``integrations.mxfp4``).

The host store, the link and the slot pool move the stored bytes unchanged (so ``expert_bytes`` is the checkpoint's
bytes per expert); only ``ExpertFormat.weight`` dequantizes, for the experts a grouped GEMM computes. Because the
dequantization is transformers' own, applied per part exactly as its loader applies it before concatenating, the
weights are bitwise those of ``from_pretrained`` (the FullLoad reference, which loads FP8 with the same
``dequantize_fp8``: ``models.fp8_full``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import MoeOffloadError
from .store import ExpertLayout

PLAIN, FP8, MXFP4 = "plain", "fp8", "mxfp4"
#: storage roles of each codec (the loader fills them from the checkpoint)
ROLES = {PLAIN: ("weight",), FP8: ("weight", "scale"), MXFP4: ("blocks", "scales")}


_E4M3_TO_F32: dict = {}


def fp8_scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The ``weight_scale_inv`` grid of a ``[rows, cols]`` weight in ``block = (bm, bn)`` blocks:
    ``(ceil(rows / bm), ceil(cols / bn))`` (the last block row / column may be partial: "ragged")."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def check_fp8_grid(key: str, weight_shape: tuple, scale_shape: tuple, block: tuple[int, int] | None) -> None:
    """Check that an FP8 weight's ``weight_scale_inv`` has one scale per ``weight_block_size`` block (the last block
    row / column may be partial): ``[ceil(rows/bm), ceil(cols/bn)]``; without a configured block size, that the grid
    divides the weight (transformers derives the block from it).

    Raises:
        MoeOffloadError: naming ``key``, the shapes and the block size.
    """
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        raise MoeOffloadError(f"{key}: FP8 weight {tuple(weight_shape)} with weight_scale_inv {tuple(scale_shape)}: "
                              "block-FP8 needs 2-D weights and scale grids")
    if block is None:
        if any(s < 1 or w % s for w, s in zip(weight_shape, scale_shape)):
            raise MoeOffloadError(f"{key}: FP8 weight {tuple(weight_shape)} is not a whole number of blocks of its "
                                  f"{tuple(scale_shape)} weight_scale_inv grid, and config.json has no "
                                  "weight_block_size")
        return
    grid = fp8_scale_grid(tuple(weight_shape), block)
    if tuple(scale_shape) != grid:
        raise MoeOffloadError(f"{key}: FP8 weight {tuple(weight_shape)} in weight_block_size {list(block)} blocks "
                              f"needs a {grid} weight_scale_inv, the checkpoint's is {tuple(scale_shape)}")


def _e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes -> float32 values (exact), through a 256-entry table: ~3x faster on the CPU than torch's
    cast, and bitwise the same; other dtypes are cast."""
    if codes.dtype != torch.float8_e4m3fn:
        return codes.to(torch.float32)
    lut = _E4M3_TO_F32.get(codes.device)
    if lut is None:
        lut = _E4M3_TO_F32[codes.device] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(
            torch.float32).to(codes.device)
    return torch.index_select(lut, 0, codes.reshape(-1).view(torch.uint8).int()).view(codes.shape)


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """Block-FP8 weights (``quant_method: fp8``; DeepSeek-V3 §3.3.2, Qwen3-FP8) to ``dtype``: the one FP8
    dequantization of both the offloaded path and FullLoad (``models.fp8_full``).

    Args:
        codes: ``[..., rows, cols]`` float8_e4m3fn.
        scales: ``[..., ceil(rows/bm), ceil(cols/bn)]`` ``weight_scale_inv`` (float32 or bfloat16; one per block).
        dtype: output dtype.
        block: the config's ``weight_block_size`` ``(bm, bn)``; None: derived from the scale grid, as transformers
            does (whole blocks only).

    Returns:
        ``[..., rows, cols]`` ``dtype``: every value ``float32(code) * float32(scale of its block)``, cast.

    Each value is transformers' ``Fp8Dequantize._dequantize_one`` arithmetic. That op derives the block size from
    the grid (``rows // scale_rows``), which is wrong when ``rows`` or ``cols`` is not a multiple of the block (a
    partial last block: e.g. moe_intermediate 40 in 32x32 blocks gives a grid of 2 and a block of 20), so it is run
    on the codes zero-padded to whole blocks and the result cropped; shapes of whole blocks are not padded and go
    through the op unchanged.

    Raises:
        MoeOffloadError: a scale grid that does not fit the weight and block size.
    """
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    values = _e4m3_values(codes)
    if block is None:
        return Fp8Dequantize(None)._dequantize_one(values, scales, output_dtype=dtype)
    rows, cols = values.shape[-2:]
    grid = fp8_scale_grid((rows, cols), block)
    if tuple(scales.shape[-2:]) != grid:
        raise MoeOffloadError(f"FP8 weight {tuple(values.shape[-2:])} in {block[0]}x{block[1]} blocks needs a "
                              f"{grid[0]}x{grid[1]} weight_scale_inv, got {tuple(scales.shape[-2:])}")
    pad_rows, pad_cols = grid[0] * block[0] - rows, grid[1] * block[1] - cols
    if not (pad_rows or pad_cols):
        return Fp8Dequantize(None)._dequantize_one(values, scales, output_dtype=dtype)
    padded = torch.nn.functional.pad(values, (0, pad_cols, 0, pad_rows))
    out = Fp8Dequantize(None)._dequantize_one(padded, scales, output_dtype=dtype)
    return out[..., :rows, :cols].contiguous()


def _dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks [G, rows, cols/32, 16]`` uint8, ``scales [G, rows, cols/32]`` uint8 -> ``[G, cols, rows]`` ``dtype``
    (transformers ``convert_moe_packed_tensors``: its output is transposed, as GPT-OSS's parameters are)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


@dataclass(frozen=True)
class Part:
    """One part of a compute parameter: its ``codec``, its per-expert ``shape`` in the compute parameter, and the
    storage field of each role (``fields[role]``); ``row_offset``: for a ``plain`` part merged into one field with
    its neighbours, its first row in that field."""

    codec: str
    shape: tuple[int, ...]
    fields: dict = field(default_factory=dict)
    row_offset: int = 0


@dataclass(frozen=True)
class ParamFormat:
    """A compute parameter: ``name``, per-expert ``shape``, the per-expert ``dim`` its ``parts`` concatenate along,
    and ``merged``: all parts are plain slices of one field named ``name`` (a zero-copy view)."""

    name: str
    shape: tuple[int, ...]
    dim: int
    parts: tuple[Part, ...]
    merged: bool


class ExpertFormat:
    """Storage layout and decoding of one model's routed experts.

    Args:
        params: ``[(name, shape, dim, [(codec, part_shape, {role: (field_shape, dtype)}), ...]), ...]`` per compute
            parameter in the module's order; ``shape``/``part_shape`` are per-expert compute shapes.
        compute_dtype: dtype the GEMMs run in (the model's).
        fp8_block: the FP8 ``weight_block_size`` ``(bm, bn)`` of ``fp8`` parts (None: derived from the scale grid).

    Attributes:
        layout: the storage ``ExpertLayout`` (what the host store, the link and the slots hold).
        params: ``{name: ParamFormat}``.
        zero_copy: every parameter is one plain field already in the compute dtype (the slot window is handed to
            the GEMM without a copy).
    """

    def __init__(self, params: list[tuple], compute_dtype: torch.dtype, fp8_block: tuple[int, int] | None = None):
        self.compute_dtype = compute_dtype
        self.fp8_block = fp8_block
        fields: list[tuple] = []
        self.params: dict[str, ParamFormat] = {}
        for name, shape, dim, parts in params:
            merge = (dim == 0 and all(c == PLAIN for c, _, _ in parts)
                     and len({r["weight"][1] for _, _, r in parts}) == 1)
            built, row = [], 0
            if merge:
                fields.append((name, tuple(shape), parts[0][2]["weight"][1]))
            for i, (codec, pshape, roles) in enumerate(parts):
                if merge:
                    built.append(Part(codec, tuple(pshape), {"weight": name}, row))
                    row += pshape[0]
                    continue
                names = {}
                for role in ROLES[codec]:
                    fshape, fdtype = roles[role]
                    names[role] = f"{name}#{i}.{role}"
                    fields.append((names[role], tuple(fshape), fdtype))
                built.append(Part(codec, tuple(pshape), names))
            self.params[name] = ParamFormat(name, tuple(shape), dim, tuple(built), merge)
        self.layout = ExpertLayout(fields)
        self.zero_copy = all(p.merged and self.layout.by_name[p.name].dtype == compute_dtype
                             for p in self.params.values())

    @classmethod
    def plain(cls, params: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> "ExpertFormat":
        """Every parameter one plain field of ``dtype`` (``[(name, per_expert_shape), ...]``)."""
        return cls([(n, s, 0, [(PLAIN, s, {"weight": (s, dtype)})]) for n, s in params], dtype)

    @property
    def stored_dtypes(self) -> list[str]:
        """Stored field dtypes, e.g. ``["bfloat16", "float8_e4m3fn"]`` (what ``generate --json`` reports)."""
        return sorted({str(f.dtype).replace("torch.", "") for f in self.layout.fields})

    def weight(self, views: dict[str, torch.Tensor], name: str, sel) -> torch.Tensor:
        """Compute weights of parameter ``name`` for the rows ``sel`` (a slice: a zero-copy window where possible;
        or an int64 index tensor) of a buffer whose field views are ``views``: ``[G, *shape]`` ``compute_dtype``."""
        pf = self.params[name]
        if pf.merged:
            w = views[name][sel]
            return w if w.dtype == self.compute_dtype else w.to(self.compute_dtype)
        parts = [self._decode(p, views, sel) for p in pf.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pf.dim + 1)

    def _decode(self, part: Part, views, sel) -> torch.Tensor:
        f = part.fields
        if part.codec == PLAIN:
            return views[f["weight"]][sel].to(self.compute_dtype)
        if part.codec == FP8:
            return dequantize_fp8(views[f["weight"]][sel], views[f["scale"]][sel], self.compute_dtype, self.fp8_block)
        return _dequantize_mxfp4(views[f["blocks"]][sel], views[f["scales"]][sel], self.compute_dtype)


class ExpertRows:
    """Experts held in a ``[rows, expert_bytes]`` uint8 buffer (the slot pool, or host store rows) with their
    format: ``weight(name, sel)`` gives compute weights ``[G, *shape]`` (see ``ExpertFormat.weight``)."""

    def __init__(self, fmt: ExpertFormat, buf: torch.Tensor):
        self.format = fmt
        self.buf = buf
        self.views = fmt.layout.views(buf)

    @property
    def zero_copy(self) -> bool:
        return self.format.zero_copy

    def weight(self, name: str, sel) -> torch.Tensor:
        return self.format.weight(self.views, name, sel)
