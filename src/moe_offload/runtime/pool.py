"""The device slot pool shared by every MoE layer (SeqMoE §8.1).

One flat device tensor ``[num_slots, layout.numel]`` with per-parameter views ``[num_slots, *shape]`` (the fixed
base address a fused kernel needs), plus the device lookup table ``expert -> slot`` (``-1`` = not resident) that
turns a router's expert ids into slot ids. The pool only moves bytes; *which* expert goes where is decided by
``core.slots.SlotTable``.
"""

from __future__ import annotations

import torch

from . import huge_pages
from .formats import ExpertFormat, ExpertRows
from .store import ExpertLayout, HostStore


class SlotPool:
    """Device slots for experts plus the expert->slot lookup table.

    Args:
        fmt: the experts' ``ExpertFormat`` (or a bare ``ExpertLayout``: bytes only, no ``rows``); its layout must be
            the host store's.
        num_slots: S, number of slots.
        num_experts_total: N, size of the lookup table.
        device: where the slots live.

    Attributes:
        buf: ``[S, expert_bytes]`` uint8 on ``device``: each slot one expert's stored bytes (native precision).
        views: ``{field_name: [S, *shape]}`` views into ``buf``.
        rows: ``runtime.formats.ExpertRows`` over ``buf`` (compute weights of any slots), or None for a bare layout.
        lookup: ``[N]`` int64 on ``device``: slot of each expert or -1.
    """

    def __init__(self, fmt: ExpertFormat | ExpertLayout, num_slots: int, num_experts_total: int,
                 device: torch.device):
        self.format = fmt if isinstance(fmt, ExpertFormat) else None
        self.layout = fmt.layout if isinstance(fmt, ExpertFormat) else fmt
        self.num_slots = num_slots
        self.device = torch.device(device)
        if self.device.type == "cpu":  # on huge pages, as FullLoad's weights (runtime.huge_pages)
            self.buf = huge_pages.empty((num_slots, self.layout.expert_bytes), torch.uint8).zero_()
        else:
            self.buf = torch.zeros((num_slots, self.layout.expert_bytes), dtype=torch.uint8, device=self.device)
        self.views = self.layout.views(self.buf)
        self.rows = ExpertRows(self.format, self.buf) if self.format is not None else None
        self.lookup = torch.full((num_experts_total,), -1, dtype=torch.long, device=self.device)
        # on the CPU a slot copy is a plain single-threaded memcpy through a byte view: torch's copy_ splits a row
        # of a few hundred KB across its intra-op threads, which costs far more than the copy when the cores are
        # busy (measured: 20 us vs 6 ms per 330 KB expert with another process on both cores)
        self._bytes = self.buf.numpy() if self.device.type == "cpu" else None
        # on the CPU the lookup table is written through a numpy view: a torch indexed write of a few ids costs
        # tens of microseconds of dispatch, paid per landing and per eviction (issue 17, management time)
        self._lookup_np = self.lookup.numpy() if self.device.type == "cpu" else None

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots (the lookup table excluded: 8 bytes per expert)."""
        return self.buf.numel()

    def load(self, store: HostStore, eids: list[int], slots: list[int], evicted: list[int]) -> None:
        """Copy experts ``eids`` from the host store into ``slots`` and update the lookup table.

        Args:
            store: the host store.
            eids, slots: experts to load and their destination slots (same length).
            evicted: experts that left their slots for these loads (set to -1 in the lookup table).
        Copies are issued non-blocking; they are ordered before later kernels on the current stream. A disk store
        reads the experts concurrently (``runtime.disk_store.DiskStore.copy_many``).
        """
        rows = self._bytes if self._bytes is not None else self.buf
        store.copy_many(eids, [rows[s] for s in slots], non_blocking=self.device.type == "cuda")
        writes = dict.fromkeys(evicted, -1) | dict(zip(eids, slots))
        self.set_lookup(list(writes), list(writes.values()))

    def set_lookup(self, eids: list[int], slots: list[int]) -> None:
        """``lookup[eids[i]] = slots[i]`` (-1: not resident) in one indexed write, host lists staged without blocking
        the host. ``eids`` must be distinct (an indexed write with repeated indices keeps an unspecified one)."""
        if not eids:
            return
        if self._lookup_np is not None:
            self._lookup_np[eids] = slots
            return
        from .experts import device_index

        self.lookup[device_index(eids, self.device)] = device_index(slots, self.device)
