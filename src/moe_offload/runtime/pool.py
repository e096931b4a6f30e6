"""The device slot pool shared by every MoE layer (SeqMoE §8.1).

One flat device tensor ``[num_slots, layout.numel]`` with per-parameter views ``[num_slots, *shape]`` (the fixed
base address a fused kernel needs), plus the device lookup table ``expert -> slot`` (``-1`` = not resident) that
turns a router's expert ids into slot ids. The pool only moves bytes; *which* expert goes where is decided by
``core.slots.SlotTable``.
"""

from __future__ import annotations

import numpy as np
import torch

from .store import ExpertLayout, HostStore


class SlotPool:
    """Device slots for experts plus the expert->slot lookup table.

    Args:
        layout: the expert layout (same as the host store's).
        num_slots: S, number of slots.
        num_experts_total: N, size of the lookup table.
        device: where the slots live.

    Attributes:
        buf: ``[S, layout.numel]`` tensor of ``layout.dtype`` on ``device``.
        views: ``{param_name: [S, *shape]}`` views into ``buf``.
        lookup: ``[N]`` int64 on ``device``: slot of each expert or -1.
    """

    def __init__(self, layout: ExpertLayout, num_slots: int, num_experts_total: int, device: torch.device):
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.buf = torch.zeros((num_slots, layout.numel), dtype=layout.dtype, device=self.device)
        self.views = layout.views(self.buf)
        self.lookup = torch.full((num_experts_total,), -1, dtype=torch.long, device=self.device)
        # on the CPU a slot copy is a plain single-threaded memcpy through a byte view: torch's copy_ splits a row
        # of a few hundred KB across its intra-op threads, which costs far more than the copy when the cores are
        # busy (measured: 20 us vs 6 ms per 330 KB expert with another process on both cores)
        self._bytes = self.buf.view(torch.uint8).numpy() if self.device.type == "cpu" else None

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots (the lookup table excluded: 8 bytes per expert)."""
        return self.buf.numel() * self.buf.element_size()

    def load(self, store: HostStore, eids: list[int], slots: list[int], evicted: list[int]) -> None:
        """Copy experts ``eids`` from the host store into ``slots`` and update the lookup table.

        Args:
            store: the host store.
            eids, slots: experts to load and their destination slots (same length).
            evicted: experts that left their slots for these loads (set to -1 in the lookup table).
        Copies are issued non-blocking; they are ordered before later kernels on the current stream.
        """
        if self._bytes is not None:
            src = store.bytes_view()
            for e, s in zip(eids, slots):
                np.copyto(self._bytes[s], src[e])
        else:
            non_blocking = store.pinned and self.device.type == "cuda"
            for e, s in zip(eids, slots):
                self.buf[s].copy_(store.buf[e], non_blocking=non_blocking)
        if evicted:
            self.lookup[torch.tensor(evicted, dtype=torch.long).to(self.device)] = -1
        self.lookup[torch.tensor(eids, dtype=torch.long).to(self.device)] = torch.tensor(
            slots, dtype=torch.long).to(self.device)
