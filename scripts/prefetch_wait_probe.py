#!/usr/bin/env python3
"""What a decode layer's waits for in-flight prefetches cost against its on-demand loads (issue 47, session 47):
runs ``moe-offload generate`` with the runtime prefetcher's ``fetch_waits`` and ``load_on_demand`` timed (decode
steps only) and prints, on stderr after the run:

- the prefetched experts a layer waited for, how many of them had not started copying when it did (still queued on
  the transfer engine behind other prefetches), and the wall time per waited expert;
- the experts loaded on demand and the wall time per loaded expert (a layer's loads are read together).

    python scripts/prefetch_wait_probe.py generate --model testbed-sparse-wide --policy xl+gate --residency 0.25 \\
        --host-store disk --sharegpt 1 --sharegpt-offset 600 --max-new-tokens 64 --threads 2 --quiet

A waited expert that costs nearly a load saved its layer little; loads that slow down beside the prefetches show
the disk shared with them. Put an earlier commit's ``src`` first on ``PYTHONPATH`` to probe it.
"""

import collections
import sys
import time

import moe_offload.runtime.prefetcher as prefetcher
from moe_offload.cli.entry import main

acc = collections.Counter()
_waits, _loads = prefetcher.Prefetcher.fetch_waits, prefetcher.Prefetcher.load_on_demand


def fetch_waits(self, waits):
    if self.step < 1 or not waits:
        return _waits(self, waits)
    queued = set(self.transfer.queued())
    acc["waits"] += len(waits)
    acc["not_started"] += sum(1 for w in waits if w.eid in queued)
    t0 = time.perf_counter()
    try:
        return _waits(self, waits)
    finally:
        acc["wait_s"] += time.perf_counter() - t0


def load_on_demand(self, loads):
    if self.step < 1 or not loads:
        return _loads(self, loads)
    acc["loads"] += len(loads)
    t0 = time.perf_counter()
    try:
        return _loads(self, loads)
    finally:
        acc["load_s"] += time.perf_counter() - t0


prefetcher.Prefetcher.fetch_waits, prefetcher.Prefetcher.load_on_demand = fetch_waits, load_on_demand
rc = main(sys.argv[1:])
print(f"waited for {acc['waits']} prefetched experts ({acc['not_started']} not started when waited), "
      f"{1e3 * acc['wait_s'] / max(1, acc['waits']):.2f} ms per waited expert; loaded {acc['loads']} on demand, "
      f"{1e3 * acc['load_s'] / max(1, acc['loads']):.2f} ms per loaded expert", file=sys.stderr)
sys.exit(rc)
