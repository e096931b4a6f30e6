"""Reading a file around the page cache (issue 35): aligned spans, files opened for ``O_DIRECT`` (or buffered
with ``posix_fadvise(DONTNEED)`` where it is refused), and several reads at once on a thread pool with the caller
taking part. Used by ``runtime.disk_store.DiskStore``; the span plan is DESIGN.md §11's "read the aligned span and
take the fields out".

Units: bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import MoeOffloadError

#: alignment of direct reads: file offset, length and buffer address (the page size covers every logical block size)
IO_ALIGN = 4096
#: ranges of one expert in one file at most this far apart are read as one span (bytes): a request costs ~60 us on
#: this machine's disk (4 KiB direct reads at 0.07 GB/s), the time to read ~64 KiB at its 1.1-1.3 GB/s
MERGE_GAP = 64 * 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class _Span:
    """One aligned read: ``file`` index, aligned ``start`` and ``length``, ``need`` (bytes from ``start`` that hold
    wanted data) and ``pieces`` ``[(dst_offset, offset in the span, nbytes)]``."""

    file: int
    start: int
    length: int
    need: int
    pieces: tuple[tuple[int, int, int], ...]


class _File:
    """An open checkpoint file: ``fd``, ``direct`` (opened with ``O_DIRECT``) and its ``path``."""

    def __init__(self, path: Path, fd: int, direct: bool):
        self.path, self.fd, self.direct = path, fd, direct


def open_direct(path: Path, allow_direct: bool = True) -> tuple[_File, str | None]:
    """Open ``path`` for streaming reads: ``O_DIRECT`` when the filesystem takes it (probed with one aligned read),
    else buffered with ``posix_fadvise(DONTNEED)`` after each read. Returns ``(file, why not direct or None)``.

    Raises:
        MoeOffloadError: the file cannot be opened, or the filesystem refuses both direct I/O and ``posix_fadvise``.
    """
    why = "direct I/O not available on this platform" if not (_O_DIRECT and allow_direct) else None
    if why is None:
        try:
            fd = os.open(path, os.O_RDONLY | _O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise MoeOffloadError(f"cannot open {path}: {e.strerror}") from None
            why = f"O_DIRECT refused ({e.strerror})"
        else:
            probe = mmap.mmap(-1, IO_ALIGN)
            try:
                os.preadv(fd, [memoryview(probe)], 0)
                return _File(path, fd, True), None
            except OSError as e:
                os.close(fd)
                why = f"direct reads refused ({e.strerror})"
            finally:
                probe.close()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise MoeOffloadError(f"cannot open {path}: {e.strerror}") from None
    try:  # no read-ahead (it would cache the neighbouring experts), and nothing of the file cached to begin with
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError) as e:
        os.close(fd)
        raise MoeOffloadError(f"{path}: the filesystem refuses both direct I/O ({why}) and posix_fadvise "
                              f"({getattr(e, 'strerror', e)}), so expert bytes would fill the page cache; use "
                              "--host-store mmap or pinned") from None
    return _File(path, fd, False), why


def copy_concurrently(copy, pool: ThreadPoolExecutor | None, eids: list[int], dsts: list, depth: int = 1) -> None:
    """``copy(eid, dst)`` for each pair, ``depth`` at once: the calling thread and ``depth - 1`` of ``pool``'s threads
    take the pairs in order (None or ``depth`` 1: one after another here; the caller works rather than waiting, which
    saves a thread hand-off per batch). Returns when all are done, raising the first failure once every copy has
    finished (a thread stops taking pairs after a failure of its own)."""
    pairs = iter(list(zip(eids, dsts)))
    take = threading.Lock()

    def work() -> None:
        while True:
            with take:
                nxt = next(pairs, None)
            if nxt is None:
                return
            copy(*nxt)

    helpers = min(depth, len(eids)) - 1 if pool is not None else 0
    futures = [pool.submit(work) for _ in range(max(0, helpers))]
    first = None
    try:
        work()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the helpers are done
        first = e
    for err in [f.exception() for f in futures]:
        first = first or err
    if first is not None:
        raise first


def plan_spans(segments: list[tuple[int, int, int, int]], merge_gap: int = MERGE_GAP,
               align: int = IO_ALIGN) -> list[_Span]:
    """Aligned reads covering one expert's ``segments [(dst_offset, file, file_offset, nbytes)]``: ranges of one file
    at most ``merge_gap`` bytes apart share a read; every read starts and ends on an ``align`` boundary."""
    spans, group = [], []

    def close_group():
        f = group[0][1]
        start = group[0][2] // align * align
        end = max(off + n for _, _, off, n in group)
        length = -(-(end - start) // align) * align
        spans.append(_Span(f, start, length, end - start,
                           tuple((dst, off - start, n) for dst, _, off, n in group)))

    for seg in sorted(segments, key=lambda s: (s[1], s[2])):
        if group and (seg[1] != group[0][1] or seg[2] - max(o + n for _, _, o, n in group) > merge_gap):
            close_group()
            group = []
        group.append(seg)
    if group:
        close_group()
    return spans


def native_plan(spans: list[_Span]) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's spans as the native ``read_expert`` takes them: int64 ``[S, 4]`` (file, start, length, need) and
    its pieces int64 ``[P, 4]`` (span index, destination offset, offset in the span, bytes)."""
    return (torch.tensor([[s.file, s.start, s.length, s.need] for s in spans], dtype=torch.int64).reshape(-1, 4),
            torch.tensor([[i, d, o, n] for i, s in enumerate(spans) for d, o, n in s.pieces],
                         dtype=torch.int64).reshape(-1, 4))


class StopFlag:
    """A copy's cancellation, which Python asks by calling it (``flag()``: True once ``set``) and a native read polls
    between its chunks (``array``: int32 ``[1]``, 1 once set) without the interpreter lock
    (``runtime.transfer.TransferEngine.cancel`` sets it; ``runtime.disk_store.DiskStore.read_prefetch`` reads it)."""

    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array = np.zeros(1, dtype=np.int32)

    def __call__(self) -> bool:
        return bool(self.array[0])

    def set(self) -> None:
        self.array[0] = 1


def read_native(kernel, files: list[_File], spans: list[_Span], plan: tuple[torch.Tensor, torch.Tensor],
                staging: np.ndarray, out: np.ndarray, demand: torch.Tensor | None = None,
                stop: StopFlag | None = None, chunk: int = 0) -> tuple[int, float, float, bool, int]:
    """One expert read by the native kernels' ``read_expert`` (``runtime.kernels``): its spans read into
    ``staging`` (page-aligned uint8) and its fields copied into ``out`` (uint8, host memory) without the interpreter
    lock. A prefetch passes ``demand`` (an int32 ``[1]`` tensor: the store's count of outstanding on-demand reads),
    ``stop`` and ``chunk`` (bytes, a multiple of ``IO_ALIGN``): it is then read in chunks, waiting before each one
    while ``demand[0] > 0`` and stopping once ``stop`` is set. Returns ``(requests, the copies' CPU s, their wall s,
    whether it stopped, the chunks that waited for on-demand reads)``.

    Raises:
        MoeOffloadError: a read failed, or a file ended early (truncated or replaced while running)."""
    flags = {}
    if chunk:
        flags = dict(demand=demand, stop=torch.from_numpy(stop.array), chunk=chunk)
    res = kernel.read_expert([f.fd for f in files], [f.direct for f in files], plan[0], plan[1],
                             torch.from_numpy(staging), torch.from_numpy(out), **flags)
    if res[5]:
        raise MoeOffloadError(read_error(files, spans, res[5], res[6], res[7]))
    return res[0], res[3], res[4], bool(res[8]), res[9]


def read_error(files: list[_File], spans: list[_Span], error: int, span: int, where: int) -> str:
    """The one-line message of a failed native read (``read_expert``'s or ``PrefetchQueue``'s outcome): ``error``
    an errno, or -1 when the file ended at byte ``where`` of span ``span`` of the expert's ``spans``."""
    path = files[spans[span].file].path
    if error > 0:
        return f"reading {path} at byte {where} failed: {os.strerror(error)}"
    return (f"{path} ended at byte {where} while an expert was read from it: the checkpoint file was truncated or "
            "replaced while running")
