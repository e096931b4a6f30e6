"""A tiny configuration of any model type by a generic shrink of its default configuration.

No per-architecture table: a model type's default configuration (``CONFIG_MAPPING[model_type]()``, the published
model's sizes) is shrunk field by field with rules keyed on the field *name*, the same for every architecture
(hidden sizes, heads, expert counts, top-k, ranks, vocabulary), recursing into sub-configurations (``text_config``;
vision / audio encoders get the encoder rules). The number of layers is chosen from the model itself: the model
is built on the meta device at its default depth with the shrunk widths, every decoder layer gets a signature
(its module classes and its entries in per-layer lists such as ``layer_types`` / ``mlp_layer_types``), and the
tiny model keeps the shortest prefix of layers that has every signature (dense and MoE layers, linear attention
or Mamba between attention layers, sliding and full attention), at least ``MIN_LAYERS``. Per-layer lists are cut
to that prefix.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..errors import MoeOffloadError, NotServedError
from .capability import text_config as _text_config

HIDDEN = 64           # text hidden size
MIN_LAYERS = 3        # layers at least (so a prefix always has more than one MoE layer where the model has them)
MAX_LAYERS = 24       # cap on the prefix (a pattern longer than this is cut)
EXPERTS = 16
TOP_K = 4

#: field -> value, applied when the default is a positive int
_EXACT = {
    "hidden_size": HIDDEN, "moe_hidden_size": HIDDEN, "router_hidden_size": 32, "projector_hidden_size": HIDDEN,
    "intermediate_size": 64, "dense_intermediate_size": 64, "prefix_dense_intermediate_size": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "shared_experts_intermediate_size": 64,
    "shared_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
    "num_attention_heads": 4, "swa_num_attention_heads": 4,
    "head_dim": 16, "swa_head_dim": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "indexer_head_dim": 16, "linear_head_dim": 16, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "mamba_head_dim": 16, "mamba_d_head": 16,
    "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16, "gated_norm_rank": 8, "loop_gate_rank": 8,
    "hc_lowrank": 16, "index_n_heads": 4, "indexer_n_heads": 4, "linear_num_heads": 4, "heads_per_ngram": 2,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 8, "hidden_size_per_layer_input": 16,
    "ple_embed_dim": 16, "ngram_vocab_size_base": 512, "rotary_dim": 8, "moe_latent_size": 32,
}
#: boolean fields that switch a default (dense) configuration's MoE blocks on (Gemma 4)
_MOE_ON = ("enable_moe_block",)
#: field -> cap (min(default, cap)) for positive ints
_CAP = {
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_topk": TOP_K, "moe_k": TOP_K,
    "top_k_experts": TOP_K, "n_group": 4, "num_expert_group": 4, "topk_group": 2, "index_topk": 16,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "first_k_dense_replace": 1,
    "num_dense_layers": 1, "moe_layer_start_index": 1, "n_groups": 2, "sliding_window": 32,
    "sliding_window_size": 32, "index_block_size": 16, "max_position_embeddings": 512,
    "index_num_heads": 2,  # Kolibri: at most the query heads per key head (4 / 2)
}
#: fields a default configuration may leave unset (None) although its model needs them (the published checkpoints
#: set them): the tiny value
_FILL = {"num_experts_per_tok": TOP_K, "top_k_experts": TOP_K, "n_routed_experts": EXPERTS, "num_experts": EXPERTS,
         "head_dim": 16, "n_shared_experts": 1, "moe_intermediate_size": 32,
         "mlp_layer_types": ["dense"] + ["sparse"] * (MIN_LAYERS - 1),
         "layer_types": ["full_attention"] * MIN_LAYERS,
         "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
         "indexer_compress_ratio": 4}
#: per model type, fields its default configuration leaves unset (None) although its model needs them, where the
#: field's being set changes other models (a set ``sliding_window`` gives a model sliding cache layers): Step3p7
#: builds a sliding-window mask whether or not a layer slides (its published checkpoints set the window)
_FILL_BY_TYPE = {"step3p7": {"sliding_window": 32}}
#: vision / audio encoder sub-configs (shrunk with ``_ENCODER``)
_ENCODER_NAME = re.compile(r"vision|audio|encoder|sam_|speech|visual")
_ENCODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "depth": 1, "num_layers": 1,
            "num_heads": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "out_hidden_size": HIDDEN, "output_dim": HIDDEN, "projection_dim": HIDDEN, "d_model": 32,
            "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "num_mel_bins": 16,
            "global_layers": 1, "n_window": 4}
_VOCAB_FIELDS = ("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size")


def _fields(config) -> dict:
    """``{field name: resolved value}`` of a config's dataclass fields (per-layer-ambiguous ones left out)."""
    out = {}
    for f in dataclasses.fields(type(config)):
        try:
            out[f.name] = getattr(config, f.name)
        except Exception:  # a heterogeneous per-layer attribute read globally: its global value
            if f.name in vars(config):
                out[f.name] = vars(config)[f.name]
    return out


def _kv_heads(value: int, heads: int) -> int:
    """Key/value heads of the shrunk model (4 query heads): MHA stays MHA, MQA stays MQA, GQA becomes 4/2."""
    if value >= heads:
        return 4
    return 1 if value == 1 else 2


def _shrink_values(vals: dict, vocab_size: int) -> dict:
    """Overrides of a text (decoder) config's field values ``vals`` (also used for one layer's overrides)."""
    out = {}
    heads = vals.get("num_attention_heads") or 4
    for name, v in vals.items():
        if name in _VOCAB_FIELDS and isinstance(v, int) and v > 0:
            out[name] = vocab_size
        elif name in _EXACT and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[name] = _EXACT[name]
        elif name in _CAP and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[name] = min(v, _CAP[name])
            if _CAP[name] == EXPERTS and v == 1:  # a one-expert default (HunYuan): an MoE needs several
                out[name] = EXPERTS
        elif name in _FILL and v is None:
            out[name] = _FILL[name]
        elif name in _MOE_ON and v is False:
            out[name] = True
        elif name in _EXACT and isinstance(v, list) and v and all(isinstance(x, int) and x > 0 for x in v):
            out[name] = [max(8, _EXACT[name] * x // v[0]) for x in v]  # per-kind sizes keep their ratios
        elif name in ("num_key_value_heads", "swa_num_key_value_heads") and isinstance(v, int) and v > 0:
            out[name] = _kv_heads(v, vals.get("swa_num_attention_heads" if name.startswith("swa") else
                                              "num_attention_heads") or heads)
    k, vh = vals.get("linear_num_key_heads"), vals.get("linear_num_value_heads")
    if isinstance(k, int) and isinstance(vh, int) and k > 0 and vh % k == 0:
        out["linear_num_key_heads"], out["linear_num_value_heads"] = 2, 2 * (vh // k)
    for name in ("mamba_n_heads", "mamba_num_heads"):
        if isinstance(vals.get(name), int):
            expand = vals.get("mamba_expand") or vals.get("expand") or 2
            out[name] = HIDDEN * expand // 16
    _keep_relations(vals, out)
    if isinstance(vals.get("rope_parameters"), dict) and "mrope" in repr(vals["rope_parameters"]):
        out["rope_parameters"] = _scale_mrope(vals["rope_parameters"], vals, out)
    return out


def _scale_mrope(rope: dict, vals: dict, out: dict) -> dict:
    """``rope_parameters`` with every ``mrope_section`` (multimodal rotary split of the rotary half-dims) scaled to
    the shrunk rotary dim."""
    dim_name = "qk_rope_head_dim" if isinstance(vals.get("qk_rope_head_dim"), int) else "head_dim"
    old = vals.get(dim_name) or (vals["hidden_size"] // vals["num_attention_heads"])
    new = out.get(dim_name, old)
    res = {}
    for k, v in rope.items():
        if isinstance(v, dict):
            res[k] = _scale_mrope(v, vals, out)
        elif k == "mrope_section" and isinstance(v, (list, tuple)) and v:
            total = max(len(v), sum(v) * new // old)
            sec = [max(1, x * total // sum(v)) for x in v]
            sec[0] += total - sum(sec)
            res[k] = sec
        else:
            res[k] = v
    return res


def _keep_relations(vals: dict, out: dict) -> None:
    """Keep the default's head-dim identities (MLA: ``head_dim = qk_nope + qk_rope`` or ``= qk_rope``)."""
    nope, rope, hd = (vals.get(n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "head_dim"))
    if isinstance(hd, int) and isinstance(rope, int) and "head_dim" in out:
        if isinstance(nope, int) and hd == nope + rope:
            out["head_dim"] = out.get("qk_nope_head_dim", nope) + out.get("qk_rope_head_dim", rope)
        elif hd == rope:
            out["head_dim"] = out.get("qk_rope_head_dim", rope)


def _per_layer(config) -> dict:
    """``{layer: {field: value}}``: a heterogeneous config's per-layer overrides (transformers' heterogeneity
    integration), or ``{}``."""
    spec = getattr(config, "_heterogeneity_spec", None)
    return dict(getattr(spec, "per_layer_overrides", None) or {})


def _fill_mrope(config, vals: dict, out: dict) -> None:
    """A config that declares a multimodal rotary split (``mrope_section``) but leaves it to the model's built-in
    default (sized for the published head dim) gets one that fits the shrunk rotary dim."""
    rope = vals.get("rope_parameters")
    if not isinstance(rope, dict) or "mrope_section" in repr(rope) or \
            "mrope_section" not in (getattr(type(config), "ignore_keys_at_rope_validation", None) or ()):
        return
    half = int(out.get("head_dim", 16) * rope.get("partial_rotary_factor", 1.0)) // 2
    if half >= 3 and "rope_type" in rope:
        third = -(-half // 3)
        out["rope_parameters"] = {**rope, "mrope_section": [third, third, half - 2 * third]}


def _shrink_text(config, vocab_size: int) -> dict:
    """Overrides of a text (decoder) config, per-layer overrides included."""
    vals = _fields(config)
    out = _shrink_values(vals, vocab_size)
    _fill_mrope(config, vals, out)
    if any(isinstance(v, list) for n, v in out.items() if n in _FILL):  # a filled per-layer list sets the depth
        out["num_hidden_layers"] = MIN_LAYERS
    per_layer = _per_layer(config)
    if per_layer:
        layers = {}
        for i, ov in per_layer.items():  # the layer's own fields, and a head_dim its identities need
            shrunk = {**ov, **_shrink_values({**vals, **ov}, vocab_size)}
            layers[i] = {k: v for k, v in shrunk.items()
                         if k in ov or (k == "head_dim" and v != out.get("head_dim", vals.get("head_dim")))}
        out["per_layer_config"] = layers
    return out


def _shrink_encoder(config, text_hidden: int | None = None) -> dict:
    """Overrides of a vision / audio encoder config (and of its own sub-configs): ``_ENCODER`` sizes, one layer
    (per-layer lists cut to it), and every size field equal to the encoder's own hidden size or to the text
    model's (``text_hidden``, e.g. a projector's output) mapped to the shrunk one."""
    vals = _fields(config)
    out = {n: _ENCODER[n] for n, v in vals.items()
           if n in _ENCODER and isinstance(v, int) and not isinstance(v, bool) and v > 0}
    own = vals.get("hidden_size")
    layers = next((vals[n] for n in ("num_hidden_layers", "depth", "num_layers") if isinstance(vals.get(n), int)),
                  None)
    for n, v in vals.items():
        if n in out or isinstance(v, bool) or not re.search(r"dim|size|hidden", n):
            continue
        if isinstance(v, int) and v > 0 and v == text_hidden:
            out[n] = HIDDEN
        elif isinstance(v, int) and v > 0 and v == own:
            out[n] = _ENCODER["hidden_size"]
    for n, v in vals.items():
        if isinstance(v, (list, tuple)) and layers and len(v) == layers and layers > 1 and n not in out:
            first = v[0]
            if isinstance(first, int) and not isinstance(first, bool) and re.search(r"hidden|dim|size", n):
                first = _ENCODER["hidden_size"]
            elif isinstance(first, int) and not isinstance(first, bool) and re.search(r"depth|layers", n):
                first = 1
            out[n] = [first]
    per_layer = _per_layer(config)
    if per_layer:  # an encoder of one layer keeps layer 0's overrides
        out["per_layer_config"] = {i: ov for i, ov in per_layer.items() if i < 1}
    for name, sub in _sub_configs(config).items():
        out[name] = _shrink_encoder(sub, text_hidden)
    return out


def _sub_configs(config) -> dict:
    """``{field: sub-config}`` of a composite config."""
    from transformers import PreTrainedConfig

    return {n: v for n, v in _fields(config).items() if isinstance(v, PreTrainedConfig)}


def shrink_overrides(config, vocab_size: int, text_hidden: int | None = None) -> dict:
    """Overrides that shrink ``config`` (a default configuration instance), recursively: ``{field: value}`` with
    sub-configurations as ``{field: {...}}`` dicts of *their* overrides."""
    out = _shrink_text(config, vocab_size)
    text_hidden = text_hidden or getattr(_text_config(config), "hidden_size", None)
    for name, sub in _sub_configs(config).items():
        if _ENCODER_NAME.search(name) or _ENCODER_NAME.search(getattr(sub, "model_type", "") or ""):
            out[name] = _shrink_encoder(sub, text_hidden)
        else:
            out[name] = shrink_overrides(sub, vocab_size, text_hidden)
    return out


def _make(model_type: str, overrides: dict):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**overrides)


def _decoder_layers(model: torch.nn.Module, num_layers: int):
    """The ``ModuleList`` of decoder layers (the longest one of ``num_layers`` modules holding experts or
    attention), or None."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers and "vision" not in name \
                and "audio" not in name and (best is None or name.count(".") < best[0].count(".")):
            best = (name, mod)
    return best[1] if best else None


def _entry(name: str, value, index: int):
    """A per-layer list entry as a signature part: a layer reference (``kv_source_layers``) by whether it points at
    its own layer, anything else by value."""
    if name.endswith("_layers") and isinstance(value, int) and not isinstance(value, bool):
        return "self" if value == index else "other"
    return value


def _layer_signatures(model: torch.nn.Module, text, num_layers: int) -> list:
    """One hashable signature per decoder layer: its module classes and its entries in per-layer lists."""
    layers = _decoder_layers(model, num_layers)
    lists = {n: v for n, v in _fields(text).items() if isinstance(v, (list, tuple)) and len(v) == num_layers}
    sigs = []
    for i in range(num_layers):
        classes = () if layers is None else tuple(sorted(
            (n, type(m).__name__) for n, m in layers[i].named_modules()))
        sigs.append((classes, tuple((n, repr(_entry(n, v[i], i))) for n, v in sorted(lists.items())),
                     repr(sorted(_per_layer(text).get(i, {}).items()))))
    return sigs


def _prefix(sigs: list) -> int:
    """Shortest prefix length holding every distinct signature (at least ``MIN_LAYERS``, at most ``MAX_LAYERS``)."""
    need, seen = set(sigs), set()
    for i, s in enumerate(sigs):
        seen.add(s)
        if seen == need:
            return min(max(i + 1, MIN_LAYERS, 1), MAX_LAYERS, len(sigs))
    return min(len(sigs), MAX_LAYERS)


def _text_field(config) -> str | None:
    """Name of the sub-config field holding the text decoder config (None: the config itself)."""
    text = _text_config(config)
    if text is config:
        return None
    for name, sub in _sub_configs(config).items():
        if sub is text:
            return name
    return None


def tiny_config(model_type: str, vocab_size: int, build_meta, **fixed):
    """A tiny configuration of ``model_type``: its default configuration shrunk by ``shrink_overrides``, with the
    layer prefix chosen from the model (see the module docstring) and ``fixed`` text-config fields (token ids,
    ``initializer_range``...) set on the text config.

    Args:
        build_meta: ``config -> model`` built on the meta device (``models.capability.build_meta``).

    Raises:
        MoeOffloadError: the model type is unknown, or its default configuration or the shrunk one cannot be built
            (the message says which and why).
    """
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise NotServedError(f"model_type {model_type!r} is not known to the installed transformers")
    try:
        default = CONFIG_MAPPING[model_type]()
    except Exception as e:
        raise MoeOffloadError(f"{model_type}: its default configuration cannot be built: {_short(e)}") from None
    ov = shrink_overrides(default, vocab_size)
    tf = _text_field(default)
    text_ov = ov if tf is None else ov.setdefault(tf, {})
    text_ov.update(fixed)
    text_default = _text_config(default)
    for name, value in _FILL_BY_TYPE.get(model_type, {}).items():
        if getattr(text_default, name, None) is None:
            text_ov.setdefault(name, value)
    if tf is not None:
        ov.update({k: v for k, v in fixed.items() if k in _fields(default)})
    try:
        config = _make(model_type, ov)
        model = build_meta(config)
    except MoeOffloadError:
        raise
    except Exception as e:
        raise MoeOffloadError(f"{model_type}: the shrunk configuration does not build: {_short(e)}") from None
    n = _cut_layers(_text_config(config), model, text_ov)
    try:
        return _make(model_type, ov)
    except Exception as e:
        raise MoeOffloadError(f"{model_type}: the shrunk {n}-layer configuration does not build: {_short(e)}") \
            from None


def _cut_layers(text, model: torch.nn.Module, text_ov: dict) -> int:
    """Choose the layer prefix of the text config ``text`` (built as ``model`` at its default depth) and write it
    into the text overrides: ``num_hidden_layers``, per-layer lists and overrides cut to it, layer indices kept
    inside it. Returns the number of layers."""
    L = text.num_hidden_layers
    n = _prefix(_layer_signatures(model, text, L))
    vals = _fields(text)
    for name, v in vals.items():  # a layer index the model needs (a loop's end) extends the prefix
        if re.search(r"layer.*(index|start|end)", name) and isinstance(v, int) and n <= v < MAX_LAYERS:
            n = v + 1
    text_ov["num_hidden_layers"] = n
    if "per_layer_config" in text_ov:
        text_ov["per_layer_config"] = {i: v for i, v in text_ov["per_layer_config"].items() if i < n}
    for name, v in vals.items():
        if name in text_ov:
            continue
        if isinstance(v, (list, tuple)) and len(v) == L:
            text_ov[name] = list(v[:n])
        elif isinstance(v, (list, tuple)) and name.endswith(("_layers", "_layer_ids")) \
                and all(isinstance(i, int) for i in v):
            text_ov[name] = [i for i in v if i < n]
        elif re.search(r"layer.*(index|start|end)", name) and isinstance(v, int) and v >= n:
            text_ov[name] = n - 1
    lt = text_ov.get("layer_types")
    if isinstance(lt, list) and lt and set(lt) == {"linear_attention"}:  # an all-linear default (Granite 4 hybrid):
        text_ov["layer_types"] = lt[:-1] + ["full_attention"]  # transformers' cache needs one attention layer
    return n


def _short(e: Exception) -> str:
    while e.__cause__ is not None and "validation error" in str(e):  # a config validator: its own message
        e = e.__cause__
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {msg[:200]}"
