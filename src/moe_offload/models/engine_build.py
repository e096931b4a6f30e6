"""Which policy a load asks for and the engine that runs it: the policy names the runtime knows (history policies,
forecast-driven SeqMoE policies, TIDE's diffusion refresh planners), their check before any work, and the engine
built for them over a store and a slot pool (``OffloadEngine`` with its slot table and prefetcher, or
``RefreshEngine``). ``models.loader`` calls these; the CLI and the server read the names.
"""

from __future__ import annotations

from ..core.policies import make_policy
from ..core.slots import SlotTable
from ..errors import MoeOffloadError
from ..runtime.engine import OffloadEngine
from ..runtime.pool import SlotPool
from .registry import Architecture


def is_refresh_policy(policy: str) -> bool:
    """Whether ``policy`` names a diffusion refresh planner (``reactive``, ``tide-fixed[-T<n>]``, ``tide``)."""
    p = policy.lower()
    return p in ("reactive", "tide") or p.startswith("tide-fixed")


# runtime policy names driven by a predictor's forecasts -> their prefetch scheduler (None: no prefetching)
FORECAST_RUNTIME_POLICIES = {"seqmoe-cacheonly": None, "seqmoe": "jsd", "seqmoe-infinity": "moe-infinity",
                             "xl": "jsd", "seqmoe-xl": "jsd"}
#: of those, the ones a trained predictor must drive (``xl`` runs on the model's own routers, predictor.cross_layer)
PREDICTOR_POLICIES = ("seqmoe-cacheonly", "seqmoe", "seqmoe-infinity", "seqmoe-xl")


def check_policy(policy: str, arch: Architecture, interval: int) -> bool:
    """Reject an unknown, simulator-only or misplaced policy before any work; True for a refresh planner.

    Raises:
        MoeOffloadError: an unknown policy, a simulator-only one (Belady), or a refresh planner for a model that is not
            a diffusion model (one line, naming the choices)."""
    refresh = is_refresh_policy(policy)
    if refresh and not arch.diffusion:
        raise MoeOffloadError(f"--policy {policy} refreshes experts per diffusion step: it is for diffusion models "
                              f"(e.g. llada2_moe), not {arch.name}")
    if refresh:
        from ..core.refresh import make_refresh_planner

        if policy.lower() != "tide":
            make_refresh_planner(policy, 1, 1, 1, interval=interval)
    elif policy not in FORECAST_RUNTIME_POLICIES and policy != "auto":
        try:
            make_policy(policy, num_slots=1, top_k=1)
        except MoeOffloadError as e:
            if "only available in the simulator" in str(e):
                raise
            raise MoeOffloadError(f"unknown policy {policy!r}; choose one of: auto, lru, lfu, lfru[-H], prefill-hot, "
                                  f"{', '.join(FORECAST_RUNTIME_POLICIES)} (with a predictor); diffusion models: "
                                  "reactive, tide-fixed-T<n>, tide") from None
    return refresh


def make_engine(policy: str, refresh: bool, store, pool: SlotPool, mods: list, num_slots: int, top_k: int,
                 num_experts: int, budget: int | None, opts: dict):
    """The engine that runs the experts: a ``RefreshEngine`` (TIDE planners) or an ``OffloadEngine`` with the
    policy's slot table (and, for ``seqmoe``/``seqmoe-infinity``, a ``Prefetcher``)."""
    from ..runtime.transfer import make_transfer_engine

    L, n_total = len(mods), len(mods) * num_experts
    if refresh:
        from ..core.refresh import make_refresh_planner
        from ..runtime.refresh_calibrate import calibrate_costs
        from ..runtime.refresh_engine import RefreshEngine

        transfer = make_transfer_engine(store, pool, link_gbps=opts["link_gbps"],
                                        seconds_per_expert=opts["seconds_per_expert"])
        host = dict(host_seconds_per_token_expert=opts["host_seconds_per_token_expert"],
                    host_seconds_per_expert=opts["host_seconds_per_expert"])
        costs = None
        if policy.lower() == "tide":
            costs = calibrate_costs(mods[0][1], store, pool, transfer, L, num_experts, top_k, **host)
        planner = make_refresh_planner(policy, L, num_experts, budget, costs=costs, interval=opts["interval"])
        return RefreshEngine(store, pool, planner, L, num_experts, transfer, **host)
    if policy in FORECAST_RUNTIME_POLICIES:  # SeqMoE §7.1 eviction; forecasts come from a predictor (ForecastFeed)
        from ..core.prob_belady import ProbabilisticBelady

        policy_obj = ProbabilisticBelady(num_experts, horizon=8, lam=0.5)
        policy_obj.name = policy
    else:  # "auto" starts as LRU; its chooser swaps in the best history policy after the first prefill
        policy_obj = make_policy("lru" if policy == "auto" else policy, num_slots=num_slots, top_k=top_k,
                                 num_moe_layers=L)
        policy_obj.name = policy
    scheduler = FORECAST_RUNTIME_POLICIES.get(policy)
    table = SlotTable(num_slots, n_total, policy_obj, experts_per_layer=num_experts if scheduler else None)
    engine = OffloadEngine(store, pool, table, num_experts)
    if policy == "auto":
        from ..runtime.auto_policy import AutoPolicyChooser

        engine.auto_policy = AutoPolicyChooser(table, L, num_experts, top_k)
        engine.observers.append(engine.auto_policy)
    if scheduler:
        from ..core.prefetch import make_scheduler
        from ..runtime.prefetcher import Prefetcher

        engine.prefetcher = Prefetcher(store, pool, table,
                                       make_scheduler(scheduler, num_moe_layers=L, b_avg=opts["link_epl"],
                                                      auto_ema=False),
                                       make_transfer_engine(store, pool, link_gbps=opts["link_gbps"],
                                                            seconds_per_expert=opts["seconds_per_expert"]),
                                       L, num_experts, top_k)
    return engine
