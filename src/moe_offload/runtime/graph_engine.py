"""Graph mode's experts engine: one MoE layer from router output to expert output with no data-dependent Python
control flow on the compiled path (SeqMoE §8.1-8.2; DESIGN.md §11 "Graph mode").

Per layer execution, inside the compiled (or captured) decode step:
  1. ``GraphCache.plan`` — lookup, miss detection, victim choice and the state update, fixed-shape tensor ops;
  2. ``moe_offload::load_slots`` — the on-demand copies of the missed experts from the host store into their
     victim slots, as one kernel that copies the rows its ``valid`` mask selects (SeqMoE §8.2's device-initiated
     miss loading; on the CPU a loop of row copies inside the op);
  3. ``moe_offload::slot_experts`` — the grouped GEMM over the slot pool for the ``T * k`` pairs and the per-token
     sum, the very arithmetic of ``runtime.experts.slot_pair_outputs`` (so the tokens equal FullLoad's).

2 and 3 are ``torch.library`` custom ops, opaque to the compiler (no graph break, as transformers' own
``grouped_mm_fallback``): they reach the engine through an integer handle, and 3 takes 2's output as an input so
the copies are ordered before the GEMM that reads them. Their host time is accumulated per phase
during decode steps (``op_seconds``: ``stall`` for the copies, ``copy_overhead`` for the copy op's bookkeeping,
``expert_compute`` for the GEMMs).
"""

from __future__ import annotations

import itertools
import time

import torch

from .engine import EngineStats
from .experts import IMPLEMENTATION_NAME, _looped_linear, _SlotViews, register, slot_pair_outputs
from .graph_cache import GraphCache
from .pool import SlotPool
from .store import HostStore

_ENGINES: dict[int, "GraphEngine"] = {}
_HANDLES = itertools.count(1)


@torch.library.custom_op("moe_offload::load_slots", mutates_args=())
def load_slots(handle: int, load_eids: torch.Tensor, load_slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Copy expert ``load_eids[j]`` from the host store into slot ``load_slots[j]`` for every ``valid[j]``
    (``[M]`` int64, int64, bool); returns a ``[]`` int64 token (the number of copies) that orders later reads."""
    return _ENGINES[handle].copy_rows(load_eids, load_slots, valid)


@load_slots.register_fake
def _load_slots_fake(handle, load_eids, load_slots, valid):
    return load_eids.new_empty(())


@torch.library.custom_op("moe_offload::slot_experts", mutates_args=())
def slot_experts(handle: int, layer: int, hidden_states: torch.Tensor, slot_ids: torch.Tensor,
                 pair_weights: torch.Tensor, ready: torch.Tensor) -> torch.Tensor:
    """The experts of MoE ``layer`` from the slot pool: ``hidden_states [T, H]``, ``slot_ids [T * k]`` int64,
    ``pair_weights [T * k]`` -> ``[T, H]`` in ``hidden_states.dtype``. ``ready``: ``load_slots``' token."""
    return _ENGINES[handle].compute(layer, hidden_states, slot_ids, pair_weights)


@slot_experts.register_fake
def _slot_experts_fake(handle, layer, hidden_states, slot_ids, pair_weights, ready):
    return torch.empty_like(hidden_states)


class GraphEngine:
    """The experts of every MoE layer from a shared slot pool, planned by a ``GraphCache`` (graph mode).

    Drop-in for ``OffloadEngine`` where ``generate`` and the reports use it (``attach``, ``begin_step``,
    ``end_step``, ``stats``, ``reset_stats``, ``close``, ``policy_name``, ``pool``, ``store``); no prefetcher and
    no observers (a predictor in graph mode writes its forecasts with ``GraphCache.update_forecast``).

    Args:
        store: the host store; pool: the device slot pool (its ``lookup`` is not used: ``cache.lookup`` is);
        cache: the device-side slot table; num_experts: E per MoE layer; policy_name: for reports.
    """

    def __init__(self, store: HostStore, pool: SlotPool, cache: GraphCache, num_experts: int, policy_name: str):
        self.store, self.pool, self.cache = store, pool, cache
        self.num_experts = num_experts
        self._policy_name = policy_name
        self.modules: list[torch.nn.Module] = []
        self.prefetcher = None
        self.observers: list = []
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
        """Forget the engine's handle and unpin the host store; the engine must not run afterwards."""
        _ENGINES.pop(self.handle, None)
        self.store.close()

    # ---- the layer (traced by torch.compile) ----------------------------------------------------------------

    def forward(self, module: torch.nn.Module, moe_layer: int, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Experts of MoE layer ``moe_layer``: ``hidden_states [T, H]``, ``top_k_index [T, k]`` int64 ids of this
        layer, ``top_k_weights [T, k]`` -> ``[T, H]`` of ``hidden_states.dtype``. No host synchronisation and no
        data-dependent control flow outside the two custom ops."""
        slot_ids, eids, slots, valid = self.cache.plan(moe_layer, top_k_index)
        ready = torch.ops.moe_offload.load_slots(self.handle, eids, slots, valid)
        return torch.ops.moe_offload.slot_experts(self.handle, moe_layer, hidden_states, slot_ids,
                                                  top_k_weights.reshape(-1), ready)

    # ---- the ops' eager bodies ------------------------------------------------------------------------------

    def copy_rows(self, eids: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``load_slots``' body: row copies host store -> slot for the valid entries."""
        t0 = time.perf_counter()
        n = int(valid.sum())
        t1 = time.perf_counter()
        pool, dst = self.pool, self.pool._bytes
        for e, s in zip(eids[:n].tolist(), slots[:n].tolist()):
            self.store.copy_to(e, dst[s] if dst is not None else pool.buf[s], non_blocking=self._cuda)
        st = self._stats
        st.bytes_loaded += n * self.store.layout.expert_bytes
        t2 = time.perf_counter()
        st.load_time_s += t2 - t1
        token = torch.tensor(n, dtype=torch.long, device=eids.device)
        if self._decoding:
            self.op_seconds["stall"] += t2 - t1
            self.op_seconds["copy_overhead"] += time.perf_counter() - t2 + t1 - t0
        return token

    def compute(self, layer: int, hidden_states: torch.Tensor, slot_ids: torch.Tensor,
                pair_weights: torch.Tensor) -> torch.Tensor:
        """``slot_experts``' body: the pairs sorted by slot, one GEMM per run of equal slots on views of the pool
        (``runtime.experts._looped_linear``, bitwise the grouped GEMM), the gate on all pairs at once, then the
        pairs put back in router order and summed per token, as ``OffloadEngine.forward`` (and transformers) do.
        Formats that decode their weights (FP8, MXFP4) and non-CPU devices go through ``slot_pair_outputs``."""
        t0 = time.perf_counter()
        num_tokens = hidden_states.shape[0]
        k = slot_ids.numel() // num_tokens
        module, rows = self.modules[layer], self.pool.rows
        sid = slot_ids.tolist()
        if rows.zero_copy and not self._cuda:
            order = sorted(range(len(sid)), key=sid.__getitem__)
            perm = torch.tensor(order, dtype=torch.long)
            bounds = [0] + [j + 1 for j in range(len(order)) if j + 1 == len(order)
                            or sid[order[j]] != sid[order[j + 1]]]
            slots = [sid[order[b - 1]] for b in bounds[1:]]
            up = "gate_up_proj" if module.has_gate else "up_proj"
            x = hidden_states[perm // k]
            h = self._linear(module, x, up, slots, bounds)
            h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
            h = self._linear(module, h, "down_proj", slots, bounds)
            if module.has_post_expert_norm:
                h = module.post_expert_norm(h)
            out = h * pair_weights[perm].unsqueeze(-1)
        else:
            out, perm, _ = slot_pair_outputs(module, rows, hidden_states, slot_ids, pair_weights, k, sorted(set(sid)))
        pairs = torch.empty_like(out).index_copy_(0, perm, out)
        result = pairs.view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)
        self._stats.layer_calls += 1
        self._stats.rounds += 1
        if self._decoding:
            self.op_seconds["expert_compute"] += time.perf_counter() - t0
        return result

    def _linear(self, module, x, name, slots, bounds):
        """``x [P, in]`` (pairs sorted by slot) through field ``name`` of each run's slot, plus the bias."""
        bias = None
        if module.has_bias:
            sel = torch.tensor(slots, dtype=torch.long)
            counts = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.long)
            bias = self.pool.rows.weight(name + "_bias", sel).repeat_interleave(counts, dim=0)
        return _looped_linear(x, _SlotViews(self.pool.rows, name, slots), bounds, bias, module.is_transposed)
