"""``--policy auto``: pick the history eviction policy for this model from a short simulation of routing it has
already seen — the run's own first prefill: its first half (and at least all but its last ``DECODE_SAMPLE`` tokens)
replayed as a prefill step, the rest token by token as decode steps. The sample is bounded: at most
``DECODE_SAMPLE`` decode steps of every MoE layer per candidate, whatever the prompt's length (on the testbeds'
64-token runs the choice takes ~0.1 s / ~0.6 s, under 2% of the run: docs/benchmarks.md).

The prompt's tokens route through the same router as the tokens to come, so which history policy keeps the most
of one token's experts for the next is measured on the user's own routing, at the run's own pool size, by the
same simulator (``sim.simulator.replay``) and policy objects the runtime uses; the decode hit rate decides. Ties go
to the earlier candidate, LRU first, so the choice never does worse than LRU on the simulated routing.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from ..core.policies import make_policy
from .simulator import replay

#: candidates in tie-break order (LRU first)
CANDIDATES = ("lru", "lfu", "lfru-2", "lfru-8", "lfru-32", "prefill-hot")
#: most prompt tokens replayed as decode steps (one per token); the earlier ones form the prefill step
DECODE_SAMPLE = 32


def token_needs(routing: list[np.ndarray], num_experts: int) -> list:
    """``routing[l]``: ``[T, k]`` int expert ids of MoE layer ``l`` for ``T`` tokens -> the simulator's per-step needs
    (``sim.simulator.layer_needs`` format): the first ``max(T // 2, T - DECODE_SAMPLE)`` tokens as one prefill step
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
                  candidates: tuple[str, ...] = CANDIDATES) -> tuple[str, dict[str, float]]:
    """The candidate with the highest simulated decode hit rate on ``routing`` (see the module docstring) and every
    candidate's decode hit rate. ``routing[l]``: ``[T, k]`` expert ids per MoE layer, ``T >= 1``."""
    geom = SimpleNamespace(num_moe_layers=len(routing), num_experts=num_experts, top_k=top_k)
    needs = token_needs(routing, num_experts)
    rates = {}
    for name in candidates:
        pol = make_policy(name, num_slots=num_slots, top_k=top_k, num_moe_layers=len(routing))
        rates[name] = replay(geom, num_slots, pol, needs=needs).decode_hit_rate
    best = max(candidates, key=lambda n: (rates[n], -candidates.index(n)))
    return best, rates


class AutoPolicyChooser:
    """Engine observer behind ``--policy auto``: records the first prefill's routing, and when the first decode
    step begins, swaps the slot table's interim LRU for ``choose_policy``'s choice (its resident experts handed
    over in recency order). ``choice`` and ``rates`` say what it chose (``None`` until then), ``decide_s`` how many
    seconds choosing took (the simulation and the switch).

    Args:
        table: the engine's ``core.slots.SlotTable`` (its policy is an ``LRU`` until the choice).
        num_moe_layers, num_experts, top_k: the model's geometry.
    """

    def __init__(self, table, num_moe_layers: int, num_experts: int, top_k: int):
        self.table, self.L, self.E, self.k = table, num_moe_layers, num_experts, top_k
        self.routing: list[np.ndarray] = []
        self.recording = False
        self.request = 0
        self.choice: str | None = None
        self.rates: dict[str, float] = {}
        self.decide_s = 0.0

    def begin_step(self, request: int, step: int) -> None:
        if self.choice is not None:
            return
        if step == 0 and not self.routing:
            self.recording, self.request = True, request
        elif self.recording and len(self.routing) == self.L:
            self.recording = False
            t0 = time.perf_counter()
            if self.table.num_slots >= self.L * self.E:  # the pool holds every expert: nothing to choose
                self._switch("lru", {}, request, step)
            else:
                self._switch(*choose_policy(self.routing, self.E, self.k, self.table.num_slots), request, step)
            self.decide_s = time.perf_counter() - t0

    def __call__(self, moe_layer: int, top_k_index, top_k_weights) -> None:
        if self.recording and moe_layer == len(self.routing):
            self.routing.append(top_k_index.detach().cpu().numpy())

    def _switch(self, name: str, rates: dict[str, float], request: int, step: int) -> None:
        """Install ``name`` as the table's policy, handing over what the interim LRU saw: the resident experts
        (least recently used first) and the recorded prefill's accesses (so LFU has its counts and prefill-hot its
        hot set), then the step that is beginning."""
        old = self.table.policy
        new = make_policy(name, num_slots=self.table.num_slots, top_k=self.k, num_moe_layers=self.L)
        tick = self.table.tick
        for eid in list(getattr(old, "_order", old.resident)):
            new.on_insert(eid, tick)
        new.on_step(self.request, 0)
        for layer, r in enumerate(self.routing):
            ids, counts = np.unique(r.reshape(-1), return_counts=True)
            for e, c in zip(ids.tolist(), counts.tolist()):
                new.on_access(layer * self.E + e, tick, c)
        new.on_step(request, step)
        new.name = f"auto:{name}"
        self.table.policy = new
        self.choice, self.rates = name, rates
