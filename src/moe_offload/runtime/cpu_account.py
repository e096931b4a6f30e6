"""Where a decode step's CPU goes, per thread and role (issue 47, part 1): thread CPU time and wall time, measured,
not estimated.

The main thread's time is split by the engine's lap timer (``runtime.breakdown.StepClock``) into compute (experts
and everything else), predictor, management and stall; the expert copies are charged where they run — the main
thread (on-demand loads), the engine's read overlap thread (a decode layer's misses from disk, read while its
resident experts compute: ``runtime.read_overlap``), a transfer engine's copy worker (prefetches, and on-demand
copies it is asked to hurry), a disk store's reader threads — as ``on_demand_reads``, ``prefetch_reads`` and
``staging_copies`` (a disk store's copy from its aligned staging buffer into the slot). A copy's time is charged to
the innermost role: a staging copy inside a prefetch read is a staging copy, not a read, and the main thread's stall
holds only the waiting its own copies do not explain. Only decode steps are counted (``active``).

Units: seconds (``time.thread_time`` for CPU, ``time.perf_counter`` for wall). A thread's CPU time below its wall
time is time it waited (the disk, a lock, the interpreter lock, a core).
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager, nullcontext

#: the roles, in report order
ROLES = ("compute", "predictor", "management", "stall", "on_demand_reads", "prefetch_reads", "staging_copies")
#: kinds of expert bytes moved (``CpuAccount.bytes``)
BYTE_KINDS = ("on_demand", "prefetched", "prefetched_used", "prefetched_wasted")
#: the engine's lap-timer phases (``runtime.breakdown.PHASES``) -> roles
PHASE_ROLE = {"expert_compute": "compute", "other_compute": "compute", "predictor": "predictor",
              "management": "management", "stall": "stall"}


#: our threads' names (``runtime.transfer``, ``runtime.disk_store``, ``runtime.read_overlap``) -> their names in
#: reports
THREAD_NAMES = {"moe-offload-transfer": "copy worker", "moe-offload-disk": "disk readers",
                "moe-offload-overlap": "overlap reads"}


def thread_label() -> str:
    """The calling thread's name in reports: ``main``, ``copy worker``, ``disk readers`` (a pool's threads add up),
    or another thread's own name without a pool's worker number."""
    t = threading.current_thread()
    if t is threading.main_thread():
        return "main"
    name = re.sub(r"[_-]\d+$", "", t.name)
    return THREAD_NAMES.get(name, name)


class CpuAccount:
    """CPU and wall seconds per (thread, role) since the last ``reset``; thread-safe.

    Attributes:
        active: charges are counted only while True (the engine sets it for decode steps).
        seconds: ``{(thread, role): [cpu_s, wall_s]}``.
        bytes: expert bytes moved into slots, by kind (``BYTE_KINDS``): ``on_demand`` (misses), ``prefetched``
            (prefetch copies that completed), ``prefetched_used`` / ``prefetched_wasted`` (prefetched experts a layer
            then needed / evicted unneeded, counted in the step that decided it).
    """

    def __init__(self) -> None:
        self.active = False
        self.seconds: dict[tuple[str, str], list[float]] = {}
        self.bytes: dict[str, int] = dict.fromkeys(BYTE_KINDS, 0)
        self._lock = threading.Lock()
        self._local = threading.local()

    def charge(self, role: str, cpu_s: float, wall_s: float, thread: str | None = None) -> None:
        """Add ``cpu_s`` / ``wall_s`` to the calling thread's ``role`` (while ``active``); ``thread``: to that
        thread's instead (a native thread's seconds, reported by the thread that collects them).

        Raises:
            ValueError: an unknown role."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}")
        if not self.active:
            return
        with self._lock:
            cell = self.seconds.setdefault((thread or thread_label(), role), [0.0, 0.0])
            cell[0] += cpu_s
            cell[1] += wall_s

    def lap_cell(self, role: str) -> list[float]:
        """The calling thread's ``[cpu_s, wall_s]`` of ``role``, for a lap timer to add to directly (only that
        thread writes it; a lap then costs no lock: ``runtime.breakdown.StepClock`` laps several times per MoE
        layer). Valid until ``reset``.

        Raises:
            ValueError: an unknown role."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}")
        with self._lock:
            return self.seconds.setdefault((thread_label(), role), [0.0, 0.0])

    def add_bytes(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``kind`` (``BYTE_KINDS``) while ``active``."""
        if self.active:
            with self._lock:
                self.bytes[kind] += nbytes

    @contextmanager
    def io(self, role: str, inherit: bool = False):
        """Charge the block's CPU and wall time to ``role`` on the calling thread, less what nested ``io`` blocks
        charged to their own roles; the block's whole time is also kept for the thread's next ``take_io``.
        ``inherit``: inside another ``io`` block, charge nothing here (the time stays the enclosing block's: a disk
        read is an on-demand or a prefetch read as its caller says); ``role`` only when there is none."""
        loc = self._local
        stack = loc.__dict__.setdefault("stack", [])
        if inherit and stack:
            yield
            return
        stack.append([0.0, 0.0])  # nested blocks' cpu, wall
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
            inner = stack.pop()
            self.charge(role, cpu - inner[0], wall - inner[1])
            if stack:
                stack[-1][0] += cpu
                stack[-1][1] += wall
            else:
                taken = loc.__dict__.get("taken") or (0.0, 0.0)
                loc.taken = (taken[0] + cpu, taken[1] + wall)

    def charge_within(self, role: str, cpu_s: float, wall_s: float) -> None:
        """Charge ``role`` with a part of the calling thread's current ``io`` block that native code measured inside
        it (e.g. the staging copy of a native disk read): the enclosing block is charged that much less, as for a
        nested ``io`` block."""
        self.charge(role, cpu_s, wall_s)
        stack = self._local.__dict__.get("stack")
        if stack:
            stack[-1][0] += cpu_s
            stack[-1][1] += wall_s

    def take_io(self) -> tuple[float, float]:
        """``(cpu_s, wall_s)`` the calling thread spent in outermost ``io`` blocks since its previous call."""
        taken = self._local.__dict__.get("taken")
        if taken is None:
            return 0.0, 0.0
        self._local.taken = None
        return taken[0], taken[1]

    def reset(self) -> None:
        """Forget every charge (``active`` is kept)."""
        with self._lock:
            self.seconds = {}
            self.bytes = dict.fromkeys(BYTE_KINDS, 0)

    def as_dict(self, steps: int) -> dict:
        """For ``generate --json``: ``{"decode_steps", "ms_per_step": {thread: {role: {"cpu", "wall"}}},
        "bytes_per_step": {kind: bytes}}``, roles in ``ROLES`` order, the main thread first."""
        per = 1.0 / max(1, steps)
        threads: dict[str, dict] = {}
        with self._lock:
            items = sorted(self.seconds.items(), key=lambda kv: (kv[0][0] != "main", kv[0][0], ROLES.index(kv[0][1])))
            moved = dict(self.bytes)
        for (thread, role), (cpu, wall) in items:
            threads.setdefault(thread, {})[role] = {"cpu": 1e3 * cpu * per, "wall": 1e3 * wall * per}
        return {"decode_steps": steps, "ms_per_step": threads,
                "bytes_per_step": {k: v * per for k, v in moved.items()}}


def summary_line(account: dict) -> str:
    """``CpuAccount.as_dict`` in one line for the report tables: per thread, each role's CPU ms per step (wall in
    parentheses where it differs by more than a tenth), then the expert MB moved per step by kind."""
    parts = []
    for thread, roles in account["ms_per_step"].items():
        cells = []
        for role, v in roles.items():
            cpu, wall = v["cpu"], v["wall"]
            waited = f" ({wall:.1f} wall)" if abs(wall - cpu) > 0.1 * max(wall, 1e-9) and wall > 0.05 else ""
            cells.append(f"{role.replace('_', ' ')} {cpu:.1f}{waited}")
        parts.append(f"{thread}: " + ", ".join(cells))
    moved = ", ".join(f"{k.replace('_', ' ')} {v / 1e6:.2f}" for k, v in account["bytes_per_step"].items() if v)
    return "; ".join(parts) + " (CPU ms per step)" + (f"; MB per step: {moved}" if moved else "")


def attach(store, account: CpuAccount) -> None:
    """Charge ``store``'s copies (and its disk tier's, behind a host cache) to ``account``."""
    while store is not None:
        store.account = account
        store = getattr(store, "disk", None)


def io(holder, role: str, inherit: bool = False):
    """``holder.account.io(role, inherit)`` when ``holder`` (a store, an engine) has an account, else a no-op
    block."""
    account = getattr(holder, "account", None)
    return account.io(role, inherit) if account is not None else nullcontext()


def charge_within(holder, role: str, cpu_s: float, wall_s: float) -> None:
    """``holder.account.charge_within(role, cpu_s, wall_s)`` when ``holder`` has an account, else nothing."""
    account = getattr(holder, "account", None)
    if account is not None:
        account.charge_within(role, cpu_s, wall_s)


def _role_ms(account: dict, role: str, what: str, thread: str | None = None) -> float:
    """``role``'s ms per step (``what``: "cpu" or "wall") on ``thread``, or summed over every thread (None)."""
    threads = account["ms_per_step"]
    return sum(roles.get(role, {}).get(what, 0.0) for name, roles in threads.items() if thread in (None, name))


def account_table(rows: list[tuple[str, dict]]) -> list[str]:
    """Markdown lines for the benchmarks' reports: per row (label, ``CpuAccount.as_dict``), the main thread's step
    (wall ms) and its compute, predictor + management (with its share of the step: issue 47's budget is 5%) and
    stall; the expert copies on every thread (CPU ms, wall in parentheses); the expert MB moved per step."""
    out = ["| row | step ms (main thread) | compute | predictor + management | stall | on-demand reads | "
           "prefetch reads | staging copies | MB on demand | MB prefetched: used / wasted |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, a in rows:
        main = a["ms_per_step"].get("main", {})
        step = sum(v["wall"] for v in main.values())
        pm = _role_ms(a, "predictor", "wall", "main") + _role_ms(a, "management", "wall", "main")
        copies = [f"{_role_ms(a, r, 'cpu'):.2f} ({_role_ms(a, r, 'wall'):.2f})"
                  for r in ("on_demand_reads", "prefetch_reads", "staging_copies")]
        mb = {k: v / 1e6 for k, v in a["bytes_per_step"].items()}
        out.append(f"| {label} | {step:.2f} | {_role_ms(a, 'compute', 'wall', 'main'):.2f} | {pm:.2f} "
                   f"({pm / step if step else 0:.1%}) | {_role_ms(a, 'stall', 'wall', 'main'):.2f} | "
                   + " | ".join(copies) + f" | {mb['on_demand']:.2f} | {mb['prefetched_used']:.2f} / "
                   f"{mb['prefetched_wasted']:.2f} |")
    return out
