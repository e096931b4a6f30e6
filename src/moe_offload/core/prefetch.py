"""Prefetch task generation and joint prefetch scheduling (SeqMoE §6, Algorithm 1), plus two baseline orderings.

Pure decision logic: tasks name experts by global id (``eid = moe_layer * num_experts + expert``), never tensors,
so the runtime prefetcher and the trace simulator drive the very same objects.

Units and conventions:
  * Positions are global MoE-layer positions. Decode step ``i >= 1`` (the repo's step numbering: 0 = prefill)
    executes MoE layer ``p`` (0-based among the model's ``L`` MoE layers) at position ``(i - 1) * L + p``
    (``position(i, p, L)``); decode step 1 layer 0 is position 0, the prefill (step 0) occupies ``-L .. -1``.
  * A task's deadline ``ddl`` is the position at which its expert is needed for computation (SeqMoE §6.1:
    ``ddl = (i - 1) * L + p``).
  * Bandwidth / transfer budgets are in experts per layer time (how many expert transfers complete while one
    MoE layer executes); ``B_avg`` may be fractional.

The schedulers share one task queue (``PrefetchScheduler``): ``submit`` tasks, ``drop`` experts that became
resident, and call ``select(pos)`` each time the prefetcher is free; it returns the next task to transfer (removed
from the queue) or None. Tasks with ``ddl <= pos + 1`` are discarded (Algorithm 1 line 4: expired, or too late to
finish before the layer that needs them). They differ only in which pending task ``select`` returns:
  * ``JSDScheduler`` (``core.jsd``) — SeqMoE's joint prefetch scheduling: maximum-confidence feasible set under the deadline
    capacities (matroid greedy with a min-heap), then earliest deadline first (Algorithm 1);
  * ``MoEInfinityScheduler`` — highest ``conf * (1 - (ddl - pos) / (L + 1))`` (SeqMoE §3.2);
  * ``ProMoEScheduler`` — lexicographic ``(-ddl, conf)``, highest first: earliest deadline, then most confident
    (SeqMoE §3.2).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ..errors import MoeOffloadError

Capacity = Callable[[int], float]

#: a prefetch copy moves in this many chunks, and yields the link to on-demand copies at a chunk boundary (SeqMoE
#: §8.3's pause, at the granularity a real copy engine can stop: between the chunks it issues), so a miss waits at
#: most 1/LINK_CHUNKS of one expert copy behind a prefetch; the simulator and the emulated link share it
LINK_CHUNKS = 8


@dataclass(frozen=True)
class PrefetchTask:
    """One candidate expert transfer (SeqMoE §6.1).

    Attributes:
        eid: global expert id ``layer * num_experts + expert``.
        conf: prediction confidence, the expected contribution to expert hits (batch-mean activation probability).
        ddl: deadline, the global position (in MoE layers, see the module docstring) at which the expert is needed.
        layer: MoE layer index ``p`` of the expert (0-based among MoE layers).
        expert: expert index ``q`` within its layer.
        step: the generation step ``i`` (>= 1) whose execution of ``layer`` needs the expert.
    """

    eid: int
    conf: float
    ddl: int
    layer: int = -1
    expert: int = -1
    step: int = 0


def position(step: int, layer: int, num_moe_layers: int) -> int:
    """Global position of MoE ``layer`` in generation ``step``: ``(step - 1) * L + layer`` (SeqMoE §6.1).

    Step 0 (prefill) maps to negative positions ``-L .. -1``; decode step 1, layer 0 is position 0.
    """
    return (step - 1) * num_moe_layers + layer


def prefetch_width(num_experts: int, top_k: int, extra: int = 3) -> int:
    """k', the number of tasks per layer: ``k + extra`` clamped to ``k <= k' < e`` (SeqMoE §6.1; §9.1 uses
    ``extra = 3``). When ``k == e`` (every expert active) k' = e."""
    return max(top_k, min(top_k + extra, num_experts - 1))


def _as_array(probs) -> np.ndarray:
    if hasattr(probs, "detach"):  # a torch tensor, without importing torch here
        probs = probs.detach().float().cpu().numpy()
    return np.asarray(probs, dtype=np.float64)


def generate_tasks(probs, layers: tuple[int, int], step_index: int, num_moe_layers: int, num_experts: int,
                   top_k: int, extra: int = 3) -> list[PrefetchTask]:
    """Prefetch tasks from one one-step prediction (SeqMoE §6.1).

    The prediction made at step ``i - 1``, layer ``l'`` gives, for each layer ``l <= p < l'``, the probability of
    every expert being activated at step ``i``. For each layer the ``k'`` experts with the highest confidence
    become tasks (``k' = prefetch_width(e, k, extra)``, i.e. ``k + extra`` with ``k <= k' < e``), with

        conf = Mean(A'_{i,l:l'}[:, 0, p, q])   (the mean over the batch of b requests; b = 1: the probability)
        ddl  = (i - 1) * L + p                  (the position at which layer p of step i runs)

    so a task created at position ``(i - 2) * L + l' - 1`` has an overlap window of ``L - (l' - 1 - p)`` layers.

    Args:
        probs: float array or tensor, ``[n, e]`` for one request (``Forecast.probs[0]``), or ``[b, 1, n, e]`` for a
            batch of b requests (the paper's ``A'_{i,l:l'}``; confidence is the mean over b). ``n = l' - l``.
        layers: ``(l, l')``, the MoE layers predicted, ``0 <= l < l' <= L``.
        step_index: ``i >= 1``, the generation step the prediction is for (``Forecast.step + 1``).
        num_moe_layers: L, MoE layers in the model.
        num_experts: e, routed experts per MoE layer.
        top_k: k, experts activated per token.
        extra: k' - k (default 3, SeqMoE §9.1).
    Returns:
        Tasks ordered by layer, then by decreasing confidence (ties: smaller expert index).
    Raises:
        MoeOffloadError: a shape that does not match ``layers``/``num_experts`` (a 3-D ``[1 + c, n, e]`` forecast
            must be indexed by row first), non-finite probabilities, or out-of-range arguments.
    """
    lo, hi = (int(x) for x in layers)
    if num_moe_layers < 1 or not 0 <= lo < hi <= num_moe_layers:
        raise MoeOffloadError(f"layers must satisfy 0 <= l < l' <= L={num_moe_layers}, got {layers}")
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise MoeOffloadError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if extra < 0:
        raise MoeOffloadError(f"extra must be >= 0, got {extra}")
    if step_index < 1:
        raise MoeOffloadError(f"step_index is the decode step predicted (>= 1), got {step_index}")
    a = _as_array(probs)
    n = hi - lo
    if a.ndim == 4 and a.shape[1] == 1 and a.shape[0] >= 1:
        a = a[:, 0].mean(axis=0)
    elif a.ndim != 2:
        raise MoeOffloadError(f"probs must be [n, e] or [b, 1, n, e], got shape {tuple(a.shape)} "
                              "(for a Forecast pass probs[0])")
    if a.shape != (n, num_experts):
        raise MoeOffloadError(f"probs must cover {n} layers x {num_experts} experts, got shape {tuple(a.shape)}")
    if not np.isfinite(a).all():
        raise MoeOffloadError("probs contains non-finite values")
    width = prefetch_width(num_experts, top_k, extra)
    top = np.argsort(-a, axis=1, kind="stable")[:, :width]              # [n, k'] expert indices, best first
    conf = np.take_along_axis(a, top, axis=1)
    tasks = []
    for r, (qs, cs) in enumerate(zip(top.tolist(), conf.tolist())):
        p = lo + r
        ddl = position(step_index, p, num_moe_layers)
        base = p * num_experts
        tasks.extend(PrefetchTask(base + q, c, ddl, p, q, step_index) for q, c in zip(qs, cs))
    return tasks


def tasks_from_forecast(forecast, num_moe_layers: int, num_experts: int, top_k: int,
                        extra: int = 3, table=None) -> list[PrefetchTask]:
    """``generate_tasks`` on a ``predictor.runtime.Forecast`` (its row 0, for step ``forecast.step + 1``).

    Args:
        table: optional ``core.slots.SlotTable``: tasks of experts already resident or in flight are left out (no
            transfer is needed; queued, they would only make the scheduler pick tasks the slot table refuses).
    Raises:
        MoeOffloadError: as ``generate_tasks``.
    """
    tasks = generate_tasks(forecast.probs[0], forecast.layers, forecast.step + 1, num_moe_layers, num_experts, top_k,
                           extra)
    if table is not None:
        slot_of, fetching = table.slot_of, table.fetching
        tasks = [t for t in tasks if slot_of[t.eid] < 0 and t.eid not in fetching]
    return tasks


def submit_forecast(scheduler: "PrefetchScheduler", forecast, num_moe_layers: int, num_experts: int, top_k: int,
                    table=None) -> None:
    """Queue a forecast's tasks (``tasks_from_forecast``) — the one place the runtime's prefetcher and the simulator
    turn a forecast into queued tasks.

    A cross-layer forecast (``forecast.cross_layer``, ``predictor.cross_layer``: made inside the step it forecasts,
    from this token's hidden state) first drops every queued task of its layers' deadlines in that step: it is newer
    than the SeqMoE forecast or the earlier layer's cross-layer forecast that queued them, and its top-(k+3) replace
    theirs (deadlines ``position(step, p, L)``, so JSD schedules these near tasks and SeqMoE's far ones together).

    Raises:
        MoeOffloadError: as ``generate_tasks``.
    """
    tasks = tasks_from_forecast(forecast, num_moe_layers, num_experts, top_k, table=table)
    if getattr(forecast, "cross_layer", False):
        lo, hi = forecast.layers
        scheduler.drop_deadlines(position(forecast.step + 1, p, num_moe_layers) for p in range(lo, hi))
    scheduler.submit(tasks)


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


class MoEInfinityScheduler(PrefetchScheduler):
    """MoE-Infinity ordering (as described in SeqMoE §3.2): transfer the task with the highest
    ``conf * (1 - (ddl - pos) / (L + 1))`` (ties: earlier deadline, then earlier submission).

    Args:
        num_moe_layers: L.
        b_avg, alpha, auto_ema: as ``PrefetchScheduler`` (bookkeeping only; the ordering ignores capacities).
    Raises:
        MoeOffloadError: ``num_moe_layers < 1``, or as ``PrefetchScheduler``.
    """

    name = "moe-infinity"

    def __init__(self, num_moe_layers: int, b_avg: float = 1.0, alpha: float = 0.2, auto_ema: bool = True):
        if num_moe_layers < 1:
            raise MoeOffloadError(f"num_moe_layers must be >= 1, got {num_moe_layers}")
        super().__init__(b_avg, alpha, auto_ema)
        self.num_moe_layers = num_moe_layers

    def score(self, task: PrefetchTask, pos: int) -> float:
        """``conf * (1 - (ddl - pos) / (L + 1))``."""
        return task.conf * (1.0 - (task.ddl - pos) / (self.num_moe_layers + 1))

    def _choose(self, pos, capacity):
        return min(self._queue.values(), key=lambda e: (-self.score(e[4], pos), -e[1], e[3]))[4]


class ProMoEScheduler(PrefetchScheduler):
    """ProMoE ordering (as described in SeqMoE §3.2): tasks sorted lexicographically by ``(-ddl, conf)``, highest
    first, i.e. the earliest deadline, and among equal deadlines the most confident (ties: earlier submission).
    See ``PrefetchScheduler`` for the arguments (bookkeeping only; the ordering ignores capacities).
    """

    name = "promoe"

    def _choose(self, pos, capacity):
        return min(self._queue.values(), key=lambda e: (-e[1], -e[0], e[3]))[4]


SCHEDULERS = ("jsd", "moe-infinity", "promoe")


def make_scheduler(name: str, *, num_moe_layers: int, b_avg: float = 1.0, alpha: float = 0.2,
                   auto_ema: bool = True) -> PrefetchScheduler:
    """Build a prefetch scheduler by name: ``jsd`` (SeqMoE), ``moe-infinity`` or ``promoe``.

    Raises:
        MoeOffloadError: unknown name or bad arguments.
    """
    from .jsd import JSDScheduler

    key = name.lower()
    if key == "jsd":
        return JSDScheduler(b_avg, alpha, auto_ema)
    if key == "moe-infinity":
        return MoEInfinityScheduler(num_moe_layers, b_avg, alpha, auto_ema)
    if key == "promoe":
        return ProMoEScheduler(b_avg, alpha, auto_ema)
    raise MoeOffloadError(f"unknown prefetch scheduler {name!r}; choose one of: {', '.join(SCHEDULERS)}")
