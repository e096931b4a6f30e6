"""Intra-op thread count for the one-time builds (testbed, llada2-medium) and for a command run from the shell.

torch runs each operation on ``torch.get_num_threads()`` OpenMP threads, one per core. When another process keeps
some of those cores busy, every parallel operation waits at its barrier for a descheduled thread: measured on a
2-core machine with one core taken by another job, one thread built the testbed's layers 2x faster and balanced
llada2-medium's routers ~40x faster than two. ``build_threads`` times a small probe shaped like the builds' work
(one large matrix product and many small ones) with 1 thread and with the default count, and uses more threads
only when they are clearly faster (``MARGIN``).
The thread count can change the last float bits of a GEMM, so a build may differ slightly with it (as it may
between machines).

Inference (``command_threads``: ``generate`` and ``serve`` started from the shell) leans the other way: it keeps
torch's default count unless one thread is clearly faster. Measured on this 2-core machine, decoding the testbed
(48 tokens): idle, 17.1 tok/s with two threads and 12.2-13.6 with one; with one core taken by another process,
0.46-0.82 tok/s with two threads and 12.7-13.2 with one (``OMP_WAIT_POLICY=PASSIVE`` gave 11.5 busy but 4.9-5.1
idle, so it is not the answer). ``OMP_NUM_THREADS`` in the environment is the user's choice and is kept.

Threads that read or copy experts beside the compute (the disk store's readers, the transfer engine's worker) wake
from each ``preadv`` needing the interpreter lock to issue the next request, and CPython hands it over only every
``sys.getswitchinterval()`` (5 ms by default) while the main thread runs Python (the forecasts, the slot table).
``short_switch_interval`` lowers it to ``IO_SWITCH_INTERVAL_S`` for the process: measured with `bench decode
--host-store disk` on testbed-sparse-wide at 25% (issue 47), the on-demand reads of `xl+gate` took 110 ms per step
for the same 116 MB that LRU read in 96 ms at 5 ms; at 0.5 ms, 91.7 ms against LRU's 91.4 ms (one ad-hoc run
with ``sys.setswitchinterval(0.0005)`` before the command; docs/benchmarks.md, session 40).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

from ..errors import MoeOffloadError


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


def choose_threads(times: dict[int, list[float]], prefer_most: bool = False) -> int:
    """The thread count to use given probe ``times`` (seconds per run, by thread count): the smallest count, unless
    a larger one's median time is below ``MARGIN`` times the chosen one's; with ``prefer_most``, the largest count,
    unless a smaller one's median is below ``MARGIN`` times the chosen one's."""
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    order = sorted(med, reverse=prefer_most)
    best = order[0]
    for n in order[1:]:
        if med[n] < MARGIN * med[best]:
            best = n
    return best


def best_num_threads(candidates: list[int] | None = None, rounds: int = 5, prefer_most: bool = False) -> int:
    """The thread count for a build (default candidates: 1 and ``torch.get_num_threads()``) chosen by
    ``choose_threads`` (``prefer_most`` passed on) from ``rounds`` interleaved probe runs (~0.2-0.5 s in all);
    restores the current count."""
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
    return choose_threads(times, prefer_most)


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


def command_threads(environ=None) -> tuple[int, int] | None:
    """``(chosen, default)`` intra-op threads for a command run from the shell (module docstring): the default
    count unless the probe runs clearly faster with one thread (``best_num_threads(prefer_most=True)``); None when
    ``OMP_NUM_THREADS`` is set in ``environ`` (default ``os.environ``) or torch has one thread only. Sets nothing."""
    import torch

    env = os.environ if environ is None else environ
    default = torch.get_num_threads()
    if "OMP_NUM_THREADS" in env or default <= 1:
        return None
    return best_num_threads([1, default], prefer_most=True), default


#: the interpreter's switch interval while expert reads or copies run on threads beside the compute (seconds)
IO_SWITCH_INTERVAL_S = 5e-4


def short_switch_interval() -> None:
    """Lower the interpreter's switch interval to ``IO_SWITCH_INTERVAL_S`` if it is longer (module docstring): a
    reader thread then waits at most that long for the lock between its requests. Never raises it."""
    if sys.getswitchinterval() > IO_SWITCH_INTERVAL_S:
        sys.setswitchinterval(IO_SWITCH_INTERVAL_S)


def compute_share() -> float:
    """The share of the machine's cores the compute's intra-op threads use, in [0, 1]
    (``torch.get_num_threads() / os.cpu_count()``): how much of a CPU second another thread takes is lost to the
    compute (1.0 on two cores with two compute threads). Used as ``core.prefetch_cost``'s ``contention``."""
    import torch

    return min(1.0, torch.get_num_threads() / max(1, os.cpu_count() or 1))


#: how the expert readers and copiers run: ``"io"``, the cores they run on once ``set_compute_threads`` has
#: partitioned the machine; ``"priority"``, their scheduling once ``set_io_priority`` has set one
_IO_CPUS: dict = {}


def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity), ascending."""
    return sorted(os.sched_getaffinity(0))


def partition_cores(compute_threads: int, cpus: list[int] | None = None) -> tuple[frozenset, frozenset]:
    """``(compute, io)``: the first ``compute_threads`` of ``cpus`` (default ``usable_cpus()``) for the compute's
    intra-op threads and the rest for the threads that read and copy experts (issue 47, ``--compute-threads``); when
    the compute takes every core, the I/O threads share them all.

    Raises:
        MoeOffloadError: ``compute_threads`` below 1 or above the number of cores.
    """
    cpus = sorted(cpus if cpus is not None else usable_cpus())
    if not 1 <= compute_threads <= len(cpus):
        raise MoeOffloadError(f"--compute-threads must be between 1 and the {len(cpus)} cores this process may use, "
                              f"got {compute_threads}")
    compute = frozenset(cpus[:compute_threads])
    return compute, frozenset(cpus[compute_threads:]) or compute


def set_compute_threads(compute_threads: int) -> tuple[frozenset, frozenset]:
    """Partition the cores (``partition_cores``): the calling (main) thread, and the intra-op threads torch starts
    from it afterwards, run on the compute cores with ``compute_threads`` intra-op threads; the expert readers and
    copiers started later run on the others (``pin_io_thread``). Call it before the first parallel operation (an
    intra-op thread started earlier keeps the affinity it had). Returns ``(compute, io)``.

    Raises:
        MoeOffloadError: as ``partition_cores``.
    """
    import torch

    compute, io = partition_cores(compute_threads)
    os.sched_setaffinity(0, compute)
    torch.set_num_threads(compute_threads)
    _IO_CPUS["io"] = io
    return compute, io


#: ``--io-priority``: how the threads that read and copy experts are scheduled (``set_io_priority``)
IO_PRIORITIES = ("normal", "realtime")
_io_thread = threading.local()


def set_io_priority(priority: str) -> None:
    """How the expert readers and copiers started from now on are scheduled (``pin_io_thread``): ``normal``, or
    ``realtime``: Linux's real-time scheduler (``SCHED_FIFO``, priority 1), so that a reader woken while the compute's
    threads hold every core runs at once instead of when they yield (issue 47, session 44: the read overlap's stall
    fell from 46-54 to 40-46 ms per step on 2 cores). Those threads block on the disk, locks and queues, never spin
    (the copy worker sleeps out an emulated link's time instead of spinning when it runs real-time).

    Raises:
        MoeOffloadError: an unknown priority, or ``realtime`` where this process may not use the real-time scheduler
            (it needs CAP_SYS_NICE or an RLIMIT_RTPRIO of 1 or more), checked on a probe thread.
    """
    if priority not in IO_PRIORITIES:
        raise MoeOffloadError(f"--io-priority must be one of {', '.join(IO_PRIORITIES)}, got {priority!r}")
    if priority == "realtime":
        why: list[str] = []

        def probe() -> None:
            try:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            except (OSError, AttributeError) as e:
                why.append(getattr(e, "strerror", None) or str(e))

        t = threading.Thread(target=probe, name="moe-offload-priority-probe")
        t.start()
        t.join()
        if why:
            raise MoeOffloadError("--io-priority realtime: this process may not use the real-time scheduler "
                                  f"({why[0]}; it needs CAP_SYS_NICE or an RLIMIT_RTPRIO of 1 or more)")
    _IO_CPUS["priority"] = priority


def io_priority() -> str:
    """The I/O priority set for this process (``set_io_priority``): ``normal`` or ``realtime``."""
    return _IO_CPUS.get("priority", "normal")


def io_thread_realtime() -> bool:
    """Whether the calling thread runs under the real-time scheduler (``pin_io_thread`` with ``realtime``)."""
    return getattr(_io_thread, "realtime", False)


def io_thread_settings() -> tuple[list[int], bool]:
    """What ``pin_io_thread`` would give a reader started now, for a thread started by native code: ``(its cores,
    sorted; empty when the cores are not partitioned, whether it runs under the real-time scheduler)``."""
    return sorted(_IO_CPUS.get("io") or ()), _IO_CPUS.get("priority") == "realtime"


def pin_io_thread(realtime: bool = True) -> None:
    """Run the calling thread (an expert reader or copier) on the I/O cores of ``set_compute_threads`` (nothing
    when the cores are not partitioned), under the real-time scheduler with ``set_io_priority("realtime")`` unless
    ``realtime`` is False (a thread that polls, or schedules rather than reads)."""
    io = _IO_CPUS.get("io")
    if io is not None:
        os.sched_setaffinity(0, io)
    if realtime and _IO_CPUS.get("priority") == "realtime":
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        _io_thread.realtime = True


def undo_partition(cpus) -> None:
    """Give the calling thread the cores ``cpus`` back and forget the I/O cores of ``set_compute_threads`` and the
    I/O priority (for a command called from code: the caller's process is left as it was)."""
    _IO_CPUS.pop("io", None)
    _IO_CPUS.pop("priority", None)
    os.sched_setaffinity(0, cpus)
