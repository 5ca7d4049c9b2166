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
  (``release_cached_blocks``, counted in ``num_alloc_retries`` by ``alloc_block(.., isRetry)``)
  before it reports the OOM. Not modelled: expandable segments, streams, and
  ``release_available_cached_blocks`` (with ``max_split_size`` set it frees oversize cached
  blocks first, without a retry; the fake goes straight to the full release).

  Blocks: a request takes the smallest free block of its pool that fits (``get_free_block``;
  with ``max_split_size`` set, a block at or above it serves only requests within
  ``kLargeBuffer`` of its size) and is split when ``should_split``: small pool, a remainder
  of at least 512 bytes; large pool, a request below ``max_split_size`` and a remainder over
  ``kSmallSize`` (1 MiB). A freed block merges with its free neighbours
  (``try_merge_blocks``). ``empty_cache`` and the OOM path release only unsplit free blocks,
  i.e. wholly free segments (``release_cached_blocks``: "Free all non-split cached
  blocks"): a free remainder of a segment in use stays reserved (fragmentation).

  The OOM path (``malloc``, ``!block_found``): ``cudaMemGetInfo``, then
  ``reportProcessMemoryInfo(device)``, then ``stats.num_ooms += 1``, then the
  ``OutOfMemoryError``. ``reportProcessMemoryInfo`` asks NVML for the processes on the
  device: ``TORCH_INTERNAL_ASSERT(NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_())``,
  ``TORCH_INTERNAL_ASSERT(NVML_SUCCESS == DriverAPI::get()->nvmlDeviceGetHandleByPciBusId_v2_(
  pci_id, &nvml_device))`` (the *physical* GPU's bus id: a MIG slice's parent) and
  ``TORCH_INTERNAL_ASSERT(NVML_SUCCESS == r)`` after ``nvmlDeviceGetComputeRunningProcesses``.
  Where NVML refuses (a MIG parent without root, WSL2, locked-down containers) the assert's
  ``c10::Error`` reaches Python as a ``RuntimeError`` instead of the OOM, and ``num_ooms`` is
  not incremented (it comes after). c10/util/Exception.h prints a failed assert as
  ``#cond " INTERNAL ASSERT FAILED at " C10_STRINGIZE(__FILE__) ":" C10_STRINGIZE(__LINE__)
  ", please report a bug to PyTorch. "``. Without libnvidia-ml (``get_nvml_handle()`` null)
  the report is empty. ``nvml=`` takes a fake pynvml (tests/fakes/fake_nvml.py) whose driver
  answers; without one NVML answers with this process alone.

  Memory outside the allocator (``context``: the CUDA context; ``outside``: cuBLAS/cuDNN
  handles, kernels loaded lazily under ``CUDA_MODULE_LOADING=LAZY``) lowers
  ``cudaMemGetInfo``'s free but not the fraction cap, which counts reserved segments only.

  cuBLAS workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp): ``getNewWorkspace()``
  allocates ``getChosenWorkspaceSize()`` through the caching allocator, one per (handle,
  stream) in ``cublas_handle_stream_to_workspace()``, kept until
  ``torch._C._cuda_clearCublasWorkspaces()``; handles are per thread (a thread-local
  ``PoolWindow``), so the autograd engine's backward thread holds a second one. The size
  is ``4096 * 1024 * 2 + 16 * 1024 * 8`` bytes (8 MiB + 128 KiB), ``4096 * 8 * 1024``
  (32 MiB) on sm90. :meth:`FakeCuda.cublas_warmup` makes them as a first matmul and
  backward would.
- ``cudaMallocAsync``: c10/cuda/CUDAMallocAsyncAllocator.cpp. The cap counts bytes in use
  (``pytorch_used_bytes + size > pytorch_memory_limits``), unrounded;
  ``memory_allocated`` is the pool's used bytes and ``memory_reserved`` the pool's reserved
  bytes, which keep freed memory (release threshold UINT64_MAX) until ``empty_cache``
  trims the pool (``cudaMemPoolTrimTo(0)``). Simplification: the pool reserves in 2 MiB
  granules (the driver's granularity is its own). ``getMemoryFraction`` calls
  ``lazy_init_device(device)`` (a CUDA context: hundreds of MiB) and ``cudaMemGetInfo``, then
  returns ``pytorch_memory_limits[device] / device_total``; the limit starts at
  ``UINT64_MAX``, so with no fraction set the "fraction" is about 2e8 on a 80 GiB device
  and ``set_per_process_memory_fraction`` refuses it back ("Allowed range: 0~1").
  ``getDeviceStats`` returns zeros without creating a context on a device not used yet.

``get_per_process_memory_fraction`` exists from torch 2.6 (``has_fraction_getter=False``
removes it, as on torch 2.4-2.5). ``memory_stats`` has torch's flattened key names
(``allocated_bytes.all.current``, ``num_alloc_retries``, ...) and ``memory_snapshot`` the
segment dicts of ``torch.cuda.memory_snapshot()`` (``segment_type``, ``total_size``,
``allocated_size``, ``blocks`` with ``size`` and ``state``); under cudaMallocAsync the
snapshot raises, as ``CudaMallocAsyncAllocator::snapshot`` does. ``get_device_properties``
has ``uuid`` (printed bare, as ``str(props.uuid)``), the PCI ids and ``major``/``minor``.
Tensors are not real: tests call :meth:`FakeCuda.alloc` and :meth:`FakeCuda.free`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
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
UINT64_MAX = 2**64 - 1
ALLOCATOR_CPP = "/pytorch/c10/cuda/CUDACachingAllocator.cpp"
# The three asserts of reportProcessMemoryInfo (pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp,
# read at 001074d and in the later reportProcessMemoryInfo(const cudaDeviceProp&) form: the
# same conditions), as the preprocessor stringises them. The line numbers are illustrative:
# they differ between releases and builds; nothing matches on them.
NVML_ASSERTS = {
    "init": ("NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_()", 1105),
    "handle": ("NVML_SUCCESS == DriverAPI::get()->nvmlDeviceGetHandleByPciBusId_v2_( pci_id, "
               "&nvml_device)", 1124),
    "processes": ("NVML_SUCCESS == r", 1133),
}


def nvml_assert_text(which: str) -> str:
    """The ``RuntimeError`` text of one of :data:`NVML_ASSERTS` failing (module docstring)."""
    cond, line = NVML_ASSERTS[which]
    return (f'{cond} INTERNAL ASSERT FAILED at "{ALLOCATOR_CPP}":{line}, please report a bug '
            "to PyTorch. ")


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
class _Block:
    size: int
    allocated: bool = False
    requested: int = 0


@dataclass
class _Segment:
    """One cudaMalloc'd segment: its blocks in address order (module docstring)."""

    size: int
    small: bool
    blocks: list[_Block] = field(default_factory=list)
    address: int = 0

    def __post_init__(self) -> None:
        if not self.blocks:
            self.blocks = [_Block(self.size)]

    @property
    def used(self) -> int:
        return sum(b.size for b in self.blocks if b.allocated)


@dataclass
class FakeCuda:
    """One fake GPU. ``context`` bytes are the CUDA context (once ``has_context``),
    ``outside`` this process's other bytes outside the allocator, ``other`` other
    processes'; all lower ``mem_get_info``'s free, none counts against the fraction cap."""

    total: int = 16 * GiB
    context: int = 512 * MiB
    other: int = 0
    outside: int = 0
    backend: str = "native"
    has_fraction_getter: bool = True
    has_context: bool = True
    max_split_size: int | None = None  # PYTORCH_CUDA_ALLOC_CONF max_split_size_mb (None: SIZE_MAX)
    nvml: ModuleType | None = None  # a fake pynvml answering reportProcessMemoryInfo
    nvml_library: bool = True  # False: no libnvidia-ml, reportProcessMemoryInfo returns ""
    pid: int = 4242
    name: str = "Fake GPU"
    uuid: str = "5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"
    pci_bus_id: str = "00000000:3B:00.0"  # NVML_DEVICE_PCI_BUS_ID_FMT of the physical GPU
    major: int = 8
    minor: int = 0
    segments: list[_Segment] = field(default_factory=list)
    blocks: dict[int, tuple[_Segment | None, _Block]] = field(default_factory=dict)
    allowed: int | None = None  # native: allowed_memory_maximum (None: no fraction below 1)
    limit: int | None = None  # cudaMallocAsync: pytorch_memory_limits (None: UINT64_MAX)
    pool_reserved: int = 0  # cudaMallocAsync pool
    peak_allocated: int = 0
    peak_reserved: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    workspaces: list[int] = field(default_factory=list)  # handles of live cuBLAS workspaces
    _ids: Any = field(default_factory=itertools.count)
    _addresses: Any = field(default_factory=lambda: itertools.count(0x7F0000000000, 1 << 32))

    # -- bookkeeping -------------------------------------------------------------------
    def allocated(self) -> int:
        return sum(b.size for _, b in self.blocks.values())

    def reserved(self) -> int:
        if self.backend == "cudaMallocAsync":
            return self.pool_reserved
        return sum(s.size for s in self.segments)

    def _device_free(self) -> int:
        context = self.context if self.has_context else 0
        return self.total - context - self.outside - self.other - self.reserved()

    def _track_peaks(self) -> None:
        self.peak_allocated = max(self.peak_allocated, self.allocated())
        self.peak_reserved = max(self.peak_reserved, self.reserved())

    # -- what a tensor does ------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` as a tensor would; returns a handle for :meth:`free`."""
        self.has_context = True  # the first allocation creates the context
        handle = next(self._ids)
        if self.backend == "cudaMallocAsync":
            self._alloc_async(handle, nbytes)
        else:
            self._alloc_native(handle, nbytes)
        self._track_peaks()
        return handle

    def free(self, handle: int) -> None:
        seg, block = self.blocks.pop(handle)
        block.allocated = False
        if seg is not None:  # try_merge_blocks with both neighbours
            i = next(k for k, b in enumerate(seg.blocks) if b is block)
            for j in (i + 1, i - 1):
                if 0 <= j < len(seg.blocks) and not seg.blocks[j].allocated:
                    lo, hi = sorted((i, j))
                    seg.blocks[lo:hi + 1] = [_Block(seg.blocks[lo].size + seg.blocks[hi].size)]
                    i = lo

    def cublas_warmup(self, threads: int = 2) -> None:
        """The cuBLAS workspaces a first matmul (forward thread) and backward (autograd
        thread) leave alive: one per thread's handle (module docstring)."""
        size = 4096 * 8 * 1024 if (self.major, self.minor) == (9, 0) else \
            4096 * 1024 * 2 + 16 * 1024 * 8
        while len(self.workspaces) < threads:
            self.workspaces.append(self.alloc(size))

    def _split_max(self) -> int:
        return self.max_split_size if self.max_split_size is not None else UINT64_MAX

    def _free_block(self, size: int, small: bool) -> tuple[_Segment, _Block] | None:
        """``get_free_block``: the smallest free block of the pool that may serve ``size``."""
        most = self._split_max()
        fits = [(b.size, seg, b) for seg in self.segments if seg.small == small
                for b in seg.blocks if not b.allocated and b.size >= size
                and not (size < most <= b.size) and not (size >= most and b.size >= size + K_LARGE_BUFFER)]
        if not fits:
            return None
        _, seg, block = min(fits, key=lambda f: f[0])
        return seg, block

    def _alloc_native(self, handle: int, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        found = self._free_block(size, small)
        if found is None:
            alloc = allocation_size(size)
            seg = self._new_segment(alloc, small)
            if seg is None:  # release_cached_blocks, then alloc_block(isRetry=true)
                self.empty_cache()
                self.num_alloc_retries += 1
                seg = self._new_segment(alloc, small)
            if seg is None:
                raise self._oom(alloc)
            found = seg, seg.blocks[0]
        seg, block = found
        remaining = block.size - size
        split = remaining >= K_MIN_BLOCK if small else (size < self._split_max()
                                                        and remaining > K_SMALL_SIZE)
        if split:
            i = seg.blocks.index(block)
            block.size = size
            seg.blocks.insert(i + 1, _Block(remaining))
        block.allocated, block.requested = True, nbytes
        self.blocks[handle] = (seg, block)

    def _new_segment(self, alloc: int, small: bool) -> _Segment | None:
        if self.allowed is not None and self.reserved() + alloc > self.allowed:
            return None
        if alloc > self._device_free():
            return None
        seg = _Segment(size=alloc, small=small, address=next(self._addresses))
        self.segments.append(seg)
        return seg

    def _process_memory_info(self) -> str:
        """``reportProcessMemoryInfo``: NVML's processes on the physical GPU, or the
        ``RuntimeError`` of the assert that fails (module docstring)."""
        if not self.nvml_library:
            return ""
        if self.nvml is None:
            procs = [SimpleNamespace(pid=self.pid, usedGpuMemory=self.context + self.outside
                                     + self.reserved())]
        else:
            steps = (("init", lambda: self.nvml.nvmlInit()),
                     ("handle", lambda: self.nvml.nvmlDeviceGetHandleByPciBusId(self.pci_bus_id)),
                     ("processes", lambda: self.nvml.nvmlDeviceGetComputeRunningProcesses_v2(
                         handle)))
            handle = None
            for which, step in steps:
                try:
                    got = step()
                except self.nvml.NVMLError:
                    raise RuntimeError(nvml_assert_text(which)) from None
                handle = got if which == "handle" else handle
            procs = got
        out = ""
        for p in procs:
            who = ("Including non-PyTorch memory, this process" if p.pid == self.pid
                   else f"Process {p.pid}")
            used = UINT64_MAX if p.usedGpuMemory is None else p.usedGpuMemory  # N/A as C has it
            out += f"{who} has {format_size(used)} memory in use. "
        return out

    def _oom(self, alloc: int) -> BaseException:
        """What the OOM path raises: the NVML assert's ``RuntimeError``, else the OOM."""
        try:
            proc_info = self._process_memory_info()
        except RuntimeError as exc:
            return exc
        self.num_ooms += 1
        allowed = f"{format_size(self.allowed)} allowed; " if self.allowed is not None else ""
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(alloc)}. GPU 0 has a total "
            f"capacity of {format_size(self.total)} of which "
            f"{format_size(self._device_free())} is free. {proc_info}{allowed}Of the allocated "
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
                f"\n                        : {format_size(self.limit or UINT64_MAX)}")
        self.pool_reserved = max(self.pool_reserved, need)
        self.blocks[handle] = (None, _Block(nbytes, allocated=True, requested=nbytes))

    # -- torch.cuda's functions ----------------------------------------------------------
    def empty_cache(self) -> None:
        if self.backend == "cudaMallocAsync":
            self.pool_reserved = ASYNC_GRANULE * math.ceil(self.allocated() / ASYNC_GRANULE)
        else:  # release_cached_blocks: unsplit free blocks only
            self.segments = [s for s in self.segments
                             if len(s.blocks) > 1 or s.blocks[0].allocated]

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

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        """``torch.cuda.memory_stats``: the flattened ``DeviceStats`` (module docstring)."""
        native = self.backend != "cudaMallocAsync"
        live = [b for _, b in self.blocks.values()]
        split_free = sum(b.size for s in self.segments if len(s.blocks) > 1
                         for b in s.blocks if not b.allocated)
        out: dict[str, Any] = {}
        for name, current, peak in (
                ("allocated_bytes", self.allocated(), self.peak_allocated),
                ("reserved_bytes", self.reserved(), self.peak_reserved),
                ("active_bytes", self.allocated(), self.peak_allocated),
                ("requested_bytes", sum(b.requested for b in live) if native else 0, 0),
                ("inactive_split_bytes", split_free if native else 0, 0),
                ("segment", len(self.segments) if native else 0, 0),
                ("allocation", len(live) if native else 0, 0)):
            for pool in ("all", "large_pool", "small_pool"):
                value = current if pool == "all" else 0
                out |= {f"{name}.{pool}.current": value, f"{name}.{pool}.peak":
                        (peak or current) if pool == "all" else 0}
        return out | {"num_alloc_retries": self.num_alloc_retries if native else 0,
                      "num_ooms": self.num_ooms if native else 0, "num_sync_all_streams": 0,
                      "num_device_alloc": 0, "num_device_free": 0,
                      "max_split_size": -1 if self.max_split_size is None else self.max_split_size}

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        """``torch.cuda.memory_stats_as_nested_dict``: the same ``DeviceStats`` nested, as
        ``torch._C._cuda_memoryStats`` returns them (``memory_stats`` joins the keys with
        ``.``, torch/cuda/memory.py)."""
        nested: dict[str, Any] = {}
        for key, value in self.memory_stats(device).items():
            *path, last = key.split(".")
            node = nested
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        return nested

    def memory_snapshot(self, mempool_id: Any = None, include_traces: bool = True) -> list[dict]:
        """``torch.cuda.memory_snapshot()``'s segments (module docstring)."""
        if self.backend == "cudaMallocAsync":
            raise RuntimeError("Calling snapshot with backend:cudaMallocAsync is not meaningful. "
                               "(For backend:native, snapshot returns a detailed summary of all "
                               "blocks tracked by the allocator, but the cudaMallocAsync backend "
                               "does not track individual blocks.)")
        out = []
        for seg in self.segments:
            blocks, address = [], seg.address
            for b in seg.blocks:
                blocks.append({"address": address, "size": b.size, "requested_size": b.requested,
                               "state": "active_allocated" if b.allocated else "inactive",
                               "frames": []})
                address += b.size
            used = seg.used
            out.append({"device": 0, "address": seg.address, "total_size": seg.size,
                        "allocated_size": used, "active_size": used,
                        "requested_size": sum(b.requested for b in seg.blocks if b.allocated),
                        "stream": 0, "segment_type": "small" if seg.small else "large",
                        "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                        "blocks": blocks})
        return out

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.has_context = True  # cudaMemGetInfo needs a context
        return self._device_free(), self.total

    def set_per_process_memory_fraction(self, fraction: Any, device: Any = None) -> None:
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.has_context = True  # setMemoryFraction: cudaMemGetInfo (async: lazy_init_device)
        if self.backend == "cudaMallocAsync":
            self.limit = int(fraction * self.total)
        else:
            self.allowed = int(fraction * self.total) if fraction < 1.0 else None

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        if self.backend == "cudaMallocAsync":  # lazy_init_device, then limit / total
            self.has_context = True
            return (UINT64_MAX if self.limit is None else self.limit) / self.total
        return 1.0 if self.allowed is None else self.allowed / self.total

    def get_allocator_backend(self) -> str:
        return self.backend  # CUDACachingAllocator::name(): no CUDA call

    def get_device_properties(self, device: Any = None) -> Any:
        bus = self.pci_bus_id.split(":")
        return SimpleNamespace(name=self.name, total_memory=self.total, uuid=self.uuid,
                               pci_domain_id=int(bus[0], 16), pci_bus_id=int(bus[1], 16),
                               pci_device_id=int(bus[2].split(".")[0], 16), major=self.major,
                               minor=self.minor, multi_processor_count=132)

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
                     "get_device_properties", "get_per_process_memory_fraction",
                     "memory_stats", "memory_stats_as_nested_dict", "memory_snapshot"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name), raising=False)
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: self.has_context,
                            raising=False)
        if not self.has_fraction_getter:
            monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        return self
