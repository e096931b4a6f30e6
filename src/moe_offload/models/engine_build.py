"""The engine a load builds for its policy (a ``core.policy_spec.PolicySpec``): the check that the runtime can run
it on the model, before any work, and the engine over a store and a slot pool (``OffloadEngine`` with its slot table
and prefetcher, or ``RefreshEngine``). ``models.loader`` calls these.
"""

from __future__ import annotations

from ..common.threads import compute_share
from ..core.policies import make_policy
from ..core.prefetch_cost import CostMeter
from ..core.policy_spec import PolicySpec
from ..core.slots import SlotTable
from ..errors import MoeOffloadError
from ..runtime.engine import OffloadEngine
from ..runtime.pool import SlotPool
from .registry import Architecture


def check_policy(spec: PolicySpec, arch: Architecture, interval: int) -> None:
    """Reject a policy the runtime cannot run on ``arch`` before any work.

    Raises:
        MoeOffloadError: a simulator-only policy (Belady, seqmoe-oracle, xl-oracle), a refresh planner for a model
            that is not a diffusion model, or a bad ``tide-fixed`` interval (one line)."""
    if spec.simulator_only:
        raise MoeOffloadError(f"policy {spec.name!r} needs the future and is only available in the simulator")
    if spec.refresh and not arch.diffusion:
        raise MoeOffloadError(f"--policy {spec.name} refreshes experts per diffusion step: it is for diffusion models "
                              f"(e.g. llada2_moe), not {arch.name}")
    if spec.refresh and spec.family != "tide":
        from ..core.refresh import make_refresh_planner

        make_refresh_planner(spec, 1, 1, 1, interval=interval)


def make_engine(spec: PolicySpec, store, pool: SlotPool, mods: list, num_slots: int, top_k: int, num_experts: int,
                budget: int | None, opts: dict):
    """The engine that runs the experts of policy ``spec``: a ``RefreshEngine`` (TIDE planners) or an
    ``OffloadEngine`` with the policy's slot table (forecast-driven policies: probabilistic Belady, SeqMoE §7.1; with
    a prefetch scheduler, a ``Prefetcher``; ``auto``: LRU until its chooser picks a history policy)."""
    from ..runtime.transfer import make_transfer_engine

    L, n_total = len(mods), len(mods) * num_experts
    if spec.refresh:
        from ..core.refresh import make_refresh_planner
        from ..runtime.refresh_calibrate import calibrate_costs
        from ..runtime.refresh_engine import RefreshEngine

        transfer = make_transfer_engine(store, pool, link_gbps=opts["link_gbps"],
                                        seconds_per_expert=opts["seconds_per_expert"])
        host = dict(host_seconds_per_token_expert=opts["host_seconds_per_token_expert"],
                    host_seconds_per_expert=opts["host_seconds_per_expert"])
        costs = None
        if spec.family == "tide":
            costs = calibrate_costs(mods[0][1], store, pool, transfer, L, num_experts, top_k, **host)
        planner = make_refresh_planner(spec, L, num_experts, budget, costs=costs, interval=opts["interval"])
        return RefreshEngine(store, pool, planner, L, num_experts, transfer, **host)
    if spec.forecast_driven:  # SeqMoE §7.1 eviction; forecasts come from a predictor (ForecastFeed)
        from ..core.prob_belady import forecast_eviction
        from ..runtime.kernels import belady_scores_kernel, belady_victim_kernel

        policy_obj = forecast_eviction(spec, num_experts, belady_victim_kernel(), belady_scores_kernel())
    elif spec.family == "auto":  # LRU until its chooser swaps in the best history policy after the first prefill
        policy_obj = make_policy("lru")
    else:
        policy_obj = make_policy(spec, num_slots=num_slots, top_k=top_k, num_moe_layers=L)
    policy_obj.name = spec.name
    scheduler = spec.prefetch
    table = SlotTable(num_slots, n_total, policy_obj, experts_per_layer=num_experts if scheduler else None)
    engine = OffloadEngine(store, pool, table, num_experts)
    if spec.family == "auto":
        from ..runtime.auto_policy import AutoPolicyChooser

        engine.auto_policy = AutoPolicyChooser(table, L, num_experts, top_k)
        engine.observers.append(engine.auto_policy)
    if scheduler:
        from ..core.prefetch import make_scheduler
        from ..runtime.prefetcher import Prefetcher

        transfer = make_transfer_engine(store, pool, link_gbps=opts["link_gbps"],
                                        seconds_per_expert=opts["seconds_per_expert"])
        engine.prefetcher = Prefetcher(store, pool, table,
                                       make_scheduler(scheduler, num_moe_layers=L, b_avg=opts["link_epl"],
                                                      auto_ema=False),
                                       transfer, L, num_experts, top_k, meter=_cost_meter(spec, transfer))
    return engine


def _cost_meter(spec, transfer):
    """A ``+gate`` policy's ``core.prefetch_cost.CostMeter`` (None otherwise). Contention: the share of the cores
    the compute's threads use (on two cores with two compute threads every CPU second a copy takes is lost);
    pre-emption: how much of one read a miss waits behind a prefetch on ``transfer``'s link (its
    ``preempt_share``: one chunk on the disk tier)."""
    if not spec.gated:
        return None
    return CostMeter(contention=compute_share(), preempt=transfer.preempt_share)
