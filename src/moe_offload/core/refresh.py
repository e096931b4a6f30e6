"""TIDE refresh planners: which experts each MoE layer keeps on the device during the diffusion steps of a block
(DESIGN.md §5 "TIDE refresh planner"; TIDE "interval-based expert refresh", "I/O-aware scheduling").

Pure decision logic (numpy, no tensors, no I/O): the trace simulator (``sim.diffusion_sim``) and the runtime drive
the very same objects through one interface, :class:`RefreshPlanner`:

``begin_block(request, block)``
    a new block of masked tokens starts (TIDE treats each block separately: stability holds within a block).
``begin_step(step) -> RefreshPlan | None``
    before diffusion step ``step`` (0, 1, ... within the block) runs: asynchronous prefetches to start now
    (``Transfer(blocking=False)``: copy ``load`` host->device in that order, drop ``evict``). An expert of such a
    plan is *in flight* until the executor reports it with ``land``; until then a layer that needs it computes it
    on the host.
``route(layer, counts) -> LayerDecision``
    after MoE ``layer``'s router ran in this step (``counts``: int ``[num_experts]``, tokens routed to each
    expert): which experts to compute on the device and which on the host (fallback), and any *blocking* copies to
    do before computing the layer (``LayerDecision.transfer``, ``blocking=True``: reactive on-demand loads,
    tide-fixed refreshes). ``route`` also records ``counts`` (the activation tracker); call it exactly once per
    layer and step, in layer order.
``land(layer, experts)``
    the executor reports finished asynchronous copies.
``end_step(step_seconds=None)``
    the step finished; optionally its wall (or modelled) seconds, which the cost-aware planner uses to estimate
    how many steps a prefetch takes.
``resident(layer)`` / ``in_flight(layer)``
    the layer's experts on the device (landed) / being copied. Always ``|resident| + |in_flight| <= budget``:
    a prefetch's victims leave when its copies start, so no staging memory beyond the budget is needed.

Planners (``make_refresh_planner``):

* ``reactive``: per step, every needed expert that is not resident is loaded on demand (blocking), LRU eviction at
  the budget (``core.slots.SlotTable`` + ``core.policies.LRU``, one table per layer); no host fallback.
* ``tide-fixed`` (interval ``T``): the TIDE authors' reference behaviour (github ims-kdks/TIDE,
  ``modeling_llada2_moe.py``, ``jump_steps``): at every step ``s`` of a block with ``s % T == 0``, when a layer's
  router has run, the layer's resident set becomes the ``budget`` experts with the most tokens in this very step
  (experts with zero tokens are never promoted; as many residents as promoted experts are demoted, the others
  stay), loaded synchronously before the layer computes; between refreshes every miss is computed on the host.
* ``tide``: the interval optimiser (:class:`IntervalOptimiser`) picks, at each interval boundary, the interval
  length, the set and how to refresh: prefetch it asynchronously while the interval computes (misses and not yet
  landed experts fall back to the host), refresh synchronously from the step's own counts like ``tide-fixed``,
  or keep the current set one more step. At step 0 of a block, where no in-block history exists, it refreshes
  synchronously (the authors' code refreshes at step 0 of every block). Per miss it chooses between the host
  fallback and an on-demand swap, whichever the cost model finds cheaper for the miss's tokens
  (``TidePlanner``'s ``on_demand``; ``LayerDecision.rounds`` reuse the slots of experts already computed).

Modules, by role: ``refresh_plan`` (what planners return), ``activation_tracker``, ``stability`` (the stability
estimator), ``interval`` (the interval optimiser), ``refresh_planner`` (the interface), ``tide_planner`` (``tide``);
this module holds the two baselines and ``make_refresh_planner``, and re-exports the public names.
"""

from __future__ import annotations

import numpy as np

from ..errors import MoeOffloadError
from .activation_tracker import ActivationTracker
from .costs import TideCosts
from .interval import IntervalChoice, IntervalOptimiser
from .policy_spec import PolicySpec, parse_policy
from .refresh_plan import LayerDecision, RefreshPlan, Round, Transfer, select_top
from .refresh_planner import RefreshPlanner
from .stability import StabilityEstimator
from .tide_planner import TidePlanner

__all__ = ["ActivationTracker", "IntervalChoice", "IntervalOptimiser", "LayerDecision", "ReactivePlanner",
           "RefreshPlan", "RefreshPlanner", "Round", "StabilityEstimator", "TideFixedPlanner", "TidePlanner",
           "Transfer", "make_refresh_planner", "select_top"]


class ReactivePlanner(RefreshPlanner):
    """Per-step on-demand loading with LRU eviction at the budget, no host fallback (the AR-style baseline TIDE
    compares against: "swap E1 out, E3 in" at every step).

    One ``core.slots.SlotTable`` with ``budget`` slots and an ``LRU`` policy per layer: needed experts are planned
    in ascending id order, resident ones are hits, the others are loaded on demand (evicting the least recently
    used expert the layer does not need); when a layer needs more experts than the budget, the table runs rounds
    (``SlotTable.plan_layer``) and an expert may be loaded and evicted within one step.
    """

    name = "reactive"

    def __init__(self, num_layers: int, num_experts: int, budget: int):
        super().__init__(num_layers, num_experts, budget)
        from .policies import LRU
        from .slots import SlotTable

        self._tables = [SlotTable(self.budget, self.num_experts, LRU()) for _ in range(self.num_layers)]
        if self.budget == self.num_experts:
            for t in self._tables:
                t.plan_layer(list(range(self.num_experts)))  # FullLoad start (not counted as swaps)
        self._resident = [t.policy.resident for t in self._tables]  # the LRU policy's set of slotted experts

    def _route(self, layer, counts):
        table = self._tables[layer]
        act = np.flatnonzero(counts)
        before = {int(e) for e in act if table.is_resident(int(e))}
        plan = table.plan_layer([int(e) for e in act], [int(counts[e]) for e in act])
        loads = [ld.eid for r in plan.rounds for ld in r.loads]
        evicted = [ld.evicted for r in plan.rounds for ld in r.loads if ld.evicted >= 0]
        self.stats["swaps"] += len(loads)
        self.stats["blocking_swaps"] += len(loads)
        tr = Transfer(layer=layer, load=loads, evict=evicted, blocking=True) if loads else None
        dev = [int(e) for e in act]
        return LayerDecision(layer=layer, device=dev, host=[], transfer=tr,
                             hit_tokens=int(sum(counts[e] for e in before)), hit_experts=len(before),
                             device_tokens=int(counts[act].sum()) if len(act) else 0, host_tokens=0,
                             slot_plan=plan)


class TideFixedPlanner(RefreshPlanner):
    """TIDE's fixed-interval refresh, the authors' reference behaviour (``jump_steps``; module docstring).

    At every step ``s`` of a block with ``s % interval == 0`` each layer refreshes synchronously from its current
    step's counts; other steps compute misses on the host.

    Args:
        interval: T, steps between refreshes (>= 1).
        refresh_first_block: also refresh at every step of a request's first block (the authors' latest code
            does, ``num_block == prefill_blocks``); default False.
    """

    name = "tide-fixed"

    def __init__(self, num_layers: int, num_experts: int, budget: int, interval: int = 1,
                 refresh_first_block: bool = False):
        super().__init__(num_layers, num_experts, budget)
        if interval < 1:
            raise MoeOffloadError(f"the refresh interval must be >= 1 step, got {interval}")
        self.interval = int(interval)
        self.refresh_first_block = bool(refresh_first_block)
        self.name = f"tide-fixed-T{self.interval}"
        self._first_block = None

    def begin_block(self, request, block):
        if request != self.request:
            self._first_block = block
        super().begin_block(request, block)

    def _route(self, layer, counts):
        before = set(self._resident[layer])
        refresh = self.step % self.interval == 0 or (self.refresh_first_block and self.block == self._first_block)
        tr = self._sync_refresh(layer, counts) if refresh else None
        if tr is not None and not tr.load and not tr.evict:
            tr = None
        return self._decision(layer, counts, before, tr)


def make_refresh_planner(policy: PolicySpec | str, num_layers: int, num_experts: int, budget: int, *,
                         costs: TideCosts | None = None, interval: int = 1, tau_max: int = 16, **kw) -> RefreshPlanner:
    """The planner of a refresh policy (``core.policy_spec``): ``reactive``, ``tide-fixed`` (its own interval
    ``tide-fixed-T<n>``, else ``interval``) or ``tide`` (needs ``costs``; ``tau_max``, ``block_start``,
    ``estimator_kw`` in ``kw``). A name is parsed by ``parse_policy``.

    Raises:
        MoeOffloadError: an unknown name or one that is not a refresh planner, ``tide`` without costs, or bad
            arguments.
    """
    spec = parse_policy(policy)
    if spec.family == "reactive":
        return ReactivePlanner(num_layers, num_experts, budget)
    if spec.family == "tide-fixed":
        return TideFixedPlanner(num_layers, num_experts, budget,
                                interval=interval if spec.interval is None else spec.interval, **kw)
    if spec.family == "tide":
        if costs is None:
            raise MoeOffloadError("the tide planner needs a cost model (core.costs.TideCosts)")
        return TidePlanner(num_layers, num_experts, budget, costs, tau_max=tau_max, **kw)
    raise MoeOffloadError(f"unknown planner {spec.name!r}; choose one of: reactive, tide-fixed[-T<n>], tide")
