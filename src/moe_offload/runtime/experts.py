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

from .formats import ExpertRows

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


#: most groups one grouped GEMM is given (torch's CUDA grouped GEMM refuses 1024 or more)
MAX_GROUPS = 1023


def slot_pair_outputs(
    module: torch.nn.Module,
    rows: ExpertRows,
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
        rows: the experts' rows with their format (``SlotPool.rows``, or host store rows for host fallback).
        hidden_states: ``[T, H]`` tokens entering the experts.
        slot_ids: ``[T * k]`` int64 row of each pair (pair ``j`` belongs to token ``j // k``); pairs not to be
            computed now carry any id ``> slot_hi`` (a sentinel).
        pair_weights: ``[T * k]`` router weight of each pair.
        num_top_k: k.
        slot_lo, slot_hi: the smallest and largest row among computed pairs. When the format needs no decoding
            (``rows.zero_copy``) and the window is at most ``MAX_GROUPS`` wide, the GEMM's groups are the window
            ``[lo, hi]`` itself (a view, no copy); otherwise the groups are the distinct rows computed (dense ids),
            whose weights are decoded (dequantized) once each — never more than ``MAX_GROUPS`` groups per GEMM.

    Returns:
        ``(out, perm, valid)``: ``out [T * k, H]`` weighted outputs in sorted-pair order, ``perm [T * k]`` the
        sorting permutation (``out[i]`` is pair ``perm[i]``) and ``valid [T * k]`` bool, which rows hold
        computed pairs.
    """
    if rows.zero_copy and slot_hi - slot_lo < MAX_GROUPS:
        num_groups = slot_hi - slot_lo + 1
        group_ids = slot_ids - slot_lo
        sel = slice(slot_lo, slot_hi + 1)
    else:
        sel = torch.unique(slot_ids[slot_ids <= slot_hi])
        if sel.numel() > MAX_GROUPS:
            return _split_pair_outputs(module, rows, hidden_states, slot_ids, pair_weights, num_top_k, sel)
        num_groups = sel.numel()
        group_ids = torch.searchsorted(sel, slot_ids)  # sentinels land at num_groups or beyond
        group_ids = torch.where(slot_ids <= slot_hi, group_ids, num_groups)
    ids_g, perm = torch.sort(group_ids)
    x = hidden_states[perm // num_top_k]
    w_g = pair_weights[perm]
    hist_in = ids_g.float() if ids_g.device.type in ("cpu", "mps") else ids_g.int()
    offs = torch.cumsum(torch.histc(hist_in, bins=num_groups, min=0, max=num_groups - 1), dim=0, dtype=torch.int32)
    valid = ids_g < num_groups
    bias_ids = ids_g.clamp(max=num_groups - 1)

    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    bias = rows.weight(up_name + "_bias", sel)[bias_ids] if module.has_bias else None
    h = _grouped_linear(x, rows.weight(up_name, sel), offs, bias, module.is_transposed)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    bias = rows.weight("down_proj_bias", sel)[bias_ids] if module.has_bias else None
    h = _grouped_linear(h, rows.weight("down_proj", sel), offs, bias, module.is_transposed)
    if module.has_post_expert_norm:
        h = module.post_expert_norm(h)
    return h * w_g.unsqueeze(-1), perm, valid


def _split_pair_outputs(module, rows, hidden_states, slot_ids, pair_weights, num_top_k, sel):
    """``slot_pair_outputs`` for more than ``MAX_GROUPS`` distinct rows: GEMMs over chunks of the rows, assembled
    into one result in the sorted-pair order of the whole set (same arithmetic per pair)."""
    n = slot_ids.numel()
    hi = int(sel[-1])
    ids_all, perm = torch.sort(torch.where(slot_ids <= hi, slot_ids, hi + 1))
    out = torch.zeros(n, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
    valid = ids_all <= hi
    where = torch.empty_like(perm)
    where[perm] = torch.arange(n, device=perm.device)  # position of each pair in the sorted order
    for c in range(0, sel.numel(), MAX_GROUPS):
        chunk = sel[c:c + MAX_GROUPS]
        lo_c, hi_c = int(chunk[0]), int(chunk[-1])
        in_chunk = (slot_ids >= lo_c) & (slot_ids <= hi_c)
        ids_c = torch.where(in_chunk, slot_ids, hi_c + 1)
        o, p, v = slot_pair_outputs(module, rows, hidden_states, ids_c, pair_weights, num_top_k, lo_c, hi_c)
        out[where[p[v]]] = o[v].to(out.dtype)
    return out, perm, valid


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
