"""Graph mode's experts engine: one MoE layer from router output to expert output with no data-dependent Python
control flow on the compiled path (SeqMoE §8.1-8.2; DESIGN.md §11 "Graph mode").

Per layer execution, inside the compiled (or captured) decode step:
  1. ``GraphCache.plan`` — lookup, miss detection, victim choice and the state update, fixed-shape tensor ops;
  2. ``moe_offload::slot_experts``, one kernel: first the on-demand copies of the missed experts from the host
     store into their victim slots, the rows its ``valid`` mask selects (SeqMoE §8.2's device-initiated miss
     loading; on the CPU a loop of row copies), then the grouped GEMM over the slot pool for the ``T * k`` pairs
     and the per-token sum, the arithmetic of ``runtime.experts`` (so the tokens equal FullLoad's).

2 is a ``torch.library`` custom op, opaque to the compiler (no graph break, as transformers' own
``grouped_mm_fallback`` under compilation); it reaches the engine through an integer handle. Its host time during
decode steps is accumulated per phase (``op_seconds``: ``stall`` for the copies, ``copy_overhead`` for the copy
bookkeeping, ``expert_compute`` for the GEMMs; the waits for in-flight experts count as ``stall``). One op rather
than two: each op call costs ~25 us of dispatch.

With prefetching (``runtime.graph.prefetch``) step 1 also lands finished copies and reserves slots for the worker's
requests (``FetchingGraphCache``), and step 2 is ``moe_offload::slot_experts_fetching``: the same op plus the
control-region exchange and the waits by tag, returning the region's snapshot for the next layer.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import torch

from ...errors import MoeOffloadError
from ..engine import EngineStats
from ..experts import IMPLEMENTATION_NAME, register, slot_pair_outputs
from ..fused_experts import DTYPES, fused_layout, fused_round, kernel_for, kernel_operands, pool_weights
from ..kernels.ops import native_ops
from .cache import GraphCache
from ..pool import SlotPool
from ..store import HostStore

_ENGINES: dict[int, "GraphEngine"] = {}
#: seconds a layer waits for an in-flight expert before it reports the prefetch worker stuck
WAIT_TIMEOUT_S = 60.0
_HANDLES = itertools.count(1)


@torch.library.custom_op("moe_offload::slot_experts", mutates_args=())
def slot_experts(handle: int, layer: int, hidden_states: torch.Tensor, slot_ids: torch.Tensor,
                 pair_weights: torch.Tensor, load_eids: torch.Tensor, load_slots: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """MoE ``layer``'s experts from the slot pool, after copying expert ``load_eids[j]`` from the host store into
    slot ``load_slots[j]`` for every ``valid[j]`` (``[M]`` int64, int64, bool): ``hidden_states [T, H]``,
    ``slot_ids [T * k]`` int64, ``pair_weights [T * k]`` -> ``[T, H]`` in ``hidden_states.dtype``."""
    eng = _ENGINES[handle]
    eng.copy_rows(load_eids, load_slots, valid)
    return eng.compute(layer, hidden_states, slot_ids, pair_weights)


@slot_experts.register_fake
def _slot_experts_fake(handle, layer, hidden_states, slot_ids, pair_weights, load_eids, load_slots, valid):
    return torch.empty_like(hidden_states)


@torch.library.custom_op("moe_offload::slot_experts_fetching", mutates_args=())
def slot_experts_fetching(handle: int, layer: int, hidden_states: torch.Tensor, slot_ids: torch.Tensor,
                          pair_weights: torch.Tensor, load_eids: torch.Tensor, load_slots: torch.Tensor,
                          valid: torch.Tensor, wait_slots: torch.Tensor, wait_valid: torch.Tensor,
                          grant_slots: torch.Tensor, grants: torch.Tensor,
                          taken: torch.Tensor, forecast: Optional[torch.Tensor],
                          predictor_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``slot_experts`` with prefetching (``runtime.graph.prefetch``): first the control-region exchange
    (``GraphPrefetcher.exchange``: position, grants ``[R]`` int64 into slots ``grant_slots [R]``, taken request
    entries ``taken [R]`` bool, a forecast ``[1 + c, n, e]`` made at this layer or None), then the waits until the
    worker has finished the copy granted to slot ``wait_slots[j]`` (``[E]`` int64, every ``wait_valid[j]``:
    in-flight experts the layer adopted), the on-demand copies and the experts. Returns ``(out [T, H], done_tag
    [S], requests [R])``: the output and the region's snapshot for the next layer."""
    eng = _ENGINES[handle]
    pf = eng.prefetcher
    pf.exchange(layer, grant_slots, grants, taken, forecast, predictor_index)
    eng.wait_fetches(wait_slots, wait_valid)
    eng.copy_rows(load_eids, load_slots, valid)
    out = eng.compute(layer, hidden_states, slot_ids, pair_weights)
    return (out, *pf.snapshot())


@slot_experts_fetching.register_fake
def _slot_experts_fetching_fake(handle, layer, hidden_states, slot_ids, pair_weights, load_eids, load_slots, valid,
                                wait_slots, wait_valid, grant_slots, grants, taken, forecast, predictor_index):
    c = _ENGINES[handle].cache
    return (torch.empty_like(hidden_states), grants.new_empty(c.S), grants.new_empty(c.R))


class GraphEngine:
    """The experts of every MoE layer from a shared slot pool, planned by a ``GraphCache`` (graph mode).

    Drop-in for ``OffloadEngine`` where ``generate`` and the reports use it (``attach``, ``begin_step``,
    ``end_step``, ``stats``, ``reset_stats``, ``close``, ``policy_name``, ``pool``, ``store``); no observers; a
    ``predictor`` (``graph.predictor.GraphPredictor``) runs inside the step, and a ``prefetcher``
    (``runtime.graph.prefetch.GraphPrefetcher``, with a ``FetchingGraphCache``) beside it.

    Args:
        store: the host store; pool: the device slot pool (its ``lookup`` is not used: ``cache.lookup`` is);
        cache: the device-side slot table; num_experts: E per MoE layer; policy_name: for reports.
    """

    def __init__(self, store: HostStore, pool: SlotPool, cache: GraphCache, num_experts: int, policy_name: str):
        self.store, self.pool, self.cache = store, pool, cache
        self.num_experts = num_experts
        self._policy_name = policy_name
        self.modules: list[torch.nn.Module] = []
        self._views: dict[str, torch.Tensor] = {}  # field -> [S, *shape] compute view of the whole pool
        self.prefetcher = None  # runtime.graph.prefetch.GraphPrefetcher: a CPU worker and the control region
        self.observers: list = []
        self.predictor = None  # graph.predictor.GraphPredictor: forecasts inside the step
        self.lookup_only = False  # set_lookup_only: no cache decisions in the step (the A/B baseline)
        self.preloaded = False  # preload_all: every expert in the slot of its global id
        self._direct: list[bool] = []  # lookup-only: per MoE layer, the kernel's operator called from the graph
        self._direct_views = None  # (gate_up [S, 2I, H], down [S, H, I]) views of the pool for those calls
        dev = cache.lookup.device
        self._no_copy = (torch.zeros(0, dtype=torch.long, device=dev),) * 2 + (torch.zeros(0, dtype=torch.bool,
                                                                                          device=dev),)
        self.handle = next(_HANDLES)
        _ENGINES[self.handle] = self
        self._cuda = pool.device.type == "cuda"
        self.reset_stats()

    @property
    def policy_name(self) -> str:
        return self._policy_name

    def attach(self, experts_modules: list[torch.nn.Module]) -> None:
        """Route the experts modules (MoE-layer order) through this engine via ``ExpertsInterface``."""
        register()
        self.modules = list(experts_modules)
        for layer, mod in enumerate(self.modules):
            mod._moe_offload = (self, layer)
            mod.config._experts_implementation = IMPLEMENTATION_NAME

    def begin_step(self, request: int, step: int) -> None:
        """Before each forward pass (step 0: a request's prefill)."""
        self.cache.begin_step(request, step)
        if self.predictor is not None:
            self.predictor.begin_step(request, step)
        if self.prefetcher is not None:
            self.prefetcher.begin_step(request, step)
        self._decoding = step >= 1

    def end_step(self) -> None:
        """After a request's last forward pass (nothing to close: no lap timers in graph mode)."""

    @property
    def stats(self) -> EngineStats:
        """Counters since ``reset_stats`` (reads the device hit/miss counters: synchronises)."""
        s = self._stats
        s.hits, s.misses = int(self.cache.hits), int(self.cache.misses)
        return s

    def reset_stats(self) -> None:
        self._stats = EngineStats()
        self.cache.reset_counters()
        self.op_seconds = {"stall": 0.0, "copy_overhead": 0.0, "expert_compute": 0.0}
        self._decoding = False

    def close(self) -> None:
        """Stop the prefetch worker, forget the engine's handle and unpin the host store; the engine must not run
        afterwards."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        _ENGINES.pop(self.handle, None)
        self.store.close()

    def preload_all(self) -> None:
        """Copy every expert into the slot of its global id (the plan then finds every expert resident) and allow
        ``set_lookup_only``. For ``bench graph``'s A/B measurement of the cache decisions; hit and miss counters
        are left as they were.

        Raises:
            MoeOffloadError: fewer slots than experts (residency below 1.0).
        """
        c = self.cache
        if c.S < c.N:
            raise MoeOffloadError(f"preload_all needs a slot for every expert ({c.N}), the pool has {c.S}")
        ids = torch.arange(c.N, dtype=torch.long, device=c.lookup.device)
        self.copy_rows(ids, ids, torch.ones(c.N, dtype=torch.bool))
        c.expert_in[:c.S] = -1
        c.lookup[:c.N] = ids
        c.expert_in[:c.N] = ids
        self.preloaded = True
        views = pool_weights(self.pool.rows) if self.pool.device.type == "cpu" else None
        ok = views is not None and views[0].dtype in DTYPES and native_ops() is not None
        self._direct = [ok and fused_layout(m) for m in self.modules]
        self._direct_views = views if ok else None

    def set_lookup_only(self, on: bool) -> None:
        """Turn the step's cache decisions off (``on``) or back on. Off, a layer only gathers its pairs' slots from
        the lookup table and counts them as hits (``GraphCache.count_resident``): the same step without
        ``GraphCache.plan`` (a compiled step specialises on this flag, so one decoder holds both graphs, over the
        same weights, pool and KV cache). A layer the native kernel serves then calls its operator
        (``torch.ops.moe_offload_native.routed_experts``) on the pool's views directly, as compiled FullLoad does on
        its parameters: no Python op in between, hence no ``op_seconds`` timing and no ``layer_calls`` count for
        it. ``graph.decode.load_graph`` turns lookup-only on when the pool holds every expert.

        Raises:
            MoeOffloadError: ``on`` before ``preload_all``.
        """
        if on and not self.preloaded:
            raise MoeOffloadError("lookup-only decode needs every expert resident: call preload_all first")
        self.lookup_only = bool(on)

    # ---- the layer (traced by torch.compile) ----------------------------------------------------------------

    def forward(self, module: torch.nn.Module, moe_layer: int, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Experts of MoE layer ``moe_layer``: ``hidden_states [T, H]``, ``top_k_index [T, k]`` int64 ids of this
        layer, ``top_k_weights [T, k]`` -> ``[T, H]`` of ``hidden_states.dtype``. No host synchronisation and no
        data-dependent control flow outside the custom op."""
        pf = self.prefetcher
        if pf is not None:
            return self._forward_fetching(pf, moe_layer, hidden_states, top_k_index, top_k_weights)
        if self.predictor is not None:  # its forecast sets the scores before this layer is planned
            self.predictor.observe(moe_layer, top_k_index, top_k_weights)
        if self.lookup_only:  # every expert resident (preload_all): the slots are a gather, nothing decided
            slot_ids = self.cache.lookup[moe_layer * self.num_experts + top_k_index.reshape(-1)]
            self.cache.count_resident(top_k_index)
            views = self._direct_views
            if views is not None and self._direct[moe_layer] and hidden_states.dtype == views[0].dtype:
                # the kernel's own operator, no Python in between (no op_seconds timing nor layer_calls count)
                return torch.ops.moe_offload_native.routed_experts(hidden_states, slot_ids.view(top_k_index.shape),
                                                                   top_k_weights, *views)
            eids, slots, valid = self._no_copy
        else:
            slot_ids, eids, slots, valid = self.cache.plan(moe_layer, top_k_index)
        return torch.ops.moe_offload.slot_experts(self.handle, moe_layer, hidden_states, slot_ids,
                                                  top_k_weights.reshape(-1), eids, slots, valid)

    def _forward_fetching(self, pf, moe_layer: int, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """``forward`` with prefetching (``runtime.graph.prefetch``): land, forecast, plan (the layer's experts stay
        in Compute while the requests get their slots), reserve, release; the op does the rest."""
        requests = pf.land(moe_layer)
        forecast, index = None, -1
        if self.predictor is not None:
            self.predictor.fresh = -1
            self.predictor.observe(moe_layer, top_k_index, top_k_weights)
            if self.predictor.fresh >= 0:
                index = self.predictor.fresh
                forecast = self.predictor.probs[index]
        # the op waits for an adopted slot's copy by the tag of the slot's grant, which it reads from the region
        # (an adopted slot's latest grant is the reservation it adopted), so the plan's wait tags are not passed
        slot_ids, eids, slots, valid, wait_slots, _, wait_valid = self.cache.plan(moe_layer, top_k_index)
        grants = pf.reserve(moe_layer, requests)
        out, done, requests = torch.ops.moe_offload.slot_experts_fetching(
            self.handle, moe_layer, hidden_states, slot_ids, top_k_weights.reshape(-1), eids, slots, valid,
            wait_slots, wait_valid, *grants, forecast, index)
        pf.carry = (done, requests)
        return out

    # ---- the ops' eager bodies ------------------------------------------------------------------------------

    def wait_fetches(self, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """The op's waits: until the prefetch worker returns the tag granted to slot ``slots[j]`` (valid entries:
        the Fetch slots of adopted experts, SlotTable's ``waits``; an adopted slot's latest grant is the
        reservation it adopted). Raises RuntimeError if the worker has died or has not returned it within
        ``WAIT_TIMEOUT_S``."""
        if not bool(valid.any()):
            return
        t0 = time.perf_counter()
        pf = self.prefetcher
        done = pf.ctrl.done_tag.numpy()
        for s in slots[valid].tolist():
            t = pf.granted_tag(s)
            give_up = time.perf_counter() + WAIT_TIMEOUT_S
            while done[s] < t:
                pf.check()
                if time.perf_counter() > give_up:
                    raise RuntimeError(f"the graph-mode prefetch worker did not finish the copy tagged {t} into slot "
                                       f"{s} within {WAIT_TIMEOUT_S:.0f} s")
                time.sleep(0)
        pf.waited += int(valid.sum())
        if self._decoding:
            self.op_seconds["stall"] += time.perf_counter() - t0

    def copy_rows(self, eids: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """The op's copies: host store -> slot for the valid entries (prefetch copies paused meanwhile)."""
        t0 = time.perf_counter()
        # on the CPU through numpy: a torch reduction costs ~10 us of dispatch per layer (0.3 ms per decode step)
        n = int(valid.numpy().sum()) if valid.device.type == "cpu" else int(valid.sum())
        if not n:  # most decode layers: nothing to copy (no slicing, no lists)
            if self._decoding:
                self.op_seconds["copy_overhead"] += time.perf_counter() - t0
            return
        t1 = time.perf_counter()
        pool, dst = self.pool, self.pool._bytes
        pause = self.prefetcher.ctrl.pause if self.prefetcher is not None else None
        if pause is not None:
            pause.fill_(1)
        try:
            for e, s in zip(eids[:n].tolist(), slots[:n].tolist()):
                self.store.copy_to(e, dst[s] if dst is not None else pool.buf[s], non_blocking=self._cuda)
        finally:
            if pause is not None:
                pause.fill_(0)
        st = self._stats
        st.bytes_loaded += n * self.store.layout.expert_bytes
        t2 = time.perf_counter()
        st.load_time_s += t2 - t1
        if self._decoding:
            self.op_seconds["stall"] += t2 - t1
            self.op_seconds["copy_overhead"] += time.perf_counter() - t2 + t1 - t0

    def compute(self, layer: int, hidden_states: torch.Tensor, slot_ids: torch.Tensor,
                pair_weights: torch.Tensor) -> torch.Tensor:
        """The op's GEMMs. A layer the native kernel serves: the kernel (``runtime.fused_experts``). One token
        (decode) on a CPU pool with a zero-copy format: ``_one_token``. Otherwise
        ``runtime.experts.slot_pair_outputs`` over the pairs' slots (prefill, decoded formats, CUDA), the pairs
        put back in router order and summed per token, as ``OffloadEngine.forward`` (and transformers) do."""
        t0 = time.perf_counter()
        num_tokens = hidden_states.shape[0]
        k = slot_ids.numel() // num_tokens
        module, rows = self.modules[layer], self.pool.rows
        kernel = kernel_for(module, hidden_states.dtype, hidden_states.device)
        if kernel is not None:  # the native kernel (runtime.fused_experts), as the eager engine and FullLoad run it
            operands, ids = kernel_operands(rows, slot_ids.view(num_tokens, k))
            result = fused_round(kernel, operands, hidden_states, ids, pair_weights.view(num_tokens, k))
            self._count(t0)
            return result
        sid = slot_ids.tolist()
        if num_tokens == 1 and rows.zero_copy and not self._cuda:
            out = self._one_token(module, hidden_states, sid, pair_weights)
        else:
            out, perm, _ = slot_pair_outputs(module, rows, hidden_states, slot_ids, pair_weights, k, sorted(set(sid)))
            out = torch.empty_like(out).index_copy_(0, perm, out)
        result = out.view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)
        self._count(t0)
        return result

    def _count(self, t0: float) -> None:
        """One layer's experts computed (since ``t0``, ``time.perf_counter``)."""
        self._stats.layer_calls += 1
        self._stats.rounds += 1
        if self._decoding:
            self.op_seconds["expert_compute"] += time.perf_counter() - t0

    def _one_token(self, module, x: torch.Tensor, sid: list[int], pair_weights: torch.Tensor) -> torch.Tensor:
        """``x [1, H]`` through the ``k`` distinct slots ``sid``: one ``mm`` per pair and projection on views of
        the pool (the per-group GEMM of transformers' grouped GEMM, whose groups here hold one row each), the gate
        on all pairs at once, the router weights -> ``[k, H]`` weighted outputs in router order."""
        up_name = "gate_up_proj" if module.has_gate else "up_proj"
        h = self._pair_linear(module, x, up_name, sid, shared_input=True)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        h = self._pair_linear(module, h, "down_proj", sid, shared_input=False)
        if module.has_post_expert_norm:
            h = module.post_expert_norm(h)
        return h * pair_weights.unsqueeze(-1)

    def _pair_linear(self, module, x, name: str, sid: list[int], shared_input: bool) -> torch.Tensor:
        """Row ``j`` of the result: ``x`` (or its row ``j``) through slot ``sid[j]``'s ``name`` (+ its bias)."""
        w = self._views.get(name)
        if w is None:
            w = self._views[name] = self.pool.rows.weight(name, slice(None))  # [S, *shape] view of the pool
        x = x.to(w.dtype)
        if module.is_transposed:
            rows = [torch.mm(x if shared_input else x[j:j + 1], w[s]) for j, s in enumerate(sid)]
        else:
            rows = [torch.mm(x if shared_input else x[j:j + 1], w[s].transpose(0, 1)) for j, s in enumerate(sid)]
        out = torch.cat(rows)  # (mm into fresh tensors: ~40% faster than mm(..., out=row) for one-row GEMMs)
        if module.has_bias:
            out.add_(self.pool.rows.weight(name + "_bias", torch.tensor(sid, dtype=torch.long)))
        return out
