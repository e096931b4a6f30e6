"""Checkpoint keys -> the model's parameter names, through transformers' own conversion mapping
(``rename_source_key``), and the keys the model has no weight for: accounted for (``UnusedKeys``: ignored by
transformers' loader, or a multimodal tower's weight the text-generation class leaves out) or a one-line error
(``unknown_key``). ``expert_map.map_checkpoint`` and ``accounting.validate_checkpoint`` both read keys through here.
"""

from __future__ import annotations

import re

import torch

from .checkpoint import FLOAT8, Checkpoint, Quantization


def conversions(model: torch.nn.Module):
    """``(renamings, converters, {source pattern: converter})`` of transformers' conversion mapping for ``model``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    return renamings, converters, {pat: c for c in converters for pat in c.source_patterns}


def rename_key(key: str, model, renamings, converters, meta_sd) -> tuple[str, str | None]:
    """transformers' key renaming (``rename_source_key``), with its loader's fallback to the key itself."""
    from transformers.core_model_loading import rename_source_key

    target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_sd)
    if target not in meta_sd and key in meta_sd:
        target, pattern = rename_source_key(key, [], [], model.base_model_prefix, meta_sd)
    return target, pattern


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
        return rename_key(base, mm, renamings, converters, sd)[0] in sd

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
                renamings, converters, _ = conversions(mm)
                return mm, renamings, converters, mm.state_dict()
        return ()
