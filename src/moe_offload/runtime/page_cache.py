"""What the kernel's page cache holds of a file, and dropping it (Linux; the disk tier's honesty checks, issue 35).

``cached_bytes`` asks ``mincore(2)`` about a read-only shared mapping of the file (what ``fincore`` does), so it
reads no page itself; ``drop`` is ``posix_fadvise(POSIX_FADV_DONTNEED)`` over the whole file, which evicts its clean
pages from the page cache (no global ``drop_caches``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import numpy as np

#: bytes per page of ``resident_pages``
PAGE = _PAGE = mmap.PAGESIZE
_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def cached_bytes(path: str | Path) -> int:
    """Bytes of ``path`` resident in the page cache (pages x page size, the last page counted whole).

    Raises:
        OSError: the file cannot be opened or mapped, or ``mincore`` fails (not Linux).
    """
    return int(resident_pages(path).sum()) * _PAGE


def resident_pages(path: str | Path) -> np.ndarray:
    """``[ceil(size / page)]`` bool: which pages of ``path`` the page cache holds (``PAGE`` bytes each).

    Raises:
        OSError: the file cannot be opened or mapped, or ``mincore`` fails (not Linux).
    """
    size = os.path.getsize(path)
    if size == 0:
        return np.zeros(0, dtype=bool)
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop(path: str | Path) -> None:
    """Evict ``path``'s pages from the page cache: written back first (``fdatasync``: a file just written is dirty,
    and ``posix_fadvise DONTNEED`` only evicts clean pages), then dropped.

    Raises:
        OSError: the file cannot be opened or the kernel refuses the advice.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
