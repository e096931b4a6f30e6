"""MoEfication of a dense SwiGLU model (the testbed recipe, ``docs/testbed.md``): split each FFN's neurons into equal
experts by co-activation (balanced spherical k-means), fit a linear router per layer, and export a Mixtral checkpoint.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from moe_offload.testbed.source import calibration_ids

DEFAULT_TAU = 1e-4
DEFAULT_SEED = 0
#: routers of layer l are fitted on the inputs produced by layers < l running top-24 MoE FFNs
DEFAULT_FIT_TOP_K = 24
#: relative ridge strength of the router least-squares fit
DEFAULT_RIDGE = 0.2
#: neurons are clustered on their activation profile over at most this many calibration tokens
CLUSTER_TOKENS = 8192


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
    # ||W_e h_e||^2 = h_e^T (W_e^T W_e) h_e: one batched [N, I/E] x [I/E, I/E] product per expert instead of
    # materialising every expert's [N, H] output (the same quantity up to float rounding, ~12x fewer operations)
    num_experts, size = partition.shape
    flat = partition.reshape(-1)
    hp = h[:, flat].view(h.shape[0], num_experts, size).transpose(0, 1)  # [E, N, I/E]
    w = wd[:, flat].view(wd.shape[0], num_experts, size).transpose(0, 1)  # [E, H, I/E]
    gram = w.transpose(1, 2) @ w  # [E, I/E, I/E]
    sq = torch.einsum("end,end->en", torch.bmm(hp, gram), hp)  # [E, N]
    return sq.clamp_min_(0).sqrt_().T.contiguous()


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
def fit_layers(model, tokenizer, num_experts: int, calib_tokens: int, seed: int = DEFAULT_SEED,
               fit_top_k: int | None = DEFAULT_FIT_TOP_K, batch_size: int = 8,
               on_layer: Callable[[int], None] | None = None):
    """Partition every layer's neurons and fit the routers, layer by layer.

    The calibration windows are pushed through the model one layer at a time. Layer ``l`` is
    fitted on the FFN inputs it sees when layers ``< l`` already use their MoE FFN with
    ``fit_top_k`` experts (``None``: the dense FFN), so the routers are fitted on the inputs the
    MoE model actually produces. ``on_layer(1)`` is called after each layer (a progress bar).

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
    for i, layer in enumerate(inner.layers):
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
        if on_layer is not None:
            on_layer(1)
    return partitions, routers, int(ids.numel())
