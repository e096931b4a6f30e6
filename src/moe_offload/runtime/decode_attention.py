"""The attention of a decode step through the native kernel (``runtime.kernels``: ``decode_attention``, issue 46).

A decode step attends one query per sequence to its cached keys and values. torch's CPU attention
(``scaled_dot_product_attention``'s flash kernel) is built for long queries: measured here on testbed-sparse-wide
(bfloat16, a 518-token prompt, 2 threads) it took 0.4 ms per layer, 12 of a 50 ms decode step, for about 0.2 MB of
keys and values. The kernel computes the same softmax attention in float32 (grouped-query heads without copies, the
mask applied as scaled_dot_product_attention applies it) in one call per layer, each (sequence, head) by one thread
in a fixed order: the same result at any thread count and batch position.

``use_decode_attention`` registers the implementation with transformers (``AttentionInterface``, and sdpa's masks
through ``AttentionMaskInterface``) and selects it on a model that uses sdpa: calls with one query on the CPU, with
float32 or bfloat16 keys and values, a mask (if any) over the keys' positions, and nothing sdpa-specific (no
attention sinks, soft-capping, position bias, dropout or returned weights), run the kernel; every other call (prefill, a diffusion block, the GPU) runs
transformers' sdpa function unchanged. FullLoad and the offloaded engines load through the same function, so they
keep agreeing bit for bit.
"""

from __future__ import annotations

import torch

from .kernels import native
from .kernels.ops import native_ops

#: the implementation's name in transformers' attention and mask registries
NAME = "moe_offload_decode"
DTYPES = (torch.float32, torch.bfloat16)
#: keyword arguments with which a call is left to sdpa (features the kernel does not compute)
SDPA_ONLY = ("softcap", "position_bias", "s_aux", "sinks", "head_mask")


def _kernel_serves(query, key, value, mask, dropout, kwargs) -> bool:
    return (query.shape[2] == 1 and query.device.type == "cpu" and key.dtype in DTYPES and value.dtype == key.dtype
            and (mask is None or (mask.dim() == 4 and mask.shape[-1] == key.shape[-2] and mask.shape[-2] == 1))
            and not dropout and not kwargs.get("output_attentions")
            and all(kwargs.get(name) is None for name in SDPA_ONLY)
            and key.stride(-1) == 1 and value.stride(-1) == 1 and query.shape[1] % key.shape[1] == 0)


def decode_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An attention function of transformers' ``AttentionInterface``: ``query [B, Hq, L, D]``, ``key [B, Hkv, S,
    D]``, ``value [B, Hkv, S, Dv]``, ``attention_mask`` (sdpa's: None, or bool / additive broadcastable to ``[B, Hq,
    L, S]``) -> ``([B, L, Hq, Dv]`` in the query's dtype, None). The kernel for one query (module docstring), else
    transformers' sdpa function with the same arguments."""
    if not _kernel_serves(query, key, value, attention_mask, dropout, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        return torch.ops.moe_offload_native.decode_attention(query, key, value, attention_mask, float(scale)), None
    return native().decode_attention(query, key, value, attention_mask, scale), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(model: torch.nn.Module) -> bool:
    """Select the kernel's attention on ``model`` (a transformers model on the CPU that uses sdpa; module
    docstring); returns whether it did. Nothing changes without the kernel, or when the model uses another
    implementation or cannot change it."""
    kernel = native_ops()  # the operator a compiled step calls, registered before it compiles
    config = getattr(model, "config", None)
    if (kernel is None or config is None or getattr(config, "_attn_implementation", None) != "sdpa"
            or not hasattr(model, "set_attn_implementation")):
        return False
    can = getattr(model, "_can_set_attn_implementation", None)
    if can is not None and not can():
        return False
    _register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError):  # an implementation transformers refuses for this model: sdpa stays
        model.set_attn_implementation("sdpa")
        return False
    return config._attn_implementation == NAME
