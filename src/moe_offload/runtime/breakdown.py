"""Where a decode step's time goes (SeqMoE fig. 9): timers around the phases of the offloaded runtime.

Phases (seconds, summed over decode steps; prefills are not counted):

* ``expert_compute``: the grouped GEMMs over the slot pool (dequantization included) and combining the pairs;
* ``other_compute``: everything between MoE layers — attention, norms, routers, embeddings, head, sampling;
* ``predictor``: the engine's observers — predictor inference and handing its forecasts to the policy and the
  prefetcher (``predictor.runtime.ForecastFeed``), trace recorders when attached;
* ``management``: planning (expert ids to the host, the slot table's hits / misses / victims), landing finished
  prefetches, the prefetch scheduler (JSD) and dispatch, releasing slots, per-step bookkeeping;
* ``stall``: on-demand copies and waits for in-flight prefetches of needed experts.

Every second between the start of one decode step and the start of the next (or ``end_step``) is in exactly one
phase (a lap timer), so the phases sum to the measured step time. On CUDA the timers see the host: kernels run
asynchronously, and their time shows up where the host next waits for the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .cpu_account import PHASE_ROLE
from .emulated_clock import now

PHASES = ("expert_compute", "other_compute", "predictor", "management", "stall")


@dataclass
class TimeBreakdown:
    """Seconds per phase (``PHASES``) over ``steps`` decode steps, and their total ``step_s``."""

    steps: int = 0
    seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def step_s(self) -> float:
        return sum(self.seconds.values())

    def shares(self) -> dict[str, float]:
        """Each phase's fraction of the decode time (0 when nothing was timed)."""
        total = self.step_s
        return {p: (s / total if total else 0.0) for p, s in self.seconds.items()}

    def as_dict(self) -> dict:
        """For ``generate --json``: steps, seconds per phase, ms per step and shares."""
        return {"decode_steps": self.steps, "seconds": dict(self.seconds), "ms_per_step": {
            p: 1e3 * s / max(1, self.steps) for p, s in self.seconds.items()}, "shares": self.shares()}


class StepClock:
    """A lap timer over decode steps: ``lap(phase)`` charges the time since the previous lap to ``phase``.

    With ``account`` (a ``runtime.cpu_account.CpuAccount``) each lap also charges the main thread's CPU and wall time
    to the phase's role, less the expert copies it ran itself in that lap (charged to theirs by the copies), and
    the account counts only while a decode step runs."""

    def __init__(self, account=None) -> None:
        self.result = TimeBreakdown()
        self.account = account
        self._mark: float | None = None  # None: not inside a decode step
        self._cpu_mark = self._wall_mark = 0.0
        self._cells: dict[str, list[float]] = {}  # role -> the account's cell of this thread (lap_cell)

    def begin_step(self, decode: bool) -> None:
        """A forward pass begins (``decode``: a decode step, which is timed); closes the previous step."""
        self.end_step()
        if decode:
            self._mark = now()
            self.result.steps += 1
            if self.account is not None:
                self.account.active = True
                self.account.take_io()
                self._cells = {}  # this step's thread may not be the last one's (a server's worker)
                self._cpu_mark, self._wall_mark = time.thread_time(), time.perf_counter()

    def end_step(self) -> None:
        """The running step ended: its time since the last lap is other compute (the head, sampling)."""
        if self._mark is not None:
            self.lap("other_compute")
            self._mark = None
            if self.account is not None:
                self.account.active = False

    def lap(self, phase: str) -> None:
        if self._mark is None:
            return
        t = now()
        self.result.seconds[phase] += t - self._mark
        self._mark = t
        if self.account is not None:
            cpu, wall = time.thread_time(), time.perf_counter()
            io_cpu, io_wall = self.account.take_io()
            role = PHASE_ROLE[phase]
            cell = self._cells.get(role)
            if cell is None:
                cell = self._cells[role] = self.account.lap_cell(role)
            cell[0] += cpu - self._cpu_mark - io_cpu
            cell[1] += wall - self._wall_mark - io_wall
            self._cpu_mark, self._wall_mark = cpu, wall

    def reset(self) -> None:
        self.result = TimeBreakdown()
        self._mark = None
        if self.account is not None:
            self.account.reset()
            self.account.active = False
            self._cells = {}
