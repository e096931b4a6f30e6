"""A prefetch at the price it is worth (issue 47, part 3; DESIGN.md §12 "A forecast's value is seconds").

A prefetch task whose expert its layer uses with probability ``c`` is weighed in seconds:

- ``c`` is the forecast's chance (``core.prefetch_queue.inclusion_probabilities``: the forecast row scaled to sum
  to top-k, whichever scale the forecast came in) times ``used_scale``, capped at 1: the share of the forecasts'
  candidates their layer then used over the chance they were given (1 until measured; ``UseLedger``). Every
  candidate the gate decides on counts, whether it was prefetched or not (issue 47, session 49). Before, the share
  of *prefetches* used was measured; the gate then saw only what it let through, and fed its own closing: in the
  simulator at 0.09 ms per read it fell to 0.09 of what was promised while ``xl``'s forecasts, ungated, had 43% of
  their prefetches used, and ``xl+gate`` made 2649 prefetches to ``xl``'s 15863.
- Its copy costs ``prefetch_cpu_s x contention`` whether or not it is used: the CPU seconds of its reads and
  staging copy, times the share of them the compute loses (1.0 when every core computes, as on this machine's two
  cores; 0 when the copy runs where nothing computes, a GPU's DMA engine).
- It shares the link (the disk, the PCIe bus) with the misses, which keep it busy a share ``link_busy`` of the
  step. A used prefetch saves a miss's wait ``miss_s`` only where the link would otherwise idle: ``c x miss_s x
  (1 - link_busy)``. A wasted one delays a miss that finds it reading until the link is free again: at most the
  share ``preempt`` of one read, where a miss pre-empts a prefetch at its next chunk (the disk tier's chunks of
  ``DiskStore.prefetch_chunk`` bytes, the emulated link's ``1 / LINK_CHUNKS``; 1 for a copy that cannot be
  stopped), and half of it on average (the miss comes at any point of the chunk it finds reading): ``(1 - c) x
  miss_s x link_busy x preempt / 2``. Until issue 47's session 49 the gate charged a whole read (``preempt`` 1) on
  every link: on the disk, where a miss waits at most a chunk, it refused tasks worth their copy, and shut
  altogether once the forecasts promised more than was used (``used_scale`` < 1). Until session 51 it charged the
  most a miss can wait, not the mean: in the simulator, with the disk's prefetches read one request per expert
  (``preempt`` 1), that shut the gate of ``xl+gate`` at 25% of the experts (89 decode prefetches over three prompts; 1.01x
  ``lru`` where ``xl`` alone projected 1.11x); charged the mean, it stays open (1.12x).

A task is queued only when the saving exceeds the cost (``delay = link_busy x preempt / 2``):

    c x miss_s x (1 - link_busy) > prefetch_cpu_s x contention + (1 - c) x miss_s x delay,
    i.e.  c > threshold = (prefetch_cpu_s x contention / miss_s + delay) / (1 - link_busy + delay)

With an idle link (``link_busy`` 0, as before issue 47's session 40) only the CPU counts. A task sure to be used
(``c`` 1) wastes nothing, so whether even it passes (``threshold < 1``) does not depend on ``preempt``.

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
        link_busy: the share of a step the link carries the misses' reads (the step's wait on them), in [0, 1].
        used_scale: a forecast's chance of use times this is the chance a prefetch is used (> 0; measured: the
            share of the forecasts' candidates their layer used over their mean chance of use, ``UseLedger``).
        preempt: the most a miss waits behind a prefetch already reading, as a share of one read, in (0, 1] (the
            copy engine's ``preempt_share``); the gate charges half of it, the mean wait.
    Raises:
        MoeOffloadError: a value out of its range or not finite.
    """

    miss_s: float
    prefetch_cpu_s: float
    contention: float = 1.0
    link_busy: float = 0.0
    used_scale: float = 1.0
    preempt: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.miss_s) and self.miss_s > 0):
            raise MoeOffloadError(f"miss_s must be a positive number of seconds, got {self.miss_s}")
        if not (math.isfinite(self.prefetch_cpu_s) and self.prefetch_cpu_s >= 0):
            raise MoeOffloadError(f"prefetch_cpu_s must be >= 0 seconds, got {self.prefetch_cpu_s}")
        if not 0.0 <= self.contention <= 1.0:
            raise MoeOffloadError(f"contention must be in [0, 1], got {self.contention}")
        if not 0.0 <= self.link_busy <= 1.0:
            raise MoeOffloadError(f"link_busy must be in [0, 1], got {self.link_busy}")
        if not (math.isfinite(self.used_scale) and self.used_scale > 0):
            raise MoeOffloadError(f"used_scale must be a positive number, got {self.used_scale}")
        if not 0.0 < self.preempt <= 1.0:
            raise MoeOffloadError(f"preempt must be in (0, 1], got {self.preempt}")

    @property
    def threshold(self) -> float:
        """The chance of use ``c`` above which a task saves more than it costs (the module docstring's inequality
        solved for ``c``)."""
        delay = self.link_busy * self.preempt / 2.0  # a miss waits half the chunk it finds reading, on average
        return (self.prefetch_cpu_s * self.contention / self.miss_s + delay) / (1.0 - self.link_busy + delay)

    @property
    def min_confidence(self) -> float:
        """The forecast's chance of use a task needs to be worth its copy (may exceed 1: then no prefetch is)."""
        return self.threshold / self.used_scale

    @property
    def closed(self) -> bool:
        """Whether no task can be worth its copy: not even one the forecast is sure of (chance 1, which a
        chance of use, ``inclusion_probabilities``, never exceeds)."""
        return self.threshold >= min(1.0, self.used_scale)

    def worth(self, conf: float) -> bool:
        """Whether a task the forecast gives chance ``conf`` of use saves more than it costs (strictly)."""
        return min(1.0, conf * self.used_scale) > self.threshold


class CostMeter:
    """A ``PrefetchCost`` measured as the runtime runs, from exponential moving averages of per-decode-step samples
    (``observe``): the on-demand copies' wall seconds per expert (``miss_s``), the prefetch copies' CPU seconds per
    expert, the share of the step spent waiting on the misses (``link_busy``) and the share of the forecasts'
    candidates their layer used over the chance the forecasts gave them (``used_scale``, from a ``UseLedger``).
    ``cost`` is None until the first two have been seen (no gate before the first measurements); the last two start
    at 0 and 1.

    Args:
        contention, preempt: as ``PrefetchCost``.
        alpha: the weight of a step's sample, in (0, 1].
    Raises:
        MoeOffloadError: ``alpha`` outside (0, 1], ``contention`` outside [0, 1] or ``preempt`` outside (0, 1].
    """

    #: the least ``used_scale`` (a run of wasted prefetches must not make the gate divide by zero)
    MIN_USED_SCALE = 0.05

    def __init__(self, contention: float = 1.0, alpha: float = 0.2, preempt: float = 1.0):
        if not 0.0 < alpha <= 1.0:
            raise MoeOffloadError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 <= contention <= 1.0:
            raise MoeOffloadError(f"contention must be in [0, 1], got {contention}")
        if not 0.0 < preempt <= 1.0:
            raise MoeOffloadError(f"preempt must be in (0, 1], got {preempt}")
        self.contention, self.alpha, self.preempt = contention, alpha, preempt
        self.miss_s: float | None = None
        self.prefetch_cpu_s: float | None = None
        self.link_busy: float | None = None
        self.used_share: float | None = None   # of the forecasts' candidates settled, the share their layer used
        self.promised: float | None = None     # their mean chance of use

    def _ema(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1.0 - self.alpha) * old + self.alpha * sample

    def observe(self, on_demand_experts: int, on_demand_wall_s: float, prefetched_experts: int,
                prefetch_cpu_s: float, step_wall_s: float = 0.0,
                settled: tuple[int, float, int] = (0, 0.0, 0)) -> None:
        """One step's totals: experts copied on demand and the wall seconds the step spent on them; experts
        prefetched and the CPU seconds their copies took; the step's wall seconds; the forecasts' candidates settled
        in it (``UseLedger.take``: how many their layer used, their summed chance of use, how many). A count (or
        ``step_wall_s``) of 0 leaves its average as it was."""
        if on_demand_experts > 0 and on_demand_wall_s > 0:
            self.miss_s = self._ema(self.miss_s, on_demand_wall_s / on_demand_experts)
        if prefetched_experts > 0:
            self.prefetch_cpu_s = self._ema(self.prefetch_cpu_s, max(0.0, prefetch_cpu_s) / prefetched_experts)
        if step_wall_s > 0:
            self.link_busy = self._ema(self.link_busy, min(1.0, max(0.0, on_demand_wall_s) / step_wall_s))
        used, promised, count = settled
        if count > 0:
            self.used_share = self._ema(self.used_share, used / count)
            self.promised = self._ema(self.promised, promised / count)

    @property
    def cost(self) -> PrefetchCost | None:
        """The current ``PrefetchCost``, or None before both copy costs were measured."""
        if self.miss_s is None or self.prefetch_cpu_s is None:
            return None
        scale = 1.0
        if self.used_share is not None and self.promised:
            scale = max(self.MIN_USED_SCALE, self.used_share / self.promised)
        return PrefetchCost(self.miss_s, self.prefetch_cpu_s, self.contention, self.link_busy or 0.0, scale,
                            self.preempt)


class UseLedger:
    """What the forecasts promised against what the layers used (``CostMeter``'s ``used_scale``; issue 47, session
    49): for each position a layer runs at (``core.prefetch_tasks.position(step, layer, L)``: a forecast's task
    deadline), the candidates of its latest forecast that were not resident — those a gate decides on, prefetched
    or refused — with their chance of use (``expect``, from ``core.prefetch_queue.submit_forecast``); when the layer
    runs at that position, how many of them it used (``settle``, from the runtime's prefetcher and the simulator
    before ``SlotTable.plan_layer``). A newer forecast of the same position replaces the older one's candidates; a
    forecast for the next step (SeqMoE's predictor) waits for that step.

    Attributes are private; ``take`` returns ``(used, summed chance, candidates)`` settled since its last call.
    """

    def __init__(self) -> None:
        self._pending: dict[int, tuple[list[int], list[float]]] = {}
        self._totals = [0, 0.0, 0]

    def expect(self, pos: int, eids: list[int], chances: list[float]) -> None:
        """The latest forecast for position ``pos``: candidates ``eids`` (global expert ids, ``layer * E + expert``,
        not resident) with their chance of use ``chances`` (same length); replaces an older forecast's."""
        self._pending[pos] = (eids, chances)

    def settle(self, pos: int, needed) -> None:
        """A layer runs at position ``pos`` needing experts ``needed`` (global ids, ``layer * E + expert``): the
        candidates pending for it are counted, used or not, and forgotten."""
        entry = self._pending.pop(pos, None)
        if entry is None or not entry[0]:
            return
        eids, chances = entry
        need = set(needed)
        t = self._totals
        t[0] += sum(1 for e in eids if e in need)
        t[1] += sum(chances)
        t[2] += len(eids)

    def take(self) -> tuple[int, float, int]:
        """``(used, summed chance of use, candidates)`` settled since the last call."""
        out = tuple(self._totals)
        self._totals = [0, 0.0, 0]
        return out

    def clear(self) -> None:
        """Forget the pending candidates (a new request: its layers will not run the forecasts' steps)."""
        self._pending.clear()
