"""Whether a checkpoint can be served, decided from the model transformers builds (DESIGN.md §11).

A model type is served when (1) transformers knows it (no remote code), (2) it has a text-generation class
(causal LM; a multimodal checkpoint's image-text-to-text or multimodal-LM class, served for text-only prompts), (3)
the model built on the meta device has experts modules declared through ``ExpertsInterface``
(``@use_experts_implementation``: ``num_experts``, ``has_gate``, ``has_bias``, ``is_transposed``,
``has_post_expert_norm``, ``_apply_gate``), (4) their routed-expert parameters are the layout the engine computes
(``gate_up_proj`` or ``up_proj``, ``down_proj``, with ``*_bias`` when ``has_bias``), the same shapes in every MoE
layer. The geometry (MoE layers, experts, top-k, which decoder layers are dense) is read from the built model and
its config. Each failed condition is a one-line ``NotServedError`` (a ``MoeOffloadError``) that says which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import MoeOffloadError, NotServedError

#: config fields that name the router's top-k, in the order they are tried (text config first, then the top one)
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts",
                "experts_per_token", "top_k")
#: the ExpertsInterface attributes the engine reads on every experts module
REQUIRED_ATTRS = ("num_experts", "has_gate", "has_bias", "is_transposed", "has_post_expert_norm", "_apply_gate")


@dataclass(frozen=True)
class Geometry:
    """A model's routed-expert geometry, read from the model built from its config.

    Attributes:
        num_layers: decoder layers (the text config's ``num_hidden_layers``).
        moe_layers: decoder layer index of each MoE layer (experts module), in model order (-1: not under a
            numbered layer list).
        num_experts: routed experts per MoE layer.
        top_k: experts per token.
        expert_params: ``((name, per-expert shape), ...)`` of the experts' fused parameters.
        multimodal: built through an image-text-to-text / multimodal-LM class (served for text-only prompts).
    """

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_params: tuple[tuple[str, tuple[int, ...]], ...]
    multimodal: bool = False

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Decoder layers without routed experts (dense MLP, or no MLP)."""
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)


def generation_class(config):
    """``(auto_class, multimodal)``: the transformers Auto class that builds ``config``'s text-generation model —
    ``AutoModelForCausalLM``, else ``AutoModelForImageTextToText`` / ``AutoModelForMultimodalLM`` — and whether the
    checkpoint is multimodal (such a class, or a composite config with a text sub-config): served for text-only
    prompts.

    Raises:
        NotServedError: no text-generation class for the model type.
    """
    import transformers
    from transformers.models.auto import modeling_auto as ma

    for name, multimodal in (("AutoModelForCausalLM", False), ("AutoModelForImageTextToText", True),
                             ("AutoModelForMultimodalLM", True)):
        auto = getattr(transformers, name, None)
        if auto is not None and type(config) in auto._model_mapping:
            return auto, multimodal or text_config(config) is not config
    mt = config.model_type
    tasks = [n.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower().replace("_", "-")
             for n in dir(ma) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES")
             and mt in getattr(ma, n)]
    raise NotServedError(f"model_type {mt!r} has no text-generation class in transformers (causal LM or "
                          f"image-text-to-text); it has: {', '.join(tasks) or 'none'}")


def build_meta(config, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``config``'s text-generation model built on the meta device (no memory).

    Raises:
        NotServedError: no text-generation class.
        MoeOffloadError: transformers cannot build the model from the config (the
            message carries transformers' own reason).
    """
    auto, _ = generation_class(config)
    try:
        with torch.device("meta"):
            return auto.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    except Exception as e:
        raise MoeOffloadError(f"transformers cannot build {config.model_type} from this config: "
                              f"{type(e).__name__}: {_first_line(e)}") from None


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``[(qualified_name, module)]`` of every experts module declared with ``@use_experts_implementation``, in
    model order (one per MoE layer)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "is_transposed") and hasattr(m, "has_gate") and hasattr(m, "_apply_gate")]


def expert_params(mod: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The routed-expert parameters of an experts module: its own parameters shaped ``[num_experts, ...]``."""
    n = mod.num_experts
    return [(name, p) for name, p in mod.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == n]


def _expected_params(mod: torch.nn.Module) -> set[str]:
    up = "gate_up_proj" if mod.has_gate else "up_proj"
    names = {up, "down_proj"}
    return names | {f"{n}_bias" for n in names} if mod.has_bias else names


def check_experts(model_type: str, mods: list) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Check that the experts modules are what the engine computes; return their ``(name, per-expert shape)``.

    Raises:
        NotServedError: no experts modules (a dense model, or experts not declared through ExpertsInterface), a
            missing ExpertsInterface attribute, an expert parameter layout the engine does not know, or experts of
            different shapes across layers.
    """
    if not mods:
        raise NotServedError(f"{model_type} declares no experts through transformers' ExpertsInterface "
                              "(@use_experts_implementation): a dense model, or an MoE whose experts transformers "
                              "implements another way")
    first = mods[0][1]
    missing = [a for a in REQUIRED_ATTRS if not hasattr(first, a)]
    if missing:
        raise NotServedError(f"{model_type}: experts module {type(first).__name__} lacks the ExpertsInterface "
                              f"attributes {', '.join(missing)}")
    if first.has_post_expert_norm and not isinstance(getattr(first, "post_expert_norm", None), torch.nn.Module):
        raise NotServedError(f"{model_type}: has_post_expert_norm but no post_expert_norm module")
    shapes = tuple((n, tuple(p.shape[1:])) for n, p in expert_params(first))
    got, want = {n for n, _ in shapes}, _expected_params(first)
    if got != want:
        raise NotServedError(f"{model_type}: expert parameters {sorted(got)} of {type(first).__name__} are not a "
                              f"layout the engine knows (has_gate={first.has_gate}, has_bias={first.has_bias} "
                              f"means {sorted(want)})")
    for name, mod in mods:
        if tuple((n, tuple(p.shape[1:])) for n, p in expert_params(mod)) != shapes or \
                mod.num_experts != first.num_experts:
            raise NotServedError(f"{model_type}: experts of different shapes in different MoE layers ({name} vs "
                                  f"{mods[0][0]}) are not supported: a slot holds one expert size")
    return shapes


def top_k(config) -> int:
    """Experts per token from the config (text config first; ``TOP_K_FIELDS``).

    Raises:
        NotServedError: no top-k field.
    """
    for cfg in (text_config(config), config):
        for name in TOP_K_FIELDS:
            v = getattr(cfg, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    raise NotServedError(f"{config.model_type}: config has no top-k field (one of {', '.join(TOP_K_FIELDS)})")


def text_config(config):
    """The decoder's text config of a composite (multimodal) config, or ``config`` itself."""
    try:
        return config.get_text_config(decoder=True)
    except Exception:
        return config


def _layer_index(name: str) -> int:
    m = re.search(r"\.(\d+)\.", f".{name}.")
    return int(m.group(1)) if m else -1


def inspect_model(config, dtype: torch.dtype | None = None):
    """Build ``config``'s model on the meta device and check it is servable.

    Returns:
        ``(model, mods, geometry)``: the meta model, its experts modules ``[(name, module)]`` and its ``Geometry``.

    Raises:
        NotServedError: any condition of the module docstring (one line, says which).
        MoeOffloadError: transformers cannot build the model from the config.
    """
    _, multimodal = generation_class(config)
    check_config(text_config(config))
    model = build_meta(config, dtype)
    mods = experts_modules(model)
    shapes = check_experts(config.model_type, mods)
    k = top_k(config)
    if k > mods[0][1].num_experts:
        raise NotServedError(f"{config.model_type}: top-k {k} exceeds the {mods[0][1].num_experts} experts")
    geo = Geometry(int(getattr(text_config(config), "num_hidden_layers", 0) or 0),
                   tuple(_layer_index(n) for n, _ in mods), mods[0][1].num_experts, k, shapes, multimodal)
    return model, mods, geo


#: sizes that must be positive where a config has them
POSITIVE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts")


def check_config(cfg) -> None:
    """A config checked against itself before any work (one line naming the key and the values).

    Raises:
        NotServedError: a size that is not positive, top-k above the experts, or group-limited routing whose
            ``n_group`` does not divide the experts or whose ``topk_group`` exceeds ``n_group``.
    """
    for key in POSITIVE_SIZES:
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
            raise NotServedError(f"config.json: {key} = {v} must be positive")
    experts = next((getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(cfg, k, None), int)), None)
    k = next((getattr(cfg, f) for f in TOP_K_FIELDS if isinstance(getattr(cfg, f, None), int)), None)
    if experts and k is not None and k > experts:
        raise NotServedError(f"config.json: top-k {k} exceeds the {experts} experts")
    groups, topk_groups = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)
    if isinstance(groups, int) and groups > 0 and experts:
        if experts % groups:
            raise NotServedError(f"config.json: n_group = {groups} does not divide the {experts} experts")
        if isinstance(topk_groups, int) and topk_groups > groups:
            raise NotServedError(f"config.json: topk_group = {topk_groups} exceeds n_group = {groups}")


def _first_line(e: Exception) -> str:
    while e.__cause__ is not None and "validation error" in str(e):
        e = e.__cause__
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:240]
