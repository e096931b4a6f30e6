"""Trace-driven replay through the decision core (DESIGN.md §6).

``replay`` walks a trace step by step and, inside a step, MoE layer by MoE layer, exactly as the runtime executes
the model, and asks the same ``SlotTable`` + eviction policy for each layer's plan. The runtime's measured hits
and misses on a run therefore equal the simulator's on that run's trace (a test checks it). Time is charged by a
separate, replaceable time model (``sim.timemodel``) from the per-step counts collected here.
"""

from __future__ import annotations

import numpy as np

from ..core.eviction import EvictionPolicy
from ..core.policies import make_policy
from ..core.policy_spec import PolicySpec, parse_policy
from ..core.replay import ReplayResult, replay_needs
from ..trace.format import Trace


def layer_needs(trace: Trace) -> list[tuple[int, int, list[list[int]], list[list[int]]]]:
    """Per step, per MoE layer: the distinct global expert ids needed and how many tokens chose each.

    Returns ``[(request, step, needed[L], tokens[L])]`` in replay order, with ``needed[l]`` sorted ints
    ``l * E + e`` and ``tokens[l]`` aligned counts.
    """
    E, L = trace.num_experts, trace.num_moe_layers
    out = []
    offs = (np.arange(L, dtype=np.int64) * E)[None, :, None]
    gids = trace.expert_ids.astype(np.int64) + offs  # [N, L, k]
    sorted_rows = np.sort(gids, axis=-1)  # a one-token step's distinct experts: sorting is its np.unique
    repeats = (sorted_rows[..., 1:] == sorted_rows[..., :-1]).any(axis=(1, 2))  # [N]: a token chose one expert twice
    ones = [1] * trace.top_k
    for req, step, a, b in trace.steps():
        if b - a == 1 and not repeats[a]:
            needed = sorted_rows[a].tolist()
            tokens = [ones] * L
        else:
            needed, tokens = [], []
            for layer in range(L):
                u, c = np.unique(gids[a:b, layer, :], return_counts=True)
                needed.append(u.tolist())
                tokens.append(c.tolist())
        out.append((req, step, needed, tokens))
    return out


def build_policy(policy: PolicySpec | str, trace: Trace, num_slots: int, needs=None) -> EvictionPolicy:
    """The eviction policy object of ``policy`` (a ``core.policy_spec.PolicySpec``; a name is parsed) for replaying
    ``trace``: Belady gets the trace's future (one entry per layer execution); a forecast-driven policy is SeqMoE's
    probabilistic Belady (§7.1, c = 8, lambda = 0.5), to be fed forecasts (``replay(..., forecasts=...)``); the
    others as ``core.policies.make_policy`` builds them.

    Raises:
        MoeOffloadError: an unknown name, or a policy that is not an eviction policy (a refresh planner, auto)."""
    spec = parse_policy(policy)
    if spec.forecast_driven:
        from ..core.prob_belady import forecast_eviction
        from ..runtime.kernels import belady_scores_kernel, belady_victim_kernel

        return forecast_eviction(spec, trace.num_experts, belady_victim_kernel(build=False),
                                 belady_scores_kernel(build=False))
    future = None
    if spec.family == "belady":
        needs = needs if needs is not None else layer_needs(trace)
        future = [layer for _, _, needed, _ in needs for layer in needed]
    return make_policy(spec, num_slots=num_slots, top_k=trace.top_k, future=future,
                       num_moe_layers=trace.num_moe_layers)


def replay(trace: Trace, num_slots: int, policy: PolicySpec | str | EvictionPolicy, needs=None, forecasts=None,
           on_loads=None) -> ReplayResult:
    """Replay ``trace`` with a pool of ``num_slots`` slots under ``policy`` (a spec or name: ``build_policy``; or a
    fresh policy object).

    ``needs`` (from ``layer_needs``) can be passed to share the preprocessing across many replays.
    ``forecasts`` (from ``sim.forecasts.forecast_stream``): predictor forecasts handed to the policy's
    ``observe`` before planning the layer that triggered them (required by forecast-driven policies).
    ``on_loads(step, eids)``: told the experts each layer loads on demand, in order (a tier below the slots, e.g.
    ``sim.host_tier.HostTierReplay``).
    Raises MoeOffloadError for an unknown policy name; ``num_slots`` must be >= 1 (fewer than top-k works here:
    the table processes such layers in rounds, as the runtime does).
    """
    needs = needs if needs is not None else layer_needs(trace)
    pol = policy if isinstance(policy, EvictionPolicy) else build_policy(policy, trace, num_slots, needs)
    return replay_needs(needs, trace.num_moe_layers, trace.num_experts, num_slots, pol, forecasts, on_loads)
