"""Weights on transparent huge pages (issue 46): the memory a decode step streams, mapped in 2 MiB pages.

A decode step reads every weight it uses once (on the CPU, 637 MB per step on testbed-sparse-wide), at the memory's
bandwidth. In 4 KiB pages that is one TLB miss per 4 KiB; in 2 MiB pages, one per 2 MiB. Measured on this project's
machine (AMD EPYC; ``scripts/experts_bandwidth.py``: the routed-experts kernel over 30 layers of bfloat16 experts,
both placements in one process): 26.0 GB/s in 4 KiB pages, 28.4 GB/s on huge pages at one thread; 42.3 and 47.7
GB/s at two.

Linux gives a mapping huge pages where ``transparent_hugepage`` is ``always``, or ``madvise`` and the range was
advised ``MADV_HUGEPAGE`` before its pages were first touched (later, only the kernel's background collapsing, slowly).
So a tensor gets a fresh anonymous mapping of its own, 2 MiB-aligned and advised, before it is filled. Where the
advice is refused or unknown (another OS, THP ``never``), the tensor is an ordinary one: this is a speed matter,
never a correctness one, and nothing here raises for it.

FullLoad and the offloaded engine both put their weights here (``models.loader``), and the slot pool its slots
(``runtime.pool``), so the two run at the same memory speed and their comparison stays fair.

Units: bytes.
"""

from __future__ import annotations

import mmap
import sys

import torch

#: a huge page on x86-64 and arm64 Linux (bytes)
HUGE_PAGE = 2 << 20
#: the smallest tensor worth placing on huge pages (bytes): below two huge pages no full aligned page may fit
MIN_BYTES = 2 * HUGE_PAGE
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None) if sys.platform.startswith("linux") else None


def empty(shape, dtype: torch.dtype, min_bytes: int = MIN_BYTES) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` on advised huge pages: its own anonymous mapping
    (fresh, so untouched: memory from the allocator's heap may have been touched before), 2 MiB-aligned, advised
    ``MADV_HUGEPAGE``; the tensor keeps the mapping alive. Below ``MIN_BYTES``, or where the advice cannot be
    given, its own anonymous mapping without the advice: page-aligned all the same (the slot pool's rows take
    direct reads, which want page-aligned memory: ``runtime.disk_store``). ``min_bytes``: that threshold (0: advise
    any size, ``io_buffer``)."""
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if _ADVICE is None or n < min_bytes:
        return torch.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8,
                                count=n).view(dtype).view(shape)
    buf = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared memory has no THP
    offset = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    try:
        buf.madvise(_ADVICE, offset, n)  # offset: a multiple of the page size, as the mapping's start is
    except OSError:  # refused (THP "never", an old kernel): ordinary pages, same values
        pass
    # a storage of exactly n bytes at the aligned offset (memory accounting sees the tensor's bytes, not the mapping's)
    return torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset).view(dtype).view(shape)


def io_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` for direct reads to land in, on advised huge pages whatever its size: the
    mapping is rounded up to whole 2 MiB pages. A direct read into 4 KiB pages pins every page and hands the device
    one segment per page; into huge pages it is a few segments. Measured on this project's machine (a virtual disk,
    ``python scripts/direct_read_pages.py``): 2.6 GB/s of 2.5 MiB reads at queue depth 1 into huge pages, 1.25 GB/s
    into 4 KiB pages. Where the advice is refused: the same buffer in ordinary pages (page-aligned)."""
    n = max(1, -(-int(nbytes) // HUGE_PAGE)) * HUGE_PAGE
    return empty((n,), torch.uint8, min_bytes=0)[:nbytes]


def copy_of(src: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``src`` on advised huge pages (same shape, dtype and values)."""
    t = empty(src.shape, src.dtype)
    t.copy_(src)
    return t


def rehome_parameters(model: torch.nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move every CPU parameter and buffer of at least ``min_bytes`` of ``model`` onto advised huge pages, in place
    (``param.data`` replaced by ``copy_of``; tied parameters stay tied, being one object). Meta and device
    tensors, and non-contiguous ones, are left alone. Returns the bytes moved."""
    moved = 0
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.device.type != "cpu" or not t.is_contiguous():
            continue
        seen.add(id(t))
        n = t.numel() * t.element_size()
        if n >= min_bytes:
            t.data = copy_of(t.data)
            moved += n
    return moved
