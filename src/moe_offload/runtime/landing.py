"""What ``runtime.transfer.TransferEngine`` reports: one ``Landing`` per finished, cancelled or failed copy (SeqMoE
§8.3's tagged completions), and its ``TransferStats`` counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Landing:
    """One finished (or cancelled) copy.

    Attributes:
        eid: global expert id that was copied.
        slot: destination slot in the pool.
        tag: the tag given to ``submit`` (the slot reservation's tag, SeqMoE §8.3), returned unchanged.
        ok: True when ``pool.buf[slot]`` holds all of expert ``eid``'s bytes; False when the copy was cancelled
            or failed (the slot's content is then unspecified: it may be partly written).
        finished_at: ``time.perf_counter()`` seconds when the engine saw the copy complete (and its emulated link
            time elapse), or when it was cancelled / failed. On CUDA this is when completion was observed
            (``poll``/``wait``/worker), an upper bound of the DMA's end.
        started_at: ``time.perf_counter()`` seconds when the copy started; None for a copy cancelled before it
            started.
        error: why a copy failed (the exception's text), ``"cancelled"`` for a cancelled copy, None when ok.
    """

    eid: int
    slot: int
    tag: int
    ok: bool
    finished_at: float
    started_at: float | None = None
    error: str | None = None


@dataclass
class TransferStats:
    """Counters since construction or ``reset_stats``.

    submitted: ``submit`` calls accepted; copies: copies that landed ok; cancelled: copies dropped before starting
    or stopped at a chunk (the disk tier);
    failed: copies that started but raised; bytes_copied: bytes of the ok copies; busy_s: seconds the link was busy
    (sum over started copies of finish - start, emulated link time included); max_queued: the longest the queue
    of not-yet-started copies has been; prefetch_copies / prefetch_cpu_s: the prefetch copies (not submitted as
    on demand) that landed ok and the CPU seconds of the thread that ran them (what a ``+gate`` policy's meter
    charges a prefetch, ``core.prefetch_cost``).
    """

    submitted: int = 0
    copies: int = 0
    cancelled: int = 0
    failed: int = 0
    bytes_copied: int = 0
    busy_s: float = 0.0
    max_queued: int = 0
    prefetch_copies: int = 0
    prefetch_cpu_s: float = 0.0

    @property
    def gbps(self) -> float:
        """Achieved bandwidth while busy, GB/s (1e9 bytes/s); 0.0 before any copy."""
        return self.bytes_copied / self.busy_s / 1e9 if self.busy_s > 0 else 0.0
