"""Every tensor of a checkpoint accounted for (issue 34): a weight of the model built from config.json, a routed
expert's piece, a quantization companion of one, or a key transformers' loader ignores; anything else is a one-line
error naming the tensor (``expert_map.map_checkpoint``, the keys' rules in ``checkpoint_keys``).
``validate_checkpoint`` runs the whole check from the safetensors headers alone (no tensor is read): what FullLoad
(``loader.load_full``) checks before transformers' ``from_pretrained``, so that it refuses what the offloaded path
refuses, with the same one-line errors, instead of loading a model that is silently wrong (transformers initialises
missing weights at random and skips unexpected ones)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import MoeOffloadError
from ..runtime.formats import check_fp8_grid
from .capability import inspect_model
from .checkpoint import FLOAT8, Checkpoint, quantization
from .expert_map import build_format, map_checkpoint
from .weights import missing_weights


def validate_checkpoint(path: Path, config, dtype: torch.dtype) -> None:
    """Check the checkpoint directory ``path`` (``checkpoint.read_config`` already passed) against the model built
    from ``config`` in compute ``dtype`` on the meta device: every tensor accounted for
    (``expert_map.map_checkpoint``: expert ids within the config's experts, no unknown keys, keys transformers
    ignores ignored), every routed expert present and shaped as the model expects (``expert_map.build_format``),
    every non-expert weight present (``weights.missing_weights``), every FP8 scale grid fitting its weight and
    ``weight_block_size``.

    Raises:
        NotServedError: the model cannot be served (``capability.inspect_model``).
        MoeOffloadError: the checkpoint's safetensors are unreadable (``checkpoint.Checkpoint``) or any check above
            fails (one line naming the tensor).
    """
    quant = quantization(json.loads((path / "config.json").read_text()))
    model, mods, geo = inspect_model(config, dtype)
    ckpt = Checkpoint(path)
    cmap = map_checkpoint(model, mods, ckpt, quant, {n for n, _ in geo.expert_params})
    build_format(mods, cmap, ckpt, quant, dtype, list(geo.expert_params), keep_file_dtype=False)
    missing = missing_weights(model, cmap, {name: i for i, (name, _) in enumerate(mods)})
    if missing:
        raise MoeOffloadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
    for weight, scale in cmap.scales.items():
        if weight in ckpt.index and ckpt.info(weight).dtype in FLOAT8:
            check_fp8_grid(weight, ckpt.info(weight).shape, ckpt.info(scale).shape, cmap.fp8_block)
