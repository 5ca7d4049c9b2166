"""glibc's heap, controlled so that CPU budgets count what is really live.

A CPU budget limits ``VmData``, which counts freed blocks glibc keeps in its heap. These
helpers make large frees go back to the kernel (``mallopt(M_MMAP_THRESHOLD)``), return the
heap's free top (``malloc_trim``) and read what is left free (``mallinfo2``); each returns
False or None without glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024
# Every block >= 4 KiB its own mapping: VmData is the sum of live blocks, for a step up to
# 35% slower (measured: docs/measurements.md#return-freed-memory).
ISOLATED_MMAP_THRESHOLD_BYTES = 4 * 1024
_mmap_threshold: list[int] = []  # the lowest set here: a later budget must not raise it


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def free_heap_bytes() -> int | None:
    """Bytes in free chunks inside glibc's heaps (``mallinfo2().fordblks``, measured;
    docs/measurements.md#free-heap-at-budget-entry). None without glibc >= 2.33."""
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return int(fn().fordblks)


@functools.cache  # find_library runs ldconfig in a subprocess: 1.5 ms a call
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def return_freed_memory_to_os(threshold: int = _MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc serve allocations of ``threshold`` bytes or more with mmap, so frees go
    back to the OS (docs/measurements.md#return-freed-memory); a lower threshold already set
    is kept. False without glibc."""
    if _mmap_threshold:
        threshold = min(threshold, _mmap_threshold[0])
    done = _call("mallopt", _M_MMAP_THRESHOLD, threshold)
    if done:
        _mmap_threshold[:] = [threshold]
    return done


def mmap_threshold_bytes() -> int | None:
    """The lowest ``M_MMAP_THRESHOLD`` oomguard set in this process (bytes), or None."""
    return _mmap_threshold[0] if _mmap_threshold else None


def trim_heap() -> bool:
    """Give the free memory at the top of glibc's heaps back to the OS (``malloc_trim(0)``)."""
    return _call("malloc_trim", 0)


def _call(name: str, *args: int) -> bool:
    """glibc's ``name(*args)`` as a bool; False without glibc or without that function."""
    fn = getattr(_libc(), name, None)
    return bool(fn(*args)) if fn is not None else False
