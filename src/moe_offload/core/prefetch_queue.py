"""The prefetch task queue that every scheduler shares (SeqMoE §6.2, Algorithm 1's bookkeeping): ``PrefetchScheduler``
(submit, drop, advance, the transfer budget ``B_cur`` and its EMA, ``select``), and ``submit_forecast``, the one place
the runtime's prefetcher and the simulator queue a forecast's tasks. Which queued task ``select`` returns is each
scheduler's own (``core.jsd``, ``core.prefetch``); conventions (positions, deadlines, units) in ``core.prefetch``'s
docstring.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import numpy as np

from ..errors import MoeOffloadError
from .prefetch_tasks import (PrefetchTask, candidate_tasks, chance_of_use, check_task_args, forecast_candidates,
                             generate_tasks, not_resident, position, prefetch_width)

Capacity = Callable[[int], float]

class PrefetchScheduler(ABC):
    """Prefetch task queue plus the transfer-budget bookkeeping of Algorithm 1; subclasses choose the task.

    Args:
        b_avg: average transfer budget per layer, in experts per layer time (profiled during warm-up, SeqMoE §6.2).
        alpha: EMA weight in ``(0, 1]`` of a new bandwidth sample (the paper gives no value).
        auto_ema: when True, every position update feeds the EMA with the number of tasks selected per layer
            since the previous update, provided the prefetcher never found the queue empty in between (an idle
            prefetcher's count says nothing about bandwidth). Turn off to feed ``observe_bandwidth`` with measured
            values instead.
    Raises:
        MoeOffloadError: negative or non-finite ``b_avg``, or ``alpha`` outside ``(0, 1]``.

    Queue semantics: a task is identified by ``(eid, ddl)``; resubmitting it replaces its confidence (a newer
    forecast). Tasks of the same expert with different deadlines are distinct.
    """

    name = "base"

    def __init__(self, b_avg: float = 1.0, alpha: float = 0.2, auto_ema: bool = True):
        self._check_bandwidth(b_avg)
        if not 0.0 < alpha <= 1.0:
            raise MoeOffloadError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.auto_ema = auto_ema
        self._b_avg = float(b_avg)
        self._b_cur = float(b_avg)
        # (eid, ddl) -> entry (conf, -ddl, -rank, seq, task): seq numbers submissions (a resubmission gets a new
        # one), rank numbers first insertions (a resubmitted task keeps its rank, as a dict keeps its key's place).
        # The entry's first three fields are the task's strict order of preference (higher = better) in JSD's
        # feasibility greedy (``core.jsd``).
        self._queue: dict[tuple[int, int], tuple] = {}
        self._by_ddl: dict[int, dict[tuple[int, int], tuple]] = {}   # the same entries grouped by deadline
        self._seq = 0
        self._rank = 0
        self._version = 0   # bumped by every change of the queue
        self._pos: int | None = None
        self._issued = 0
        self._idle = False
        #: ``core.prefetch_cost.PrefetchCost`` that ``submit_forecast`` admits tasks by (None: every task)
        self.gate = None
        #: tasks ``submit_forecast`` left out because the gate found them not worth their cost
        self.gated = 0
        #: ``core.prefetch_cost.UseLedger`` the forecasts' candidates are recorded in for a cost meter to calibrate
        #: the gate (None: not recorded; set by the runtime's prefetcher and the simulator for a ``+gate`` policy)
        self.ledger = None
        #: the native ``forecast_candidates`` (``runtime.kernels.forecast_candidates_kernel``; set by the runtime's
        #: prefetcher and the simulator when the kernels are built) ``submit_forecast`` finds candidates with: the
        #: same ones as numpy's, in one call (None: numpy)
        self.candidates_kernel = None

    @staticmethod
    def _check_bandwidth(b: float) -> None:
        if not (math.isfinite(b) and b >= 0):
            raise MoeOffloadError(f"transfer budget must be a finite number >= 0 experts per layer, got {b}")

    @property
    def b_avg(self) -> float:
        """Average transfer budget per layer (experts per layer time)."""
        return self._b_avg

    @property
    def b_cur(self) -> float:
        """Remaining transfer budget of the current layer (experts; negative once over-committed)."""
        return self._b_cur

    @property
    def pos(self) -> int | None:
        """The last position seen by ``select``/``advance`` (None before the first)."""
        return self._pos

    def __len__(self) -> int:
        return len(self._queue)

    def pending(self) -> list[PrefetchTask]:
        """The queued tasks by ascending deadline, then decreasing confidence, then submission order."""
        return [e[4] for e in sorted(self._queue.values(), key=lambda e: (-e[1], -e[0], e[3]))]

    def set_bandwidth(self, b_avg: float) -> None:
        """Set ``B_avg`` (experts per layer time), e.g. from a warm-up profile; also resets ``B_cur`` to it.

        Raises:
            MoeOffloadError: negative or non-finite value.
        """
        self._check_bandwidth(b_avg)
        self._b_avg = float(b_avg)
        self._b_cur = float(b_avg)

    def observe_bandwidth(self, experts_per_layer: float) -> float:
        """EMA update with one bandwidth sample: ``B_avg <- (1 - alpha) * B_avg + alpha * sample``; returns B_avg.

        Raises:
            MoeOffloadError: negative or non-finite sample.
        """
        self._check_bandwidth(experts_per_layer)
        self._b_avg = (1.0 - self.alpha) * self._b_avg + self.alpha * float(experts_per_layer)
        return self._b_avg

    def submit(self, tasks: Iterable[PrefetchTask]) -> None:
        """Add tasks to the queue (a task with the same ``(eid, ddl)`` as a queued one replaces it)."""
        for t in tasks:
            key = (t.eid, t.ddl)
            old = self._queue.get(key)
            if old is None:
                rank = self._rank
                self._rank += 1
            else:
                rank = -old[2]
            self._queue[key] = self._by_ddl.setdefault(t.ddl, {})[key] = (t.conf, -t.ddl, -rank, self._seq, t)
            self._seq += 1
            self._version += 1

    def drop(self, eids: Iterable[int]) -> int:
        """Remove every queued task of the given experts (e.g. they became resident); returns how many."""
        gone = set(eids)
        keys = [k for k in self._queue if k[0] in gone]
        for k in keys:
            self._remove(k)
        return len(keys)

    def drop_deadlines(self, ddls: Iterable[int]) -> int:
        """Remove every queued task whose deadline is one of ``ddls``; returns how many."""
        n = 0
        for d in ddls:
            group = self._by_ddl.pop(int(d), None)
            if group:
                for key in group:
                    del self._queue[key]
                n += len(group)
                self._version += 1
        return n

    def _remove(self, key: tuple[int, int]) -> None:
        del self._queue[key]
        group = self._by_ddl[key[1]]
        del group[key]
        if not group:
            del self._by_ddl[key[1]]
        self._version += 1

    def advance(self, pos: int) -> None:
        """Algorithm 1 lines 1-4: on a new position update ``B_avg`` (EMA) and reset ``B_cur <- B_avg``; then
        discard tasks with ``ddl <= pos + 1``.

        The paper writes line 2 as ``B_avg <- B_avg + alpha * B_cur``. Since ``B_cur`` is the budget left after the
        layer's selections, an EMA towards the observed rate (``B_avg - B_cur`` tasks in the layer) is
        ``B_avg <- B_avg - alpha * B_cur``, which is what this does (generalised to jumps of several layers, and
        skipped when the prefetcher went idle; see ``auto_ema``). Expiry runs on every call, not only on updates,
        so tasks submitted after the update are filtered too.
        """
        pos = int(pos)
        if pos != self._pos:
            if self._pos is not None and pos > self._pos and self.auto_ema and not self._idle:
                self.observe_bandwidth(self._issued / (pos - self._pos))
            self._pos = pos
            self._b_cur = self._b_avg
            self._issued = 0
            self._idle = False
        for d in [d for d in self._by_ddl if d <= pos + 1]:
            for key in self._by_ddl.pop(d):
                del self._queue[key]
            self._version += 1

    def capacity(self, ddl: int) -> float:
        """``C(ddl) = max(1, B_cur) + B_avg * (ddl - pos - 1)``: transfers that can complete before ``ddl`` at the
        current position (SeqMoE §6.2).

        Raises:
            MoeOffloadError: called before any position was seen.
        """
        if self._pos is None:
            raise MoeOffloadError("capacity needs a current position: call select or advance first")
        return max(1.0, self._b_cur) + self._b_avg * (ddl - self._pos - 1)

    def select(self, pos: int, b_cur: float | None = None, capacity: Capacity | None = None) -> PrefetchTask | None:
        """The next task to transfer at position ``pos``, removed from the queue, or None when nothing is pending.

        Runs ``advance(pos)``; then, if ``b_cur`` is given, it replaces the current layer's remaining budget (the
        ``B_cur`` input of Algorithm 1); the chosen task costs one unit of ``B_cur`` (line 12).

        Args:
            pos: current position (MoE layers, see the module docstring).
            b_cur: optional remaining budget of the current layer (experts).
            capacity: optional ``capacity(ddl)`` replacing ``C(ddl)`` (used by JSD only; e.g. an exact per-layer
                budget profile).
        Raises:
            MoeOffloadError: ``b_cur`` not finite.
        """
        self.advance(pos)
        if b_cur is not None:
            if not math.isfinite(b_cur):
                raise MoeOffloadError(f"b_cur must be finite, got {b_cur}")
            self._b_cur = float(b_cur)
        task = self._choose(self._pos, capacity) if self._queue else None
        if task is None:
            self._idle = True
            return None
        self._remove((task.eid, task.ddl))
        self._b_cur -= 1.0
        self._issued += 1
        return task

    @abstractmethod
    def _choose(self, pos: int, capacity: Capacity | None) -> PrefetchTask | None:
        """Pick one of the queued tasks (none expired; ``self._queue``'s entries) at ``pos``; ``capacity`` is the
        caller's replacement of ``C(ddl)`` or None."""

    def reset(self) -> None:
        """Empty the queue and forget the position (``B_avg`` is kept: it describes the hardware)."""
        self._queue.clear()
        self._by_ddl.clear()
        self._version += 1
        self._pos = None
        self._b_cur = self._b_avg
        self._issued = 0
        self._idle = False
        if self.ledger is not None:
            self.ledger.clear()


def submit_forecast(scheduler: PrefetchScheduler, forecast, num_moe_layers: int, num_experts: int, top_k: int,
                    table=None) -> None:
    """Queue a forecast's tasks (``tasks_from_forecast``) — the one place the runtime's prefetcher and the simulator
    turn a forecast into queued tasks; with ``scheduler.gate`` (a ``core.prefetch_cost.PrefetchCost``) only those
    worth their cost (counted in ``scheduler.gated`` otherwise).

    A cross-layer forecast (``forecast.cross_layer``, ``predictor.cross_layer``: made inside the step it forecasts,
    from this token's hidden state) first drops every queued task of its layers' deadlines in that step: it is newer
    than the SeqMoE forecast or the earlier layer's cross-layer forecast that queued them, and its top-(k+3) replace
    theirs (deadlines ``position(step, p, L)``, so JSD schedules these near tasks and SeqMoE's far ones together).

    Its first layer's tasks are not made: that layer runs at the position right after the one the forecast was made
    at, and every selection from there on discards tasks due by ``pos + 1`` (``PrefetchScheduler.advance``), so they
    could never be chosen.

    While the gate is closed (``PrefetchCost.closed``: no task could pass it) no task is made; the candidates still
    go to ``scheduler.ledger`` (when set), so that the gate keeps learning what the forecasts are worth.

    Raises:
        MoeOffloadError: as ``generate_tasks``.
    """
    gate = scheduler.gate
    lo, hi = forecast.layers
    row = forecast.probs[0]
    if getattr(forecast, "cross_layer", False):
        scheduler.drop_deadlines(position(forecast.step + 1, p, num_moe_layers) for p in range(lo, hi))
        if hi - lo < 2:
            return
        lo, row = lo + 1, row[1:]
    keep = not_resident(table)
    if gate is None and scheduler.ledger is None:
        scheduler.submit(generate_tasks(row, (lo, hi), forecast.step + 1, num_moe_layers, num_experts, top_k,
                                        keep=keep, kernel=scheduler.candidates_kernel))
        return
    scheduler.submit(_gated_tasks(scheduler, gate, row, (lo, hi), forecast.step + 1, num_moe_layers, num_experts,
                                  top_k, keep))


def _gated_tasks(scheduler: PrefetchScheduler, gate, probs, layers: tuple[int, int], step_index: int,
                 num_moe_layers: int, num_experts: int, top_k: int, keep) -> list[PrefetchTask]:
    """``generate_tasks``' tasks (the same candidates, order and checks) of those ``gate.worth`` their cost by
    their chance of use (``chance_of_use``), the chance and the gate's test computed for all candidates at once
    (``gate`` None: every one; closed: none); the candidates ``keep`` admits and the gate refuses are counted in
    ``scheduler.gated``. Every candidate ``keep`` admits goes to ``scheduler.ledger`` (when set) with its chance,
    one entry per layer (``UseLedger.expect``)."""
    lo, hi = check_task_args(layers, step_index, num_moe_layers, num_experts, top_k)
    top, conf, chance, worth = forecast_candidates(probs, hi - lo, num_experts, prefetch_width(num_experts, top_k),
                                                   top_k, gate, chances=True, kernel=scheduler.candidates_kernel)
    ledger = scheduler.ledger
    kept: list[tuple[int, int]] | None = [] if ledger is not None else None
    tasks, refused = candidate_tasks(top, conf, lo, step_index, num_moe_layers, num_experts, keep, worth, kept)
    scheduler.gated += refused
    if ledger is not None:
        rows: list[tuple[list[int], list[float]]] = [([], []) for _ in range(hi - lo)]
        for r, j in kept:
            rows[r][0].append((lo + r) * num_experts + top[r][j])
            rows[r][1].append(chance[r][j])
        for r, (eids, chances) in enumerate(rows):
            ledger.expect(position(step_index, lo + r, num_moe_layers), eids, chances)
    return tasks


def inclusion_probabilities(forecast, top_k: int) -> np.ndarray:
    """``[n, E]``: each forecast expert's chance of being among the ``top_k`` its layer uses, what a prefetch's
    saving is weighed by: ``chance_of_use`` of ``forecast.probs[0]``."""
    return chance_of_use(np.asarray(forecast.probs[0], dtype=np.float64), top_k)
