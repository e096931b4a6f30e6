"""The disk tier: routed experts read from the checkpoint's safetensors files with direct I/O (issue 35, DESIGN.md
§11 "Tiers below the device").

``DiskStore`` (``--host-store disk``) keeps no expert byte in host memory: like ``MmapHostStore`` each expert is a
list of byte ranges of the files (``add_segment``, filled by the loader in the file's own dtype), but a read goes
around the page cache. At the first read the ranges of each expert are planned into a few *spans*: ranges of one
file closer than ``MERGE_GAP`` are merged (reading the gap costs less than another request), and each span is widened to ``IO_ALIGN`` (4 KiB)
boundaries, because safetensors offsets are not aligned and ``O_DIRECT`` wants offset, length and buffer address
aligned (``runtime.direct_io``: the span plan, opening files, concurrent reads). A span is read with ``os.preadv`` (which releases the GIL) into a page-aligned staging buffer of the reading
thread, and the expert's fields are copied from there into the destination (a slot of the pool, or a host row).
With the native kernels built, a whole on-demand read into host memory is one call (``read_expert``) that reads
every span and copies every field without the interpreter lock (issue 47: between Python's requests a reader
waited for the lock while the main thread ran Python).

Several experts are read at once by ``copy_many`` (a pool of ``readers`` threads: the queue depth of the on-demand
misses of one layer; the calling thread reads one of them itself). A prefetch copy runs on the transfer engine's
worker thread through ``read_prefetch``, in chunks of at most ``PREFETCH_CHUNK`` bytes: before each chunk it yields
to on-demand reads (it waits while ``copy_to`` / ``copy_many`` calls are outstanding, unless the engine is waiting
for that very prefetch) and stops when its copy was cancelled, so an on-demand miss never queues behind more than
one chunk of a prefetch (a whole expert up to ``PREFETCH_CHUNK``) and a cancelled prefetch stops reading at a chunk.
With the native kernels built, a prefetch into host memory is one ``read_expert`` call too: it sleeps on a futex
over the store's count of outstanding on-demand reads (woken when the last one ends) and checks its job's
``StopFlag`` between chunks, without the interpreter lock.

Reads while misses are outstanding are measured (``DiskReadStats.demand_s``, ``demand_reads``) so that a report can
set them against the bandwidth ``bench link --disk`` measured at the same request size and queue depth
(``demand_efficiency``).

Where the filesystem refuses ``O_DIRECT``, a file is read through the page cache and each span is dropped again
with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (said once on stderr); a filesystem that refuses both is an error.
Files are opened once, at load: a shard deleted while running stays readable through its descriptor (POSIX), and a
shard truncated or replaced in place ends a read early, which is a one-line ``MoeOffloadError``.

Units: bytes; seconds; GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..common.threads import pin_io_thread, short_switch_interval
from ..errors import MoeOffloadError
from .cpu_account import charge_within, io
from .disk_stats import DiskReadStats  # noqa: F401 (re-exported)
from .direct_io import (IO_ALIGN, StopFlag, _File, _Span, copy_concurrently, native_plan,  # noqa: F401 (re-exported)
                        open_direct, plan_spans, read_native)
from . import huge_pages
from .kernels import native
from .store import ExpertLayout, gather_rows

#: default reader threads (queue depth of ``copy_many``)
DEFAULT_READERS = 4
#: largest read of a prefetch between two checks for on-demand reads to yield to and for cancellation (bytes); an
#: expert up to this size is read in one request (a 2.65 MB testbed-sparse-wide expert), a 9.4 MB one in three.
#: Each request costs the reading thread CPU on the compute's cores whatever its size (about 60 us here, nested
#: virtualisation): at 1 MiB the prefetch reads took 7.0-8.3 ms of CPU per decode step, at 4 MiB 4.0-4.2
#: (docs/benchmarks.md, session 51)
PREFETCH_CHUNK = 4 << 20


def preempt_share(chunk: int, read_bytes: float) -> float:
    """The most an on-demand read waits behind a prefetch already reading, as a share of one expert's read of
    ``read_bytes`` bytes, where a prefetch yields at its next chunk of ``chunk`` bytes: ``min(1, chunk /
    read_bytes)`` (1 for an empty read)."""
    return min(1.0, chunk / read_bytes) if read_bytes > 0 else 1.0


class DiskStore:
    """Routed experts streamed from the checkpoint's files with direct I/O; no private copy (module docstring).

    Same interface as ``runtime.store.HostStore`` / ``MmapHostStore`` (``copy_to``, ``copy_many``, ``gather``,
    ``nbytes``, ``close``), so every engine and policy runs over it unchanged.

    Args:
        layout: the expert layout (fields in the files' own dtypes).
        num_experts_total: N.
        readers: reader threads of ``copy_many`` (its queue depth), >= 1.
        allow_direct: False forces the buffered + ``posix_fadvise`` path (tests; a filesystem known to lie).

    Attributes:
        stats: ``DiskReadStats``; ``buffered_reason``: why some file is read through the page cache (None: all
        direct).
    """

    mode = "disk"
    pinned = False
    pin_failed = False

    def __init__(self, layout: ExpertLayout, num_experts_total: int, readers: int = DEFAULT_READERS,
                 allow_direct: bool = True, prefetch_chunk: int = PREFETCH_CHUNK):
        if readers < 1:
            raise MoeOffloadError(f"a disk store needs at least one reader thread, got {readers}")
        if prefetch_chunk < IO_ALIGN or prefetch_chunk % IO_ALIGN:
            raise MoeOffloadError(f"a prefetch chunk must be a positive multiple of {IO_ALIGN} bytes, got "
                                  f"{prefetch_chunk}")
        self.prefetch_chunk = int(prefetch_chunk)
        self.layout = layout
        self.num_experts_total = num_experts_total
        self.readers = readers
        short_switch_interval()  # a reader gets the interpreter lock between its requests within 0.5 ms
        self.allow_direct = allow_direct
        self.stats = DiskReadStats()
        self.buffered_reason: str | None = None
        self._files: list[_File] = []
        self._index: dict[Path, int] = {}
        self._segments: list[list[tuple[int, int, int, int]]] = [[] for _ in range(num_experts_total)]
        self._spans: list[list[_Span]] | None = None
        self._stage = threading.local()
        self._lock = threading.Lock()
        self._demand_done = threading.Condition(self._lock)   # notified when no on-demand read is outstanding
        self._demand = 0                                      # on-demand calls outstanding, all threads
        self._demand_flag = np.zeros(1, dtype=np.int32)       # the same count, for native prefetch reads to poll
        self._demand_tensor = torch.from_numpy(self._demand_flag)
        self._demand_since = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._kernel = native()           # read_expert, when the native kernels are built
        self._native_plans: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}  # (eid, in place) ->
        # read_expert's spans, pieces
        #: the expert pack the experts are read from (``models.expert_pack``; None: the checkpoint's files)
        self.pack: Path | None = None

    @property
    def nbytes(self) -> int:
        """Private bytes held for experts: none (staging buffers are a few experts' worth, see ``staging_bytes``)."""
        return 0

    @property
    def files(self) -> list[Path]:
        """The checkpoint files experts are read from."""
        return [f.path for f in self._files]

    def add_segment(self, eid: int, dst_offset: int, path: Path, file_offset: int, nbytes: int) -> None:
        """Expert ``eid``'s bytes ``[dst_offset, dst_offset + nbytes)`` are ``path``'s bytes from ``file_offset``
        (the file is opened now, once).

        Raises:
            MoeOffloadError: the file cannot be opened, or its filesystem refuses direct I/O and fadvise alike.
        """
        path = Path(path)
        i = self._index.get(path)
        if i is None:
            f, why = open_direct(path, self.allow_direct)
            if why is not None and self.buffered_reason is None:
                self.buffered_reason = why
                print(f"moe-offload: note: {path.parent}: {why}; experts are read through the page cache and dropped "
                      "from it after each read (posix_fadvise DONTNEED)", file=sys.stderr)
            i = self._index[path] = len(self._files)
            self._files.append(f)
        self._segments[eid].append((dst_offset, i, file_offset, nbytes))
        self._spans = None
        self._native_plans.clear()

    def spans(self, eid: int) -> list[_Span]:
        """The aligned reads of expert ``eid`` (planned once for every expert, at the first call)."""
        if self._spans is None:
            self._spans = [plan_spans(s) for s in self._segments]
        return self._spans[eid]

    @property
    def staging_bytes(self) -> int:
        """Bytes of one reader's staging buffer: the longest span of any expert."""
        return max((s.length for e in range(self.num_experts_total) for s in self.spans(e)), default=0)

    @property
    def max_staging_bytes(self) -> int:
        """Host bytes the staging buffers can take at most: one per thread that reads (the caller's, the ``readers``
        of ``copy_many``, a transfer engine's worker and an engine's read overlap thread), each ``staging_bytes``."""
        return (self.readers + 3) * -(-self.staging_bytes // IO_ALIGN) * IO_ALIGN

    def _buffer(self, nbytes: int) -> tuple[memoryview, np.ndarray]:
        st = self._stage
        buf = getattr(st, "buf", None)
        if buf is None or len(buf) < nbytes:  # an older, smaller buffer is freed with its last view
            size = max(nbytes, self.staging_bytes)
            st.buf = huge_pages.io_buffer(-(-size // IO_ALIGN) * IO_ALIGN)  # page-aligned, on huge pages
            st.np = st.buf.numpy()
            st.view = memoryview(st.np)
        return st.view, st.np

    def _read_span(self, span: _Span, view: memoryview, lo: int = 0, hi: int | None = None) -> int:
        """Read bytes ``[lo, hi)`` of ``span`` into the same bytes of ``view`` (None: to its end; ``lo`` and ``hi``
        multiples of ``IO_ALIGN``); returns the requests issued."""
        f = self._files[span.file]
        end = span.need if hi is None else min(hi, span.need)
        stop = span.length if hi is None or hi >= span.need else hi
        got, requests = lo, 0
        while got < end:
            try:
                n = os.preadv(f.fd, [view[got:stop]], span.start + got)
            except OSError as e:
                raise MoeOffloadError(f"reading {f.path} at byte {span.start + got} failed: {e.strerror}") from None
            requests += 1
            if n <= 0 or (f.direct and n % IO_ALIGN and got + n < end):
                raise MoeOffloadError(f"{f.path} ended at byte {span.start + got + max(n, 0)} while an expert was "
                                      "read from it: the checkpoint file was truncated or replaced while running")
            got += n
        if not f.direct:
            os.posix_fadvise(f.fd, span.start + lo, stop - lo, os.POSIX_FADV_DONTNEED)
        return requests

    def _read(self, eid: int, dst, gate=None, depth: int = 0, stop: StopFlag | None = None) -> bool:
        """Expert ``eid`` into ``dst``; ``gate()`` (a prefetch) is asked before each chunk of ``prefetch_chunk``
        bytes and False abandons the read (returns False, ``dst`` partly written); ``depth`` > 0: an on-demand read
        issued ``depth`` at once (recorded in ``stats.demand_reads``). A read into host memory is one call of the
        native ``read_expert`` when the kernels are built (``_read_native``): a whole on-demand read, or a prefetch
        given its ``stop`` flag, whose chunks then yield and stop in the native code as ``gate`` would have them."""
        spans = self.spans(eid)
        out = dst if isinstance(dst, np.ndarray) else dst.numpy() if dst.device.type == "cpu" else None
        in_place = self._in_place(spans, out)
        view, arr = (memoryview(out), out) if in_place else self._buffer(max(s.length for s in spans))
        t0 = time.perf_counter()
        requests = nread = 0
        done = True
        role = "prefetch_reads" if gate is not None else "on_demand_reads"
        todo = spans
        if out is not None and self._kernel is not None and (gate is None or stop is not None):
            requests, nread, done = self._read_native(eid, spans, arr, out, in_place, stop)
            todo = ()
        for span in todo:
            if gate is None:
                with io(self, role, inherit=True):
                    requests += self._read_span(span, view)
            else:
                for lo in range(0, span.need, self.prefetch_chunk):
                    if not gate():
                        done = False
                        break
                    with io(self, role, inherit=True):
                        requests += self._read_span(span, view, lo, lo + self.prefetch_chunk)
                if not done:
                    break
            nread += span.length
            if in_place:
                continue
            with io(self, "staging_copies"):
                for dst_off, src_off, n in span.pieces:
                    if out is not None:  # numpy's copy: half the overhead of torch's for these ~100 KiB pieces
                        np.copyto(out[dst_off:dst_off + n], arr[src_off:src_off + n])
                    else:
                        dst[dst_off:dst_off + n].copy_(torch.from_numpy(arr[src_off:src_off + n]))
        busy = time.perf_counter() - t0
        with self._lock:
            st = self.stats
            st.requests += requests
            st.bytes_read += nread
            st.busy_s += busy
            if done:
                st.expert_bytes += sum(n for s in spans for _, _, n in s.pieces)
                st.experts += 1
                st.in_place += in_place
            else:
                st.prefetch_cancelled += 1
            if depth:
                key = (sum(s.length for s in spans), depth)
                st.demand_reads[key] = st.demand_reads.get(key, 0) + 1
                st.demand_bytes += nread
        return done

    def _in_place(self, spans: list[_Span], out: np.ndarray | None) -> bool:
        """Whether an expert's read can land straight in ``out`` (a pack's expert: one aligned span that is the
        whole row, and ``out`` page-aligned host memory): no staging buffer, no copy."""
        if self.pack is None or out is None or len(spans) != 1:
            return False
        s = spans[0]
        return s.pieces == ((0, 0, s.length),) and out.ctypes.data % IO_ALIGN == 0 and out.nbytes >= s.length

    def _read_native(self, eid: int, spans: list, arr: np.ndarray, out: np.ndarray,
                     in_place: bool = False, stop: StopFlag | None = None) -> tuple[int, int, bool]:
        """``_read`` of an expert into host memory ``out`` by one native call (``direct_io.read_native``) through
        the staging buffer ``arr``; its copies are charged as staging copies. ``in_place``: ``arr`` is ``out`` and
        nothing is copied. ``stop``: a prefetch, read in chunks of ``prefetch_chunk`` that wait while on-demand
        reads are outstanding and end once ``stop`` is set (its waits counted in ``stats.prefetch_yields``).
        Returns ``(requests, bytes read, whether the whole expert is in)``.

        Raises:
            MoeOffloadError: as ``_read_span``."""
        plan = self._native_plans.get((eid, in_place))
        if plan is None:
            plan = native_plan(spans)
            if in_place:  # the span is read where the row is: no piece to copy
                plan = (plan[0], plan[1][:0])
            self._native_plans[(eid, in_place)] = plan
        role = "on_demand_reads" if stop is None else "prefetch_reads"
        chunk = 0 if stop is None else self.prefetch_chunk
        with io(self, role, inherit=True):
            requests, copy_cpu, copy_wall, stopped, yields = read_native(
                self._kernel, self._files, spans, plan, arr, out, self._demand_tensor, stop, chunk)
            charge_within(self, "staging_copies", copy_cpu, copy_wall)
        if yields:
            with self._lock:
                self.stats.prefetch_yields += yields
        return requests, 0 if stopped else sum(s.length for s in spans), not stopped  # a stopped read's bytes: uncounted

    @contextmanager
    def _on_demand(self):
        """An on-demand read is outstanding inside (prefetches yield to it; ``stats.demand_s`` counts the wall time
        during which any is)."""
        with self._lock:
            if not self._demand:
                self._demand_since = time.perf_counter()
            self._demand += 1
            self._demand_flag[0] = self._demand
        try:
            yield
        finally:
            with self._lock:
                self._demand -= 1
                self._demand_flag[0] = self._demand
                if not self._demand:
                    if self._kernel is not None:  # native prefetch reads sleep on the flag
                        self._kernel.futex_wake(self._demand_tensor)
                    self.stats.demand_s += time.perf_counter() - self._demand_since
                    self._demand_done.notify_all()

    def copy_to(self, eid: int, dst, non_blocking: bool = False, depth: int = 1) -> None:
        """Read expert ``eid`` from disk into ``dst`` (a numpy uint8 row of ``expert_bytes``, or a torch uint8 row on
        a device; the copy to a device is synchronous: the staging buffer is reused): an on-demand read, which
        prefetches yield to. ``depth``: how many reads the caller issues at once with this one (statistics only).
        Thread-safe.

        Raises:
            MoeOffloadError: a read fails or a file ends early (module docstring).
        """
        with self._on_demand():
            self._read(eid, dst, depth=max(1, depth))

    def copy_many(self, eids: list[int], dsts: list, non_blocking: bool = False) -> None:
        """Read experts ``eids`` into ``dsts`` (as ``copy_to``), up to ``readers`` at once (the calling thread is one
        of them); returns when all are in (``non_blocking`` is accepted for the stores' common interface; disk reads
        always complete).

        Raises:
            MoeOffloadError: as ``copy_to`` (the first failure; the others are still waited for).
        """
        depth = max(1, min(len(eids), self.readers))
        with self._on_demand():
            copy_concurrently(lambda e, d: self._read(e, d, depth=depth),
                              self.executor() if depth > 1 else None, eids, dsts, depth)

    def read_prefetch(self, eid: int, dst, stopped=None) -> bool:
        """A prefetch of expert ``eid`` into ``dst`` (as ``copy_to``), read in chunks of ``prefetch_chunk`` bytes:
        before each chunk it waits while on-demand reads (``copy_to`` / ``copy_many``) are outstanding, and stops
        when ``stopped()`` (its copy was cancelled) is true. Never waits for itself: the engine waits for a prefetch
        in flight (``TransferEngine.wait``) only while none of its own on-demand reads is outstanding. Into host
        memory with the native kernels built, and ``stopped`` None or a ``StopFlag`` (the transfer engine's), it is
        one native call that checks the flags between its chunks without the interpreter lock (issue 47, session
        47: prefetches land sooner, 4-7 ms less stall per decode step); another ``stopped`` callable is asked in
        Python.

        Returns:
            True when all of the expert is in ``dst``; False when stopped (``dst`` partly written: its slot must not
            be used, which ``SlotTable.land(..., ok=False)`` ensures).
        Raises:
            MoeOffloadError: as ``copy_to``.
        """
        def gate() -> bool:
            with self._lock:
                if self._demand:
                    self.stats.prefetch_yields += 1
                while self._demand and not (stopped is not None and stopped()):
                    self._demand_done.wait(0.005)  # ``stopped`` flips without notifying this condition
            return not (stopped is not None and stopped())

        flag = StopFlag() if stopped is None else stopped if isinstance(stopped, StopFlag) else None
        return self._read(eid, dst, gate, stop=flag)

    def preempt_share(self) -> float:
        """The most an on-demand read waits behind a prefetch already reading, as a share of one expert's read: one
        chunk of ``prefetch_chunk`` bytes over the experts' mean read bytes, at most 1 (``core.prefetch_cost``'s
        ``preempt``: a miss pre-empts a prefetch at its next chunk)."""
        n = self.num_experts_total
        return preempt_share(self.prefetch_chunk, sum(s.length for e in range(n) for s in self.spans(e)) / max(1, n))

    def reset_stats(self) -> None:
        """Zero ``stats``."""
        with self._lock:
            self.stats = DiskReadStats()

    def executor(self) -> ThreadPoolExecutor:
        """The ``readers`` reader threads (started at the first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="moe-offload-disk",
                                                initializer=pin_io_thread)
            return self._pool

    def gather(self, eids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``runtime.store.gather_rows``: ``eids`` read from disk for host fallback compute."""
        return gather_rows(self, eids)

    def cached_bytes(self) -> int:
        """Bytes of the store's files in the page cache now (``runtime.page_cache.cached_bytes``; non-expert
        tensors of the same files count too)."""
        from .page_cache import cached_bytes

        return sum(cached_bytes(f.path) for f in self._files)

    def close(self) -> None:
        """Stop the reader threads and close the files; the store cannot read afterwards."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for f in self._files:
            os.close(f.fd)
        self._files.clear()
        self._index.clear()
