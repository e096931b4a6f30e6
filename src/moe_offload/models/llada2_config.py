"""LLaDA2-MoE's configuration (``model_type = "llada2_moe"``): the published ``config.json`` keys, their defaults
(LLaDA2.0-mini) and the geometry checks the modules rely on. The modules, the conversion mapping and the
registration with transformers' Auto classes are ``models.llada2_moe``.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

MODEL_TYPE = "llada2_moe"


@strict
class LLaDA2MoeConfig(PreTrainedConfig):
    """Configuration of LLaDA2-MoE; the defaults are LLaDA2.0-mini's published ``config.json``.

    The keys are the published ones (hidden_size 2048, num_hidden_layers 20, first_k_dense_replace 1, num_experts 256,
    num_shared_experts 1, num_experts_per_tok 8, moe_intermediate_size 512, n_group 8, topk_group 4,
    routed_scaling_factor 2.5, partial_rotary_factor 0.5, 16 query / 4 key-value heads of head_dim 128, qk-norm,
    score_function "sigmoid", moe_router_enable_expert_bias...). ``mask_token_id`` (156895 in LLaDA2's vocabulary)
    is the mask token of the block-diffusion loop; published checkpoints name it only in their generate code, so
    it defaults here and may be overridden in ``config.json``. ``rope_theta`` and ``partial_rotary_factor`` are folded
    into transformers' ``rope_parameters``. Keys of the published config that do not change inference
    (``embedding_dropout``, ``output_dropout``, ``router_dtype``, ``rotary_dim``, ``use_sliding_window``...) are kept
    for round-tripping.
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int | None = 128
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    use_qk_norm: bool = True
    use_bias: bool = False
    rms_norm_eps: float | int = 1e-6
    norm_head: bool = False
    tie_word_embeddings: bool = False
    embedding_dropout: float | int = 0.0
    attention_dropout: float | int = 0.0
    output_dropout: float | int = 0.0
    initializer_range: float | int = 0.02
    max_position_embeddings: int = 16384
    rope_parameters: dict | None = None
    use_cache: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    num_experts: int = 256
    num_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float | int = 2.5
    moe_intermediate_size: int = 512
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    output_router_logits: bool = False
    mask_token_id: int = 156895
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 156892
    pad_token_id: int | None = 156892

    def __post_init__(self, **kwargs):
        kwargs.setdefault("rope_theta", 600000.0)
        kwargs.setdefault("partial_rotary_factor", 0.5)
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)

    def to_dict(self) -> dict:
        """The config as saved: transformers' ``rope_parameters`` plus the published top-level ``rope_theta`` and
        ``partial_rotary_factor``."""
        out = super().to_dict()
        rope = out.get("rope_parameters") or {}
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope:
                out[key] = rope[key]
        return out

    def validate_architecture(self):
        """Checks the geometry the modules rely on. Raises ValueError (transformers' config convention)."""
        super().validate_architecture()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError("num_experts must be a multiple of n_group, and topk_group <= n_group")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError("num_experts_per_tok exceeds the experts of topk_group groups")
        if self.score_function not in ("sigmoid", "softmax"):
            raise ValueError(f"score_function must be 'sigmoid' or 'softmax', got {self.score_function!r}")
        if self.norm_head:
            raise ValueError("norm_head=True (a normalised LM head) is not implemented; LLaDA2 checkpoints use False")
