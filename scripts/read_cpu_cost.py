#!/usr/bin/env python3
"""What one expert's direct read costs in CPU, bare and through the disk store (issue 47, session 48).

    python scripts/read_cpu_cost.py [READS]      # default 300

On testbed-sparse-wide from its expert pack, into the slot pool's rows (huge pages), one read at a time on this
thread, with the machine otherwise idle:

- bare: ``os.preadv`` of the expert's pack bytes (O_DIRECT) straight into a slot row;
- through the store: ``SlotPool.load`` of one expert (what an on-demand miss runs: the store's read plan, its
  on-demand bookkeeping and CPU account, the native ``read_expert``, the pool's lookup), after every expert has been
  read once so that the store's cached read plans are warm; also the part of it spent inside ``read_expert``.

Prints GB/s and the thread's CPU per read (``time.thread_time``: user + system). The difference between the two is
the Python around each read, which the reading threads pay at every on-demand and prefetch read.
"""

import os
import random
import sys
import time

import torch

from moe_offload.core.policy_spec import parse_policy
from moe_offload.models.expert_pack import PACK_FILE, stride_for
from moe_offload.models.loader import load_offloaded
from moe_offload.testbed.resolve import resolve_model

reads = int(sys.argv[1]) if len(sys.argv) > 1 else 300
torch.set_num_threads(2)
lm = load_offloaded(resolve_model("testbed-sparse-wide", progress=False), residency=0.25, policy=parse_policy("lru"),
                    host_store="disk", progress=False)
store, pool = lm.engine.store, lm.engine.pool
if store.pack is None:
    sys.exit("read_cpu_cost.py: testbed-sparse-wide has no expert pack (moe-offload pack testbed-sparse-wide)")
nbytes, experts = store.layout.expert_bytes, lm.num_moe_layers * lm.num_experts
rows = pool.buf.numpy()
rng = random.Random(0)
for e in range(experts):  # every expert once: the store's read plans are cached from here on
    pool.load(store, [e], [e % pool.num_slots], [])

kernel, inside = store._kernel, [0.0, 0]


class Timed:
    """The native kernels with ``read_expert``'s thread CPU summed."""

    def __getattr__(self, name):
        return getattr(kernel, name)

    def read_expert(self, *args):
        c0 = time.thread_time()
        try:
            return kernel.read_expert(*args)
        finally:
            inside[0] += time.thread_time() - c0
            inside[1] += 1


store._kernel = Timed()
fd = os.open(store.pack / PACK_FILE, os.O_RDONLY | os.O_DIRECT)
stride = stride_for(nbytes)
print(f"testbed-sparse-wide, {nbytes} B per expert, {reads} reads per line, one at a time\n")
print("| read | GB/s | thread CPU per read, ms | of which in read_expert, ms |")
print("|---|---:|---:|---:|")
for _ in range(2):
    picks = [(rng.randrange(experts), rng.randrange(pool.num_slots)) for _ in range(reads)]
    c0, t0 = time.thread_time(), time.perf_counter()
    for e, s in picks:
        os.preadv(fd, [memoryview(rows[s])], e * stride)
    dc, dt = time.thread_time() - c0, time.perf_counter() - t0
    print(f"| bare os.preadv | {reads * nbytes / dt / 1e9:.2f} | {dc / reads * 1e3:.3f} | - |")
    inside[:] = [0.0, 0]
    c0, t0 = time.thread_time(), time.perf_counter()
    for e, s in picks:
        pool.load(store, [e], [s], [])
    dc, dt = time.thread_time() - c0, time.perf_counter() - t0
    print(f"| SlotPool.load (the store) | {reads * nbytes / dt / 1e9:.2f} | {dc / reads * 1e3:.3f} | "
          f"{inside[0] / inside[1] * 1e3:.3f} |")
os.close(fd)
lm.close()
