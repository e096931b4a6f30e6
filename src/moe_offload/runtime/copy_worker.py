"""The link of ``runtime.transfer.TransferEngine``: the worker thread's side (one copy at a time from the host store
into a pool slot, the emulated link's timing).

``CopyWorker`` is a mixin: the queue, the condition variable, the stats and ``_finish`` live in ``TransferEngine``.
Units: seconds (``time.perf_counter``). A pool on the CPU with an emulated link is served by
``runtime.virtual_link.VirtualLinkEngine`` instead (no thread; SeqMoE §8.3's yield to on-demand copies on its
timeline).
"""

from __future__ import annotations

import time

import torch

from ..common.threads import io_thread_realtime, pin_io_thread
from ..errors import MoeOffloadError
from .cpu_account import io
from .direct_io import StopFlag
from .emulated_clock import sleep_until as _sleep_until

_QUEUED, _RUNNING, _DONE = 0, 1, 2


class _Job:
    __slots__ = ("eid", "slot", "tag", "state", "urgent", "ready", "event", "started_at", "deadline", "landing",
                 "stop", "on_demand")

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
        self.stop = StopFlag()       # set when cancelled while running: a store that reads in chunks stops at the
        # next one (a native read polls it too)
        self.on_demand = False       # a miss's copy (submitted as one), not a prefetch


class CopyCancelled(Exception):
    """A running copy stopped at a chunk because it was cancelled (``TransferEngine.cancel``)."""


def check_copy(store, pool, eid: int, slot: int) -> None:
    """A copy engine's check of one copy (``TransferEngine``, ``runtime.native_prefetch.NativePrefetchQueue``).

    Raises:
        MoeOffloadError: ``eid`` not in ``[0, store.num_experts_total)`` or ``slot`` not in ``[0, pool.num_slots)``."""
    if not 0 <= eid < store.num_experts_total:
        raise MoeOffloadError(f"expert id {eid} out of range [0, {store.num_experts_total})")
    if not 0 <= slot < pool.num_slots:
        raise MoeOffloadError(f"slot {slot} out of range [0, {pool.num_slots})")


def copy_misses_now(store, rows, eids: list[int], slots: list[int], non_blocking: bool) -> float:
    """Read the misses ``eids`` from a disk store into ``rows[slots]`` at once (``store.copy_many``: the calling
    thread and the store's readers, whole experts, a prefetch yields to them at its next chunk); returns the seconds
    it took. The copy engines' ``copy_now`` (``CopyWorker``, ``runtime.native_prefetch.NativePrefetchQueue``).

    Raises:
        MoeOffloadError: a read fails."""
    t0 = time.perf_counter()
    store.copy_many(list(eids), [rows[s] for s in slots], non_blocking=non_blocking)
    return time.perf_counter() - t0


class CopyWorker:
    """The copy worker's loop (``_run`` on its own thread) for ``TransferEngine``; see its docstring."""

    def _next_job(self) -> _Job | None:
        """Block until a copy may start (lock held); None when the worker should exit."""
        while True:
            if self._queue and (not self._paused or self._stop or self._queue[0].urgent):
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
            pin_io_thread()
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
            except CopyCancelled:
                err = "cancelled"
            except Exception as e:  # report the failure, keep serving the queue
                err = f"{type(e).__name__}: {e}"
            with self._cond:
                self._finish(job, err is None, err)

    def _link_time(self, job: _Job) -> None:
        """Hold the emulated link until ``job.deadline`` (sleeping; spinning only for an urgent copy, which the main
        thread waits for: spinning then takes the GIL from no computation; never on a real-time thread, which would
        hold its core: ``--io-priority realtime``)."""
        _sleep_until(job.deadline, spin=job.urgent and not io_thread_realtime())

    def copy_now(self, eids: list[int], slots: list[int]) -> bool:
        """``VirtualLinkEngine.copy_now``'s counterpart. A pool fed by the disk tier without link emulation
        (``store.mode == "disk"``), on the CPU or CUDA: the misses are read at once, on the calling thread and the
        store's readers (``copy_many``: whole experts, the queue depth of the misses, the native read), as
        ``SlotPool.load`` reads them without a prefetcher; a prefetch on the worker yields to them at its next chunk
        (``DiskStore.read_prefetch``). On CUDA each copy into a slot is synchronous (from the reading thread's
        staging buffer), issued on the reading thread's current stream: the caller's, and the device's default
        stream for the store's reader threads, which is the compute's while the model runs on the default stream.
        Counted in ``stats`` (``copies``, ``bytes_copied``, ``busy_s``) as the worker's copies are. Returns True
        (done); a failed read raises the store's ``MoeOffloadError``. Anywhere else False (nothing done): on-demand
        copies then go through the worker (``submit``, then ``wait``, which moves them ahead of queued prefetches).

        Before issue 47's session 44 every miss went through the worker, one at a time, in prefetch-sized chunks:
        a forecast policy read the same bytes 8-10% more slowly than LRU.

        Raises:
            MoeOffloadError: an expert or slot out of range; a read fails.
        """
        if (self._closed or self.seconds_per_expert is not None or not (self._cpu or self._cuda)
                or getattr(self.store, "mode", None) != "disk"):
            return False
        for eid, slot in zip(eids, slots):
            self._check(eid, slot)
        busy = copy_misses_now(self.store, self._dst if self._cpu else self.pool.buf, eids, slots, self._cuda)
        with self._cond:
            st = self.stats
            st.copies += len(eids)
            st.bytes_copied += len(eids) * self.store.layout.expert_bytes
            st.busy_s += busy
        return True

    def _read(self, job: _Job, dst, non_blocking: bool = False) -> None:
        """The store's copy of ``job``'s expert into ``dst``: a prefetch read that yields to on-demand reads and stops
        at a chunk when cancelled where the store reads in chunks (``read_prefetch``: the disk tier).

        Raises:
            CopyCancelled: the copy was cancelled while running and stopped before its end.
        """
        read = getattr(self.store, "read_prefetch", None)
        demand = job.on_demand or job.urgent  # a prefetch a layer waits for is on its critical path too
        cpu0 = time.thread_time()
        with io(self.store, "on_demand_reads" if demand else "prefetch_reads"):
            if read is None:
                self.store.copy_to(job.eid, dst, non_blocking=non_blocking)
            elif not read(job.eid, dst, job.stop):
                raise CopyCancelled(job.eid)
        if not job.on_demand:
            with self._cond:
                self.stats.prefetch_copies += 1
                self.stats.prefetch_cpu_s += time.thread_time() - cpu0
        account = getattr(self.store, "account", None)
        if account is not None and not job.on_demand:
            account.add_bytes("prefetched", self.store.layout.expert_bytes)

    def _copy(self, job: _Job) -> None:
        """Copy ``job``'s expert into its slot; returns when the bytes are all in the slot.

        Raises:
            CopyCancelled: as ``_read``.
        """
        if self._cpu:
            self._read(job, self._dst[job.slot])
        elif self._cuda:
            stream = self._stream
            with torch.cuda.stream(stream):
                stream.wait_event(job.ready)
                self._read(job, self.pool.buf[job.slot], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            with self._cond:
                job.event = ev  # from now on poll()/wait() may observe completion themselves
                self._cond.notify_all()
            ev.synchronize()    # releases the GIL; blocks this worker only
        else:
            self._read(job, self.pool.buf[job.slot])
