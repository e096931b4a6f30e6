"""Runtime of the diffusion refresh planners (TIDE; DESIGN.md §5 "TIDE refresh planner"): per-layer device working
sets refreshed by a ``core.refresh.RefreshPlanner`` (reactive, tide-fixed, tide), asynchronous prefetch copies
through the ``TransferEngine``, and **host fallback**: a needed expert that is not on the device is computed where
its weights already are, in the host store, and only activations move, while the layer's device experts compute
(``runtime.host_fallback``).

Slots: MoE layer ``l`` owns pool slots ``[l * budget, (l + 1) * budget)``; ``pool.lookup`` maps the layer's landed
experts to them. A planner's asynchronous prefetch evicts its victims when the copies are issued (their slots take
the new experts), so a prefetch never needs memory beyond the budget; an expert whose copy has not landed is
computed on the host (TIDE: "if an expert is needed but not present, the system falls back to CPU computation").

Per diffusion step the block-diffusion loop (``generation.diffusion``) calls ``begin_diffusion_step(request, block,
step_in_block)``; per MoE layer the experts hook calls ``forward``, which lands finished copies, asks the planner
(``route``), runs blocking copies, computes the device pairs from the slots and the host pairs from the host store
with the same grouped-GEMM code (``runtime.experts.slot_pair_outputs``), and sums them per token.

On a CPU-only machine "device" and "host" are the same processor; ``host_seconds_per_token_expert`` /
``host_seconds_per_expert`` then emulate a slower host (``runtime.host_fallback``), as the copy engine's
``seconds_per_expert`` emulates the link (``runtime.transfer.make_transfer_engine``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.refresh import RefreshPlanner, Transfer
from ..errors import MoeOffloadError
from .emulated_clock import now
from .engine import EngineStats
from .experts import IMPLEMENTATION_NAME, device_index, register, slot_pair_outputs
from .fused_experts import fused_round, kernel_for, kernel_operands, sum_rounds
from .host_fallback import HostFallback
from .pool import SlotPool
from .route_rows import observed_routing
from .store import HostStore
from .transfer import TransferEngine


@dataclass
class RefreshStats(EngineStats):
    """``EngineStats`` (hits / misses count distinct experts per layer call: a hit is resident before any blocking
    copy) plus: ``host_experts`` / ``host_tokens`` computed on the host (fallback), ``device_tokens``,
    ``blocking_loads`` and ``prefetches`` (expert copies), ``fallback_s`` (host compute seconds, emulation
    included), ``steps`` (diffusion steps)."""

    host_experts: int = 0
    host_tokens: int = 0
    device_tokens: int = 0
    blocking_loads: int = 0
    prefetches: int = 0
    fallback_s: float = 0.0
    steps: int = 0


class RefreshEngine:
    """Executes a ``RefreshPlanner``'s decisions for one model (the engine the experts hook calls).

    Args:
        store: host store with all routed experts (``[L * E, numel]``).
        pool: device slot pool with ``L * budget`` slots.
        planner: the refresh planner (its ``budget`` experts per layer).
        num_moe_layers, num_experts: L and E.
        transfer: the copy engine (link emulation included); all copies, blocking ones too, go through it (blocking
            ones on the calling thread where its ``copy_now`` takes them: the emulated link, the disk tier).
        host_seconds_per_token_expert, host_seconds_per_expert: emulated host fallback cost (seconds, >= 0) on a
            machine without an accelerator; 0 = the real cost only.
        overlap_host: compute a layer's host experts while its device experts compute (default; the cost model
            must then say ``overlap_host`` too), or after them (the TIDE authors' reference order).
    Raises:
        MoeOffloadError: pool size is not ``L * budget`` or negative emulation costs.
    """

    def __init__(self, store: HostStore, pool: SlotPool, planner: RefreshPlanner, num_moe_layers: int,
                 num_experts: int, transfer: TransferEngine, host_seconds_per_token_expert: float = 0.0,
                 host_seconds_per_expert: float = 0.0, overlap_host: bool = True):
        if pool.num_slots != num_moe_layers * planner.budget:
            raise MoeOffloadError(f"the pool has {pool.num_slots} slots; the planner needs "
                                  f"{num_moe_layers} x {planner.budget}")
        if host_seconds_per_token_expert < 0 or host_seconds_per_expert < 0:
            raise MoeOffloadError("host fallback costs must be >= 0 seconds")
        self.store, self.pool, self.planner, self.transfer = store, pool, planner, transfer
        self.L, self.num_experts, self.budget = num_moe_layers, num_experts, planner.budget
        self.host = HostFallback(store, pool.format, host_seconds_per_token_expert, host_seconds_per_expert,
                                 overlap_host, self._accumulate)
        self.observers: list = []
        self.prefetcher = None  # interface parity with OffloadEngine (SeqMoE prefetching does not apply)
        self.table = None
        self.stats = RefreshStats()
        self._slot_of: dict[int, int] = {}   # global eid -> slot (landed or being copied)
        self._landed: dict[int, int] = {}    # global eid -> slot of landed experts (host mirror of pool.lookup)
        self._free = [list(range((l + 1) * self.budget - 1, l * self.budget - 1, -1)) for l in range(self.L)]
        self._step_t0: float | None = None
        self._block = (-1, -1)
        if self.budget == num_experts:  # FullLoad-sized: the planner starts with every expert resident
            for l in range(self.L):
                self._copy_now(l, list(range(num_experts)))
            self.stats = RefreshStats()

    # ---- wiring -------------------------------------------------------------------------------------------------

    def attach(self, experts_modules: list[torch.nn.Module]) -> None:
        """Route the given experts modules (in MoE-layer order) through this engine via ``ExpertsInterface``."""
        register()
        for layer, mod in enumerate(experts_modules):
            mod._moe_offload = (self, layer)
            mod.config._experts_implementation = IMPLEMENTATION_NAME

    def reset_stats(self) -> None:
        """Zero the engine's counters and the store's (``runtime.store.reset_store_stats``)."""
        from .store import reset_store_stats

        self.stats = RefreshStats()
        reset_store_stats(self.store)

    @property
    def policy_name(self) -> str:
        """The refresh planner's name (``tide-fixed-T<n>`` with its interval; for reports)."""
        return self.planner.name

    def begin_step(self, request: int, step: int) -> None:
        """Global step notification of the generation loops (observers only; the planner needs the block, see
        ``begin_diffusion_step``)."""
        for obs in self.observers:
            hook = getattr(obs, "begin_step", None)
            if hook is not None:
                hook(request, step)

    def begin_diffusion_step(self, request: int, block: int, step: int) -> None:
        """Diffusion step ``step`` of ``block`` of ``request`` begins: tell the planner (a new block first: every
        block starts at step 0, also when the same request and block numbers come again, e.g. a benchmark's
        warm-up and its timed run) and issue its asynchronous prefetches."""
        t = now()
        if self._step_t0 is not None:
            self.planner.end_step(t - self._step_t0)
        self._step_t0 = t
        if step == 0 or (request, block) != self._block:
            self._block = (request, block)
            self.planner.begin_block(request, block)
        self._land_ready()
        plan = self.planner.begin_step(step)
        self.stats.steps += 1
        if plan is not None:
            for tr in plan.transfers:
                self._apply(tr)

    def end_diffusion_step(self) -> None:
        """The diffusion step begun last finished: the planner gets its wall seconds (``RefreshPlanner.end_step``),
        so idle time between steps (another request's tokenisation, a benchmark's pause) is never counted."""
        if self._step_t0 is not None:
            self.planner.end_step(now() - self._step_t0)
            self._step_t0 = None

    def restart(self, planner: RefreshPlanner | None = None) -> None:
        """Start again cold with ``planner`` (a fresh planner of the same geometry and budget; default: a new one
        of the current planner's name and cost model, ``make_refresh_planner``), as a simulator replay starts:
        every expert leaves the device (copies in flight are cancelled or waited for), the counters are reset;
        with a FullLoad-sized budget every expert is loaded again (not counted).

        Raises:
            MoeOffloadError: a planner of another geometry or budget.
        """
        if planner is None:
            from ..core.refresh import make_refresh_planner

            planner = make_refresh_planner(self.planner.name, self.L, self.num_experts, self.budget,
                                           costs=getattr(self.planner, "costs", None))
        if (planner.num_layers, planner.num_experts, planner.budget) != (self.L, self.num_experts, self.budget):
            raise MoeOffloadError(f"restart with a {planner.num_layers}x{planner.num_experts} planner of budget "
                                  f"{planner.budget}; the engine has {self.L}x{self.num_experts}, budget {self.budget}")
        for g in list(self._slot_of):
            self._release(g // self.num_experts, g % self.num_experts)
        self.planner = planner
        self._step_t0 = None
        self._block = (-1, -1)
        if self.budget == self.num_experts:
            for l in range(self.L):
                self._copy_now(l, list(range(self.num_experts)))
        self.stats = RefreshStats()

    def close(self) -> None:
        """Stop the copy worker (which otherwise keeps the store and the pool alive) and unpin the host store."""
        self.transfer.close()
        self.store.close()

    # ---- copies -------------------------------------------------------------------------------------------------

    def _gid(self, layer: int, e: int) -> int:
        return layer * self.num_experts + int(e)

    def _set_lookup(self, g: int, slot: int) -> None:
        """Expert ``g`` is in ``slot`` (-1: nowhere) in the device lookup table and its host mirror ``_landed``
        (which the hot path reads instead of the device table: no synchronisation)."""
        self.pool.lookup[g] = slot
        if slot < 0:
            self._landed.pop(g, None)
        else:
            self._landed[g] = slot

    def _release(self, layer: int, e: int) -> None:
        g = self._gid(layer, e)
        slot = self._slot_of.pop(g, None)
        if slot is None:
            return
        if self.transfer.pending(g) and not self.transfer.cancel(g):
            self.transfer.wait(g)  # a copy in progress completes or stops at a chunk: never reuse its slot before it lands
        self._set_lookup(g, -1)
        self._free[layer].append(slot)

    def _take(self, layer: int, e: int) -> int:
        if not self._free[layer]:
            raise RuntimeError(f"MoE layer {layer}: no free slot for expert {e} (planner exceeded its budget)")
        slot = self._free[layer].pop()
        self._slot_of[self._gid(layer, e)] = slot
        return slot

    def _copy_now(self, layer: int, experts: list[int]) -> None:
        gids = [self._gid(layer, e) for e in experts]
        self._load_blocking(gids, [self._take(layer, e) for e in experts])

    def _load_blocking(self, gids: list[int], slots: list[int]) -> None:
        """Copy experts ``gids`` into pool ``slots`` before returning and point the lookup table at them: on this
        thread (a CPU pool's ``VirtualLinkEngine.copy_now``: at once, or once a prefetch yields the emulated link at
        a chunk; the disk tier's ``TransferEngine.copy_now``: at once with the store's readers, raising the store's
        error when a read fails), else through the ``TransferEngine``'s worker ahead of its queue."""
        if not self.transfer.copy_now(gids, slots):
            for g, slot in zip(gids, slots):
                self.transfer.submit(g, slot)
            for g in gids:
                got = self.transfer.wait(g)
                if got is None or not got.ok:
                    raise RuntimeError(f"copy of expert {g} failed: {got and got.error}")
        for g, slot in zip(gids, slots):
            self._set_lookup(g, slot)

    def _apply(self, tr: Transfer) -> None:
        for e in tr.evict:
            self._release(tr.layer, e)
        if tr.blocking:
            t0 = now()
            self.transfer.pause()  # on-demand / synchronous refresh copies go ahead of queued prefetches
            try:
                self._copy_now(tr.layer, tr.load)
            finally:
                self.transfer.resume()
            self.stats.load_time_s += now() - t0
            self.stats.blocking_loads += len(tr.load)
        else:
            for e in tr.load:
                g = self._gid(tr.layer, e)
                self.transfer.submit(g, self._take(tr.layer, e))
            self.stats.prefetches += len(tr.load)
        self.stats.bytes_loaded += len(tr.load) * self.store.layout.expert_bytes

    def _land_ready(self) -> None:
        by_layer: dict[int, list[int]] = {}
        for ld in self.transfer.poll():
            if not ld.ok or self._slot_of.get(ld.eid) != ld.slot:
                continue  # cancelled, or the expert was evicted again meanwhile
            self._set_lookup(ld.eid, ld.slot)
            by_layer.setdefault(ld.eid // self.num_experts, []).append(ld.eid % self.num_experts)
        for layer, es in by_layer.items():
            self.planner.land(layer, es)

    # ---- compute ------------------------------------------------------------------------------------------------

    def forward(self, module: torch.nn.Module, moe_layer: int, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Experts of MoE layer ``moe_layer``: ``hidden_states [T, H]``, ``top_k_index [T, k]`` int64,
        ``top_k_weights [T, k]`` -> ``[T, H]`` of ``hidden_states.dtype``; device pairs from the slots, the
        others on the host from the host store."""
        if self.observers:
            seen = observed_routing(module, top_k_index, top_k_weights)
            for obs in self.observers:
                obs(moe_layer, *seen)
        num_tokens, k = top_k_index.shape
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts).cpu().numpy()
        self._land_ready()
        dec = self.planner.route(moe_layer, counts)
        if dec.slot_plan is not None:  # reactive: on-demand loads in rounds of at most `budget` experts
            return self._forward_rounds(module, moe_layer, hidden_states, top_k_index, top_k_weights, dec,
                                        dec.slot_plan)
        st, host = self.stats, self.host
        self._count(dec)
        host.begin_layer()
        gid = (top_k_index + moe_layer * self.num_experts).reshape(-1)
        weights = top_k_weights.reshape(-1)
        pairs = self._pairs(module, hidden_states, k)
        staged = None
        if dec.rounds is not None:  # tide's on-demand swaps: copy, compute, reuse computed experts' slots
            flat = top_k_index.reshape(-1)
            st.rounds += len(dec.rounds)
            if dec.host:  # staged before the device work is launched (runtime.host_fallback)
                staged = host.stage(hidden_states, gid, weights, torch.isin(flat, device_index(dec.host, flat.device)),
                                    [self._gid(moe_layer, e) for e in dec.host], dec.host_tokens, len(dec.host))
            for rnd in dec.rounds:
                if rnd.load or rnd.evict:
                    t0 = now()
                    self._apply(Transfer(layer=moe_layer, load=rnd.load, evict=rnd.evict, blocking=True))
                    host.blocked(now() - t0)
                if rnd.compute:
                    host.device_starts()
                    mask = torch.isin(flat, device_index(rnd.compute, flat.device))
                    slots = sorted(self._landed[self._gid(moe_layer, e)] for e in rnd.compute)
                    self._accumulate(pairs, module, self.pool.rows, hidden_states, self.pool.lookup[gid], mask,
                                     weights, k, slots)
        else:
            if dec.transfer is not None:
                self._apply(dec.transfer)
            st.rounds += 1
            slot_ids = self.pool.lookup[gid]
            on_device = slot_ids >= 0
            used = [self._gid(moe_layer, e) for e in np.flatnonzero(counts)]
            dev_slots = sorted(self._landed[g] for g in used if g in self._landed)
            if len(dev_slots) < len(used):
                staged = host.stage(hidden_states, gid, weights, ~on_device, [g for g in used if g not in self._landed],
                                    dec.host_tokens, len(dec.host))
            if dev_slots:
                host.device_starts()
                self._accumulate(pairs, module, self.pool.rows, hidden_states, slot_ids, on_device, weights, k,
                                 dev_slots)
        if staged is not None:
            st.fallback_s += host.compute(pairs, module, staged)
        return self._sum(pairs, module, hidden_states, k)

    def _count(self, dec) -> None:
        st = self.stats
        st.hits += dec.hit_experts
        st.misses += len(dec.device) + len(dec.host) - dec.hit_experts
        st.layer_calls += 1
        st.host_experts += len(dec.host)
        st.host_tokens += dec.host_tokens
        st.device_tokens += dec.device_tokens

    def _forward_rounds(self, module, layer, hidden_states, top_k_index, top_k_weights, dec, plan) -> torch.Tensor:
        """Reactive planner: execute its per-layer ``SlotTable`` plan (``core.slots.LayerPlan``) round by round:
        load the round's misses on demand (blocking, through the link), compute the round's pairs on the device.
        Table slot ``s`` of MoE layer ``l`` is pool slot ``l * budget + s``."""
        self._count(dec)
        self.stats.rounds += len(plan.rounds)
        num_tokens, k = top_k_index.shape
        base = layer * self.budget
        gid = (top_k_index + layer * self.num_experts).reshape(-1)
        weights = top_k_weights.reshape(-1)
        pairs = self._pairs(module, hidden_states, k)
        for rnd in plan.rounds:
            if rnd.loads:
                t0 = now()
                for ld in rnd.loads:
                    if ld.evicted >= 0:
                        self._set_lookup(self._gid(layer, ld.evicted), -1)
                self._load_blocking([self._gid(layer, ld.eid) for ld in rnd.loads],
                                    [base + ld.slot for ld in rnd.loads])
                self.stats.load_time_s += now() - t0
                self.stats.blocking_loads += len(rnd.loads)
                self.stats.bytes_loaded += len(rnd.loads) * self.store.layout.expert_bytes
            in_round = torch.isin(top_k_index.reshape(-1), device_index(rnd.eids, gid.device))
            self._accumulate(pairs, module, self.pool.rows, hidden_states, self.pool.lookup[gid], in_round, weights,
                             k, sorted(base + s for s in rnd.slots))
        return self._sum(pairs, module, hidden_states, k)

    def _kernel(self, module, hidden_states):
        """The native kernel when it computes this layer's pairs (``runtime.fused_experts``; the host store's rows
        share the pool's format), else None."""
        return kernel_for(module, hidden_states.dtype, hidden_states.device)

    def _pairs(self, module, hidden_states, k: int) -> torch.Tensor:
        """A layer's zeroed pair outputs ``[T * k, H]``: float32 for the native kernel's pairs (added at the end
        by ``sum_rounds``, as FullLoad's one fused call adds them), else in the hidden states' dtype."""
        dtype = torch.float32 if self._kernel(module, hidden_states) is not None else hidden_states.dtype
        return torch.zeros(hidden_states.shape[0] * k, hidden_states.shape[-1], dtype=dtype,
                           device=hidden_states.device)

    def _sum(self, pairs, module, hidden_states, k: int) -> torch.Tensor:
        """The pairs added per token in routing order -> ``[T, H]`` in the hidden states' dtype."""
        kernel = self._kernel(module, hidden_states)
        if kernel is not None:
            return sum_rounds(kernel, pairs.view(hidden_states.shape[0], k, -1), hidden_states.dtype)
        return pairs.view(hidden_states.shape[0], k, -1).sum(dim=1).to(hidden_states.dtype)

    @staticmethod
    def _accumulate(pairs, module, source, hidden_states, rows, mask, weights, k, slots: list[int]) -> None:
        """Compute the pairs selected by ``mask`` (``rows``: their row in ``source``, an ``ExpertRows``; ``slots``:
        the sorted distinct rows they use, a host list) into ``pairs`` [T * k, H], without synchronising: with the
        native kernel where it serves the layer (float32 pairs), else the grouped GEMMs."""
        kernel = kernel_for(module, hidden_states.dtype, hidden_states.device)
        if kernel is not None:
            T = hidden_states.shape[0]
            operands, ids = kernel_operands(source, rows.masked_fill(~mask, -1).view(T, k), slots)
            fused_round(kernel, operands, hidden_states, ids, weights.view(T, k), pair_out=pairs.view(T, k, -1))
            return
        ids = rows.masked_fill(~mask, slots[-1] + 1)
        out, perm, valid = slot_pair_outputs(module, source, hidden_states, ids, weights, k, slots)
        pairs.index_copy_(0, perm, torch.where(valid.unsqueeze(-1), out.to(pairs.dtype), pairs[perm]))

