"""Supported architectures: one small adapter each (DESIGN.md §4).

Weight names and the per-expert checkpoint layout are *not* re-derived here: transformers' own checkpoint
conversion mapping (``conversion_mapping``) already knows how per-expert keys become fused parameters, and the
loader (``models.loader``) reads it. An adapter only records what the generic path cannot know: which
``model_type`` we have tested end to end, a human name, and a tiny configuration for random test checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import MoeOffloadError


@dataclass(frozen=True)
class Architecture:
    """An MoE architecture served by the generic offloaded experts implementation.

    Attributes:
        model_type: the ``config.json`` ``model_type``.
        name: human-readable name.
        notes: what is special about its experts (for docs and errors).
        tiny: keyword arguments of a tiny random configuration (``AutoConfig.for_model(model_type, **tiny)``),
            without ``vocab_size`` (set from the tiny tokenizer).
    """

    model_type: str
    name: str
    notes: str
    tiny: dict = field(default_factory=dict)


_ATTN = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in [
    Architecture("qwen3_moe", "Qwen3-MoE", "gate;up concatenated, top-k renormalised",
                 dict(_ATTN, intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                      head_dim=16, norm_topk_prob=True)),
    Architecture("qwen2_moe", "Qwen2-MoE", "plus one gated shared expert (kept on the device)",
                 dict(_ATTN, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      num_experts=16, num_experts_per_tok=4)),
    Architecture("olmoe", "OLMoE", "gate;up concatenated, qk-norm",
                 dict(_ATTN, num_key_value_heads=4, intermediate_size=32, num_experts=16, num_experts_per_tok=4)),
    Architecture("mixtral", "Mixtral", "checkpoint keys block_sparse_moe.experts.{e}.w1/w2/w3",
                 dict(_ATTN, intermediate_size=32, num_local_experts=16, num_experts_per_tok=4)),
    Architecture("gpt_oss", "GPT-OSS", "transposed, interleaved gate/up, biases, clamped SwiGLU",
                 dict(_ATTN, intermediate_size=32, num_local_experts=16, num_experts_per_tok=4, head_dim=16,
                      sliding_window=16)),
    Architecture("deepseek_v3", "DeepSeek-V3", "shared experts, group-limited routing, first dense layers",
                 dict(_ATTN, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                      n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                      n_shared_experts=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                      v_head_dim=16, routed_scaling_factor=2.5)),
]}


def supported_names() -> str:
    """Comma-separated ``model_type``s we serve, for error messages."""
    return ", ".join(ARCHITECTURES)


def architecture_for(model_type: str | None) -> Architecture:
    """The adapter of ``model_type``.

    Raises:
        MoeOffloadError: dense or unsupported architecture (the message names the supported ones).
    """
    arch = ARCHITECTURES.get(model_type or "")
    if arch is None:
        raise MoeOffloadError(
            f"model_type {model_type!r} is not a supported MoE architecture; supported: {supported_names()}")
    return arch
