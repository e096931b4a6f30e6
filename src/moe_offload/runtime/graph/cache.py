"""The slot table as device tensors: one MoE layer's lookup, miss detection and victim choice in fixed-shape tensor
ops (SeqMoE §8.1-8.2, DESIGN.md §11 "Graph mode").

``core.slots.SlotTable`` plans a layer in Python from the router's expert ids (a host synchronisation per layer on a
GPU). ``GraphCache`` keeps the same state on the device — the lookup table, the expert in each slot, and the
policy's per-expert keys — and plans a layer with tensor ops whose shapes depend only on ``T * k`` and the model,
never on the data, so ``torch.compile(fullgraph=True)`` compiles it without graph breaks and a CUDA graph can
capture it. It makes exactly the decisions ``SlotTable.plan_layer`` makes with ``LRU``, ``LFU`` and
``ProbabilisticBelady`` (``tests/test_graph_cache.py`` replays random traces through both and compares hits,
misses, evicted experts, destination slots and slot contents after every layer):

* needed experts are a mask over the layer's ``E`` experts, so they come in ascending id order, as the table
  sorts them;
* policy accesses (``on_access``) happen for all needed experts in ascending order before any load: LRU and
  probabilistic Belady stamp the resident ones with the next values of one counter (``last``), LFU counts and
  stamps every needed expert;
* the ``j``-th missed expert (ascending id) goes to the ``j``-th candidate slot: first the Empty slots by
  ascending index (``SlotTable._take_slot``), then the Used slots in the policy's victim order — LRU: oldest
  stamp; LFU: (count, stamp, id); probabilistic Belady: (CacheScore, stamp, id). Needed resident experts are
  pinned (Compute) and never candidates. The victim order of the remaining slots does not change while a layer
  loads (an inserted expert is pinned, an evicted one leaves), so taking the first ``n_miss`` candidates equals
  the table's one-victim-at-a-time loop;
* inserted experts get the next stamps (LRU appends at the end, probabilistic Belady stamps ``on_insert``); an
  evicted expert's stamp is cleared for probabilistic Belady (``on_evict``).

Scope (each refused with a one-line error by ``check_graph_policy``): the policies above only (``lfru`` needs a
log-space float key per access and ``prefill-hot`` a top-N over prefill counts at the first decode step; both are
expressible but not built); and at least ``E`` slots, so that every layer fits in one round (``plan_layer``'s
rounds when a layer needs more distinct experts than there are slots are data-dependent).
Prefetching (``seqmoe``) adds the Fetch and Compute states: ``runtime.graph.fetch_cache.FetchingGraphCache``.

Ties: LRU and probabilistic-Belady stamps are distinct among resident experts, and so are LFU stamps when every
resident expert was accessed (always true without prefetching), so the id tie-breaks of the policies never
decide here. CacheScore is computed by ``scores_from_forecast`` in float64 in torch (the Python policy uses numpy's
``tensordot``): the two can differ in the last bit, so a decision can differ only between two experts whose
scores are within one rounding of each other and not equal.
"""

from __future__ import annotations

import torch

from ...core.policy_spec import GRAPH, PolicySpec, parse_policy
from ...errors import MoeOffloadError

#: the eviction kinds graph mode runs as tensor ops
KINDS = ("lru", "lfu", "prob-belady")
_INT_MAX = torch.iinfo(torch.int64).max
#: LFU key = count * 2**LFU_SHIFT + stamp (stamps stay below 2**40: ~1e12 accesses)
LFU_SHIFT = 40


def check_graph_policy(policy: PolicySpec | str, num_slots: int, experts_per_layer: int) -> str:
    """The graph-mode eviction kind (``lru``, ``lfu``, ``prob-belady``: a forecast-driven policy) of ``policy`` (a
    ``core.policy_spec.PolicySpec``; a name is parsed).

    Raises:
        MoeOffloadError: a policy graph mode does not reproduce (``PolicySpec.graph``), or fewer slots than one
            layer's experts.
    """
    spec = parse_policy(policy)
    if not spec.graph:
        raise MoeOffloadError(f"--graph supports the policies {', '.join(GRAPH)}, not {spec.name!r} (prefetching and "
                              "the other policies run without --graph)")
    kind = "prob-belady" if spec.forecast_driven else spec.family
    if num_slots < experts_per_layer:
        raise MoeOffloadError(f"--graph needs at least one MoE layer's experts in slots ({experts_per_layer}), "
                              f"got {num_slots}")
    return kind


def scores_from_forecast(probs: torch.Tensor, horizon: int, lam: float) -> torch.Tensor:
    """CacheScore (SeqMoE §7.1) of a forecast: ``probs [R, n, e]`` (row j = step i + j) -> float64 ``[n, e]``,
    ``sum_{j < min(R, c)} lam^j probs[j] / sum_j lam^j`` (``core.prob_belady.ProbabilisticBelady.update_forecast``).
    Fixed shapes: ``R`` is static."""
    rows = min(probs.shape[0], horizon)
    w = torch.tensor([lam ** j for j in range(rows)], dtype=torch.float64, device=probs.device)
    w = w / w.sum()
    return torch.tensordot(w, probs[:rows].to(torch.float64), dims=1)


class GraphCache:
    """Device-resident slot table + eviction policy state, planned with fixed-shape tensor ops (SeqMoE §8.2).

    Args:
        num_slots: S (>= ``experts_per_layer``).
        experts_per_layer: E, routed experts per MoE layer (global id = ``layer * E + expert``).
        num_moe_layers: L (N = L * E experts in all).
        policy: the eviction kind, ``lru``, ``lfu`` or ``prob-belady`` (``KINDS``; ``check_graph_policy`` gives a
            policy's).
        device: where the state lives.
        horizon, lam, no_forecast_score: probabilistic Belady's c, lambda and score without a forecast.

    State (int64 unless said; index N resp. S is a scratch entry that masked writes go to, never read):
        lookup ``[N + 1]``: slot of each expert or -1; expert_in ``[S + 1]``: expert in each slot or -1;
        last ``[N + 1]``: the policy's recency stamp; freq ``[N + 1]``: LFU access counts; score ``[N + 1]``
        float64: CacheScore; seq ``[]``: the stamp counter; hits, misses ``[]``: SeqMoE's hit accounting
        (needed experts resident / not resident before loading, per layer execution).

    Raises:
        MoeOffloadError: an unknown kind, or fewer slots than one layer's experts.
    """

    def __init__(self, num_slots: int, experts_per_layer: int, num_moe_layers: int, policy: str,
                 device: torch.device | str = "cpu", horizon: int = 8, lam: float = 0.5,
                 no_forecast_score: float = 0.0):
        kind = policy
        if kind not in KINDS:
            raise MoeOffloadError(f"unknown graph-mode eviction kind {policy!r}; choose one of: {', '.join(KINDS)}")
        if num_slots < experts_per_layer:
            raise MoeOffloadError(f"--graph needs at least one MoE layer's experts in slots ({experts_per_layer}), "
                                  f"got {num_slots}")
        self.kind, self.S, self.E, self.L = kind, num_slots, experts_per_layer, num_moe_layers
        self.N = n = num_moe_layers * experts_per_layer
        self.horizon, self.lam, self.no_forecast_score = horizon, lam, float(no_forecast_score)
        dev = torch.device(device)
        i64 = dict(dtype=torch.long, device=dev)
        self.lookup = torch.full((n + 1,), -1, **i64)
        self.expert_in = torch.full((num_slots + 1,), -1, **i64)
        self.last = torch.zeros(n + 1, **i64)
        self.freq = torch.zeros(n + 1, **i64)
        self.score = torch.full((n + 1,), self.no_forecast_score, dtype=torch.float64, device=dev)
        self.seq = torch.zeros((), **i64)
        self.hits = torch.zeros((), **i64)
        self.misses = torch.zeros((), **i64)
        self._slot_ar = torch.arange(num_slots, **i64)
        self._e_ar = torch.arange(experts_per_layer, **i64)
        self._tril = torch.ones(experts_per_layer, experts_per_layer, dtype=torch.bool, device=dev).tril()

    # ---- per request / per forecast (outside the hot path or fixed-shape) ----------------------------------

    def begin_step(self, request: int, step: int) -> None:
        """A forward pass begins (step 0 = prefill): probabilistic Belady forgets all forecasts
        (``ProbabilisticBelady.on_step``)."""
        if step == 0 and self.kind == "prob-belady":
            self.score.fill_(self.no_forecast_score)

    def update_forecast(self, layers: tuple[int, int], probs: torch.Tensor) -> None:
        """Replace the CacheScores of MoE layers ``l <= p < l'`` from ``probs [R, l' - l, E]`` (``[b, R, n, E]``
        is averaged over b) — in place, fixed shapes (capturable)."""
        lo, hi = layers
        if probs.dim() == 4:
            probs = probs.mean(dim=0)
        self.score[lo * self.E:hi * self.E].copy_(scores_from_forecast(probs, self.horizon, self.lam).reshape(-1))

    def reset_counters(self) -> None:
        """Zero the hit and miss counters."""
        self.hits.zero_()
        self.misses.zero_()

    # ---- the layer plan (fixed shapes) ------------------------------------------------------------------------

    def plan(self, layer: int, top_k_index: torch.Tensor):
        """Plan one execution of MoE layer ``layer`` and apply it to the state (``SlotTable.plan_layer``).

        Args:
            layer: MoE layer index (a Python int: one specialisation per layer under compilation).
            top_k_index: ``[T, k]`` int64 expert ids in ``[0, E)`` (the router's choice).
        Returns:
            ``(slot_ids, load_eids, load_slots, valid)``: ``slot_ids [T * k]`` int64 slot of each pair after the
            loads; ``load_eids [M]``, ``load_slots [M]`` int64 the on-demand copies (expert -> slot) in order,
            ``valid [M]`` bool which of them are real (the first ``n_miss``; the others point at the scratch
            entries N and S), ``M = min(T * k, E)``.
        """
        E, S, base = self.E, self.S, layer * self.E
        flat = top_k_index.reshape(-1)
        m = min(flat.numel(), E)
        need = torch.zeros(E, dtype=torch.bool, device=flat.device).scatter_(0, flat, True)
        lk = self.lookup[base:base + E]
        hit, miss = need & (lk >= 0), need & (lk < 0)
        n_miss = miss.sum()
        self.hits.add_(hit.sum())
        self.misses.add_(n_miss)
        self._access(base, need, hit)
        picks = self._victims(base, need, m)
        # the j-th miss (ascending id) -> the j-th candidate
        rank = torch.where(miss, self._prefix(miss) - 1, m)
        load_eids = torch.full((m + 1,), self.N, dtype=torch.long, device=flat.device)
        load_eids = load_eids.scatter(0, rank, self._e_ar + base)[:m]
        valid = torch.arange(m, device=flat.device) < n_miss
        load_slots = torch.where(valid, picks, S)
        evicted = self.expert_in[load_slots]
        evicted = torch.where(valid & (evicted >= 0), evicted, self.N)
        self.lookup.index_put_((evicted,), torch.full_like(evicted, -1))
        if self.kind == "prob-belady":  # on_evict forgets the stamp
            self.last.index_put_((evicted,), torch.zeros_like(evicted))
        self.lookup.index_put_((load_eids,), load_slots)
        self.expert_in.index_put_((load_slots,), load_eids)
        if self.kind != "lfu":  # on_insert: the next stamps, in load order
            self.last.index_put_((load_eids,), self.seq + 1 + torch.arange(m, device=flat.device))
            self.seq.add_(n_miss)
        return self.lookup[base + flat], load_eids, load_slots, valid

    def count_resident(self, top_k_index: torch.Tensor) -> None:
        """Count one layer execution whose every expert is resident (every expert preloaded, no decisions made:
        ``GraphEngine.set_lookup_only``): its distinct experts are hits, as ``plan`` counts them. ``top_k_index
        [T, k]`` int64; one token's ``k`` ids are distinct (a top-k), so a decode step adds the constant ``k``."""
        num_tokens, k = top_k_index.shape
        if num_tokens == 1:
            self.hits.add_(k)
            return
        need = torch.zeros(self.E, dtype=torch.bool, device=top_k_index.device)
        self.hits.add_(need.scatter_(0, top_k_index.reshape(-1), True).sum())

    def _prefix(self, mask: torch.Tensor) -> torch.Tensor:
        """Inclusive prefix count of a bool ``[E]`` mask as int64 ``[E]`` (a masked row sum over a lower triangle:
        fuses with its neighbours, where ``cumsum`` is a separate library call)."""
        return (self._tril & mask.unsqueeze(0)).sum(dim=1)

    def _access(self, base: int, need: torch.Tensor, hit: torch.Tensor) -> None:
        """``on_access`` of every needed expert, ascending: LRU / prob-Belady stamp resident ones, LFU counts and
        stamps all."""
        acc = need if self.kind == "lfu" else hit
        stamps = self.seq + self._prefix(acc)
        sl = slice(base, base + self.E)
        self.last[sl] = torch.where(acc, stamps, self.last[sl])
        if self.kind == "lfu":
            self.freq[sl] += need
        self.seq.add_(acc.sum())

    def _victims(self, base: int, need: torch.Tensor, m: int) -> torch.Tensor:
        """The first ``m`` candidate slots in allocation order: Empty by index, then Used by the policy's victim
        order; needed resident experts' slots are pinned (never candidates unless fewer than m remain, and then
        only after every real candidate, where they are never used: ``n_miss <= S - hits``)."""
        se = self.expert_in[:self.S]
        occupied = se >= 0
        e = se.clamp(min=0)
        local = (e - base).clamp(0, self.E - 1)
        pinned = occupied & (e >= base) & (e < base + self.E) & need[local]
        empty_key = self._slot_ar - self.S  # negative: before any stamp, by slot index
        if self.kind == "prob-belady":
            return self._victims_scored(occupied, pinned, self.score[e], self.last[e], empty_key, m)
        used_key = self.last[e] if self.kind == "lru" else self.freq[e] * (1 << LFU_SHIFT) + self.last[e]
        key = torch.where(occupied, torch.where(pinned, _INT_MAX, used_key), empty_key)
        return torch.topk(key, m, largest=False, sorted=True).indices

    def _victims_scored(self, occupied, pinned, score, last, empty_key, m: int) -> torch.Tensor:
        """Candidates by (class, CacheScore, stamp): ``m`` rounds of a masked minimum (fixed shapes)."""
        primary = torch.where(occupied, score, -torch.inf)
        secondary = torch.where(occupied, last, empty_key)
        avail = ~pinned
        picks = []
        for _ in range(m):
            p = torch.where(avail, primary, torch.inf)
            tie = avail & (p == p.min())
            pick = torch.argmin(torch.where(tie, secondary, _INT_MAX))
            picks.append(pick)
            avail = avail & (self._slot_ar != pick)
        return torch.stack(picks)

    # ---- inspection -----------------------------------------------------------------------------------------

    def slots_of(self) -> list[int]:
        """The expert in each slot (-1: Empty), as a host list (synchronises; for tests and reports)."""
        return self.expert_in[:self.S].tolist()
