"""The offload engine: one MoE layer's experts, from router output to expert output (SeqMoE §4, fig. 5).

Per layer execution:
  1. the model's own router gives ``top_k_index [T, k]`` and ``top_k_weights [T, k]``;
  2. the slot table (``core.slots``) decides hits, misses, loads and evictions — in rounds when the layer needs
     more distinct experts than there are slots;
  3. the slot pool copies missed experts from the host store (on-demand load);
  4. ``runtime.experts.slot_pair_outputs`` computes every pair from the slots through the lookup table with one
     grouped GEMM per projection;
  5. the pairs' outputs are summed per token exactly as transformers does.
"""

from __future__ import annotations

from concurrent.futures import wait
from dataclasses import dataclass

import numpy as np
import torch

from ..core.slots import SlotTable
from ..errors import MoeOffloadError
from .breakdown import StepClock
from .cpu_account import CpuAccount, attach as attach_account, io
from .emulated_clock import now
from .experts import IMPLEMENTATION_NAME, device_index, register, slot_pair_outputs
from .fused_experts import fused_round, kernel_for, kernel_operands, sum_rounds
from .pool import SlotPool
from .read_overlap import ReadOverlap
from .route_rows import observed_routing
from .store import HostStore, reset_store_stats


@dataclass
class EngineStats:
    """Counters of one engine since the last reset.

    hits/misses: distinct experts per layer execution that were / were not resident before on-demand loading
    (SeqMoE's hit rate = hits / (hits + misses)); bytes_loaded: host->device bytes; load_time_s: seconds spent on
    on-demand copies (on CUDA: issuing them; they complete in stream order before the GEMM); layer_calls: MoE
    layer executions.
    """

    hits: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    load_time_s: float = 0.0
    layer_calls: int = 0
    rounds: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class OffloadEngine:
    """Runs the experts of every MoE layer of one model from a shared slot pool.

    Args:
        store: host store holding all routed experts.
        pool: device slot pool.
        table: slot table (with its eviction policy) deciding residency.
        num_experts: routed experts per MoE layer (E); expert ``e`` of MoE layer ``l`` has id ``l * E + e``.
    """

    def __init__(self, store: HostStore, pool: SlotPool, table: SlotTable, num_experts: int):
        self.store = store
        self.pool = pool
        self.table = table
        self.num_experts = num_experts
        self.stats = EngineStats()
        self.account = CpuAccount()  # decode-step CPU by thread and role (runtime.cpu_account)
        attach_account(store, self.account)
        self.clock = StepClock(self.account)  # decode-step time breakdown (runtime.breakdown)
        self._prefetch_outcomes = (0, 0)  # the table's (prefetches_used, prefetches_wasted) when last counted
        self.observers: list = []  # callables(moe_layer, top_k_index, top_k_weights), e.g. trace recorders
        self.prefetcher = None     # runtime.prefetcher.Prefetcher when prefetching (SeqMoE), else None
        self._cuda = pool.device.type == "cuda"
        self._overlap = ReadOverlap()  # misses read while the resident experts compute (runtime.read_overlap)

    def attach(self, experts_modules: list[torch.nn.Module]) -> None:
        """Route the given experts modules (in MoE-layer order) through this engine via ``ExpertsInterface``."""
        register()
        for layer, mod in enumerate(experts_modules):
            mod._moe_offload = (self, layer)
            mod.config._experts_implementation = IMPLEMENTATION_NAME

    @property
    def policy_name(self) -> str:
        """The eviction policy's name (for reports)."""
        return self.table.policy.name

    def begin_step(self, request: int, step: int) -> None:
        """Before each forward pass (step 0 = a request's prefill, i = its i-th decode step): tell the slot table
        and every observer that has a ``begin_step(request, step)`` method (e.g. a predictor runner)."""
        self._count_prefetch_outcomes()
        self.clock.begin_step(step >= 1)
        self.table.begin_step(request, step)
        if self.prefetcher is not None:
            self.prefetcher.begin_step(request, step)
        for obs in self.observers:
            hook = getattr(obs, "begin_step", None)
            if hook is not None:
                hook(request, step)
        self.clock.lap("management")

    def end_step(self) -> None:
        """After the last forward pass of a request (closes the decode-step timers)."""
        self._count_prefetch_outcomes()
        self.clock.end_step()

    def _count_prefetch_outcomes(self) -> None:
        """The prefetched experts the slot table found needed or evicted unneeded since the last call, as bytes of
        the step that ends (``runtime.cpu_account``; counted only when it is a decode step)."""
        seen = self._prefetch_outcomes
        now_seen = (self.table.prefetches_used, self.table.prefetches_wasted)
        nbytes = self.store.layout.expert_bytes
        self.account.add_bytes("prefetched_used", (now_seen[0] - seen[0]) * nbytes)
        self.account.add_bytes("prefetched_wasted", (now_seen[1] - seen[1]) * nbytes)
        self._prefetch_outcomes = now_seen

    @property
    def breakdown(self):
        """``runtime.breakdown.TimeBreakdown`` of the decode steps since the last ``reset_stats``."""
        return self.clock.result

    def reset_stats(self) -> None:
        """Zero the counters: the engine's, the clock's and the store's (a disk store's reads, a host cache's hits),
        so that every tier counts the same requests."""
        self.stats = EngineStats()
        self.clock.reset()
        reset_store_stats(self.store)

    def close(self) -> None:
        """Stop the read overlap's thread and the prefetcher's copy worker (which otherwise keeps the store and the
        pool alive), close the observers that have a ``close`` (a predictor worker process) and unpin the host
        store. The engine must not run afterwards."""
        self._overlap.close()  # first: a read in flight there finishes through the prefetcher
        if self.prefetcher is not None:
            self.prefetcher.close()
        for obs in self.observers:  # e.g. a predictor.lagged.LaggedFeed's worker process
            close = getattr(obs, "close", None)
            if close is not None:
                close()
        self.store.close()

    def _load(self, loads) -> None:
        if not loads:
            return
        t0 = now()
        with io(self, "on_demand_reads"):
            self.pool.load(self.store, [l.eid for l in loads], [l.slot for l in loads],
                           [l.evicted for l in loads if l.evicted >= 0])
        self.stats.load_time_s += now() - t0
        self.stats.bytes_loaded += len(loads) * self.store.layout.expert_bytes
        self.account.add_bytes("on_demand", len(loads) * self.store.layout.expert_bytes)

    def _needed(self, moe_layer: int, top_k_index: torch.Tensor) -> tuple[list[int], list[int]]:
        """The layer's distinct experts as global ids, ascending, and how many of the ``[T, k]`` routed pairs chose
        each (host lists), from one device->host copy of the expert ids.

        Raises:
            MoeOffloadError: an id outside ``[0, E)`` (it would read another layer's expert)."""
        E = self.num_experts
        if top_k_index.shape[0] == 1:  # one token (a decode step): host lists directly, no numpy round trip
            ids = sorted(top_k_index.reshape(-1).tolist())  # the one device->host transfer
            if ids and 0 <= ids[0] and ids[-1] < E and len(set(ids)) == len(ids):
                base = moe_layer * E
                return [i + base for i in ids], [1] * len(ids)
        local = top_k_index.reshape(-1).cpu().numpy()  # the one device->host transfer
        try:
            counts = np.bincount(local, minlength=E)
        except ValueError:  # a negative id
            counts = None
        if counts is None or counts.size > E:
            bad = int(local.min()) if counts is None else int(local.max())
            raise MoeOffloadError(f"MoE layer {moe_layer}: the router chose expert {bad}, outside [0, {E})")
        chosen = np.flatnonzero(counts)
        return (chosen + moe_layer * E).tolist(), counts[chosen].tolist()

    def forward(self, module: torch.nn.Module, moe_layer: int, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Experts of MoE layer ``moe_layer``: ``hidden_states [T, H]``, ``top_k_index [T, k]`` int64 expert ids
        of this layer, ``top_k_weights [T, k]`` -> ``[T, H]`` of ``hidden_states.dtype``.

        Host-device traffic on the hot path: one small device->host copy (the layer's ``T * k`` expert ids, which
        the slot table plans from); on-demand copies and index tensors go host->device without synchronising
        (stream order makes the copies land before the GEMM that reads them)."""
        clock = self.clock
        clock.lap("other_compute")
        if self.observers:  # without observers nothing is the predictor's, not even a lap's gap
            seen = observed_routing(module, top_k_index, top_k_weights)
            for obs in self.observers:
                obs(moe_layer, *seen)
            clock.lap("predictor")
        needed, counts = self._needed(moe_layer, top_k_index)
        pf = self.prefetcher
        if pf is not None:
            pf.land_ready()
            pf.settle(moe_layer, needed)
            plan = self.table.plan_layer(needed, counts, layer=moe_layer, hold=True)
        else:
            plan = self.table.plan_layer(needed, counts)
        st = self.stats
        st.hits += plan.hits
        st.misses += plan.misses
        st.layer_calls += 1
        st.rounds += len(plan.rounds)
        kernel = kernel_for(module, hidden_states.dtype, hidden_states.device)
        if (kernel is not None and len(plan.rounds) == 1 and top_k_index.shape[0] == 1
                and self._overlap.applies(plan.rounds[0], self.pool, self.store)):
            result = self._fused_overlapped(plan.rounds[0], kernel, moe_layer, top_k_index, hidden_states,
                                            top_k_weights)
        elif kernel is not None:
            result = self._fused_rounds(plan, kernel, moe_layer, top_k_index, hidden_states, top_k_weights)
        else:
            gid = (top_k_index + moe_layer * self.num_experts).reshape(-1)
            result = self._grouped_rounds(plan, module, moe_layer, gid, hidden_states, top_k_weights)
        if pf is not None:
            if len(plan.rounds) > 1:  # earlier rounds' slots are Used before they computed: issue only now
                pf.issue(moe_layer)
            self.table.release(moe_layer)
            clock.lap("management")
        return result

    def _deliver_forecasts(self) -> None:
        """The forecasts observers make once the layer is planned (a ``deliver()`` method: the cross-layer feed,
        ``predictor.cross_layer``, which delivers once per layer; ``core.forecast.triggered``), charged to the
        predictor. Called where the clock's last lap has just been taken: while a one-round layer's reads are in
        flight (``_fused_overlapped``), else once the first round's reads are in (``_load_round``: an error in a
        consumer then leaves no slot the table maps without its expert)."""
        delivered = False
        for obs in self.observers:
            deliver = getattr(obs, "deliver", None)
            if deliver is not None:
                deliver()
                delivered = True
        if delivered:
            self.clock.lap("predictor")

    def _fused_rounds(self, plan, kernel, moe_layer: int, top_k_index: torch.Tensor,
                      hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The plan's rounds through the native kernel (``runtime.fused_experts``): one call when the layer fits in
        one round; else each round's pairs written per pair and added in routing order at the end (the same float
        operations as one round). A pool format that needs decoding (FP8 blocks) has each round's slots decoded once
        (``runtime.fused_experts.kernel_operands``). (A one-token, one-round layer reading from the disk tier reads
        while its resident experts compute instead: ``_fused_overlapped``.)"""
        num_tokens, k = top_k_weights.shape
        pair_out = None if len(plan.rounds) == 1 else torch.zeros(num_tokens, k, hidden_states.shape[-1])
        layer_lookup = self.pool.lookup.view(-1, self.num_experts)[moe_layer]  # this layer's expert -> slot
        for rnd in plan.rounds:
            self._load_round(rnd, moe_layer, len(plan.rounds) == 1)
            slot_ids = layer_lookup[top_k_index]
            if pair_out is not None:  # pairs of experts outside this round are skipped (-1)
                local = device_index([e - moe_layer * self.num_experts for e in rnd.eids], top_k_index.device)
                slot_ids = slot_ids.masked_fill(~torch.isin(top_k_index, local), -1)
            weights, slot_ids = kernel_operands(self.pool.rows, slot_ids, rnd.slots)
            result = fused_round(kernel, weights, hidden_states, slot_ids, top_k_weights, pair_out)
            self.clock.lap("expert_compute")
        if pair_out is not None:
            result = sum_rounds(kernel, pair_out, hidden_states.dtype)
            self.clock.lap("expert_compute")
        return result

    def _fused_overlapped(self, rnd, kernel, moe_layer: int, top_k_index: torch.Tensor,
                          hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """A one-token, one-round layer whose misses come from the disk tier: the misses (and the prefetches in
        flight it waits for) are read on the overlap thread while the resident experts' pairs compute, then the late
        pairs compute and the pairs are added in routing order (``sum_rounds``: bit for bit one round's result;
        ``runtime.read_overlap``). Each pass's slots come from the plan (the table's ``slot_of`` for the hits, the
        round's loads and waits for the late ones), not from the lookup table the reads update. Between the early
        pairs and the wait for the reads, the cross-layer forecasts are made and handed over
        (``_deliver_forecasts``: the policy and the scheduler are not touched by the reads), in time the CPU would
        otherwise spend waiting."""
        clock, pf = self.clock, self.prefetcher
        base = moe_layer * self.num_experts
        late = {ld.eid - base: ld.slot for ld in rnd.loads} | {w.eid - base: w.slot for w in rnd.waits}
        slot_of, ids = self.table.slot_of, top_k_index.reshape(-1).tolist()
        early = [-1 if e in late else slot_of[base + e] for e in ids]
        pair_out = torch.zeros(1, len(ids), hidden_states.shape[-1])
        clock.lap("management")
        reads = self._overlap.start(self._read_round, rnd)
        try:
            views, slot_ids = kernel_operands(self.pool.rows, torch.tensor([early]), [s for s in early if s >= 0])
            fused_round(kernel, views, hidden_states, slot_ids, top_k_weights, pair_out)
            clock.lap("expert_compute")
            self._deliver_forecasts()  # while the reads are in flight: the CPU would otherwise wait for them
        except BaseException:
            wait([reads])  # the compute's error goes on, once the reads are over
            raise
        t0 = now()
        reads.result()  # the reads' error, if any
        clock.lap("stall")
        if pf is not None:  # the misses cost the step only the wait; the next copies overlap the late pairs
            pf.overlapped(now() - t0)
            pf.issue(moe_layer)
            clock.lap("management")
        views, slot_ids = kernel_operands(self.pool.rows, torch.tensor([[late.get(e, -1) for e in ids]]),
                                          list(late.values()))
        fused_round(kernel, views, hidden_states, slot_ids, top_k_weights, pair_out)
        result = sum_rounds(kernel, pair_out, hidden_states.dtype)
        clock.lap("expert_compute")
        return result

    def _grouped_rounds(self, plan, module, moe_layer: int, gid: torch.Tensor, hidden_states: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """The plan's rounds through the grouped GEMMs of ``runtime.experts`` (layers the native kernel does not
        serve, or no kernel)."""
        num_tokens, k = top_k_weights.shape
        weights = top_k_weights.reshape(-1)
        pairs = None
        for rnd in plan.rounds:
            self._load_round(rnd, moe_layer, len(plan.rounds) == 1)
            slot_ids = self.pool.lookup[gid]
            if len(plan.rounds) > 1:  # pairs of experts outside this round get a sentinel past every slot
                in_round = torch.isin(gid, device_index(rnd.eids, gid.device))
                slot_ids = slot_ids.masked_fill(~in_round, self.pool.num_slots)
            out, perm, valid = slot_pair_outputs(module, self.pool.rows, hidden_states, slot_ids, weights, k,
                                                 sorted(rnd.slots))
            if len(plan.rounds) == 1:  # undo the sort: row i of out is pair perm[i]
                pairs = torch.empty_like(out).index_copy_(0, perm, out)
            else:
                if pairs is None:
                    pairs = torch.zeros_like(out)
                pairs.index_copy_(0, perm, torch.where(valid.unsqueeze(-1), out, pairs[perm]))
            self.clock.lap("expert_compute")
        result = pairs.view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)
        self.clock.lap("expert_compute")
        return result

    def _load_round(self, rnd, moe_layer: int, only_round: bool) -> None:
        """Copy one round's missing experts into their slots (with a prefetcher: after the copies in flight that
        the round waits for), then hand over the layer's cross-layer forecasts (``_deliver_forecasts``; the first
        round delivers, later ones find nothing pending); when it is the layer's only round, the prefetcher's next
        copies are issued at once, to overlap this layer's compute."""
        clock, pf = self.clock, self.prefetcher
        clock.lap("management")
        self._read_round(rnd)
        clock.lap("stall")
        self._deliver_forecasts()
        if pf is not None and only_round:  # overlap the copies with this layer's compute
            pf.issue(moe_layer)
            clock.lap("management")

    def _read_round(self, rnd) -> None:
        """Bring one round's missing experts into their slots: the in-flight prefetches it waits for, then the
        on-demand copies (through the prefetcher when there is one); returns when all are in."""
        pf = self.prefetcher
        if pf is None:
            self._load(rnd.loads)
            return
        st = self.stats
        t0 = now()
        pf.fetch_waits(rnd.waits)
        pf.load_on_demand(rnd.loads)
        st.load_time_s += now() - t0
        st.bytes_loaded += len(rnd.loads) * self.store.layout.expert_bytes
        self.account.add_bytes("on_demand", len(rnd.loads) * self.store.layout.expert_bytes)
