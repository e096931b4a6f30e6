"""Blend weights of ``seqmoe-xl`` fitted to a model (``moe-offload predictor calibrate-xl``).

``predictor.blend`` mixes the cross-layer forecast of the layer at distance ``j`` into SeqMoE's one-step forecast
with weight ``w_j``. The right weight depends on how accurate the model's cross-layer forecasts are: on this repo's
testbeds (next-layer router finds ~80% of the true top-k) a small weight (``XL_WEIGHTS = (0.3, 0.25, 0.2)``) is
best, on a model whose next-layer router finds ~97% (Fate, arXiv 2502.12224) a weight near 0.5 or more
(docs/benchmarks.md, "What the targets need from cross-layer forecasts"). ``calibrate_xl_weights`` picks, for each
distance, the weight of a grid that maximises the blend's recall@top-k (ties: recall@top-(k+3), SeqMoE §9.1's
metric, then the smaller weight) on calibration requests — traces recorded with ``--xl-forecasts`` on prompts the
policy will not be measured on. Top-k first, because the decision core ranks by the forecast's probabilities
(probabilistic Belady's CacheScore, §7.1; JSD's confidences, §6.2), and the top-k are what the layer will need: with
accurate cross-layer forecasts the top-(k+3) recall saturates at any weight from ~0.5 on while the top-k recall
peaks near 0.5. The weights are stored beside the predictor (``xl_weights.json``), and every user of the
predictor's blend (the runtime's ``seqmoe-xl``, ``simulate``'s replay, ``bench decode``'s simulated column,
``predictor eval``) reads them through ``PredictorSet.xl_weights``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import MoeOffloadError

#: the file beside ``predictor.json`` holding the calibrated blend weights
XL_WEIGHTS_NAME = "xl_weights.json"
#: the default grid of candidate weights (0 = SeqMoE's forecast alone, 1 = the cross-layer forecast alone)
XL_GRID = tuple(i / 10 for i in range(11))


def check_xl_weights(weights, what: str = "--xl-weights") -> tuple[float, ...]:
    """``weights`` as a tuple of floats, each in ``[0, 1]`` (one per layer distance, at least one).

    Raises:
        MoeOffloadError: none, not numbers, or a weight outside ``[0, 1]``.
    """
    try:
        out = tuple(float(w) for w in weights)
    except (TypeError, ValueError):
        raise MoeOffloadError(f"{what} must be numbers, got {weights!r}") from None
    if not out:
        raise MoeOffloadError(f"{what} is empty")
    bad = [w for w in out if not (math.isfinite(w) and 0.0 <= w <= 1.0)]
    if bad:
        raise MoeOffloadError(f"{what} must be in [0, 1], got {bad[0]}")
    return out


def read_xl_weights(directory: str | Path) -> tuple[tuple[float, ...], str] | None:
    """The calibrated weights stored in a predictor ``directory`` (``XL_WEIGHTS_NAME``) and a note saying where they
    come from (the file; "fitted on synthetic traces" when they were), or None when there are none.

    Raises:
        MoeOffloadError: an unreadable or malformed file.
    """
    p = Path(directory) / XL_WEIGHTS_NAME
    if not p.exists():
        return None
    try:
        j = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeOffloadError(f"{p}: unreadable blend weights ({e})") from None
    if not isinstance(j, dict) or not isinstance(j.get("weights"), list):
        raise MoeOffloadError(f"{p}: malformed blend weights (needs a list \"weights\")")
    note = str(p) + (", fitted on synthetic traces" if j.get("synthetic") else "")
    return check_xl_weights(j["weights"], f"{p} \"weights\""), note


def describe_xl_weights(pset) -> str:
    """``"w1, w2, ... (where from)"``: the blend weights ``seqmoe-xl`` uses with ``pset`` (its calibrated ones, or
    ``predictor.blend.XL_WEIGHTS`` "(default)"), for reports."""
    from .blend import XL_WEIGHTS

    w = getattr(pset, "xl_weights", None)
    note = getattr(pset, "xl_weights_note", None) if w else "default"
    return ", ".join(f"{x:g}" for x in (w or XL_WEIGHTS)) + f" ({note or 'set by the caller'})"


def write_xl_weights(directory: str | Path, weights, record: dict, replace: bool = False) -> Path:
    """Store ``weights`` (and ``record``: how they were chosen) as ``directory/xl_weights.json``.

    Raises:
        MoeOffloadError: the file exists and ``replace`` is False (nothing is overwritten), or it cannot be written.
    """
    p = Path(directory) / XL_WEIGHTS_NAME
    if p.exists() and not replace:
        raise MoeOffloadError(f"{p} already exists; pass --replace to recalibrate (nothing was overwritten)")
    tmp = p.with_name(p.name + ".partial")
    try:
        tmp.write_text(json.dumps({"weights": list(check_xl_weights(weights))} | record, indent=1) + "\n")
        tmp.replace(p)
    except OSError as e:
        raise MoeOffloadError(f"cannot write {p}: {e.strerror or e}") from None
    return p


def calibrate_xl_weights(pset, seqs, grid=XL_GRID, progress: bool = False) -> tuple[tuple[float, ...], dict]:
    """Per layer distance, the grid weight whose blend (``predictor.blend.mix``) of Seq-1 and the cross-layer
    forecast has the highest recall@top-k over ``seqs`` (ties: the higher recall@top-(k+3), then the smaller
    weight); module docstring.

    Args:
        pset: the trained predictors (``PredictorSet``).
        seqs: calibration requests (``predictor.features.Sequence``) whose traces carry cross-layer forecasts.
        grid: candidate weights in ``[0, 1]``.
    Returns:
        ``(weights, table)``: one weight per distance of the forecasts (``d``), and ``{distance: {weight:
        (recall@top-(k+3), recall@top-k, pairs)}}`` for every grid weight.
    Raises:
        MoeOffloadError: a bad grid, or no request with cross-layer forecasts and a decode step.
    """
    from .evaluate import evaluate_predictor

    grid = check_xl_weights(grid, "--grid")
    use = [s for s in seqs if s.xl is not None and 1 <= s.prompt_len < len(s)]
    if not use:
        raise MoeOffloadError("calibration needs traces collected with --xl-forecasts (and at least one decode step)")
    res = evaluate_predictor(pset, use, horizon=1, long_threshold=1 << 62, progress=progress, xl_grid=grid)
    table: dict[int, dict[float, tuple[float, float, int]]] = {}
    for (j, w), r in sorted(res.blend_grid.items()):
        table.setdefault(j, {})[w] = (r.wide, r.narrow, r.pairs)
    weights = tuple(max(table[j], key=lambda w: (table[j][w][1], table[j][w][0], -w)) for j in sorted(table))
    return weights, table
