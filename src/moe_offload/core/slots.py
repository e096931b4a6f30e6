"""The slot table: which expert sits in which device slot, the slot states, and the per-layer residency decisions.

SeqMoE §8.1: one pool of ``num_slots`` device slots is shared by every MoE layer; a lookup table maps a global
expert id ``eid = moe_layer * num_experts + expert`` to its slot. This module holds that mapping and makes all
residency decisions (hit/miss accounting, which slot a missed or prefetched expert goes to, whom to evict) as pure
logic, so the runtime (``runtime.engine``) and the trace simulator replay the exact same decisions.

The slot states (Empty, Fetch, Compute, Used: SeqMoE §7.2), their transitions and the tags of §8.3 are tabled in
``core.slot_states``, with the records (``Load``, ``Round``, ``LayerPlan``) the table reports its decisions in.
"""

from __future__ import annotations

import bisect

from ..errors import MoeOffloadError
from .eviction import EvictionPolicy
from .slot_states import LayerPlan, Load, Round, SlotState

__all__ = ["LayerPlan", "Load", "Round", "SlotState", "SlotTable"]


class SlotTable:
    """Expert <-> slot mapping over one global pool, the slot states, plus hit/miss/eviction accounting.

    Args:
        num_slots: number of device slots S (>= 1).
        num_experts_total: number of routed experts in the model, all MoE layers together (N).
        policy: the eviction policy consulted when no slot is Empty.
        experts_per_layer: e, routed experts per MoE layer (``eid // e`` is an expert's MoE layer). Needed to
            prefetch: landed prefetches stay in Compute until their own layer is planned (SeqMoE §7.2). Without
            it ``prefetch`` raises and the table behaves exactly as before prefetching existed.
        reserve: slots that prefetches may never occupy: ``prefetch`` refuses when the Fetch and Compute slots
            would exceed ``num_slots - reserve`` (SeqMoE §8.4 keeps ``num_slots - e`` slots in Fetch during
            prefill, "reserving e slots for evicting and loading missed experts"). >= 1, so a layer can always
            load its misses (in rounds of at most ``reserve`` experts in the worst case).

    Attributes:
        slot_of: list[int] of length N, the slot of each resident (Compute or Used) expert, -1 otherwise
            (an expert in flight is not resident: ``slot_of`` is -1 until it lands).
        expert_in: list[int] of length S, the expert in each slot (for a Fetch slot, the expert being fetched into
            it), -1 when Empty.
        tick: number of layer executions planned so far (the policies' clock).
        prefetches_wasted: prefetched experts evicted before any layer needed them (the forecast was wrong or came
            too early; a failed or cancelled copy is not counted).
        prefetches_used: prefetched experts a layer needed (in flight or landed) before they were evicted.

    Policy events: ``on_evict`` when a victim leaves its slot (at ``prefetch`` for a prefetch's victim);
    ``on_insert`` when an expert becomes resident: an on-demand load, a successful landing, or the adoption of an
    in-flight prefetch by ``plan_layer`` (never at reservation, so the policy's ``resident`` set always equals
    the experts with ``slot_of >= 0``). ``victim(pinned)`` gets every expert in a Fetch or Compute slot as pinned.

    Not thread-safe: one thread drives it (SeqMoE §8.3 keeps the state table on the main stream; the prefetcher
    only copies and reports landings).

    Raises:
        MoeOffloadError: bad arguments (see each method).
    """

    def __init__(self, num_slots: int, num_experts_total: int, policy: EvictionPolicy,
                 experts_per_layer: int | None = None, reserve: int = 1):
        if num_slots < 1:
            raise MoeOffloadError(f"the slot pool needs at least one slot, got {num_slots}")
        if num_experts_total < 0:
            raise MoeOffloadError(f"num_experts_total must be >= 0, got {num_experts_total}")
        if experts_per_layer is not None and experts_per_layer < 1:
            raise MoeOffloadError(f"experts_per_layer must be >= 1, got {experts_per_layer}")
        if not 1 <= reserve <= num_slots:
            raise MoeOffloadError(f"reserve must be in [1, num_slots={num_slots}], got {reserve}")
        self.num_slots = num_slots
        self.num_experts_total = num_experts_total
        self.policy = policy
        self.experts_per_layer = experts_per_layer
        self.reserve = reserve
        self.slot_of = [-1] * num_experts_total
        self.expert_in = [-1] * num_slots
        self._empty = list(range(num_slots - 1, -1, -1))  # descending: pop() hands out the smallest Empty slot
        self._state = [SlotState.EMPTY] * num_slots
        self._tag = [0] * num_slots                         # the slot's current reservation tag (0: never)
        self._next_tag = 1
        self._fetching: dict[int, int] = {}                 # expert in flight -> its Fetch slot
        self._pinned: set[int] = set()                      # experts in Fetch or Compute slots
        self._unused_prefetch: set[int] = set()             # prefetched, not needed by any layer since
        self.prefetches_wasted = 0
        self.prefetches_used = 0
        self.tick = 0

    # ---- queries -------------------------------------------------------------------------------------------

    @property
    def resident(self) -> int:
        """Number of occupied (Fetch, Compute or Used) slots."""
        return self.num_slots - len(self._empty)

    def is_resident(self, eid: int) -> bool:
        """Whether expert ``eid`` is in a Compute or Used slot (an expert in flight is not)."""
        return self.slot_of[eid] >= 0

    def state_of(self, slot: int) -> SlotState:
        """The state of ``slot``. Raises MoeOffloadError when ``slot`` is not in ``[0, num_slots)``."""
        self._check_slot(slot)
        return self._state[slot]

    def tag_of(self, slot: int) -> int:
        """The tag of ``slot``'s current reservation (0 before its first). Raises MoeOffloadError for a bad slot."""
        self._check_slot(slot)
        return self._tag[slot]

    def in_flight(self, eid: int) -> bool:
        """Whether expert ``eid`` is being prefetched (its slot in Fetch). Raises MoeOffloadError for a bad id."""
        self._check_eid(eid)
        return eid in self._fetching

    @property
    def fetching(self):
        """The experts in flight (a read-only view of the Fetch slots' experts, for fast ``in`` tests)."""
        return self._fetching.keys()

    @property
    def num_fetching(self) -> int:
        """Number of slots in Fetch."""
        return len(self._fetching)

    @property
    def num_protected(self) -> int:
        """Number of slots in Fetch or Compute (never evicted)."""
        return len(self._pinned)

    def begin_step(self, request: int, step: int) -> None:
        """A forward pass begins (step 0 = prefill of ``request``, i >= 1 = decode step i): tells the policy."""
        self.policy.on_step(request, step)

    # ---- prefetch (SeqMoE §7.2 events 1 and 2, §8.3 tags) -----------------------------------------------------

    def prefetch(self, eid: int, reserve: int | None = None) -> Load | None:
        """Create a prefetch task for expert ``eid``: reserve a slot for it in Fetch (SeqMoE §7.2, first event).

        The slot is an Empty one if any (the smallest), else a Used one whose expert the policy picks as
        ``victim`` (evicted now: ``on_evict``; its slot mapping is dropped). The returned Load carries the
        reservation's ``tag``: the caller copies the expert into ``slot`` and then calls
        ``land(eid, slot, tag, ok)``.

        Args:
            eid: global expert id in ``[0, N)``.
            reserve: overrides the table's ``reserve`` for this call (``1 <= reserve <= num_slots``).
        Returns:
            The Load, or None when ``eid`` is already resident or in flight, or when taking a slot would leave
            more than ``num_slots - reserve`` slots in Fetch or Compute (no slot can be had without evicting a
            protected one or eating into the reserve).
        Raises:
            MoeOffloadError: ``eid`` out of range, bad ``reserve``, or the table has no ``experts_per_layer``.
        """
        self._check_eid(eid)
        if self.experts_per_layer is None:
            raise MoeOffloadError("prefetching needs the slot table's experts_per_layer (to know each expert's "
                                  "layer: landed prefetches stay in Compute until their layer runs)")
        reserve = self.reserve if reserve is None else reserve
        if not 1 <= reserve <= self.num_slots:
            raise MoeOffloadError(f"reserve must be in [1, num_slots={self.num_slots}], got {reserve}")
        if self.slot_of[eid] >= 0 or eid in self._fetching:
            return None
        if len(self._pinned) + 1 > self.num_slots - reserve:
            return None
        slot, evicted = self._take_slot()  # a Used slot exists: fewer than num_slots slots are protected
        self._tag[slot] = tag = self._new_tag()
        self._state[slot] = SlotState.FETCH
        self.expert_in[slot] = eid
        self._fetching[eid] = slot
        self._pinned.add(eid)
        self._unused_prefetch.add(eid)
        return Load(eid=eid, slot=slot, evicted=evicted, tag=tag)

    def land(self, eid: int, slot: int, tag: int, ok: bool = True) -> bool:
        """A prefetch lands (SeqMoE §7.2, second event): Fetch -> Compute if ``ok``, else Fetch -> Empty.

        Only a landing whose ``tag`` is ``slot``'s current tag and whose slot is still in Fetch changes the table
        (SeqMoE §8.3: "updates the cache state only when the returned tag matches the slot's expected tag"). On
        success the expert becomes resident (``slot_of``) and the policy sees ``on_insert``; it stays in Compute,
        protected, until its layer is planned. On failure the slot is freed and the expert is not resident.

        Args:
            eid, slot, tag: as returned by ``prefetch``.
            ok: whether the copy completed successfully (False also cancels a task that will not be copied).
        Returns:
            True when applied; False when stale (the slot was reassigned since, the task was already landed, or
            ``plan_layer`` adopted it as a wait).
        Raises:
            MoeOffloadError: ``eid`` or ``slot`` out of range, or ``tag`` is the slot's current Fetch tag but the
            slot is being filled with another expert (the arguments do not belong together).
        """
        self._check_eid(eid)
        self._check_slot(slot)
        if self._state[slot] is not SlotState.FETCH or self._tag[slot] != tag:
            return False
        if self.expert_in[slot] != eid:
            raise MoeOffloadError(f"tag {tag} of slot {slot} belongs to expert {self.expert_in[slot]}, not {eid}")
        del self._fetching[eid]
        if ok:
            self._state[slot] = SlotState.COMPUTE
            self.slot_of[eid] = slot
            self.policy.on_insert(eid, self.tick)
        else:
            self._state[slot] = SlotState.EMPTY
            self.expert_in[slot] = -1
            self._pinned.discard(eid)
            self._unused_prefetch.discard(eid)
            i = bisect.bisect_left(self._empty, -slot, key=lambda s: -s)  # keep the list descending
            self._empty.insert(i, slot)
        return True

    # ---- on-demand (SeqMoE §7.2 events 3 and 4) ---------------------------------------------------------------

    def plan_layer(self, needed: list[int], tokens: list[int] | None = None, layer: int | None = None, *,
                   hold: bool = False) -> LayerPlan:
        """Decide how one layer execution gets its experts onto the device.

        Args:
            needed: distinct global expert ids the layer's router selected, any order (ints in [0, N)).
            tokens: optional, aligned with ``needed``: how many tokens selected each expert (default 1 each).
            layer: optional MoE layer index of this execution (only with ``experts_per_layer``; by default the
                layer of ``needed``). Its prefetched-but-unneeded Compute slots become Used at the end.
            hold: keep the last round's experts and the layer's Compute slots in Compute when returning; the caller
                then calls ``release(layer)`` (or ``release()``) before the layer computes, after creating the
                prefetch tasks that must not evict this layer's experts (SeqMoE §4 pipeline order). Without
                ``hold``, a ``prefetch`` between this call and the layer's computation may evict a Used expert the
                layer is about to read: the caller must then order that copy after the computation.

        Returns:
            A LayerPlan. Needed experts already resident are hits; needed experts in flight (Fetch) are adopted:
            their slot goes to Compute and the plan lists them in ``waits`` (no second copy); the others are
            loaded on demand into Empty or Used slots (-> Compute). When the needed experts fit in the slots not
            protected for other experts (``num_slots`` minus the Fetch/Compute slots of experts not needed here;
            all of them without prefetching) there is one round holding every needed expert. Otherwise the
            experts are processed in rounds of at most that many: the resident and in-flight ones first (so a hit
            is never evicted before it is used), each round's experts in Compute while it computes and released
            (Used) before the next round loads. The hit count is taken before any load (SeqMoE's definition:
            required experts already resident before on-demand loading).

        The plan is already applied to the table (mapping, states, policy events, counters) when this returns:
        the caller executes, for each round in order, its waits and loads and then its compute. At the end every
        Compute slot of this layer (its experts and its prefetched-but-unactivated experts) is Used (SeqMoE §7.2,
        fourth event); landed prefetches of other layers stay in Compute.

        Raises:
            MoeOffloadError: an id out of range, ``tokens`` not aligned with ``needed``, ``needed`` spanning
            several MoE layers or not in ``layer`` (with ``experts_per_layer``), ``layer`` without it, or every
            slot protected for other experts (a held layer not released).
        """
        if len(needed):
            lo, hi = min(needed), max(needed)
            if lo < 0 or hi >= self.num_experts_total:
                raise MoeOffloadError(f"expert ids must be in [0, {self.num_experts_total}), got {lo}..{hi}")
        if tokens is not None and len(tokens) != len(needed):
            raise MoeOffloadError(f"tokens has {len(tokens)} entries for {len(needed)} needed experts")
        layer = self._layer_of(needed, layer)
        # slots protected for experts this layer does not need (Fetch, or Compute awaiting another computation)
        pinned = self._pinned
        others = len(pinned) - sum(1 for e in needed if e in pinned) if pinned else 0
        width = self.num_slots - others  # >= reserve >= 1 (prefetch never protects more than num_slots - reserve)
        if width < 1 and len(needed):
            raise MoeOffloadError("every slot is in Fetch or Compute for other experts: release the held layer "
                                  "(plan_layer(..., hold=True) needs release(layer) before the next layer)")
        self.tick += 1
        if tokens is None:
            tokens = [1] * len(needed)
        pairs = sorted(zip(needed, tokens))
        needed = [e for e, _ in pairs]
        if self._unused_prefetch:
            before = len(self._unused_prefetch)
            self._unused_prefetch.difference_update(needed)
            self.prefetches_used += before - len(self._unused_prefetch)
        slot_of, fetching = self.slot_of, self._fetching
        if not pinned and not fetching and all(slot_of[e] >= 0 for e in needed):
            return self._plan_all_hits(pairs, needed, hold)
        hit_list = [e for e in needed if slot_of[e] >= 0]
        miss_list = [e for e in needed if slot_of[e] < 0]
        late_list: list[int] = []
        if fetching:
            late_list = [e for e in miss_list if e in fetching]
            miss_list = [e for e in miss_list if e not in fetching]
        self.policy.on_layer_access(pairs, self.tick)
        order = hit_list + late_list + miss_list
        chunks = [order[i:i + width] for i in range(0, len(order), width)]
        rounds = []
        for i, chunk in enumerate(chunks):
            if i:
                self._release_experts(chunks[i - 1])
            rounds.append(self._apply_round(chunk))
        if not hold:
            if chunks:
                self._release_experts(chunks[-1])
            if layer is not None:
                self.release(layer)
        return LayerPlan(rounds=rounds, hits=len(hit_list), misses=len(late_list) + len(miss_list))

    def _plan_all_hits(self, pairs: list[tuple[int, int]], needed: list[int], hold: bool) -> LayerPlan:
        """``plan_layer`` when every needed expert is resident and no slot is in Fetch or Compute (the common case of
        a decode step): the same policy events and the same plan, without the state changes that would cancel out
        (each slot Used -> Compute -> Used; with ``hold``, the slots stay in Compute until ``release``)."""
        self.policy.on_layer_access(pairs, self.tick)
        slot_of = self.slot_of
        if hold:
            compute, state = SlotState.COMPUTE, self._state
            self._pinned.update(needed)
            for e in needed:
                state[slot_of[e]] = compute
        rnd = Round(eids=needed, slots=[slot_of[e] for e in needed], loads=[], waits=[])
        return LayerPlan(rounds=[rnd] if needed else [], hits=len(needed), misses=0)

    def release(self, layer: int | None = None) -> None:
        """Move Compute slots to Used: every Compute slot (``layer`` None: the table's behaviour before
        prefetching), or only those holding experts of MoE ``layer`` (SeqMoE §7.2, fourth event; needs
        ``experts_per_layer``). Fetch slots are never touched.

        Raises:
            MoeOffloadError: ``layer`` given without ``experts_per_layer``.
        """
        if layer is None:
            self._release_experts([e for e in self._pinned if e not in self._fetching])
            return
        if self.experts_per_layer is None:
            raise MoeOffloadError("release(layer) needs the slot table's experts_per_layer")
        e = self.experts_per_layer
        lo, hi = layer * e, (layer + 1) * e
        self._release_experts([x for x in self._pinned if lo <= x < hi and x not in self._fetching])

    # ---- internals -----------------------------------------------------------------------------------------

    def _apply_round(self, chunk: list[int]) -> Round:
        self._pinned.update(chunk)
        slot_of, state, compute = self.slot_of, self._state, SlotState.COMPUTE
        loads, waits = [], []
        for e in chunk:
            s = slot_of[e]
            if s >= 0:
                state[s] = compute
            elif e in self._fetching:
                waits.append(self._adopt(e))
            else:
                loads.append(self._allocate(e))
        eids = sorted(chunk)
        return Round(eids=eids, slots=[slot_of[e] for e in eids], loads=loads, waits=waits)

    def _adopt(self, eid: int) -> Load:
        """A needed expert is in flight: its Fetch slot becomes Compute under a fresh tag (the prefetch's own
        landing is then stale) and the caller waits for the copy instead of loading the expert again."""
        slot = self._fetching.pop(eid)
        old_tag = self._tag[slot]
        self._tag[slot] = self._new_tag()
        self._state[slot] = SlotState.COMPUTE
        self.slot_of[eid] = slot
        self.policy.on_insert(eid, self.tick)
        return Load(eid=eid, slot=slot, evicted=-1, tag=old_tag)

    def _allocate(self, eid: int) -> Load:
        slot, evicted = self._take_slot()
        self._tag[slot] = self._new_tag()
        self._state[slot] = SlotState.COMPUTE
        self.slot_of[eid] = slot
        self.expert_in[slot] = eid
        self.policy.on_insert(eid, self.tick)
        return Load(eid=eid, slot=slot, evicted=evicted)

    def _take_slot(self) -> tuple[int, int]:
        """An Empty slot if any, else the slot of the policy's Used victim (evicted here). Callers guarantee an
        Empty or Used slot exists."""
        if self._empty:
            return self._empty.pop(), -1
        evicted = self.policy.victim(self._pinned)
        slot = self.slot_of[evicted]
        if slot < 0 or self._state[slot] is not SlotState.USED:
            raise RuntimeError(f"policy {self.policy.name} chose expert {evicted}, which is not in a Used slot")
        self.slot_of[evicted] = -1
        self.policy.on_evict(evicted)
        if evicted in self._unused_prefetch:
            self._unused_prefetch.discard(evicted)
            self.prefetches_wasted += 1
        return slot, evicted

    def _release_experts(self, eids) -> None:
        pinned, state, slot_of, used = self._pinned, self._state, self.slot_of, SlotState.USED
        for e in eids:
            pinned.discard(e)
            state[slot_of[e]] = used

    def _new_tag(self) -> int:
        tag = self._next_tag
        self._next_tag += 1
        return tag

    def _layer_of(self, needed: list[int], layer: int | None) -> int | None:
        e = self.experts_per_layer
        if e is None:
            if layer is not None:
                raise MoeOffloadError("plan_layer(layer=...) needs the slot table's experts_per_layer")
            return None
        if len(needed):
            lo, hi = min(needed) // e, max(needed) // e
            if lo != hi or (layer is not None and layer != lo):
                where = f"layer {layer}" if layer is not None else "one MoE layer"
                raise MoeOffloadError(f"needed experts must all belong to {where}; they span layers {lo}..{hi}")
            return lo
        return layer

    def _check_eid(self, eid: int) -> None:
        if not 0 <= eid < self.num_experts_total:
            raise MoeOffloadError(f"expert id {eid} is out of range [0, {self.num_experts_total})")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise MoeOffloadError(f"slot {slot} is out of range [0, {self.num_slots})")
