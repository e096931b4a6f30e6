"""The clock of the emulated link and host fallback on a CPU-only machine: waits slept, or skipped on a virtual clock.

A CPU-only machine stands in for a GPU behind PCIe by making the inference thread wait out each emulated copy (the
virtual link, ``runtime.virtual_link``) and each emulated host-fallback duration (``runtime.host_fallback``). Two ways
to wait (``skipping_waits``):

  * **sleep** (the default): the thread sleeps until the deadline; ``now()`` moves with ``time.perf_counter()``.
  * **skip**: the wait returns at once and the clock jumps to the deadline: ``now()`` is ``time.perf_counter()``
    plus every second skipped so far (in this process: it stays counted after the skipping ends). Compute, Python
    overhead and everything else still run in real time, and every timer read through ``now()`` (tok/s, the time
    breakdowns, the planners' step times) sees the wait.

Why skip: the emulated waits are not real work, but sleeping them out lets wall time pass between two computations,
and on this shared virtual machine that time costs the computation after it (the likely cause: the small models that
fit here sit in a last-level cache shared with other tenants, who evict them while the inference thread waits;
spinning instead of sleeping did not remove it). FullLoad, whose compute the simulator's time model is built on,
never waits; an offloaded run whose waits are slept computes slower for that reason alone
(docs/notes/benchmark-history.md, "Emulated waits: sleeping vs skipping", measures both modes A B B A). A GPU computing
from its own memory pays nothing of the kind. Skipping also makes emulated runs as fast as their real work.

Single-threaded: only the inference thread may wait while skipping (``skipping_waits`` is process-wide; a copy
worker thread, the CUDA path's ``TransferEngine``, always sleeps with ``sleep_until``). Units: seconds.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

# a sleep shorter than this is replaced by yielding (time.sleep(0), which releases the GIL) until the deadline:
# Linux sleeps overshoot by ~50-100 us, which would dominate the emulated time of a small expert
_SPIN_S = 5e-4

_skip = False
_skipped = 0.0   # seconds skipped so far (only grows: now() is monotonic)

WAIT_MODES = ("sleep", "skip")


def now() -> float:
    """Seconds on the emulation's clock: ``time.perf_counter()`` plus the waits skipped so far in this process (0
    until a wait is first skipped)."""
    return time.perf_counter() + _skipped


def sleep_until(deadline: float, spin: bool = True) -> None:
    """Return at or after ``time.perf_counter() >= deadline`` (seconds): sleeps, then (``spin``) yields the GIL in a
    loop for the last 0.5 ms for accuracy. A background thread passes ``spin=False`` (sleep only, a few tens of
    microseconds late at worst): a spinning thread keeps taking the GIL from the thread that computes."""
    while True:
        rem = deadline - time.perf_counter()
        if rem <= 0:
            return
        if not spin:
            time.sleep(rem)
        else:
            time.sleep(rem - _SPIN_S if rem > 2 * _SPIN_S else 0)


def wait_until(deadline: float) -> None:
    """Return once ``now() >= deadline`` (seconds on this clock): at once, the clock moved to ``deadline``, while
    skipping; else after sleeping the real distance to it (``sleep_until``)."""
    global _skipped
    if _skip:
        rem = deadline - now()
        if rem > 0:
            _skipped += rem
    else:
        sleep_until(deadline - _skipped)


def check_skip_device(skip: bool, device) -> None:
    """Refuse to skip emulated waits on a pool that is not on the CPU (``device``: a ``torch.device`` or its name).

    Raises:
        MoeOffloadError: ``skip`` with a CUDA device, whose emulated link is slept out by the ``TransferEngine``'s
            copy thread on the wall clock.
    """
    if skip and str(device).split(":")[0] != "cpu":
        from ..errors import MoeOffloadError

        raise MoeOffloadError(f"--emulated-waits skip needs the CPU, not {device}: there the emulated link is slept "
                              "out by a copy thread")


def skipping() -> bool:
    """Whether emulated waits are skipped now (inside ``skipping_waits()``)."""
    return _skip


@contextmanager
def skipping_waits(enabled: bool = True) -> Iterator[None]:
    """Within the block, emulated waits are skipped (``enabled``) or slept; the previous mode is restored after it.

    The clock never goes back: what was skipped stays counted in ``now()``, so a timer read across the block's end
    stays consistent."""
    global _skip
    before, _skip = _skip, bool(enabled)
    try:
        yield
    finally:
        _skip = before

