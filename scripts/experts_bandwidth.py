#!/usr/bin/env python3
"""The routed-experts kernel's read bandwidth on 4 KiB pages against huge pages (issue 46, runtime/huge_pages.py).

    python scripts/experts_bandwidth.py [THREADS]

30 layers of testbed-sparse-wide's bfloat16 experts (32 experts, hidden 576, expert width 768; random values),
top-8 of one token per layer, each layer's weights once as torch allocates them and once as
``huge_pages.copy_of``; prints the best of 10 steps of each, alternating, in ms per step and GB/s of expert bytes.
"""

import sys
import time

import torch

from moe_offload.runtime import huge_pages
from moe_offload.runtime.kernels import native

L, E, K, H, I = 30, 32, 8, 576, 768
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
kernel = native()
if kernel is None:
    sys.exit("the native kernels are not built (scripts/setup.sh builds them)")
g = torch.Generator().manual_seed(0)
small = [(torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16), torch.randn(E, H, I, generator=g).to(torch.bfloat16))
         for _ in range(L)]
huge = [(huge_pages.copy_of(gu), huge_pages.copy_of(dn)) for gu, dn in small]
x = torch.randn(1, H).to(torch.bfloat16)
slots = [torch.randperm(E, generator=g)[:K].view(1, K) for _ in range(L)]
w = torch.rand(1, K, generator=g)
step_bytes = L * K * 3 * H * I * 2
best = {"4 KiB pages": 1e9, "huge pages": 1e9}
for rep in range(20):
    name, layers = ("4 KiB pages", small) if rep % 2 == 0 else ("huge pages", huge)
    t = time.perf_counter()
    for (gu, dn), s in zip(layers, slots):
        kernel.routed_experts(x, s, w, gu, dn, None, False)
    best[name] = min(best[name], time.perf_counter() - t)
for name, s in best.items():
    print(f"{name:12s} threads {torch.get_num_threads()}: {s * 1e3:6.2f} ms per step, {step_bytes / s / 1e9:5.1f} GB/s")
