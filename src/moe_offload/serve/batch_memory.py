"""The memory plan of a decode batch (issue 18): how many sequences, and the KV cache they reserve.

With ``max_batch`` B the device tier holds, besides the weights, lookup table and slot pool:

- the KV cache of B sequences at ``max_context``: ``B x kv1`` (kv1 = one sequence's KV cache at ``max_context``,
  measured by the profile run, ``serve.memory_profile.profile_request``);
- the activation peak: the larger of the profile run's (a ``max_context - 1`` token prefill, which a new request's
  admission runs next to the other B - 1 rows) and one decode step of B rows at ``max_context``
  (``profile_batch_decode``: measured on a batch cache of zeros, so it costs one decode step, not B prefills).

So the plan's ``kv_cache_bytes + activation_bytes`` bounds both moments of serving: ``(B - 1) kv1 + prefill peak``
and ``B kv1 + decode activations``. Default B (``choose_max_batch``): with a budget, the most sequences (at most
``DEFAULT_MAX_BATCH``) whose KV cache takes at most half of what the weights and activations leave, so at least
as much goes to the slot pool; without a budget (``--residency`` / ``--slots``, the CPU default),
``DEFAULT_MAX_BATCH``.
"""

from __future__ import annotations

import inspect
import os

import torch

from ..errors import MoeOffloadError
from .memory import GB
from .memory_profile import DeviceTierTracker, cache_bytes

DEFAULT_MAX_BATCH = 32  # sequences; the default when no budget limits the KV cache


def choose_max_batch(budget_bytes: int | None, fixed_bytes: int, kv1_bytes: int) -> int:
    """The default ``--max-batch``: ``min(DEFAULT_MAX_BATCH, floor((budget - fixed) / 2 / kv1))``, at least 1;
    ``DEFAULT_MAX_BATCH`` without a budget.

    Args:
        budget_bytes: the device-tier budget (bytes) or None.
        fixed_bytes: non-expert weights + lookup table + activation peak (bytes).
        kv1_bytes: one sequence's KV cache at ``max_context`` (bytes; 0: no KV cache).
    """
    if budget_bytes is None or kv1_bytes <= 0:
        return DEFAULT_MAX_BATCH
    return max(1, min(DEFAULT_MAX_BATCH, (budget_bytes - fixed_bytes) // 2 // kv1_bytes))


def free_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` now: CUDA's free memory, or on the CPU the kernel's
    ``MemAvailable`` (``/proc/meminfo``; else free physical pages); None where neither is known."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_batch_fits(batch: int, kv1_bytes: int, fixed_bytes: int, budget_bytes: int | None, device: torch.device,
                     max_context: int) -> None:
    """Refuse a ``--max-batch`` whose KV cache cannot fit, before the batch decode profile allocates it.

    Args:
        batch: sequences. kv1_bytes: one sequence's KV cache at ``max_context`` (bytes).
        fixed_bytes: non-expert weights + lookup table + the prefill's activation peak (bytes).
        budget_bytes: the device-tier budget, or None. device: where the KV cache goes.
    Raises:
        MoeOffloadError: ``batch x kv1_bytes`` exceeds what the budget leaves after ``fixed_bytes``, or the memory
            ``device`` has free now (``free_bytes``; checked with or without a budget).
    """
    need = batch * kv1_bytes
    what = (f"--max-batch {batch} needs {need / GB:.3f} GB of KV cache at --max-context {max_context} "
            f"({kv1_bytes / 1e6:.2f} MB per request), more than ")
    if budget_bytes is not None and fixed_bytes + need > budget_bytes:
        raise MoeOffloadError(f"{what}the --memory-budget of {budget_bytes / GB:g} GB leaves after the weights and "
                              f"activations ({max(0, budget_bytes - fixed_bytes) / GB:.3f} GB); lower --max-batch or "
                              "--max-context")
    free = free_bytes(device)
    if free is not None and need > free:
        raise MoeOffloadError(f"{what}the {free / GB:.3f} GB free on {device.type}; lower --max-batch or "
                              "--max-context")


@torch.no_grad()
def profile_batch_decode(lm, max_context: int, batch: int) -> int:
    """Activation bytes (the peak above the KV cache it leaves) of one decode step of ``batch`` rows whose caches
    hold ``max_context - 1`` tokens (zeros, shaped like a two-token prefill's cache).

    On the CPU the tensor storages allocated during the step are tracked (``DeviceTierTracker``); on CUDA the
    caching allocator's reserved peak above what it held before. The engine's counters are reset afterwards."""
    kw = "cache" if "cache" in inspect.signature(lm.model.forward).parameters else "past_key_values"
    dev, eng = lm.device, lm.engine
    if eng is not None:
        eng.begin_step(-1, 0)
    cache = lm.model(input_ids=torch.tensor([[1, 2]], device=dev), use_cache=True).get(kw)
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        layer.keys = k.new_zeros(batch, k.shape[1], max_context - 1, k.shape[3])
        layer.values = v.new_zeros(batch, v.shape[1], max_context - 1, v.shape[3])
    ids = torch.ones(batch, 1, dtype=torch.long, device=dev)
    if eng is not None:
        eng.begin_step(-1, 1)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_reserved(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = lm.model(input_ids=ids, use_cache=True, **{kw: cache})
        out.logits[:, -1].float().argmax(-1)
        torch.cuda.synchronize(dev)
        act = max(0, torch.cuda.max_memory_reserved(dev) - base)
    else:
        tracker = DeviceTierTracker(dev)
        with tracker:
            out = lm.model(input_ids=ids, use_cache=True, **{kw: cache})
            out.logits[:, -1].float().argmax(-1)
        act = max(0, tracker.peak_bytes - cache_bytes(out.get(kw), dev))
    if eng is not None:
        eng.reset_stats()
    return int(act)


def plan_batch(lm, requested: int | None, budget_bytes: int | None, base_bytes: int, prof,
               max_context: int) -> tuple[int, str | None, int, int]:
    """The batch part of the memory plan (module docstring).

    Args:
        lm: the loaded model (the profile run's load). requested: ``--max-batch`` or None (default).
        budget_bytes: the budget or None. base_bytes: non-expert weights + lookup table (bytes).
        prof: the profile run's ``serve.memory_profile.RequestProfile``. max_context: tokens per sequence.
    Returns:
        ``(max_batch, note, kv_cache_bytes, activation_bytes)``: ``note`` says why the model runs batch 1 (None when
        it batches); bytes as in the module docstring.
    Raises:
        MoeOffloadError: the batch's KV cache cannot fit (``check_batch_fits``), before anything is allocated.
    """
    from ..generation.batching import batch_reason

    why = batch_reason(lm)
    if why is not None:
        batch = 1
        if requested and requested > 1:
            why += f" (--max-batch {requested} does not apply)"
    elif requested:
        batch = requested
    else:
        batch = choose_max_batch(budget_bytes, base_bytes + prof.activation_bytes, prof.kv_cache_bytes)
    act = prof.activation_bytes
    if batch > 1:
        check_batch_fits(batch, prof.kv_cache_bytes, base_bytes + act, budget_bytes, lm.device, max_context)
        act = max(act, profile_batch_decode(lm, max_context, batch))
    return batch, why, batch * prof.kv_cache_bytes, act
