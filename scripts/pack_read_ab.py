#!/usr/bin/env python3
"""Expert reads from the aligned expert pack against reads from the checkpoint's safetensors files (issue 47 part 2):
the same random experts, in alternating blocks, into page-aligned slot rows, as ``--host-store disk`` reads misses
(``copy_many``, a layer's misses at once).

    python scripts/pack_read_ab.py [MODEL] [BLOCKS] [EXPERTS_PER_BLOCK] [MISSES_PER_CALL]

MODEL needs a pack beside it (``moe-offload pack MODEL``). Prints, per source, GB/s of expert bytes delivered and
the CPU of the reading threads' staging copies (none from the pack).
"""

import random
import sys
import time

import torch

from moe_offload.models.loader import load_offloaded
from moe_offload.runtime import huge_pages
from moe_offload.testbed.resolve import resolve_model

model = sys.argv[1] if len(sys.argv) > 1 else "testbed-sparse-wide"
blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 6
per_block = int(sys.argv[3]) if len(sys.argv) > 3 else 60
per_call = int(sys.argv[4]) if len(sys.argv) > 4 else 2
path = resolve_model(model, progress=False)
stores = {}
for name, pack in (("pack", None), ("safetensors", False)):
    lm = load_offloaded(path, residency=0.02, host_store="disk", pack=pack, progress=False)
    assert (lm.engine.store.pack is not None) == (name == "pack"), f"{name}: no pack beside {path}"
    stores[name] = (lm, lm.engine.store)
n_total = stores["pack"][1].num_experts_total
row_bytes = stores["pack"][1].layout.expert_bytes
rows = huge_pages.io_buffer(per_call * row_bytes).view(per_call, row_bytes)  # as the pool: huge pages
rng = random.Random(0)
took = {k: 0.0 for k in stores}
for b in range(blocks):
    eids = rng.sample(range(n_total), per_block)
    order = list(stores) if b % 2 == 0 else list(reversed(stores))
    for name in order:
        st = stores[name][1]
        t0 = time.perf_counter()
        for i in range(0, per_block, per_call):
            chunk = eids[i:i + per_call]
            st.copy_many(chunk, [rows[j].numpy() for j in range(len(chunk))])
        took[name] += time.perf_counter() - t0
for name, (lm, st) in stores.items():
    gb = blocks * per_block * row_bytes / 1e9
    print(f"{name:12s} {gb / took[name]:.2f} GB/s ({blocks * per_block} experts of {row_bytes} B, {per_call} per "
          f"call); in place {st.stats.in_place}; requests {st.stats.requests}")
    lm.close()
