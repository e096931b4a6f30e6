"""Probabilistic Belady's victim ranked in numpy (``core.prob_belady.ProbabilisticBelady.victim`` without its native
kernel; SeqMoE §7.1): the rank keys of the policy's order, and the victim from a ranking kept between calls. The
native ``belady_victim`` (``runtime/kernels/belady_victim.cpp``) picks the same expert in one pass; the tests compare
both with a full scan (``tests/test_prob_belady_cycle.py``).

The ranking is reused until a score changes (a forecast, a new request), the layer cycle moves on, or more than
``core.prob_belady._FRESH_MAX`` experts were accessed or inserted since it was made; those "fresh" experts are
compared one by one (``ProbabilisticBelady._touch`` keeps them).
"""

from __future__ import annotations

import numpy as np


def rank_keys(pb, ids: np.ndarray) -> tuple:
    """``np.lexsort`` keys ranking experts ``ids`` (int64 ``[m]``) of the policy ``pb`` (last key first): (score, last
    use, id), with ``layer_cycle`` (score, log2 reuse frequency at its layer's last run, -layers until its layer runs
    again, last use, id): 1 for the layer after the running one, L for the running layer itself (its next run is the
    next step's)."""
    if not pb.layer_cycle:
        return (ids, pb._last[ids], pb._score[ids])
    layer = ids // pb.num_experts
    ahead = (layer - pb._cur - 1) % max(pb._ran.size, 1) + 1
    freq = pb._crf[ids] - pb._ran[layer] / pb.half_life
    return (ids, pb._last[ids], -ahead, freq, pb._score[ids])


def rank_key(pb, e: int) -> tuple:
    """The rank key of one expert, ``rank_keys``' keys in order of precedence."""
    return tuple(k[0] for k in reversed(rank_keys(pb, np.array([e]))))


def ranked_victim(pb, pinned: set[int]) -> int:
    """The resident expert of ``pb`` not in ``pinned`` that ranks first (``rank_keys``), from ``pb``'s ranking
    (made again when stale) and its fresh experts.

    Raises:
        RuntimeError: every resident expert is pinned (the slot table never asks then).
    """
    if pb._ranking is None:
        ids = np.flatnonzero(pb._in)
        pb._ranking = ids[np.lexsort(rank_keys(pb, ids))].tolist()
        pb._fresh = set()
    resident, fresh = pb.resident, pb._fresh
    best = -1
    for e in pb._ranking:  # the first ranked expert still resident, not pinned and not re-inserted since
        if e in resident and e not in pinned and e not in fresh:
            best = e
            break
    if fresh:
        cands = [e for e in fresh if e in resident and e not in pinned]
        if cands:
            f = min(cands, key=lambda e: rank_key(pb, e))
            if best < 0 or rank_key(pb, f) < rank_key(pb, best):
                best = f
    if best < 0:
        raise RuntimeError("no evictable expert")
    return best
