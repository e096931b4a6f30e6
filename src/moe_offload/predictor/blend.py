"""Blending cross-layer forecasts with SeqMoE's multi-step forecasts (policy ``seqmoe-xl``).

The two forecasts see different information: SeqMoE's predictor (§5.3) the routing history, made one step ahead at
its trigger layer and rolled out over the next steps; the cross-layer forecast (``predictor.cross_layer``, Fate /
ProMoE) this token's own hidden state, but only for the next ``d`` layers of the current step. At MoE layer ``l`` of
decode step ``s`` the blended forecast of layer ``l + j`` (``j = 1..d``) is

    row 0 (step s):      w_j * XL_j + (1 - w_j) * Seq[step s]      (a mixture of the two probability vectors)
    rows 1.. (s+1, ...): Seq's rollout rows, unchanged

where ``Seq`` is the predictor's latest forecast covering layer ``l + j`` (made at step ``s - 1``) and ``w_j`` the
weight of the cross-layer forecast at distance ``j`` (``XL_WEIGHTS``: it decays with the distance, as the
cross-layer forecast's accuracy does). Both are probability vectors summing to 1 over the experts, so the mixture is
one too; its top-(k+3) become prefetch tasks (SeqMoE §6.1) replacing the queued tasks of those layers' deadlines in
step ``s`` (``core.prefetch.submit_forecast``), and its rows replace those layers' CacheScores (§7.1). Without a
current SeqMoE forecast for a layer (none yet), the cross-layer forecast is used alone.
"""

from __future__ import annotations

import torch

from .runtime import Forecast

#: w_j, the cross-layer forecast's blend weight at layer distance j = 1, 2, 3, ... (the last one for larger
#: distances); measured on training prompts (docs/benchmarks.md, "Cross-layer forecasts (issue 21)")
XL_WEIGHTS = (0.3, 0.25, 0.2)


def mix(xl: torch.Tensor, seq: torch.Tensor, weights=XL_WEIGHTS, distances=None) -> torch.Tensor:
    """``w_j * xl + (1 - w_j) * seq`` row by row: ``xl``, ``seq`` float32 ``[..., n, E]``, row r at layer distance
    ``distances[r]`` (default ``r + 1``; ``w_j = weights[min(j, len(weights)) - 1]``) -> float32 ``[..., n, E]``."""
    n = xl.shape[-2]
    ds = range(1, n + 1) if distances is None else distances
    w = torch.tensor([weights[min(j, len(weights)) - 1] for j in ds], dtype=xl.dtype, device=xl.device)
    w = w.unsqueeze(-1)
    return w * xl + (1.0 - w) * seq.to(xl.device, xl.dtype)


def seq_rows(runner, step: int, lo: int, n: int) -> torch.Tensor | None:
    """float32 ``[R, n, E]``: the rows of ``runner``'s latest forecasts for MoE layers ``lo .. lo + n - 1`` when every
    one of them was made at step ``step - 1`` (row 0 = step ``step``), else None."""
    cols = []
    for p in range(lo, lo + n):
        hit = runner.forecast_for(p)
        if hit is None or hit[0].step != step - 1:
            return None
        cols.append(hit[0].probs[:, hit[1]])
    if len({c.shape[0] for c in cols}) != 1:
        return None
    return torch.stack(cols, 1)


def blend_forecast(request: int, step: int, layer: int, xl: torch.Tensor, runner=None,
                   weights=XL_WEIGHTS) -> Forecast:
    """The forecast handed to the decision core at MoE ``layer`` of decode ``step`` (see the module docstring).

    Args:
        xl: float32 ``[n, E]``, the cross-layer forecast of layers ``layer + 1 .. layer + n``.
        runner: a ``PredictorRunner`` (``seqmoe-xl``) or None (``xl``: the cross-layer forecast alone).
        weights: ``XL_WEIGHTS``-like blend weights per distance.
    Returns:
        ``Forecast(request, step - 1, (layer + 1, layer + 1 + n), probs [R, n, E], cross_layer=True)``: row 0 is
        the current step (R = 1 for ``xl``, the predictor's rows for ``seqmoe-xl``).
    """
    n = xl.shape[0]
    lo = layer + 1
    probs = xl.unsqueeze(0)
    rows = seq_rows(runner, step, lo, n) if runner is not None else None
    if rows is not None:
        probs = torch.cat([mix(xl, rows[0], weights).unsqueeze(0), rows[1:].to(xl.device, xl.dtype)])
    return Forecast(request, step - 1, (lo, lo + n), probs, cross_layer=True)
