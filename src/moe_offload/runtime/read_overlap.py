"""A layer's misses read while its resident experts compute (issue 47, session 44).

On the disk tier a decode step spent about as long waiting for its misses' reads as computing (testbed-sparse-wide
at 25%: 58 ms of stall, 35 ms of expert compute per step), one after the other in every layer: the layer waited
for all its misses, then computed all its experts. The reads are I/O (a direct read releases the interpreter lock
and takes almost no CPU), and the native experts kernel releases the lock too, so the two can run at once:
``OffloadEngine`` starts the reads of a one-round layer's misses (and the prefetches in flight it waits for) on the
overlap thread, computes the pairs of its resident experts meanwhile into per-pair outputs, waits for the reads,
computes the late pairs, and adds every pair in routing order (``runtime.fused_experts.sum_rounds``: bit for bit
what one round gives, the rule multi-round layers already follow). The tokens are FullLoad's.

It applies where it can pay: one token (a decode step of one sequence), a pool on the CPU fed by the disk tier
(``store.mode == "disk"``: reads that take milliseconds; from a store in memory a copy takes less than the thread
hand-off), a layer planned in one round (several rounds already load round by round), with both resident experts
to compute and experts to read.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ..common.threads import pin_io_thread


class ReadOverlap:
    """The overlap thread of one engine and the rule of when a layer uses it (module docstring).

    Attributes:
        enabled: False turns the overlap off (every layer reads, then computes; for comparisons:
            ``scripts/read_overlap_ab.py``).
        layers: layer executions that read while they computed (``start`` calls).
    """

    def __init__(self) -> None:
        self.enabled = True
        self.layers = 0
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def applies(self, rnd, pool, store) -> bool:
        """Whether the one round ``rnd`` (a ``core.slot_states.Round``) of a layer reads while it computes: enabled,
        a pool on the CPU, the disk tier, and the round has experts to read (loads or waits) and resident ones."""
        late = len(rnd.loads) + len(rnd.waits)
        return (self.enabled and not self._closed and late > 0 and len(rnd.eids) > late
                and pool.device.type == "cpu" and getattr(store, "mode", None) == "disk")

    def start(self, read, rnd) -> Future:
        """``read(rnd)`` on the overlap thread (started at the first use); returns its future (``result()`` re-raises
        what the read raised) once that thread has begun (or the future is done: a thread that could not start).
        Waiting for it costs this thread a hand-off (~0.06 ms); without it the overlap thread woke only once the
        compute that follows had released the cores (~0.9 ms later: the whole overlap).

        Raises:
            RuntimeError: called after ``close``."""
        if self._closed:
            raise RuntimeError("the read overlap is closed")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="moe-offload-overlap", initializer=pin_io_thread)
        started = threading.Event()

        def run(r):
            started.set()
            return read(r)

        fut = self._pool.submit(run, rnd)
        fut.add_done_callback(lambda _: started.set())
        self.layers += 1
        started.wait()
        return fut

    def close(self) -> None:
        """Stop the overlap thread (after the read it runs, if any); later layers read, then compute."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
