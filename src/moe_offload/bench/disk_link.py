"""``bench link --disk DIR``: direct-read bandwidth of the disk by request size and queue depth (issue 35).

``measure_disk`` writes a scratch file in DIR (so the filesystem and device measured are the checkpoint's), drops
it from the page cache, and reads it with ``O_DIRECT`` at random aligned offsets: for each request size, with 1, 2,
4 and 8 threads each issuing ``os.preadv`` (which releases the GIL), for a fixed time. The result is stored as the
``disk`` entry of the ``this-machine`` hardware profile (``core.disk_link.save_disk``), which the disk link model
(``core.disk_link``) reads. ``disk_table`` shows a measured entry.

Units: bytes (KiB = 1024 bytes), seconds, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from ..errors import MoeOffloadError
from ..runtime import huge_pages

#: request sizes measured (KiB) and queue depths (reader threads)
SIZES_KIB = (4, 16, 64, 128, 256, 1024, 4096)
DEPTHS = (1, 2, 4, 8)
_ALIGN = 4096


def _scratch(directory: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` random-ish bytes in ``directory``, written, synced and dropped from the page cache."""
    path = directory / f".moe-offload-disk-bench-{os.getpid()}"
    chunk = os.urandom(1 << 20) * 4
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


def _read_for(fd: int, size: int, span: int, seconds: float, seed: int, out: list) -> None:
    buf = huge_pages.io_buffer(size).numpy()  # where the runtime's reads land too: huge pages
    view = memoryview(buf)
    rng = random.Random(seed)
    slots = span // size
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += os.preadv(fd, [view], rng.randrange(slots) * size)
    out.append(n)


def _cell(fd: int, size: int, depth: int, span: int, seconds: float) -> float:
    """GB/s of ``depth`` threads reading ``size``-byte requests for ``seconds``."""
    counts: list[int] = []
    threads = [threading.Thread(target=_read_for, args=(fd, size, span, seconds, i, counts)) for i in range(depth)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0) / 1e9


def measure_disk(directory: str | Path, file_mb: int = 512, seconds: float = 0.4,
                 sizes_kib: tuple[int, ...] = SIZES_KIB, depths: tuple[int, ...] = DEPTHS) -> dict:
    """Direct-read bandwidth of the filesystem holding ``directory``, by request size and queue depth.

    Args:
        directory: where to put the scratch file (removed afterwards): the checkpoint's directory, typically.
        file_mb: scratch file size in MiB (reads land at random aligned offsets inside it).
        seconds: reading time per (size, depth) cell.
    Returns:
        The ``disk`` profile entry: ``{"directory", "direct_io", "file_mb", "seconds_per_cell", "table_gbps":
        {size_kib: {depth: GB/s}}, "qd1_gbps": {size_kib: GB/s}, "best": {size_kib: [depth, GB/s]}, "gbps": the best
        GB/s at >= 1 MiB requests, "time"}``.
    Raises:
        MoeOffloadError: ``directory`` is not a writable directory, or the filesystem refuses direct reads (the
            measurement would be the page cache's).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise MoeOffloadError(f"--disk {directory}: " + ("not a directory" if directory.exists() else "does not exist"))
    if file_mb * 1024 < 4 * max(sizes_kib) or seconds <= 0:
        raise MoeOffloadError("a disk measurement needs file_mb >= 4 x the largest request and seconds > 0")
    try:
        path = _scratch(directory, file_mb << 20)
    except OSError as e:
        raise MoeOffloadError(f"cannot write a scratch file in {directory}: {e.strerror}") from None
    try:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            _cell(fd, _ALIGN, 1, _ALIGN * 4, 0.01)
        except OSError as e:
            raise MoeOffloadError(f"{directory}: the filesystem refuses direct reads ({e.strerror}); the disk cannot "
                                  "be measured around the page cache") from None
        table = {}
        try:
            for kib in sizes_kib:
                table[kib] = {d: round(_cell(fd, kib << 10, d, file_mb << 20, seconds), 4) for d in depths}
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    best = {k: max(row.items(), key=lambda kv: kv[1]) for k, row in table.items()}
    return {"directory": str(directory.resolve()), "direct_io": True, "file_mb": file_mb,
            "seconds_per_cell": seconds,
            "table_gbps": {str(k): {str(d): v for d, v in row.items()} for k, row in table.items()},
            "qd1_gbps": {str(k): row[1] for k, row in table.items() if 1 in row},
            "best": {str(k): [d, v] for k, (d, v) in best.items()},
            "gbps": max((v for k, (_, v) in best.items() if k >= 1024), default=max(v for _, v in best.values())),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def disk_table(entry: dict) -> str:
    """A markdown table of a measured ``disk`` entry: GB/s by request size (rows) and queue depth (columns)."""
    depths = list(next(iter(entry["table_gbps"].values())))
    out = ["| request | " + " | ".join(f"QD {d}" for d in depths) + " | best |",
           "|---|" + "---|" * (len(depths) + 1)]
    for kib, row in entry["table_gbps"].items():
        d, v = entry["best"][kib]
        size = f"{int(kib) // 1024} MiB" if int(kib) >= 1024 else f"{kib} KiB"
        out.append(f"| {size} | " + " | ".join(f"{row[x]:.3f}" for x in depths) + f" | {v:.3f} (QD {d}) |")
    return "\n".join(out)
