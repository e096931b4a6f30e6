"""Expert layout and the host store: every routed expert's bytes in the next-level memory (DESIGN.md §2, §11).

An expert is one flat row of bytes (mixtral-offloading's habit): its storage fields (e.g. ``gate_up_proj [2I, H]``
bf16, or FP8 codes plus their block scales, or MXFP4 blocks plus e8m0 scales) are laid end to end, each at a
16-byte aligned offset, so moving an expert between the host store and a device slot is one copy of
``expert_bytes`` bytes in the checkpoint's own precision. What the fields mean is ``runtime.formats``' business.

Two host stores behind one interface (``copy_to``, ``gather``, ``nbytes``):

* ``HostStore`` (``--host-store pinned``): a private ``[N, expert_bytes]`` uint8 copy, page-locked on CUDA;
* ``MmapHostStore`` (``--host-store mmap``): no private copy; each expert's fields are byte ranges of the
  checkpoint's safetensors files, read through read-only memory maps (the page cache and the disk are the tier
  below host RAM, llama.cpp's default).
"""

from __future__ import annotations

import math
import mmap
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

#: ``--host-store`` modes whose experts are byte ranges of the checkpoint's files (``add_segment``), stored in the
#: files' own dtypes: ``MmapHostStore`` and ``runtime.disk_store.DiskStore``
FILE_BACKED = ("mmap", "disk")
#: byte alignment of every field offset and of the row length (CUDA grouped GEMM operand alignment)
ALIGN = 16


@dataclass(frozen=True)
class ExpertField:
    """One storage field of an expert: ``name``, per-expert ``shape``, element ``dtype`` and byte ``offset`` inside
    the expert's row."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


class ExpertLayout:
    """The byte layout of one expert, shared by every MoE layer of a model.

    Args:
        fields: ``[(name, per_expert_shape[, dtype]), ...]``, e.g. ``[("gate_up_proj", (2 * I, H)),
            ("down_proj", (H, I))]``; a field without its own dtype takes ``dtype``.
        dtype: default element dtype.

    Every field starts at a multiple of ``ALIGN`` (16) bytes and ``expert_bytes`` is a multiple of it.

    Raises:
        ValueError: a field without a dtype and no default, or a repeated name.
    """

    def __init__(self, fields: list[tuple], dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.fields: list[ExpertField] = []
        off = 0
        for spec in fields:
            name, shape = spec[0], tuple(int(s) for s in spec[1])
            dt = spec[2] if len(spec) > 2 else dtype
            if dt is None:
                raise ValueError(f"field {name} has no dtype")
            f = ExpertField(name, shape, dt, off)
            self.fields.append(f)
            off += -(-f.nbytes // ALIGN) * ALIGN
        self.expert_bytes = max(off, ALIGN)
        self.by_name = {f.name: f for f in self.fields}
        if len(self.by_name) != len(self.fields):
            raise ValueError("repeated field name in an expert layout")

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a ``[rows, expert_bytes]`` uint8 buffer into per-field views ``{name: [rows, *shape]}`` (no copy)."""
        rows = buf.shape[0]
        return {f.name: buf[:, f.offset:f.offset + f.nbytes].view(f.dtype).view(rows, *f.shape)
                for f in self.fields}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpertLayout) and self.fields == other.fields

    def __repr__(self) -> str:
        return f"ExpertLayout({[(f.name, f.shape, str(f.dtype).replace('torch.', '')) for f in self.fields]})"


def reset_store_stats(store) -> None:
    """Zero a store's own counters where it keeps any (``DiskStore.stats``, ``HostCache.cache_stats``)."""
    reset = getattr(store, "reset_stats", None)
    if reset is not None:
        reset()


def gather_rows(store, eids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buf [len(eids), expert_bytes] uint8, rows [N] int64)``: ``eids`` copied out of a file-backed store (mmap,
    disk, a host cache; ``store.copy_many``) and the map from global expert id to row of ``buf`` (-1 elsewhere), for
    host fallback compute."""
    buf = torch.empty((len(eids), store.layout.expert_bytes), dtype=torch.uint8)
    arr = buf.numpy()
    store.copy_many(list(eids), [arr[i] for i in range(len(eids))])
    rows = torch.full((store.num_experts_total,), -1, dtype=torch.long)
    rows[list(eids)] = torch.arange(len(eids))
    return buf, rows


def _unpin(t: torch.Tensor) -> None:
    """Undo ``_pin_in_place`` (errors ignored: the memory stays usable, pageable)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:
        pass


def _pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory at its exact size (``cudaHostRegister``); False when CUDA refuses."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        return int(getattr(rc, "value", rc)) == 0
    except Exception:
        return False


class HostStore:
    """All routed experts of a model in private host memory: a ``[num_experts_total, expert_bytes]`` uint8 tensor.

    Row ``eid = moe_layer * num_experts + expert`` holds that expert's bytes. With ``pin`` (CUDA) the buffer is
    allocated at its exact size and page-locked in place (``cudaHostRegister``; torch's pinned allocator would round
    a 58 GB store up to 64 GiB), so host-to-device copies run asynchronously at full link bandwidth; when pinning
    fails the store stays pageable (copies are then synchronous) and ``pinned`` is False.

    Args:
        layout: the expert layout.
        num_experts_total: N, the number of rows.
        pin: page-lock the buffer (only meaningful when a CUDA device is used).
    """

    mode = "pinned"

    def __init__(self, layout: ExpertLayout, num_experts_total: int, pin: bool = False):
        self.layout = layout
        self.num_experts_total = num_experts_total
        self.buf = torch.empty((num_experts_total, layout.expert_bytes), dtype=torch.uint8)
        self.pinned = bool(pin) and _pin_in_place(self.buf)
        self.pin_failed = bool(pin) and not self.pinned
        self._np = self.buf.numpy()

    @property
    def nbytes(self) -> int:
        """Private bytes held (all experts)."""
        return self.buf.numel()

    def row(self, eid: int) -> np.ndarray:
        """Expert ``eid``'s bytes as a writable numpy uint8 row (for the loader)."""
        return self._np[eid]

    def copy_to(self, eid: int, dst, non_blocking: bool = False) -> None:
        """Copy expert ``eid``'s row into ``dst``: a numpy uint8 row (CPU pool, single-threaded memcpy that releases
        the GIL) or a torch uint8 row on a device (asynchronous when the store is pinned and ``non_blocking``)."""
        if isinstance(dst, np.ndarray):
            np.copyto(dst, self._np[eid])
        else:
            dst.copy_(self.buf[eid], non_blocking=non_blocking and self.pinned)

    def copy_many(self, eids: list[int], dsts: list, non_blocking: bool = False) -> None:
        """``copy_to`` of each of ``eids`` into the matching ``dsts`` (one at a time: a memcpy is not worth threads)."""
        for e, d in zip(eids, dsts):
            self.copy_to(e, d, non_blocking)

    def gather(self, eids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Host rows for computing ``eids`` on the host: ``(buf, rows)`` where ``rows`` maps a global expert id to
        its row of ``buf``; here the whole store with ``rows`` None (identity, no copy)."""
        return self.buf, None

    def close(self) -> None:
        """Unpin the buffer (CUDA); the store stays readable."""
        if self.pinned:
            _unpin(self.buf)
            self.pinned = False


class MmapHostStore:
    """Routed experts read straight from the checkpoint's safetensors files through read-only memory maps.

    Nothing is copied at load: each expert is a list of segments ``(dst_offset, file, file_offset, nbytes)``
    whose bytes, in the file's own dtype, are the expert's fields. A slot load copies those segments (pageable
    memory: on CUDA the copies are synchronous). Requires every field to be stored in the file's dtype and layout
    (the loader checks this and refuses otherwise).

    Args:
        layout: the expert layout.
        num_experts_total: N.
    """

    mode = "mmap"
    pinned = False
    pin_failed = False

    def __init__(self, layout: ExpertLayout, num_experts_total: int):
        self.layout = layout
        self.num_experts_total = num_experts_total
        self._maps: dict[Path, np.ndarray] = {}
        self._files: list = []
        self._segments: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(num_experts_total)]

    def _map(self, path: Path) -> np.ndarray:
        m = self._maps.get(path)
        if m is None:
            fh = open(path, "rb")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            if sys.platform.startswith("linux"):
                mm.madvise(mmap.MADV_RANDOM)
            self._files.append((fh, mm))
            m = self._maps[path] = np.frombuffer(mm, dtype=np.uint8)
        return m

    def add_segment(self, eid: int, dst_offset: int, path: Path, file_offset: int, nbytes: int) -> None:
        """Expert ``eid``'s bytes ``[dst_offset, dst_offset + nbytes)`` are ``path``'s bytes from ``file_offset``."""
        self._segments[eid].append((dst_offset, self._map(path)[file_offset:file_offset + nbytes]))

    @property
    def nbytes(self) -> int:
        """Private bytes held: none (the experts stay in the files)."""
        return 0

    def copy_to(self, eid: int, dst, non_blocking: bool = False) -> None:
        """Copy expert ``eid``'s segments into ``dst`` (numpy uint8 row, or a torch uint8 row on a device)."""
        for off, src in self._segments[eid]:
            if isinstance(dst, np.ndarray):
                np.copyto(dst[off:off + len(src)], src)
            else:
                dst[off:off + len(src)].copy_(torch.from_numpy(src))

    def copy_many(self, eids: list[int], dsts: list, non_blocking: bool = False) -> None:
        """``copy_to`` of each of ``eids`` into the matching ``dsts`` (one at a time: page faults of one thread)."""
        for e, d in zip(eids, dsts):
            self.copy_to(e, d, non_blocking)

    def gather(self, eids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``gather_rows``: copies of ``eids``' rows for host fallback compute."""
        return gather_rows(self, eids)

    def close(self) -> None:
        """Release the memory maps."""
        self._segments = [[] for _ in range(self.num_experts_total)]
        self._maps.clear()
        for fh, mm in self._files:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the map goes with it
                pass
            fh.close()
        self._files.clear()
