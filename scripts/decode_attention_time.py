#!/usr/bin/env python3
"""Time of one ``decode_attention`` call (issue 46, runtime/kernels/decode_attention.cpp) on testbed-sparse-wide's
shape: 9 query heads over 3 key/value heads of 64, one query, S cached positions, with and without a bool mask.

    python scripts/decode_attention_time.py [THREADS]

Prints microseconds per call (mean of 300 after 20 warm-up calls) for bfloat16 and float32 caches at S = 550 (the
518-token ShareGPT prompt of ``bench peers`` plus its decode) and S = 2048; the AVX2 and portable paths, which give
the same bits.
"""

import sys
import time

import torch

from moe_offload.runtime.kernels import native

kernel = native()
if kernel is None:
    raise SystemExit("the native kernels are not built (scripts/setup.sh builds them)")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
g = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    for S in (550, 2048):
        q = torch.randn(1, 9, 1, 64, generator=g).to(dtype)
        k = torch.randn(1, 3, S, 64, generator=g).to(dtype)
        v = torch.randn(1, 3, S, 64, generator=g).to(dtype)
        for mask in (None, torch.ones(1, 1, 1, S, dtype=torch.bool)):
            for portable in (False, True):
                for _ in range(20):
                    kernel.decode_attention(q, k, v, mask, 0.125, portable)
                t = time.perf_counter()
                for _ in range(300):
                    kernel.decode_attention(q, k, v, mask, 0.125, portable)
                print(f"{str(dtype):14s} S={S:5d} {'mask' if mask is not None else 'no mask':7s} "
                      f"{'portable' if portable else 'avx2':8s}: {(time.perf_counter() - t) / 300 * 1e6:7.1f} us")
