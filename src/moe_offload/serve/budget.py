"""A memory budget turned into a loaded model: ``--memory-budget GB|auto`` for ``serve`` and ``generate``.

``resolve_budget`` says what the budget is (a number of GB, ``auto``, or the CUDA default) and
``load_within_budget`` loads the model with a minimal pool, measures the largest request (``serve.memory``'s
profile run), sizes the pool from what is left and loads again with it (the plan itself is ``serve.memory``).

``auto`` sizes from what the machine has: on CUDA 90% of the free device memory; on the CPU, where the slot pool
is the RAM tier, ``AUTO_HOST_FRACTION`` of the host memory the process may still use (``MemAvailable``, capped by
its cgroup's limit less its usage, reclaimable page cache not counted: ``runtime.host_memory.memory_limit_bytes``) less a private host store
(``--host-store pinned``: every expert in the same RAM). Not counted in any budget: the interpreter and its
libraries (torch, transformers: ~0.3-0.4 GB here), and the page cache of ``--host-store mmap`` (reclaimable).

Units: bytes (``GB`` = 10^9 bytes).
"""

from __future__ import annotations

import gc
import math

import torch

from ..errors import MoeOffloadError
from .batch_memory import plan_batch
from .memory import GB, host_cache_bytes, lookup_bytes, non_expert_bytes, slots_for_budget, staging_bytes
from .memory_profile import profile_request

CUDA_DEFAULT_FRACTION = 0.9  # default budget on CUDA: this share of the free device memory at start-up
AUTO_HOST_FRACTION = 0.8     # --memory-budget auto on the CPU: this share of the memory the process may still use
DEFAULT_MAX_CONTEXT = 1024   # tokens; at most the model's max_position_embeddings


def resolve_budget(memory_budget: float | str | None, device: torch.device,
                   slots_given: bool) -> tuple[int | None, str | None]:
    """``(budget bytes, where it came from)`` for ``--memory-budget`` (GB or ``"auto"``); None without a budget
    (``--slots`` / ``--residency`` given, or the CPU default). On CUDA with nothing given: the CUDA default.
    ``auto`` on the CPU is finished by ``load_within_budget`` (a private host store is subtracted once known).

    Raises:
        MoeOffloadError: a budget that is not a finite number > 0 nor ``auto``.
    """
    if memory_budget == "auto":
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(CUDA_DEFAULT_FRACTION * free), f"auto: {CUDA_DEFAULT_FRACTION:.0%} of the free CUDA memory " \
                f"({free / GB:.2f} GB)"
        from ..runtime.host_memory import memory_limit_bytes

        avail = memory_limit_bytes()
        return int(AUTO_HOST_FRACTION * avail), f"auto: {AUTO_HOST_FRACTION:.0%} of the {avail / GB:.2f} GB of " \
            "host memory this process may use (MemAvailable and its cgroup's limit)"
    if memory_budget is not None:
        try:
            gb = float(memory_budget)
        except (TypeError, ValueError):
            gb = math.nan
        if not (gb > 0 and math.isfinite(gb)):
            raise MoeOffloadError(f"--memory-budget must be a finite number > 0 GB or auto, got {memory_budget}")
        return int(gb * GB), "--memory-budget"
    if not slots_given and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(CUDA_DEFAULT_FRACTION * free), \
            f"default: {CUDA_DEFAULT_FRACTION:.0%} of the free CUDA memory ({free / GB:.2f} GB)"
    return None, None


def _host_store_share(lm, budget: int, source: str) -> int:
    """``budget`` less a private host store that shares the budget's RAM (``auto`` on the CPU).

    Raises:
        MoeOffloadError: the host store alone takes the whole budget.
    """
    store = lm.engine.store.nbytes
    if not (source.startswith("auto") and lm.device.type == "cpu" and lm.engine.store.mode == "pinned"):
        return budget
    if store >= budget:
        raise MoeOffloadError(f"--memory-budget auto: the host store holds every expert in RAM ({store / GB:.2f} GB) "
                              f"and {budget / GB:.2f} GB is what the machine gives: use --host-store disk")
    return budget - store


def load_within_budget(path, budget: int, source: str, load: dict, max_context: int, block: int | None,
                       refresh: bool, max_batch: int | None, load_predictor, log):
    """Load ``path`` with a slot pool sized from ``budget`` bytes (module docstring).

    Args:
        load: keyword arguments of ``models.loader.load_offloaded`` (not ``slots``/``residency``).
        max_context: tokens of the largest request; block: diffusion block length (None: autoregressive).
        refresh: a diffusion refresh planner (per-layer budgets). max_batch: ``--max-batch`` or None.
        load_predictor: ``lm -> PredictorSet | None``, called once, on the first load (its parameters count as
            non-expert bytes).
        log: one-line progress messages.
    Returns:
        ``(lm, pset, batch, note, kv_cache_bytes, activation_bytes, budget)``: the budget after ``auto`` took a
        private host store out of it.
    Raises:
        MoeOffloadError: the budget leaves fewer than top-k slots (per layer for refresh planners), or as
            ``load_offloaded``.
    """
    from ..models.loader import load_offloaded

    log(f"loading {path} with a minimal pool (top-k slots{' per MoE layer' if refresh else ''}) for the profile run")
    lm = _minimal(path, load)
    budget = _host_store_share(lm, budget, source)
    layers, n_total, top_k = lm.num_moe_layers, lm.num_moe_layers * lm.num_experts, lm.top_k
    pset = load_predictor(lm)
    staging, cache = staging_bytes(lm), host_cache_bytes(lm)
    base = non_expert_bytes(lm) + (0 if pset is None else pset.parameter_bytes()) + lookup_bytes(lm) + staging + cache
    extra = (f", disk staging buffers ({staging / GB:.4f} GB)" if staging else "") + (
        f", the --host-cache ({cache / GB:.4f} GB)" if cache else "")
    per_layer = layers if refresh else None
    slots_for_budget(budget, base, lm.expert_bytes, n_total, top_k, per_layer, weights_only=True,  # fail early
                     extra=extra)
    log(f"profile run: the largest request ({max_context} tokens, sampled)")
    prof = profile_request(lm, max_context, block)
    batch, note, kv, act = plan_batch(lm, max_batch, budget, base, prof, max_context)
    slots = slots_for_budget(budget, base + kv + act, lm.expert_bytes, n_total, top_k, per_layer, extra=extra)
    lm.close()  # its copy worker would keep the first store and pool alive outside the plan
    del lm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"loading {path} with {slots} slots")
    lm = load_offloaded(path, slots=slots, **load)
    return lm, pset, batch, note, kv, act, budget


def _minimal(path, load: dict):
    """``path`` loaded with top-k slots (the loader makes them top-k per layer for a refresh planner)."""
    from ..models.checkpoint import read_config
    from ..models.loader import _top_k, load_offloaded

    _, config, _ = read_config(path)
    return load_offloaded(path, slots=_top_k(config), **load)


def load_for_generate(path, memory_budget: float | str, load: dict, max_context: int | None, block: int | None,
                      log):
    """``generate --memory-budget``: ``path`` loaded with the pool the budget leaves for one request of
    ``max_context`` tokens (default: min(1024, the model's positions)); the plan is on ``lm.memory_plan`` and its
    lines go to ``log``. The predictor of ``--predictor`` is attached after this and is not counted.

    Raises:
        MoeOffloadError: as ``resolve_budget`` and ``load_within_budget``, or ``max_context`` above the model's
            positions.
    """
    from ..models.checkpoint import read_config
    from ..core.policy_spec import parse_policy
    from ..models.loader import resolve_device
    from .memory import MemoryPlan

    _, config, _ = read_config(path)
    max_pos = getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_CONTEXT
    if max_context is not None and max_context > max_pos:
        raise MoeOffloadError(f"--max-context {max_context} exceeds the model's max_position_embeddings {max_pos}")
    max_context = max_context or min(DEFAULT_MAX_CONTEXT, max_pos)
    budget, source = resolve_budget(memory_budget, resolve_device(load.get("device")), False)
    refresh = parse_policy(load.get("policy", "lru")).refresh
    lm, _, batch, _, kv, act, budget = load_within_budget(path, budget, source, load, max_context, block, refresh, 1,
                                                          lambda lm: None, log)
    lm.memory_plan = MemoryPlan(budget, source, non_expert_bytes(lm), lookup_bytes(lm), kv, act, lm.expert_bytes,
                                lm.engine.pool.num_slots, lm.num_moe_layers * lm.num_experts, lm.top_k, max_context,
                                batch, staging_bytes(lm), host_cache_bytes(lm))
    for line in lm.memory_plan.lines():
        log(line)
    return lm
