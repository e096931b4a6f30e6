"""Device-tier memory for serving: the plan that sizes the slot pool from a budget, and its measurement.

The **device tier** is everything the model keeps in device memory: the non-expert weights (attention, norms,
routers, shared experts, embeddings, head), the slot pool (``slots x expert bytes``), the expert -> slot lookup
table (8 bytes per routed expert), the KV cache and the activations / workspace of a forward pass. The host store
(every routed expert) is the next tier and is not counted.

Plan (``plan_memory``): with a budget B (bytes),

    slots = floor((B - non-expert - lookup - peak request bytes) / expert bytes)     (at most all routed experts)

where *peak request bytes* is measured by a **profile run** at start-up: one request of the worst shape the
server admits (a prompt of ``max_context - 1`` tokens and one decode step, so the last forward sees a KV cache of
``max_context`` tokens; for block diffusion one diffusion step over ``max_context`` rounded up to whole blocks),
sampled with temperature 1 and top-p 0.5 so the sampling path's temporaries are included. With a budget the
profile runs on a minimal pool (top-k slots; per layer for the diffusion refresh planners) before the real pool
exists: a layer that needs more distinct experts than the pool holds runs in rounds, whose temporaries include
a single round's. Its KV cache (the cache object's tensor bytes at ``max_context``) is reported separately from
the activations (peak minus KV cache). A decode batch of N requests reserves N such KV caches and the larger
activation peak of a prefill and an N-row decode step (``serve.batch_memory``).

Measurement (the profile run, the CPU tracker): ``serve.memory_profile``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import MoeOffloadError
from .memory_profile import storage_bytes

GB = 10 ** 9  # --memory-budget is in decimal gigabytes


def non_expert_bytes(lm) -> int:
    """Bytes of the model's parameters and buffers on its device (unique storages; tied weights once): the
    non-expert weights (routed experts are never on the device)."""
    m = lm.model
    return storage_bytes(list(m.parameters()) + list(m.buffers()), lm.device)


def lookup_bytes(lm) -> int:
    """Bytes of the expert -> slot lookup table (int64 per routed expert); 0 for FullLoad."""
    return 0 if lm.engine is None else lm.engine.pool.lookup.numel() * lm.engine.pool.lookup.element_size()


def staging_bytes(lm) -> int:
    """Host bytes of a disk store's staging buffers at most (``runtime.disk_store.DiskStore.max_staging_bytes``;
    0 for other stores and FullLoad)."""
    return getattr(getattr(lm.engine, "store", None), "max_staging_bytes", 0)


def host_cache_bytes(lm) -> int:
    """Bytes of a host cache in front of the disk (``--host-cache``) when it shares the slots' memory (the CPU);
    0 otherwise (on CUDA it is host RAM, outside the device tier)."""
    store = getattr(lm.engine, "store", None)
    return store.nbytes if getattr(store, "mode", None) == "disk" and lm.device.type == "cpu" else 0


def static_device_bytes(lm) -> int:
    """Device-tier bytes held between requests: non-expert weights + slot pool + lookup table (bytes)."""
    pool = 0 if lm.engine is None else lm.engine.pool.nbytes
    return non_expert_bytes(lm) + pool + lookup_bytes(lm)


@dataclass
class MemoryPlan:
    """How the device tier is split (bytes) and the slot pool it leaves.

    Attributes:
        budget_bytes: the budget (None when slots were given by ``--slots`` / ``--residency``).
        source: where the slot count came from (``--memory-budget``, ``--slots``, ``--residency``, or the CUDA
            default).
        non_expert_bytes, lookup_bytes, kv_cache_bytes, activation_bytes: the parts (see the module docstring).
        expert_bytes: one routed expert; slots: the pool size; routed_experts: L x E; top_k.
        max_context: tokens (prompt + new); batch: requests at once (1: queued).
        staging_bytes: a disk store's staging buffers (``staging_bytes``; host RAM, the slot pool's tier on the CPU).
        host_cache_bytes: a host cache in front of the disk on the CPU (``host_cache_bytes``).
    """

    budget_bytes: int | None
    source: str
    non_expert_bytes: int
    lookup_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    expert_bytes: int
    slots: int
    routed_experts: int
    top_k: int
    max_context: int
    batch: int = 1
    staging_bytes: int = 0
    host_cache_bytes: int = 0

    @property
    def slot_bytes(self) -> int:
        """Bytes of the slot pool."""
        return self.slots * self.expert_bytes

    @property
    def total_bytes(self) -> int:
        """Planned device-tier peak: every part plus the pool (bytes)."""
        return (self.non_expert_bytes + self.lookup_bytes + self.kv_cache_bytes + self.activation_bytes
                + self.slot_bytes + self.staging_bytes + self.host_cache_bytes)

    @property
    def residency(self) -> float:
        """Slots as a fraction of all routed experts."""
        return self.slots / self.routed_experts

    def as_dict(self) -> dict:
        """The fields plus ``slot_bytes``, ``total_bytes`` and ``residency`` (for ``/v1/stats``)."""
        return asdict(self) | {"slot_bytes": self.slot_bytes, "total_bytes": self.total_bytes,
                               "residency": self.residency}

    def lines(self) -> list[str]:
        """The plan as log lines: one part per line with bytes and MB, then slots and residency."""
        def row(name, n):
            return f"  {name:<34}{n:>16,d} B {n / 1e6:>12.2f} MB"

        head = (f"memory plan ({self.source}; budget "
                + (f"{self.budget_bytes:,d} B = {self.budget_bytes / GB:.3f} GB" if self.budget_bytes is not None
                   else "none") + f"; max context {self.max_context} tokens, batch {self.batch}):")
        staging = ([row("disk staging buffers", self.staging_bytes)] if self.staging_bytes else []) + (
            [row("host cache", self.host_cache_bytes)] if self.host_cache_bytes else [])
        return [head,
                row("non-expert weights", self.non_expert_bytes),
                row("expert -> slot lookup table", self.lookup_bytes),
                row(f"KV cache ({self.max_context} tokens x {self.batch})", self.kv_cache_bytes),
                row("activations + workspace (peak)", self.activation_bytes),
                row(f"slot pool ({self.slots} x {self.expert_bytes:,d} B)", self.slot_bytes),
                *staging,
                row("total", self.total_bytes),
                f"  slots {self.slots} of {self.routed_experts} routed experts (top-k {self.top_k}), "
                f"residency {self.residency:.4f}"]


def slots_for_budget(budget_bytes: int, fixed_bytes: int, expert_bytes: int, routed_experts: int, top_k: int,
                     num_moe_layers: int | None = None, weights_only: bool = False, extra: str = "") -> int:
    """Slots that fit: ``floor((budget - fixed) / expert_bytes)``, at most ``routed_experts``.

    Args:
        budget_bytes: the device-tier budget (bytes).
        fixed_bytes: everything but the pool: non-expert weights + lookup table + KV cache + activations (bytes).
        expert_bytes: bytes of one routed expert.
        routed_experts: L x E.
        top_k: experts per token.
        num_moe_layers: for the diffusion refresh planners (per-layer budgets): round down to a multiple of L and
            require top-k per layer.
        weights_only: ``fixed_bytes`` holds only the non-expert weights and the lookup table (the early check,
            before the profile run measures the KV cache and activations); the message then says so.
        extra: what else ``fixed_bytes`` holds, for the message (e.g. ", disk staging buffers (0.003 GB)").
    Raises:
        MoeOffloadError: fewer slots than top-k (per layer with ``num_moe_layers``); the message gives the
            smallest budget that works.
    """
    free = budget_bytes - fixed_bytes
    slots = min(routed_experts, max(0, free) // expert_bytes)
    need = top_k
    if num_moe_layers:
        per_layer = min(routed_experts // num_moe_layers, slots // num_moe_layers)
        slots, need = per_layer * num_moe_layers, top_k * num_moe_layers
    if slots < need:
        least = fixed_bytes + need * expert_bytes
        parts = (f"non-expert weights and lookup table{extra} alone" if weights_only
                 else f"non-expert weights, lookup table{extra}, KV cache and activations")
        more = (" plus the KV cache and activations of a --max-context request" if weights_only
                else " (a smaller --max-context needs less KV cache and activations)")
        raise MoeOffloadError(
            f"--memory-budget {budget_bytes / GB:g} GB is too small: {parts} take {fixed_bytes / GB:.4f} GB and "
            f"leave room for {max(0, slots)} slots of {expert_bytes:,d} B; {need} slots (top-k = {top_k}"
            f"{' per layer' if num_moe_layers else ''}) need at least {math.ceil(least / 1e6) / 1e3:.3f} GB{more}")
    return int(slots)
