"""What the TIDE refresh planners (``core.refresh``) hand their executor (the runtime's ``runtime.refresh_engine`` or
the simulator's ``sim.diffusion_sim``): a step's asynchronous prefetches (``RefreshPlan`` of ``Transfer``s), a
layer's device/host split (``LayerDecision``, with its on-demand ``Round``s), and ``select_top``, the ranking every
planner refreshes by.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Transfer:
    """Copies of one MoE layer.

    Attributes:
        layer: MoE layer index.
        load: experts to copy host->device, in this order.
        evict: experts whose device copies (landed or still in flight: cancel those) are dropped; their slots take
            ``load``.
        blocking: True: the layer waits for the copies before computing (on-demand / synchronous refresh);
            False: asynchronous prefetch, reported back with ``RefreshPlanner.land``.
    """

    layer: int
    load: list[int]
    evict: list[int]
    blocking: bool


@dataclass
class RefreshPlan:
    """Asynchronous prefetches decided at the start of a diffusion step (``RefreshPlanner.begin_step``).

    Attributes:
        block, step: where the decision was taken.
        transfers: one ``Transfer(blocking=False)`` per refreshed layer, in layer order (copy them in this order:
            earlier layers are needed earlier in the next step).
        choices: ``{layer: IntervalChoice}`` (the optimiser's decision and predicted cost breakdown; tide only).
    """

    block: int
    step: int
    transfers: list[Transfer]
    choices: dict = field(default_factory=dict)


@dataclass
class LayerDecision:
    """How one MoE layer of one step gets its experts computed (``RefreshPlanner.route``).

    Attributes:
        layer: MoE layer index.
        device: experts computed on the device (sorted ids).
        host: experts computed on the host, the fallback (sorted ids).
        transfer: blocking copies to finish before computing (None: none).
        hit_tokens, hit_experts: token-experts / experts resident before any blocking copy of this layer (a hit
            in DESIGN.md §2's sense).
        device_tokens, host_tokens: token-experts computed on the device / on the host.
        slot_plan: reactive only: the per-layer ``core.slots.LayerPlan`` (its ``rounds`` say which loads to do
            before which computations when the layer needs more experts than the budget holds); None otherwise.
        rounds: tide with on-demand swaps only: the ``Round``s to execute in order (their loads and evictions
            together are ``transfer``); the experts of ``host`` are computed on the host besides. None otherwise.
    """

    layer: int
    device: list[int]
    host: list[int]
    transfer: Transfer | None
    hit_tokens: int
    hit_experts: int
    device_tokens: int
    host_tokens: int
    slot_plan: object | None = None
    rounds: list | None = None


@dataclass
class Round:
    """One round of a layer's on-demand execution (``LayerDecision.rounds``): drop ``evict`` (experts already
    computed in an earlier round of this step, or not needed in it), copy ``load`` host->device (blocking) into
    their slots, then compute ``compute`` (resident now) on the device."""

    load: list[int]
    evict: list[int]
    compute: list[int]


def select_top(score: np.ndarray, budget: int) -> np.ndarray:
    """The experts with the largest positive ``score`` (float or int ``[E]``), at most ``budget`` of them, ties
    broken by the lower id; int64 array in that rank order."""
    score = np.asarray(score)
    pos = np.flatnonzero(score > 0)
    if len(pos) == 0 or budget <= 0:
        return np.zeros(0, dtype=np.int64)
    order = pos[np.lexsort((pos, -score[pos]))]
    return order[:budget].astype(np.int64)
