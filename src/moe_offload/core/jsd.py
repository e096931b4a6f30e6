"""SeqMoE's joint prefetch scheduling (§6.2, Algorithm 1): Job Sequencing with Deadlines as a matroid greedy,
then earliest deadline first.

``max_confidence_feasible`` is Algorithm 1 lines 5-10 as written (a min-heap over the tasks by ascending deadline)
and the specification; ``JSDScheduler`` computes the same set and the same EDF choice, but keeps what it computed
between selections (issue 17: rebuilding the feasible set for every selection cost ~0.5 ms of Python per copy).

Why the kept set can be reused. The tasks whose counts of deadline ``<= d`` stay within ``T(d) = floor(C(d))`` for
every d are the independent sets of a matroid (nested capacity constraints), and the heap greedy returns its unique
maximum basis B under a strict order of preference (confidence, then earlier deadline, then earlier first insertion).
EDF transfers ``s``, the earliest-deadline task of B, and costs one unit of ``B_cur``. At the same position:

* ``B_cur >= 2`` before: every threshold drops by one (``T' = T - 1``). ``B - s`` is then independent (no task of B
  is due before ``s``) and maximal in the contraction by ``s``, which allows at least as much: it is the new maximum
  basis.
* ``B_cur <= 1`` before: ``max(1, B_cur)`` does not change (``T' = T``); ``s`` freed one unit at every ``d >= ddl_s``
  and nothing of B is due earlier, so the best rejected task joins: ``B - s + x``, the maximum basis after deleting
  ``s`` (the few best rejected tasks are remembered for this).
* otherwise (``1 < B_cur < 2``, a new position, new or expired or dropped tasks, another ``B_avg``): recompute.

The thresholds are compared per deadline in floating point before reusing, so the result is always the one the
heap greedy would return (a property test compares the two on random queues, ties included).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable

from .prefetch_queue import Capacity, PrefetchScheduler
from .prefetch_tasks import PrefetchTask


def max_confidence_feasible(tasks: Iterable[PrefetchTask], capacity: Capacity) -> list[PrefetchTask]:
    """The maximum-total-confidence task set with at most ``capacity(d)`` tasks of deadline ``<= d`` for every d
    (SeqMoE §3.2 formulation; Algorithm 1 lines 5-10).

    Matroid greedy: tasks are visited by ascending deadline and pushed on a min-heap keyed by
    ``(conf, -ddl)``; whenever the heap holds more than ``capacity(ddl)`` tasks its minimum (least confident; among
    equals the latest deadline, then the later in visiting order) is popped. The paper pops once per push, which
    suffices for a non-decreasing capacity; popping while over capacity also handles any other capacity function.

    Args:
        tasks: candidate tasks, any order.
        capacity: ``capacity(ddl)``, transfers that can complete before deadline ``ddl`` (experts; may be fractional).
    Returns:
        The kept tasks, by ascending deadline, then decreasing confidence.
    """
    order = sorted(tasks, key=lambda t: (t.ddl, -t.conf))
    heap: list[tuple[float, int, int, int]] = []
    for seq, t in enumerate(order):
        heapq.heappush(heap, (t.conf, -t.ddl, -seq, seq))
        cap = capacity(t.ddl)
        while heap and len(heap) > cap:
            heapq.heappop(heap)
    return [order[seq] for seq in sorted(entry[3] for entry in heap)]


_REJECTED_KEPT = 8  # rejected entries remembered for reuse (each later selection at B_cur <= 1 takes the best one)


def _edf_key(entry: tuple) -> tuple:
    """EDF order of a queue entry ``(conf, -ddl, -rank, seq, task)``: earliest deadline, higher confidence, earlier
    submission."""
    return (-entry[1], -entry[0], entry[3])


class JSDScheduler(PrefetchScheduler):
    """SeqMoE joint prefetch scheduling (§6.2, Algorithm 1): keep the maximum-confidence task set that fits the
    deadline capacities ``C(ddl)`` (``max_confidence_feasible``), then transfer its earliest-deadline task
    (EDF; ties: higher confidence, then earlier submission). See ``PrefetchScheduler`` for the arguments.

    The kept set is reused between selections at the same position when that is exact (module docstring); a
    caller-supplied ``capacity`` always recomputes with ``max_confidence_feasible``.
    """

    name = "jsd"

    def __init__(self, b_avg: float = 1.0, alpha: float = 0.2, auto_ema: bool = True):
        super().__init__(b_avg, alpha, auto_ema)
        # after a selection: (queue version, pos, B_avg, B_cur, thresholds, kept [EDF order], best rejected [best
        # first], whether those are all rejected) describing the state that selection leaves; used by the next _choose
        self._carry: tuple | None = None

    def plan(self, pos: int, capacity: Capacity | None = None) -> list[PrefetchTask]:
        """The feasible maximum-confidence set at ``pos`` (after ``advance(pos)``), without selecting anything."""
        self.advance(pos)
        return max_confidence_feasible((e[4] for e in self._queue.values()), capacity or self.capacity)

    def _thresholds(self, pos: int) -> list[int]:
        """``floor(C(d))`` for the queue's deadlines in ascending order, as the heap greedy compares them."""
        c0, b = max(1.0, self._b_cur), self._b_avg
        return [int(c0 + b * (d - pos - 1)) for d in sorted(self._by_ddl)]

    def _greedy(self, pos: int) -> tuple[list, list, bool]:
        """Algorithm 1 lines 5-10 over the queue's entries by ascending deadline. Capacities only grow with the
        deadline, so "push, then pop the minimum while over ``C(ddl)``" is one ``heappushpop`` once the heap holds
        ``floor(C(ddl))`` entries. Returns (kept entries in EDF order, the best few rejected entries, best first,
        and whether those are all of them): what ``_carry_after`` needs."""
        c0, b = max(1.0, self._b_cur), self._b_avg
        heap: list = []
        rejected: list = []
        push, pushpop, reject = heapq.heappush, heapq.heappushpop, rejected.append
        for d in sorted(self._by_ddl):
            cap = int(c0 + b * (d - pos - 1))   # >= 1: tasks due by pos + 1 have expired
            for entry in self._by_ddl[d].values():
                if len(heap) < cap:
                    push(heap, entry)
                else:
                    reject(pushpop(heap, entry))
        heap.sort(key=_edf_key)
        return heap, heapq.nlargest(_REJECTED_KEPT, rejected), len(rejected) <= _REJECTED_KEPT

    def _choose(self, pos, capacity):
        if capacity is not None:
            kept = max_confidence_feasible((e[4] for e in self._queue.values()), capacity)
            seq_of = {(e[4].eid, e[4].ddl): e[3] for e in self._queue.values()}
            self._carry = None
            return min(kept, key=lambda t: (t.ddl, -t.conf, seq_of[(t.eid, t.ddl)])) if kept else None
        carry, self._carry = self._carry, None
        if carry is not None and carry[:4] == (self._version, pos, self._b_avg, self._b_cur) \
                and carry[4] == self._thresholds(pos):
            kept, rejected, complete = carry[5:]
        else:
            kept, rejected, complete = self._greedy(pos)
        if not kept:
            return None
        chosen = kept[0]
        self._carry_after(pos, chosen, kept, rejected, complete)
        return chosen[4]

    def _carry_after(self, pos: int, chosen: tuple, kept: list, rejected: list, complete: bool) -> None:
        """Prepare the kept set that selecting ``chosen`` (``kept[0]``) leaves, when it is exact (module docstring):
        ``select`` then removes the task (one queue change) and spends one unit of ``B_cur``."""
        b_cur = self._b_cur
        if 1.0 < b_cur < 2.0:
            return
        old = self._thresholds(pos)
        rest = kept[1:]
        if b_cur <= 1.0:
            if not rejected and not complete:  # the remembered rejected tasks ran out: recompute
                return
            if rejected:
                bisect.insort(rest, rejected[0], key=_edf_key)
                rejected = rejected[1:]
        new_b_cur = b_cur - 1.0
        c0, b = max(1.0, new_b_cur), self._b_avg
        ddls = sorted(self._by_ddl)
        if len(self._by_ddl[-chosen[1]]) == 1:  # the chosen task's deadline leaves the queue with it
            i = ddls.index(-chosen[1])
            del ddls[i], old[i]
        new = [int(c0 + b * (d - pos - 1)) for d in ddls]
        shift = 1 if b_cur >= 2.0 else 0
        if any(n != o - shift for n, o in zip(new, old)):
            return
        self._carry = (self._version + 1, pos, self._b_avg, new_b_cur, new, rest, rejected, complete)

    def reset(self) -> None:
        super().reset()
        self._carry = None
