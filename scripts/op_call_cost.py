#!/usr/bin/env python3
"""What one call of a native kernel costs from a compiled graph (issue 46, runtime/kernels/ops.py).

    python scripts/op_call_cost.py

A compiled loop of 100 calls of ``linear_rows`` on a tiny input (8 x 64 weights: the kernel's own work is well under
a microsecond), through the operator registered in C++ (``torch.ops.moe_offload_native``) and through a
``torch.library.custom_op`` with a Python body (how the compiled step called the kernels before session 42), against
the same loop without the call; and the binding and the operator called from eager Python. One thread; microseconds
per call, best of 5 rounds of 50 loops.
"""

import time

import torch

from moe_offload.runtime.kernels import native
from moe_offload.runtime.kernels.ops import native_ops

torch.set_num_threads(1)
kernel = native()
if kernel is None or native_ops() is None:
    raise SystemExit("the native kernels are not built (scripts/setup.sh builds them)")


@torch.library.custom_op("moe_offload_script::linear_rows_py", mutates_args=())
def linear_rows_py(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return kernel.linear_rows(x, weight, None)


@linear_rows_py.register_fake
def _fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


x, w = torch.randn(1, 64), torch.randn(8, 64)
CALLS = 100


def loop(call):
    def f(x):
        for _ in range(CALLS):
            x = call(x)[:, :8].repeat(1, 8)
        return x
    return torch.compile(f, fullgraph=True)


variants = {
    "C++ operator": loop(lambda v: torch.ops.moe_offload_native.linear_rows(v, w, None)),
    "Python custom op": loop(lambda v: linear_rows_py(v, w)),
    "no call": loop(lambda v: v[:, :8]),
}
best = {}
for name, fn in variants.items():
    for _ in range(3):
        fn(x)
for _ in range(5):
    for name, fn in variants.items():
        t = time.perf_counter()
        for _ in range(50):
            fn(x)
        best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) / 50 / CALLS)
for name in variants:
    print(f"compiled, {name:16s}: {best[name] * 1e6:6.2f} us per loop iteration")
for name, call in (("binding", lambda: kernel.linear_rows(x, w, None)),
                   ("operator", lambda: torch.ops.moe_offload_native.linear_rows(x, w, None))):
    t = time.perf_counter()
    for _ in range(5000):
        call()
    print(f"eager,    {name:16s}: {(time.perf_counter() - t) / 5000 * 1e6:6.2f} us per call")
