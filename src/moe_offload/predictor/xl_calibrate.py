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

from ..errors import MoeOffloadError
from .xl_weights import check_xl_weights

#: the default grid of candidate weights (0 = SeqMoE's forecast alone, 1 = the cross-layer forecast alone)
XL_GRID = tuple(i / 10 for i in range(11))


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


def calibrate_on_traces(predictor: str, paths: list[str], grid: tuple[float, ...], *, replace: bool = False,
                        allow_synthetic: bool = False, progress: bool = False) -> dict:
    """``predictor calibrate-xl``: per layer distance, the grid weight with the best blended recall on the
    requests of ``paths`` (traces collected with ``--xl-forecasts``; their held-out requests when they are the
    predictor's training traces), stored as ``xl_weights.json`` in the predictor directory ``predictor``.

    Returns:
        ``{"weights", "table" ({distance: {weight: (recall@k+3, recall@k)}}), "grid", "note", "path",
        "record" (what the file holds besides the weights), "top_k", "synthetic"}``.

    Raises:
        MoeOffloadError: a bad grid, an existing ``xl_weights.json`` without ``replace``, the same trace twice,
            traces without cross-layer forecasts, synthetic traces without ``allow_synthetic``, an unreadable
            predictor.
    """
    from pathlib import Path

    from .features import eval_split, load_traces
    from .model import load_predictor
    from .xl_weights import XL_WEIGHTS_NAME, write_xl_weights

    grid = tuple(sorted(set(check_xl_weights(grid, "--grid"))))
    if (Path(predictor) / XL_WEIGHTS_NAME).exists() and not replace:
        raise MoeOffloadError(f"{Path(predictor) / XL_WEIGHTS_NAME} already exists; pass --replace to "
                              "recalibrate (nothing was overwritten)")
    if len({Path(p).resolve() for p in paths}) < len(paths):
        raise MoeOffloadError("--traces names the same file twice")
    traces = load_traces(paths)
    for p, t in zip(paths, traces):
        if t.xl_probs is None:
            raise MoeOffloadError(f"{p} has no cross-layer forecasts: calibration needs traces collected with "
                                  "--xl-forecasts")
    synthetic = [(p, t.header.get("xl_forecasts") or "a generated trace")
                 for p, t in zip(paths, traces) if t.header.get("synthetic")]
    if synthetic and not allow_synthetic:
        raise MoeOffloadError(f"{synthetic[0][0]} is synthetic ({synthetic[0][1]}); weights fitted on it would drive "
                              "real runs: pass --allow-synthetic if that is what you want")
    pset = load_predictor(predictor, model_id=traces[0].header.get("model_id"))
    seqs, _, test_idx, note = eval_split(pset.header.training, traces)
    weights, table = calibrate_xl_weights(pset, [seqs[i] for i in test_idx], grid, progress=progress)
    record = {"grid": list(grid), "requests": note, "traces": [str(Path(p).resolve()) for p in paths],
              "synthetic": bool(synthetic),
              "recall": {f"XL-{j}": {f"{w:g}": {"top_k": round(v[1], 6), "top_k_plus_3": round(v[0], 6)}
                                     for w, v in t.items()} for j, t in table.items()}}
    path = write_xl_weights(predictor, weights, record, replace=replace)
    return {"weights": weights, "table": table, "grid": grid, "note": note, "path": path, "record": record,
            "top_k": pset.header.top_k, "synthetic": bool(synthetic)}
