"""FullLoad of block-FP8 checkpoints (``quant_method: fp8``) dequantized in the config's ``weight_block_size`` blocks.

transformers 5.x dequantizes FP8 while loading (``Fp8Dequantize``, on a machine without an FP8 GPU) but derives the
block size from the scale grid (``rows // scale_rows``) rather than the configured ``weight_block_size``: a weight
dimension that is not a multiple of the block (a partial last block, e.g. moe_intermediate 40 in 32x32 blocks) is
then dequantized with the wrong block (20 rows) or refused. FullLoad is the reference the offloaded engine is checked
against, so it must not inherit that: ``fullload_kwargs`` gives ``from_pretrained`` a config whose
``quantization_config`` names a quantizer registered here, transformers' own FP8 quantizer with its dequantize op
replaced by one that calls ``runtime.formats.dequantize_fp8`` (the function the offloaded path decodes experts and
non-expert weights with).

Why this way, rather than re-dequantizing after ``from_pretrained`` or building FullLoad with our own loader: the
weights still come through transformers' whole loading (its key renaming, expert merging, tying, its initialisation
of what the checkpoint does not hold) with only the arithmetic corrected at the one place it is wrong; a repair
after loading cannot work where transformers refuses the checkpoint (a grid that does not divide the weight), and
a FullLoad built by our loader would no longer be an independent reference. The registration is transformers'
public extension point (``register_quantizer`` / ``register_quantization_config``) under a name of our own, so
other loads of ``fp8`` checkpoints in the process are unchanged. FullLoad always dequantizes (``dequantize=True``,
also on an FP8-capable GPU), as the offloaded path does: the two then compute with the same weights.
"""

from __future__ import annotations

import copy

import torch

#: ``quant_method`` of the corrected FP8 quantizer (registered with transformers on first use)
QUANT_METHOD = "moe_offload_fp8"


def _register() -> None:
    """Register the corrected FP8 quantization config and quantizer with transformers (once per process)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.quantizers.auto import (AUTO_QUANTIZER_MAPPING, register_quantization_config,
                                              register_quantizer)
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    if QUANT_METHOD in AUTO_QUANTIZER_MAPPING:
        return

    class BlockFp8Dequantize(Fp8Dequantize):
        """transformers' ``Fp8Dequantize`` dequantizing FP8 e4m3 codes in the configured ``weight_block_size``
        blocks (``runtime.formats.dequantize_fp8``); other inputs (FP4-packed experts) as transformers does."""

        def _dequantize_one(self, quantized, scales, output_dtype=None):
            from ..runtime.formats import dequantize_fp8

            if quantized.dtype != torch.float8_e4m3fn:
                return super()._dequantize_one(quantized, scales, output_dtype=output_dtype)
            if output_dtype is None:  # transformers' own default when the target parameter is unknown
                output_dtype = (scales.dtype if scales.dtype.is_floating_point and scales.element_size() >= 2
                                else torch.bfloat16)
            block = self.hf_quantizer.quantization_config.weight_block_size
            return dequantize_fp8(quantized, scales, output_dtype, tuple(block) if block else None)

    class BlockFp8Config(FineGrainedFP8Config):
        """``FineGrainedFP8Config`` under ``QUANT_METHOD``."""

    class BlockFp8Quantizer(FineGrainedFP8HfQuantizer):
        """transformers' FP8 quantizer whose dequantize op is ``BlockFp8Dequantize``."""

        def get_load_operations(self):
            return {"dequantize": BlockFp8Dequantize}

    register_quantization_config(QUANT_METHOD)(BlockFp8Config)
    register_quantizer(QUANT_METHOD)(BlockFp8Quantizer)


def fullload_kwargs(config) -> dict:
    """Extra ``from_pretrained`` arguments for FullLoad of a checkpoint whose transformers config is ``config``:
    none unless it is FP8-quantized; then ``{"config": copy}``, the copy's ``quantization_config`` (top-level or the
    text config's) loading through the corrected quantizer, dequantizing (``dequantize=True``) in
    ``weight_block_size`` blocks."""
    holders = [config, config.get_text_config(decoder=True)]
    holder = next((h for h in holders if getattr(h, "quantization_config", None)), None)
    if holder is None:
        return {}
    q = holder.quantization_config
    q = q.to_dict() if hasattr(q, "to_dict") else dict(q)
    if str(q.get("quant_method", "")).lower() != "fp8":
        return {}
    _register()
    config = copy.deepcopy(config)
    holder = config if holder is holders[0] else config.get_text_config(decoder=True)
    # no weight_block_size in config.json: None (the block derived from the scale grid, as the offloaded path does),
    # not FineGrainedFP8Config's default 128 x 128
    holder.quantization_config = {**q, "quant_method": QUANT_METHOD, "dequantize": True,
                                  "weight_block_size": q.get("weight_block_size")}
    return {"config": config}
