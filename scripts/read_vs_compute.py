#!/usr/bin/env python3
"""What a thread doing direct reads costs a 2-thread compute on the same cores (issue 47, session 51): a compute loop
(16 x ``F.linear`` of ``[1, 1024]`` by ``[2048, 1024]``, float32, 400 passes) timed alone and beside a thread reading
FILE with ``O_DIRECT`` in requests of REQUEST bytes (``os.preadv`` into an anonymous mapping, wrapping at the end),
ROUNDS times; prints, per round, both times, their ratio, the reads' GB/s and the reader's CPU per MB (us).

    python scripts/read_vs_compute.py FILE [REQUEST_BYTES] [THREADS] [ROUNDS]
    # e.g. ~/.cache/moe-offload/testbed-sparse-wide/moe-offload-pack/experts.pack 1048576 2 3

THREADS: the compute's threads (default 2; 1 leaves the reader a core). Results: docs/results/prefetch-chunk-s51.txt.
"""

import mmap
import os
import sys
import threading
import time

import torch

if len(sys.argv) < 2:
    sys.exit(__doc__.split("\n\n")[1])
path = sys.argv[1]
req = int(sys.argv[2]) if len(sys.argv) > 2 else 2 << 20
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
if req <= 0 or req % 4096:
    sys.exit("read_vs_compute.py: REQUEST_BYTES must be a positive multiple of 4096 (direct I/O)")
try:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
except OSError as e:
    sys.exit(f"read_vs_compute.py: cannot open {path} for direct reads: {e.strerror}")
size = os.fstat(fd).st_size
if size < req:
    sys.exit(f"read_vs_compute.py: {path} holds {size} bytes, fewer than one request of {req}")
buf = mmap.mmap(-1, req)
stop = threading.Event()
stats = {"bytes": 0, "cpu": 0.0, "wall": 0.0}


def reader() -> None:
    off, c0, w0 = 0, time.thread_time(), time.perf_counter()
    while not stop.is_set():
        if off + req > size:
            off = 0
        stats["bytes"] += os.preadv(fd, [buf], off)
        off += req
    stats["cpu"], stats["wall"] = time.thread_time() - c0, time.perf_counter() - w0


ws = [torch.randn(2048, 1024) for _ in range(16)]
x = torch.randn(1, 1024)


def compute(passes: int) -> float:
    t0 = time.perf_counter()
    for _ in range(passes):
        for w in ws:
            torch.nn.functional.linear(x, w)
    return time.perf_counter() - t0


compute(50)
print(f"{torch.get_num_threads()} compute threads, requests of {req} bytes\n")
print("| round | compute alone, ms | beside the reads, ms | ratio | reads GB/s | reader CPU, us per MB |")
print("|---|---:|---:|---:|---:|---:|")
for r in range(1, rounds + 1):
    alone = compute(400)
    stats["bytes"] = 0
    stop.clear()
    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)
    beside = compute(400)
    stop.set()
    t.join()
    mb = stats["bytes"] / 1e6
    print(f"| {r} | {alone * 1e3:.0f} | {beside * 1e3:.0f} | {beside / alone:.2f} | "
          f"{stats['bytes'] / stats['wall'] / 1e9:.2f} | {stats['cpu'] / mb * 1e6:.0f} |", flush=True)
