"""A fake ``pynvml`` module: nvidia-ml-py 13.615's Python API over a configurable driver.

Follows nvidia-ml-py 13.615.71 ``pynvml.py`` (the installed dependency): the
exception classes, constants and ctypes structs are the real module's own
(``NVMLError`` and its per-code subclasses such as ``NVMLError_NotSupported``
and ``NVMLError_FunctionNotFound``; ``NVMLLibraryMismatchError``, which is a
plain ``Exception``, not an ``NVMLError``; ``c_nvmlMemory_t``,
``c_nvmlMemory_v2_t``, ``c_nvmlProcessInfo_v2_t``). Only the C library is
replaced; each function keeps the real name and signature and reproduces what
the real wrapper does with the driver's answer:

- ``_nvmlGetFunctionPointer`` raises ``NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)``
  for a symbol the driver lacks; ``@throwOnVersionMismatch`` (the real
  decorator) turns that into ``NVMLLibraryMismatchError`` for the unversioned
  ``nvmlDeviceGet{Compute,Graphics}RunningProcesses``.
- The running-process wrappers return ``nvmlStructToFriendlyObject`` of each
  ``c_nvmlProcessInfo_v2_t`` read from the driver's buffer, with
  ``usedGpuMemory`` None where the driver wrote ``NVML_VALUE_NOT_AVAILABLE``.
  Drivers 535.43-535.86 wrote the 32-byte v3 struct into ``_v3``'s buffer, which
  pynvml reads with the 24-byte v2 stride: the fake writes real v3 structs into
  the real buffer type, so the misparse is the real one.
- ``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)`` calls
  ``nvmlDeviceGetMemoryInfo_v2`` (total, reserved, free, used with
  total = reserved + used + free); the v1 call reports total and used with the
  reserved part included.
- ``nvmlDeviceGetHandleByPciBusId`` (the ``_v2`` C call; what torch's allocator uses in its
  OOM path): the physical GPU at that bus id; on a MIG card that is the parent, which every
  slice shares.
- Process queries where the driver refuses them (nvml.h, ``nvmlDeviceGetComputeRunningProcesses_v3``:
  "In MIG mode, if device handle is provided, the API returns aggregate information, only if
  the caller has appropriate privileges. Per-instance information can be queried by using
  specific MIG device handles."): a MIG parent's handle answers ``NVML_ERROR_NO_PERMISSION``
  unless ``FakeDriver.privileged`` (root) (the code is an assumption: the note names no
  code; any failure fails torch's assert alike); ``FakeGpu.process_error`` refuses the queries on
  any handle of that GPU with the given code (WSL2 and some containers answer
  ``NVML_ERROR_NOT_SUPPORTED``). ``FakeDriver.init_error`` makes ``nvmlInit`` fail with that
  code (a container without the driver's libraries mounted, ``NVML_ERROR_DRIVER_NOT_LOADED``).
- Per-process memory inside a container: the driver lists the process with
  ``usedGpuMemory = NVML_VALUE_NOT_AVAILABLE`` (pynvml: None), as above.
- MIG: ``nvmlDeviceGetMigMode`` -> [current, pending] (``NVMLError_NotSupported``
  on a GPU without MIG), ``nvmlDeviceGetMaxMigDeviceCount``,
  ``nvmlDeviceGetMigDeviceHandleByIndex`` (``NVMLError_NotFound`` for an empty
  slot), ``MIG-`` UUIDs (R470+ form) and MIG device names "<GPU name> MIG <profile>"
  (the name format is an assumption: NVML's documentation does not print one).

Driver generations, chosen by ``FakeDriver.version``: before R510 no ``_v3``
process queries and no ``nvmlDeviceGetMemoryInfo_v2`` (both arrived in 510);
535.43-535.86 the v3-struct misparse; anything else current.
"""

from __future__ import annotations

import ctypes
import re
import types
from dataclasses import dataclass, field

import pynvml as real  # the real module: classes and decorators only; no library is loaded

MiB = 1024**2
GiB = 1024**3


class c_nvmlProcessInfo_v3_t(ctypes.Structure):  # noqa: N801 - nvml.h's name
    """nvml.h (535.43-535.86) ``nvmlProcessInfo_v3_t``: v2 plus ``usedGpuCcProtectedMemory``."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint),
                ("usedGpuCcProtectedMemory", ctypes.c_ulonglong)]


@dataclass
class FakeMig:
    """One MIG device: ``profile`` like ``"1g.5gb"``, sizes in bytes, processes (pid, bytes or None)."""

    uuid: str
    profile: str
    total: int
    reserved: int = 0
    used: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class FakeGpu:
    """One physical GPU. ``total`` is the board's memory (NVML's total); ``reserved`` the
    driver-reserved part; ``used`` what allocations hold. ``migs`` non-empty means MIG mode
    is on; ``mig_slots`` is the GPU's maximum MIG device count (7 on an A100; 0: no MIG)."""

    uuid: str
    pci_bus_id: str  # NVML's form, "00000000:3B:00.0"
    name: str = "NVIDIA A100-SXM4-40GB"
    total: int = 40 * GiB
    reserved: int = 0
    used: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    mig_slots: int = 0
    migs: dict[int, FakeMig] = field(default_factory=dict)  # slot -> device
    process_error: int | None = None  # NVML_ERROR_* the process queries answer (WSL2: NOT_SUPPORTED)


@dataclass
class FakeDriver:
    version: str = "550.54.15"
    gpus: list[FakeGpu] = field(default_factory=list)
    privileged: bool = False  # root: a MIG parent's process query answers (module docstring)
    init_error: int | None = None  # NVML_ERROR_* that nvmlInit answers

    def generation(self) -> tuple[int, int]:
        m = re.match(r"^(\d+)\.(\d+)", self.version)
        assert m is not None
        return int(m[1]), int(m[2])


@dataclass(frozen=True)
class _Handle:
    """Stands for ``c_nvmlDevice_t``: a GPU, or one MIG device of it."""

    gpu: int
    mig: int | None = None


def _err(code: int) -> real.NVMLError:
    return real.NVMLError(code)  # the real __new__ maps the code to its subclass


def make_fake_pynvml(driver: FakeDriver) -> types.ModuleType:
    """A module with pynvml's names, answering from ``driver``."""
    m = types.ModuleType("pynvml")
    for name in dir(real):  # constants, exception classes, structs, helpers
        if name.startswith(("NVML", "nvmlMemory", "c_nvml", "NVMLError")) or name in (
                "nvmlStructToFriendlyObject", "nvmlFriendlyObject", "nvmlExceptionClass"):
            setattr(m, name, getattr(real, name))
    lib = _Library(driver)
    for name in dir(_Library):
        if name.startswith("nvml"):
            setattr(m, name, getattr(lib, name))
    for kind in ("Compute", "Graphics"):
        v3, v2, unversioned = _process_queries(lib, kind)
        setattr(m, f"nvmlDeviceGet{kind}RunningProcesses_v3", v3)
        setattr(m, f"nvmlDeviceGet{kind}RunningProcesses_v2", v2)
        setattr(m, f"nvmlDeviceGet{kind}RunningProcesses", unversioned)
    return m


class _Library:
    """The driver's answers as pynvml's wrappers return them: each ``nvml*`` method is the
    pynvml function of that name."""

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        major_minor = driver.generation()
        self.has_v3 = major_minor >= (510, 0)
        self.v3_struct = (535, 43) <= major_minor <= (535, 86)

    def symbol(self, name: str) -> None:
        """``_nvmlGetFunctionPointer``: the driver lacks the symbol -> FUNCTION_NOT_FOUND."""
        if not self.has_v3 and (name.endswith("_v3") or name == "nvmlDeviceGetMemoryInfo_v2"):
            raise _err(real.NVML_ERROR_FUNCTION_NOT_FOUND)

    def gpu(self, h: _Handle) -> FakeGpu:
        return self.driver.gpus[h.gpu]

    def node(self, h: _Handle) -> FakeGpu | FakeMig:
        return self.gpu(h) if h.mig is None else self.gpu(h).migs[h.mig]

    def nvmlInit(self) -> None:
        if self.driver.init_error is not None:
            raise _err(self.driver.init_error)

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> _Handle:  # noqa: N803
        bus = pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId
        for i, g in enumerate(self.driver.gpus):
            if g.pci_bus_id.lower() == bus.lower():
                return _Handle(i)
        raise _err(real.NVML_ERROR_NOT_FOUND)

    def refuse_processes(self, h: _Handle) -> None:
        """The driver's refusals of a process query (module docstring)."""
        g = self.gpu(h)
        if g.process_error is not None:
            raise _err(g.process_error)
        if h.mig is None and g.migs and not self.driver.privileged:
            raise _err(real.NVML_ERROR_NO_PERMISSION)

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver.version

    def nvmlDeviceGetCount(self) -> int:
        return len(self.driver.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self.driver.gpus):
            raise _err(real.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        g = self.gpu(handle)
        return g.name if handle.mig is None else f"{g.name} MIG {g.migs[handle.mig].profile}"

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self.node(handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> object:
        if handle.mig is not None:
            raise _err(real.NVML_ERROR_NOT_SUPPORTED)
        info = real.nvmlPciInfo_t()  # what nvmlDeviceGetPciInfo_v3 fills
        info.busId = self.gpu(handle).pci_bus_id.encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> object:
        n = self.node(handle)
        free = n.total - n.reserved - n.used
        if not version:
            mem = real.c_nvmlMemory_t()
            mem.total, mem.free, mem.used = n.total, free, n.used + n.reserved
            return mem
        self.symbol("nvmlDeviceGetMemoryInfo_v2")
        mem = real.c_nvmlMemory_v2_t()
        mem.version = version
        mem.total, mem.reserved, mem.free, mem.used = n.total, n.reserved, free, n.used
        return mem

    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        g = self.gpu(device)
        if g.mig_slots == 0 or device.mig is not None:
            raise _err(real.NVML_ERROR_NOT_SUPPORTED)
        mode = real.NVML_DEVICE_MIG_ENABLE if g.migs else real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: _Handle) -> int:
        if self.gpu(device).mig_slots == 0:
            raise _err(real.NVML_ERROR_NOT_SUPPORTED)
        return self.gpu(device).mig_slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: _Handle, index: int) -> _Handle:
        g = self.gpu(device)
        if not g.migs or not 0 <= index < g.mig_slots:
            raise _err(real.NVML_ERROR_INVALID_ARGUMENT)
        if index not in g.migs:
            raise _err(real.NVML_ERROR_NOT_FOUND)
        return _Handle(device.gpu, index)


def _read(entries: list[tuple[int, int | None]], struct: type) -> list:
    """The real wrapper's second call: the driver fills a ``c_nvmlProcessInfo_v2_t``
    array sized count * 2 + 5 with ``struct`` records; pynvml reads ``count`` v2 records."""
    if not entries:
        return []
    buf = (real.c_nvmlProcessInfo_v2_t * (len(entries) * 2 + 5))()
    records = (struct * len(entries)).from_buffer(buf)
    for rec, (pid, used) in zip(records, entries, strict=True):
        rec.pid = pid
        rec.usedGpuMemory = real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
    procs = []
    for i in range(len(entries)):
        obj = real.nvmlStructToFriendlyObject(buf[i])
        if obj.usedGpuMemory == real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
            obj.usedGpuMemory = None
        procs.append(obj)
    return procs


def _process_queries(lib: _Library, kind: str) -> tuple:
    """pynvml's ``_v3``, ``_v2`` and unversioned ``nvmlDeviceGet{kind}RunningProcesses``."""

    def entries(handle: _Handle) -> list[tuple[int, int | None]]:
        n = lib.node(handle)
        return n.processes if kind == "Compute" else getattr(n, "graphics", [])

    def v3(handle: _Handle) -> list:
        lib.symbol(f"nvmlDeviceGet{kind}RunningProcesses_v3")
        lib.refuse_processes(handle)
        return _read(entries(handle), c_nvmlProcessInfo_v3_t if lib.v3_struct
                     else real.c_nvmlProcessInfo_v2_t)

    def v2(handle: _Handle) -> list:
        lib.refuse_processes(handle)
        return _read(entries(handle), real.c_nvmlProcessInfo_v2_t)

    def unversioned(handle: _Handle) -> list:
        return v3(handle)

    unversioned.__name__ = f"nvmlDeviceGet{kind}RunningProcesses"  # the decorator quotes it
    return v3, v2, real.throwOnVersionMismatch(unversioned)


# --- torch.cuda as the probe reads it (torch 2.13) ----------------------------


@dataclass
class FakeCudaDevice:
    """What torch reports for one visible CUDA device: ``_CudaDeviceProperties`` fields,
    ``torch.cuda.mem_get_info`` (free, total) bytes and the caching allocator's counters."""

    name: str
    total_memory: int  # cudaDeviceProp.totalGlobalMem: what CUDA can use
    uuid: str  # printed bare, as str(props.uuid) does
    pci_domain_id: int = 0
    pci_bus_id: int = 0
    pci_device_id: int = 0
    free: int = 0
    reserved: int = 0
    allocated: int = 0
    fraction: float = 1.0
    context: bool = True
    alloc_retries: int = 0  # memory_stats num_alloc_retries
    ooms: int = 0  # memory_stats num_ooms


def install_fake_torch_cuda(monkeypatch: object, devices: list[FakeCudaDevice]) -> None:
    """Make ``torch.cuda`` answer for ``devices`` (torch 2.13 names and return types)."""
    import torch

    def props(i: int) -> object:
        d = devices[i]
        return types.SimpleNamespace(
            name=d.name, total_memory=d.total_memory, uuid=d.uuid, pci_domain_id=d.pci_domain_id,
            pci_bus_id=d.pci_bus_id, pci_device_id=d.pci_device_id)

    mp = monkeypatch
    mp.setattr(torch.version, "cuda", "12.8")
    mp.setattr(torch.cuda, "is_available", lambda: True)
    mp.setattr(torch.cuda, "is_initialized", lambda: True)
    mp.setattr(torch.cuda, "device_count", lambda: len(devices))
    mp.setattr(torch.cuda, "current_device", lambda: 0)
    mp.setattr(torch.cuda, "get_device_properties", props)
    mp.setattr(torch.cuda, "mem_get_info",
               lambda i=0: (devices[i].free, devices[i].total_memory))
    mp.setattr(torch.cuda, "memory_reserved", lambda i=0: devices[i].reserved)
    mp.setattr(torch.cuda, "max_memory_reserved", lambda i=0: devices[i].reserved)
    mp.setattr(torch.cuda, "memory_allocated", lambda i=0: devices[i].allocated)
    mp.setattr(torch.cuda, "max_memory_allocated", lambda i=0: devices[i].allocated)
    mp.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=0: devices[i].fraction)
    mp.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: devices[i].context, raising=False)
    mp.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    mp.setattr(torch.cuda, "memory_stats", lambda i=0: {
        "allocated_bytes.all.current": devices[i].allocated,
        "reserved_bytes.all.current": devices[i].reserved,
        "num_alloc_retries": devices[i].alloc_retries, "num_ooms": devices[i].ooms})
