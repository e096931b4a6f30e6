#!/usr/bin/env python3
"""zentorch's fused MoE against our routed_experts kernel (issue 46, docs/benchmarks.md): values against float64,
the same result at 1 and 2 threads and with the experts in other slots, whether the inputs are left as they were,
and microseconds per call, on testbed-sparse-wide's layer shape (H 576, I 768, 32 experts, top-8, one token).

    pip download --no-deps zentorch==2.13.0.2 -d /tmp/zt
    pip install --no-deps --target ZENTORCH_DIR /tmp/zt/zentorch-*.whl deprecated wrapt
    python scripts/zentorch_eval.py ZENTORCH_DIR

zentorch stays out of the project's environment (it is installed into ZENTORCH_DIR only).
"""
import sys
import time

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "zentorch")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import zentorch  # noqa: E402,F401
from moe_offload.runtime.kernels import native  # noqa: E402
k = native()
H, I, E, K = 576, 768, 32, 8
g = torch.Generator().manual_seed(0)
w13f = torch.randn(E, 2 * I, H, generator=g) * 0.05
w2f = torch.randn(E, H, I, generator=g) * 0.05
x = torch.randn(1, H, generator=g)
ids = torch.randperm(E, generator=g)[:K].view(1, K)
wts = torch.rand(1, K, generator=g); wts /= wts.sum()
def ref(w13, w2, xx):
    out = torch.zeros(1, H, dtype=torch.float64)
    for j in range(K):
        e = int(ids[0, j]); h = w13[e].double() @ xx[0].double()
        out[0] += wts[0, j].double() * (w2[e].double() @ (F.silu(h[:I]) * h[I:]))
    return out
def zt(w13, w2, xx, ii):
    out = torch.empty_like(xx)
    torch.ops.zentorch.zentorch_fused_moe(out, xx, w13, w2, None, None, wts, ii.int(), False, "silu")  # int32 ids
    return out
perm = torch.randperm(E, generator=g); inv = torch.argsort(perm)  # expert e sits at slot inv[e]
for dt in (torch.float32, torch.bfloat16):
    row = {}
    for name, fn in (("zentorch", lambda a, b, s: zt(a, b, xx, s)), ("ours", lambda a, b, s: k.routed_experts(xx, s, wts, a, b))):
        w13, w2, xx = w13f.to(dt), w2f.to(dt), x.to(dt)
        r = ref(w13, w2, xx)
        x0, w130 = xx.clone(), w13.clone()
        try:
            torch.set_num_threads(2); o2 = fn(w13, w2, ids)
            torch.set_num_threads(1); o1 = fn(w13, w2, ids); torch.set_num_threads(2)
            op = fn(w13[perm].contiguous(), w2[perm].contiguous(), inv[ids])  # the same experts in other slots
            err = ((o2.double() - r).abs().max() / r.abs().max()).item()
            for _ in range(20): fn(w13, w2, ids)
            t0 = time.perf_counter()
            for _ in range(200): fn(w13, w2, ids)
            us = (time.perf_counter() - t0) / 200 * 1e6
            row[name] = f"inputs kept {torch.equal(xx, x0) and torch.equal(w13, w130)}, rel err {err:.2e}, 1 vs 2 threads equal {torch.equal(o1, o2)}, other slots equal {torch.equal(o2, op)}, {us:.0f} us/call"
        except Exception as e:
            row[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    print(dt, row)
