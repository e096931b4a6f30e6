"""Non-expert weights (attention, norms, routers, shared experts, embeddings, head; a multimodal checkpoint's vision
tower) from the checkpoint onto the model's device, through transformers' own conversion operations.

Each checkpoint key was renamed with transformers' conversion mapping (``expert_map.map_checkpoint``); keys that a
``WeightConverter`` fuses, splits or permutes (a q/k/v convolution concatenated, a fused projection split in four,
rotary permutations) are grouped per target exactly as transformers' loader groups them and converted with the
converter's own ``convert``; plain renames are copied. FP8 weights (``weight_scale_inv`` beside them) are dequantized
when read, in the config's ``weight_block_size`` blocks (``runtime.formats.dequantize_fp8``).
"""

from __future__ import annotations

import copy
from functools import partial

import torch

from ..errors import MoeOffloadError
from ..runtime.formats import check_fp8_grid
from .checkpoint import FLOAT8, Checkpoint
from .checkpoint_keys import conversions
from .expert_map import CheckpointMap


def _read(ckpt: Checkpoint, key: str, scale_key: str | None, dtype: torch.dtype,
          block: tuple[int, int] | None) -> torch.Tensor:
    """One checkpoint tensor, FP8 codes dequantized to ``dtype`` with their scales in ``block`` (``weight_block_size``)
    blocks.

    Raises:
        MoeOffloadError: FP8 codes without their scales, a scale grid that does not fit, or a scale beside a tensor
            that is not FP8.
    """
    from ..runtime.formats import dequantize_fp8

    src = ckpt.tensor(key)
    if src.dtype in FLOAT8:
        if scale_key is None:
            raise MoeOffloadError(f"{key} is {str(src.dtype).replace('torch.', '')} without its weight_scale_inv: "
                                  "its values are unknown")
        scales = ckpt.tensor(scale_key)
        check_fp8_grid(key, src.shape, scales.shape, block)
        return dequantize_fp8(src, scales, dtype, block)
    if scale_key is not None:
        raise MoeOffloadError(f"{scale_key}: a scale for {key}, which is stored as {src.dtype}, not FP8")
    return src


def _targets_of(target: str, sources: list, by_pattern: dict) -> list[str]:
    """Every parameter a group of checkpoint keys becomes (a one-to-many converter names its first target)."""
    pattern = sources[0][1]
    if pattern is None:
        return [target]
    conv = by_pattern[pattern]
    return [target.replace(conv.target_patterns[0], t) for t in conv.target_patterns]


def _mappings(model, cmap: CheckpointMap, ckpt: Checkpoint, state: dict) -> dict:
    """``{first target: transformers WeightRenaming / WeightConverter}`` holding deferred reads of its keys."""
    from transformers.core_model_loading import WeightRenaming

    _, _, by_pattern = conversions(model)
    out = {}
    for target, sources in cmap.non_expert.items():
        if target not in state:
            continue  # a tied lm_head written twice (keys the model has no weight for: expert_map.map_checkpoint)
        dtype = state[target].dtype
        for key, pattern in sources:
            if pattern is not None:
                mapping = out.setdefault(target, copy.deepcopy(by_pattern[pattern]))
                source = pattern
            else:
                mapping = out.setdefault(target, WeightRenaming(key, target))
                source = key
            mapping.add_tensor(target, key, source, partial(_read, ckpt, key, cmap.scales.get(key), dtype,
                                                                  cmap.fp8_block))
    return out


def missing_weights(model: torch.nn.Module, cmap: CheckpointMap, layer_of: dict) -> list[str]:
    """The model's persistent non-expert weights (parameters and persistent buffers, on the meta device or not) that
    no checkpoint key becomes (``cmap.non_expert``, a one-to-many converter's siblings included), tied ones aside;
    ``layer_of``: ``{experts module name: MoE layer}`` (their parameters are the host store's)."""
    _, _, by_pattern = conversions(model)
    persistent = set(model.state_dict())
    state = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    covered = {t for target, src in cmap.non_expert.items() if target in state
               for t in _targets_of(target, src, by_pattern)}
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    return [k for k in persistent if k not in covered and k.rpartition(".")[0] not in layer_of and k not in tied]


def load_non_expert(model: torch.nn.Module, cmap: CheckpointMap, ckpt: Checkpoint, layer_of: dict) -> None:
    """Read every non-expert weight onto the model's device (already materialised, experts dropped).

    Args:
        layer_of: ``{experts module name: MoE layer}`` (their parameters are not loaded here).

    Raises:
        MoeOffloadError: a weight the checkpoint lacks, a shape mismatch, a conversion that fails, or FP8 codes
            without their scales.
    """
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    state = {**buffers, **params}
    missing = missing_weights(model, cmap, layer_of)
    if missing:
        raise MoeOffloadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
    with torch.no_grad():
        for target, mapping in _mappings(model, cmap, ckpt, state).items():
            try:
                realized = mapping.convert(target, model=model, config=model.config)
            except MoeOffloadError:
                raise
            except Exception as e:
                raise MoeOffloadError(f"{target}: transformers' conversion of the checkpoint failed: "
                                      f"{type(e).__name__}: {str(e).strip()[:200]}") from None
            for name, src in realized.items():
                src = src[0] if isinstance(src, list) else src
                dst = state.get(name)
                if dst is None:
                    continue
                if tuple(src.shape) != tuple(dst.shape):
                    raise MoeOffloadError(f"{name}: the checkpoint gives shape {tuple(src.shape)}, the model's is "
                                          f"{tuple(dst.shape)}")
                dst.copy_(src.to(dst.dtype))
        model.tie_weights()
