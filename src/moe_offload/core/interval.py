"""TIDE's I/O-aware interval optimiser: at an interval boundary, the refresh interval, the set and the refresh mode
(asynchronous prefetch, synchronous refresh, or keep) with the lowest modelled cost per step, swap time against
host fallback compute (TIDE "I/O-aware scheduling"; DESIGN.md §5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import MoeOffloadError
from .costs import TideCosts
from .refresh_plan import select_top


@dataclass
class IntervalChoice:
    """The interval optimiser's decision for one layer at one boundary.

    Attributes:
        mode: ``"async"``: prefetch ``target`` now (copies overlap the interval; not yet landed experts fall back);
            ``"sync"``: refresh when the layer's router has run in this step, from this step's counts, loading
            before the layer computes (the authors' refresh; ``target``/``load``/``evict`` are then estimates from
            the previous step and are recomputed at ``route``); ``"keep"``: keep the current set one more step and
            decide again at the next step.
        tau: interval length in steps (1 when keeping).
        target: the new resident set (sorted ids; the current set when keeping).
        load: experts to copy, most used first; evict: experts to drop.
        per_step_s: predicted seconds per step of the chosen option (a refresh: the interval's average; keep: the
            next step's expected fallback seconds).
        breakdown: for the chosen refresh mode at ``tau``: ``swap_s`` (n_load x swap_s), ``hidden_s`` (link time
            the interval's compute hides), ``exposed_s`` (link time not hidden; all of it for sync), ``landing_s``
            (fallbacks while async copies are in flight), ``miss_s`` (fallbacks of experts outside the set over the
            interval), ``per_step_s``; plus ``candidates`` ``{mode: {tau: per_step_s}}``, ``keep_s`` (next step's
            expected seconds if kept, None without a current set) and ``n_load``.
    """

    mode: str
    tau: int
    target: list[int]
    load: list[int]
    evict: list[int]
    per_step_s: float
    breakdown: dict

    @property
    def refresh(self) -> bool:
        """True unless the decision keeps the current set."""
        return self.mode != "keep"


class IntervalOptimiser:
    """Chooses the next interval length ``tau`` and expert set ``S`` of one layer (TIDE "I/O-aware scheduling").

    TIDE minimises ``total_time = num_intervals x swap_time + num_fallbacks x fallback_time`` over the interval
    length and the set, "using historical activation data from previous intervals". Long-run time is the sum over
    intervals, so for a stationary workload the interval length minimising the time *per step* of one interval
    minimises the total (renewal argument). With ``S`` = :func:`select_top` of the tracker's score (the top-budget
    experts by the most recent step's token counts, as the authors' code selects), ``n = |S minus resident|``,
    ``n_tau`` the swaps charged to an interval of ``tau`` steps (``turnover[tau]``, the expected turnover of the
    selection after ``tau`` steps, i.e. the stationary cost of repeating the interval; ``n`` when no turnover is
    given) and ``M(d)`` the expected host-fallback seconds at distance ``d`` from the set's reference step
    (``StabilityEstimator.expected_miss_s``), two ways to refresh are priced:

    * ``async`` (prefetch; reference = the previous step, so the interval covers ``d = 1..tau``):
      ``J(tau) = [ exposed(tau) + landing(tau) + sum_{d=1..tau} M(d) ] / tau`` with
      ``exposed(tau) = max(0, queue + n_tau * swap_s - tau * step_s) - max(0, queue - tau * step_s)``, the link
      time the copies add beyond what the interval's compute hides (DESIGN.md §5's ``swap_bytes / bandwidth -
      hidden_by_prefetch``; ``queue``: seconds of copies already queued on the shared link), and ``landing(tau)``
      the fallbacks of this boundary's new experts while their copies are in flight (copy ``j``, most used first,
      lands ``queue + (j + 1) * swap_s`` after the boundary; the layer runs ``layer_pos`` of a step after the step
      starts; each step without it costs ``tokens_e * fallback_token_s + fallback_expert_s``, ``tokens_e`` its
      count at the reference step);
    * ``sync`` (the authors' refresh: from the coming step's counts once its router ran, loaded before the layer
      computes; reference = that step, ``d = 0..tau-1``): ``J(tau) = [ n_tau * swap_s + sum_{d=0..tau-1} M(d) ] /
      tau`` — nothing is hidden.

    Candidates ``tau = 1..tau_max`` (capped by ``horizon``, the expected steps left in the block: a block's end
    refreshes anyway). Keeping the current set instead is an age-replacement decision: refresh when the best average
    ``min J`` is below the kept set's expected fallback seconds for the next step, ``M(age + 1)`` (the current
    set's reference step lies ``age`` steps before the previous step); otherwise keep it and decide again at the
    next step. A refresh that loads nothing is always taken (it only renews the set's reference).

    Where DESIGN.md and the TIDE text differ: the TIDE text states the objective only in words (above); DESIGN.md
    gives the per-step formula with this boundary's ``swap_bytes(S minus resident)``, which the ``async`` mode
    follows when no turnover is given. With the estimator's turnover (what ``TidePlanner`` passes) the swap term is
    the stationary ``n_tau``: charging this boundary's backlog ``n`` instead rewards stretching an interval because
    the backlog is large, although the backlog itself grows with the interval (measured here: it picked T=2 where
    T=1 is faster). ``landing`` is added because here the prefetched set's copies overlap the interval's own first
    steps (the budget includes in-flight copies: no staging memory). The ``sync`` mode prices the authors'
    implemented refresh; the keep rule is not described by the TIDE text.

    Args:
        costs: the cost model.
        tau_max: largest interval considered (>= 1).
        modes: refresh modes considered, a subset of ``("async", "sync")``.

    Raises:
        MoeOffloadError: ``tau_max < 1`` or unknown / no modes.
    """

    def __init__(self, costs: TideCosts, tau_max: int = 16, modes=("async", "sync")):
        if tau_max < 1:
            raise MoeOffloadError(f"tau_max must be >= 1, got {tau_max}")
        modes = tuple(modes)
        if not modes or any(m not in ("async", "sync") for m in modes):
            raise MoeOffloadError(f"modes must be a non-empty subset of ('async', 'sync'), got {modes}")
        self.costs = costs
        self.tau_max = int(tau_max)
        self.modes = modes

    def choose(self, score: np.ndarray, resident, budget: int, expected_miss_s: np.ndarray, step_s: float,
               ref_counts: np.ndarray | None = None, queue_s: float = 0.0, layer_pos: float = 0.0,
               age: int | None = None, horizon: float | None = None,
               turnover: np.ndarray | None = None) -> IntervalChoice:
        """Decide for one layer at one boundary (before the step runs).

        Args:
            score: float ``[E]`` selection score (``ActivationTracker.score`` after the previous step).
            resident: the experts on the device or in flight now (iterable of ints).
            budget: B, experts the layer may hold.
            expected_miss_s: float ``[D + 1]``, ``M(d)`` for ``d = 0..D`` (seconds; ``d > D`` uses ``M(D)``).
            step_s: expected seconds of one diffusion step (> 0).
            ref_counts: int ``[E]`` token counts at the reference step (default ``floor(score)``).
            queue_s: seconds of copies already queued on the link ahead of this layer's.
            layer_pos: fraction of a step elapsed before this layer runs (0..1).
            age: distance from the current set's reference step to the previous step (None: no current set).
            horizon: expected steps left in the block, this one included (None: unbounded).
            turnover: float ``[D' + 1]``, expected experts a refresh loads when the layer's previous refresh was
                ``d`` steps earlier (``StabilityEstimator.turnover``); when given, an interval of ``tau`` steps is
                charged ``turnover[tau]`` swaps (the stationary cost of repeating it) instead of this boundary's
                ``n`` (the default).

        Returns:
            An IntervalChoice.

        Raises:
            MoeOffloadError: ``step_s <= 0`` or an empty ``expected_miss_s``.
        """
        if not step_s > 0:
            raise MoeOffloadError(f"step_s must be > 0, got {step_s}")
        M = np.asarray(expected_miss_s, dtype=np.float64)
        if M.ndim != 1 or len(M) == 0:
            raise MoeOffloadError("expected_miss_s must be a non-empty 1-D array")
        c = self.costs
        resident = resident if isinstance(resident, (set, frozenset)) else set(int(e) for e in resident)
        new, evict, target = _refresh_sets(score, resident, budget)
        rc = np.floor(np.asarray(score)) if ref_counts is None else np.asarray(ref_counts)
        n = len(new)
        landing = _landing(new, rc, c, queue_s, step_s, layer_pos)
        m, n_of = _clamped(M), _swap_count(n, turnover)
        tmax = self.tau_max
        if horizon is not None:
            tmax = max(1, min(tmax, int(math.ceil(horizon))))
        cands: dict = {}
        parts: dict = {}
        if "async" in self.modes:
            cands["async"], parts["async"] = _async_costs(tmax, m, n_of, step_s, queue_s, c.swap_s, landing)
        if "sync" in self.modes:
            cands["sync"], parts["sync"] = _sync_costs(tmax, m, n_of, c.swap_s)
        mode, best = min(((md, t) for md in cands for t in cands[md]),
                         key=lambda x: (cands[x[0]][x[1]], x[1], x[0] != "async"))
        keep_s = None if age is None else float(m(age + 1))
        bd = dict(parts[mode][best], candidates=cands, keep_s=keep_s, n_load=n, tau=best, mode=mode)
        if keep_s is not None and n > 0 and keep_s <= cands[mode][best]:
            return IntervalChoice(mode="keep", tau=1, target=sorted(resident), load=[], evict=[], per_step_s=keep_s,
                                  breakdown=bd)
        return IntervalChoice(mode=mode, tau=best, target=target, load=new, evict=evict,
                              per_step_s=cands[mode][best], breakdown=bd)


def _clamped(M: np.ndarray):
    """``m(d)``: ``M[d]``, and ``M``'s last value for a ``d`` beyond it."""
    def m(d):
        return M[min(d, len(M) - 1)]

    return m


def _swap_count(n: int, turnover):
    """``n_of(tau)``: the swaps an interval of ``tau`` steps is charged: ``turnover[tau]`` (its last value beyond
    it) when ``turnover`` is given and not empty, else this boundary's ``n``."""
    tv = None if turnover is None else np.asarray(turnover, dtype=np.float64)

    def n_of(tau):
        return float(n) if tv is None or len(tv) == 0 else float(tv[min(tau, len(tv) - 1)])

    return n_of


def _refresh_sets(score: np.ndarray, resident: set, budget: int) -> tuple[list[int], list[int], list[int]]:
    """``(load, evict, target)`` of a refresh to the top-``budget`` experts by ``score``: the selected experts not
    resident (rank order: most used first), the residents outside the selection that must leave to make room
    (lowest score first; residents are kept while there is room: never demote more than promoted), and the
    resulting set (sorted)."""
    sel = select_top(score, budget).tolist()
    selset = set(sel)
    new = [e for e in sel if e not in resident]
    drop = sorted(resident - selset, key=lambda e: (score[e], e))
    n_evict = max(0, len(resident) + len(new) - budget)
    evict = drop[:n_evict]
    target = sorted((resident - set(evict)) | set(new))
    return new, evict, target


def _landing(new: list[int], rc: np.ndarray, c: TideCosts, queue_s: float, step_s: float, layer_pos: float):
    """``landing(tau)``: the host-fallback seconds an asynchronous refresh loading ``new`` (in that order, behind
    ``queue_s`` seconds of queued copies) costs over its first ``tau`` steps, while each expert is not landed yet
    (``rc``: token counts per expert at the reference step)."""
    n = len(new)
    landed_at = queue_s + c.swap_s * np.arange(1, n + 1)
    unavail = np.maximum(0, np.ceil(landed_at / step_s - layer_pos)).astype(np.int64)  # steps without it
    land_cost = np.array([rc[e] * c.fallback_token_s + (c.fallback_expert_s if rc[e] > 0 else 0.0)
                          for e in new]) if n else np.zeros(0)

    def landing(tau):
        return float((np.minimum(unavail, tau) * land_cost).sum()) if n else 0.0

    return landing


def _async_costs(tmax: int, m, n_of, step_s: float, queue_s: float, swap_s: float, landing_of) -> tuple[dict, dict]:
    """Per interval ``tau`` in ``1..tmax`` of an asynchronous refresh (copies overlap the steps): the expected
    seconds per step and its parts (``IntervalChoice.breakdown``), with ``m(d)`` the expected miss seconds at
    distance ``d``, ``n_of(tau)`` the swaps charged and ``landing_of(tau)`` the host-fallback seconds of the experts
    not landed yet."""
    cands, parts = {}, {}
    cum = 0.0
    for tau in range(1, tmax + 1):
        cum += m(tau)
        hide = tau * step_s
        nt = n_of(tau)
        exposed = max(0.0, queue_s + nt * swap_s - hide) - max(0.0, queue_s - hide)
        landing = landing_of(tau)
        total = exposed + landing + cum
        cands[tau] = total / tau
        parts[tau] = {"swap_s": nt * swap_s, "hidden_s": nt * swap_s - exposed, "exposed_s": exposed,
                      "landing_s": landing, "miss_s": cum, "per_step_s": total / tau}
    return cands, parts


def _sync_costs(tmax: int, m, n_of, swap_s: float) -> tuple[dict, dict]:
    """``_async_costs`` for a synchronous refresh (the step waits for every copy; the set serves from the same
    step on)."""
    cands, parts = {}, {}
    cum = 0.0
    for tau in range(1, tmax + 1):
        cum += m(tau - 1)
        nt = n_of(tau)
        total = nt * swap_s + cum
        cands[tau] = total / tau
        parts[tau] = {"swap_s": nt * swap_s, "hidden_s": 0.0, "exposed_s": nt * swap_s, "landing_s": 0.0,
                      "miss_s": cum, "per_step_s": total / tau}
    return cands, parts
