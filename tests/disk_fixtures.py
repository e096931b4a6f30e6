"""What the disk tier's tests share (``test_disk_prefetch``, ``test_native_prefetch``): the tiny gpt_oss checkpoint's
experts in a private store and on disk, and two helpers over them."""

from __future__ import annotations

import numpy as np
import pytest

from moe_offload.models.loader import load_offloaded
from moe_offload.runtime.disk_store import IO_ALIGN, DiskStore


@pytest.fixture(scope="module")
def stores(tiny_dirs):
    """The tiny gpt_oss checkpoint's experts: a private (pinned) store to compare with, and a disk store reading in
    4 KiB prefetch chunks, with its pool: ``(pinned store, disk store, pool)``."""
    pinned = load_offloaded(tiny_dirs["gpt_oss"], device="cpu", residency=0.3, progress=False)
    disk = load_offloaded(tiny_dirs["gpt_oss"], device="cpu", residency=0.3, progress=False, host_store="disk")
    disk.engine.store.prefetch_chunk = IO_ALIGN
    yield pinned.engine.store, disk.engine.store, disk.engine.pool
    pinned.close()
    disk.close()


def fields_equal(store, got: np.ndarray, want: np.ndarray) -> bool:
    """Whether two expert rows hold the same fields (the padding between fields is not read)."""
    return all(np.array_equal(got[f.offset:f.offset + f.nbytes], want[f.offset:f.offset + f.nbytes])
               for f in store.layout.fields)


def largest_expert(store: DiskStore) -> int:
    """The expert with the most bytes to read."""
    return max(range(store.num_experts_total), key=lambda e: sum(s.need for s in store.spans(e)))
