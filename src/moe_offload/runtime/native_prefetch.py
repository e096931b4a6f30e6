"""The disk tier's prefetches read by a native worker thread that never takes the interpreter lock (issue 47,
session 49): ``NativePrefetchQueue``, ``runtime.transfer.TransferEngine``'s protocol (SeqMoE §8.3: tagged landings,
FIFO starts, ``wait`` promotes, ``cancel``, ``pause`` / ``resume``) over the native kernels' ``PrefetchQueue``
(``runtime/kernels/prefetch_queue.cpp``).

Why: ``TransferEngine``'s worker ran 0.2-0.3 ms of Python around each prefetched expert's 0.1 ms read (its loop, the
store's read plan and bookkeeping, the CPU account), under the interpreter lock the computing thread needs
(session 48: ``scripts/read_cpu_cost.py``; the in-step prefetch CPU was 0.27-0.36 ms per expert). Here the worker
reads each queued expert straight into its slot (an expert pack's expert in place, otherwise through one staging
buffer) with the disk store's shared read (``expert_read.h``): chunks of ``DiskStore.prefetch_chunk`` that wait while
the store's on-demand reads are outstanding and stop when cancelled. Its counters — the store's read statistics,
the transfer statistics, and its thread CPU and wall seconds by role for ``runtime.cpu_account`` (thread ``copy
worker``) — are collected by the thread that polls or waits.

``make_transfer_engine`` picks it for a ``DiskStore`` feeding a pool on the CPU without link emulation when the
native kernels are built; everything else keeps ``TransferEngine``.

Units: bytes; seconds (``time.perf_counter``'s clock, ``CLOCK_MONOTONIC``).
"""

from __future__ import annotations

import torch

from ..common.threads import io_thread_settings
from ..errors import MoeOffloadError
from . import huge_pages
from .copy_worker import check_copy, copy_misses_now
from .direct_io import IO_ALIGN, native_plan, read_error
from .landing import Landing, TransferStats
from .pool import SlotPool

# PrefetchQueue.stats() positions (prefetch_queue.cpp)
_SUBMITTED, _COPIES, _CANCELLED, _FAILED, _MAX_QUEUED, _PREFETCH_COPIES, _REQUESTS, _BYTES_READ, _FIELD_BYTES, \
    _IN_PLACE, _YIELDS, _STOPPED = range(12)
_BUSY, _PREFETCH_CPU = 0, 1
#: seconds positions (cpu, wall) -> cpu_account roles
_ROLE_SECONDS = (("prefetch_reads", 2, 3), ("on_demand_reads", 4, 5), ("staging_copies", 6, 7))
_STATUS_ERROR = {1: "cancelled"}


def native_queue_possible(store, pool: SlotPool, seconds_per_expert: float | None) -> bool:
    """Whether ``NativePrefetchQueue`` can serve ``store`` and ``pool``: a ``runtime.disk_store.DiskStore`` (not a
    host cache in front of one) with its native kernels built, a pool on the CPU, no emulated link."""
    from .disk_store import DiskStore

    return (type(store) is DiskStore and store._kernel is not None and hasattr(store._kernel, "PrefetchQueue")
            and pool.device.type == "cpu" and seconds_per_expert is None and bool(store.files))


class NativePrefetchQueue:
    """``runtime.transfer.TransferEngine``'s API (see its docstring for each method's contract) for a disk store
    and a CPU pool, its copies read by the native ``PrefetchQueue``'s worker thread (module docstring).

    Args:
        store: a ``DiskStore`` (``native_queue_possible``).
        pool: the slot pool on the CPU; the store's layout.

    Attributes:
        seconds_per_expert, link_gbps: None (no link emulation; ``TransferEngine`` emulates links).
        fatal: None (the native worker reports a failed read as a failed landing and goes on).

    The store's ``prefetch_chunk`` is taken at construction (``TransferEngine`` reads it at each copy). The worker's
    seconds and the prefetched bytes reach the CPU account when collected (``poll`` with landings, ``wait``,
    ``close``), not when read: a read between two decode steps is charged to the next.

    Raises:
        MoeOffloadError: the layouts differ, or the store cannot be served (``native_queue_possible``).
    """

    seconds_per_expert = None
    link_gbps = None
    fatal = None

    def __init__(self, store, pool: SlotPool):
        if store.layout != pool.layout:
            raise MoeOffloadError(f"host store layout {store.layout} differs from the slot pool's {pool.layout}")
        if not native_queue_possible(store, pool, None):
            raise MoeOffloadError("the native prefetch queue needs a disk store with the native kernels built and a "
                                  "slot pool on the CPU")
        self.store, self.pool, self.device = store, pool, pool.device
        self.expert_bytes = store.layout.expert_bytes
        self._rows = pool.buf.numpy()
        n = store.num_experts_total
        row_aligned = self._rows.ctypes.data % IO_ALIGN == 0 and self._rows.strides[0] % IO_ALIGN == 0
        span_index, piece_index, spans, pieces, staged = [0], [0], [], [], 0
        for e in range(n):
            s = store.spans(e)
            plan = native_plan(s)
            in_place = row_aligned and store._in_place(s, self._rows[0])
            spans.append(plan[0])
            pieces.append(plan[1][:0] if in_place else plan[1])
            if not in_place:
                staged = max(staged, max(x.length for x in s))
            span_index.append(span_index[-1] + len(s))
            piece_index.append(piece_index[-1] + len(pieces[-1]))
        staging = huge_pages.io_buffer(-(-max(staged, 1) // IO_ALIGN) * IO_ALIGN)
        cpus, realtime = io_thread_settings()
        files = store._files
        self._q = store._kernel.PrefetchQueue(
            [f.fd for f in files], [f.direct for f in files], torch.tensor(span_index), torch.cat(spans),
            torch.tensor(piece_index), torch.cat(pieces), pool.buf, staging, store._demand_tensor,
            store.prefetch_chunk, cpus, realtime)
        self._extra = TransferStats()             # copy_now's copies, on the calling thread
        self._seen = ([0] * 12, [0.0] * 8)        # the native counters already folded into the store and account

    # ---- TransferEngine's API ------------------------------------------------------------------------------------

    def submit(self, eid: int, slot: int, tag: int = -1, on_demand: bool = False) -> None:
        """Enqueue a copy of expert ``eid`` into slot ``slot`` (``TransferEngine.submit``).

        Raises:
            MoeOffloadError: ``eid`` or ``slot`` out of range, a copy of ``eid`` already queued or running, or the
                queue is closed."""
        eid, slot = int(eid), int(slot)
        check_copy(self.store, self.pool, eid, slot)
        code = self._q.submit(eid, slot, int(tag), bool(on_demand))
        if code == 1:
            raise MoeOffloadError("the transfer engine is closed")
        if code == 2:
            raise MoeOffloadError(f"a copy of expert {eid} is already queued or in flight")

    def poll(self) -> list[Landing]:
        """The copies that landed (or were cancelled / failed) since the last ``poll``, in completion order."""
        landed = self._q.poll()
        if not landed:
            return []
        self._collect()
        return [self._landing(r) for r in landed]

    def wait(self, eid: int, timeout: float | None = None) -> Landing | None:
        """Block (without the interpreter lock) until the copy of ``eid`` lands and return its landing
        (``TransferEngine.wait``); None when no copy of ``eid`` is queued, in flight or unreported.

        Raises:
            TimeoutError: ``timeout`` seconds elapsed first."""
        code, row = self._q.wait(int(eid), -1.0 if timeout is None else float(timeout))
        if code == 2:
            raise TimeoutError(f"copy of expert {eid} not complete after {timeout} s")
        if code == 1:
            return None
        self._collect()
        return self._landing(row)

    def cancel(self, eid: int) -> bool:
        """Drop the queued copy of ``eid`` (True; it lands cancelled) or stop the running one at its next chunk."""
        return self._q.cancel(int(eid))

    def pause(self) -> None:
        """Stop starting new copies (``TransferEngine.pause``)."""
        self._q.pause()

    def resume(self) -> None:
        """Let queued copies start again."""
        self._q.resume()

    @property
    def preempt_share(self) -> float:
        """The most an on-demand read waits behind a prefetch, as a share of one read (``DiskStore.preempt_share``:
        one chunk)."""
        return self.store.preempt_share()

    @property
    def paused(self) -> bool:
        """Whether ``pause`` is in effect."""
        return self._q.paused()

    def outstanding(self) -> int:
        """Copies queued or in flight."""
        return self._q.outstanding()

    def in_flight(self) -> list[int]:
        """The expert whose copy is running (at most one)."""
        running = self._q.jobs()[1]
        return [running] if running >= 0 else []

    def queued(self) -> list[int]:
        """Experts whose copy is queued, in the order they will start."""
        return list(self._q.jobs()[0])

    def pending(self, eid: int) -> bool:
        """Whether a copy of ``eid`` is queued or in flight."""
        return self._q.pending(int(eid))

    def idle(self) -> bool:
        """Whether no copy is queued or in flight (landings may still be unreported)."""
        return self._q.outstanding() == 0

    def copy_now(self, eids: list[int], slots: list[int]) -> bool:
        """Read the misses ``eids`` into ``slots`` now, on the calling thread and the store's readers
        (``copy_worker.copy_misses_now``; a prefetch yields to them at its next chunk). Returns True (done); False
        once closed.

        Raises:
            MoeOffloadError: an expert or slot out of range; a read fails."""
        if self._q.closed():
            return False
        for eid, slot in zip(eids, slots):
            check_copy(self.store, self.pool, eid, slot)
        busy = copy_misses_now(self.store, self._rows, eids, slots, False)
        self._extra.copies += len(eids)
        self._extra.bytes_copied += len(eids) * self.expert_bytes
        self._extra.busy_s += busy
        return True

    @property
    def stats(self) -> TransferStats:
        """``TransferStats`` since construction or ``reset_stats`` (a fresh object at each read)."""
        counts, secs = self._q.stats()
        x = self._extra
        return TransferStats(submitted=counts[_SUBMITTED], copies=counts[_COPIES] + x.copies,
                             cancelled=counts[_CANCELLED], failed=counts[_FAILED],
                             bytes_copied=counts[_COPIES] * self.expert_bytes + x.bytes_copied,
                             busy_s=secs[_BUSY] + x.busy_s, max_queued=counts[_MAX_QUEUED],
                             prefetch_copies=counts[_PREFETCH_COPIES], prefetch_cpu_s=secs[_PREFETCH_CPU])

    def reset_stats(self) -> None:
        """Zero ``stats``; what the worker counted until then is first folded into the store's statistics and the CPU
        account (taken and zeroed under the queue's lock: a read ending meanwhile is counted in one or the other)."""
        self._fold(*self._q.reset_stats())
        self._seen = ([0] * 12, [0.0] * 8)
        self._extra = TransferStats()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (submissions are refused)."""
        return self._q.closed()

    @property
    def worker_alive(self) -> bool:
        """Whether the native worker thread runs (False after ``close``)."""
        return self._q.alive()

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop accepting copies and join the worker (``TransferEngine.close``). Idempotent.

        Raises:
            MoeOffloadError: the worker did not exit within ``timeout`` seconds."""
        if not self._q.close(bool(drain), -1.0 if timeout is None else float(timeout)):
            raise MoeOffloadError(f"the transfer worker did not stop within {timeout} s")
        self._collect()

    def __enter__(self) -> NativePrefetchQueue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------------------

    def _landing(self, row) -> Landing:
        """A native landing (``prefetch_queue.cpp``'s ``Landed``) as a ``Landing``; an ok prefetch's bytes are
        counted as prefetched in the store's CPU account."""
        _, eid, slot, tag, status, on_demand, error, span, where, started, finished = row
        if status == 2:
            why = "MoeOffloadError: " + read_error(self.store._files, self.store.spans(eid), error, span, where)
        else:
            why = _STATUS_ERROR.get(status)
        if status == 0 and not on_demand:
            account = getattr(self.store, "account", None)
            if account is not None:
                account.add_bytes("prefetched", self.expert_bytes)
        return Landing(eid, slot, tag, status == 0, finished, None if started < 0 else started, why)

    def _collect(self) -> None:
        """Fold the native counters' growth since the last call into the store's ``DiskReadStats`` and its CPU
        account (the worker's seconds by role, as thread ``copy worker``)."""
        self._fold(*self._q.stats())

    def _fold(self, counts: list, secs: list) -> None:
        """``_collect`` of the native counters ``counts`` / ``secs`` (``prefetch_queue.cpp``'s ``stats()``)."""
        seen_c, seen_s = self._seen
        self._seen = (counts, secs)
        st = self.store.stats
        with self.store._lock:
            st.requests += counts[_REQUESTS] - seen_c[_REQUESTS]
            st.bytes_read += counts[_BYTES_READ] - seen_c[_BYTES_READ]
            st.expert_bytes += counts[_FIELD_BYTES] - seen_c[_FIELD_BYTES]
            st.experts += counts[_COPIES] - seen_c[_COPIES]
            st.in_place += counts[_IN_PLACE] - seen_c[_IN_PLACE]
            st.prefetch_yields += counts[_YIELDS] - seen_c[_YIELDS]
            st.prefetch_cancelled += counts[_STOPPED] - seen_c[_STOPPED]
            st.busy_s += sum(secs[w] - seen_s[w] for _, _, w in _ROLE_SECONDS)
        account = getattr(self.store, "account", None)
        if account is not None:
            for role, c, w in _ROLE_SECONDS:
                if secs[w] > seen_s[w]:
                    account.charge(role, secs[c] - seen_s[c], secs[w] - seen_s[w], thread="copy worker")
