"""glibc's heap, controlled so that CPU budgets count what is really live.

A CPU budget limits ``VmData``, which counts freed blocks glibc keeps in its heap. These
helpers make large frees go back to the kernel (``mallopt(M_MMAP_THRESHOLD)``) for a
process we own or for the length of a block (:func:`freed_memory_returned`), return the
heap's free top (``malloc_trim``), read what is left free (``mallinfo2``) and fill it for the
length of a budget (:func:`heap_plugged`); each does nothing without glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024
# After a block: where glibc's own dynamic thresholds end in a process that frees large
# tensors (the mmap threshold rises to the largest block freed, at most 32 MiB on 64-bit,
# the trim threshold to twice that). glibc cannot be told to adjust them again once
# set, and 128 KiB left set costs a training step 1.8x its time in page faults
# (docs/measurements.md#return-freed-memory).
_AFTER_MMAP_THRESHOLD_BYTES = 32 << 20
_AFTER_TRIM_THRESHOLD_BYTES = 64 << 20
# Plug sizes, largest first, all below the mmap threshold (a plug must come from the heap):
# the free chunks that the small allocations of the code inside a budget could reuse.
_PLUG_BYTES = (96 * 1024, 12 * 1024, 1536, 192)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2() -> _MallInfo2 | None:
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return fn()


def free_heap_bytes() -> int | None:
    """Bytes in free chunks inside glibc's heaps, every arena's (``mallinfo2().fordblks``,
    measured; docs/measurements.md#free-heap-at-budget-entry). None without glibc >= 2.33."""
    info = _mallinfo2()
    return None if info is None else int(info.fordblks)


def plug_free_heap() -> list[int]:
    """Fill the free chunks of the calling thread's glibc arena with blocks of our own, so
    that what runs next cannot reuse memory already counted in ``VmData``
    (docs/measurements.md#free-heap-at-budget-entry). A block is kept while taking it grew
    no heap; the threshold must be :func:`return_freed_memory_to_os`'s first. At most the
    free bytes measured at the start are taken. Returns the blocks for :func:`unplug_heap`;
    none without glibc >= 2.33."""
    libc, info = _libc(), _mallinfo2()
    if libc is None or info is None:
        return []
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    heap_size = _heap_size_reader(libc)
    plugs: list[int] = []
    left = int(info.fordblks)  # a bound: a heap that grows elsewhere cannot loop forever
    for size in _PLUG_BYTES:
        while left >= size:
            before = heap_size()
            block = libc.malloc(size)
            if not block:
                break
            if heap_size() > before:  # no free chunk held it: the heap grew
                libc.free(block)
                break
            plugs.append(block)
            left -= size
    return plugs


def _heap_size_reader(libc: ctypes.CDLL) -> Callable[[], int]:
    """What tells that the calling thread's heap grew. Where its arena is glibc's main one (a
    probe block lies below the program break), the break (``sbrk(0)``, constant time: 56,209
    plugs took 16.4 s when each read ``mallinfo2``, which walks every free chunk); else, as
    for other threads, or a main thread glibc moved to another arena after an allocation
    failed there (a trial's OOM), the bytes of every arena (``mallinfo2().arena``)."""
    sbrk = getattr(libc, "sbrk", None)
    if sbrk is not None:
        sbrk.restype = ctypes.c_void_p
        sbrk.argtypes = [ctypes.c_ssize_t]
        probe = libc.malloc(_PLUG_BYTES[-2])  # above tcache's sizes: from this arena's own bins
        on_brk = bool(probe) and probe < (sbrk(0) or 0)
        libc.free(probe)
        if on_brk:
            return lambda: int(sbrk(0) or 0)
    return lambda: int(_mallinfo2().arena)


def unplug_heap(plugs: list[int]) -> None:
    """Free the blocks :func:`plug_free_heap` took (and forget them)."""
    libc = _libc()
    for block in plugs:
        libc.free(block)
    plugs.clear()


@contextlib.contextmanager
def heap_plugged() -> Iterator[list[int]]:
    """:func:`plug_free_heap` for the block, :func:`unplug_heap` after it."""
    plugs = plug_free_heap()
    try:
        yield plugs
    finally:
        unplug_heap(plugs)


@functools.cache  # find_library runs ldconfig in a subprocess: 1.5 ms a call
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


# glibc's thresholds are the process's, so is what holds them: whether a process we own
# set them for good, and how many blocks hold them now.
_held = {"for_good": False, "blocks": 0}


def return_freed_memory_to_os() -> bool:
    """Make glibc serve allocations of 128 KiB or more with mmap, so frees go back to the OS
    (docs/measurements.md#return-freed-memory), for the rest of the process: for the
    processes oomguard starts and measures. False without glibc."""
    _held["for_good"] = True
    return _call("mallopt", _M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


@contextlib.contextmanager
def freed_memory_returned() -> Iterator[bool]:
    """The 128 KiB threshold of :func:`return_freed_memory_to_os` for the block only (a
    budget or a search in the user's own process); after the outermost block, glibc's
    thresholds are set where its dynamic ones end (32 MiB mmap, 64 MiB trim), unless the
    process set them for good. Yields False without glibc."""
    ok = _call("mallopt", _M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    _held["blocks"] += 1
    try:
        yield ok
    finally:
        _held["blocks"] -= 1
        if ok and not _held["blocks"] and not _held["for_good"]:
            _call("mallopt", _M_MMAP_THRESHOLD, _AFTER_MMAP_THRESHOLD_BYTES)
            _call("mallopt", _M_TRIM_THRESHOLD, _AFTER_TRIM_THRESHOLD_BYTES)


def trim_heap() -> bool:
    """Give the free memory at the top of glibc's heaps back to the OS (``malloc_trim(0)``)."""
    return _call("malloc_trim", 0)


def _call(name: str, *args: int) -> bool:
    """glibc's ``name(*args)`` as a bool; False without glibc or without that function."""
    fn = getattr(_libc(), name, None)
    return bool(fn(*args)) if fn is not None else False
