"""``TidePlanner``: TIDE with the I/O-aware interval optimiser, asynchronous prefetch of the next working set and
per-miss choice between host fallback and an on-demand swap (``core.refresh`` docstring, planner ``tide``).
"""

from __future__ import annotations

import numpy as np

from ..errors import MoeOffloadError
from .costs import TideCosts
from .interval import IntervalChoice, IntervalOptimiser
from .refresh_plan import LayerDecision, RefreshPlan, Round, Transfer
from .refresh_planner import RefreshPlanner
from .stability import StabilityEstimator


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
