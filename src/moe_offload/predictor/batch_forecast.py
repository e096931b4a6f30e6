"""Per-sequence forecasts combined into one demand per expert for a decode batch (issue 18).

A batch's MoE layer needs expert e when at least one of its sequences routes to it. With independent per-sequence
forecasts ``p_s(e)`` (``predictor.runtime.Forecast.probs``), the probability of that union is
``p(e) = 1 - prod_s (1 - p_s(e))``; probabilistic Belady (``core.prob_belady``) and the prefetch task generator
(``core.prefetch``) take it as they take one sequence's forecast. Wired into a decode batch by
``predictor.batch_feed.BatchForecastFeed``; see docs/architecture.md, "Continuous batching".
"""

from __future__ import annotations

import torch

from .runtime import Forecast


def union_probs(probs: torch.Tensor) -> torch.Tensor:
    """``probs [S, ...]`` float, the per-sequence probabilities of each expert -> ``[...]``: the probability that
    at least one of the S sequences needs it, ``1 - prod_s (1 - p_s)`` (computed as ``-expm1(sum log1p(-p))``;
    one sequence's probabilities are returned as they are, so a batch of one is bitwise its sequence's forecast).

    Raises:
        ValueError: ``probs`` has no sequence dimension or no sequence.
    """
    if probs.dim() < 1 or probs.shape[0] == 0:
        raise ValueError(f"probs must be [S, ...] with S >= 1, got shape {tuple(probs.shape)}")
    if probs.shape[0] == 1:
        return probs[0]
    return -torch.expm1(torch.log1p(-probs.clamp(0.0, 1.0)).sum(dim=0))


def combine(forecasts: list[Forecast]) -> Forecast:
    """One batch forecast from the sequences' forecasts of the same layers and horizon (``probs [1 + c, n, e]``
    each): ``union_probs`` of their stacked probabilities; request -1 (the batch), the latest step.

    Raises:
        ValueError: no forecast, or forecasts of different layers or shapes.
    """
    if not forecasts:
        raise ValueError("no forecast to combine")
    layers = {f.layers for f in forecasts}
    shapes = {tuple(f.probs.shape) for f in forecasts}
    if len(layers) != 1 or len(shapes) != 1:
        raise ValueError(f"forecasts must share layers and shape, got {sorted(layers)} and {sorted(shapes)}")
    return Forecast(-1, max(f.step for f in forecasts), forecasts[0].layers,
                    union_probs(torch.stack([f.probs for f in forecasts])))
