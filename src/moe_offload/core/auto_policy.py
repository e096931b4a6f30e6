"""``--policy auto``: pick the history eviction policy for this model from a short simulation of routing it has
already seen — the run's own first prefill: its first half (and at least all but its last ``DECODE_SAMPLE`` tokens)
replayed as a prefill step, the rest token by token as decode steps. The sample is bounded: at most
``DECODE_SAMPLE`` decode steps of every MoE layer per candidate, whatever the prompt's length (on the testbeds'
64-token runs the choice takes ~0.1 s / ~0.6 s, under 2% of the run: docs/benchmarks.md).

The prompt's tokens route through the same router as the tokens to come, so which history policy keeps the most
of one token's experts for the next is measured on the user's own routing, at the run's own pool size, by the
same replay (``core.replay.replay_needs``) and policy objects the runtime uses; the decode hit rate decides. Ties go
to the earlier candidate, LRU first, so the choice never does worse than LRU on the simulated routing.
"""

from __future__ import annotations

import numpy as np

from .policies import make_policy
from .policy_spec import PolicySpec, parse_policy
from .replay import replay_needs

#: candidates in tie-break order (LRU first)
CANDIDATES = tuple(parse_policy(n) for n in ("lru", "lfu", "lfru-2", "lfru-8", "lfru-32", "prefill-hot"))
#: most prompt tokens replayed as decode steps (one per token); the earlier ones form the prefill step
DECODE_SAMPLE = 32


def token_needs(routing: list[np.ndarray], num_experts: int) -> list:
    """``routing[l]``: ``[T, k]`` int expert ids of MoE layer ``l`` for ``T`` tokens -> the simulator's per-step needs
    (``core.replay.replay_needs`` format): the first ``max(T // 2, T - DECODE_SAMPLE)`` tokens as one prefill step
    (step 0, with each expert's token count), then one decode step per remaining token (at most ``DECODE_SAMPLE``)."""
    T = routing[0].shape[0]
    split = max(T // 2, T - DECODE_SAMPLE)
    needed, tokens = [], []
    for layer, r in enumerate(routing):
        ids, cnt = np.unique(r[:split].reshape(-1), return_counts=True)
        needed.append([int(e) + layer * num_experts for e in ids])
        tokens.append([int(c) for c in cnt])
    needs = [(0, 0, needed, tokens)] if split else []
    for t in range(split, T):
        ids = [sorted({int(e) + layer * num_experts for e in r[t]}) for layer, r in enumerate(routing)]
        needs.append((0, t - split + 1, ids, [[1] * len(i) for i in ids]))
    return needs


def choose_policy(routing: list[np.ndarray], num_experts: int, top_k: int, num_slots: int,
                  candidates: tuple[PolicySpec, ...] = CANDIDATES) -> tuple[str, dict[str, float]]:
    """The name of the candidate with the highest simulated decode hit rate on ``routing`` (see the module
    docstring) and every candidate's decode hit rate by name. ``routing[l]``: ``[T, k]`` expert ids per MoE layer,
    ``T >= 1``."""
    needs = token_needs(routing, num_experts)
    rates = {}
    for spec in candidates:
        pol = make_policy(spec, num_slots=num_slots, top_k=top_k, num_moe_layers=len(routing))
        rates[spec.name] = replay_needs(needs, len(routing), num_experts, num_slots, pol).decode_hit_rate
    best = max(candidates, key=lambda c: (rates[c.name], -candidates.index(c)))
    return best.name, rates
