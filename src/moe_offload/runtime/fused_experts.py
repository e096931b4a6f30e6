"""The routed experts of a layer through the native kernel (``runtime.kernels``, issue 46): which layers it serves,
the pool's weights as the kernel reads them, and FullLoad running the same kernel.

A layer is served when its experts module has transformers' standard gated layout — ``has_gate`` with the default
gate (``act_fn(gate) * up`` over concatenated ``gate_up_proj [E, 2I, H]``), SiLU, not transposed, no bias, no
post-expert norm — and its weights are plain float32 or bfloat16 in the compute dtype (``ExpertRows.zero_copy``).
Every other layer, and every layer when the kernel is not built (``runtime.kernels.native`` is None), runs the
grouped GEMMs of ``runtime.experts``. The kernel's result does not depend on where an expert sits in the pool nor
on the thread count, so an offloaded run and FullLoad (``use_fused_fullload``) agree bit for bit at any number of
threads.
"""

from __future__ import annotations

import torch
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

from .experts import device_index
from .kernels import native
from .kernels.ops import native_ops

#: the experts implementation FullLoad runs (``use_fused_fullload``)
FULLLOAD_IMPLEMENTATION = "moe_offload_fullload"
DTYPES = (torch.float32, torch.bfloat16)


def fused_layout(module: torch.nn.Module) -> bool:
    """Whether ``module``'s experts have the layout the kernel computes (module docstring)."""
    ok = getattr(module, "_moe_fused_layout", None)
    if ok is None:
        act = getattr(module, "act_fn", None)
        ok = bool(getattr(module, "has_gate", False) and getattr(module, "is_concatenated", True)
                  and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
                  and not getattr(module, "has_post_expert_norm", False)
                  and getattr(type(module), "_apply_gate", None) is _default_apply_gate
                  and isinstance(act, (SiLUActivation, torch.nn.SiLU)))
        module._moe_fused_layout = ok
    return ok


def kernel_for(module: torch.nn.Module, dtype: torch.dtype, device: torch.device):
    """The native kernel module when it serves ``module``'s layer in ``dtype`` on ``device``, else None."""
    if device.type != "cpu" or dtype not in DTYPES or not fused_layout(module):
        return None
    return native()


def pool_weights(rows) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(gate_up [S, 2I, H], down [S, H, I])``: every slot of ``rows`` (``runtime.formats.ExpertRows``) as strided
    views of its buffer, the kernel's operands (None when the format needs decoding)."""
    if not rows.zero_copy:
        return None
    cached = getattr(rows, "_moe_fused_views", None)
    if cached is None:
        n = rows.buf.shape[0]
        cached = rows._moe_fused_views = (rows.weight("gate_up_proj", slice(0, n)), rows.weight("down_proj",
                                                                                              slice(0, n)))
    return cached


def kernel_operands(rows, slot_ids: torch.Tensor, slots: list[int] | None = None
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(weights, slot_ids)`` for ``fused_round``: ``rows``' own slot views when its format needs no decoding,
    else the rows ``slots`` (the distinct rows the computed pairs use, a host list in any order; None: read
    from ``slot_ids``, a device->host copy) decoded once into dense
    groups ``(gate_up [G, 2I, H], down [G, H, I])`` (FP8 blocks: the values FullLoad holds, so the kernel gives
    FullLoad's result bit for bit) with ``slot_ids`` ``[T, k]`` renumbered into them (-1, a pair not computed,
    kept). The one rule every engine follows to run the kernel on a slot pool or host rows."""
    views = pool_weights(rows)
    if views is not None:
        return views, slot_ids
    if slots is None:
        slots = {s for s in slot_ids.reshape(-1).tolist() if s >= 0}
    sel = device_index(sorted(slots), slot_ids.device)  # ascending: searchsorted renumbers into it
    weights = (rows.weight("gate_up_proj", sel), rows.weight("down_proj", sel))
    return weights, torch.where(slot_ids >= 0, torch.searchsorted(sel, slot_ids.clamp(min=0)), -1)


def fused_round(kernel, views, hidden_states: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                pair_out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on one layer: ``hidden_states [T, H]``, ``slots [T, k]`` int64 (-1: a pair computed in another
    round), ``weights [T, k]`` -> ``[T, H]`` in ``hidden_states.dtype``; with ``pair_out`` (``[T, k, H]`` float32)
    the computed pairs' weighted outputs are written there instead (``sum_rounds`` adds them)."""
    gate_up, down = views
    return kernel.routed_experts(hidden_states, slots, weights, gate_up, down, pair_out)


def sum_rounds(kernel, pair_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pairs of several rounds (``fused_round``'s ``pair_out``) added per token in routing order: bit for bit
    what one fused round gives."""
    return kernel.sum_pairs(pair_out, dtype)


def fullload_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """FullLoad's experts implementation: the native kernel over the module's own parameters (slot = expert id)
    where it serves the layer, else the implementation the model had (``self._moe_fullload_fallback``)."""
    kernel = kernel_for(self, hidden_states.dtype, hidden_states.device)
    if kernel is None or self.gate_up_proj.dtype != hidden_states.dtype:
        return self._moe_fullload_fallback(self, hidden_states, top_k_index, top_k_weights)
    if torch.compiler.is_compiling():
        return torch.ops.moe_offload_native.routed_experts(hidden_states, top_k_index, top_k_weights,
                                                           self.gate_up_proj, self.down_proj)
    return kernel.routed_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, None)


def use_fused_fullload(experts_modules: list[torch.nn.Module]) -> bool:
    """Route FullLoad's experts modules through ``fullload_experts_forward`` when the kernel is built; returns
    whether it is (the modules are left as they are otherwise)."""
    if native_ops() is None:  # the kernel, and its operator for a compiled step, registered before it compiles
        return False
    ALL_EXPERTS_FUNCTIONS.register(FULLLOAD_IMPLEMENTATION, fullload_experts_forward)
    for mod in experts_modules:
        name = getattr(mod.config, "_experts_implementation", None)
        if name and name != FULLLOAD_IMPLEMENTATION:
            mod._moe_fullload_fallback = ALL_EXPERTS_FUNCTIONS.get(name, ALL_EXPERTS_FUNCTIONS["grouped_mm"])
        elif name is None:  # the class's own forward (what the decorator's dispatch falls back to)
            mod._moe_fullload_fallback = type(mod).forward.__wrapped__
    for mod in experts_modules:
        mod.config._experts_implementation = FULLLOAD_IMPLEMENTATION
    return True


def experts_path(experts_modules: list[torch.nn.Module], dtype: torch.dtype, device: torch.device) -> str:
    """Which code computes the routed experts of these MoE layers, in one line (``generate``'s stats say it)."""
    from .kernels import describe

    if native() is None:
        return describe()
    served = sum(kernel_for(m, dtype, device) is not None for m in experts_modules)
    if served == 0:
        return "torch grouped GEMMs (" + ("not on the CPU" if device.type != "cpu" else
                                          f"{str(dtype).replace('torch.', '')} experts" if dtype not in DTYPES else
                                          "the layers' experts layout is not the kernel's") + ")"
    rest = len(experts_modules) - served
    return describe() + (f" for {served} of {len(experts_modules)} MoE layers" if rest else "")

