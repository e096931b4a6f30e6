"""What-if cross-layer forecasts of a chosen accuracy (``moe-offload trace xl-accuracy``).

The cross-layer forecasts a trace records (``trace collect --xl-forecasts``, ``predictor.cross_layer``) are only as
accurate as the recording model's routers make them: on this repo's testbeds, whose routers were fitted to
SmolLM2's hidden states, the next layer's router finds ~80% of the true top-k (``predictor eval``'s XL-1 row),
where published MoE models reach ~97% (Fate, arXiv 2502.12224). ``with_xl_accuracy`` rewrites a trace's forecasts
as the *true* routing of the forecast layers with each of its k experts swapped for a wrong one at a chosen rate
per layer distance, so ``simulate --policy xl,seqmoe-xl`` and ``predictor eval`` can answer "what would this
pipeline do on a model whose cross-layer forecasts are this accurate?" on a recorded routing. The routing itself is
untouched; the header says ``synthetic: true`` and names the rates, so every report made from it says so.

Each forecast row keeps the form of ``runtime.cross_layer.xl_probabilities``:

    p = (1 - eps) * onehot(S) / k + eps * tail        eps = 1 / (2(k + 1))

where ``S`` is the forecast layer's true top-k with each expert independently replaced, with probability
``swap[j]`` for distance ``j + 1``, by a distinct expert outside the true set (uniformly drawn), and ``tail`` is the
recorded forecast of the same row when the trace has one of the same depth (its ranking beyond the top-k) or
uniform ``1 / E`` otherwise. Rows past the last MoE layer stay zero, as recorded.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import MoeOffloadError
from .format import Trace


def with_xl_accuracy(trace: Trace, swap: list[float], seed: int = 0) -> Trace:
    """A copy of ``trace`` whose cross-layer forecasts are the true routing with experts swapped (module docstring).

    Args:
        trace: a routing trace (any; its recorded ``xl_probs``, if of depth ``len(swap)``, give the tail ranking).
        swap: per layer distance ``j = 1 .. d`` the probability in ``[0, 1]`` that each of a forecast's k experts is
            replaced by a wrong one; ``d = len(swap)`` is the forecast depth.
        seed: seed of numpy's PCG64 generator; equal arguments give equal traces.
    Returns:
        A ``Trace`` sharing ``trace``'s routing arrays, with ``xl_probs`` float32 ``[D, L, d, E]`` (D decode rows)
        and the header marked ``synthetic: true`` with ``xl_forecasts`` naming the rates and seed.
    Raises:
        MoeOffloadError: no rate, more rates than the trace has layer distances (``L - 1``), a rate outside
            ``[0, 1]``, a trace without decode rows, or ``E < 2k`` (not enough wrong experts to swap in for every
            expert).
    """
    if not swap:
        raise MoeOffloadError("--swap needs at least one rate (one per layer distance)")
    bad = [q for q in swap if not 0.0 <= q <= 1.0]
    if bad:
        raise MoeOffloadError(f"--swap rates must be in [0, 1], got {bad[0]}")
    L, E, k = trace.num_moe_layers, trace.num_experts, trace.top_k
    if len(swap) > L - 1:
        raise MoeOffloadError(f"--swap has {len(swap)} rates, but a trace of {L} MoE layers has at most {L - 1} "
                              "layer distances to forecast")
    if E < 2 * k:
        raise MoeOffloadError(f"swapping needs at least 2k = {2 * k} experts per layer, the trace has {E}")
    dec = np.flatnonzero(trace.step > 0)
    if not len(dec):
        raise MoeOffloadError("the trace has no decode steps (cross-layer forecasts are made in decode steps only)")
    d, D = len(swap), len(dec)
    rec = trace.xl_probs if trace.xl_probs is not None and trace.xl_probs.shape[2] == d else None
    rng = np.random.default_rng(seed)
    truth = trace.expert_ids[dec].astype(np.int64)                      # [D, L, k]
    eps = 1.0 / (2 * (k + 1))
    out = np.zeros((D, L, d, E), dtype=np.float32)
    rows = np.arange(D)[:, None]
    for j, q in enumerate(swap):
        for layer in range(L - 1 - j):
            true = truth[:, layer + 1 + j]                              # [D, k]
            keys = rng.random((D, E))
            keys[rows, true] = np.inf                                   # wrong experts first, in random order
            wrong = np.argsort(keys, axis=1)[:, :k]                     # [D, k] distinct experts outside the set
            chosen = np.where(rng.random((D, k)) < q, wrong, true)
            onehot = np.zeros((D, E), dtype=np.float32)
            onehot[rows, chosen] = 1.0
            tail = rec[:, layer, j] if rec is not None else np.float32(1.0 / E)
            out[:, layer, j] = (1.0 - eps) * onehot / k + eps * tail
    rates = ",".join(f"{q:g}" for q in swap)
    header = dict(trace.header, synthetic=True,
                  xl_forecasts=f"what-if: true routing, experts swapped at {rates} per distance (seed {seed}), "
                               f"moe_offload.trace.xl_accuracy; recorded tail: {'yes' if rec is not None else 'no'}")
    return replace(trace, header=header, xl_probs=out, _bounds=None)
