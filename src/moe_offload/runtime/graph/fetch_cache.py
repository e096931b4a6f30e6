"""Graph mode's device-side slot table with prefetching: the Fetch and Compute slot states, reservations bound to
tags, landings by tag and the adoption of in-flight experts, in fixed-shape tensor ops (SeqMoE §7.2, §8.2-8.3).

``FetchingGraphCache`` extends ``runtime.graph.cache.GraphCache`` with the rest of ``core.slots.SlotTable``'s state
machine, making exactly its decisions (``tests/test_graph_fetch_cache.py`` replays random traces with prefetch
requests and landings through both and compares every decision, tag and slot):

* ``reserve(eids)`` = ``SlotTable.prefetch`` for each requested expert in order: skipped when resident, in flight
  or already requested in the batch; refused once the Fetch and Compute slots would exceed ``S - reserve``; else
  the next candidate slot (Empty by index, then Used in the policy's victim order, every Fetch/Compute slot
  protected) goes to Fetch under the next tag, its Used expert evicted (``on_evict``).
* ``land(done_tag)`` = ``SlotTable.land(ok=True)`` for every Fetch slot whose returned tag equals its expected tag,
  in ascending tag order (the order one copy worker completes them): Fetch -> Compute, the expert resident
  (``on_insert``). A returned tag that is not the slot's current one is stale and ignored (§8.3).
* ``plan(layer, ids)`` = ``SlotTable.plan_layer(..., hold=True)``: hits are needed resident experts; a needed expert
  in flight is adopted (Fetch -> Compute under a fresh tag, ``on_insert``; the caller waits for its copy: ``waits``)
  and counts as a miss, as do the experts loaded on demand. Policy order: accesses of all needed experts first, then
  inserts — adopted experts (ascending id), then loads (ascending id).
* ``release(layer)`` = ``SlotTable.release(layer)``: this layer's Compute slots -> Used.

Scope: LRU and probabilistic Belady (``seqmoe``'s eviction); LFU is refused (a landed expert that was never accessed
ties with others on (count, stamp) and LFU breaks that tie by expert id, which the packed key does not carry).
The table's ``reserve`` must be at least one layer's experts (``E``), so every layer executes in one round
(``SlotTable.plan_layer``'s rounds are data-dependent).

Stamps: landings stamp ``seq + 1 + (tag - first landed tag)`` and advance ``seq`` past the last one: the same order
as one-by-one ``on_insert`` calls in tag order (the stamps may skip values; only their order is ever compared).
"""

from __future__ import annotations

import torch

from ...errors import MoeOffloadError
from .cache import GraphCache

#: slot states (``core.slot_states.SlotState``) as the int64 codes of ``FetchingGraphCache.state``
EMPTY, FETCH, COMPUTE, USED = 0, 1, 2, 3


class FetchingGraphCache(GraphCache):
    """``GraphCache`` plus the Fetch/Compute states, tags and reservations (SeqMoE §7.2, §8.3).

    Args:
        num_slots, experts_per_layer, num_moe_layers, policy, device, horizon, lam, no_forecast_score: as
            ``GraphCache`` (eviction kind ``lru`` or ``prob-belady``).
        reserve: slots a reservation never takes (``SlotTable``'s ``reserve``); default and minimum ``E``.
        max_requests: R, the reservations one ``reserve`` call may make (a static shape).

    State besides ``GraphCache``'s (int64; index S or N is the scratch entry): ``state [S + 1]`` slot state codes;
    ``tag [S + 1]`` each slot's expected tag (0: never reserved); ``next_tag []``; ``fetch_of [N + 1]`` the Fetch
    slot of an expert in flight, else -1; ``landed []`` landings applied. ``lookup`` holds resident (Compute or
    Used) experts only.

    Raises:
        MoeOffloadError: LFU, ``reserve`` outside ``[E, S - 1]``, ``max_requests < 1``, or as ``GraphCache``.
    """

    def __init__(self, num_slots: int, experts_per_layer: int, num_moe_layers: int, policy: str,
                 device: torch.device | str = "cpu", horizon: int = 8, lam: float = 0.5,
                 no_forecast_score: float = 0.0, reserve: int | None = None, max_requests: int = 4):
        super().__init__(num_slots, experts_per_layer, num_moe_layers, policy, device, horizon, lam,
                         no_forecast_score)
        if self.kind == "lfu":
            raise MoeOffloadError("graph-mode prefetching runs with LRU or probabilistic Belady, not LFU")
        reserve = experts_per_layer if reserve is None else reserve
        if not experts_per_layer <= reserve < num_slots:
            raise MoeOffloadError(f"graph-mode prefetching needs reserve in [{experts_per_layer}, {num_slots - 1}] "
                                  f"(one MoE layer's experts, at least one slot to prefetch into), got {reserve}")
        if max_requests < 1:
            raise MoeOffloadError(f"max_requests must be >= 1, got {max_requests}")
        self.reserve, self.R = reserve, max_requests
        i64 = dict(dtype=torch.long, device=self.lookup.device)
        self.state = torch.zeros(num_slots + 1, **i64)
        self.tag = torch.zeros(num_slots + 1, **i64)
        self.next_tag = torch.ones((), **i64)
        self.fetch_of = torch.full((self.N + 1,), -1, **i64)
        self.landed = torch.zeros((), **i64)  # prefetches landed (Fetch -> Compute by a matching tag)
        self._r_ar = torch.arange(max_requests, **i64)
        self._r_upto = torch.ones(max_requests, max_requests, dtype=torch.bool, device=self.lookup.device).tril()

    # ---- landings ---------------------------------------------------------------------------------------------

    def land(self, done_tag: torch.Tensor) -> None:
        """Apply every finished copy: ``done_tag [S]`` int64, the tag the copy worker returned for each slot (its
        last finished copy). Fetch slots whose expected tag it equals go to Compute, their experts resident
        (``SlotTable.land``); other returned tags are stale. Fixed shapes, no host synchronisation."""
        S, N = self.S, self.N
        tag = self.tag[:S]
        landed = (self.state[:S] == FETCH) & (done_tag == tag)
        eid = torch.where(landed, self.expert_in[:S], N)
        first = torch.where(landed, tag, torch.iinfo(torch.int64).max).min()
        stamps = self.seq + 1 + (tag - first)
        self.lookup.index_put_((eid,), torch.where(landed, self._slot_ar, -1))
        self.fetch_of.index_put_((eid,), torch.full_like(eid, -1))
        self.last.index_put_((eid,), torch.where(landed, stamps, 0))
        self.state[:S] = torch.where(landed, COMPUTE, self.state[:S])
        self.landed.add_(landed.sum())
        last_tag = torch.where(landed, tag, 0).max()
        self.seq.copy_(torch.where(landed.any(), self.seq + 1 + last_tag - first, self.seq))

    # ---- reservations -----------------------------------------------------------------------------------------

    def reserve_slots(self, eids: torch.Tensor):
        """Reserve Fetch slots for the requested experts, in order (``SlotTable.prefetch`` for each).

        Args:
            eids: ``[R]`` int64 global expert ids; an entry ``>= N`` (or < 0) is no request.
        Returns:
            ``(slots, tags, accepted)``: ``[R]`` int64 the Fetch slot and tag of each accepted request, ``[R]`` bool
            which were accepted (the others: resident, in flight, repeated in the batch, or refused by the reserve;
            their slot is S, their tag 0).
        """
        S, N = self.S, self.N
        req = (eids >= 0) & (eids < N)
        e = torch.where(req, eids, N)
        picks = self._candidates(self.R)
        accepted = self._accept(e, req, picks)
        ok_rank = (self._r_upto & accepted.unsqueeze(0)).sum(dim=1)  # inclusive prefix count
        rank = torch.where(accepted, ok_rank - 1, self.R)
        slots = torch.where(accepted, picks[rank.clamp(max=self.R - 1)], S)
        tags = torch.where(accepted, self.next_tag + rank, 0)
        evicted = self.expert_in[slots]
        evicted = torch.where(accepted & (evicted >= 0), evicted, N)
        self.lookup.index_put_((evicted,), torch.full_like(evicted, -1))
        if self.kind == "prob-belady":
            self.last.index_put_((evicted,), torch.zeros_like(evicted))
        e = torch.where(accepted, e, N)
        self.state.index_put_((slots,), torch.full_like(slots, FETCH))
        self.tag.index_put_((slots,), tags)
        self.expert_in.index_put_((slots,), e)
        self.fetch_of.index_put_((e,), slots)
        self.next_tag.add_(accepted.sum())
        return slots, tags, accepted

    def _accept(self, e: torch.Tensor, req: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        """Which requests ``SlotTable.prefetch`` would accept, one after the other: ``[R]`` bool. Request j is
        accepted when its expert is neither resident (an earlier acceptance may have evicted it: the r-th accepted
        request takes candidate ``picks[r]``) nor in flight (before, or by an earlier acceptance), and one more
        protected slot stays within ``S - reserve``. An unrolled loop over the R requests on ``[R]`` tensors; the
        big state is updated once, afterwards."""
        resident0 = self.lookup[e] >= 0
        in_flight0 = self.fetch_of[e] >= 0
        victims = self.expert_in[picks]  # -1 for an Empty candidate
        room = self.S - self.reserve - ((self.state[:self.S] == FETCH) | (self.state[:self.S] == COMPUTE)).sum()
        taken = torch.zeros((), dtype=torch.long, device=e.device)
        accepted = torch.zeros(self.R, dtype=torch.bool, device=e.device)
        for j in range(self.R):
            evicted = ((victims == e[j]) & (self._r_ar < taken)).any()
            again = (accepted & (e == e[j])).any()
            ok = req[j] & ~(resident0[j] & ~evicted) & ~in_flight0[j] & ~again & (taken < room)
            accepted = accepted | ((self._r_ar == j) & ok)
            taken = taken + ok.long()
        return accepted

    def _candidates(self, m: int) -> torch.Tensor:
        """The first ``m`` slots a load or reservation takes: Empty by index, then Used by the policy's victim
        order; Fetch and Compute slots are protected (after every real candidate, never used)."""
        se = self.expert_in[:self.S]
        st = self.state[:self.S]
        occupied = st != EMPTY
        pinned = (st == FETCH) | (st == COMPUTE)
        e = se.clamp(min=0)
        empty_key = self._slot_ar - self.S
        if self.kind == "prob-belady":
            return self._victims_scored(occupied, pinned, self.score[e], self.last[e], empty_key, m)
        key = torch.where(occupied, torch.where(pinned, torch.iinfo(torch.int64).max, self.last[e]), empty_key)
        return torch.topk(key, m, largest=False, sorted=True).indices

    # ---- the layer plan ---------------------------------------------------------------------------------------

    def plan(self, layer: int, top_k_index: torch.Tensor):
        """Plan one execution of MoE ``layer`` (``SlotTable.plan_layer(..., hold=True)``); its experts stay in
        Compute until ``release(layer)``.

        Args:
            layer: MoE layer index (a Python int); top_k_index: ``[T, k]`` int64 expert ids in ``[0, E)``.
        Returns:
            ``(slot_ids, load_eids, load_slots, valid, wait_slots, wait_tags, wait_valid)``: the first four as
            ``GraphCache.plan``; ``wait_slots [E]``, ``wait_tags [E]`` int64 the Fetch slots of adopted experts and
            the tag of their copy (the caller waits until the copy worker returns it), ``wait_valid [E]`` bool.
        """
        E, S, N, base = self.E, self.S, self.N, layer * self.E
        flat = top_k_index.reshape(-1)
        m = min(flat.numel(), E)
        need = torch.zeros(E, dtype=torch.bool, device=flat.device).scatter_(0, flat, True)
        lk = self.lookup[base:base + E]
        fs = self.fetch_of[base:base + E]
        hit = need & (lk >= 0)
        late = need & (lk < 0) & (fs >= 0)
        miss = need & (lk < 0) & (fs < 0)
        n_late, n_miss = late.sum(), miss.sum()
        self.hits.add_(hit.sum())
        self.misses.add_(n_late + n_miss)
        self._access(base, need, hit)
        hit_slots = torch.where(hit, lk, S)
        self.state.index_put_((hit_slots,), torch.full_like(hit_slots, COMPUTE))
        # adopt the late ones: Fetch -> Compute under fresh tags, resident now (on_insert, ascending id)
        late_rank = self._prefix(late) - 1
        wait_slots = torch.where(late, fs, S)
        wait_tags = torch.where(late, self.tag[wait_slots], 0)
        late_ids = torch.where(late, self._e_ar + base, N)
        self.tag.index_put_((wait_slots,), self.next_tag + late_rank)
        self.state.index_put_((wait_slots,), torch.full_like(wait_slots, COMPUTE))
        self.lookup.index_put_((late_ids,), wait_slots)
        self.fetch_of.index_put_((late_ids,), torch.full_like(late_ids, -1))
        self.last.index_put_((late_ids,), self.seq + 1 + late_rank)
        self.seq.add_(n_late)
        self.next_tag.add_(n_late)
        # on-demand loads into the candidates (Empty, then Used by the policy; Fetch/Compute protected)
        picks = self._candidates(m)
        rank = torch.where(miss, self._prefix(miss) - 1, m)
        load_eids = torch.full((m + 1,), N, dtype=torch.long, device=flat.device)
        load_eids = load_eids.scatter(0, rank, self._e_ar + base)[:m]
        valid = torch.arange(m, device=flat.device) < n_miss
        load_slots = torch.where(valid, picks, S)
        evicted = self.expert_in[load_slots]
        evicted = torch.where(valid & (evicted >= 0), evicted, N)
        self.lookup.index_put_((evicted,), torch.full_like(evicted, -1))
        if self.kind == "prob-belady":
            self.last.index_put_((evicted,), torch.zeros_like(evicted))
        ar_m = torch.arange(m, device=flat.device)
        self.lookup.index_put_((load_eids,), load_slots)
        self.expert_in.index_put_((load_slots,), load_eids)
        self.state.index_put_((load_slots,), torch.full_like(load_slots, COMPUTE))
        self.tag.index_put_((load_slots,), self.next_tag + ar_m)
        self.last.index_put_((load_eids,), self.seq + 1 + ar_m)
        self.seq.add_(n_miss)
        self.next_tag.add_(n_miss)
        return self.lookup[base + flat], load_eids, load_slots, valid, wait_slots, wait_tags, late

    def release(self, layer: int) -> None:
        """This MoE ``layer``'s Compute slots -> Used (``SlotTable.release(layer)``; Fetch slots untouched)."""
        se, st = self.expert_in[:self.S], self.state[:self.S]
        mine = (st == COMPUTE) & (se >= layer * self.E) & (se < (layer + 1) * self.E)
        self.state[:self.S] = torch.where(mine, USED, st)

    def in_flight(self) -> list[int]:
        """The experts in Fetch slots, ascending (synchronises; for tests and reports)."""
        return sorted(e for e, s in zip(self.expert_in[:self.S].tolist(), self.state[:self.S].tolist())
                      if s == FETCH)
