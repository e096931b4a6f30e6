"""Progress of long one-time jobs (building the testbed or llada2-medium): numbered phases on stderr, each with its
expected duration on this machine, and a progress bar (``tqdm``) for every phase expected to take over
``BAR_MIN_S`` — a counted one where the job loops, a timed one (elapsed against expected seconds) where it waits on
one long call — each redrawn every second, so the output moves even while one slow step runs.

Expected durations come from reference timings scaled by ``slowdown()``: how much slower a fixed float32 matrix
product runs here than on the reference machine (an idle 2-core CPU, ``REFERENCE_PROBE_S``).
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

BAR_MIN_S = 2.0
#: seconds of ``_probe()``'s workload on the reference machine: this project's 2-core development machine, measured
#: in the same run as the reference build timings (docs/testbed.md "Build time")
REFERENCE_PROBE_S = 0.027
_slowdown: float | None = None


def _probe() -> float:
    """Seconds of a small fixed float32 workload like the build's (best of 3; about 0.1 s on 2 cores)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2048, 576, generator=gen)
    b = torch.randn(576, 1536, generator=gen)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        (a @ b).relu_().sum()
        best = min(best, time.perf_counter() - t0)
    return best


def slowdown() -> float:
    """How many times slower than the reference machine this one runs the probe now, with the builds' thread count
    (``threads.build_threads``); measured once per process, clamped to [0.25, 20]."""
    global _slowdown
    if _slowdown is None:
        from .threads import build_threads

        with build_threads():  # the thread count the builds will use
            _slowdown = min(20.0, max(0.25, _probe() / REFERENCE_PROBE_S))
    return _slowdown


def fmt_duration(seconds: float) -> str:
    """``"40 s"``, ``"3 min"``, ``"2.5 min"``: a rough duration for messages."""
    if seconds < 90:
        return f"{max(1, round(seconds / 5) * 5 if seconds >= 10 else round(seconds))} s"
    minutes = seconds / 60
    return f"{minutes:.1f} min" if minutes < 10 else f"{minutes:.0f} min"


def say(msg: str) -> None:
    """One message line on stderr, prefixed ``moe-offload:`` (progress never goes to stdout: ``--json`` stays
    clean)."""
    print(f"moe-offload: {msg}", file=sys.stderr, flush=True)


class Phases:
    """Numbered phases of one job. ``phase(what, expected_s)`` prints ``[i/n] what (about X)`` and, for phases over
    ``BAR_MIN_S``, shows a bar while the ``with`` block runs; inside, ``update(k)`` advances a counted bar
    (``total`` given) — without ``total`` the bar follows the clock.

    Args:
        count: number of phases (for the ``[i/n]`` labels).
        enabled: False prints nothing (``--quiet``).
        scale: multiplies every expected duration (``slowdown()``).
    """

    def __init__(self, count: int, enabled: bool = True, scale: float = 1.0):
        self.count, self.enabled, self.scale = count, enabled, scale
        self.index = 0

    @contextmanager
    def phase(self, what: str, expected_s: float, total: int | None = None, unit: str = "it"):
        """Run one phase (see the class docstring); yields ``update(k)``."""
        self.index += 1
        expected = expected_s * self.scale
        if not self.enabled:
            yield lambda k=1: None
            return
        label = f"[{self.index}/{self.count}] {what}"
        if expected < BAR_MIN_S:
            say(f"{label} (about {fmt_duration(expected)})")
            yield lambda k=1: None
            return
        say(f"{label} (about {fmt_duration(expected)})")
        from tqdm.auto import tqdm

        if total is not None:
            bar = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, mininterval=1.0)
            with _ticking(bar):
                yield bar.update
            return
        seconds = max(1, round(expected))
        bar = tqdm(total=seconds, desc=label, unit="s", file=sys.stderr, mininterval=1.0,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} (expected ~{total} s)")
        with _ticking(bar, clock=True):
            yield lambda k=1: None


@contextmanager
def _ticking(bar, clock: bool = False):
    """Redraw ``bar`` every second from a thread, so its elapsed time moves even while one step (a layer, a long
    call) runs; with ``clock`` also advance it with the clock (held below 100% until the block ends). Closes it."""
    stop = threading.Event()
    t0 = time.monotonic()

    def tick():
        while not stop.wait(1.0):
            if clock:
                bar.n = min(int(time.monotonic() - t0), bar.total - 1)
            bar.refresh()

    th = threading.Thread(target=tick, daemon=True)
    th.start()
    try:
        yield bar
    finally:
        stop.set()
        th.join()
        if clock:
            bar.n = bar.total
        bar.close()
