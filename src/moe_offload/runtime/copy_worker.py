"""The link of ``runtime.transfer.TransferEngine``: the worker thread's side (one copy at a time from the host store
into a pool slot, the emulated link's timing) and the protocol by which a prefetch yields the emulated link to
on-demand copies (SeqMoE §8.3): to urgent copies the worker runs itself, or to the main thread's own copies
(``copy_now``).

``CopyWorker`` is a mixin: the queue, the condition variable, the stats and ``_finish`` live in ``TransferEngine``.
Units: seconds (``time.perf_counter``).
"""

from __future__ import annotations

import math
import time

import torch

from ..core.prefetch import LINK_CHUNKS
from ..errors import MoeOffloadError

# a sleep shorter than this is replaced by yielding (time.sleep(0), which releases the GIL) until the deadline:
# Linux sleeps overshoot by ~50-100 us, which would dominate the emulated time of a small expert
_SPIN_S = 5e-4


_QUEUED, _RUNNING, _DONE = 0, 1, 2


class _Job:
    __slots__ = ("eid", "slot", "tag", "state", "urgent", "ready", "event", "started_at", "deadline", "landing")

    def __init__(self, eid: int, slot: int, tag: int, ready):
        self.eid = eid
        self.slot = slot
        self.tag = tag
        self.state = _QUEUED
        self.urgent = False          # promoted by wait(): runs first, even while paused
        self.ready = ready           # CUDA: event on the submitting stream the copy must wait for
        self.event = None            # CUDA: event recorded on the copy stream after the copy
        self.started_at = None
        self.deadline = 0.0          # emulated link: the copy is not complete before this perf_counter time
        self.landing = None          # the runtime.transfer.Landing once done


def _sleep_until(deadline: float, spin: bool = True) -> None:
    """Return at or after ``time.perf_counter() >= deadline``: sleeps, then (``spin``) yields the GIL in a loop for
    the last ``_SPIN_S`` seconds for accuracy. A background thread passes ``spin=False`` (sleep only, a few tens of
    microseconds late at worst): a spinning thread keeps taking the GIL from the thread that computes."""
    while True:
        rem = deadline - time.perf_counter()
        if rem <= 0:
            return
        if not spin:
            time.sleep(rem)
        else:
            time.sleep(rem - _SPIN_S if rem > 2 * _SPIN_S else 0)


class CopyWorker:
    """The copy worker's loop (``_run`` on its own thread) for ``TransferEngine``; see its docstring."""

    def _next_job(self) -> _Job | None:
        """Block until a copy may start (lock held); None when the worker should exit."""
        while True:
            if (self._queue and not self._want
                    and (not self._paused or self._stop or self._queue[0].urgent)):
                job = self._queue.popleft()
                job.state = _RUNNING
                self._current = job
                return job
            if self._stop and not self._queue:
                return None
            self._cond.wait()

    def _run(self) -> None:
        """The worker thread: any exception outside a single copy (device set-up, bookkeeping) ends it cleanly —
        every queued or running copy lands with ``ok=False`` and the error's message, later ``submit`` calls raise —
        so no ``wait`` ever blocks on a dead worker."""
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - reported to every waiter, never swallowed
            with self._cond:
                self.fatal = f"{type(e).__name__}: {e}"
                self._closed = self._stop = True
                for job in list(self._active.values()):
                    self._finish(job, False, f"transfer worker died: {self.fatal}")
                self._queue.clear()
                self._cond.notify_all()

    def _serve(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self._cond:
                job = self._next_job()
                if job is None:
                    return
                job.started_at = time.perf_counter()
                if self.seconds_per_expert is not None:
                    job.deadline = job.started_at + self.seconds_per_expert
            try:
                self._copy(job)
                self._link_time(job)
                err = None
            except Exception as e:  # report the failure, keep serving the queue
                err = f"{type(e).__name__}: {e}"
            with self._cond:
                self._finish(job, err is None, err)

    def _link_time(self, job: _Job) -> None:
        """Hold the emulated link until ``job.deadline``. On the CPU a prefetch yields it (SeqMoE §8.3 pause): when
        an urgent copy (an on-demand load the main thread waits for) reaches the front of the queue, or the main
        thread asks for the link to copy on-demand experts itself (``TransferEngine.copy_now``), the prefetch's
        current chunk (``1 / LINK_CHUNKS`` of a copy) completes, the urgent copies run (or the main thread's), and
        the prefetch resumes with the link time it had left — the order ``sim.prefetch_sim`` replays. The worker
        sleeps on ``_link_wake`` (woken by those two events only, not by every submit), never spins (it must not
        take the GIL from the computing thread)."""
        if not (self._cpu and self.seconds_per_expert is not None) or job.urgent:
            _sleep_until(job.deadline, spin=job.urgent)  # the main thread waits for an urgent copy: spinning
            return                                       # takes the GIL from no computation
        chunk = self.seconds_per_expert / LINK_CHUNKS
        with self._cond:
            self._linkjob = job
            try:
                while True:
                    rem = job.deadline - time.perf_counter()
                    if rem <= 0:
                        return
                    if not (self._want or (self._queue and self._queue[0].urgent)):
                        self._link_wake.wait(rem)
                        continue
                    after = math.floor(rem / chunk) * chunk    # link time left once the current chunk is through
                    self._cond.release()
                    try:
                        _sleep_until(job.deadline - after, spin=False)
                        paused_at = time.perf_counter()
                        self._run_urgent()
                        self._park()
                    finally:
                        self._cond.acquire()
                    now = time.perf_counter()
                    job.deadline = now + after
                    job.started_at += now - paused_at  # the link time of the urgent copies is not this copy's
                    self._current = job
            finally:
                self._linkjob = None
                self._cond.notify_all()

    def _park(self) -> None:
        """Leave the link to the main thread's own copies while it asks for it (lock not held)."""
        with self._cond:
            if not self._want:
                return
            self._yielded = True
            self._cond.notify_all()
            while self._want:
                self._cond.wait()
            self._yielded = False

    def _run_urgent(self) -> None:
        """Run the urgent copies at the front of the queue to completion (lock not held)."""
        while True:
            with self._cond:
                if not (self._queue and self._queue[0].urgent):
                    return
                job = self._queue.popleft()
                job.state = _RUNNING
                self._current = job
                job.started_at = time.perf_counter()
                job.deadline = job.started_at + self.seconds_per_expert
            try:
                self._copy(job)
                _sleep_until(job.deadline)  # urgent: the main thread is waiting, so spin for accuracy
                err = None
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            with self._cond:
                self._finish(job, err is None, err)

    def copy_now(self, eids: list[int], slots: list[int]) -> bool:
        """On-demand copies on the calling thread (CPU pool): with the link free at once; with a prefetch holding the
        emulated link, after it yields at its next ``1 / LINK_CHUNKS`` chunk (SeqMoE §8.3's pause; it resumes with
        the link time it had left once these copies are done, the order ``sim.prefetch_sim`` replays). The worker
        starts no copy meanwhile; each copy holds the (emulated) link for its ``seconds_per_expert`` (the calling
        thread sleeps, then yields the GIL until then, as the non-prefetching engine's emulated loads do), and no
        landing is reported (the caller knows they are done).

        Why: handing an on-demand copy to the worker costs two thread wake-ups per miss on a busy machine, time the
        link model does not charge (issue 17, runtime vs simulator).

        Args:
            eids, slots: experts and their destination slots (same length, distinct experts).
        Returns:
            True when copied; False (nothing done) when the pool is not on the CPU, the engine is closed, a copy the
            main thread waits for is queued, or a copy without emulated link time is in flight: the caller then
            ``submit``s and ``wait``s as for any on-demand copy.
        Raises:
            MoeOffloadError: an expert or slot out of range.
            RuntimeError: a copy failed (``"on-demand copy of expert E failed: <error>"``); the link is released.
        """
        if not self._cpu:
            return False
        for eid, slot in zip(eids, slots):
            if not 0 <= eid < self.store.num_experts_total or not 0 <= slot < self.pool.num_slots:
                raise MoeOffloadError(f"expert {eid} / slot {slot} out of range")
        with self._cond:
            if self._closed or (self._queue and self._queue[0].urgent):
                return False
            if self._current is not None and self._current is not self._linkjob:
                return False
            self._want = True  # the worker starts nothing now, and a prefetch holding the link parks at a chunk
            self._cond.notify_all()
            self._link_wake.notify_all()
            while not self._yielded and self._linkjob is not None:
                self._cond.wait()
        busy = 0.0
        try:
            for eid, slot in zip(eids, slots):
                start = time.perf_counter()
                try:
                    self.store.copy_to(eid, self._dst[slot])
                except Exception as e:  # as a worker's failed copy is reported to the waiting caller
                    raise RuntimeError(f"on-demand copy of expert {eid} failed: {type(e).__name__}: {e}") from e
                if self.seconds_per_expert is not None:
                    _sleep_until(start + self.seconds_per_expert)
                busy += time.perf_counter() - start
        finally:
            with self._cond:
                self._want = False
                st = self.stats
                st.busy_s += busy
                st.copies += len(eids)
                st.bytes_copied += len(eids) * self.expert_bytes
                self._cond.notify_all()
        return True

    def _copy(self, job: _Job) -> None:
        """Copy ``job``'s expert into its slot; returns when the bytes are all in the slot."""
        if self._cpu:
            self.store.copy_to(job.eid, self._dst[job.slot])
        elif self._cuda:
            stream = self._stream
            with torch.cuda.stream(stream):
                stream.wait_event(job.ready)
                self.store.copy_to(job.eid, self.pool.buf[job.slot], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            with self._cond:
                job.event = ev  # from now on poll()/wait() may observe completion themselves
                self._cond.notify_all()
            ev.synchronize()    # releases the GIL; blocks this worker only
        else:
            self.store.copy_to(job.eid, self.pool.buf[job.slot])
