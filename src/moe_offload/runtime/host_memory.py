"""What host memory the process may use, and child memory cgroups to run a command under a limit (issue 35).

``memory_limit_bytes`` is what ``--memory-budget auto`` sizes the tiers from: the smaller of ``MemAvailable`` and
what the limit of the process's memory cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) leaves beside
its usage, its reclaimable page cache not counted as used (as ``MemAvailable`` does not). ``ChildCgroup``
makes a child of the process's own memory cgroup (cgroup v1, as root) with a limit, runs commands inside it and
reads back its peak usage and whether the kernel's OOM killer fired — how the disk tier is shown to run a model
larger than memory, and how ``bench disk`` gives every engine the same limit. Nothing outside the process's own
cgroup is touched.

Units: bytes.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from ..errors import MoeOffloadError

_V1_ROOT = Path("/sys/fs/cgroup/memory")
_V2_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60


def _own_cgroup() -> tuple[Path | None, int]:
    """``(directory, version)`` of this process's memory cgroup (``(None, 0)`` when there is none)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, 0
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(",") and (_V1_ROOT / rel.lstrip("/")).is_dir():
            return _V1_ROOT / rel.lstrip("/"), 1
    for line in lines:
        if line.startswith("0::") and (_V2_ROOT / line[3:].lstrip("/") / "memory.max").exists():
            return _V2_ROOT / line[3:].lstrip("/"), 2
    return None, 0


def cgroup_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup in bytes, or None when it has none (or none can be read)."""
    path, version = _own_cgroup()
    if path is None:
        return None
    name = "memory.limit_in_bytes" if version == 1 else "memory.max"
    try:
        text = (path / name).read_text().strip()
    except OSError:
        return None
    if text == "max" or int(text) >= _UNLIMITED:
        return None
    return int(text)


def mem_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (memory the kernel can give without swapping).

    Raises:
        MoeOffloadError: ``/proc/meminfo`` cannot be read (not Linux).
    """
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError as e:
        raise MoeOffloadError(f"cannot read /proc/meminfo: {e.strerror}") from None
    raise MoeOffloadError("/proc/meminfo has no MemAvailable line")


def reclaimable_file_bytes(stat_text: str, version: int) -> int:
    """The file pages a memory cgroup's usage counts that the kernel reclaims before it runs out (bytes): its
    ``memory.stat``'s inactive and active file pages (v1: the hierarchy's ``total_*``). ``MemAvailable`` counts
    such page cache as available, and so does ``memory_limit_bytes`` within a cgroup."""
    stat = dict(line.split() for line in stat_text.splitlines() if len(line.split()) == 2)
    prefix = "total_" if version == 1 else ""
    return sum(int(stat.get(prefix + k, 0)) for k in ("inactive_file", "active_file"))


def memory_limit_bytes() -> int:
    """Host memory this process may still use: ``MemAvailable``, capped by the cgroup's limit less its usage, the
    cgroup's reclaimable page cache (``reclaimable_file_bytes``: e.g. a checkpoint just read) not counted as used."""
    avail = mem_available_bytes()
    limit = cgroup_limit_bytes()
    if limit is None:
        return avail
    path, version = _own_cgroup()
    try:
        used = int((path / ("memory.usage_in_bytes" if version == 1 else "memory.current")).read_text())
    except (OSError, ValueError, TypeError):
        used = 0
    try:
        used -= reclaimable_file_bytes((path / "memory.stat").read_text(), version)
    except (OSError, ValueError):
        pass
    return max(0, min(avail, limit - used))


class ChildCgroup:
    """A child of this process's memory cgroup (v1) with a memory limit; a context manager that removes it.

    Args:
        limit_bytes: the child's ``memory.limit_in_bytes`` (page cache included, as the kernel counts it).

    Raises:
        MoeOffloadError: no writable cgroup v1 memory hierarchy (not root, cgroup v2, a container without it): the
            message says why, so a test can skip with it.
    """

    def __init__(self, limit_bytes: int):
        parent, version = _own_cgroup()
        if version != 1:
            raise MoeOffloadError("no cgroup v1 memory hierarchy for this process (child memory cgroups need it)")
        self.path = parent / f"moe-offload-{uuid.uuid4().hex[:12]}"
        try:
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
        except OSError as e:
            self._remove()
            raise MoeOffloadError(f"cannot make a child memory cgroup in {parent}: {e.strerror}") from None
        self.limit_bytes = int(limit_bytes)

    def argv(self, cmd: list[str]) -> list[str]:
        """``cmd`` wrapped so that it runs inside the cgroup (a shell joins it, then ``exec``s the command)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *cmd]

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``cmd`` inside the cgroup (keyword arguments passed on)."""
        return subprocess.run(self.argv(cmd), **kw)

    def _read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    @property
    def peak_bytes(self) -> int:
        """Most memory the cgroup's processes used at once (``memory.max_usage_in_bytes``, page cache included)."""
        return self._read("memory.max_usage_in_bytes")

    @property
    def oom_kills(self) -> int:
        """How many processes the OOM killer ended in this cgroup (``memory.oom_control``'s ``oom_kill``)."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def stat(self) -> dict[str, int]:
        """``memory.stat`` as ``{name: value}`` (e.g. ``cache``, ``rss``, ``mapped_file``; bytes)."""
        return {k: int(v) for k, v in (ln.split() for ln in (self.path / "memory.stat").read_text().splitlines())}

    def _remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass

    def __enter__(self) -> ChildCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self._remove()


def child_cgroup_problem() -> str | None:
    """Why no child memory cgroup can be made here (None: one can), for tests to skip with."""
    try:
        with ChildCgroup(_UNLIMITED):
            return None
    except MoeOffloadError as e:
        return str(e)
