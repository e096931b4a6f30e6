"""Asynchronous host->device expert copies for prefetching (SeqMoE §8.3).

SeqMoE §8.3 runs the prefetcher on a CPU worker thread next to the main (inference) thread: the main thread decides
what to prefetch and into which slot (``core.slots.SlotTable.prefetch`` hands out ``Load(eid, slot, evicted, tag)``),
the worker moves the bytes "on a dedicated CUDA copy stream" so the copies overlap the layers' computation, and each
finished copy comes back as a landing carrying the reservation's monotonically increasing ``tag``; the main thread
applies it with ``SlotTable.land(eid, slot, tag, ok)``, which ignores stale tags. "When a cache miss triggers
on-demand loading, the GPU sets a shared flag to pause new prefetch submissions, reducing bandwidth contention":
``TransferEngine.pause()`` / ``resume()``.

``TransferEngine`` only moves bytes: it never touches the slot table nor the pool's ``lookup`` table. The caller

  * drops the prefetch's victim from ``pool.lookup`` (and stops reading its slot) *before* ``submit`` — on CUDA,
    ``submit`` records an event on the current stream and the copy waits for it, so kernels already enqueued that
    still read the victim finish before the slot is overwritten;
  * on a landing with ``ok=True`` whose ``SlotTable.land`` returns True, points ``pool.lookup[eid]`` at the slot;
  * never reads a slot whose copy is queued or in flight (the slot table keeps such a slot in Fetch).

Typical use (one thread drives the engine and the slot table)::

    te = TransferEngine(store, pool, link_gbps=16.0)
    load = table.prefetch(eid)
    if load is not None:
        te.submit(load.eid, load.slot, load.tag)
    ...                                       # layers compute while the worker copies
    for landing in te.poll():                 # non-blocking, e.g. once per layer
        table.land(landing.eid, landing.slot, landing.tag, landing.ok)
    ...
    te.pause()                                # an on-demand miss: no new prefetch copy starts
    landing = te.wait(w.eid)                  # a needed expert still in flight (``Round.waits``)
    te.resume()
    te.close()

Ordering: copies *start* in submission (FIFO) order, one at a time, except that ``wait`` moves a queued copy to the
front of the queue (and starts it even while paused: it has become on-demand work). Landings are reported in
completion order, which is therefore submission order except for copies promoted by ``wait`` and for cancelled
copies (reported when cancelled). Each landing is reported exactly once: by ``wait`` if the caller waited for that
expert, otherwise by ``poll``.

Units: bytes; seconds (``time.perf_counter`` clock for every timestamp); GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from ..common.threads import short_switch_interval
from ..errors import MoeOffloadError
from .copy_worker import _DONE, _QUEUED, _RUNNING, CopyWorker, _Job, _sleep_until, check_copy
from .landing import Landing, TransferStats
from .native_prefetch import NativePrefetchQueue, native_queue_possible
from .pool import SlotPool
from .store import HostStore
from .virtual_link import VirtualLinkEngine, emulated_seconds_per_expert

def make_transfer_engine(store: HostStore, pool: SlotPool, link_gbps: float | None = None,
                         seconds_per_expert: float | None = None):
    """The copy engine for ``pool``: a ``runtime.virtual_link.VirtualLinkEngine`` for a pool on the CPU (copies on
    the calling thread, emulated link time on a virtual timeline: no worker thread to take the GIL from the
    computing thread), else a ``TransferEngine`` (worker thread, CUDA copy stream). A disk store is a real link
    even on the CPU (``runtime.disk_store``: reads release the GIL): its copies run on the ``TransferEngine``'s
    worker, or, for a ``DiskStore`` and a pool on the CPU without link emulation when the native kernels are built,
    on ``runtime.native_prefetch.NativePrefetchQueue``'s native worker, which never takes the GIL (issue 47, session
    49). Same API, same arguments (see ``TransferEngine``); raises what their constructors raise."""
    if pool.device.type == "cpu" and store.mode != "disk":
        return VirtualLinkEngine(store, pool, link_gbps=link_gbps, seconds_per_expert=seconds_per_expert)
    spe = emulated_seconds_per_expert(store.layout.expert_bytes, link_gbps, seconds_per_expert)
    if native_queue_possible(store, pool, spe):
        return NativePrefetchQueue(store, pool)
    return TransferEngine(store, pool, link_gbps=link_gbps, seconds_per_expert=seconds_per_expert)


class TransferEngine(CopyWorker):
    """Copies experts from the host store into pool slots on a worker thread, one at a time, FIFO (SeqMoE §8.3).

    CPU pool: the worker copies the host row into ``pool.buf[slot]`` with a single-threaded memcpy (numpy
    ``copyto`` of byte views, which releases the GIL, like ``SlotPool.load``). CUDA pool: the worker issues
    ``pool.buf[slot].copy_(store.buf[eid], non_blocking=True)`` on a dedicated copy stream (asynchronous with pinned
    host memory, which ``HostStore(pin=True)`` provides), after waiting (on the device, not the host) for the event
    ``submit`` recorded on the submitting thread's current stream, and records one CUDA event per copy; ``poll``
    checks that event with ``query()`` (never synchronises) and ``wait`` synchronises on that event only. The worker
    itself waits for each copy to complete before starting the next, so ``pause`` takes effect at copy granularity
    (at most one copy is ever in flight). Other devices: a blocking ``copy_`` on the worker. The runtime serves a CPU
    pool with ``runtime.virtual_link.VirtualLinkEngine`` instead (``make_transfer_engine``): no thread beside the
    computing one; this class on the CPU remains for tests of the worker protocol.

    Link emulation (to model a slower link than the machine's, e.g. PCIe on a CPU-only box): with ``link_gbps``
    each copy takes at least ``expert_bytes / (link_gbps * 1e9)`` seconds, with ``seconds_per_expert`` at least
    that many seconds; the worker sleeps the remainder after the real copy, and the copy is not reported complete
    before. Both None (the default): no emulation.

    Args:
        store: host store holding every expert (row ``eid``).
        pool: the slot pool; must have the store's layout.
        link_gbps: emulated link bandwidth in GB/s (1e9 bytes/s), > 0; or None.
        seconds_per_expert: emulated seconds per expert copy, > 0; or None. At most one of the two.

    Thread safety: ``submit``, ``poll``, ``wait``, ``cancel``, ``pause``, ``resume`` and ``close`` may be called
    from any thread (normally the main one); shared state is guarded by one condition variable.

    Raises:
        MoeOffloadError: non-positive / non-finite ``link_gbps`` or ``seconds_per_expert``, both given, or the
            store's and pool's layouts differ.
    """

    def __init__(self, store: HostStore, pool: SlotPool, link_gbps: float | None = None,
                 seconds_per_expert: float | None = None):
        spe = emulated_seconds_per_expert(store.layout.expert_bytes, link_gbps, seconds_per_expert)
        if store.layout != pool.layout:
            raise MoeOffloadError(f"host store layout {store.layout} differs from the slot pool's {pool.layout}")
        self.store = store
        self.pool = pool
        self.expert_bytes = store.layout.expert_bytes
        self.link_gbps = None if link_gbps is None else float(link_gbps)
        self.seconds_per_expert: float | None = spe  # emulated minimum seconds per copy, None: no emulation
        self.device = pool.device
        self._cuda = self.device.type == "cuda"
        self._cpu = self.device.type == "cpu"
        if self._cpu:
            self._dst = pool.buf.numpy()
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._queue: deque[_Job] = deque()
        self._active: dict[int, _Job] = {}   # eid -> queued or running job
        self._current: _Job | None = None    # the running job
        self._done: list[Landing] = []       # landings not yet reported
        self._paused = False
        self._closed = False                 # no more submissions
        self.fatal: str | None = None        # why the worker died (then every copy lands failed)
        self._stop = False                   # worker exits once the queue is empty
        self.stats = TransferStats()
        self._thread = threading.Thread(target=self._run, name="moe-offload-transfer", daemon=True)
        short_switch_interval()  # the worker gets the interpreter lock between its copies within 0.5 ms
        self._thread.start()

    # ---- main-thread API ----------------------------------------------------------------------------------------

    def submit(self, eid: int, slot: int, tag: int = -1, on_demand: bool = False) -> None:
        """Enqueue a copy of expert ``eid``'s host row into pool slot ``slot``; returns at once.

        ``tag`` is carried to the landing unchanged (SeqMoE §8.3: the slot reservation's tag from
        ``SlotTable.prefetch``). While paused the copy is queued but does not start until ``resume``.
        ``on_demand``: a miss's copy, not a prefetch (what ``runtime.cpu_account`` charges it to).

        Raises:
            MoeOffloadError: ``eid`` not in ``[0, store.num_experts_total)``, ``slot`` not in
                ``[0, pool.num_slots)``, a copy of ``eid`` is already queued or in flight, or the engine is closed.
        """
        eid, slot = int(eid), int(slot)
        self._check(eid, slot)
        ready = None
        if self._cuda:  # the copy must not overwrite the slot before work already enqueued (reading it) finishes
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._cond:
            if self.fatal is not None:
                raise MoeOffloadError(f"the transfer worker died: {self.fatal}")
            if self._closed:
                raise MoeOffloadError("the transfer engine is closed")
            if eid in self._active:
                raise MoeOffloadError(f"a copy of expert {eid} is already queued or in flight")
            job = _Job(eid, slot, int(tag), ready)
            job.on_demand = on_demand
            self._active[eid] = job
            self._queue.append(job)
            self.stats.submitted += 1
            self.stats.max_queued = max(self.stats.max_queued, len(self._queue))
            self._cond.notify_all()

    def _check(self, eid: int, slot: int) -> None:
        """``copy_worker.check_copy`` for this engine's store and pool."""
        check_copy(self.store, self.pool, eid, slot)

    def poll(self) -> list[Landing]:
        """The copies that completed (or were cancelled / failed) since the last ``poll``, in completion order.

        Non-blocking: on CUDA the running copy's event is checked with ``query()``, never synchronised. A landing
        already returned by ``wait`` is not returned again.
        """
        with self._cond:
            job = self._current
            if (self._cuda and job is not None and job.event is not None and job.state == _RUNNING
                    and time.perf_counter() >= job.deadline):
                try:
                    if job.event.query():
                        self._finish(job, True)
                except RuntimeError as e:  # an asynchronous CUDA error surfaces here
                    self._finish(job, False, str(e))
            out, self._done = self._done, []
            return out

    def wait(self, eid: int, timeout: float | None = None) -> Landing | None:
        """Block until the copy of ``eid`` completes and return its landing (consumed: ``poll`` won't return it).

        For an on-demand need of an expert whose prefetch is in flight (``Round.waits``). A copy of ``eid`` still
        queued is moved to the front of the queue and started even while paused. A landing of ``eid`` that
        completed but was not polled yet is returned at once. On CUDA, when the copy is running, this synchronises
        on its event only (no device or stream synchronisation).

        Args:
            eid: the expert.
            timeout: seconds to wait at most; None: no limit.
        Returns:
            The landing, or None when no copy of ``eid`` is queued, in flight or unreported.
        Raises:
            TimeoutError: ``timeout`` elapsed first (the copy stays queued / in flight).
        """
        eid = int(eid)
        end = None if timeout is None else time.perf_counter() + timeout
        with self._cond:
            job = self._active.get(eid)
            if job is None:
                return self._take_done(eid)
            if job.state == _QUEUED and not job.urgent:
                job.urgent = True
                self._queue.remove(job)
                # after the urgent jobs already at the front (they were waited for first)
                i = 0
                while i < len(self._queue) and self._queue[i].urgent:
                    i += 1
                self._queue.insert(i, job)
                self._cond.notify_all()
            while job.state != _DONE:
                if self._cuda and end is None and job.state == _RUNNING and job.event is not None:
                    ev = job.event
                    self._cond.release()
                    err = None
                    try:
                        ev.synchronize()
                        _sleep_until(job.deadline)
                    except RuntimeError as e:
                        err = str(e)
                    finally:
                        self._cond.acquire()
                    self._finish(job, err is None, err)  # no-op if the worker finished it meanwhile
                    break
                rem = None if end is None else end - time.perf_counter()
                if rem is not None and rem <= 0:
                    raise TimeoutError(f"copy of expert {eid} not complete after {timeout} s")
                self._cond.wait(rem)
            # this job's own landing: an older one of the same expert (a cancelled copy not polled yet) stays
            # for poll
            self._done = [landing for landing in self._done if landing is not job.landing]
            return job.landing

    def cancel(self, eid: int) -> bool:
        """Drop the queued (not yet started) copy of ``eid``, or stop the running one at its next chunk.

        Returns:
            True when a queued copy was dropped: its landing (``ok=False``, ``error="cancelled"``, the submitted
            tag) is reported by the next ``poll`` (or ``wait(eid)``) so the caller frees the slot with
            ``SlotTable.land(..., ok=False)``; the pool slot is never touched by it. False when no copy of ``eid``
            is queued (an unknown ``eid`` is ignored): a copy in flight completes, except from a store that reads in
            chunks (the disk tier's ``read_prefetch``), which stops at its next chunk and lands ``ok=False``,
            ``error="cancelled"`` with its slot partly written — ``wait(eid)`` or ``poll`` tells which happened.
        """
        with self._cond:
            job = self._active.get(int(eid))
            if job is not None and job.state == _RUNNING:
                job.stop.set()
            if job is None or job.state != _QUEUED:
                return False
            self._queue.remove(job)
            self.stats.cancelled += 1
            self._finish(job, False, "cancelled")
            return True

    def pause(self) -> None:
        """Stop starting new copies (SeqMoE §8.3: an on-demand miss pauses prefetch submission to reduce bandwidth
        contention). The copy in flight completes; queued ones wait for ``resume`` (except those ``wait``
        promotes). Idempotent: one ``resume`` undoes any number of ``pause`` calls."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Let queued copies start again after ``pause``. Idempotent."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def preempt_share(self) -> float:
        """The most an on-demand copy waits behind a prefetch copy, as a share of one copy (``core.prefetch_cost``'s
        ``preempt``): the store's ``preempt_share`` where it reads in chunks that yield to on-demand reads (the disk
        tier), else 1 (a whole copy: ``pause`` holds only the copies not yet started)."""
        share = getattr(self.store, "preempt_share", None)
        return share() if share is not None else 1.0

    @property
    def paused(self) -> bool:
        """Whether ``pause`` is in effect."""
        return self._paused

    def outstanding(self) -> int:
        """Number of copies queued or in flight (``len(queued()) + len(in_flight())``, without building lists)."""
        with self._cond:
            return len(self._active)

    def in_flight(self) -> list[int]:
        """Expert ids whose copy has started and not completed (at most one: copies run one at a time)."""
        with self._cond:
            return [self._current.eid] if self._current is not None else []

    def queued(self) -> list[int]:
        """Expert ids whose copy is queued and not started, in the order they will start."""
        with self._cond:
            return [j.eid for j in self._queue]

    def pending(self, eid: int) -> bool:
        """Whether a copy of ``eid`` is queued or in flight."""
        with self._cond:
            return int(eid) in self._active

    def idle(self) -> bool:
        """Whether no copy is queued or in flight (landings may still be unreported)."""
        with self._cond:
            return not self._active

    def reset_stats(self) -> None:
        with self._cond:
            self.stats = TransferStats()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread is running (False after ``close``)."""
        return self._thread.is_alive()

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop accepting copies and join the worker thread. Idempotent.

        Args:
            drain: True: run every queued copy first (a ``pause`` no longer holds them back); False: cancel the
                queued copies (``ok=False`` landings, reported by ``poll``); the copy in flight completes either way.
            timeout: seconds to wait for the worker at most (None: no limit).
        Raises:
            MoeOffloadError: the worker did not exit within ``timeout``.
        """
        with self._cond:
            self._closed = True
            if drain:
                self._paused = False
            else:
                while self._queue:
                    job = self._queue.popleft()
                    self.stats.cancelled += 1
                    self._finish(job, False, "cancelled")
            self._stop = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise MoeOffloadError(f"the transfer worker did not stop within {timeout} s")

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------------------

    def _take_done(self, eid: int) -> Landing | None:
        for i, landing in enumerate(self._done):
            if landing.eid == eid:
                return self._done.pop(i)
        return None

    def _finish(self, job: _Job, ok: bool, error: str | None = None) -> None:
        """Record ``job``'s landing (lock held). Idempotent: the first caller (worker, poll or wait) wins."""
        if job.state == _DONE:
            return
        now = time.perf_counter()
        job.state = _DONE
        job.landing = Landing(job.eid, job.slot, job.tag, ok, now, job.started_at, error)
        self._done.append(job.landing)
        del self._active[job.eid]
        if self._current is job:
            self._current = None
        st = self.stats
        if job.started_at is not None:
            st.busy_s += now - job.started_at
            if ok:
                st.copies += 1
                st.bytes_copied += self.expert_bytes
            elif error == "cancelled":  # stopped at a chunk while running
                st.cancelled += 1
            else:
                st.failed += 1
        self._cond.notify_all()
