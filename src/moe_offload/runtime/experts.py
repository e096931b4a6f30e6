"""The offloaded experts implementation registered with transformers' ``ExpertsInterface`` (DESIGN.md §4).

Every MoE architecture that declares its experts with ``@use_experts_implementation`` records its layout on the
experts module (``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``, ``_apply_gate``). This
module reads those flags and computes the experts *from the slot pool* instead of the module's own parameters:
router expert ids are turned into slot ids through the lookup table and one grouped matmul per projection runs
over the pool (SeqMoE §8.1 "compute-transparent expert placement").

The arithmetic mirrors transformers' ``grouped_mm`` experts implementation operation for operation (same sort,
same grouped GEMM per expert, same bias add, gate, routing-weight product and the same final
``[T, k, H].sum(dim=1)`` reduction), so the tokens equal those of the fully loaded model.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

try:  # the very grouped GEMM dispatcher transformers' own grouped_mm implementation uses
    from transformers.integrations.moe import _grouped_mm as _hf_grouped_mm
except ImportError:  # pragma: no cover - older/newer transformers without the private helper
    _hf_grouped_mm = None

IMPLEMENTATION_NAME = "moe_offload"


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [S, in]`` sorted by group, ``w [G, in, out]``, ``offs [G]`` int32 cumulative row counts -> ``[S, out]``.

    Rows past ``offs[-1]`` are left undefined (callers never read them)."""
    if _hf_grouped_mm is not None:
        return _hf_grouped_mm(x, w, offs)
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end].to(w.dtype), w[g], out=out[start:end])
        start = end
    return out


def _grouped_linear(x, weight, offs, bias, is_transposed):
    out = _grouped_mm(x, weight if is_transposed else weight.transpose(-2, -1), offs)
    if bias is not None:
        out.add_(bias)
    return out


def slot_pair_outputs(
    module: torch.nn.Module,
    views: dict[str, torch.Tensor],
    hidden_states: torch.Tensor,
    slot_ids: torch.Tensor,
    pair_weights: torch.Tensor,
    num_top_k: int,
    slot_lo: int,
    slot_hi: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compute routed token-expert pairs from slots, weighted by their router weights.

    Args:
        module: the transformers experts module (supplies ``has_gate``, ``has_bias``, ``is_transposed``,
            ``_apply_gate``, ``act_fn``, ``has_post_expert_norm``/``post_expert_norm``).
        views: slot-pool views ``{param_name: [S, *shape]}``.
        hidden_states: ``[T, H]`` tokens entering the experts.
        slot_ids: ``[T * k]`` int64 slot of each pair (pair ``j`` belongs to token ``j // k``); pairs not to be
            computed now carry any slot id ``> slot_hi`` (a sentinel).
        pair_weights: ``[T * k]`` router weight of each pair.
        num_top_k: k.
        slot_lo, slot_hi: the smallest and largest slot id among computed pairs; only ``views[..][lo:hi+1]`` is
            handed to the grouped GEMM (it loops over groups, so a narrow window is cheaper).

    Returns:
        ``(out, perm, valid)``: ``out [T * k, H]`` weighted outputs in sorted-pair order, ``perm [T * k]`` the
        sorting permutation (``out[i]`` is pair ``perm[i]``) and ``valid [T * k]`` bool, which rows hold
        computed pairs.
    """
    num_groups = slot_hi - slot_lo + 1
    ids_g, perm = torch.sort(slot_ids - slot_lo)
    x = hidden_states[perm // num_top_k]
    w_g = pair_weights[perm]
    hist_in = ids_g.float() if ids_g.device.type in ("cpu", "mps") else ids_g.int()
    offs = torch.cumsum(torch.histc(hist_in, bins=num_groups, min=0, max=num_groups - 1), dim=0, dtype=torch.int32)
    valid = ids_g < num_groups
    bias_ids = ids_g.clamp(max=num_groups - 1) + slot_lo

    def window(name):
        return views[name][slot_lo:slot_hi + 1]

    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    bias = views[up_name + "_bias"][bias_ids] if module.has_bias else None
    h = _grouped_linear(x, window(up_name), offs, bias, module.is_transposed)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    bias = views["down_proj_bias"][bias_ids] if module.has_bias else None
    h = _grouped_linear(h, window("down_proj"), offs, bias, module.is_transposed)
    if module.has_post_expert_norm:
        h = module.post_expert_norm(h)
    return h * w_g.unsqueeze(-1), perm, valid


def offloaded_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``ExpertsInterface`` entry point: ``hidden_states [T, H]``, ``top_k_index [T, k]`` int64,
    ``top_k_weights [T, k]`` -> ``[T, H]`` in ``hidden_states.dtype``.

    The module must have been attached to an engine (``runtime.engine.OffloadEngine.attach``)."""
    engine, moe_layer = self._moe_offload
    return engine.forward(self, moe_layer, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register ``offloaded_experts_forward`` under the name ``"moe_offload"`` (idempotent)."""
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION_NAME, offloaded_experts_forward)
