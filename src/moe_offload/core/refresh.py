"""TIDE refresh planners: which experts each MoE layer keeps on the device during the diffusion steps of a block
(DESIGN.md §5 "TIDE refresh planner"; TIDE "interval-based expert refresh", "I/O-aware scheduling").

Pure decision logic (numpy, no tensors, no I/O): the trace simulator (``sim.diffusion_sim``) and the runtime drive
the very same objects through one interface, :class:`RefreshPlanner`:

``begin_block(request, block)``
    a new block of masked tokens starts (TIDE treats each block separately: stability holds within a block).
``begin_step(step) -> RefreshPlan | None``
    before diffusion step ``step`` (0, 1, ... within the block) runs: asynchronous prefetches to start now
    (``Transfer(blocking=False)``: copy ``load`` host->device in that order, drop ``evict``). An expert of such a
    plan is *in flight* until the executor reports it with ``land``; until then a layer that needs it computes it
    on the host.
``route(layer, counts) -> LayerDecision``
    after MoE ``layer``'s router ran in this step (``counts``: int ``[num_experts]``, tokens routed to each
    expert): which experts to compute on the device and which on the host (fallback), and any *blocking* copies to
    do before computing the layer (``LayerDecision.transfer``, ``blocking=True``: reactive on-demand loads,
    tide-fixed refreshes). ``route`` also records ``counts`` (the activation tracker); call it exactly once per
    layer and step, in layer order.
``land(layer, experts)``
    the executor reports finished asynchronous copies.
``end_step(step_seconds=None)``
    the step finished; optionally its wall (or modelled) seconds, which the cost-aware planner uses to estimate
    how many steps a prefetch takes.
``resident(layer)`` / ``in_flight(layer)``
    the layer's experts on the device (landed) / being copied. Always ``|resident| + |in_flight| <= budget``:
    a prefetch's victims leave when its copies start, so no staging memory beyond the budget is needed.

Planners (``make_refresh_planner``):

* ``reactive``: per step, every needed expert that is not resident is loaded on demand (blocking), LRU eviction at
  the budget (``core.slots.SlotTable`` + ``core.policies.LRU``, one table per layer); no host fallback.
* ``tide-fixed`` (interval ``T``): the TIDE authors' reference behaviour (github ims-kdks/TIDE,
  ``modeling_llada2_moe.py``, ``jump_steps``): at every step ``s`` of a block with ``s % T == 0``, when a layer's
  router has run, the layer's resident set becomes the ``budget`` experts with the most tokens in this very step
  (experts with zero tokens are never promoted; as many residents as promoted experts are demoted, the others
  stay), loaded synchronously before the layer computes; between refreshes every miss is computed on the host.
* ``tide``: the interval optimiser (:class:`IntervalOptimiser`) picks, at each interval boundary, the interval
  length, the set and how to refresh: prefetch it asynchronously while the interval computes (misses and not yet
  landed experts fall back to the host), refresh synchronously from the step's own counts like ``tide-fixed``,
  or keep the current set one more step. At step 0 of a block, where no in-block history exists, it refreshes
  synchronously (the authors' code refreshes at step 0 of every block). Per miss it chooses between the host
  fallback and an on-demand swap, whichever the cost model finds cheaper for the miss's tokens
  (``TidePlanner``'s ``on_demand``; ``LayerDecision.rounds`` reuse the slots of experts already computed).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from ..errors import MoeOffloadError
from .costs import TideCosts

# ------------------------------------------------------------------------------------------------ plans


@dataclass
class Transfer:
    """Copies of one MoE layer.

    Attributes:
        layer: MoE layer index.
        load: experts to copy host->device, in this order.
        evict: experts whose device copies (landed or still in flight: cancel those) are dropped; their slots take
            ``load``.
        blocking: True: the layer waits for the copies before computing (on-demand / synchronous refresh);
            False: asynchronous prefetch, reported back with ``RefreshPlanner.land``.
    """

    layer: int
    load: list[int]
    evict: list[int]
    blocking: bool


@dataclass
class RefreshPlan:
    """Asynchronous prefetches decided at the start of a diffusion step (``RefreshPlanner.begin_step``).

    Attributes:
        block, step: where the decision was taken.
        transfers: one ``Transfer(blocking=False)`` per refreshed layer, in layer order (copy them in this order:
            earlier layers are needed earlier in the next step).
        choices: ``{layer: IntervalChoice}`` (the optimiser's decision and predicted cost breakdown; tide only).
    """

    block: int
    step: int
    transfers: list[Transfer]
    choices: dict = field(default_factory=dict)


@dataclass
class LayerDecision:
    """How one MoE layer of one step gets its experts computed (``RefreshPlanner.route``).

    Attributes:
        layer: MoE layer index.
        device: experts computed on the device (sorted ids).
        host: experts computed on the host, the fallback (sorted ids).
        transfer: blocking copies to finish before computing (None: none).
        hit_tokens, hit_experts: token-experts / experts resident before any blocking copy of this layer (a hit
            in DESIGN.md §2's sense).
        device_tokens, host_tokens: token-experts computed on the device / on the host.
        slot_plan: reactive only: the per-layer ``core.slots.LayerPlan`` (its ``rounds`` say which loads to do
            before which computations when the layer needs more experts than the budget holds); None otherwise.
        rounds: tide with on-demand swaps only: the ``Round``s to execute in order (their loads and evictions
            together are ``transfer``); the experts of ``host`` are computed on the host besides. None otherwise.
    """

    layer: int
    device: list[int]
    host: list[int]
    transfer: Transfer | None
    hit_tokens: int
    hit_experts: int
    device_tokens: int
    host_tokens: int
    slot_plan: object | None = None
    rounds: list | None = None


@dataclass
class Round:
    """One round of a layer's on-demand execution (``LayerDecision.rounds``): drop ``evict`` (experts already
    computed in an earlier round of this step, or not needed in it), copy ``load`` host->device (blocking) into
    their slots, then compute ``compute`` (resident now) on the device."""

    load: list[int]
    evict: list[int]
    compute: list[int]


def select_top(score: np.ndarray, budget: int) -> np.ndarray:
    """The experts with the largest positive ``score`` (float or int ``[E]``), at most ``budget`` of them, ties
    broken by the lower id; int64 array in that rank order."""
    score = np.asarray(score)
    pos = np.flatnonzero(score > 0)
    if len(pos) == 0 or budget <= 0:
        return np.zeros(0, dtype=np.int64)
    order = pos[np.lexsort((pos, -score[pos]))]
    return order[:budget].astype(np.int64)


# ------------------------------------------------------------------------------------------------ tracking


class ActivationTracker:
    """Per MoE layer: token counts per expert for every diffusion step of the current block (TIDE's "expert
    activation tracker"), plus a long-run frequency over all blocks.

    Args:
        num_layers: MoE layers L.
        num_experts: experts per layer E.
        history_decay: weight of each older in-block step in :meth:`score`'s tie-break term (0..1).
        longrun_decay: per-step decay of the long-run frequency (0..1).
    """

    def __init__(self, num_layers: int, num_experts: int, history_decay: float = 0.5, longrun_decay: float = 0.98):
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.history_decay = float(history_decay)
        self.longrun_decay = float(longrun_decay)
        self._steps: list[list[np.ndarray]] = [[] for _ in range(self.num_layers)]
        self._older = np.zeros((self.num_layers, self.num_experts))  # decayed sum of in-block steps before the last
        self._longrun = np.zeros((self.num_layers, self.num_experts))

    def begin_block(self) -> None:
        """Forget the in-block history (the long-run frequency is kept)."""
        self._steps = [[] for _ in range(self.num_layers)]
        self._older[:] = 0.0

    def observe(self, layer: int, counts) -> np.ndarray:
        """Record one step's counts of ``layer``: int ``[E]``, tokens routed to each expert.

        Returns the counts as an int64 array. Raises MoeOffloadError for a bad layer or shape or negative counts.
        """
        if not 0 <= layer < self.num_layers:
            raise MoeOffloadError(f"layer {layer} out of range [0, {self.num_layers})")
        c = np.asarray(counts)
        if c.shape != (self.num_experts,):
            raise MoeOffloadError(f"counts of layer {layer} must have shape ({self.num_experts},), got {c.shape}")
        c = c.astype(np.int64)
        if c.size and c.min() < 0:
            raise MoeOffloadError("counts must be >= 0")
        hist = self._steps[layer]
        if hist:
            self._older[layer] = self.history_decay * self._older[layer] + hist[-1]
        hist.append(c)
        self._longrun[layer] = self.longrun_decay * self._longrun[layer] + c
        return c

    def history(self, layer: int) -> np.ndarray:
        """This block's counts of ``layer`` so far, int64 ``[steps, E]``."""
        h = self._steps[layer]
        return np.stack(h) if h else np.zeros((0, self.num_experts), dtype=np.int64)

    def last(self, layer: int) -> np.ndarray | None:
        """The most recent step's counts of ``layer`` in this block (None before the first)."""
        h = self._steps[layer]
        return h[-1] if h else None

    def score(self, layer: int) -> np.ndarray:
        """Selection score ``[E]`` (float): the last step's counts; ties broken by the decayed older in-block counts,
        then by the long-run frequency (so a set with room beyond the last step's active experts is filled with
        the next most likely ones). Zero for experts never seen."""
        last = self.last(layer)
        base = last.astype(np.float64) if last is not None else np.zeros(self.num_experts)
        older = self._older[layer]
        lr = self._longrun[layer]
        o = older / (older.max() + 1.0)
        g = lr / (lr.max() + 1.0)
        return base + 1e-3 * o + 1e-6 * g


class StabilityEstimator:
    """Expected misses at distance ``d`` after a refresh, for one MoE layer (TIDE's stability, DESIGN.md §5).

    Quantity: a refresh at reference step ``r`` keeps ``S_r`` = the ``budget`` experts with the highest
    ``ActivationTracker.score`` after step ``r`` (:func:`select_top`); ``d`` steps later the step's token-experts
    whose expert is not in ``S_r`` are misses. The estimator measures, from the recent blocks, the miss fraction
    ``mu(d)`` = missed token-experts / token-experts and the missed experts ``nu(d)`` (active experts outside the
    set), and the turnover ``|S_s minus S_r|`` of the selection (the experts a refresh loads), for
    ``d = 0..max_distance``.
    It measures them at *every* step of a block as a potential refresh point
    (every pair of steps ``(r, r + d)`` of the block), not only at the refreshes the planner took, so distances
    beyond the intervals chosen so far are observed too (no exploration bias).

    Recency: at each new block, the accumulated sums are multiplied by ``decay``.

    Tokens per step: the intervals the optimiser prices cover steps after a block's first (``TidePlanner`` decides
    at steps >= 1), and a block's first step may route more tokens than the others — with the block-prefix KV cache
    (``models.diffusion_forward``) it also computes the block committed just before (the prompt's complete blocks in
    a request's first step). So ``token_experts_per_step`` and ``active_per_step`` are means over the later steps
    of the blocks (``observe(..., first=True)`` marks a block's first step), over all steps until a later one is
    seen; the miss fractions are measured at every step.

    Prior (before data, and blended with few observations, weight ``prior_weight`` steps): ``mu(d) = (1 - B/E) *
    (1 - rho**d)`` — no miss at the reference step, tending to the miss fraction of an arbitrary set of ``B`` of
    ``E`` experts under uniform routing — with ``rho = prior_rho`` (0.8: a set still covers most of the routing 5
    steps later, TIDE's "say, 5 consecutive diffusion steps"; an assumption); ``nu(d) = mu(d) * active`` with the
    observed mean active experts per step (before any step: the expected distinct experts of 32 tokens x top-8
    under uniform routing). Estimates are made non-decreasing in ``d`` (misses grow with distance).

    Args:
        num_experts, budget: E and B (``1 <= B <= E``).
        max_distance: largest distance tracked (>= 1).
        decay: per-block decay of the accumulated evidence (0..1].
        prior_rho, prior_weight: the prior (see above).
        top_k: experts per token (for the prior's active-expert guess).

    Raises:
        MoeOffloadError: arguments out of range.
    """

    def __init__(self, num_experts: int, budget: int, max_distance: int = 16, decay: float = 0.7,
                 prior_rho: float = 0.8, prior_weight: float = 1.0, top_k: int = 8):
        if not 1 <= budget <= num_experts:
            raise MoeOffloadError(f"budget must be in [1, {num_experts}], got {budget}")
        if max_distance < 1 or not 0 < decay <= 1 or not 0 <= prior_rho < 1 or prior_weight < 0:
            raise MoeOffloadError("max_distance >= 1, 0 < decay <= 1, 0 <= prior_rho < 1, prior_weight >= 0")
        self.E, self.B, self.D = int(num_experts), int(budget), int(max_distance)
        self.decay, self.prior_rho, self.prior_weight = float(decay), float(prior_rho), float(prior_weight)
        n = self.D + 1
        self._miss_tok = np.zeros(n)
        self._tok = np.zeros(n)
        self._miss_exp = np.zeros(n)
        self._pairs = np.zeros(n)
        self._turn = np.zeros(n)
        self._masks: list[np.ndarray] = []
        self._sum_tok = np.zeros(2)   # [all steps, steps after a block's first]
        self._sum_act = np.zeros(2)
        self._nsteps = np.zeros(2)
        self._act0 = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** (32 * top_k))

    def begin_block(self) -> None:
        """A new block: forget the in-block reference sets; decay the accumulated evidence."""
        self._masks = []
        for a in (self._miss_tok, self._tok, self._miss_exp, self._pairs, self._turn):
            a *= self.decay
        for a in (self._sum_tok, self._sum_act, self._nsteps):
            a *= self.decay

    def observe(self, counts: np.ndarray, score: np.ndarray, first: bool = False) -> None:
        """Record step ``s``'s counts (int ``[E]``) against the sets of the block's earlier steps, then record this
        step's own set (from ``score`` ``[E]``, the tracker's score after observing step ``s``); ``first``: ``s`` is
        the block's first step (not counted in the per-step means, see the class docstring)."""
        c = np.asarray(counts, dtype=np.float64)
        act = (c > 0).astype(np.float64)
        tot = c.sum()
        mask = np.zeros(self.E, dtype=bool)
        mask[select_top(score, self.B)] = True
        refs = self._masks[-self.D:] if self._masks else []
        if refs:
            out = ~np.stack(refs)  # [r, E], experts outside each earlier set; last row is distance 1
            mt = out @ c
            me = out @ act
            tn = out @ mask.astype(np.float64)
            d = np.arange(len(refs), 0, -1)
            np.add.at(self._turn, d, tn)
            np.add.at(self._miss_tok, d, mt)
            np.add.at(self._miss_exp, d, me)
            np.add.at(self._tok, d, tot)
            np.add.at(self._pairs, d, 1.0)
        self._miss_tok[0] += c[~mask].sum()
        self._miss_exp[0] += act[~mask].sum()
        self._tok[0] += tot
        self._pairs[0] += 1.0
        self._masks.append(mask)
        which = [0] if first else [0, 1]
        self._sum_tok[which] += tot
        self._sum_act[which] += act.sum()
        self._nsteps[which] += 1.0

    def _mean(self, sums: np.ndarray) -> float | None:
        i = 1 if self._nsteps[1] > 0 else 0
        return float(sums[i] / self._nsteps[i]) if self._nsteps[i] > 0 else None

    @property
    def token_experts_per_step(self) -> float | None:
        """Mean token-experts per step after a block's first (recency-weighted; class docstring); None before any
        step."""
        return self._mean(self._sum_tok)

    @property
    def active_per_step(self) -> float:
        """Mean active experts per step after a block's first (recency-weighted; the prior's guess before any
        step)."""
        m = self._mean(self._sum_act)
        return self._act0 if m is None else m

    def prior_mu(self) -> np.ndarray:
        """The prior miss fraction ``[D + 1]`` (see the class docstring)."""
        d = np.arange(self.D + 1)
        return (1.0 - self.B / self.E) * (1.0 - self.prior_rho ** d)

    def curves(self) -> tuple[np.ndarray, np.ndarray]:
        """``(mu, nu)``, float64 ``[D + 1]``: expected miss fraction of token-experts and expected missed experts
        at distance ``d = 0..D`` from the reference step (non-decreasing in ``d``)."""
        tk = self.token_experts_per_step or 1.0
        w = self.prior_weight
        pm = self.prior_mu()
        pn = pm * self.active_per_step
        den = self._tok + w * tk
        mu = np.divide(self._miss_tok + w * tk * pm, den, out=pm.copy(), where=den > 0)
        den = self._pairs + w
        nu = np.divide(self._miss_exp + w * pn, den, out=pn.copy(), where=den > 0)
        return np.maximum.accumulate(mu), np.maximum.accumulate(nu)

    def turnover(self) -> np.ndarray:
        """Expected experts a refresh loads, float64 ``[D + 1]``: ``|S_s minus S_r|`` for sets selected ``d = s - r``
        steps apart (0 at ``d = 0``; non-decreasing). Prior (no pair observed): the prior miss fraction times the
        budget."""
        w = self.prior_weight
        pt = self.prior_mu() * self.B
        den = self._pairs + w
        t = np.divide(self._turn + w * pt, den, out=pt.copy(), where=den > 0)
        t[0] = 0.0
        return np.maximum.accumulate(t)

    def expected_miss_s(self, costs: TideCosts) -> np.ndarray:
        """Expected host-fallback seconds per step at distance ``d = 0..D``:
        ``mu(d) * token_experts_per_step * fallback_token_s + nu(d) * fallback_expert_s``."""
        mu, nu = self.curves()
        tk = self.token_experts_per_step or 0.0
        return mu * tk * costs.fallback_token_s + nu * costs.fallback_expert_s


# ------------------------------------------------------------------------------------------------ optimiser


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
        sel = select_top(score, budget).tolist()
        selset = set(sel)
        new = [e for e in sel if e not in resident]  # rank order: most used first
        # keep residents outside the selection while there is room (never demote more than promoted)
        drop = sorted(resident - selset, key=lambda e: (score[e], e))
        n_evict = max(0, len(resident) + len(new) - budget)
        evict = drop[:n_evict]
        target = sorted((resident - set(evict)) | set(new))
        rc = np.floor(np.asarray(score)) if ref_counts is None else np.asarray(ref_counts)
        n = len(new)
        landed_at = queue_s + c.swap_s * np.arange(1, n + 1)
        unavail = np.maximum(0, np.ceil(landed_at / step_s - layer_pos)).astype(np.int64)  # steps without it
        land_cost = np.array([rc[e] * c.fallback_token_s + (c.fallback_expert_s if rc[e] > 0 else 0.0)
                              for e in new]) if n else np.zeros(0)

        def m(d):
            return M[min(d, len(M) - 1)]

        tv = None if turnover is None else np.asarray(turnover, dtype=np.float64)

        def n_of(tau):
            return float(n) if tv is None or len(tv) == 0 else float(tv[min(tau, len(tv) - 1)])

        tmax = self.tau_max
        if horizon is not None:
            tmax = max(1, min(tmax, int(math.ceil(horizon))))
        cands: dict = {}
        parts: dict = {}
        if "async" in self.modes:
            cands["async"], parts["async"] = {}, {}
            cum = 0.0
            for tau in range(1, tmax + 1):
                cum += m(tau)
                hide = tau * step_s
                nt = n_of(tau)
                exposed = max(0.0, queue_s + nt * c.swap_s - hide) - max(0.0, queue_s - hide)
                landing = float((np.minimum(unavail, tau) * land_cost).sum()) if n else 0.0
                total = exposed + landing + cum
                cands["async"][tau] = total / tau
                parts["async"][tau] = {"swap_s": nt * c.swap_s, "hidden_s": nt * c.swap_s - exposed,
                                       "exposed_s": exposed, "landing_s": landing, "miss_s": cum,
                                       "per_step_s": total / tau}
        if "sync" in self.modes:
            cands["sync"], parts["sync"] = {}, {}
            cum = 0.0
            for tau in range(1, tmax + 1):
                cum += m(tau - 1)
                nt = n_of(tau)
                total = nt * c.swap_s + cum
                cands["sync"][tau] = total / tau
                parts["sync"][tau] = {"swap_s": nt * c.swap_s, "hidden_s": 0.0, "exposed_s": nt * c.swap_s,
                                      "landing_s": 0.0, "miss_s": cum, "per_step_s": total / tau}
        mode, best = min(((md, t) for md in cands for t in cands[md]),
                         key=lambda x: (cands[x[0]][x[1]], x[1], x[0] != "async"))
        keep_s = None if age is None else float(m(age + 1))
        bd = dict(parts[mode][best], candidates=cands, keep_s=keep_s, n_load=n, tau=best, mode=mode)
        if keep_s is not None and n > 0 and keep_s <= cands[mode][best]:
            return IntervalChoice(mode="keep", tau=1, target=sorted(resident), load=[], evict=[], per_step_s=keep_s,
                                  breakdown=bd)
        return IntervalChoice(mode=mode, tau=best, target=target, load=new, evict=evict,
                              per_step_s=cands[mode][best], breakdown=bd)


# ------------------------------------------------------------------------------------------------ planners


class RefreshPlanner(ABC):
    """Interface of the refresh planners (module docstring: call order and semantics).

    Args:
        num_layers: MoE layers L (>= 1).
        num_experts: experts per layer E (>= 1).
        budget: experts each layer may hold on the device, ``1 <= budget <= E``. A planner starts with no expert
            resident (cold), except when ``budget == E``: then every expert is resident from the start (FullLoad)
            and nothing is ever copied.

    Attributes:
        stats: counters: ``swaps`` (experts copied), ``blocking_swaps``, ``prefetch_swaps``, ``refreshes``
            (layer refreshes), ``steps`` (steps begun), ``intervals`` (list of chosen interval lengths, tide).

    Raises:
        MoeOffloadError: bad geometry or budget.
    """

    name = "base"

    def __init__(self, num_layers: int, num_experts: int, budget: int):
        if num_layers < 1 or num_experts < 1:
            raise MoeOffloadError(f"need num_layers >= 1 and num_experts >= 1, got {num_layers}, {num_experts}")
        if not 1 <= budget <= num_experts:
            raise MoeOffloadError(f"budget must be in [1, {num_experts}] experts per layer, got {budget}")
        self.num_layers, self.num_experts, self.budget = int(num_layers), int(num_experts), int(budget)
        full = self.budget == self.num_experts  # everything fits: start as FullLoad (all resident)
        self._resident: list[set[int]] = [set(range(self.num_experts)) if full else set()
                                          for _ in range(self.num_layers)]
        self._in_flight: list[dict[int, None]] = [dict() for _ in range(self.num_layers)]
        self.tracker = ActivationTracker(self.num_layers, self.num_experts)
        self.request = -1
        self.block = -1
        self.step = -1
        self.stats = {"swaps": 0, "blocking_swaps": 0, "prefetch_swaps": 0, "refreshes": 0, "steps": 0,
                      "intervals": []}

    # ---- queries
    def resident(self, layer: int) -> frozenset:
        """Experts of ``layer`` on the device (landed)."""
        return frozenset(self._resident[layer])

    def in_flight(self, layer: int) -> frozenset:
        """Experts of ``layer`` being copied asynchronously (not usable yet)."""
        return frozenset(self._in_flight[layer])

    # ---- events
    def begin_block(self, request: int, block: int) -> None:
        """A new block begins (resets the in-block activation history)."""
        self.request, self.block, self.step = int(request), int(block), -1
        self.tracker.begin_block()

    def begin_step(self, step: int) -> RefreshPlan | None:
        """Diffusion step ``step`` of the current block begins; returns the asynchronous prefetches to start (None
        for none). Raises MoeOffloadError before ``begin_block`` or when steps do not count 0, 1, 2, ..."""
        if self.block < 0:
            raise MoeOffloadError("begin_step before begin_block")
        if step != self.step + 1:
            raise MoeOffloadError(f"diffusion step {step} after step {self.step}: steps of a block count 0, 1, ...")
        self.step = int(step)
        self.stats["steps"] += 1
        return self._plan_step()

    def _plan_step(self) -> RefreshPlan | None:
        return None

    def route(self, layer: int, counts) -> LayerDecision:
        """Decide ``layer``'s experts for the current step from its router's ``counts`` (int ``[E]``) and record
        them. Raises MoeOffloadError before ``begin_step`` or for a bad layer / counts shape."""
        if self.step < 0:
            raise MoeOffloadError("route before begin_step")
        c = self.tracker.observe(layer, counts)
        return self._route(layer, c)

    @abstractmethod
    def _route(self, layer: int, counts: np.ndarray) -> LayerDecision:
        """Planner-specific part of ``route`` (counts already recorded)."""

    def land(self, layer: int, experts) -> None:
        """Asynchronous copies of ``experts`` of ``layer`` finished: they become resident (ids that are not in
        flight, e.g. cancelled ones, are ignored)."""
        fl = self._in_flight[layer]
        for e in experts:
            e = int(e)
            if e in fl:
                del fl[e]
                self._resident[layer].add(e)

    def end_step(self, step_seconds: float | None = None) -> None:
        """The current step finished, in ``step_seconds`` (optional; used by cost-aware planners)."""

    # ---- helpers
    def _mask(self, experts) -> np.ndarray:
        """Bool ``[E]``: True for the given experts (a set or another iterable of ints)."""
        m = np.zeros(self.num_experts, dtype=bool)
        if experts:
            m[np.fromiter(experts, dtype=np.int64, count=len(experts))] = True
        return m

    def _decision(self, layer: int, counts: np.ndarray, before: set, transfer: Transfer | None) -> LayerDecision:
        act = np.flatnonzero(counts)
        on = self._mask(self._resident[layer])[act]
        dev, host = act[on], act[~on]
        hit = act[self._mask(before)[act]]
        return LayerDecision(layer=layer, device=dev.tolist(), host=host.tolist(), transfer=transfer,
                             hit_tokens=int(counts[hit].sum()), hit_experts=len(hit),
                             device_tokens=int(counts[dev].sum()), host_tokens=int(counts[host].sum()))

    def _sync_refresh(self, layer: int, counts: np.ndarray) -> Transfer:
        """The authors' refresh: resident := the budget experts with the most tokens in ``counts`` (positive only),
        demoting as many residents as promoted (those with the fewest tokens in ``counts`` first, ties by lower
        id) once the budget is full, loaded before the layer computes. In-flight copies of the layer are cancelled."""
        res = self._resident[layer]
        cancelled = list(self._in_flight[layer])
        self._in_flight[layer].clear()
        target = [int(e) for e in select_top(counts, self.budget)]
        tset = set(target)
        promote = [e for e in target if e not in res]
        drop = sorted(res - tset, key=lambda e: (counts[e], e))
        n_demote = max(0, len(res) + len(promote) - self.budget)
        demote = drop[:n_demote]
        res.difference_update(demote)
        res.update(promote)
        self.stats["swaps"] += len(promote)
        self.stats["blocking_swaps"] += len(promote)
        self.stats["refreshes"] += 1
        return Transfer(layer=layer, load=promote, evict=demote + cancelled, blocking=True)


class ReactivePlanner(RefreshPlanner):
    """Per-step on-demand loading with LRU eviction at the budget, no host fallback (the AR-style baseline TIDE
    compares against: "swap E1 out, E3 in" at every step).

    One ``core.slots.SlotTable`` with ``budget`` slots and an ``LRU`` policy per layer: needed experts are planned
    in ascending id order, resident ones are hits, the others are loaded on demand (evicting the least recently
    used expert the layer does not need); when a layer needs more experts than the budget, the table runs rounds
    (``SlotTable.plan_layer``) and an expert may be loaded and evicted within one step.
    """

    name = "reactive"

    def __init__(self, num_layers: int, num_experts: int, budget: int):
        super().__init__(num_layers, num_experts, budget)
        from .policies import LRU
        from .slots import SlotTable

        self._tables = [SlotTable(self.budget, self.num_experts, LRU()) for _ in range(self.num_layers)]
        if self.budget == self.num_experts:
            for t in self._tables:
                t.plan_layer(list(range(self.num_experts)))  # FullLoad start (not counted as swaps)
        self._resident = [t.policy.resident for t in self._tables]  # the LRU policy's set of slotted experts

    def _route(self, layer, counts):
        table = self._tables[layer]
        act = np.flatnonzero(counts)
        before = {int(e) for e in act if table.is_resident(int(e))}
        plan = table.plan_layer([int(e) for e in act], [int(counts[e]) for e in act])
        loads = [ld.eid for r in plan.rounds for ld in r.loads]
        evicted = [ld.evicted for r in plan.rounds for ld in r.loads if ld.evicted >= 0]
        self.stats["swaps"] += len(loads)
        self.stats["blocking_swaps"] += len(loads)
        tr = Transfer(layer=layer, load=loads, evict=evicted, blocking=True) if loads else None
        dev = [int(e) for e in act]
        return LayerDecision(layer=layer, device=dev, host=[], transfer=tr,
                             hit_tokens=int(sum(counts[e] for e in before)), hit_experts=len(before),
                             device_tokens=int(counts[act].sum()) if len(act) else 0, host_tokens=0,
                             slot_plan=plan)


class TideFixedPlanner(RefreshPlanner):
    """TIDE's fixed-interval refresh, the authors' reference behaviour (``jump_steps``; module docstring).

    At every step ``s`` of a block with ``s % interval == 0`` each layer refreshes synchronously from its current
    step's counts; other steps compute misses on the host.

    Args:
        interval: T, steps between refreshes (>= 1).
        refresh_first_block: also refresh at every step of a request's first block (the authors' latest code
            does, ``num_block == prefill_blocks``); default False.
    """

    name = "tide-fixed"

    def __init__(self, num_layers: int, num_experts: int, budget: int, interval: int = 1,
                 refresh_first_block: bool = False):
        super().__init__(num_layers, num_experts, budget)
        if interval < 1:
            raise MoeOffloadError(f"the refresh interval must be >= 1 step, got {interval}")
        self.interval = int(interval)
        self.refresh_first_block = bool(refresh_first_block)
        self.name = f"tide-fixed-T{self.interval}"
        self._first_block = None

    def begin_block(self, request, block):
        if request != self.request:
            self._first_block = block
        super().begin_block(request, block)

    def _route(self, layer, counts):
        before = set(self._resident[layer])
        refresh = self.step % self.interval == 0 or (self.refresh_first_block and self.block == self._first_block)
        tr = self._sync_refresh(layer, counts) if refresh else None
        if tr is not None and not tr.load and not tr.evict:
            tr = None
        return self._decision(layer, counts, before, tr)


class TidePlanner(RefreshPlanner):
    """TIDE with the I/O-aware interval optimiser and asynchronous prefetch (module docstring).

    Per layer: an ``ActivationTracker`` (shared), a :class:`StabilityEstimator` and the boundary of its current
    interval. At step 0 of a block: synchronous refresh from the step's counts (``block_start="sync"``, the
    authors' behaviour) or nothing (``"keep"``). At a later boundary ``b`` (``begin_step(b)``), the
    :class:`IntervalOptimiser` decides from the counts up to step ``b - 1``: an ``async`` refresh's copies are
    returned as a ``RefreshPlan`` and overlap the interval's compute; a ``sync`` refresh happens in ``route`` of
    step ``b`` (a blocking ``Transfer``); ``keep`` re-decides at ``b + 1``.

    Args:
        costs: the cost model (seconds of swaps, fallbacks, compute).
        tau_max: longest interval considered.
        block_start: ``"sync"`` or ``"keep"``.
        estimator_kw: keyword arguments of :class:`StabilityEstimator` (``decay``, ``prior_rho``, ...).
        modes: refresh modes the optimiser may choose (``("async",)``: prefetch only, TIDE as described).
        on_demand: per-miss choice between a swap and a host fallback (default True): a missed expert with
            ``c`` tokens is swapped in on demand when ``swap_s + device_time(c, 1) < fallback_time(c, 1)`` — into a
            free slot, the slot of a resident expert this step does not use, or, in a later round, the slot of a
            resident expert already computed this step (fewest tokens first) — and computed on the host
            otherwise. With a fast link (e.g. H200) most misses are cheaper to swap; with a slow one only the
            heavily used ones are. Not applied in a step where the layer refreshes synchronously. When a layer's
            typical miss is cheaper to swap (``swap_beats_fallback``) the layer also skips the asynchronous
            refreshes: its working set then follows the on-demand swaps.

    Attributes:
        last_choices: ``{layer: IntervalChoice}`` of the latest decisions (for reports and tests).
    """

    name = "tide"

    def __init__(self, num_layers: int, num_experts: int, budget: int, costs: TideCosts, tau_max: int = 16,
                 block_start: str = "sync", estimator_kw: dict | None = None, modes=("async", "sync"),
                 on_demand: bool = True):
        super().__init__(num_layers, num_experts, budget)
        self.on_demand = bool(on_demand)
        if block_start not in ("sync", "keep"):
            raise MoeOffloadError(f"block_start must be 'sync' or 'keep', got {block_start!r}")
        self.costs = costs
        self.tau_max = int(tau_max)
        self.block_start = block_start
        self.optimiser = IntervalOptimiser(costs, tau_max, modes)
        kw = dict(max_distance=max(self.tau_max + 1, 2), top_k=costs.top_k or 8)
        kw.update(estimator_kw or {})
        self.estimators = [StabilityEstimator(self.num_experts, self.budget, **kw) for _ in range(self.num_layers)]
        self._next = [0] * self.num_layers          # step of the layer's next decision
        self._ref = [None] * self.num_layers        # reference step of the layer's current set (None: no set)
        self._since = [0] * self.num_layers         # steps since the layer's last refresh
        self._sync_at = [-1] * self.num_layers      # step at which route refreshes synchronously (-1: none)
        self._step_s: float | None = None           # EMA of observed step seconds
        self._block_steps: float | None = None      # EMA of steps per block
        self.last_choices: dict[int, IntervalChoice] = {}

    def begin_block(self, request, block):
        if self.step >= 0 and self.block >= 0:
            n = self.step + 1
            self._block_steps = n if self._block_steps is None else 0.7 * self._block_steps + 0.3 * n
        super().begin_block(request, block)
        for est in self.estimators:
            est.begin_block()
        for layer in range(self.num_layers):
            self._next[layer] = 0
            self._sync_at[layer] = -1
            if self._ref[layer] is not None:
                self._ref[layer] = -10 ** 6  # the set's reference lies in an earlier block: treat as stale

    def step_seconds_estimate(self) -> float:
        """Expected seconds of one step: the EMA of ``end_step`` feedback, else a model estimate from the costs
        (non-expert work plus every layer computing its observed active experts on the device)."""
        if self._step_s is not None:
            return self._step_s
        c = self.costs
        est = self.estimators[0]
        tk = est.token_experts_per_step or 0.0
        return max(c.nonexpert_step_s + self.num_layers * c.device_time(tk, est.active_per_step), 1e-6)

    def _plan_step(self):
        s = self.step
        if s == 0:
            return None
        transfers, choices = [], {}
        queue = sum(len(f) for f in self._in_flight) * self.costs.swap_s
        step_s = self.step_seconds_estimate()
        horizon = None if self._block_steps is None else max(1.0, self._block_steps - s)
        for layer in range(self.num_layers):
            if self._next[layer] > s:
                continue
            last = self.tracker.last(layer)
            if last is None:
                continue
            est = self.estimators[layer]
            if self.on_demand and self.swap_beats_fallback(est):
                self._next[layer] = s + 1  # misses are swapped on demand (route): nothing to prefetch
                continue
            occupied = self._resident[layer] | set(self._in_flight[layer])
            ref = self._ref[layer]
            age = None if ref is None else (s - 1) - ref
            ch = self.optimiser.choose(self.tracker.score(layer), occupied, self.budget,
                                       est.expected_miss_s(self.costs), step_s, ref_counts=last, queue_s=queue,
                                       layer_pos=(layer + 1) / (self.num_layers + 1), age=age, horizon=horizon,
                                       turnover=est.turnover())
            choices[layer] = ch
            if ch.mode == "keep":
                self._next[layer] = s + 1
                continue
            self._next[layer] = s + ch.tau
            if ch.mode == "sync":
                self._sync_at[layer] = s  # refreshed in route, from this step's counts
                continue
            self._ref[layer] = s - 1
            self.stats["intervals"].append(self._since[layer])
            self._since[layer] = 0
            self.stats["refreshes"] += 1
            if not ch.load and not ch.evict:
                continue
            fl = self._in_flight[layer]
            for e in ch.evict:
                self._resident[layer].discard(e)
                fl.pop(e, None)
            for e in ch.load:
                fl[e] = None
            self.stats["swaps"] += len(ch.load)
            self.stats["prefetch_swaps"] += len(ch.load)
            queue += len(ch.load) * self.costs.swap_s
            transfers.append(Transfer(layer=layer, load=list(ch.load), evict=list(ch.evict), blocking=False))
        self.last_choices = choices
        if not transfers and not choices:
            return None
        return RefreshPlan(block=self.block, step=s, transfers=transfers, choices=choices)

    def _route(self, layer, counts):
        before = set(self._resident[layer])
        tr = None
        sync = self._sync_at[layer] == self.step
        if self.step == 0 and self.block_start == "sync":
            sync = True
            self._next[layer] = 1
        if sync:
            self._sync_at[layer] = -1
            tr = self._sync_refresh(layer, counts)
            if self._ref[layer] is not None:
                self.stats["intervals"].append(self._since[layer])
            self._since[layer] = 0
            self._ref[layer] = self.step
            if not tr.load and not tr.evict:
                tr = None
        est = self.estimators[layer]
        est.observe(counts, self.tracker.score(layer), first=self.step == 0)
        self._since[layer] += 1
        if self.on_demand:
            return self._on_demand(layer, counts, before, tr)
        return self._decision(layer, counts, before, tr)

    def swap_beats_fallback(self, est: "StabilityEstimator") -> bool:
        """Whether a typical miss (the layer's mean tokens per active expert, ``est``) costs less swapped in on
        demand than computed on the host: then the layer runs without asynchronous refreshes and its misses are
        swapped in (``on_demand``), as on a fast link; otherwise the interval optimiser plans its refreshes."""
        c = self.costs
        tk = est.token_experts_per_step
        if not tk or est.active_per_step <= 0:
            return False
        mean = tk / est.active_per_step
        return c.swap_s + c.device_time(mean, 1) < c.fallback_time(mean, 1)

    def _on_demand(self, layer: int, counts: np.ndarray, before: set, sync: Transfer | None) -> LayerDecision:
        """Route with the per-miss swap-or-fallback choice (class docstring, ``on_demand``); ``sync``: this step's
        synchronous refresh (already applied to the resident set), which becomes part of the first round."""
        c = self.costs
        # swap_s + device_time(n, 1) < fallback_time(n, 1)  <=>  n * gain > swap_s + device_expert_s - fallback_expert_s
        gain = c.fallback_token_s - c.device_token_s
        base = c.swap_s + c.device_expert_s - c.fallback_expert_s
        if (gain <= 0 and base >= 0) or (gain > 0 and counts.max(initial=0) * gain <= base):
            return self._decision(layer, counts, before, sync)  # no miss of this step is cheaper to swap
        res, fl = self._resident[layer], self._in_flight[layer]
        act = np.flatnonzero(counts)
        res_mask = self._mask(res)
        cand = act[(counts[act] * gain > base) & ~res_mask[act] & ~self._mask(fl)[act]]
        if not len(cand):
            return self._decision(layer, counts, before, sync)
        swap = cand[np.lexsort((cand, -counts[cand]))].tolist()  # most tokens first, ties by lower id
        on_dev = act[res_mask[act]].tolist()
        # round 0: free slots, then slots of resident experts this step does not use (lowest score first)
        free = self.budget - len(res) - len(fl)
        score = self.tracker.score(layer)
        idle = sorted((e for e in res if counts[e] == 0), key=lambda e: (score[e], e))
        n0 = min(len(swap), max(0, free) + len(idle))
        ev0 = idle[:max(0, n0 - max(0, free))]
        rounds = [Round(load=swap[:n0], evict=ev0, compute=on_dev + swap[:n0])]
        res.difference_update(ev0)
        res.update(swap[:n0])
        # later rounds: slots of experts computed in an earlier round, fewest tokens first
        done = sorted(rounds[0].compute, key=lambda e: (counts[e], e))
        rest = swap[n0:]
        while rest and done:
            n = min(len(rest), len(done))
            load, evict = rest[:n], done[:n]
            rounds.append(Round(load=load, evict=evict, compute=list(load)))
            done = done[n:] + sorted(load, key=lambda e: (counts[e], e))
            rest = rest[n:]
        for r in rounds[1:]:
            res.difference_update(r.evict)
            res.update(r.load)
        n_new = sum(len(r.load) for r in rounds)
        self.stats["swaps"] += n_new
        self.stats["blocking_swaps"] += n_new
        if sync is not None:  # the refresh's copies (counted by _sync_refresh) come first
            rounds[0] = Round(load=sync.load + rounds[0].load, evict=sync.evict + rounds[0].evict,
                              compute=rounds[0].compute)
        loads = [e for r in rounds for e in r.load]
        evicts = [e for r in rounds for e in r.evict]
        on = self._mask({e for r in rounds for e in r.compute})[act]
        dev, host = act[on], act[~on]
        hit = act[self._mask(before)[act]]
        return LayerDecision(layer=layer, device=dev.tolist(), host=host.tolist(),
                             transfer=Transfer(layer=layer, load=loads, evict=evicts, blocking=True),
                             hit_tokens=int(counts[hit].sum()), hit_experts=len(hit),
                             device_tokens=int(counts[dev].sum()), host_tokens=int(counts[host].sum()),
                             rounds=rounds)

    def end_step(self, step_seconds=None):
        """The step's seconds feed the step-time estimate (an EMA) the optimiser hides copies behind; a block's
        first step is left out: it refreshes synchronously and, with the prefix cache, computes more tokens than the
        steps an interval covers."""
        if step_seconds is not None and step_seconds > 0 and (self.step > 0 or self._step_s is None):
            self._step_s = step_seconds if self._step_s is None else 0.7 * self._step_s + 0.3 * float(step_seconds)


PLANNERS = ("reactive", "tide-fixed", "tide")


def make_refresh_planner(name: str, num_layers: int, num_experts: int, budget: int, *, costs: TideCosts | None = None,
                         interval: int = 1, tau_max: int = 16, **kw) -> RefreshPlanner:
    """Build a planner by name: ``reactive``, ``tide-fixed`` (or ``tide-fixed-T<n>``; ``interval``) or ``tide``
    (needs ``costs``; ``tau_max``, ``block_start``, ``estimator_kw`` in ``kw``).

    Raises:
        MoeOffloadError: unknown name, ``tide`` without costs, or bad arguments.
    """
    key = name.lower()
    if key == "reactive":
        return ReactivePlanner(num_layers, num_experts, budget)
    if key.startswith("tide-fixed"):
        rest = key[len("tide-fixed"):]
        if rest:
            if not rest.startswith("-t") or not rest[2:].isdigit():
                raise MoeOffloadError(f"unknown planner {name!r}; tide-fixed takes an interval as tide-fixed-T<n>")
            interval = int(rest[2:])
        return TideFixedPlanner(num_layers, num_experts, budget, interval=interval, **kw)
    if key == "tide":
        if costs is None:
            raise MoeOffloadError("the tide planner needs a cost model (core.costs.TideCosts)")
        return TidePlanner(num_layers, num_experts, budget, costs, tau_max=tau_max, **kw)
    raise MoeOffloadError(f"unknown planner {name!r}; choose one of: {', '.join(PLANNERS)}")
