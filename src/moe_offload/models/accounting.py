"""Every tensor of a checkpoint accounted for (issue 34): a weight of the model built from config.json, a routed
expert's piece, a quantization companion of one, or a key transformers' loader ignores; anything else is a one-line
error naming the tensor (``expert_map.map_checkpoint``). ``validate_checkpoint`` runs the whole check from the
safetensors headers alone (no tensor is read): what FullLoad (``loader.load_full``) checks before transformers'
``from_pretrained``, so that it refuses what the offloaded path refuses, with the same one-line errors, instead of
loading a model that is silently wrong (transformers initialises missing weights at random and skips unexpected
ones)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import MoeOffloadError
from ..runtime.formats import check_fp8_grid
from .capability import inspect_model
from .checkpoint import FLOAT8, Checkpoint, Quantization, quantization
from .expert_map import _conversions, _rename, build_format, map_checkpoint
from .weights import missing_weights


def unknown_key(key: str, target: str, model: torch.nn.Module, ckpt: Checkpoint, quant: Quantization) -> str:
    """The one-line error for checkpoint tensor ``key`` (renamed ``target``) that the model has no weight for: a
    quantization companion the config does not declare, or an unknown key."""
    weight = key[: -len("_scale_inv")] if key.endswith(".weight_scale_inv") else None
    if quant.method != "fp8" and weight in ckpt.index and ckpt.info(weight).dtype in FLOAT8:
        return (f"{weight} is {str(ckpt.info(weight).dtype).replace('torch.', '')} but config.json has no fp8 "
                "quantization_config: its weight_scale_inv cannot be applied")
    if quant.method != "mxfp4" and re.search(r"_(blocks|scales)$", key):
        return f"checkpoint key {key} looks like MXFP4 (*_blocks / *_scales) but config.json has no mxfp4 " \
               "quantization_config"
    return (f"checkpoint tensor {key} is not a weight of {type(model).__name__} built from config.json (it would "
            f"load into {target}, which the model does not have)")


def ignored_by_transformers(model: torch.nn.Module, key: str, target: str) -> bool:
    """Whether transformers' loader ignores checkpoint key ``key`` (renamed ``target``), which the model has no
    weight for: ``model._keys_to_ignore_on_load_unexpected`` patterns (e.g. DeepSeek-V3's MTP ``model.layers.61``,
    Qwen3-Next's ``mtp.*``), rotary ``inv_freq`` / ``position_ids`` buffers that older checkpoints saved, and a
    layer past ``num_hidden_layers`` (a multi-token-prediction module shipped as one more decoder layer)."""
    from .capability import text_config

    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) | {
        r"(^|\.)inv_freq$", r"(^|\.)position_ids$"}
    if any(re.search(p, k) for p in patterns for k in (key, target)):
        return True
    layers = getattr(text_config(model.config), "num_hidden_layers", None)
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
    return bool(layers and m and int(m.group(1)) >= layers)


class UnusedKeys:
    """Checkpoint keys the model built for text generation has no weight for but that are accounted for: those
    transformers ignores (``ignored_by_transformers``) and, for a multimodal checkpoint served by a text-only class
    (e.g. dots3_note's causal LM), the weights of the towers only its multimodal class has (checked against that
    class built on the meta device from the checkpoint's config.json, on the first such key)."""

    def __init__(self, model: torch.nn.Module, ckpt: Checkpoint):
        self.model, self.ckpt = model, ckpt
        self._tower = None  # (model, renamings, converters, state_dict) of the multimodal class, or ()

    def __call__(self, key: str, base: str, target: str) -> bool:
        """Whether checkpoint tensor ``key`` (a companion of ``base``; renamed ``target``) is accounted for."""
        if ignored_by_transformers(self.model, key, target):
            return True
        if self._tower is None:
            self._tower = self._multimodal_model()
        if not self._tower:
            return False
        mm, renamings, converters, sd = self._tower
        return _rename(base, mm, renamings, converters, sd)[0] in sd

    def _multimodal_model(self) -> tuple:
        import transformers

        from .capability import text_config
        from .checkpoint import read_config_json

        config = read_config_json(self.ckpt.path / "config.json")[0]
        if text_config(config) is config:
            return ()
        for name in ("AutoModelForImageTextToText", "AutoModelForMultimodalLM"):
            auto = getattr(transformers, name, None)
            if auto is not None and type(config) in auto._model_mapping and \
                    auto._model_mapping[type(config)] is not type(self.model):
                try:
                    with torch.device("meta"):
                        mm = auto.from_config(config)
                except Exception:  # transformers cannot build it: no tower is accounted for
                    return ()
                renamings, converters, _ = _conversions(mm)
                return mm, renamings, converters, mm.state_dict()
        return ()


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
