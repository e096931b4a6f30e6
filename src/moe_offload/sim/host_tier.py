"""The host cache tier in the simulator: three tiers, disk -> host cache -> device slots (issue 35).

``HostTierReplay`` replays the device tier's misses (the experts each layer loads on demand, in order:
``sim.simulator.replay``'s ``on_loads``) through a host cache of ``rows`` experts with an eviction policy from
``core.policies``, making the same policy calls in the same order as the runtime's ``runtime.host_cache.HostCache``
(``on_access`` of every request, a victim only when no row is free, ``on_evict`` then ``on_insert``), so a sequence
of requests gets the same hits and misses in both (tested). ``three_tier_load_s`` turns its hit rate into the
seconds one device miss costs: the host->device copy, plus a disk read for a host-cache miss.

The time model's stall is linear in the misses, so the decode time of a replay with the per-miss cost averaged over
its decode steps equals the sum over steps: the projection is exact for the on-demand (history) policies. The
prefetching policies' link model (one link, ``sim.prefetch_sim``) has no second tier: not projected.

Units: seconds, bytes.
"""

from __future__ import annotations

from ..core.policies import make_policy
from ..core.policy_spec import PolicySpec
from ..errors import MoeOffloadError


class HostTierReplay:
    """A host cache of ``rows`` experts in front of the disk, fed the device tier's misses (``on_loads``).

    Args:
        rows: experts the host cache holds, >= 1.
        policy: its eviction policy, a history policy (``lru``, ``lfu``, ``lfru[-H]``; a name is parsed).

    Attributes:
        hits, misses: decode-step requests served from the cache / read from disk (prefill requests change the
            cache's contents but are not counted: the projection is of decode speed).
        evictions: experts the cache dropped (all steps).

    Raises:
        MoeOffloadError: ``rows`` < 1 or an unknown policy.
    """

    def __init__(self, rows: int, policy: PolicySpec | str = "lru"):
        if rows < 1:
            raise MoeOffloadError(f"a host cache needs at least one expert row, got {rows}")
        self.rows = int(rows)
        self.policy = make_policy(policy, num_slots=self.rows, top_k=1)
        self.hits = self.misses = self.evictions = 0
        self._tick = 0

    def __call__(self, step: int, eids: list[int]) -> None:
        """The device tier loaded ``eids`` (global expert ids, in order) during ``step`` (0 = a prefill)."""
        pol = self.policy
        for eid in eids:
            self._tick += 1
            pol.on_access(eid, self._tick)
            if eid in pol.resident:
                self.hits += step > 0
                continue
            self.misses += step > 0
            if len(pol.resident) >= self.rows:
                victim = pol.victim(set())
                pol.on_evict(victim)
                self.evictions += 1
            pol.on_insert(eid, self._tick)

    @property
    def hit_rate(self) -> float:
        """Decode requests served from the host cache / all decode requests (0.0 without any)."""
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def three_tier_load_s(host_load_s: float, disk_load_s: float, host_hit_rate: float) -> float:
    """Seconds of one device miss with a host cache: the host->device copy ``host_load_s``, plus the disk read
    ``disk_load_s`` for the share ``1 - host_hit_rate`` that misses the host cache too (serial: a miss waits for
    both)."""
    return host_load_s + (1.0 - host_hit_rate) * disk_load_s
