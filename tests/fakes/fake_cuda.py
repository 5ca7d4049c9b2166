"""A fake CUDA device and allocator, for the budget and peak code paths a CPU host cannot reach.

Follows torch 2.13 ``torch/cuda/memory.py`` (the functions and their units, bytes) and the
two allocator backends behind it:

- ``native``: c10/cuda/CUDACachingAllocator.cpp. Requests are rounded to 512 bytes
  (``kMinBlockSize``); requests up to 1 MiB come from the small pool in 2 MiB segments
  (``kSmallBuffer``), larger ones from the large pool, in 20 MiB segments below 10 MiB
  (``kLargeBuffer``/``kMinLargeAlloc``), else rounded up to 2 MiB (``kRoundLarge``).
  ``memory_reserved`` is the sum of segments (cudaMalloc'd), ``memory_allocated`` of live
  blocks. A new segment fails when ``reserved + segment > fraction * total``
  (``alloc_block``: ``total_allocated_memory + size > allowed_memory_maximum``) or the
  device has no room; the allocator then frees its unused cached segments and retries
  (``release_cached_blocks``) before raising ``torch.OutOfMemoryError`` with the message
  of ``DeviceCachingAllocator::malloc``. ``empty_cache`` frees unused segments.
  Simplification: a segment's free bytes count as one contiguous block (real blocks split
  and fragment), and expandable segments are not modelled.
- ``cudaMallocAsync``: c10/cuda/CUDAMallocAsyncAllocator.cpp. The cap counts bytes in use
  (``pytorch_used_bytes + size > pytorch_memory_limits``), unrounded;
  ``memory_allocated`` is the pool's used bytes and ``memory_reserved`` the pool's reserved
  bytes, which keep freed memory (release threshold UINT64_MAX) until ``empty_cache``
  trims the pool (``cudaMemPoolTrimTo(0)``). Simplification: the pool reserves in 2 MiB
  granules (the driver's granularity is its own).

``get_per_process_memory_fraction`` exists from torch 2.6 (``has_fraction_getter=False``
removes it, as on torch 2.4-2.5). Tensors are not real: tests call :meth:`FakeCuda.alloc`
and :meth:`FakeCuda.free`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

KiB, MiB, GiB = 1024, 1024**2, 1024**3
K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 * MiB
K_SMALL_BUFFER = 2 * MiB
K_LARGE_BUFFER = 20 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB
ASYNC_GRANULE = 2 * MiB


def format_size(size: int) -> str:
    """c10's ``format_size``: bytes up to 1 KiB, then KiB, MiB, GiB with two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= MiB:
        return f"{size / 1024:.2f} KiB"
    if size <= GiB:
        return f"{size / MiB:.2f} MiB"
    return f"{size / GiB:.2f} GiB"


def round_size(size: int) -> int:
    return K_MIN_BLOCK if size < K_MIN_BLOCK else K_MIN_BLOCK * math.ceil(size / K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * math.ceil(size / K_ROUND_LARGE)


@dataclass
class _Segment:
    size: int
    small: bool
    used: int = 0


@dataclass
class FakeCuda:
    """One fake GPU. ``context`` bytes are the CUDA context (outside the allocator),
    ``other`` bytes other processes' use; both lower ``mem_get_info``'s free."""

    total: int = 16 * GiB
    context: int = 512 * MiB
    other: int = 0
    backend: str = "native"
    has_fraction_getter: bool = True
    segments: list[_Segment] = field(default_factory=list)
    blocks: dict[int, tuple[int, _Segment | None]] = field(default_factory=dict)
    allowed: int | None = None  # native: allowed_memory_maximum (None: no fraction below 1)
    limit: int | None = None  # cudaMallocAsync: pytorch_memory_limits (None: UINT64_MAX)
    pool_reserved: int = 0  # cudaMallocAsync pool
    peak_allocated: int = 0
    peak_reserved: int = 0
    _ids: Any = field(default_factory=itertools.count)

    # -- bookkeeping -------------------------------------------------------------------
    def allocated(self) -> int:
        return sum(size for size, _ in self.blocks.values())

    def reserved(self) -> int:
        if self.backend == "cudaMallocAsync":
            return self.pool_reserved
        return sum(s.size for s in self.segments)

    def _device_free(self) -> int:
        return self.total - self.context - self.other - self.reserved()

    def _track_peaks(self) -> None:
        self.peak_allocated = max(self.peak_allocated, self.allocated())
        self.peak_reserved = max(self.peak_reserved, self.reserved())

    # -- what a tensor does ------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` as a tensor would; returns a handle for :meth:`free`."""
        handle = next(self._ids)
        if self.backend == "cudaMallocAsync":
            self._alloc_async(handle, nbytes)
        else:
            self._alloc_native(handle, nbytes)
        self._track_peaks()
        return handle

    def free(self, handle: int) -> None:
        size, seg = self.blocks.pop(handle)
        if seg is not None:
            seg.used -= size

    def _alloc_native(self, handle: int, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        fits = [s for s in self.segments if s.small == small and s.size - s.used >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size - s.used)
        else:
            alloc = allocation_size(size)
            seg = self._new_segment(alloc, small)
            if seg is None:
                self.empty_cache()  # release_cached_blocks, then retry once
                seg = self._new_segment(alloc, small)
            if seg is None:
                raise torch.OutOfMemoryError(self._native_message(alloc))
        seg.used += size
        self.blocks[handle] = (size, seg)

    def _new_segment(self, alloc: int, small: bool) -> _Segment | None:
        if self.allowed is not None and self.reserved() + alloc > self.allowed:
            return None
        if alloc > self._device_free():
            return None
        seg = _Segment(size=alloc, small=small)
        self.segments.append(seg)
        return seg

    def _native_message(self, alloc: int) -> str:
        allowed = f"{format_size(self.allowed)} allowed; " if self.allowed is not None else ""
        used = self.context + self.reserved()
        return (f"CUDA out of memory. Tried to allocate {format_size(alloc)}. GPU 0 has a total "
                f"capacity of {format_size(self.total)} of which "
                f"{format_size(self._device_free())} is free. Including non-PyTorch memory, this "
                f"process has {format_size(used)} memory in use. {allowed}Of the allocated "
                f"memory {format_size(self.allocated())} is allocated by PyTorch, and "
                f"{format_size(self.reserved() - self.allocated())} is reserved by PyTorch but "
                "unallocated. If reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
                "documentation for Memory Management  "
                "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")

    def _alloc_async(self, handle: int, nbytes: int) -> None:
        used = self.allocated()
        need = ASYNC_GRANULE * math.ceil((used + nbytes) / ASYNC_GRANULE)
        over_limit = self.limit is not None and used + nbytes > self.limit
        if over_limit or need - self.pool_reserved > self._device_free():
            raise torch.OutOfMemoryError(
                f"Allocation on device 0 would exceed allowed memory. (out of memory)"
                f"\nCurrently allocated     : {format_size(used)}"
                f"\nRequested               : {format_size(nbytes)}"
                f"\nDevice limit            : {format_size(self.total)}"
                f"\nFree (according to CUDA): {format_size(self._device_free())}"
                "\nPyTorch limit (set by user-supplied memory fraction)"
                f"\n                        : {format_size(self.limit or 2**64 - 1)}")
        self.pool_reserved = max(self.pool_reserved, need)
        self.blocks[handle] = (nbytes, None)

    # -- torch.cuda's functions ----------------------------------------------------------
    def empty_cache(self) -> None:
        if self.backend == "cudaMallocAsync":
            self.pool_reserved = ASYNC_GRANULE * math.ceil(self.allocated() / ASYNC_GRANULE)
        else:
            self.segments = [s for s in self.segments if s.used > 0]

    def memory_allocated(self, device: Any = None) -> int:
        return self.allocated()

    def memory_reserved(self, device: Any = None) -> int:
        return self.reserved()

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak_allocated

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated(), self.reserved()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self._device_free(), self.total

    def set_per_process_memory_fraction(self, fraction: Any, device: Any = None) -> None:
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        if self.backend == "cudaMallocAsync":
            self.limit = int(fraction * self.total)
        else:
            self.allowed = int(fraction * self.total) if fraction < 1.0 else None

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        cap = self.limit if self.backend == "cudaMallocAsync" else self.allowed
        return 1.0 if cap is None else cap / self.total

    def get_allocator_backend(self) -> str:
        return self.backend

    def get_device_properties(self, device: Any = None) -> Any:
        return SimpleNamespace(name="Fake GPU", total_memory=self.total)

    def install(self, monkeypatch: Any) -> FakeCuda:
        """Replace the ``torch.cuda`` functions oomguard calls with this device's."""
        simple = {"is_available": lambda: True, "device_count": lambda: 1,
                  "current_device": lambda: 0, "is_initialized": lambda: True,
                  "synchronize": lambda device=None: None}
        for name, fn in simple.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        for name in ("empty_cache", "memory_allocated", "memory_reserved", "max_memory_allocated",
                     "max_memory_reserved", "reset_peak_memory_stats", "mem_get_info",
                     "set_per_process_memory_fraction", "get_allocator_backend",
                     "get_device_properties", "get_per_process_memory_fraction"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name), raising=False)
        if not self.has_fraction_getter:
            monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        return self
