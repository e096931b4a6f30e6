"""The user cache of built-in checkpoints (``testbed``, ``testbed-sparse``, ``llada2-medium``): where it is, and
building an entry once even when several processes ask for it at the same time.

``build_once`` holds an inter-process lock (``filelock``; ``<cache>/.<name>.lock``) while it builds: a second
process that wants the same entry waits for it, saying so every ``WAIT_REPORT_S`` seconds, and then uses what the
first one built. An entry is built in a temporary folder ``<cache>/.<name>.<random>.tmp`` renamed into place, so an
interrupted build never leaves a half-written entry; the temporary folders of killed builds are removed whenever
their entry's lock is free (nobody is building it).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

#: a process waiting for another one's build says so this often (seconds)
WAIT_REPORT_S = 10.0


def default_cache_dir() -> Path:
    """``$MOE_OFFLOAD_CACHE`` if set, else ``~/.cache/moe-offload``."""
    env = os.environ.get("MOE_OFFLOAD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moe-offload"


def _log(msg: str) -> None:
    print(f"moe-offload: {msg}", file=sys.stderr, flush=True)


def lock_for(cache: Path, name: str) -> FileLock:
    """The inter-process lock that guards building ``cache / name``."""
    return FileLock(cache / f".{name}.lock")


def _temp_name(path: Path) -> str | None:
    """The entry name of a temporary build folder ``.<name>.<random>.tmp`` (None for anything else)."""
    n = path.name
    if not (n.startswith(".") and n.endswith(".tmp")) or n.count(".") < 3:
        return None
    return n[1:-len(".tmp")].rsplit(".", 1)[0]


def remove_stale_temps(cache: Path, held: str | None = None) -> list[Path]:
    """Remove the temporary build folders in ``cache`` that no running build owns: those of ``held`` (whose lock
    the caller holds) and those of every entry whose lock is free right now. Returns the removed paths."""
    removed = []
    by_name: dict[str, list[Path]] = {}
    for p in cache.glob(".*.tmp"):
        name = _temp_name(p)
        if name and p.is_dir():
            by_name.setdefault(name, []).append(p)
    for name, paths in by_name.items():
        lock = None
        if name != held:
            lock = lock_for(cache, name)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue  # another process is building this entry right now
        try:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        finally:
            if lock is not None:
                lock.release()
    return removed


def _acquire(lock: FileLock, what: str, log: Callable[[str], None]) -> None:
    """Take ``lock``; while another process holds it, say so every ``WAIT_REPORT_S`` seconds."""
    try:
        lock.acquire(timeout=0)
        return
    except Timeout:
        pass
    t0 = time.monotonic()
    log(f"another moe-offload process is building {what}; waiting for it (lock {lock.lock_file})")
    while True:
        try:
            lock.acquire(timeout=WAIT_REPORT_S)
            return
        except Timeout:
            log(f"still waiting for the other process to finish {what} ({time.monotonic() - t0:.0f} s)")


def build_once(name: str, is_built: Callable[[Path], bool], build: Callable[[Path], None], *, what: str,
               announce: Callable[[], None] | None = None, cache: Path | None = None,
               log: Callable[[str], None] = _log) -> Path:
    """``cache / name``, built by ``build(tmp_dir)`` first if ``is_built`` says it is missing.

    Args:
        name: the entry's folder name in the cache.
        is_built: whether a folder holds a complete entry.
        build: writes the entry into the (empty, existing) temporary folder it is given.
        what: the entry in words, for the waiting messages.
        announce: called once, just before this process starts building (e.g. to say what and how long).
        cache: the cache folder (default ``default_cache_dir()``).
        log: where the waiting messages go (default: stderr).

    Returns:
        The entry's path. Concurrent callers build it once: the others wait and then return it.
    """
    cache = default_cache_dir() if cache is None else cache
    target = cache / name
    if is_built(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    lock = lock_for(cache, name)
    _acquire(lock, what, log)
    try:
        if is_built(target):  # another process built it while we waited
            log(f"{what} is ready: {target}")
            return target
        remove_stale_temps(cache, held=name)
        if announce is not None:
            announce()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=cache))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)  # an incomplete folder (no build of ours is running: we hold the lock)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        lock.release()
    return target
