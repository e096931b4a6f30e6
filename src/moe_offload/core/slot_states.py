"""Slot states, their transitions, and the records the slot table reports its decisions in (``core.slots``).

Slot states (SeqMoE §7.2):
  * Empty   — no expert; allocation always prefers these;
  * Fetch   — reserved for an ongoing prefetch (a host-to-device copy in flight); protected from eviction;
  * Compute — holds an expert awaiting computation (a landed prefetch, or an expert of the layer being planned);
              protected from eviction;
  * Used    — holds a resident expert no pending computation needs; the only evictable state.

Transitions (SeqMoE §7.2, four events; the tags of §8.3):
  ==========  ======================================================================  ==========
  from        event                                                                   to
  ==========  ======================================================================  ==========
  Empty/Used  ``prefetch(eid)`` reserves the slot (a Used victim is evicted)          Fetch
  Fetch       ``land(eid, slot, tag, ok=True)`` with the slot's current tag           Compute
  Fetch       ``land(eid, slot, tag, ok=False)`` with the slot's current tag          Empty
  Empty/Used  on-demand load of a missed expert in ``plan_layer``                     Compute
  Used        a needed, resident expert (a hit) in ``plan_layer``                     Compute
  Fetch       a needed expert still in flight in ``plan_layer`` (adopted: a wait)     Compute
  Compute     end of ``plan_layer`` of layer p (unless ``hold``): every Compute slot  Used
              of layer p
  Compute     between two rounds of one ``plan_layer``: the earlier round's experts   Used
  Compute     ``release()`` (every Compute slot) or ``release(layer)`` (one layer)    Used
  any         ``land`` with a stale tag (the slot was reassigned or adopted since)    unchanged
  ==========  ======================================================================  ==========

The paper has no explicit Used->Compute for hits; this table pins a needed resident expert in Compute while its
layer's on-demand loads are decided, so a miss never evicts a hit of the same layer (the behaviour the table
always had). "Immediately before executing each MoE layer" (§7.2) is the end of ``plan_layer`` (the plan is
decided and applied at once and the caller executes it next), or, with ``plan_layer(..., hold=True)``, the
caller's ``release(layer)``: SeqMoE creates the layer's prefetch tasks in the offloading pipeline, after the
on-demand loads and before that transition, so a new task never evicts an expert the layer is about to use.

Tags (SeqMoE §8.3): every reservation of a slot (prefetch, on-demand load, adoption of an in-flight prefetch)
binds a fresh tag from one monotonically increasing counter (1, 2, ...) to the slot. ``land`` changes the table
only when the tag it is given is the slot's current tag and the slot is still in Fetch; any other landing is
stale and ignored (returns False).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class SlotState(Enum):
    """The four slot states of SeqMoE §7.2."""

    EMPTY = "empty"
    FETCH = "fetch"
    COMPUTE = "compute"
    USED = "used"


@dataclass
class Load:
    """One copy decided by the table: copy expert ``eid`` into ``slot`` (evicting ``evicted``, or -1).

    ``tag``: the slot reservation's tag (SeqMoE §8.3) for a prefetch (``SlotTable.prefetch``) and for a wait
    (``Round.waits``: the tag of the prefetch to wait for); -1 for an on-demand load of ``plan_layer``, which the
    caller does not land.
    """

    eid: int
    slot: int
    evicted: int = -1
    tag: int = -1


@dataclass
class Round:
    """A set of experts that are all resident at once and computed together.

    ``eids``: the experts computed in this round (sorted); ``slots``: the slot of each of them during the round;
    ``loads``: the on-demand copies to do, in order, before computing; ``waits``: prefetches still in flight
    (``Load`` with the prefetch's ``eid``, ``slot`` and ``tag``; ``evicted`` -1, the victim was reported by
    ``prefetch``) whose copies must complete before computing. The table already treats a waited expert as
    resident (in Compute, its prefetch tag retired, so landing that prefetch later returns False); if the caller
    finds the awaited copy failed, it copies the expert into ``slot`` itself, as for a load.
    """

    eids: list[int]
    slots: list[int]
    loads: list[Load] = field(default_factory=list)
    waits: list[Load] = field(default_factory=list)


@dataclass
class LayerPlan:
    """Decisions for one layer execution: the rounds to run and the hit/miss counts (SeqMoE's hit rate).

    ``hits``: needed experts resident (Compute or Used) when the layer was planned; ``misses``: the others,
    including the ``late`` ones (needed experts whose prefetch was still in flight, SeqMoE §9.1's hit definition:
    "already resident in device memory before on-demand loading"). ``hits + misses == len(needed)``.
    """

    rounds: list[Round]
    hits: int
    misses: int

    @property
    def waits(self) -> list[Load]:
        """Every in-flight prefetch the layer waits for (all in the first round)."""
        return [w for r in self.rounds for w in r.waits]

    @property
    def late(self) -> int:
        """Number of needed experts that were in flight (counted in ``misses``, loaded by no on-demand copy)."""
        return sum(len(r.waits) for r in self.rounds)

    @property
    def num_loads(self) -> int:
        """Number of on-demand copies (``misses - late``)."""
        return sum(len(r.loads) for r in self.rounds)
