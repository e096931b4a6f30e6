"""The disk as a link, modelled: a hardware profile's ``disk`` entry (direct-read GB/s by request size and queue
depth, measured by ``bench link --disk DIR``: ``bench.disk_link``; shipped profiles carry published figures of other
disks). ``disk_gbps`` reads it at a request size (log-size interpolation between measured sizes), ``over_disk`` makes
a profile whose link is the disk (``simulate --link disk``), ``readers_for`` picks the queue depth of
``runtime.disk_store.DiskStore``, and ``save_disk`` stores a measured entry in the ``this-machine`` profile.

Units: bytes (KiB = 1024 bytes), seconds, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

from ..errors import MoeOffloadError
from .profiles import merge_this_machine, this_machine_path


def _interp(points: dict, request_bytes: int) -> float:
    """Log-size interpolation of ``{size_kib (str): GB/s}`` at ``request_bytes`` (clamped to the measured range)."""
    xs = sorted((int(k), float(v)) for k, v in points.items())
    kib = max(request_bytes / 1024, 1e-9)
    if kib <= xs[0][0]:
        return xs[0][1]
    if kib >= xs[-1][0]:
        return xs[-1][1]
    i = bisect.bisect_left([x for x, _ in xs], kib)
    (x0, y0), (x1, y1) = xs[i - 1], xs[i]
    w = (math.log(kib) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


def disk_gbps(disk: dict, request_bytes: int, depth: int | None = 1) -> float:
    """GB/s of a profile's ``disk`` entry at ``request_bytes`` per request: at queue depth ``depth`` (None: the best
    measured depth; a depth between two measured ones: linear between them, beyond the measured ones: the nearest);
    a published entry without a table gives its one ``gbps`` figure for every size.

    Raises:
        MoeOffloadError: a ``disk`` entry without ``gbps``, or a depth < 1.
    """
    if "table_gbps" not in disk:
        if "gbps" not in disk:
            raise MoeOffloadError("the hardware profile's disk entry has no gbps")
        return float(disk["gbps"])
    if depth is None:
        return _interp({k: v[1] for k, v in disk["best"].items()}, request_bytes)
    if depth < 1:
        raise MoeOffloadError(f"a queue depth is at least 1, got {depth}")
    depths = sorted({int(d) for row in disk["table_gbps"].values() for d in row})
    if depth in depths or depth < depths[0] or depth > depths[-1]:
        d = min(depths, key=lambda x: abs(x - depth))
        return _interp({k: row[str(d)] for k, row in disk["table_gbps"].items() if str(d) in row}, request_bytes)
    lo = max(d for d in depths if d < depth)
    hi = min(d for d in depths if d > depth)
    w = (depth - lo) / (hi - lo)
    return (1 - w) * disk_gbps(disk, request_bytes, lo) + w * disk_gbps(disk, request_bytes, hi)


def over_disk(hw, expert_bytes: int):
    """``hw`` (a ``core.profiles.HardwareProfile``) with its link replaced by its disk (``disk`` entry): the
    bandwidth of ``expert_bytes`` reads at queue depth 1 (a published entry: its one figure). The projection of
    ``simulate --link disk``: experts streamed from disk straight into the device tier (two tiers).

    Raises:
        MoeOffloadError: the profile has no disk entry.
    """
    import dataclasses

    disk = hw.extra.get("disk")
    if not disk:
        raise MoeOffloadError(f"hardware profile {hw.name} has no disk entry (this machine: `moe-offload bench link "
                              "--disk DIR`; shipped: rtx4090)")
    gbps = disk_gbps(disk, expert_bytes, 1)
    what = disk.get("device") or f"measured in {disk.get('directory', '?')}"
    return dataclasses.replace(hw, link=f"disk ({what}), {expert_bytes / 2**20:.2f} MiB reads", link_gbps=gbps,
                               link_theoretical_gbps=None, link_efficiency=None)


def this_machine_disk() -> dict | None:
    """The ``disk`` entry of the ``this-machine`` profile (``bench link --disk``), or None when not measured."""
    path = this_machine_path()
    try:
        return json.loads(path.read_text()).get("disk")
    except (OSError, ValueError):
        return None


def readers_for(request_bytes: int, default: int) -> int:
    """Reader threads for ``request_bytes`` requests: the smallest measured depth within 5% of the best there
    (``this_machine_disk``), else ``default``."""
    disk = this_machine_disk()
    if not disk or "table_gbps" not in disk:
        return default
    depths = sorted(int(d) for d in next(iter(disk["table_gbps"].values())))
    rates = {d: disk_gbps(disk, request_bytes, d) for d in depths}
    top = max(rates.values())
    return next(d for d in depths if rates[d] >= 0.95 * top)


def save_disk(entry: dict) -> Path:
    """Store ``entry`` as the ``disk`` section of the ``this-machine`` profile, every other section kept
    (``core.profiles.merge_this_machine``; ``bench link`` measures the link's)."""
    return merge_this_machine({"disk": entry}, f"measured by bench.disk_link.measure_disk at {entry['time']}")
