"""A prefetch at the price it is worth (issue 47, part 3; DESIGN.md §12 "A forecast's value is seconds").

A prefetch task whose expert its layer uses with probability ``conf`` (``core.prefetch_queue.inclusion_probabilities``:
the forecast row scaled to sum to top-k, whichever scale the forecast came in) saves, in expectation,
``conf x miss_s``: the seconds a decode step stalls on an on-demand copy of one expert. It
costs ``prefetch_cpu_s x contention`` whether or not the forecast was right: the CPU seconds its copy takes (the
reads' system time, the staging copy into the slot) times the share of them the compute loses, 1.0 when every core
computes (this machine: two cores, two compute threads), 0 when the copy runs where nothing computes (a GPU's DMA
engine). A task is queued only when the saving exceeds the cost:

    conf x miss_s > prefetch_cpu_s x contention,   i.e.  conf > min_confidence = prefetch_cpu_s x contention / miss_s

``submit_forecast`` (``core.prefetch_queue``) applies it for the runtime's prefetcher and the simulator alike. The
runtime measures both costs as it runs (``CostMeter``: the on-demand copies' wall time and the prefetch copies' CPU
time per expert, from ``runtime.cpu_account``); the simulator is given them.

Units: seconds per expert; ``conf`` and ``contention`` in [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import MoeOffloadError


@dataclass(frozen=True)
class PrefetchCost:
    """The seconds one expert's prefetch saves and costs (module docstring).

    Attributes:
        miss_s: wall seconds a step waits for one on-demand expert copy (> 0).
        prefetch_cpu_s: CPU seconds one prefetch copy takes (>= 0).
        contention: the share of ``prefetch_cpu_s`` the compute loses, in [0, 1].
    Raises:
        MoeOffloadError: a value out of its range or not finite.
    """

    miss_s: float
    prefetch_cpu_s: float
    contention: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.miss_s) and self.miss_s > 0):
            raise MoeOffloadError(f"miss_s must be a positive number of seconds, got {self.miss_s}")
        if not (math.isfinite(self.prefetch_cpu_s) and self.prefetch_cpu_s >= 0):
            raise MoeOffloadError(f"prefetch_cpu_s must be >= 0 seconds, got {self.prefetch_cpu_s}")
        if not 0.0 <= self.contention <= 1.0:
            raise MoeOffloadError(f"contention must be in [0, 1], got {self.contention}")

    @property
    def min_confidence(self) -> float:
        """The confidence a task needs to be worth its copy (may exceed 1: then no prefetch is)."""
        return self.prefetch_cpu_s * self.contention / self.miss_s

    def worth(self, conf: float) -> bool:
        """Whether a task of confidence ``conf`` saves more than it costs (strictly)."""
        return conf * self.miss_s > self.prefetch_cpu_s * self.contention


class CostMeter:
    """A ``PrefetchCost`` measured as the runtime runs: exponential moving averages of the on-demand copies' wall
    seconds per expert and the prefetch copies' CPU seconds per expert, each fed per decode step with that step's
    totals (``observe``). ``cost`` is None until both have been seen (no gate before the first measurements).

    Args:
        contention: as ``PrefetchCost``.
        alpha: the weight of a step's sample, in (0, 1].
    Raises:
        MoeOffloadError: ``alpha`` outside (0, 1], or ``contention`` outside [0, 1].
    """

    def __init__(self, contention: float = 1.0, alpha: float = 0.2):
        if not 0.0 < alpha <= 1.0:
            raise MoeOffloadError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 <= contention <= 1.0:
            raise MoeOffloadError(f"contention must be in [0, 1], got {contention}")
        self.contention, self.alpha = contention, alpha
        self.miss_s: float | None = None
        self.prefetch_cpu_s: float | None = None

    def _ema(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1.0 - self.alpha) * old + self.alpha * sample

    def observe(self, on_demand_experts: int, on_demand_wall_s: float, prefetched_experts: int,
                prefetch_cpu_s: float) -> None:
        """One step's totals: experts copied on demand and the wall seconds the step spent on them; experts
        prefetched and the CPU seconds their copies took. A count of 0 leaves its average as it was."""
        if on_demand_experts > 0 and on_demand_wall_s > 0:
            self.miss_s = self._ema(self.miss_s, on_demand_wall_s / on_demand_experts)
        if prefetched_experts > 0:
            self.prefetch_cpu_s = self._ema(self.prefetch_cpu_s, max(0.0, prefetch_cpu_s) / prefetched_experts)

    @property
    def cost(self) -> PrefetchCost | None:
        """The current ``PrefetchCost``, or None before both costs were measured."""
        if self.miss_s is None or self.prefetch_cpu_s is None:
            return None
        return PrefetchCost(self.miss_s, self.prefetch_cpu_s, self.contention)
