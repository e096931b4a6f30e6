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


class _SlotViews:
    """A parameter of single slots as zero-copy views: ``[i]`` is slot ``slots[i]``'s ``[*shape]`` weight (a
    format with ``zero_copy``: one plain field in the compute dtype)."""

    def __init__(self, rows: ExpertRows, name: str, slots: list[int]):
        self.rows, self.name, self.slots = rows, name, slots

    def __getitem__(self, i: int) -> torch.Tensor:
        s = self.slots[i]
        return self.rows.weight(self.name, slice(s, s + 1))[0]


def _looped_linear(x, weights: _SlotViews, bounds: list[int], bias, is_transposed):
    """``_grouped_linear`` as one ``torch.mm`` per non-empty group on the slot's own weights: ``x [S, in]`` sorted
    by group, group ``g`` the rows ``bounds[g]:bounds[g + 1]`` -> ``[S, out]`` (rows past ``bounds[-1]`` undefined).
    torch's CPU grouped GEMM computes each group with the same ``mm``, so the result is bitwise the grouped GEMM's
    (tested for float32, bfloat16, float16)."""
    w0 = weights[0]
    out = torch.empty(x.shape[0], w0.shape[-1] if is_transposed else w0.shape[-2], dtype=w0.dtype, device=x.device)
    x = x.to(w0.dtype)
    for g in range(len(bounds) - 1):
        a, b = bounds[g], bounds[g + 1]
        if b > a:
            w = weights[g]
            torch.mm(x[a:b], w if is_transposed else w.transpose(0, 1), out=out[a:b])
    if bias is not None:
        out.add_(bias)
    return out


#: most groups one grouped GEMM is given (torch's CUDA grouped GEMM refuses 1024 or more)
MAX_GROUPS = 1023
#: a slot window is used as the GEMM's groups only while it is at most this many times wider than the slots it
#: serves: every group, empty or not, costs the grouped GEMM a fixed overhead.
#: A layer whose experts lie scattered across a large pool is computed instead with one GEMM per slot on views of
#: the pool (CPU, ``_looped_linear``: no empty groups, no gathered copy), or from gathered rows (CUDA). Issue 17:
#: at residency 0.45 on testbed-sparse, windows ~400 slots wide for ~11 experts doubled the expert time, and
#: gathering the rows cost as much.
WINDOW_DENSITY = 4
#: devices whose sparse windows are computed one GEMM per slot (a Python loop of kernels costs too much on CUDA)
LOOPED_DEVICES = ("cpu",)


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``; on CUDA staged through pinned memory and copied without
    blocking the host (stream order delivers it before the kernels that read it)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def slot_pair_outputs(
    module: torch.nn.Module,
    rows: ExpertRows,
    hidden_states: torch.Tensor,
    slot_ids: torch.Tensor,
    pair_weights: torch.Tensor,
    num_top_k: int,
    slots: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compute routed token-expert pairs from slots, weighted by their router weights.

    Args:
        module: the transformers experts module (supplies ``has_gate``, ``has_bias``, ``is_transposed``,
            ``_apply_gate``, ``act_fn``, ``has_post_expert_norm``/``post_expert_norm``).
        rows: the experts' rows with their format (``SlotPool.rows``, or host store rows for host fallback).
        hidden_states: ``[T, H]`` tokens entering the experts.
        slot_ids: ``[T * k]`` int64 row of each pair (pair ``j`` belongs to token ``j // k``); pairs not to be
            computed now carry any id ``> max(slots)`` (a sentinel).
        pair_weights: ``[T * k]`` router weight of each pair.
        num_top_k: k.
        slots: the distinct rows the computed pairs use, sorted ascending (a host list: no device sync). When
            the format needs no decoding (``rows.zero_copy``) and ``[slots[0], slots[-1]]`` is at most
            ``MAX_GROUPS`` and at most ``WINDOW_DENSITY * len(slots)`` wide, the GEMM's groups are that window (a
            view of the pool, no copy); otherwise the groups are ``slots`` themselves (dense ids), whose weights
            are gathered (and decoded or dequantized) once each, in chunks of at most ``MAX_GROUPS`` groups per
            GEMM. Either way every pair is computed by the same per-group GEMM on the same weights.

    Returns:
        ``(out, perm, valid)``: ``out [T * k, H]`` weighted outputs in sorted-pair order, ``perm [T * k]`` the
        sorting permutation (``out[i]`` is pair ``perm[i]``) and ``valid [T * k]`` bool, which rows hold
        computed pairs.
    """
    lo, hi = slots[0], slots[-1]
    if rows.zero_copy and hi - lo < min(MAX_GROUPS, WINDOW_DENSITY * len(slots)):
        return _pair_outputs(module, rows, hidden_states, slot_ids - lo, pair_weights, num_top_k, hi - lo + 1,
                             slice(lo, hi + 1))
    if rows.zero_copy and slot_ids.device.type in LOOPED_DEVICES:
        sel = torch.tensor(slots, dtype=torch.long)
        return _pair_outputs(module, rows, hidden_states, torch.searchsorted(sel, slot_ids), pair_weights,
                             num_top_k, len(slots), sel, looped=slots)
    if len(slots) > MAX_GROUPS:
        return _split_pair_outputs(module, rows, hidden_states, slot_ids, pair_weights, num_top_k, slots)
    sel = device_index(slots, slot_ids.device)
    group_ids = torch.searchsorted(sel, slot_ids)  # sentinels (> every slot) land at len(slots)
    return _pair_outputs(module, rows, hidden_states, group_ids, pair_weights, num_top_k, len(slots), sel)


def _pair_outputs(module, rows, hidden_states, group_ids, pair_weights, num_top_k, num_groups, sel, looped=None):
    """The grouped GEMMs over ``num_groups`` groups whose weights are ``rows``' rows ``sel`` (a slice or an index
    tensor); ``group_ids [T * k]`` in ``[0, num_groups)`` for computed pairs, ``>= num_groups`` for the rest.
    ``looped``: the groups' slots (a host list, CPU): one GEMM per group on views of those slots instead."""
    ids_g, perm = torch.sort(group_ids)
    x = hidden_states[perm // num_top_k]
    w_g = pair_weights[perm]
    hist_in = ids_g.float() if ids_g.device.type in ("cpu", "mps") else ids_g.int()
    offs = torch.cumsum(torch.histc(hist_in, bins=num_groups, min=0, max=num_groups - 1), dim=0, dtype=torch.int32)
    valid = ids_g < num_groups
    bias_ids = ids_g.clamp(max=num_groups - 1)

    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    if looped is not None:
        bounds = [0] + offs.tolist()

        def linear(x, name, bias):
            return _looped_linear(x, _SlotViews(rows, name, looped), bounds, bias, module.is_transposed)
    else:
        def linear(x, name, bias):
            return _grouped_linear(x, rows.weight(name, sel), offs, bias, module.is_transposed)
    bias = rows.weight(up_name + "_bias", sel)[bias_ids] if module.has_bias else None
    h = linear(x, up_name, bias)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    bias = rows.weight("down_proj_bias", sel)[bias_ids] if module.has_bias else None
    h = linear(h, "down_proj", bias)
    if module.has_post_expert_norm:
        h = module.post_expert_norm(h)
    return h * w_g.unsqueeze(-1), perm, valid


def _split_pair_outputs(module, rows, hidden_states, slot_ids, pair_weights, num_top_k, slots):
    """``slot_pair_outputs`` for more than ``MAX_GROUPS`` distinct rows: GEMMs over chunks of the rows, assembled
    into one result in the sorted-pair order of the whole set (the same arithmetic per pair)."""
    n, hi = slot_ids.numel(), slots[-1]
    ids_all, perm = torch.sort(torch.where(slot_ids <= hi, slot_ids, hi + 1))
    out = torch.zeros(n, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
    where = torch.empty_like(perm)
    where[perm] = torch.arange(n, device=perm.device)  # position of each pair in the sorted order
    for c in range(0, len(slots), MAX_GROUPS):
        chunk = slots[c:c + MAX_GROUPS]
        in_chunk = (slot_ids >= chunk[0]) & (slot_ids <= chunk[-1])
        o, p, v = slot_pair_outputs(module, rows, hidden_states, torch.where(in_chunk, slot_ids, chunk[-1] + 1),
                                    pair_weights, num_top_k, chunk)
        out.index_copy_(0, where[p], torch.where(v.unsqueeze(-1), o.to(out.dtype), out[where[p]]))
    return out, perm, ids_all <= hi


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
