"""Host fallback of the diffusion refresh engine (TIDE: "if an expert is needed but not present, the system falls back
to CPU computation"): the pairs of a layer's experts that are not on the device are computed where their weights
already are, in the host store, and only activations move.

**Overlap with the device.** A layer's host experts and its device experts are independent work, so the engine
runs them at the same time, the way offloading runtimes that compute on the CPU beside a GPU do: the host inputs
(hidden states, ids, router weights) are staged on the host *before* the device experts' kernels are launched, and
the host experts are computed while those kernels run (on CUDA the launches do not block the host; staging after
them would wait for them). A layer then costs ``max(device, host)`` instead of their sum — what
``core.costs.TideCosts.layer_time`` charges with ``overlap_host`` (the simulator and the tide planner's cost model
are given the same flag). The TIDE authors' reference code computes CPU and GPU experts one after another
(``overlap=False`` keeps that, for comparison).

On a machine without an accelerator "device" and "host" are the same processor; ``token_s`` / ``expert_s`` then
emulate a slower host: the host part of a layer lasts at least ``tokens * token_s + experts * expert_s`` seconds,
counted from the start of the layer's device compute with overlap (blocking copies the device waits for in between
are added, as the simulator charges them before the overlapped compute), from the start of the host part without;
slept out, or skipped on ``runtime.emulated_clock``'s clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .emulated_clock import now, wait_until
from .formats import ExpertRows


def host_expert_rows(store, fmt, gid: torch.Tensor, mask: torch.Tensor, eids: list[int]):
    """Host rows to compute the experts ``eids`` (sorted; the pairs ``mask`` of ``gid [T * k]``) from, for host
    fallback: ``(ExpertRows, row ids [T * k], the sorted rows used)``. A private store is used in place (row =
    global expert id); a file-backed store (mmap, disk) gathers the needed experts' rows."""
    buf, rows = store.gather(eids)
    if rows is None:
        return ExpertRows(fmt, buf), gid, eids
    return ExpertRows(fmt, buf), torch.where(mask, rows[gid], gid), list(range(len(eids)))


@dataclass
class StagedHost:
    """A layer's host-fallback inputs on the host (``HostFallback.stage``): ``hidden [T, H]``, ``gid [T * k]``
    int64 global expert ids, ``weights [T * k]`` router weights, ``mask [T * k]`` bool (the host pairs),
    ``eids`` (the host experts' global ids), ``emulated_s`` (the emulated host seconds of the layer)."""

    hidden: torch.Tensor
    gid: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    eids: list[int]
    emulated_s: float


class HostFallback:
    """Computes a layer's host pairs from the host store, overlapped with its device compute (module docstring).

    Args:
        store: the host store (all routed experts); fmt: the pool's expert format.
        token_s, expert_s: emulated host seconds per token-expert and per expert (>= 0; 0: the real cost only).
        overlap: run the host part during the device part (default) or after it (the authors' reference).
        accumulate: ``accumulate(pairs, module, rows, hidden, row_ids, mask, weights, k, slots)``, the engine's
            grouped-GEMM accumulation (``RefreshEngine._accumulate``), so host and device pairs use the same code.
    """

    def __init__(self, store, fmt, token_s: float, expert_s: float, overlap: bool, accumulate):
        self.store, self.fmt = store, fmt
        self.token_s, self.expert_s, self.overlap = float(token_s), float(expert_s), bool(overlap)
        self._accumulate = accumulate
        self._t_dev: float | None = None   # when the layer's device compute started (overlap)
        self._blocked = 0.0                 # seconds of blocking copies since then

    def begin_layer(self) -> None:
        """A layer starts: no device compute yet."""
        self._t_dev, self._blocked = None, 0.0

    def device_starts(self) -> None:
        """The layer's device compute is about to be launched (its first round's, if several)."""
        if self._t_dev is None:
            self._t_dev = now()

    def blocked(self, seconds: float) -> None:
        """A blocking copy held the layer for ``seconds`` (counted only after the device compute started)."""
        if self._t_dev is not None:
            self._blocked += seconds

    def stage(self, hidden_states, gid, weights, mask, eids: list[int], tokens: int, experts: int) -> StagedHost:
        """Move a layer's host inputs to the host *before* its device experts are launched (on CUDA this waits for
        the work queued so far, not for the device experts). ``hidden_states [T, H]``, ``gid``/``weights``/``mask``
        ``[T * k]``, ``eids`` the host experts' global ids; ``tokens`` / ``experts``: the planner's count of host
        token-experts and experts, which the emulated duration charges (as the simulator does)."""
        cpu = torch.device("cpu")
        return StagedHost(hidden_states.to(cpu), gid.to(cpu), weights.to(cpu), mask.to(cpu), sorted(eids),
                          tokens * self.token_s + experts * self.expert_s)

    def compute(self, pairs: torch.Tensor, module, staged: StagedHost) -> float:
        """Add the host pairs to ``pairs [T * k, H]`` and return the seconds the host part held the layer (its
        emulated duration included: see the module docstring)."""
        t0 = now()
        k = pairs.shape[0] // staged.hidden.shape[0]
        rows, g, used = host_expert_rows(self.store, self.fmt, staged.gid, staged.mask, staged.eids)
        host_pairs = torch.zeros(pairs.shape, dtype=pairs.dtype, device=torch.device("cpu"))
        self._accumulate(host_pairs, module, rows, staged.hidden, g, staged.mask, staged.weights, k, used)
        pairs += host_pairs.to(pairs.device)
        start = self._t_dev + self._blocked if self.overlap and self._t_dev is not None else t0
        wait_until(start + staged.emulated_s)
        return now() - t0
