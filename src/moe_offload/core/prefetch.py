"""Joint prefetch scheduling (SeqMoE §6.2, Algorithm 1), plus two baseline orderings, built by name
(``make_scheduler``); the tasks themselves (§6.1: ``PrefetchTask``, ``generate_tasks``) live in
``core.prefetch_tasks``, the queue every scheduler shares (``PrefetchScheduler``, ``submit_forecast``) in
``core.prefetch_queue``, SeqMoE's scheduler in ``core.jsd``; all are re-exported here.

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

from ..errors import MoeOffloadError
from .jsd import JSDScheduler
from .prefetch_queue import Capacity, PrefetchScheduler, submit_forecast
from .prefetch_tasks import (LINK_CHUNKS, PrefetchTask, generate_tasks, link_time_after_chunk, position,
                             prefetch_width, tasks_from_forecast)

__all__ = ["LINK_CHUNKS", "Capacity", "JSDScheduler", "MoEInfinityScheduler", "PrefetchScheduler", "PrefetchTask",
           "ProMoEScheduler", "SCHEDULERS", "generate_tasks", "link_time_after_chunk", "make_scheduler", "position",
           "prefetch_width", "submit_forecast", "tasks_from_forecast"]


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
    key = name.lower()
    if key == "jsd":
        return JSDScheduler(b_avg, alpha, auto_ema)
    if key == "moe-infinity":
        return MoEInfinityScheduler(num_moe_layers, b_avg, alpha, auto_ema)
    if key == "promoe":
        return ProMoEScheduler(b_avg, alpha, auto_ema)
    raise MoeOffloadError(f"unknown prefetch scheduler {name!r}; choose one of: {', '.join(SCHEDULERS)}")
