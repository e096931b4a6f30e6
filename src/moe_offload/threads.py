"""Intra-op thread count for the one-time builds (testbed, llada2-medium).

torch runs each operation on ``torch.get_num_threads()`` OpenMP threads, one per core. When another process keeps
some of those cores busy, every parallel operation waits at its barrier for a descheduled thread: measured on a
2-core machine with one core taken by another job, one thread built the testbed's layers 2x faster and balanced
llada2-medium's routers ~40x faster than two. ``build_threads`` times a small probe shaped like the builds' work
(one large matrix product and many small ones) with 1 thread and with the default count, and uses the faster.
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


def best_num_threads(candidates: list[int] | None = None, rounds: int = 3) -> int:
    """The candidate thread count (default: 1 and ``torch.get_num_threads()``) whose probe ran fastest (median of
    ``rounds`` interleaved runs, ~0.1-0.5 s in all); restores the current count."""
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
    return min(cands, key=lambda n: sorted(times[n])[len(times[n]) // 2])


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
