#!/usr/bin/env python3
"""Direct reads into 4 KiB pages against reads into huge pages (issue 47: why ``runtime.huge_pages.io_buffer``).

    python scripts/direct_read_pages.py FILE [REQUEST_KIB] [READS]

Reads READS random 4 KiB-aligned requests of REQUEST_KIB (default 2592, a testbed-sparse-wide expert) from FILE
with ``O_DIRECT`` at queue depth 1, alternately into a buffer advised ``MADV_HUGEPAGE`` and one advised
``MADV_NOHUGEPAGE``, three rounds; prints GB/s (1e9 B/s) of each. Use a file larger than the page cache would
matter for, e.g. a checkpoint's safetensors shard.
"""

import mmap
import os
import random
import sys
import time

import torch

HUGE = 2 << 20


def buffer(nbytes: int, huge: bool) -> memoryview:
    """A 2 MiB-aligned, pre-touched buffer of ``nbytes`` in huge pages or in 4 KiB pages."""
    span = -(-nbytes // HUGE) * HUGE
    m = mmap.mmap(-1, span + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = -torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr() % HUGE
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, off, span)
    view = memoryview(m)[off:off + nbytes]
    view[:] = bytes(nbytes)
    return view


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) * 1024 if len(sys.argv) > 2 else 2592 * 1024
    reads = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    rng = random.Random(0)
    bufs = {"huge pages": buffer(n, True), "4 KiB pages": buffer(n, False)}
    for _ in range(3):
        for name, view in bufs.items():
            t0 = time.perf_counter()
            for _ in range(reads):
                os.preadv(fd, [view], rng.randrange(0, size - n) // 4096 * 4096)
            print(f"{name:12s} {reads * n / (time.perf_counter() - t0) / 1e9:.2f} GB/s")
    os.close(fd)


if __name__ == "__main__":
    main()
