"""Training the predictors (SeqMoE §5.4): ranking loss + KL divergence, teacher forcing then scheduled sampling."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .features import Sequence, psi_topk
from .model import PredictorHeader, PredictorSet, SeqPredictor


@dataclass
class TrainConfig:
    """Hyper-parameters.

    Attributes:
        epochs: teacher-forcing epochs (ground truth is always the input).
        ss_epochs: scheduled-sampling epochs after them (inputs partly replaced by Psi of the model's own
            predictions, with a probability rising linearly to ``ss_max_prob``; Bengio et al. 2015).
        ss_max_prob: final replacement probability.
        lr: AdamW learning rate (cosine-decayed to 10% over all epochs).
        batch_tokens: positions per batch (sequences of similar length are padded together).
        max_len: longer sequences keep their last ``max_len`` positions (the decode steps and the prompt's end).
        margin: ranking-loss margin between a ground-truth top-k logit and a hard negative's logit.
        hard_negatives: how many highest-scoring wrong experts per layer act as negatives.
        seed: RNG seed (initialisation, batching, sampling).
    """

    epochs: int = 6
    ss_epochs: int = 3
    ss_max_prob: float = 0.5
    lr: float = 3e-3
    batch_tokens: int = 1024
    max_len: int = 256
    margin: float = 1.0
    hard_negatives: int = 3
    seed: int = 0


def predictor_loss(logits: torch.Tensor, target: torch.Tensor, target_ids: torch.Tensor, valid: torch.Tensor,
                   margin: float = 1.0, hard_negatives: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ranking loss + KL divergence (SeqMoE §5.4).

    Args:
        logits: ``[B, T, n, e]`` predictions.
        target: ``[B, T, n, e]`` Psi of the true next-step activation (rows sum to 1 per layer).
        target_ids: ``[B, T, n, k]`` int64 true top-k experts.
        valid: ``[B, T]`` bool, False on padding.
        margin: each true expert's logit must exceed every hard negative's by this much.
        hard_negatives: h highest-scoring experts outside the true top-k (per layer) used as negatives.

    Returns:
        ``(total, ranking, kl)`` scalars (means over valid positions and layers).
    """
    pos = logits.gather(-1, target_ids)                                        # [B,T,n,k]
    neg = logits.scatter(-1, target_ids, float("-inf")).topk(hard_negatives, dim=-1).values  # [B,T,n,h]
    rank = F.relu(margin - pos.unsqueeze(-1) + neg.unsqueeze(-2)).mean((-1, -2))  # [B,T,n]
    logq = F.log_softmax(logits, dim=-1)
    kl = (target * (torch.log(target.clamp_min(1e-12)) - logq)).sum(-1)       # [B,T,n]
    w = valid.float()
    denom = w.sum().clamp_min(1.0) * logits.shape[2]
    rank_m = (rank * w[..., None]).sum() / denom
    kl_m = (kl * w[..., None]).sum() / denom
    return rank_m + kl_m, rank_m, kl_m


def _batches(seqs: list[Sequence], max_len: int, batch_tokens: int, gen: torch.Generator) -> list[list[int]]:
    order = sorted(range(len(seqs)), key=lambda i: min(len(seqs[i]), max_len))
    batches, cur, longest = [], [], 0
    for i in order:
        n = min(len(seqs[i]), max_len)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def _collate(seqs: list[Sequence], layers: tuple[int, int], num_experts: int, max_len: int):
    """-> x ``[B, T, n*e]``, ids ``[B, T, n, k]``, valid ``[B, T]`` (right-padded; padding never influences earlier
    positions because the model is causal)."""
    lo, hi = layers
    parts = [(s.features(layers, num_experts)[-max_len:], s.ids[-max_len:, lo:hi]) for s in seqs]
    T = max(len(f) for f, _ in parts)
    B = len(parts)
    x = torch.zeros(B, T, parts[0][0].shape[1])
    ids = torch.zeros(B, T, *parts[0][1].shape[1:], dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, (f, i) in enumerate(parts):
        x[b, :len(f)] = f
        ids[b, :len(f)] = i
        valid[b, :len(f)] = True
    return x, ids, valid


def train_one(model: SeqPredictor, seqs: list[Sequence], cfg: TrainConfig, progress: bool = False,
              desc: str = "train") -> list[dict]:
    """Train one predictor in place on ``seqs``; returns per-epoch ``{"epoch", "loss", "rank", "kl", "ss_prob"}``.

    Each sequence of length T gives T-1 (input, next-step target) pairs: inputs ``A_{0:T-1}``, targets
    ``A_{1:T}`` (§5.3, training mode). Sequences shorter than 2 positions are skipped.
    """
    from tqdm.auto import tqdm

    seqs = [s for s in seqs if len(s) >= 2]
    gen = torch.Generator().manual_seed(cfg.seed)
    lo, hi = model.spec.layers
    E = model.num_experts
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    total_epochs = cfg.epochs + cfg.ss_epochs
    plan = [_batches(seqs, cfg.max_len, cfg.batch_tokens, gen) for _ in range(total_epochs)]
    steps_total = sum(len(p) for p in plan)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps_total) / max(1, steps_total))))
    history = []
    bar = tqdm(total=steps_total, desc=desc, disable=not progress, leave=False)
    model.train()
    for epoch in range(total_epochs):
        ss_prob = 0.0 if epoch < cfg.epochs else cfg.ss_max_prob * (epoch - cfg.epochs + 1) / cfg.ss_epochs
        sums = [0.0, 0.0, 0.0]
        count = 0
        for batch in plan[epoch]:
            x, ids, valid = _collate([seqs[i] for i in batch], (lo, hi), E, cfg.max_len)
            inp, tgt, tgt_ids, v = x[:, :-1], x[:, 1:], ids[:, 1:], valid[:, 1:]
            if ss_prob > 0:  # scheduled sampling: input t (t >= 1) <- Psi(prediction made at t - 1)
                with torch.no_grad():
                    pred, _ = model(inp)
                    own = psi_topk(pred, model.top_k)                   # [B, T-1, n*e]; own[:, t-1] forecasts t
                replace = torch.rand(inp.shape[:2], generator=gen) < ss_prob
                replace[:, 0] = False
                inp = inp.clone()
                inp[:, 1:][replace[:, 1:]] = own[:, :-1][replace[:, 1:]]
            logits, _ = model(inp)
            loss, r, k = predictor_loss(logits, tgt.reshape(logits.shape), tgt_ids, v, cfg.margin, cfg.hard_negatives)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            lv = float(loss.detach())
            sums[0] += lv
            sums[1] += float(r.detach())
            sums[2] += float(k.detach())
            count += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{lv:.3f}")
        history.append({"epoch": epoch + 1, "loss": sums[0] / max(1, count), "rank": sums[1] / max(1, count),
                        "kl": sums[2] / max(1, count), "ss_prob": ss_prob})
    bar.close()
    model.eval()
    return history


def train_predictors(header: PredictorHeader, seqs: list[Sequence], cfg: TrainConfig,
                     progress: bool = False) -> PredictorSet:
    """Build a ``PredictorSet`` for ``header`` and train each of its predictors on ``seqs`` (SeqMoE §5.4).

    The training summary (config, per-epoch losses, seconds) is stored in ``header.training``.
    """
    torch.manual_seed(cfg.seed)
    pset = PredictorSet(header)
    t0 = time.perf_counter()
    hist = []
    for i, p in enumerate(pset.predictors):
        hist.append(train_one(p, seqs, cfg, progress, desc=f"predictor {i + 1}/{len(pset.predictors)} "
                                                           f"layers {p.spec.layers[0]}-{p.spec.layers[1] - 1}"))
    header.training.update({"config": vars(cfg).copy(), "history": hist, "seconds": time.perf_counter() - t0,
                            "train_requests": len(seqs)})
    return pset.eval()


def train_on_traces(traces: list, names: list[str], cfg: TrainConfig, *, predictors: int = 2, hidden_size: int = 128,
                    mamba_layers: int = 1, input_skip: bool = True, test_fraction: float = 0.1,
                    shuffle_steps: bool = False, progress: bool = False) -> tuple[PredictorSet, int]:
    """``predictor train``: split the requests of ``traces`` (one model's, ``features.load_traces``; ``names``
    their file names, recorded with their digests) 90/10 by request (``test_fraction``, ``cfg.seed``), train
    ``predictors`` predictors over consecutive layer ranges on the training requests (SeqMoE §5.4), and record the
    split and the prefill popularity (§8.4) in the header. ``shuffle_steps``: the step-shuffled control (§3.1).

    Returns:
        ``(trained predictor set, number of training requests)``.

    Raises:
        MoeOffloadError: ``test_fraction`` outside (0, 1), ``cfg.ss_max_prob`` outside [0, 1], fewer than 2
            requests.
    """
    from ..errors import MoeOffloadError
    from .features import prefill_popularity, split_requests, trace_digest, traces_sequences
    from .model import PredictorSpec, default_ranges

    if not 0 < test_fraction < 1:
        raise MoeOffloadError(f"--test-fraction must be in (0, 1), got {test_fraction}")
    if not 0 <= cfg.ss_max_prob <= 1:
        raise MoeOffloadError(f"--ss-max-prob must be in [0, 1], got {cfg.ss_max_prob}")
    h0 = traces[0].header
    seqs = traces_sequences(traces)
    if len(seqs) < 2:
        raise MoeOffloadError("need at least 2 requests in the traces to split into train and test")
    train_idx, test_idx = split_requests([s.key for s in seqs], test_fraction, cfg.seed)
    train = [seqs[i] for i in train_idx]
    if shuffle_steps:
        train = [s.shuffled(cfg.seed + 1 + i) for i, s in enumerate(train)]
    L, E = int(h0["num_moe_layers"]), int(h0["num_experts"])
    specs = [PredictorSpec(layers=r, hidden_size=hidden_size, num_mamba_layers=mamba_layers, input_skip=input_skip)
             for r in default_ranges(L, predictors)]
    header = PredictorHeader(model_id=h0["model_id"], model_type=h0.get("model_type", ""), num_moe_layers=L,
                             num_experts=E, top_k=int(h0["top_k"]), specs=specs, shuffled_control=shuffle_steps,
                             training={"split": {"seed": cfg.seed, "test_fraction": test_fraction,
                                                 "traces": [{"name": n, "digest": trace_digest(t)}
                                                            for n, t in zip(names, traces)]},
                                       "test_requests": len(test_idx)},
                             prefill_popularity=prefill_popularity(traces, [seqs[i].key for i in train_idx], L, E))
    return train_predictors(header, train, cfg, progress=progress), len(train)
