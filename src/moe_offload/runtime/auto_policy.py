"""``--policy auto`` in the runtime: the engine observer that records the first prefill's routing and installs the
history policy ``core.auto_policy.choose_policy`` picks from it."""

from __future__ import annotations

import time

import numpy as np

from ..core.auto_policy import choose_policy
from ..core.policies import make_policy


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
