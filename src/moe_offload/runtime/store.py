"""Expert layout and the host store: every routed expert's weights in the next-level memory (DESIGN.md §2).

An expert is one flat buffer (mixtral-offloading's habit): its parameters (e.g. ``gate_up_proj [2I, H]``,
``down_proj [H, I]``, optional biases) are laid end to end in a row of ``numel`` elements, so moving an expert
between the host store and a device slot is one copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertParam:
    """One parameter of an expert: ``name`` as on the transformers experts module, per-expert ``shape``, and its
    element ``offset`` inside the expert's flat row."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ExpertLayout:
    """The flat layout of one expert, shared by every MoE layer of a model.

    Args:
        params: ``[(name, per_expert_shape), ...]`` in the experts module's parameter order, e.g.
            ``[("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))]``.
        dtype: element dtype of the stored weights.
    """

    def __init__(self, params: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype):
        self.dtype = dtype
        self.params: list[ExpertParam] = []
        off = 0
        for name, shape in params:
            p = ExpertParam(name, tuple(int(s) for s in shape), off)
            self.params.append(p)
            off += p.numel
        self.numel = off
        self.by_name = {p.name: p for p in self.params}

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (all its parameters)."""
        return self.numel * torch.tensor([], dtype=self.dtype).element_size()

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a ``[rows, numel]`` buffer into per-parameter views ``{name: [rows, *shape]}`` (no copy)."""
        rows = buf.shape[0]
        return {p.name: buf[:, p.offset:p.offset + p.numel].view(rows, *p.shape) for p in self.params}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpertLayout) and self.params == other.params and self.dtype == other.dtype

    def __repr__(self) -> str:
        return f"ExpertLayout({[(p.name, p.shape) for p in self.params]}, {self.dtype})"


class HostStore:
    """All routed experts of a model in host memory: a ``[num_experts_total, layout.numel]`` tensor.

    Row ``eid = moe_layer * num_experts + expert`` holds that expert. On CUDA the buffer is pinned (page-locked)
    so host-to-device copies can run asynchronously at full link bandwidth.

    Args:
        layout: the expert layout.
        num_experts_total: N, the number of rows.
        pin: allocate pinned memory (only meaningful when a CUDA device is used).
    """

    def __init__(self, layout: ExpertLayout, num_experts_total: int, pin: bool = False):
        self.layout = layout
        self.num_experts_total = num_experts_total
        self.buf = torch.empty((num_experts_total, layout.numel), dtype=layout.dtype, pin_memory=pin)
        self.pinned = pin
        self._bytes = None

    def bytes_view(self):
        """The buffer as a numpy ``uint8`` array ``[num_experts_total, expert_bytes]`` (no copy)."""
        if self._bytes is None:
            self._bytes = self.buf.view(torch.uint8).numpy()
        return self._bytes

    @property
    def nbytes(self) -> int:
        """Total bytes held (all experts)."""
        return self.buf.numel() * self.buf.element_size()

    def write(self, eid: int, name: str, value: torch.Tensor) -> None:
        """Store parameter ``name`` of expert ``eid``; ``value`` must have the layout's per-expert shape."""
        p = self.layout.by_name[name]
        if tuple(value.shape) != p.shape:
            raise ValueError(f"expert {eid} {name}: expected shape {p.shape}, got {tuple(value.shape)}")
        self.buf[eid, p.offset:p.offset + p.numel].copy_(value.reshape(-1))
