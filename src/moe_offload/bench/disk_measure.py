"""What ``bench disk`` measures of one engine run (issue 36): the run itself in a child memory cgroup with the
page cache of the checkpoint dropped first, the storage bytes it read (``RUSAGE_CHILDREN``'s ``ru_inblock``, the same
counter for every engine), llama.cpp's decode timing, and the expert bytes of a checkpoint and of its GGUF.

Units: bytes, seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

_EVAL = re.compile(r"eval time\s*=\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)")


def expert_bytes_of_checkpoint(model_dir: Path) -> tuple[int, int]:
    """``(bytes, experts)`` of the routed experts in ``model_dir``'s safetensors files (per-expert keys
    ``...experts.<e>.<name>``: the testbed family's layout), from their headers (``models.checkpoint.Checkpoint``).

    Raises:
        MoeOffloadError: a file that is not valid safetensors (``Checkpoint``).
    """
    from ..models.checkpoint import Checkpoint

    ckpt = Checkpoint(Path(model_dir))
    try:
        keys = [k for k in ckpt.keys() if ".experts." in k]
        return sum(ckpt.info(k).nbytes for k in keys), len({k.rsplit(".", 2)[0] for k in keys})
    finally:
        ckpt.close()


def checkpoint_expert_ranges(model_dir: Path) -> dict[Path, list[tuple[int, int]]]:
    """``{safetensors file: [(offset, nbytes)]}`` of the routed-expert tensors in ``model_dir`` (per-expert keys
    ``...experts.<e>.<name>``), from the headers (``models.checkpoint.Checkpoint``).

    Raises:
        MoeOffloadError: a file that is not valid safetensors (``Checkpoint``).
    """
    from ..models.checkpoint import Checkpoint

    ckpt = Checkpoint(Path(model_dir))
    try:
        out: dict[Path, list[tuple[int, int]]] = {}
        for k in ckpt.keys():
            if ".experts." in k:
                info = ckpt.info(k)
                out.setdefault(info.file, []).append((info.start, info.nbytes))
        return out
    finally:
        ckpt.close()


def gguf_expert_ranges(gguf: Path) -> list[tuple[int, int]]:
    """``[(offset, nbytes)]`` of the GGUF's routed-expert tensors (``*_exps``), from its header (``gguf`` package)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    return [(int(t.data_offset), int(t.n_bytes)) for t in reader.tensors if "_exps" in t.name]


def resident_in_ranges(path: Path, ranges: list[tuple[int, int]]) -> int:
    """Bytes of ``ranges`` of ``path`` in the page cache now (``runtime.page_cache.resident_pages``), in whole pages:
    a page a range shares with its neighbour counts for both (at most 2 pages per range over)."""
    from ..runtime.page_cache import PAGE, resident_pages

    pages = resident_pages(path)
    return sum(int(pages[off // PAGE:(off + n + PAGE - 1) // PAGE].sum()) * PAGE for off, n in ranges)


def drop_files(paths: list[Path]) -> int:
    """Evict ``paths`` from the page cache (``runtime.page_cache.drop``); returns the bytes of them still cached
    afterwards (``runtime.page_cache.cached_bytes``: ~0 when the kernel took the advice), so a run's reads are
    known to be real."""
    from ..runtime.page_cache import cached_bytes, drop

    for p in paths:
        drop(p)
    return sum(cached_bytes(p) for p in paths)


#: seconds between two samples of a run's memory beside the checkpoint's page cache (``run_limited``'s ``beside``)
SAMPLE_S = 0.05


def run_limited(cmd: list[str], limit_bytes: int | None, timeout_s: float, beside: list[Path] | None = None) -> dict:
    """Run ``cmd`` in a child memory cgroup limited to ``limit_bytes`` (None: unlimited) and return ``{"rc",
    "stdout", "stderr", "wall_s", "peak_bytes", "oom", "timed_out", "peak_beside_bytes"}`` (``timeout_s``: killed
    after that many seconds).

    ``peak_beside_bytes`` (with ``beside``, else None): the most the cgroup used beside the page cache of the files
    ``beside``, sampled every ``SAMPLE_S`` seconds (``memory.usage_in_bytes`` less their cached bytes): the memory a
    run needs of its own when those files' pages are only a cache to it. The cgroup's ``peak_bytes`` counts that
    cache, and the cache left at the end can be larger than at the peak, so neither gives it.

    Raises:
        MoeOffloadError: no child memory cgroup can be made here (``ChildCgroup``).
    """
    from ..runtime.host_memory import ChildCgroup
    from ..runtime.page_cache import cached_bytes

    with ChildCgroup(limit_bytes if limit_bytes is not None else 1 << 62) as cg:
        t0 = time.perf_counter()
        with open(os.devnull, "rb") as stdin:
            proc = subprocess.Popen(cg.argv(cmd), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        peak_beside = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                try:
                    used = int((cg.path / "memory.usage_in_bytes").read_text())
                    peak_beside[0] = max(peak_beside[0], used - sum(cached_bytes(f) for f in beside))
                except (OSError, ValueError):  # the cgroup is going away with its last process
                    return

        sampler = threading.Thread(target=sample, daemon=True) if beside else None
        if sampler is not None:
            sampler.start()
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            timed_out = True
        finally:
            done.set()
            if sampler is not None:
                sampler.join()
        wall = time.perf_counter() - t0
        return {"rc": proc.returncode, "stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace"),
                "wall_s": wall, "peak_bytes": cg.peak_bytes, "oom": cg.oom_kills > 0, "timed_out": timed_out,
                "peak_beside_bytes": peak_beside[0] if beside else None}


def _children_inblock() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock * 512


def measured(cmd: list[str], limit_bytes: int | None, timeout_s: float, drop: list[Path],
             beside: list[Path] | None = None) -> dict:
    """``run_limited`` (``beside`` passed on) after dropping ``drop`` from the page cache, with ``read_bytes``: the
    storage bytes the run's processes read (``RUSAGE_CHILDREN``'s ``ru_inblock`` before and after), and
    ``cached_before_bytes``: the bytes of ``drop`` still in the page cache when the run started."""
    cached = drop_files(drop)
    before = _children_inblock()
    r = run_limited(cmd, limit_bytes, timeout_s, beside)
    r["read_bytes"] = _children_inblock() - before
    r["cached_before_bytes"] = cached
    return r


def parse_llama_decode(stderr: str) -> tuple[float, int] | None:
    """``(decode tok/s, tokens)`` from llama.cpp's timing lines (the ``eval time`` line, not ``prompt eval``), or
    None when absent."""
    for line in stderr.splitlines():
        if "prompt eval" in line:
            continue
        m = _EVAL.search(line)
        if m and int(m.group(2)) > 0:
            ms, n = float(m.group(1)), int(m.group(2))
            return n / (ms / 1e3), n
    return None
