"""The host tier between the disk and the device slots: ``--host-cache GB`` over ``--host-store disk`` (issue 35).

Three tiers: device slots (``runtime.pool``, their own ``core.slots.SlotTable`` and policy) <- host cache (this: a
``[rows, expert_bytes]`` buffer in host RAM, page-locked on CUDA, with its own expert -> row map and an eviction
policy from ``core.policies``) <- disk (``runtime.disk_store.DiskStore``, direct I/O). A copy into a slot is served
from the cache when the expert is there (a host memcpy, or a host->device copy at the link's speed on CUDA);
otherwise the expert is read from disk into a cache row, evicting the policy's victim, and copied on from there.

Thread-safety: copies come from the engine's thread, the disk store's readers (``copy_many``) and the transfer
engine's worker at once. The map is guarded by one lock; rows being filled or read are pinned (never a victim); a
request for an expert whose disk read is in flight waits for that read instead of issuing a second one. When every
row is pinned, the expert is read from disk straight into the destination (counted as a bypass).

On the CPU the slot pool is already host RAM, so the cache only adds a copy there; it exists so the three-tier path
runs and is tested on the machines without a GPU, with the same code as on CUDA.

Units: bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..core.policies import make_policy
from ..core.policy_spec import PolicySpec
from ..errors import MoeOffloadError
from . import huge_pages
from .disk_store import DiskStore, copy_concurrently
from .store import _pin_in_place, _unpin, gather_rows


@dataclass
class HostCacheStats:
    """``hits`` (copies served from a cache row), ``misses`` (experts read from disk into a row), ``bypasses`` (read
    from disk straight into the destination: every row pinned), ``waits`` (copies that waited for another thread's
    read of the same expert), ``evictions``."""

    hits: int = 0
    misses: int = 0
    bypasses: int = 0
    waits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses + self.bypasses
        return self.hits / n if n else 0.0


class HostCache:
    """A host-RAM expert cache of ``rows`` experts in front of a ``DiskStore``, with the stores' interface
    (``copy_to``, ``copy_many``, ``gather``, ``nbytes``, ``close``; ``mode`` "disk": it is the disk tier to the
    engine, with a cache in front).

    Args:
        disk: the disk store (owned: closed with the cache).
        rows: experts the cache holds, >= 1.
        policy: its eviction policy, a history policy (``core.policies.make_policy``: ``lru``, ``lfu``, ``lfru[-H]``;
            a name is parsed).
        pin: page-lock the rows (CUDA: host->device copies from them run at the link's speed).

    Raises:
        MoeOffloadError: ``rows`` < 1 or an unknown policy.
    """

    mode = "disk"

    def __init__(self, disk: DiskStore, rows: int, policy: PolicySpec | str = "lru", pin: bool = False):
        if rows < 1:
            raise MoeOffloadError(f"a host cache needs at least one expert row, got {rows}")
        self.disk = disk
        self.layout = disk.layout
        self.num_experts_total = disk.num_experts_total
        self.rows = min(int(rows), disk.num_experts_total)
        self.policy = make_policy(policy, num_slots=self.rows, top_k=1)
        self.buf = huge_pages.empty((self.rows, self.layout.expert_bytes), torch.uint8)  # direct reads land here
        self.pinned = bool(pin) and _pin_in_place(self.buf)
        self.pin_failed = bool(pin) and not self.pinned
        self._np = self.buf.numpy()
        self.cache_stats = HostCacheStats()
        self._row_of: dict[int, int] = {}
        self._free = list(range(self.rows - 1, -1, -1))
        self._pins = [0] * self.rows                   # copies using each row now
        self._pinned: set[int] = set()                 # experts whose row is in use (never a victim)
        self._inflight: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._tick = 0

    # the disk store's counters and settings, read by reports and the memory plan
    stats = property(lambda self: self.disk.stats)
    readers = property(lambda self: self.disk.readers)
    buffered_reason = property(lambda self: self.disk.buffered_reason)
    files = property(lambda self: self.disk.files)
    pack = property(lambda self: self.disk.pack)
    max_staging_bytes = property(lambda self: self.disk.max_staging_bytes)

    def reset_stats(self) -> None:
        """Zero the cache's counters and the disk store's."""
        with self._lock:
            self.cache_stats = HostCacheStats()
        self.disk.reset_stats()

    @property
    def nbytes(self) -> int:
        """Private bytes held for experts: the cache rows."""
        return self.buf.numel()

    def _claim(self, eid: int) -> tuple[str, object]:
        """Under the lock: ``("hit", row)``, ``("fill", row)`` (this thread reads it from disk), ``("wait", event)``
        or ``("bypass", None)``; a returned row is pinned."""
        self._tick += 1
        row = self._row_of.get(eid)
        if row is not None:
            self.policy.on_access(eid, self._tick)
            self._pin(eid, row)
            self.cache_stats.hits += 1
            return "hit", row
        ev = self._inflight.get(eid)
        if ev is not None:
            return "wait", ev
        self.policy.on_access(eid, self._tick)
        if self._free:
            row = self._free.pop()
        else:
            resident, pinned = self.policy.resident, self._pinned
            if len(resident) <= sum(1 for e in pinned if e in resident):
                return "bypass", None
            victim = self.policy.victim(pinned)
            row = self._row_of.pop(victim)
            self.policy.on_evict(victim)
            self.cache_stats.evictions += 1
        self._pin(eid, row)
        self._inflight[eid] = threading.Event()
        return "fill", row

    def _pin(self, eid: int, row: int) -> None:
        self._pins[row] += 1
        self._pinned.add(eid)

    def _unpin(self, eid: int, row: int) -> None:
        self._pins[row] -= 1
        if not self._pins[row]:
            self._pinned.discard(eid)

    def copy_to(self, eid: int, dst, non_blocking: bool = False, depth: int = 1) -> None:
        """Expert ``eid`` into ``dst`` (numpy uint8 row, or a torch uint8 row on a device: a synchronous copy) from
        its cache row, reading it from disk into a row first on a miss (an on-demand read: ``DiskStore.copy_to``;
        ``depth``: reads issued at once with it, for its statistics). Thread-safe.

        Raises:
            MoeOffloadError: a disk read fails (``DiskStore.copy_to``).
        """
        self._copy(eid, dst, None, depth)

    def read_prefetch(self, eid: int, dst, stopped=None) -> bool:
        """``copy_to`` for a prefetch: a disk read on a cache miss is ``DiskStore.read_prefetch`` (yields to on-demand
        reads at each chunk, stops when ``stopped()``; a stopped read gives its row back). Returns False when
        stopped (``dst`` not to be used), True when the expert is in ``dst``.

        Raises:
            MoeOffloadError: a disk read fails.
        """
        return self._copy(eid, dst, stopped if stopped is not None else (lambda: False), 1)

    def _copy(self, eid: int, dst, stopped, depth: int) -> bool:
        """``copy_to`` (``stopped`` None) or ``read_prefetch``; False when a prefetch was stopped."""
        while True:
            with self._lock:
                kind, got = self._claim(eid)
                if kind == "wait":
                    self.cache_stats.waits += 1
            if kind != "wait":
                break
            got.wait()
        if kind == "bypass":
            self.cache_stats.bypasses += 1
            return self._from_disk(eid, dst, stopped, depth)
        row = got
        try:
            if kind == "fill" and not self._fill(eid, row, stopped, depth):
                return False
            if isinstance(dst, np.ndarray):
                np.copyto(dst, self._np[row])
            else:
                dst.copy_(self.buf[row])
            return True
        finally:
            with self._lock:
                self._unpin(eid, row)

    def _from_disk(self, eid: int, dst, stopped, depth: int) -> bool:
        if stopped is None:
            self.disk.copy_to(eid, dst, depth=depth)
            return True
        return self.disk.read_prefetch(eid, dst, stopped)

    def _fill(self, eid: int, row: int, stopped, depth: int) -> bool:
        """Read ``eid`` from disk into ``row``, then publish it (or give the row back if the read fails or the
        prefetch is stopped); False when stopped."""
        ok = False
        try:
            ok = self._from_disk(eid, self._np[row], stopped, depth)
            return ok
        finally:  # a failed or stopped read gives the row back (an error goes on to the caller)
            with self._lock:
                if ok:
                    self._row_of[eid] = row
                    self.policy.on_insert(eid, self._tick)
                    self.cache_stats.misses += 1
                else:
                    self._free.append(row)
                self._inflight.pop(eid).set()

    def copy_many(self, eids: list[int], dsts: list, non_blocking: bool = False) -> None:
        """``copy_to`` of each expert, the disk reads of several misses at once (the disk store's reader threads and
        the calling thread, ``readers`` at most)."""
        depth = max(1, min(len(eids), self.disk.readers))
        copy_concurrently(lambda e, d: self.copy_to(e, d, depth=depth),
                          self.disk.executor() if depth > 1 else None, eids, dsts, depth)

    def gather(self, eids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``runtime.store.gather_rows`` through the cache, for host fallback compute."""
        return gather_rows(self, eids)

    def cached_bytes(self) -> int:
        """The disk store's files in the page cache (``DiskStore.cached_bytes``)."""
        return self.disk.cached_bytes()

    def close(self) -> None:
        """Close the disk store and unpin the rows."""
        self.disk.close()
        if self.pinned:
            _unpin(self.buf)
            self.pinned = False
