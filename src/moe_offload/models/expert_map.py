"""Checkpoint keys -> model parameters and routed-expert pieces; the experts' format; filling the host store.

The key -> parameter mapping is transformers' own conversion mapping (``rename_source_key``), so per-expert
checkpoints (``experts.{e}.gate_proj`` ...) and fused ones (GPT-OSS ``experts.gate_up_proj``) both work. Quantized
checkpoints carry companions next to a weight: FP8 ``<w>.weight_scale_inv``, MXFP4 ``<p>_blocks`` / ``<p>_scales``;
a companion is mapped through its weight's key and kept with it, never dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..errors import MoeOffloadError
from ..runtime.formats import FP8, MXFP4, PLAIN, ExpertFormat, check_fp8_grid
from ..runtime.store import FILE_BACKED
from .checkpoint import FLOAT8, Checkpoint, Quantization
from .checkpoint_keys import UnusedKeys, conversions, rename_key, unknown_key


@dataclass(frozen=True)
class ExpertPiece:
    """Where one role (``weight``, ``scale``, ``blocks``, ``scales``) of one part of an expert parameter lives:
    checkpoint ``key`` and, for a fused ``[E, ...]`` tensor, the row ``fused_index`` (None: a per-expert tensor)."""

    key: str
    fused_index: int | None


@dataclass
class CheckpointMap:
    """The checkpoint mapped onto a model built on the meta device.

    Attributes:
        non_expert: ``{first target parameter: [(checkpoint key, converter source pattern or None), ...]}``: the
            keys transformers' loader would convert into that parameter (and, for a one-to-many converter, its
            siblings), loaded by ``models.weights.load_non_expert``.
        scales: ``{checkpoint key of an FP8 weight: key of its weight_scale_inv}``.
        pieces: ``{(moe_layer, expert, param): {part position: {role: ExpertPiece}}}``.
        concat_dim: ``{param: per-expert dim its parts concatenate along}``.
        converted: ``{param: transformers WeightConverter}`` for expert parameters whose checkpoint layout the
            converter changes by more than merging and concatenating (transpose, interleave...): they are converted
            per expert when the host store is filled (``fill_store``), with transformers' own operations.
        fp8_block: the FP8 ``weight_block_size`` ``(bm, bn)`` (None: not FP8, or none configured).
    """

    non_expert: dict = field(default_factory=dict)
    scales: dict = field(default_factory=dict)
    pieces: dict = field(default_factory=dict)
    concat_dim: dict = field(default_factory=dict)
    converted: dict = field(default_factory=dict)
    fp8_block: tuple[int, int] | None = None


def _companion(key: str, quant: Quantization) -> tuple[str, str]:
    """``(base key, role)``: the weight a quantization companion belongs to, or ``(key, "weight")``.

    Raises:
        MoeOffloadError: static activation scales (not served).
    """
    if quant.method == "fp8":
        if key.endswith(".weight_scale_inv"):
            return key[: -len("_scale_inv")], "scale"
        if key.endswith(".activation_scale") or key.endswith(".input_scale"):
            raise MoeOffloadError(f"checkpoint key {key}: static FP8 activation scales are not supported")
    if quant.method == "mxfp4":
        for suffix, role in (("_blocks", "blocks"), ("_scales", "scales")):
            if key.endswith(suffix):
                return key[: -len(suffix)], role
    return key, "weight"


def map_checkpoint(model: torch.nn.Module, mods: list, ckpt: Checkpoint, quant: Quantization,
                   expert_names: set[str]) -> CheckpointMap:
    """Map every checkpoint key onto ``model`` (built on the meta device; ``mods`` its experts modules in MoE-layer
    order, ``expert_names`` the names of their routed-expert parameters). Every tensor is accounted for: a weight of
    the model, a routed expert's piece, a quantization companion of one, a key transformers' loader ignores
    (``checkpoint_keys.ignored_by_transformers``) or a multimodal tower's weight the text-generation class leaves out
    (``checkpoint_keys.UnusedKeys``); anything else is an error.

    Raises:
        MoeOffloadError: one line naming the tensor: a key that is no weight of the model, an expert id or a fused
            expert count beyond the config's experts, a key mapping to an expert parameter the module does not have,
            an expert index that cannot be found, or quantized experts whose conversion is more than merge
            (+ concatenate).
    """
    renamings, converters, by_pattern = conversions(model)
    meta_sd = model.state_dict()
    layer_of = {name: i for i, (name, _) in enumerate(mods)}
    cmap = CheckpointMap(fp8_block=quant.block_size if quant.method == "fp8" else None)
    unused = UnusedKeys(model, ckpt)
    for key in ckpt.keys():
        base, role = _companion(key, quant)
        target, pattern = rename_key(base, model, renamings, converters, meta_sd)
        mod_name, _, pname = target.rpartition(".")
        if mod_name not in layer_of:
            if target not in meta_sd:
                if unused(key, base, target):
                    continue
                raise MoeOffloadError(unknown_key(key, target, model, ckpt, quant))
            if role == "weight":
                cmap.non_expert.setdefault(target, []).append((key, pattern))
            else:
                cmap.scales[base] = key
            continue
        if pname not in expert_names:
            if quant.method != "mxfp4" and re.search(r"_(blocks|scales)$", pname):
                raise MoeOffloadError(f"checkpoint key {key} looks like MXFP4 (*_blocks / *_scales) but config.json "
                                      "has no mxfp4 quantization_config")
            raise MoeOffloadError(f"checkpoint key {key} maps to unknown expert parameter {target}")
        _map_expert_key(cmap, ckpt, key, base, role, layer_of[mod_name], pname, by_pattern.get(pattern) if pattern
                        else None, pattern, mods[0][1].num_experts)
    return cmap


def _map_expert_key(cmap: CheckpointMap, ckpt: Checkpoint, key: str, base: str, role: str, layer: int, pname: str,
                    conv, pattern: str | None, num_experts: int) -> None:
    """Record one routed-expert checkpoint key: per-expert (``experts.{e}.*``) or fused (``[E, ...]``), as parts of
    a merge (+ concatenate) or as the input of a converter applied per expert.

    Raises:
        MoeOffloadError: an expert id ``>= num_experts``, a fused tensor not holding ``num_experts`` rows, or a
            conversion the offloaded experts do not support.
    """
    if conv is not None and not _is_merge(conv):
        if role != "weight":
            raise MoeOffloadError(f"checkpoint key {key}: quantized experts converted by "
                                  f"{[type(o).__name__ for o in conv.operations]} are not supported for offloading")
        cmap.converted[pname] = conv
    elif conv is not None:
        cmap.concat_dim[pname] = _concat_dim(conv, key)
    position = conv.source_patterns.index(pattern) if conv is not None else 0
    if pattern is None or "*" not in pattern:  # a fused [E, ...] tensor: one row per expert
        shape = ckpt.info(key).shape
        if not shape or shape[0] != num_experts:
            raise MoeOffloadError(f"checkpoint tensor {key} {list(shape)} holds {shape[0] if shape else 0} experts, "
                                  f"the model built from config.json has {num_experts} per MoE layer")
        for e in range(num_experts):
            cmap.pieces.setdefault((layer, e, pname), {}).setdefault(position, {})[role] = ExpertPiece(key, e)
        return
    m = re.search(pattern.replace("*.", r"(\d+)\."), base)
    if m is None:
        raise MoeOffloadError(f"cannot find the expert index in checkpoint key {key}")
    if int(m.group(1)) >= num_experts:
        raise MoeOffloadError(f"checkpoint tensor {key} is expert {int(m.group(1))}, but the model built from "
                              f"config.json has {num_experts} experts per MoE layer (ids 0-{num_experts - 1})")
    cmap.pieces.setdefault((layer, int(m.group(1)), pname), {}).setdefault(position, {})[role] = \
        ExpertPiece(key, None)


def _is_merge(conv) -> bool:
    """A converter that only stacks per-expert tensors (+ concatenates them): stored as parts (native precision)."""
    ops = [type(o).__name__ for o in conv.operations]
    return ops in (["MergeModulelist"], ["MergeModulelist", "Concatenate"])


def _concat_dim(conv, key: str) -> int:
    """Per-expert concatenation dim implied by a converter [MergeModulelist(dim=0)] (+ Concatenate(dim=d))."""
    ops = [type(o).__name__ for o in conv.operations]
    if ops == ["MergeModulelist"] and conv.operations[0].dim == 0:
        return 0
    if ops == ["MergeModulelist", "Concatenate"] and conv.operations[0].dim == 0 and conv.operations[1].dim >= 1:
        return conv.operations[1].dim - 1
    raise MoeOffloadError(f"checkpoint key {key}: expert conversion {ops} is not supported for offloading")


def _piece_shape(ckpt: Checkpoint, piece: ExpertPiece) -> tuple[tuple[int, ...], torch.dtype]:
    info = ckpt.info(piece.key)
    return (info.shape if piece.fused_index is None else info.shape[1:]), info.dtype


def _part_spec(ckpt: Checkpoint, roles: dict, pname: str, quant: Quantization, storage_dtype) -> tuple:
    """``(codec, compute shape, {role: (field shape, dtype)})`` of one part from its pieces.

    Raises:
        MoeOffloadError: a part whose pieces do not make a format the engine serves exactly.
    """
    shapes = {r: _piece_shape(ckpt, p) for r, p in roles.items()}
    key = next(iter(roles.values())).key
    if "blocks" in roles or "scales" in roles:
        if set(roles) != {"blocks", "scales"}:
            raise MoeOffloadError(f"{key}: MXFP4 expert weights need both *_blocks and *_scales")
        (bshape, bdt), (sshape, sdt) = shapes["blocks"], shapes["scales"]
        if bdt != torch.uint8 or sdt != torch.uint8 or len(bshape) != 3 or bshape[:2] != sshape:
            raise MoeOffloadError(f"{key}: MXFP4 blocks {bshape} {bdt} / scales {sshape} {sdt} are not the "
                                  "gpt-oss layout ([rows, cols/32, 16] and [rows, cols/32] uint8)")
        return MXFP4, (bshape[1] * bshape[2] * 2, bshape[0]), {r: shapes[r] for r in ("blocks", "scales")}
    if "weight" not in roles:
        raise MoeOffloadError(f"{key}: a quantization scale without its weight")
    wshape, wdt = shapes["weight"]
    if wdt in FLOAT8:
        if quant.method != "fp8":
            raise MoeOffloadError(f"{key} is {str(wdt).replace('torch.', '')} but config.json has no fp8 "
                                  "quantization_config: its scales are unknown")
        if wdt != torch.float8_e4m3fn:
            raise MoeOffloadError(f"{key}: FP8 {wdt} is not supported; supported: float8_e4m3fn")
        if "scale" not in roles:
            raise MoeOffloadError(f"{key} is FP8 without its weight_scale_inv")
        check_fp8_grid(key, wshape, shapes["scale"][0], quant.block_size)
        return FP8, wshape, {"weight": shapes["weight"], "scale": shapes["scale"]}
    if "scale" in roles:
        raise MoeOffloadError(f"{key} has a weight_scale_inv but is stored as {wdt}, not FP8")
    if not wdt.is_floating_point:
        raise MoeOffloadError(f"{key}: expert parameter {pname} stored as {wdt}: not a float or a supported "
                              "quantization")
    return PLAIN, wshape, {"weight": (wshape, storage_dtype or wdt)}


def build_format(mods: list, cmap: CheckpointMap, ckpt: Checkpoint, quant: Quantization,
                 compute_dtype: torch.dtype, expert_params, keep_file_dtype: bool) -> ExpertFormat:
    """The experts' ``ExpertFormat`` from MoE layer 0's pieces, checked against every layer and expert.

    Args:
        expert_params: ``[(name, per-expert compute shape), ...]`` of the experts module.
        keep_file_dtype: plain parts are stored in the file's dtype (``--host-store mmap``) rather than the compute
            dtype.
    Raises:
        MoeOffloadError: missing expert weights, parts whose shapes do not add up to the module's parameter (e.g.
            ``moe_intermediate_size`` disagreeing with the stored tensors), or layers/experts stored differently.
    """
    num_experts = mods[0][1].num_experts
    storage = None if keep_file_dtype else compute_dtype
    specs, reference = [], {}
    for pname, shape in expert_params:
        parts = cmap.pieces.get((0, 0, pname))
        if not parts:
            raise MoeOffloadError(f"checkpoint lacks expert weights, e.g. MoE layer 0 expert 0 {pname}")
        if pname in cmap.converted:
            specs.append(_converted_spec(pname, tuple(shape), parts, ckpt, cmap, compute_dtype, keep_file_dtype))
            reference[pname] = {pos: {r: _piece_shape(ckpt, p) for r, p in roles.items()}
                                for pos, roles in parts.items()}
            continue
        dim = cmap.concat_dim.get(pname, 0)
        built = [_part_spec(ckpt, parts[pos], pname, quant, storage) for pos in sorted(parts)]
        total = list(built[0][1])
        total[dim] = sum(b[1][dim] for b in built)
        if tuple(total) != tuple(shape) or any(len(b[1]) != len(shape) for b in built):
            raise MoeOffloadError(f"expert parameter {pname}: the checkpoint's tensors give shape {tuple(total)}, the "
                                  f"model built from config.json expects {tuple(shape)} (check moe_intermediate_size"
                                  " / hidden_size against the weights)")
        specs.append((pname, tuple(shape), dim, built))
        reference[pname] = {pos: {r: _piece_shape(ckpt, p) for r, p in roles.items()} for pos, roles in parts.items()}
    for layer in range(len(mods)):
        for e in range(num_experts):
            for pname, _ in expert_params:
                parts = cmap.pieces.get((layer, e, pname))
                if parts is None:
                    raise MoeOffloadError(f"checkpoint lacks expert weights, e.g. MoE layer {layer} expert {e} "
                                          f"{pname}")
                got = {pos: {r: _piece_shape(ckpt, p) for r, p in roles.items()} for pos, roles in parts.items()}
                if got != reference[pname]:
                    for pos in sorted(parts):  # a specific reason first (a missing scale, ...)
                        _part_spec(ckpt, parts[pos], pname, quant, storage)
                    raise MoeOffloadError(f"MoE layer {layer} expert {e} {pname} is stored differently from MoE "
                                          f"layer 0 expert 0 (tensor shapes or dtypes differ)")
    return ExpertFormat(specs, compute_dtype, cmap.fp8_block)


def _converted_spec(pname: str, shape: tuple, parts: dict, ckpt: Checkpoint, cmap: CheckpointMap,
                    compute_dtype: torch.dtype, keep_file_dtype: bool) -> tuple:
    """The format spec of a converted expert parameter: one plain field in the module's per-expert layout.

    Raises:
        MoeOffloadError: ``--host-store mmap`` or ``disk`` (they read the checkpoint's bytes, which this parameter's
            are not), or
            pieces that are not float tensors.
    """
    ops = [type(o).__name__ for o in cmap.converted[pname].operations]
    if keep_file_dtype:
        raise MoeOffloadError(f"expert parameter {pname} is converted from the checkpoint's layout ({', '.join(ops)}):"
                              " --host-store mmap and disk serve experts stored in the module's layout; use "
                              "--host-store pinned")
    for roles in parts.values():
        for piece in roles.values():
            if not _piece_shape(ckpt, piece)[1].is_floating_point or _piece_shape(ckpt, piece)[1] in FLOAT8:
                raise MoeOffloadError(f"{piece.key}: converted expert weights ({', '.join(ops)}) must be float")
    return pname, shape, 0, [(PLAIN, shape, {"weight": (shape, compute_dtype)})]


class _SliceModel:
    """What a conversion op may ask of the model (``get_parameter`` for ``Transpose(check_dims=True)``), for a
    one-expert slice: the parameter's shape with one expert."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty((1, *self.shape), device="meta")


def convert_expert(conv, parts: dict, ckpt: Checkpoint, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """One expert's parameter from its checkpoint pieces through transformers' own conversion operations, run on a
    one-expert slice (a per-expert tensor, or one row of a fused ``[E, ...]`` tensor, as a list of one).

    Returns:
        ``shape`` tensor in the checkpoint's dtype.

    Raises:
        MoeOffloadError: the conversion does not give the module's per-expert shape.
    """
    inputs = {}
    for pos in sorted(parts):
        piece = parts[pos]["weight"]
        t = ckpt.tensor(piece.key, piece.fused_index)
        inputs[conv.source_patterns[pos]] = [t] if piece.fused_index is None else t.unsqueeze(0)
    for op in conv.operations:
        inputs = op.convert(inputs, source_patterns=conv.source_patterns, target_patterns=conv.target_patterns,
                            full_layer_name=name, model=_SliceModel(shape), config=None)
    (out,) = inputs.values()
    out = out[0] if isinstance(out, list) else out
    if tuple(out.shape) != (1, *shape):
        raise MoeOffloadError(f"{name}: converting the checkpoint's pieces gives {tuple(out.shape[1:])}, the module "
                              f"expects {shape}")
    return out[0]


def _targets(fmt: ExpertFormat, pname: str, position: int, role: str):
    """``(field, byte offset inside the row, storage dtype)`` where part ``position``'s ``role`` goes."""
    pf = fmt.params[pname]
    part = pf.parts[position]
    f = fmt.layout.by_name[part.fields[role]]
    row_bytes = f.nbytes // f.shape[0] if f.shape else f.nbytes
    return f, f.offset + part.row_offset * row_bytes


def fill_store(store, fmt: ExpertFormat, cmap: CheckpointMap, ckpt: Checkpoint, num_layers: int, num_experts: int,
               progress: bool) -> None:
    """Put every routed expert's pieces into ``store``: positioned reads straight into the private rows
    (``HostStore``; plain parts in another dtype than the file's are read and cast), or byte-range segments of the
    files (``MmapHostStore``), in file order. Parts are identified by their sorted position."""
    jobs, converted = [], []
    for (layer, e, pname), parts in cmap.pieces.items():
        if layer >= num_layers:
            continue
        eid = layer * num_experts + e
        if pname in cmap.converted:
            converted.append((eid, pname, parts))
            continue
        for i, pos in enumerate(sorted(parts)):
            for role, piece in parts[pos].items():
                info = ckpt.info(piece.key)
                start = info.start if piece.fused_index is None else info.row_range(piece.fused_index)[0]
                jobs.append((str(info.file), start, eid, pname, i, role, piece))
    jobs.sort(key=lambda j: (j[0], j[1]))
    bar = tqdm(total=len(jobs), desc="experts -> host store" if store.mode not in FILE_BACKED else
               "indexing experts in the files", unit="tensor", disable=not progress, leave=False,
               miniters=max(1, len(jobs) // 100))
    for _, start, eid, pname, i, role, piece in jobs:
        f, off = _targets(fmt, pname, i, role)
        info = ckpt.info(piece.key)
        nbytes = info.nbytes if piece.fused_index is None else info.row_range(piece.fused_index)[1]
        if store.mode in FILE_BACKED:
            store.add_segment(eid, off, info.file, start, nbytes)
        elif info.dtype == f.dtype:
            ckpt.read_into(piece.key, store.row(eid)[off:off + nbytes], piece.fused_index)
        else:  # a plain part cast to the compute dtype, as transformers' loader casts it
            t = ckpt.tensor(piece.key, piece.fused_index).to(f.dtype).reshape(-1)
            store.row(eid)[off:off + t.numel() * t.element_size()] = t.view(torch.uint8).numpy()
        bar.update(1)
    bar.close()
    for eid, pname, parts in converted:  # transformers' conversion ops, one expert at a time
        f, off = _targets(fmt, pname, 0, "weight")
        t = convert_expert(cmap.converted[pname], parts, ckpt, fmt.params[pname].shape, pname).to(f.dtype)
        store.row(eid)[off:off + t.numel() * t.element_size()] = t.reshape(-1).view(torch.uint8).numpy()
