"""The disk store's read counters (``runtime.disk_store.DiskStore.stats``): requests, bytes, busy and on-demand
time, and the on-demand reads' efficiency against a measured disk.

Units: bytes; seconds; GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DiskReadStats:
    """Counters of a ``DiskStore``.

    ``requests`` (preadv calls), ``bytes_read`` (aligned span bytes transferred), ``expert_bytes`` (field bytes
    delivered), ``experts`` (experts read), ``busy_s`` (seconds spent in reads, summed over threads). ``gbps`` is
    ``bytes_read / busy_s / 1e9`` (per-thread bandwidth).

    On-demand reads (``copy_to`` / ``copy_many``, misses the engine waits for): ``demand_s`` (wall seconds during
    which at least one was outstanding), ``demand_bytes`` (their aligned bytes) and ``demand_reads`` ``{(span
    bytes, queue depth at its start): reads}``, from which ``demand_efficiency`` compares them with a measured disk.
    Prefetches (``read_prefetch``): ``prefetch_yields`` (chunks held back for on-demand reads),
    ``prefetch_cancelled`` (prefetches stopped at a chunk because their copy was cancelled). ``in_place``: experts
    read straight into their destination (from an expert pack: no staging copy).
    """

    requests: int = 0
    bytes_read: int = 0
    expert_bytes: int = 0
    experts: int = 0
    busy_s: float = 0.0
    demand_s: float = 0.0
    demand_bytes: int = 0
    demand_reads: dict = field(default_factory=dict)
    prefetch_yields: int = 0
    prefetch_cancelled: int = 0
    in_place: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.busy_s / 1e9 if self.busy_s > 0 else 0.0

    @property
    def demand_gbps(self) -> float:
        """GB/s of on-demand reads while they were outstanding: ``demand_bytes / demand_s / 1e9`` (0: none)."""
        return self.demand_bytes / self.demand_s / 1e9 if self.demand_s > 0 else 0.0

    def demand_efficiency(self, gbps_at) -> float | None:
        """Share of a measured disk's speed the on-demand reads reached: the seconds the disk needs for these reads at
        its measured bandwidth (``gbps_at(span_bytes, depth)`` GB/s for all ``depth`` reads in flight together, so one
        read takes ``span_bytes / gbps`` of wall time) over ``demand_s``. 1.0 = as fast as ``bench link --disk``
        measured; None when no on-demand read was made."""
        if self.demand_s <= 0 or not self.demand_reads:
            return None
        ideal = sum(n * size / (gbps_at(size, depth) * 1e9) for (size, depth), n in self.demand_reads.items())
        return ideal / self.demand_s
