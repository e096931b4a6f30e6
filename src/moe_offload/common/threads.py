"""Intra-op thread count for the one-time builds (testbed, llada2-medium).

torch runs each operation on ``torch.get_num_threads()`` OpenMP threads, one per core. When another process keeps
some of those cores busy, every parallel operation waits at its barrier for a descheduled thread: measured on a
2-core machine with one core taken by another job, one thread built the testbed's layers 2x faster and balanced
llada2-medium's routers ~40x faster than two. ``build_threads`` times a small probe shaped like the builds' work
(one large matrix product and many small ones) with 1 thread and with the default count, and uses more threads
only when they are clearly faster (``MARGIN``).
The thread count can change the last float bits of a GEMM, so a build may differ slightly with it (as it may
between machines).
"""

from __future__ import annotations

import time
from contextlib import contextmanager


def _probe_seconds(threads: int, data) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b, xs, w = data
    t0 = time.perf_counter()
    (a @ b).relu_().sum()
    for x in xs:
        (x @ w).sum()
    return time.perf_counter() - t0


#: more threads are used only when their probe runs at most this fraction of the time of fewer threads: under
#: contention a momentary idle core can make the probe favour them by a little, and then the build by a lot
MARGIN = 0.8


def choose_threads(times: dict[int, list[float]]) -> int:
    """The thread count to use given probe ``times`` (seconds per run, by thread count): the smallest count, unless
    a larger one's median time is below ``MARGIN`` times the chosen one's."""
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    best = min(med)
    for n in sorted(med)[1:]:
        if med[n] < MARGIN * med[best]:
            best = n
    return best


def best_num_threads(candidates: list[int] | None = None, rounds: int = 5) -> int:
    """The thread count for a build (default candidates: 1 and ``torch.get_num_threads()``) chosen by
    ``choose_threads`` from ``rounds`` interleaved probe runs (~0.2-0.5 s in all); restores the current count."""
    import torch

    current = torch.get_num_threads()
    cands = sorted(set(candidates or [1, current]))
    if len(cands) == 1:
        return cands[0]
    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(1024, 576, generator=gen), torch.randn(576, 1536, generator=gen),
            [torch.randn(160, 64, generator=gen) for _ in range(48)], torch.randn(64, 576, generator=gen))
    times: dict[int, list[float]] = {n: [] for n in cands}
    try:
        for _ in range(rounds):
            for n in cands:
                times[n].append(_probe_seconds(n, data))
    finally:
        torch.set_num_threads(current)
    return choose_threads(times)


@contextmanager
def build_threads():
    """Run the block with ``best_num_threads()`` intra-op threads, then restore the previous count; yields it."""
    import torch

    before = torch.get_num_threads()
    n = best_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
