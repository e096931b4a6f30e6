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

Measurement: on CUDA, the caching allocator's *reserved* bytes (``torch.cuda.max_memory_reserved``: what the
allocator holds, fragmentation included, not only what tensors use) plus a measured workspace margin: device memory
the request took outside the allocator (cuBLAS / cuDNN workspaces, kernel images), from ``cudaMemGetInfo`` before
and after (``request_peak_bytes``). On the CPU,
where device and host tier share the same memory, ``DeviceTierTracker`` follows every tensor storage that an
operator allocates while generation runs (a ``TorchDispatchMode`` on the worker thread: an output whose storage is
none of the operator's inputs' is a new allocation; it stays counted until the storage is freed, checked through
a weak reference to the storage), and the static part is the bytes of the model's parameters and buffers, the
pool and the lookup table. Not seen on the CPU: scratch memory a kernel allocates internally without making a
tensor of it (e.g. a GEMM's packing buffers) and tensors made from Python data (``torch.tensor([...])``, a few
bytes of expert ids).
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import MoeOffloadError

GB = 10 ** 9  # --memory-budget is in decimal gigabytes


def _tensors(obj, out: list) -> list:
    """Tensors among ``obj`` (nested lists / tuples / dicts), appended to ``out``."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


class DeviceTierTracker(TorchDispatchMode):
    """Live bytes of tensor storages allocated by operators while the mode is active (see the module docstring).

    Enter it (``with tracker:``) on the thread that runs generation; it may be entered many times, the live set
    persists between entries (a tensor kept from one request to the next stays counted).

    Args:
        device: only storages on this device are counted.

    Attributes:
        current_bytes: bytes of tracked storages alive at the last allocation check.
        peak_bytes: the largest ``current_bytes`` seen (bytes).
        allocations: storages allocated so far.
    """

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0

    def _prune(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.current_bytes -= self._live.pop(k)[1]

    def live_bytes(self) -> int:
        """Bytes of tracked storages alive now (prunes freed ones first)."""
        self._prune()
        return self.current_bytes

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak_bytes = self.live_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (list, tuple)):
            outs = _tensors(out, [])
        else:
            return out
        live = self._live
        inputs = None
        for t in outs:
            if t.device != self.device or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            key = st._cdata
            known = live.get(key)
            if known is not None and not known[0].expired():
                continue
            if inputs is None:
                inputs = {a.untyped_storage()._cdata for a in _tensors((args, kwargs), [])
                          if a.layout == torch.strided}
            if key in inputs:  # a view of an input, or an in-place / out= result: nothing new
                continue
            nbytes = st.nbytes()
            if known is not None:  # the address of a freed storage, reused
                self.current_bytes -= known[1]
            live[key] = (StorageWeakRef(st), nbytes)
            self.current_bytes += nbytes
            self.allocations += 1
            # current_bytes may still count freed storages (pruned lazily): prune before it can set a new peak
            if self.current_bytes > self.peak_bytes or len(live) > 4096:
                self._prune()
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out


def _storage_bytes(tensors, device: torch.device) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.device != device or t.layout != torch.strided:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def non_expert_bytes(lm) -> int:
    """Bytes of the model's parameters and buffers on its device (unique storages; tied weights once): the
    non-expert weights (routed experts are never on the device)."""
    m = lm.model
    return _storage_bytes(list(m.parameters()) + list(m.buffers()), lm.device)


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


def _cache_bytes(cache, device: torch.device) -> int:
    """Tensor bytes held by a transformers cache object (its ``layers``' tensors, or the legacy key/value lists)."""
    if cache is None:
        return 0
    tensors = []
    for layer in getattr(cache, "layers", None) or []:
        for v in vars(layer).values():
            _tensors(v, tensors)
    for name in ("key_cache", "value_cache"):
        if not getattr(cache, "layers", None) and hasattr(cache, name):
            _tensors(list(getattr(cache, name)), tensors)
    return _storage_bytes(tensors, device)


def _profile_prompt(lm, length: int) -> list[int]:
    """``length`` token ids drawn (seed 0) from the vocabulary, the mask token excluded (diffusion models)."""
    vocab = int(lm.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (length,), generator=g)
    mask = getattr(lm.model.config, "mask_token_id", None)
    if mask is not None:
        ids[ids == int(mask)] = (int(mask) + 1) % vocab
    return ids.tolist()


@torch.no_grad()
def _profile_autoregressive(lm, max_context: int) -> int:
    """Prefill ``max_context - 1`` tokens and one sampled decode step; returns the KV cache bytes at the end."""
    import inspect

    from ..generation.generate import _pick

    cache_kw = "cache" if "cache" in inspect.signature(lm.model.forward).parameters else "past_key_values"
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([_profile_prompt(lm, max_context - 1)], dtype=torch.long, device=lm.device)
    eng = lm.engine
    if eng is not None:
        eng.begin_step(-1, 0)
    out = lm.model(input_ids=ids, use_cache=True)
    tok = _pick(out.logits[:, -1], 1.0, 0.5, gen)
    past = out.get(cache_kw)
    del out
    if eng is not None:
        eng.begin_step(-1, 1)
    out = lm.model(input_ids=tok.view(1, 1), use_cache=True, **{cache_kw: past})
    past = out.get(cache_kw)
    _pick(out.logits[:, -1], 1.0, 0.5, gen)
    return _cache_bytes(past, lm.device)


def _profile_diffusion(lm, max_context: int, block_length: int) -> int:
    """One sampled diffusion step over ``max_context`` rounded up to whole blocks: its forward covers the whole
    context either way (with the block-prefix KV cache, the prompt's blocks are computed in that first step and
    their key/value buffers are part of the measured peak); returns 0 (no KV cache counted apart)."""
    from ..generation.diffusion import diffusion_generate_ids

    padded = -(-max_context // block_length) * block_length
    if lm.max_positions is not None:  # requests use whole blocks within the position limit (generate.token_budget)
        padded = max(block_length, min(padded, lm.max_positions // block_length * block_length))
    prompt = max(1, padded - block_length)
    diffusion_generate_ids(lm, _profile_prompt(lm, prompt), padded - prompt, block_length=block_length, steps=1,
                           threshold=1.0, temperature=1.0, top_p=0.5, seed=0, request=-1)
    return 0


@dataclass
class RequestProfile:
    """Measured device-tier bytes of the profile run: ``peak_bytes`` above the static part (KV cache +
    activations + workspace), ``kv_cache_bytes`` (the KV cache at ``max_context``; 0 for diffusion models)."""

    peak_bytes: int
    kv_cache_bytes: int

    @property
    def activation_bytes(self) -> int:
        """Peak bytes other than the KV cache (activations and workspace)."""
        return max(0, self.peak_bytes - self.kv_cache_bytes)


def request_peak_bytes(reserved_before: int, reserved_peak: int, reserved_after: int, free_before: int,
                       free_after: int) -> int:
    """A request's CUDA device-memory peak (bytes): the caching allocator's reserved peak above what it held
    before, plus the workspace margin — memory the device lost outside the allocator meanwhile, ``(free_before -
    free_after) - (reserved_after - reserved_before)``, at least 0 (cuBLAS workspaces, lazily loaded kernels)."""
    outside = (free_before - free_after) - (reserved_after - reserved_before)
    return max(0, reserved_peak - reserved_before) + max(0, outside)


def profile_request(lm, max_context: int, block_length: int | None = None) -> RequestProfile:
    """Run the worst-shape request the server admits (module docstring) and measure its device-tier peak.

    Args:
        lm: a loaded model (``models.loader.LoadedModel``).
        max_context: the server's maximum context (prompt + new tokens), >= 2 tokens.
        block_length: diffusion models: positions per block; None for autoregressive models.
    Returns:
        ``RequestProfile`` (bytes). The engine's counters are reset afterwards.
    Raises:
        MoeOffloadError: ``max_context < 2``; on CUDA, running out of device memory (the budget is too small).
    """
    if max_context < 2:
        raise MoeOffloadError(f"--max-context must be at least 2 tokens, got {max_context}")
    dev = lm.device
    gc.collect()
    try:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            base, free_before = torch.cuda.memory_reserved(dev), torch.cuda.mem_get_info(dev)[0]
            torch.cuda.reset_peak_memory_stats(dev)
            kv = (_profile_diffusion(lm, max_context, block_length) if block_length
                  else _profile_autoregressive(lm, max_context))
            torch.cuda.synchronize(dev)
            peak = request_peak_bytes(base, torch.cuda.max_memory_reserved(dev), torch.cuda.memory_reserved(dev),
                                      free_before, torch.cuda.mem_get_info(dev)[0])
        else:
            tracker = DeviceTierTracker(dev)
            with tracker:
                kv = (_profile_diffusion(lm, max_context, block_length) if block_length
                      else _profile_autoregressive(lm, max_context))
            peak = tracker.peak_bytes
    except torch.OutOfMemoryError:
        raise MoeOffloadError(f"out of device memory in the profile run at --max-context {max_context}: lower "
                              "--max-context or raise the budget") from None
    if lm.engine is not None:
        lm.engine.reset_stats()
    return RequestProfile(int(peak), int(kv))


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
