"""The linear layers of a decode step through the native kernel (``runtime.kernels``: ``linear_rows``, issue 46).

A decode step multiplies each weight matrix by one row (or a few: a batch); torch's CPU GEMM does that well below
the memory's bandwidth for a large matrix (an LM head of 49,152 x 576 float32: 9.5 ms against the kernel's 3.8 ms
here). ``use_fast_linears`` makes every ``nn.Linear`` of a model on the CPU with float32 or bfloat16 weights run the
kernel when its input has at most ``FAST_ROWS`` rows, and torch's ``F.linear`` otherwise (prefill). Each output is
one dot product computed by one thread, so these layers give the same result at any thread count. FullLoad and the
offloaded engines load through the same function, so they keep agreeing bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import native
from .kernels.ops import native_ops

#: inputs of at most this many rows run the kernel (a decode step of up to this many sequences)
FAST_ROWS = 8
DTYPES = (torch.float32, torch.bfloat16)


def fast_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through the kernel for a few rows on the CPU (module docstring), else ``F.linear``."""
    w = self.weight
    if x.dtype == w.dtype and x.numel() <= FAST_ROWS * w.shape[1] and x.device.type == "cpu":
        if torch.compiler.is_compiling():
            return torch.ops.moe_offload_native.linear_rows(x, w, self.bias)
        return self._moe_kernel.linear_rows(x, w, self.bias)
    return F.linear(x, w, self.bias)


class FastLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward is ``fast_linear_forward`` (the class of a layer ``use_fast_linears`` routed)."""

    forward = fast_linear_forward


def use_fast_linears(model: torch.nn.Module) -> int:
    """Route ``model``'s ``nn.Linear`` layers with float32 / bfloat16 weights on the CPU through the kernel for
    decode-sized inputs (module docstring); returns how many. Nothing changes without the kernel."""
    kernel = native()
    if kernel is None or native_ops() is None:  # the operators a compiled step calls, registered before it compiles
        return 0
    n = 0
    for mod in model.modules():
        if (type(mod) is torch.nn.Linear and mod.weight.device.type == "cpu" and mod.weight.dtype in DTYPES
                and mod.weight.stride(-1) == 1):
            mod._moe_kernel = kernel
            mod.__class__ = FastLinear  # a class swap, not a bound method on the instance: no reference cycle
            n += 1
    return n
