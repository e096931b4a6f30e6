"""Where a disk-store read's time goes (docs/benchmarks.md, "Where the rest goes"; issue 35).

On ``--model`` (default testbed-sparse) loaded with ``--host-store disk``: the experts' offsets modulo 4 KiB (why no
slot layout takes every expert straight from the file), then, for 400 random experts, GB/s (1e9 B/s) of raw
``os.preadv`` of the store's own aligned spans one at a time, of ``DiskStore.copy_to`` and of ``copy_many`` of 4, and
of raw reads 4 / 2 at a time with a barrier per batch against the same threads reading without one. Three rounds.

    .venv/bin/python scripts/disk_read_breakdown.py [--model testbed-sparse]
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from moe_offload.models.loader import load_offloaded
from moe_offload.testbed.resolve import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="testbed-sparse")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_offloaded(resolve_model(args.model), residency=0.25, policy="lru", host_store="disk", device="cpu",
                        progress=False)
    store = lm.engine.store
    spans = [store.spans(e) for e in range(store.num_experts_total)]
    offsets = collections.Counter(min(p[1] - p[0] for p in sp[0].pieces) % 4096 for sp in spans)
    print(f"expert bytes {store.layout.expert_bytes}; pieces per span {len(spans[0][0].pieces)}; experts at "
          f"{len(offsets)} different offsets modulo 4 KiB (most common: {offsets.most_common(3)})")
    rng = random.Random(0)
    order = [rng.randrange(len(spans)) for _ in range(400)]
    bufs = [mmap.mmap(-1, max(s.length for sp in spans for s in sp)) for _ in range(4)]
    pool = ThreadPoolExecutor(4)

    def read(i: int, eids) -> int:
        view = memoryview(bufs[i])
        return sum(os.preadv(store._files[s.file].fd, [view[:s.length]], s.start) for e in eids for s in spans[e])

    def gbps(fn) -> float:
        t = time.perf_counter()
        n = fn()
        return n / (time.perf_counter() - t) / 1e9

    def batches(k: int) -> int:
        return sum(sum(pool.map(lambda i, e: read(i, [e]), range(k), order[j:j + k])) for j in range(0, len(order), k))

    def stream(k: int) -> int:
        return sum(pool.map(lambda i: read(i, order[i::k]), range(k)))

    def store_one() -> int:
        row = torch.empty(store.layout.expert_bytes, dtype=torch.uint8)
        for e in order:
            store.copy_to(e, row)
        return sum(s.length for e in order for s in spans[e])

    def store_many() -> int:
        rows = [torch.empty(store.layout.expert_bytes, dtype=torch.uint8) for _ in range(4)]
        for j in range(0, len(order), 4):
            store.copy_many(order[j:j + 4], rows[:len(order[j:j + 4])])
        return sum(s.length for e in order for s in spans[e])

    for r in range(3):
        print(f"round {r + 1}: raw one at a time {gbps(lambda: read(0, order)):.2f}, store copy_to {gbps(store_one):.2f},"
              f" store copy_many(4) {gbps(store_many):.2f}; raw 4 / 2 at a time with a barrier {gbps(lambda: batches(4)):.2f}"
              f" / {gbps(lambda: batches(2)):.2f}, without {gbps(lambda: stream(4)):.2f} / {gbps(lambda: stream(2)):.2f} GB/s")
    lm.close()


if __name__ == "__main__":
    main()
