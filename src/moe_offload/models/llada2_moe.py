"""LLaDA2-MoE (inclusionAI LLaDA2.0-mini/flash, TIDE's model) as transformers classes (DESIGN.md §4).

LLaDA2 is not in transformers; its published checkpoints ship remote code. This module re-implements the
architecture from the published config keys and checkpoint key layout, built from transformers' own pieces
(GLM-4-MoE's RMSNorm, partial rotary embedding and MLP; Qwen2-MoE's fused experts class declared with
``@use_experts_implementation``), so that the generic offloaded experts path serves it unchanged:

* ``model.word_embeddings``, ``model.layers.{i}.input_layernorm``, ``...attention.query_key_value`` (fused QKV,
  GQA), ``...attention.dense``, ``...attention.query_layernorm`` / ``key_layernorm`` (RMSNorm qk-norm over
  ``head_dim``), ``...post_attention_layernorm``, ``model.norm``, ``lm_head``;
* layers ``i < first_k_dense_replace``: a dense SwiGLU ``mlp.{gate,up,down}_proj``;
* other layers: ``mlp.gate.weight`` + ``mlp.gate.expert_bias`` (router), ``mlp.shared_experts.{gate,up,down}_proj``
  and routed experts stored per expert in the checkpoint (``mlp.experts.{e}.{gate,up,down}_proj.weight``) but held
  in the model as fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (transformers' conversion mapping,
  registered below, fuses them on load and splits them on save).

Attention is non-causal (a diffusion LM): without a mask every token sees every token; the block-diffusion loop
(``generation.diffusion``) passes an explicit block-causal mask. Rotary embedding is applied to the first
``partial_rotary_factor * head_dim`` channels of every head (rotate-half convention).

Importing this module registers ``model_type = "llada2_moe"`` with ``AutoConfig``, ``AutoModelForCausalLM`` and
transformers' checkpoint conversion mapping (``register()``, idempotent; ``moe_offload.models`` imports it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMLP as LLaDA2MoeMLP
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm as LLaDA2MoeRMSNorm
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.glm4_moe.modeling_glm4_moe import eager_attention_forward
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

from .llada2_config import MODEL_TYPE, LLaDA2MoeConfig

class LLaDA2MoeGate(nn.Module):
    """Router of one MoE layer: ``weight [E, H]`` and ``expert_bias [E]`` (float32 buffer; checkpoint key
    ``mlp.gate.expert_bias``).

    Scores are ``sigmoid(hidden @ weight.T)`` in float32. Selection is group-limited top-k on the *biased* scores
    ``scores + expert_bias``: the E experts form ``n_group`` groups of E / n_group, each group is ranked by the sum of
    its two best biased scores, only the ``topk_group`` best groups stay eligible, and the top ``num_experts_per_tok``
    eligible experts are chosen. The weights are the *unbiased* scores of the chosen experts, renormalised to sum
    to 1 (``norm_topk_prob``, k > 1), times ``routed_scaling_factor``: the bias steers selection only (auxiliary-
    loss-free load balancing, as in DeepSeek-V3).
    """

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.norm_topk_prob = config.norm_topk_prob
        self.score_function = config.score_function
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))
        if config.moe_router_enable_expert_bias:
            self.expert_bias = nn.Buffer(torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden_states [..., H]`` -> ``(router_logits [T, E] float32, top_k_weights [T, k] float32,
        top_k_index [T, k] int64)`` with ``T`` the number of tokens (transformers' router convention)."""
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.float(), self.weight.float())
        if self.score_function == "sigmoid":
            scores = router_logits.sigmoid()
        else:
            scores = router_logits.softmax(dim=-1)
        biased = scores if self.expert_bias is None else scores + self.expert_bias.float()
        per_group = self.num_experts // self.n_group
        group_scores = biased.view(-1, self.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        biased = biased.masked_fill(expert_mask == 0, float("-inf"))
        top_k_index = torch.topk(biased, k=self.top_k, dim=-1)[1]
        top_k_weights = scores.gather(1, top_k_index)
        if self.norm_topk_prob and self.top_k > 1:
            top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, top_k_weights * self.routed_scaling_factor, top_k_index


class LLaDA2MoeExperts(Qwen2MoeExperts):
    """Routed experts of one MoE layer as fused parameters: ``gate_up_proj [E, 2I, H]`` (gate rows then up rows),
    ``down_proj [E, H, I]``; SwiGLU (``config.hidden_act``).

    This is transformers' Qwen2-MoE experts class (declared with ``@use_experts_implementation``: concatenated
    gate;up, not transposed, no bias), so its forward dispatches on ``config._experts_implementation`` — eager,
    grouped_mm, or moe-offload's offloaded implementation. Called as ``experts(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
    """


class LLaDA2MoeSparseMoeBlock(nn.Module):
    """MoE feed-forward: router ``gate``, routed ``experts`` and (``num_shared_experts`` > 0) one always-active
    ``shared_experts`` SwiGLU of width ``moe_intermediate_size * num_shared_experts``. ``[B, S, H] -> [B, S, H]``."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.gate = LLaDA2MoeGate(config)
        self.experts = LLaDA2MoeExperts(config)
        n_shared = config.num_shared_experts or 0
        self.shared_experts = (LLaDA2MoeMLP(config, intermediate_size=config.moe_intermediate_size * n_shared)
                               if n_shared > 0 else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        _, top_k_weights, top_k_index = self.gate(hidden_states)
        flat = hidden_states.reshape(-1, shape[-1])
        out = self.experts(flat, top_k_index, top_k_weights).view(shape)  # float32 weights, as DeepSeek-V3/GLM
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class LLaDA2MoeAttention(nn.Module):
    """Non-causal GQA self-attention with fused ``query_key_value``, output ``dense``, RMSNorm qk-norm
    (``query_layernorm``/``key_layernorm`` over ``head_dim``, before rotary) and partial rotary embedding.

    ``attention_mask`` is ``None`` (every token sees every key) or an additive float mask ``[B, 1, Q, K]``
    (0 = attend, very negative = masked), as prepared by ``LLaDA2MoeModel``.
    """

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        self.query_key_value = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                         bias=config.use_qkv_bias)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.query_layernorm = LLaDA2MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = LLaDA2MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: Cache | None = None, **kwargs):
        """``hidden_states [B, S, H]`` -> ``(out [B, S, H], attention weights or None)``."""
        bsz, q_len, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(bsz, q_len, self.num_heads + 2 * self.num_kv_heads,
                                                       self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                             eager_attention_forward)
        out, weights = attention_interface(self, q, k, v, attention_mask, scaling=self.scaling,
                                           dropout=0.0 if not self.training else self.attention_dropout,
                                           is_causal=False)
        return self.dense(out.reshape(bsz, q_len, -1).contiguous()), weights


class LLaDA2MoeDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``input_layernorm`` -> ``attention`` -> residual, ``post_attention_layernorm`` -> ``mlp``
    (dense for ``layer_idx < first_k_dense_replace``, else MoE) -> residual."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.attention = LLaDA2MoeAttention(config, layer_idx)
        self.mlp = (LLaDA2MoeSparseMoeBlock(config) if layer_idx >= config.first_k_dense_replace
                    else LLaDA2MoeMLP(config, intermediate_size=config.intermediate_size))
        self.input_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, cache: Cache | None = None,
                **kwargs) -> torch.Tensor:
        """``[B, S, H] -> [B, S, H]``."""
        residual = hidden_states
        hidden_states, _ = self.attention(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                          cache=cache)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LLaDA2MoeRotaryEmbedding(Glm4MoeRotaryEmbedding):
    """Rotary cos/sin ``[B, S, rotary_dim]`` with ``rotary_dim = partial_rotary_factor * head_dim`` (GLM-4-MoE's)."""


class LLaDA2MoePreTrainedModel(PreTrainedModel):
    """Weight init and transformers capabilities shared by the LLaDA2-MoE models."""

    config_class = LLaDA2MoeConfig
    config: LLaDA2MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = False
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, LLaDA2MoeGate):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.expert_bias is not None:
                init.zeros_(module.expert_bias)
        elif isinstance(module, LLaDA2MoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)


def prepare_attention_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                           dtype: torch.dtype) -> torch.Tensor | None:
    """Normalise a user mask to the additive ``[B, 1, Q, K]`` float mask the attention layers take.

    Accepted: ``None`` (full bidirectional attention; returned as None); a 2-D ``[B, K]`` key-padding mask (1/True =
    a real token; transformers' ``generate`` passes one) — except that a 2-D mask with ``Q > 1`` rows for a batch of
    one is read as ``[Q, K]``; a boolean or 0/1 integer ``[Q, K]``, ``[B, Q, K]`` or ``[B, 1, Q, K]`` mask (True =
    may attend; e.g. ``generation.diffusion.block_causal_mask``); or an additive float mask of those shapes (0 = attend,
    large negative = masked), used as given. A padding mask of all ones becomes None.

    Raises:
        ValueError: a mask whose last dimension is not ``kv_len``.
    """
    if attention_mask is None:
        return None
    m = attention_mask
    if m.shape[-1] != kv_len:
        raise ValueError(f"attention mask covers {m.shape[-1]} keys, the attention has {kv_len}")
    if m.dim() == 2 and m.shape[0] == batch and not (m.shape[0] == q_len and batch == 1 and q_len > 1):
        if bool((m != 0).all()):
            return None
        m = (m != 0)[:, None, None, :].expand(batch, 1, q_len, kv_len)
    elif m.dim() == 2:
        m = m[None, None]
    elif m.dim() == 3:
        m = m[:, None]
    if m.dtype == torch.bool or not m.is_floating_point():
        allowed = m.bool()
        return torch.zeros(allowed.shape, dtype=dtype, device=m.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return m.to(dtype)


class LLaDA2MoeModel(LLaDA2MoePreTrainedModel):
    """The decoder stack: ``word_embeddings``, ``layers``, final ``norm`` and the shared rotary embedding."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LLaDA2MoeRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                past_key_values: Cache | None = None, **kwargs) -> MoeModelOutputWithPast:
        """``input_ids [B, S]`` (or ``inputs_embeds [B, S, H]``) -> ``last_hidden_state [B, S, H]``.

        ``attention_mask``: see ``prepare_attention_mask`` (None = bidirectional over the cache and the input).
        ``position_ids [B, S]`` default to ``past + arange(S)``. With ``use_cache`` a ``DynamicCache`` keeps the
        keys/values (autoregressive use); the block-diffusion loop passes its own block-prefix cache
        (``generation.diffusion_forward.BlockPrefixCache``: ``update`` / ``get_seq_length``), or none with
        ``--no-prefix-cache``.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = self.config.use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        batch, q_len = inputs_embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(q_len, device=inputs_embeds.device) + past).unsqueeze(0)
        mask = prepare_attention_mask(attention_mask, batch, q_len, past + q_len, inputs_embeds.dtype)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings,
                                  cache=cache)
        return MoeModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


class LLaDA2MoeModelLM(LLaDA2MoePreTrainedModel, GenerationMixin):
    """LLaDA2-MoE with its LM head (the published ``architectures`` name ``LLaDA2MoeModelLM``).

    ``forward(input_ids [B, S], attention_mask=None, position_ids=None, cache=None, use_cache=None)`` returns
    ``logits [B, S, V]`` for *every* position (a masked-diffusion LM predicts each position's own token, not the
    next one) and the cache. Block-diffusion generation: ``moe_offload.generation.diffusion``.
    """

    _tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.model = LLaDA2MoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def set_input_embeddings(self, value):
        self.model.word_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                past_key_values: Cache | None = None, logits_to_keep: int = 0,
                **kwargs) -> MoeCausalLMOutputWithPast:
        """See the class docstring; ``logits_to_keep`` > 0 keeps only the last positions' logits."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return MoeCausalLMOutputWithPast(logits=self.lm_head(hidden), cache=out.cache)


def conversion_mapping() -> list:
    """transformers checkpoint conversion for ``llada2_moe``: per-expert ``mlp.experts.{e}.gate_proj/up_proj.weight``
    -> fused ``mlp.experts.gate_up_proj`` (experts stacked on dim 0, gate;up concatenated on dim 1) and
    ``mlp.experts.{e}.down_proj.weight`` -> ``mlp.experts.down_proj``; every other key already has the model's
    name. The same converters as transformers' ``qwen2_moe`` entry; reversed by ``save_pretrained``."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    return [
        WeightConverter(source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                        target_patterns="mlp.experts.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns="mlp.experts.*.down_proj.weight", target_patterns="mlp.experts.down_proj",
                        operations=[MergeModulelist(dim=0)]),
    ]


_registered = False


def register() -> None:
    """Register ``llada2_moe`` with ``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` and transformers'
    checkpoint conversion mapping. Idempotent; runs on ``import moe_offload.models``."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    AutoConfig.register(MODEL_TYPE, LLaDA2MoeConfig, exist_ok=True)
    AutoModel.register(LLaDA2MoeConfig, LLaDA2MoeModel, exist_ok=True)
    AutoModelForCausalLM.register(LLaDA2MoeConfig, LLaDA2MoeModelLM, exist_ok=True)
    register_checkpoint_conversion_mapping(MODEL_TYPE, conversion_mapping(), overwrite=True)
    _registered = True


register()
