"""Replaying a stream of expert needs through the decision core: per step, per MoE layer, the same ``SlotTable`` +
eviction policy the runtime asks for each layer's plan (DESIGN.md §3, §6). The simulator (``sim.simulator``) turns a
routing trace into such a stream; ``--policy auto`` (``core.auto_policy``) replays a prompt's own routing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import MoeOffloadError
from .eviction import EvictionPolicy
from .forecast import triggered
from .slots import SlotTable


@dataclass
class StepCounts:
    """Per-step counts of one replay, arrays of length ``num_steps`` (replay order): ``request``, ``step`` (0 =
    prefill), ``hits``, ``misses`` (distinct experts per layer execution summed over the step's layers)."""

    request: np.ndarray
    step: np.ndarray
    hits: np.ndarray
    misses: np.ndarray


@dataclass
class ReplayResult:
    """Totals of one replay (hit rate = hits / (hits + misses)), split by phase, plus per-step counts."""

    policy: str
    num_slots: int
    hits: int = 0
    misses: int = 0
    decode_hits: int = 0
    decode_misses: int = 0
    accesses: int = 0
    per_step: StepCounts | None = field(default=None, repr=False)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    @property
    def decode_hit_rate(self) -> float:
        n = self.decode_hits + self.decode_misses
        return self.decode_hits / n if n else 1.0


def replay_needs(needs: list, num_moe_layers: int, num_experts: int, num_slots: int, pol: EvictionPolicy,
                 forecasts=None, on_loads=None) -> ReplayResult:
    """Replay ``needs`` (``[(request, step, needed[L], tokens[L])]`` in replay order, ``needed[l]`` sorted global
    expert ids ``l * E + e``, ``tokens[l]`` their token counts: ``sim.simulator.layer_needs``) with a pool of
    ``num_slots`` slots under the fresh policy object ``pol``.

    ``forecasts``: per step, ``[(trigger layer, forecast)]`` handed to the policy's ``observe`` before planning the
    layer that triggered them, the cross-layer ones right after (``core.forecast.triggered``); required by
    forecast-driven policies. ``on_loads(step, eids)``: told the experts each layer loads on demand, in order (a
    tier below the slots, e.g. ``sim.host_tier.HostTierReplay``).

    Raises:
        MoeOffloadError: a forecast-driven policy without forecasts.
        ValueError: ``forecasts`` of another length than ``needs``.
    """
    if forecasts is None and hasattr(pol, "observe"):
        raise MoeOffloadError(f"policy {pol.name} needs a predictor's forecasts (simulate --predictor DIR)")
    if forecasts is not None and len(forecasts) != len(needs):
        raise ValueError("forecasts must have one entry per step of the trace")
    table = SlotTable(num_slots, num_moe_layers * num_experts, pol)
    res = ReplayResult(policy=pol.name, num_slots=num_slots)
    n = len(needs)
    req_a, step_a = np.zeros(n, np.int32), np.zeros(n, np.int32)
    hits_a, miss_a = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i, (req, step, needed, tokens) in enumerate(needs):
        table.begin_step(req, step)
        h = m = 0
        events = forecasts[i] if forecasts is not None else ()
        for layer, (ids, cnt) in enumerate(zip(needed, tokens)):
            for f in triggered(events, layer, planned=False):
                pol.observe(f)
            plan = table.plan_layer(ids, cnt)
            for f in triggered(events, layer, planned=True):
                pol.observe(f)
            h += plan.hits
            m += plan.misses
            if on_loads is not None:
                on_loads(step, [ld.eid for rnd in plan.rounds for ld in rnd.loads])
        req_a[i], step_a[i], hits_a[i], miss_a[i] = req, step, h, m
        res.hits += h
        res.misses += m
        if step > 0:
            res.decode_hits += h
            res.decode_misses += m
    res.accesses = res.hits + res.misses
    res.per_step = StepCounts(req_a, step_a, hits_a, miss_a)
    return res
