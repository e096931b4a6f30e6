"""Expert copies into a slot pool in host memory, on the calling thread, with their link time on a virtual timeline.

``VirtualLinkEngine`` has ``runtime.transfer.TransferEngine``'s API (``submit``, ``poll``, ``wait``, ``cancel``,
``pause``, ``resume``, ``copy_now``, ``close``, the queries and ``stats``) for a pool on the CPU, the one where the
link is emulated (a CPU-only machine standing in for a GPU behind PCIe). There is no worker thread: the link is a
timeline the engine advances to ``clock()`` whenever it is called, exactly as ``sim.prefetch_sim`` advances its own
(SeqMoE §8.3's rules, in seconds instead of layer times):

  * copies start one at a time in submission (FIFO) order; each holds the link for ``seconds_per_expert`` seconds
    (the emulated ``expert_bytes / link_gbps``; 0 without emulation);
  * ``pause`` stops copies from starting (the one on the link completes), ``resume`` lets the next start at once;
  * an on-demand copy (``copy_now``, or ``wait`` for a copy still queued) takes the link when the copy on it reaches
    its next ``1 / LINK_CHUNKS`` chunk boundary; that copy resumes with the link time it had left once the on-demand
    copies are through;
  * a copy's bytes reach its slot (a ~15 us memcpy for a 0.3 MiB expert) when a call first finds its link time
    over, before its landing is reported; a cancelled copy never touches its slot.

Why: a worker thread that sleeps out each copy's emulated time wakes about twice per copy, and on this 2-core machine
each wake-up takes the GIL from the thread that computes — time the link model does not charge (issue 17: SeqMoE
computed 2.8 ms per decode step slower than LRU with the same tokens). Here nothing runs beside the inference thread;
the memcpy it does instead is the cheaper distortion.

Single-threaded: one thread (the inference thread) drives the engine. Units: seconds (``clock``, default
``runtime.emulated_clock.now``, whose waits are slept or skipped); bytes; GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from ..core.prefetch_tasks import LINK_CHUNKS, link_time_after_chunk
from ..errors import MoeOffloadError
from . import emulated_clock
from .cpu_account import io
from .landing import Landing, TransferStats
from .pool import SlotPool
from .store import HostStore

def emulated_seconds_per_expert(expert_bytes: int, link_gbps=None, seconds_per_expert=None) -> float | None:
    """Seconds one expert copy holds an emulated link: ``expert_bytes / (link_gbps * 1e9)``, or
    ``seconds_per_expert``; None when neither is given (no emulation).

    Raises:
        MoeOffloadError: both given, or either is not a positive finite number.
    """
    if link_gbps is not None and seconds_per_expert is not None:
        raise MoeOffloadError("give link_gbps or seconds_per_expert, not both")
    if link_gbps is not None:
        return expert_bytes / (_positive("link_gbps", link_gbps) * 1e9)
    return None if seconds_per_expert is None else _positive("seconds_per_expert", seconds_per_expert)


def _positive(name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise MoeOffloadError(f"{name} must be a positive number, got {value!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise MoeOffloadError(f"{name} must be a positive finite number, got {value!r}")
    return v


class _Copy:
    __slots__ = ("eid", "slot", "tag", "started_at", "deadline", "on_demand")

    def __init__(self, eid: int, slot: int, tag: int):
        self.eid, self.slot, self.tag = eid, slot, tag
        self.started_at: float | None = None  # when it took the link (shifted by the time it yielded it)
        self.deadline = 0.0                   # when its link time is over
        self.on_demand = False                # a miss's copy, not a prefetch


class VirtualLinkEngine:
    """``TransferEngine``'s API for a CPU slot pool: copies on the calling thread, link time on a virtual timeline
    (module docstring; SeqMoE §8.3).

    Args:
        store: host store holding every expert (row ``eid``).
        pool: the slot pool, on the CPU, with the store's layout.
        link_gbps: emulated link bandwidth in GB/s (1e9 bytes/s), > 0; or None.
        seconds_per_expert: emulated seconds per expert copy, > 0; or None. At most one of the two; neither: copies
            take no link time (they land at the next call).
        clock, sleep_until: the time source (seconds) and a function returning once ``clock() >= t``; the defaults
            are ``runtime.emulated_clock``'s ``now`` and ``wait_until`` (waits slept, or skipped inside its
            ``skipping_waits``). Tests pass a manual clock.
    Raises:
        MoeOffloadError: a bad ``link_gbps`` / ``seconds_per_expert``, a pool not on the CPU, or the store's and
            pool's layouts differ.
    """

    def __init__(self, store: HostStore, pool: SlotPool, link_gbps: float | None = None,
                 seconds_per_expert: float | None = None, *, clock: Callable[[], float] = emulated_clock.now,
                 sleep_until: Callable[[float], None] = emulated_clock.wait_until):
        if pool.device.type != "cpu":
            raise MoeOffloadError(f"the virtual link copies into a pool on the CPU, not {pool.device}")
        if store.layout != pool.layout:
            raise MoeOffloadError(f"host store layout {store.layout} differs from the slot pool's {pool.layout}")
        self.store, self.pool = store, pool
        self.expert_bytes = store.layout.expert_bytes
        self.link_gbps = None if link_gbps is None else _positive("link_gbps", link_gbps)
        self.seconds_per_expert = emulated_seconds_per_expert(self.expert_bytes, link_gbps, seconds_per_expert)
        self._d = self.seconds_per_expert or 0.0   # link seconds per copy
        self._chunk = self._d / LINK_CHUNKS
        self.device = pool.device
        self._dst = pool.buf.numpy()
        self._clock, self._sleep = clock, sleep_until
        self._queue: deque[_Copy] = deque()   # submitted, not started, in start order
        self._cur: _Copy | None = None        # the copy on the link
        self._active: dict[int, _Copy] = {}   # eid -> queued or current copy
        self._done: list[Landing] = []        # landings not yet reported
        self._paused = False
        self._closed = False
        self.fatal: str | None = None         # never set: no worker to die (TransferEngine's API)
        self.stats = TransferStats()

    # ---- the timeline -------------------------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Land every copy whose link time is over by ``now``, starting the next queued one at each landing (the
        state — paused or not, the queue — has not changed since the previous call)."""
        cur = self._cur
        while cur is not None and cur.deadline <= now:
            self._cur = None
            self._land(cur)
            cur = self._start(self._queue.popleft(), cur.deadline) if self._queue and not self._paused else None

    def _start(self, job: _Copy, t: float) -> _Copy:
        job.started_at, job.deadline = t, t + self._d
        self._cur = job
        return job

    def _land(self, job: _Copy) -> None:
        """The copy's bytes into its slot; its landing reported at its deadline."""
        try:
            cpu0 = time.thread_time()
            with io(self.store, "on_demand_reads" if job.on_demand else "prefetch_reads"):
                self.store.copy_to(job.eid, self._dst[job.slot])
            if not job.on_demand:
                self.stats.prefetch_copies += 1
                self.stats.prefetch_cpu_s += time.thread_time() - cpu0
            err = None
        except Exception as e:  # reported with the landing, as a worker's failed copy
            err = f"{type(e).__name__}: {e}"
        account = getattr(self.store, "account", None)
        if account is not None and err is None and not job.on_demand:
            account.add_bytes("prefetched", self.store.layout.expert_bytes)
        self._finish(job, err is None, err, job.deadline)

    def _finish(self, job: _Copy, ok: bool, error: str | None, at: float) -> None:
        self._done.append(Landing(job.eid, job.slot, job.tag, ok, at, job.started_at, error))
        del self._active[job.eid]
        st = self.stats
        if job.started_at is None:
            return
        st.busy_s += at - job.started_at
        if ok:
            st.copies += 1
            st.bytes_copied += self.expert_bytes
        else:
            st.failed += 1

    def _yield_point(self, now: float) -> tuple[float, float]:
        """``(t0, after)``: on-demand copies asked for at ``now`` (timeline advanced to ``now``) take the link at
        ``t0``, once the copy on it reaches its next chunk boundary (``now`` when idle), and that copy has ``after``
        seconds of link time left (SeqMoE §8.3)."""
        cur = self._cur
        if cur is None:
            return now, 0.0
        rem = cur.deadline - now
        after = link_time_after_chunk(rem, self._chunk)
        return now + (rem - after), after

    def _take_link(self, now: float) -> tuple[float, _Copy | None, float]:
        """Take the link for on-demand copies: ``(t0, parked, after)``, ``parked`` the copy that yields it (None:
        the link was idle); ``_give_back_link`` ends the hold."""
        t0, after = self._yield_point(now)
        parked, self._cur = self._cur, None
        return t0, parked, after

    def _give_back_link(self, t: float, t0: float, parked: _Copy | None, after: float) -> None:
        """The on-demand copies that took the link at ``t0`` are through at ``t``: the parked copy resumes with the
        link time it had left (its own busy time excludes theirs); else the next queued copy starts (not paused)."""
        if parked is not None:
            parked.deadline = t + after
            parked.started_at += t - t0
            self._cur = parked
        elif self._queue and not self._paused:
            self._start(self._queue.popleft(), t)

    def _now(self) -> float:
        now = self._clock()
        self._advance(now)
        return now

    # ---- TransferEngine's API -----------------------------------------------------------------------------------

    def submit(self, eid: int, slot: int, tag: int = -1, on_demand: bool = False) -> None:
        """Queue a copy of expert ``eid``'s host row into pool slot ``slot``; it starts at once when the link is idle
        and not paused. ``tag`` is carried to the landing unchanged; ``on_demand``: a miss's copy, not a prefetch
        (``runtime.cpu_account``).

        Raises:
            MoeOffloadError: ``eid`` or ``slot`` out of range, a copy of ``eid`` already queued or in flight, or the
                engine is closed.
        """
        eid, slot = int(eid), int(slot)
        self._check(eid, slot)
        if self._closed:
            raise MoeOffloadError("the transfer engine is closed")
        if eid in self._active:
            raise MoeOffloadError(f"a copy of expert {eid} is already queued or in flight")
        now = self._now()
        job = _Copy(eid, slot, int(tag))
        job.on_demand = on_demand
        self._active[eid] = job
        st = self.stats
        st.submitted += 1
        if self._cur is None and not self._paused and not self._queue:
            self._start(job, now)
        else:
            self._queue.append(job)
            st.max_queued = max(st.max_queued, len(self._queue))

    def poll(self) -> list[Landing]:
        """The copies whose link time is over (their bytes now in their slots), cancelled or failed since the last
        ``poll``, in completion order. Never sleeps."""
        self._now()
        out, self._done = self._done, []
        return out

    def wait(self, eid: int, timeout: float | None = None) -> Landing | None:
        """Return once the copy of ``eid`` has landed, with its landing (consumed: ``poll`` won't return it).

        A queued copy takes the link as an on-demand copy (``copy_now``'s rule), even while paused; the copy on the
        link is waited out. Sleeps until the copy's link time is over.

        Returns:
            The landing, or None when no copy of ``eid`` is queued, in flight or unreported.
        Raises:
            TimeoutError: the copy would land more than ``timeout`` seconds from now (after sleeping ``timeout``; the
                copy stays where it was).
        """
        eid = int(eid)
        now = self._now()
        job = self._active.get(eid)
        if job is None:
            return self._take_done(eid)
        if job is self._cur:
            if timeout is not None and job.deadline > now + timeout:
                self._sleep(now + timeout)
                raise TimeoutError(f"copy of expert {eid} not complete after {timeout} s")
            self._sleep(job.deadline)
            self._advance(job.deadline)
        else:
            if timeout is not None and self._yield_point(now)[0] + self._d > now + timeout:
                self._sleep(now + timeout)
                raise TimeoutError(f"copy of expert {eid} not complete after {timeout} s")
            self._queue.remove(job)
            t0, parked, after = self._take_link(now)
            job.started_at, job.deadline = t0, t0 + self._d
            self._sleep(job.deadline)
            self._land(job)
            self._give_back_link(job.deadline, t0, parked, after)
        return self._take_done(eid)

    def copy_now(self, eids: list[int], slots: list[int]) -> bool:
        """On-demand copies on the calling thread: they take the link at once when it is idle, else when the copy
        on it reaches its next ``1 / LINK_CHUNKS`` chunk (SeqMoE §8.3's pause; it resumes with the link time it had
        left once these are through, the order ``sim.prefetch_sim`` replays), then hold it ``seconds_per_expert``
        each; this returns when their link time is over. No landing is reported (the caller knows they are done).

        Args:
            eids, slots: experts and their destination slots (same length, distinct experts).
        Returns:
            True (copied); False, nothing done, when the engine is closed (the caller's fallback then raises).
        Raises:
            MoeOffloadError: an expert or slot out of range.
            RuntimeError: a copy failed (``"on-demand copy of expert E failed: <error>"``); the link is released.
        """
        for eid, slot in zip(eids, slots):
            self._check(eid, slot)
        if self._closed:
            return False
        now = self._now()
        t0, parked, after = self._take_link(now)
        end = t0 + len(eids) * self._d
        try:
            for eid, slot in zip(eids, slots):
                try:
                    self.store.copy_to(eid, self._dst[slot])
                except Exception as e:
                    raise RuntimeError(f"on-demand copy of expert {eid} failed: {type(e).__name__}: {e}") from e
            self._sleep(end)
        finally:
            st = self.stats
            st.busy_s += end - t0
            st.copies += len(eids)
            st.bytes_copied += len(eids) * self.expert_bytes
            self._give_back_link(end, t0, parked, after)
        return True

    def cancel(self, eid: int) -> bool:
        """Drop the queued (not started) copy of ``eid``: its landing (``ok=False``, ``error="cancelled"``) comes with
        the next ``poll`` / ``wait(eid)``; its slot is never touched. False when no copy of ``eid`` is queued (the
        copy on the link always completes)."""
        now = self._now()
        job = self._active.get(int(eid))
        if job is None or job is self._cur:
            return False
        self._queue.remove(job)
        self.stats.cancelled += 1
        self._finish(job, False, "cancelled", now)
        return True

    def pause(self) -> None:
        """Stop starting copies (the one on the link completes). Idempotent."""
        self._now()
        self._paused = True

    def resume(self) -> None:
        """Let queued copies start again after ``pause`` (the next at once when the link is idle). Idempotent."""
        now = self._now()
        self._paused = False
        if self._cur is None and self._queue:
            self._start(self._queue.popleft(), now)

    @property
    def preempt_share(self) -> float:
        """The most an on-demand copy waits behind a prefetch on the link, as a share of one copy: ``1 /
        LINK_CHUNKS`` (it takes the link at the prefetch's next chunk boundary; ``core.prefetch_cost``)."""
        return 1.0 / LINK_CHUNKS

    @property
    def paused(self) -> bool:
        """Whether ``pause`` is in effect."""
        return self._paused

    def outstanding(self) -> int:
        """Copies queued or on the link."""
        self._now()
        return len(self._active)

    def in_flight(self) -> list[int]:
        """The expert whose copy is on the link (at most one)."""
        self._now()
        return [self._cur.eid] if self._cur is not None else []

    def queued(self) -> list[int]:
        """Experts whose copy is queued, in start order."""
        self._now()
        return [j.eid for j in self._queue]

    def pending(self, eid: int) -> bool:
        """Whether a copy of ``eid`` is queued or on the link."""
        self._now()
        return int(eid) in self._active

    def idle(self) -> bool:
        """Whether no copy is queued or on the link (landings may still be unreported)."""
        self._now()
        return not self._active

    def reset_stats(self) -> None:
        self.stats = TransferStats()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def worker_alive(self) -> bool:
        """False: there is no worker thread."""
        return False

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop accepting copies. ``drain``: run every queued copy first (sleeping out their link time; a ``pause``
        no longer holds them back); else cancel the queued ones (``ok=False`` landings for ``poll``). The copy on the
        link completes either way. ``timeout`` is accepted for ``TransferEngine``'s API (nothing to join).
        Idempotent."""
        self._now()
        if drain:
            self._paused = False
            if self._cur is None and self._queue:
                self._start(self._queue.popleft(), self._clock())
        else:
            while self._queue:
                self.stats.cancelled += 1
                self._finish(self._queue.popleft(), False, "cancelled", self._clock())
        while self._cur is not None:
            self._sleep(self._cur.deadline)
            self._advance(self._cur.deadline)
        self._closed = True

    def __enter__(self) -> VirtualLinkEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, eid: int, slot: int) -> None:
        if not 0 <= eid < self.store.num_experts_total:
            raise MoeOffloadError(f"expert id {eid} out of range [0, {self.store.num_experts_total})")
        if not 0 <= slot < self.pool.num_slots:
            raise MoeOffloadError(f"slot {slot} out of range [0, {self.pool.num_slots})")

    def _take_done(self, eid: int) -> Landing | None:
        for i, landing in enumerate(self._done):
            if landing.eid == eid:
                return self._done.pop(i)
        return None
