"""Tiny random checkpoints of any model type, for tests and for trying an architecture in seconds.

The configuration is the model type's default configuration shrunk generically (``models.shrink``: no
per-architecture sizes). Each checkpoint is written with transformers' ``save_pretrained`` of the model type's
richest text-generation class (a multimodal checkpoint keeps its vision tower, as published ones do), so it has the
architecture's published checkpoint key layout, per-expert keys included, plus a 258-token byte-level tokenizer,
so ``--prompt`` works on it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MoeOffloadError
from .registry import DIFFUSION


def tiny_tokenizer(mask_token: bool = False):
    """A byte-level BPE tokenizer without merges: 256 byte tokens + ``<|bos|>`` (256) + ``<|eos|>`` (257), and with
    ``mask_token`` a ``<|mask|>`` (258) for diffusion models (their mask token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|bos|>"] = len(vocab)
    vocab["<|eos|>"] = len(vocab)
    special = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    if mask_token:
        vocab["<|mask|>"] = len(vocab)
        special["mask_token"] = "<|mask|>"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def _token_ids(tok, diffusion: bool) -> dict:
    extra = {"mask_token_id": tok.mask_token_id} if diffusion else {}
    return dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id, tie_word_embeddings=False, initializer_range=0.2, **extra)


def _tokenizer_and_config(arch: str, sizes: dict):
    """The byte-level tokenizer (with a mask token for diffusion models) and a random-checkpoint config of ``arch``
    with explicit ``sizes`` (initializer_range 0.2, untied head; see ``make_tiny``)."""
    from transformers import AutoConfig

    tok = tiny_tokenizer(mask_token=arch in DIFFUSION)
    return tok, AutoConfig.for_model(arch, **_token_ids(tok, arch in DIFFUSION), **sizes)


def tiny_config(model_type: str):
    """The byte-level tokenizer and the tiny configuration of ``model_type`` (its default configuration shrunk by
    ``models.shrink.tiny_config``; token ids from the tokenizer, initializer_range 0.2, untied head).

    Raises:
        MoeOffloadError: the model type is unknown, has no text-generation class, its shrunk configuration does
            not build, or its model is not one the engine serves (``capability.inspect_model``; the message says
            why).
    """
    from .capability import build_meta, inspect_model
    from .shrink import tiny_config as shrink

    tok = tiny_tokenizer(mask_token=model_type in DIFFUSION)
    ids = _token_ids(tok, model_type in DIFFUSION)
    config = shrink(model_type, ids.pop("vocab_size"), build_meta, **ids)
    inspect_model(config)
    return tok, config


@torch.no_grad()
def _random_routing_buffers(model: torch.nn.Module, config) -> None:
    """Routing state a checkpoint stores as buffers, which ``from_config`` leaves at zero, drawn at random as in a
    trained checkpoint: a selection-only router bias (``*expert_bias``, LLaDA2) and token -> expert tables
    (persistent integer buffers ``[..., top_k]``, DeepSeek-V4's hash routing: distinct experts per row)."""
    from .capability import experts_modules, top_k

    k, n = top_k(config), experts_modules(model)[0][1].num_experts
    persistent = set(model.state_dict())
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.normal_(0.0, 0.1)
        elif name in persistent and not buf.is_floating_point() and buf.dim() >= 2 and buf.shape[-1] == k \
                and not buf.any():
            rows = torch.rand(buf.numel() // k, n).argsort(dim=-1)[:, :k]
            buf.copy_(rows.reshape(buf.shape).to(buf.dtype))


def _override(config, overrides: dict):
    """``config`` (a text config) rebuilt with ``overrides``; per-layer lists of the old depth are dropped when the
    depth changes (the config derives them again).

    Raises:
        MoeOffloadError: a composite config, or one the engine does not serve after the change.
    """
    from .capability import inspect_model, text_config

    if text_config(config) is not config:
        raise MoeOffloadError("config_overrides apply to text-only model types")
    d = config.to_dict()
    if "num_hidden_layers" in overrides:
        d = {k: v for k, v in d.items() if not (isinstance(v, list) and len(v) == config.num_hidden_layers)}
    config = type(config).from_dict({**d, **overrides})
    inspect_model(config)
    return config


def _save_class(config):
    """The class a published checkpoint of ``config`` is saved from: its multimodal class when it has one (vision
    tower included), else its causal LM."""
    import transformers

    for name in ("AutoModelForImageTextToText", "AutoModelForMultimodalLM"):
        auto = getattr(transformers, name, None)
        if auto is not None and type(config) in auto._model_mapping:
            return auto
    from .capability import generation_class

    return generation_class(config)[0]


def make_tiny(arch: str, out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              overwrite: bool = False, config_overrides: dict | None = None) -> Path:
    """Write a tiny random checkpoint of ``arch`` (any ``model_type`` of the installed transformers, or
    ``llada2_moe``; ``tiny_config``) to ``out_dir``.

    Weights are drawn with ``initializer_range`` 0.2 (transformers' default 0.02 gives near-uniform router scores
    and a model that repeats one token): routing is then decisive and varies from token to token, and greedy text
    varies, which makes the lossless comparisons meaningful. ``config_overrides`` are set on the text config after
    the shrink (e.g. ``num_hidden_layers``, ``mlp_only_layers`` to mix dense and MoE layers).

    Raises:
        MoeOffloadError: an architecture without a tiny configuration (``tiny_config`` says why), or ``out_dir``
            exists and is not empty (unless ``overwrite``).
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise MoeOffloadError(f"{out} already exists and is not empty; choose another --out")
    tok, config = tiny_config(arch)
    if config_overrides:
        config = _override(config, config_overrides)
    torch.manual_seed(seed)
    try:
        model = _save_class(config).from_config(config, dtype=dtype)
    except Exception as e:
        raise MoeOffloadError(f"{arch}: transformers cannot build the tiny model: {type(e).__name__}: "
                              f"{str(e).strip()[:200]}") from None
    _random_routing_buffers(model, config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


#: LLaDA2-MoE with LLaDA2.0-mini's routing geometry (256 routed experts in 8 groups, top-4 groups, top-8, one shared
#: expert, first layer dense) at a size this CPU runs in milliseconds per diffusion step: the "medium" checkpoint of
#: the TIDE benchmark (``bench diffusion``).
LLADA2_MEDIUM = dict(hidden_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=2048, intermediate_size=256, moe_intermediate_size=64, num_experts=256,
                     num_experts_per_tok=8, n_group=8, topk_group=4, num_shared_experts=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5)


@torch.no_grad()
def balance_expert_bias(model: torch.nn.Module, batches: list[torch.Tensor], iters: int = 40,
                        rate: float = 0.01, on_pass=None) -> list[float]:
    """Auxiliary-loss-free load balancing of a router's selection bias, as LLaDA2 / DeepSeek-V3 train it: after each
    pass over ``batches`` every router's ``expert_bias [E]`` (float32) moves by ``rate`` towards balance,
    ``bias_e += rate * sign(mean_load - load_e)``, where ``load_e`` counts the tokens routed to expert ``e``.

    A random checkpoint's routers otherwise send most tokens to a few experts; a trained model's are balanced by
    this very update, which makes the routing of a balanced random model a more realistic offloading workload.

    Args:
        model: a model whose routers have an ``expert_bias`` buffer and return ``(logits, weights, indices)``.
        batches: ``input_ids [1, S]`` int64 tensors.
        iters: passes; rate: bias step (scores are sigmoids in (0, 1)).
        on_pass: called with 1 after every pass (a progress bar).

    Returns:
        The max/mean load ratio of each pass (1.0 = perfectly balanced), pooled over routers.

    Raises:
        MoeOffloadError: no router with ``expert_bias``.
    """
    gates = [m for m in model.modules() if isinstance(getattr(m, "expert_bias", None), torch.Tensor)]
    if not gates:
        raise MoeOffloadError("the model has no router with an expert_bias to balance")
    loads = [torch.zeros(g.expert_bias.numel()) for g in gates]

    def hook(i):
        def fn(module, args, out):
            loads[i] += torch.bincount(out[2].reshape(-1).cpu(), minlength=loads[i].numel()).float()
        return fn

    handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    history = []
    try:
        for _ in range(iters):
            for ld in loads:
                ld.zero_()
            for ids in batches:
                model(input_ids=ids, use_cache=False)
            history.append(float(torch.stack([ld.max() / ld.mean() for ld in loads]).mean()))
            for g, ld in zip(gates, loads):
                g.expert_bias += rate * torch.sign(ld.mean() - ld).to(g.expert_bias.device)
            if on_pass is not None:
                on_pass(1)
    finally:
        for h in handles:
            h.remove()
    return history


#: router balancing passes of llada2-medium
BALANCE_PASSES = 40
def make_llada2_medium(out_dir: str | Path, texts: list[str], *, seed: int = 0, block_length: int = 32,
                       overwrite: bool = False, on_pass=None) -> tuple[Path, list[float]]:
    """Write the medium random LLaDA2-MoE (``LLADA2_MEDIUM``) with its routers load-balanced on ``texts``
    (``balance_expert_bias`` over ``text + block_length`` mask tokens, as the diffusion loop's forwards see them;
    ``on_pass(1)`` after each of its passes).

    Returns:
        ``(path, balance_history)``.

    Raises:
        MoeOffloadError: ``out_dir`` exists and is not empty (unless ``overwrite``), or no text.
    """
    if not texts:
        raise MoeOffloadError("make_llada2_medium needs texts to balance the routers on")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise MoeOffloadError(f"{out} already exists and is not empty; choose another --out")
    from transformers import AutoModelForCausalLM

    tok, config = _tokenizer_and_config("llada2_moe", LLADA2_MEDIUM)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    masks = [tok.mask_token_id] * block_length
    batches = [torch.tensor([tok(t)["input_ids"][:config.max_position_embeddings - block_length] + masks])
               for t in texts]
    history = balance_expert_bias(model, batches, iters=BALANCE_PASSES, on_pass=on_pass)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, history
