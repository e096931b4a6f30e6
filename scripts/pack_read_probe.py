#!/usr/bin/env python3
"""How fast the disk reads whole experts of an expert pack, as the runtime's misses read them (issue 47, session 50):
one thread, queue depth 1, each read one expert's aligned bytes at a random expert's offset, with direct I/O into a
huge-page buffer (``runtime.huge_pages.io_buffer``: where the runtime's reads land); for SECONDS idle, then beside a
2-thread float32 matmul (compute, little memory traffic), then idle again. Prints GB/s (1e9 B/s) of each phase.

    python scripts/pack_read_probe.py PACK_FILE EXPERT_BYTES [SECONDS]
    # e.g. ~/.cache/moe-offload/testbed-sparse-wide/moe-offload-pack/experts.pack 2654208 2
"""

import os
import random
import sys
import threading
import time

import torch

from moe_offload.runtime import huge_pages

if len(sys.argv) not in (3, 4):
    sys.exit("usage: pack_read_probe.py PACK_FILE EXPERT_BYTES [SECONDS]")
path, expert_bytes = sys.argv[1], int(sys.argv[2])
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
size = -(-expert_bytes // 4096) * 4096
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
view = memoryview(huge_pages.io_buffer(size).numpy())
experts = os.path.getsize(path) // size


def read_for(label: str) -> None:
    rng, n, t0 = random.Random(1), 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += os.preadv(fd, [view], rng.randrange(experts) * size)
    print(f"{label}: {n / (time.perf_counter() - t0) / 1e9:.2f} GB/s", flush=True)


read_for("idle")
stop = threading.Event()


def compute() -> None:
    torch.set_num_threads(2)
    a = torch.randn(2048, 2048)
    while not stop.is_set():
        a @ a


worker = threading.Thread(target=compute)
worker.start()
time.sleep(0.3)
read_for("beside a 2-thread matmul")
stop.set()
worker.join()
read_for("idle again")
