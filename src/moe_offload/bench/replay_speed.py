"""Speed of the trace simulator (DESIGN.md §6): how many expert accesses per second ``replay`` processes.

An *access* is one (layer execution, needed expert) pair, i.e. ``hits + misses`` of a replay. The target is
>= 200k accesses/s on one core, measured on a synthetic trace of Qwen3-30B-A3B's geometry (48 x 128 x top-8).
"""

from __future__ import annotations

import time

TARGET_ACCESSES_PER_S = 200_000


def bench_replay_speed(seconds: float = 5.0, residency: float = 0.25, policy: str = "lru",
                       num_moe_layers: int = 48, num_experts: int = 128, top_k: int = 8, skew: float = 1.0,
                       reuse: float = 0.5, prompt_tokens: int = 16, seed: int = 0) -> dict:
    """Measure ``sim.simulator.replay`` throughput on a synthetic trace sized to take about ``seconds``.

    A short probe replay sizes the trace; then three phases are timed separately with ``time.perf_counter``:
    generating the synthetic trace, ``layer_needs`` (per-step, per-layer distinct experts; shared across the
    replays of a sweep) and ``replay(..., needs=...)`` itself.

    Args:
        seconds: approximate wall time of the timed replay (s).
        residency: slots as a fraction of all routed experts (SeqMoE's "% Loaded").
        policy: eviction policy name (``core.policies.make_policy``).
        num_moe_layers, num_experts, top_k, skew, reuse, prompt_tokens, seed: the synthetic trace
            (``trace.synthetic.synthetic_trace``; one request).

    Returns:
        dict: ``steps``, ``slots``, ``accesses`` (hits + misses), ``hit_rate``, ``generate_s``, ``layer_needs_s``,
        ``replay_s`` (seconds), ``accesses_per_s`` (replay only), ``accesses_per_s_with_needs`` (layer_needs +
        replay), ``target_accesses_per_s`` (200k) and ``meets_target`` (replay-with-needs rate >= target).
    """
    from ..trace.synthetic import synthetic_trace
    from ..sim.simulator import layer_needs, replay

    slots = max(1, int(round(residency * num_moe_layers * num_experts)))
    geo = dict(num_moe_layers=num_moe_layers, num_experts=num_experts, top_k=top_k, skew=skew, reuse=reuse,
               prompt_tokens=prompt_tokens, seed=seed)

    probe_steps = 100
    probe = synthetic_trace(steps=probe_steps, **geo)
    t0 = time.perf_counter()
    r = replay(probe, slots, policy)
    rate = r.accesses / max(time.perf_counter() - t0, 1e-9)
    steps = int(min(max(rate * seconds / (num_moe_layers * top_k), probe_steps), 1_000_000))

    t0 = time.perf_counter()
    trace = synthetic_trace(steps=steps, **geo)
    t1 = time.perf_counter()
    needs = layer_needs(trace)
    t2 = time.perf_counter()
    res = replay(trace, slots, policy, needs=needs)
    t3 = time.perf_counter()
    replay_s, needs_s = t3 - t2, t2 - t1
    with_needs = res.accesses / (replay_s + needs_s)
    return {
        "geometry": f"{num_moe_layers}x{num_experts}x{top_k}", "policy": policy, "residency": residency,
        "steps": steps, "slots": slots, "accesses": res.accesses, "hit_rate": res.hit_rate,
        "generate_s": t1 - t0, "layer_needs_s": needs_s, "replay_s": replay_s,
        "accesses_per_s": res.accesses / replay_s, "accesses_per_s_with_needs": with_needs,
        "target_accesses_per_s": TARGET_ACCESSES_PER_S, "meets_target": with_needs >= TARGET_ACCESSES_PER_S,
    }
