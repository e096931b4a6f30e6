"""Probabilistic Belady eviction (SeqMoE §7.1): evict the resident expert least likely to be needed soon.

After the one-step prediction at step ``i - 1``, layer ``l'``, the predictor's recursive rollout estimates expert
activation probabilities for the following steps. Each expert ``E_{p,q}`` of the forecast layers ``l <= p < l'``
gets the retention priority

    CacheScore_{p,q} = sum_{j=0}^{c-1} lambda^j * Mean(A'[:, i+j, p, q]) / sum_{j=0}^{c-1} lambda^j,  0 < lambda < 1

(the mean is over the batch of requests), a discounted average that favours experts likely to be activated in
the nearer future, approximating Belady's preference for the earliest reuse. The victim is the resident,
unpinned expert with the lowest score.

With ``layer_cycle`` (the cross-layer policies ``xl`` and ``seqmoe-xl``, whose forecasts cover a few layers of
one token) the policy also follows the cycle of the layers (issue 47):
  * a forecast's rows are consumed as the model runs: once MoE layer ``p`` has run in step ``i + j``, row ``j`` of
    its forecast is the past and the score is the same weighted mean over the rows still ahead; a layer whose rows
    are all consumed scores as one without a forecast. Without this, the experts a one-row forecast left out of
    its top-k were evicted before the ones it named, whatever the layer then used.
  * experts without a forecast (most of them: a cross-layer forecast covers 3 of the layers) are ordered by how
    likely their layer's next run is to use them, as its past runs tell, then as Belady would order them under the
    cyclic layer sequence: first the least *reuse frequency* at their layer's last run, ``sum_i 2^-((r - s_i) / H)``
    over the steps ``s_i`` of the request the expert was used in, ``r`` the step its layer last ran in and ``H`` the
    half-life ``CYCLE_HALF_LIFE_STEPS`` (LFRU's combined recency-frequency, Lee et al. 2001, counted in runs of the
    expert's own layer); then, among equals, those whose layer runs again farthest from now (the layer just run
    before the one about to run); then the least recently used. Before session 52 the first key was the recency
    alone (runs of the layer since the expert's last use): on the wide testbed's three-prompt trace, replayed at 25%
    / 45% residency, the frequency cut `xl+gate`'s decode misses by 11% / 13% (docs/benchmarks.md, session 52).
"""

from __future__ import annotations

import numpy as np

from ..errors import MoeOffloadError
from .eviction import EvictionPolicy, crf_after_use
from .prob_belady_ranking import ranked_victim


#: the half-life, in decode steps (runs of the expert's layer), of the reuse frequency that orders the experts
#: without a forecast under ``layer_cycle`` (module docstring): replayed on the wide testbed's three-prompt trace, 2 to
#: 8 steps cut `xl`'s decode misses by 8-17% at 25% and 45% residency (4: 12% / 14%), 1 step by 4-6%
#: (docs/results/forecast-ceiling-half-life-s52.txt)
CYCLE_HALF_LIFE_STEPS = 4.0

#: experts accessed or inserted since the victim ranking was made beyond which ``victim`` ranks again (each call
#: compares those experts one by one)
_FRESH_MAX = 16


class ProbabilisticBelady(EvictionPolicy):
    """Forecast-driven eviction policy (SeqMoE §7.1; defaults ``c = 8``, ``lambda = 0.5`` from §9.1).

    Feed it forecasts with ``update_forecast(layers, probs)`` or ``observe(forecast)`` (a
    ``predictor.runtime.Forecast``) whenever a predictor produces one; a forecast replaces the scores of its
    layers until the next forecast of those layers.

    Rows: row ``j`` of a forecast is step ``i + j`` (row 0: the one-step prediction for step ``i``, rows 1..: the
    recursive rollout, the layout of ``Forecast.probs``). The score uses rows ``0 .. c-1`` exactly as the paper's
    sum ``j = 0 .. c-1``; a forecast with fewer rows uses all of them, normalised by the matching
    ``sum lambda^j`` (so the score is always a weighted mean of probabilities). With the runner's ``rollout = c``
    (``1 + c`` rows) the last row is therefore unused; pass ``horizon = c + 1`` to include it.

    Experts without a forecast (layers no predictor covers, or before the first forecast of a request) score
    ``no_forecast_score`` (default 0: nothing suggests they will be reused). Ties, including all experts without
    a forecast, are broken by least recent access or insertion (LRU), then by the smaller expert id; so with no
    forecast at all the policy is plain LRU. A new request (``on_step(request, 0)``) forgets all forecasts.
    With ``layer_cycle``, rows are consumed as their layers run and experts without a forecast are ordered by their
    reuse frequency, then the layer cycle (module docstring); ``observe`` then passes the step of a forecast's row 0
    (``Forecast.step + 1``).

    Args:
        num_experts: e, routed experts per MoE layer (expert ids are ``layer * e + expert``).
        horizon: c, forecast rows used (>= 1).
        lam: lambda, the discount, ``0 < lam < 1``.
        no_forecast_score: the score of an expert whose layer has no forecast.
        layer_cycle: consume forecast rows as their layers run, and order experts without a forecast by their
            reuse frequency and the layer cycle (module docstring) instead of LRU.
        half_life: ``H``, the reuse frequency's half-life in decode steps (> 0; ``layer_cycle`` only).
        victim_kernel: the same ranking in one native pass (``runtime.kernels``' ``belady_victim``, given by the
            runtime and the simulator when the kernels are built): ``victim`` then asks it, with the same result,
            instead of ranking in numpy; None: numpy.
        scores_kernel: ``update_forecast``'s one-row layer-cycle case in one native call (``runtime.kernels``'
            ``belady_scores``, given like ``victim_kernel``): the same scores; None: numpy.
    Raises:
        MoeOffloadError: ``num_experts < 1``, ``horizon < 1``, ``lam`` outside ``(0, 1)`` or ``half_life <= 0``.

    Cost: ``update_forecast`` O(c * n * e) (vectorised; a one-row layer-cycle forecast one native call with
    ``scores_kernel``). ``victim`` in numpy (``core.prob_belady_ranking``): the resident experts are ranked by
    (score, last use, id) once (one vectorised sort) and the ranking serves every later ``victim`` until a score
    changes (``update_forecast``, a new request) or more than ``_FRESH_MAX`` experts were accessed or inserted
    since; each call walks the ranking from the front past pinned, evicted and such "fresh" experts and compares
    it with the fresh ones (whose last use is newer than the ranking's) one by one. A layer's victims (one per
    miss and per prefetch) then cost a sort per few layers, not one vectorised pass each (issue 17). With
    ``victim_kernel`` (the runtime's and the simulator's when the native kernels are built) a victim is one native
    pass over the arrays instead, the same expert: the layer-cycle keys change as each layer runs, so the numpy
    ranking was made again at nearly every layer (issue 47: 32 us per victim in the decode step, 2.5 ms per step).
    ``on_layer_access`` takes a layer's accesses in one call (the table's way).
    """

    name = "prob-belady"

    def __init__(self, num_experts: int, horizon: int = 8, lam: float = 0.5, no_forecast_score: float = 0.0,
                 layer_cycle: bool = False, victim_kernel=None, half_life: float = CYCLE_HALF_LIFE_STEPS,
                 scores_kernel=None):
        super().__init__()
        self.victim_kernel = victim_kernel
        self.scores_kernel = scores_kernel
        if num_experts < 1:
            raise MoeOffloadError(f"num_experts must be >= 1, got {num_experts}")
        if horizon < 1:
            raise MoeOffloadError(f"horizon c must be >= 1, got {horizon}")
        if not 0.0 < lam < 1.0:
            raise MoeOffloadError(f"lambda must be in (0, 1), got {lam}")
        if not half_life > 0:
            raise MoeOffloadError(f"half_life must be > 0 decode steps, got {half_life}")
        self.half_life = float(half_life)
        self.num_experts = num_experts
        self.horizon = horizon
        self.lam = float(lam)
        self.no_forecast_score = float(no_forecast_score)
        self.layer_cycle = bool(layer_cycle)
        # per global expert id (grown on demand): CacheScore, recency sequence number, residency. Arrays, so that
        # ``victim`` is a handful of vectorised passes instead of a Python loop over every resident expert.
        self._score = np.empty(0, dtype=np.float64)
        self._last = np.empty(0, dtype=np.int64)
        self._in = np.empty(0, dtype=bool)
        self._seq = 0
        self._ranking: list[int] | None = None  # resident experts by (score, last use, id) when ranked; None: stale
        self._fresh: set[int] = set()           # experts accessed or inserted since the ranking was made
        self._weights: dict[int, np.ndarray] = {}  # rows -> ``weights(rows)``
        self._step = 0                             # the current step (``on_step``)
        self._rows: dict[int, tuple[np.ndarray, int]] = {}  # layer -> (its forecast rows [R, e], row 0's step)
        # layer_cycle: per MoE layer the last step it ran in; per expert its reuse frequency in LFRU's log form,
        # ``log2(sum_i 2^-((s - s_i) / H)) + s / H`` at its last use s (-inf: not used in this request), so that
        # ``_crf - r / H`` is its log2 frequency at step r; the layer running now
        self._ran = np.full(0, -1, dtype=np.int64)
        self._crf = np.full(0, -np.inf, dtype=np.float64)
        self._cur = 0

    def _grow(self, n: int) -> None:
        """Make the per-expert arrays hold ids ``< n`` (new entries: no forecast, never used, not resident)."""
        old = self._score.size
        if n <= old:
            return
        n = max(n, 2 * old, self.num_experts)
        self._ranking = None
        self._score = np.concatenate([self._score, np.full(n - old, self.no_forecast_score)])
        self._last = np.concatenate([self._last, np.zeros(n - old, dtype=np.int64)])
        self._in = np.concatenate([self._in, np.zeros(n - old, dtype=bool)])
        self._crf = np.concatenate([self._crf, np.full(n - old, -np.inf)])

    def weights(self, rows: int) -> np.ndarray:
        """float64 ``[min(rows, c)]``: ``lambda^j / sum_j lambda^j``, the weight of forecast row j (made once per
        row count; do not modify the array)."""
        n = min(rows, self.horizon)
        w = self._weights.get(n)
        if w is None:
            w = self.lam ** np.arange(n, dtype=np.float64)
            w = self._weights[n] = w / w.sum()
        return w

    def update_forecast(self, layers: tuple[int, int], probs, first_step: int | None = None) -> None:
        """Replace the scores of MoE layers ``l <= p < l'`` from a forecast.

        Args:
            layers: ``(l, l')``, ``0 <= l < l'``.
            probs: float array or tensor ``[R, n, e]`` (``Forecast.probs``: row j = step i + j, R >= 1) or
                ``[b, R, n, e]`` for a batch (averaged over b), with ``n = l' - l``.
            first_step: i, the step of row 0: the rows are then consumed as their layers run (class docstring);
                None: rows ``0 .. c-1`` score the layers until their next forecast.
        Raises:
            MoeOffloadError: a shape that does not match ``layers``/``num_experts``, or non-finite values.
        """
        lo, hi = int(layers[0]), int(layers[1])
        if not 0 <= lo < hi:
            raise MoeOffloadError(f"layers must satisfy 0 <= l < l', got {layers}")
        if first_step is not None and self.scores_kernel is not None and type(probs) is np.ndarray \
                and self._cycle_intake(lo, hi, probs, int(first_step)):
            return
        if hasattr(probs, "detach"):  # a torch tensor, without importing torch here
            probs = probs.detach().float().cpu().numpy()
        a = np.asarray(probs, dtype=np.float64)
        if a.ndim == 4:
            a = a.mean(axis=0)
        if a.ndim != 3 or a.shape[0] < 1 or a.shape[1:] != (hi - lo, self.num_experts):
            raise MoeOffloadError(f"probs must be [R, {hi - lo}, {self.num_experts}] (or with a leading batch "
                                  f"dimension), got shape {tuple(np.shape(probs))}")
        if not np.isfinite(a).all():
            raise MoeOffloadError("probs contains non-finite values")
        E = self.num_experts
        self._grow(hi * E)
        self._ranking = None
        if first_step is None:
            for p in range(lo, hi):
                self._rows.pop(p, None)
            w = self.weights(a.shape[0])
            self._score[lo * E:hi * E] = w @ a[:len(w)].reshape(len(w), -1)    # [n * e]: sum_j w_j * row j
            return
        self._grow_layers(hi)
        first = int(first_step)
        for p in range(lo, hi):
            self._rows[p] = (a[:, p - lo], first)
        if a.shape[0] == 1 and (self._ran[lo:hi] < first).all():
            # one row (a cross-layer forecast alone, ``xl``), none of its layers run in its step yet: the row is the
            # score (its weight is 1), as ``_score_layer`` would set it layer by layer
            self._score[lo * E:hi * E] = a[0].reshape(-1)
            return
        for p in range(lo, hi):
            self._score_layer(p)

    def _cycle_intake(self, lo: int, hi: int, probs: np.ndarray, first: int) -> bool:
        """``update_forecast``'s one-row case in one native call (``scores_kernel``: the row written as the scores of
        layers ``lo .. hi - 1`` when none of them ran in step ``first`` yet, the case ``_score_layer`` would score
        from the row alone); True when done. False leaves everything to numpy's path (several rows, a layer that
        ran, another dtype or shape, a value not finite, or arrays still too short for the forecast's layers: numpy's
        path grows them, once, and raises its errors before changing anything). The rows kept for ``_score_layer``
        are views of ``probs`` (float32 or float64: ``w @ rows`` casts them to float64 first, so it computes what it
        computes from float64 rows; the forecast's sources make a new array for each forecast)."""
        E = self.num_experts
        if self._score.size < hi * E or self._ran.size < hi:
            return False
        if self.scores_kernel(self._score, self._ran, probs, lo, hi, E, first) != 1:
            return False
        self._ranking = None
        rows = self._rows
        for p in range(lo, hi):
            rows[p] = (probs[:, p - lo], first)
        return True

    def _grow_layers(self, n: int) -> None:
        """Make ``_ran`` hold MoE layers ``< n`` (new layers: not run yet)."""
        if self._ran.size < n:
            self._ran = np.concatenate([self._ran, np.full(n - self._ran.size, -1, dtype=np.int64)])

    def _score_layer(self, p: int) -> None:
        """Score MoE layer ``p`` from the rows of its forecast still ahead (those of steps after the last one ``p``
        ran in): their weighted mean, or ``no_forecast_score`` when none is left (the forecast is then dropped)."""
        rows, first = self._rows[p]
        done = max(0, int(self._ran[p]) - first + 1)
        E = self.num_experts
        if done >= rows.shape[0]:
            del self._rows[p]
            self._score[p * E:(p + 1) * E] = self.no_forecast_score
        else:
            ahead = rows[done:]
            w = self.weights(ahead.shape[0])
            self._score[p * E:(p + 1) * E] = w @ ahead[:len(w)]
        self._ranking = None

    def observe(self, forecast) -> None:
        """``update_forecast(forecast.layers, forecast.probs)`` for a ``predictor.runtime.Forecast``; with
        ``layer_cycle`` its row 0 is step ``forecast.step + 1`` and its rows are consumed as their layers run."""
        first = forecast.step + 1 if self.layer_cycle else None
        self.update_forecast(forecast.layers, forecast.probs, first_step=first)

    def score(self, eid: int) -> float:
        """CacheScore of expert ``eid`` (``no_forecast_score`` when its layer has no forecast)."""
        return float(self._score[eid]) if eid < self._score.size else self.no_forecast_score

    def on_step(self, request: int, step: int) -> None:
        self._step = step
        if step == 0:
            self._score.fill(self.no_forecast_score)
            self._rows.clear()
            self._ran.fill(-1)
            self._crf.fill(-np.inf)
            self._ranking = None

    def on_access(self, eid: int, tick: int, tokens: int = 1) -> None:
        if self.layer_cycle:
            self._cycle_access(eid)
        if eid in self.resident:
            self._seq += 1
            self._last[eid] = self._seq
            self._touch(eid)

    def on_layer_access(self, pairs: list[tuple[int, int]], tick: int) -> None:
        """A layer's accesses at once (``EvictionPolicy.on_layer_access``): when they are of one MoE layer, its
        layer-cycle bookkeeping once, each expert's reuse frequency and the recency stamps in loops, the state
        ``on_access`` in turn leaves; else ``on_access`` in turn."""
        if not pairs:
            return
        E = self.num_experts
        first, last = pairs[0][0], pairs[-1][0]
        if first // E != last // E:
            super().on_layer_access(pairs, tick)
            return
        # scalar writes: for a layer's few experts they cost less than numpy's indexed ones
        if self.layer_cycle:
            self._cycle_access(last)  # the layer's bookkeeping (once: the same for each of its experts)
            crf, now = self._crf, self._step / self.half_life
            for e, _ in pairs[:-1]:
                crf[e] = crf_after_use(crf[e], now)
        resident, stamp, seq, ranked = self.resident, self._last, self._seq, self._ranking is not None
        for e, _ in pairs:
            if e in resident:
                seq += 1
                stamp[e] = seq
                if ranked:
                    self._touch(e)
        self._seq = seq

    def _cycle_access(self, eid: int) -> None:
        """``layer_cycle``: ``eid`` is used now (its reuse frequency counts the use); its layer's first access in
        this step means the layer runs, so the row of this step of its forecast is consumed; a new running layer
        changes the order of the cycle."""
        p, step = eid // self.num_experts, self._step
        if p >= self._ran.size:
            self._grow_layers(p + 1)
        first_run = self._ran[p] != step
        if first_run or p != self._cur:  # the frequencies at their layers' last runs or the distances change
            self._ranking = None
            self._cur = p
            if first_run:
                self._ran[p] = step
                if p in self._rows:
                    self._score_layer(p)
        if eid >= self._crf.size:
            self._grow(eid + 1)
        self._crf[eid] = crf_after_use(self._crf[eid], step / self.half_life)

    def on_insert(self, eid: int, tick: int) -> None:
        super().on_insert(eid, tick)
        self._grow(eid + 1)
        if self.layer_cycle:
            self._grow_layers(eid // self.num_experts + 1)
        self._seq += 1
        self._last[eid] = self._seq
        self._in[eid] = True
        self._touch(eid)

    def _touch(self, eid: int) -> None:
        """``eid``'s last use changed: its ranked position (if any) is stale, so ``victim`` compares it apart until
        the next ranking, which is due once more than ``_FRESH_MAX`` experts are such."""
        if self._ranking is None:
            return
        self._fresh.add(eid)
        if len(self._fresh) > _FRESH_MAX:
            self._ranking = None

    def on_evict(self, eid: int) -> None:
        super().on_evict(eid)
        if eid < self._in.size:
            self._in[eid] = False
            self._last[eid] = 0

    def victim(self, pinned: set[int]) -> int:
        """The resident expert not in ``pinned`` that ranks first: the lowest (score, last use, id), with
        ``layer_cycle`` the order of ``core.prob_belady_ranking.rank_keys``: the native pass (``victim_kernel``) or
        numpy's ranking (``ranked_victim``), the same expert.

        Raises:
            RuntimeError: every resident expert is pinned (the slot table never asks then).
        """
        if self.victim_kernel is not None:
            best = self.victim_kernel(self._score, self._last, self._in, self._ran, self._crf, pinned, self._cur,
                                      self.num_experts, self.layer_cycle, self.half_life)
            if best < 0:
                raise RuntimeError("no evictable expert")
            return best
        return ranked_victim(self, pinned)

    def reset(self) -> None:
        super().reset()
        self._score.fill(self.no_forecast_score)
        self._last.fill(0)
        self._in.fill(False)
        self._seq = 0
        self._ranking = None
        self._fresh = set()
        self._step = 0
        self._rows.clear()
        self._ran.fill(-1)
        self._crf.fill(-np.inf)
        self._cur = 0


def forecast_eviction(spec, num_experts: int, victim_kernel=None, scores_kernel=None) -> ProbabilisticBelady:
    """The eviction policy of a forecast-driven ``spec`` (a ``core.policy_spec.PolicySpec``), for the runtime and
    the simulator alike: probabilistic Belady with SeqMoE's c = 8 and lambda = 0.5 (§9.1), following the layer
    cycle for the cross-layer policies (``spec.cross_layer``: ``xl``, ``seqmoe-xl``) with the reuse frequency's
    half-life ``CYCLE_HALF_LIFE_STEPS`` as it is when called (a probe may set it: ``scripts/forecast_ceiling.py
    --half-life``), named as the spec; ``victim_kernel`` and ``scores_kernel`` as ``ProbabilisticBelady``'s."""
    pol = ProbabilisticBelady(num_experts, horizon=8, lam=0.5, layer_cycle=spec.cross_layer,
                              victim_kernel=victim_kernel, half_life=CYCLE_HALF_LIFE_STEPS,
                              scores_kernel=scores_kernel)
    pol.name = spec.name
    return pol

