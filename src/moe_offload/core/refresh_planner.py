"""The interface every TIDE refresh planner implements (``RefreshPlanner``; call order and semantics in
``core.refresh``'s docstring), with the residency bookkeeping and the authors' synchronous refresh they share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..errors import MoeOffloadError
from .activation_tracker import ActivationTracker
from .refresh_plan import LayerDecision, RefreshPlan, Transfer, select_top


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
