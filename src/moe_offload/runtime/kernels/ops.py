"""The native kernels as torch operators (``ops.cpp``), for the graphs ``torch.compile`` captures (issue 46).

An operator with a Python body (``torch.library.custom_op``) costs about 14 us of interpreter time per call, against
about 2 us for the kernel's own binding; a compiled decode step calls the kernels ~180 times (4 projections, the
attention and the routed experts per layer, and the LM head), so it runs them through these operators, which the
dispatcher enters in C++. Eager code calls the bindings directly (``native()``): the same kernels, the same bits.

``native_ops()`` registers the operators of namespace ``NAMESPACE`` on first use, with their fake kernels (shapes
only) for tracing:

* ``routed_experts(x [T, H], slots [T, k] int64, weights [T, k], gate_up [S, 2I, H], down [S, H, I]) -> [T, H]``
  (``routed_experts.cpp``);
* ``linear_rows(x [..., K], weight [O, K], bias [O] | None) -> [..., O]`` (``linear_rows.cpp``);
* ``decode_attention(q [B, Hq, 1, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], mask | None, scale) -> [B, 1, Hq, Dv]``
  (``decode_attention.cpp``).
"""

from __future__ import annotations

import torch

from . import native

#: the operators' namespace: ``torch.ops.moe_offload_native``
NAMESPACE = "moe_offload_native"
_STATE: dict = {}


def _fakes() -> None:
    """The operators' fake kernels: output shapes and dtypes, for tracing."""
    def routed_experts(x, slots, weights, gate_up, down):
        return torch.empty_like(x)

    def linear_rows(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    def decode_attention(q, k, v, mask, scale):
        return q.new_empty(q.shape[0], 1, q.shape[1], v.shape[-1])

    for fn in (routed_experts, linear_rows, decode_attention):
        torch.library.register_fake(f"{NAMESPACE}::{fn.__name__}")(fn)


def native_ops():
    """``torch.ops.moe_offload_native`` with the kernels registered as operators (module docstring), or None when
    the native kernels cannot be had (``runtime.kernels.native``). Registers them on the first call: call it while
    setting a model up, before a step that uses them is compiled (the compiled code names
    ``torch.ops.moe_offload_native`` directly)."""
    module = native()
    if module is None:
        return None
    if "ops" not in _STATE:
        if module.register_ops(NAMESPACE):
            _fakes()
        _STATE["ops"] = getattr(torch.ops, NAMESPACE)
    return _STATE["ops"]
