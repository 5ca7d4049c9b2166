"""``probe(device)``: one memory snapshot, in bytes, with the source of each figure.

The host probe reads ``/proc`` and rlimits and needs no torch; torch (1.3-1.8 s
to import) is loaded only when a GPU backend has something to ask it, so
``oomguard probe`` on a CPU-only machine answers at once.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from oomguard.probes import host, nvml
from oomguard.probes.device import parse_device


@dataclass
class MemorySnapshot:
    """Memory of one device at one moment, in bytes. ``free_bytes`` is what a new allocation
    could still get (the smallest of the limits that apply); a figure that could not be
    measured is None, and ``sources`` names where each measured one came from."""

    device: str
    name: str
    available: bool
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_bytes: int | None = None
    other_processes_bytes: int | None = None
    sources: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_snapshot() -> MemorySnapshot:
    mem = host.host_memory()
    return MemorySnapshot(
        device="cpu", name=mem["name"], available=True, total_bytes=mem["total"],
        free_bytes=mem["free"], process_bytes=mem["process"], sources=mem["sources"],
        extra={"limited_by": mem["limited_by"], "cpus": host.cpu_count(),
               "budget": mem["budget"], "peak": mem["peak"]})


def _backend(name: str) -> ModuleType:
    """``oomguard.probes.cuda`` or ``.mps``: the torch-based backends are imported only when
    a GPU is asked about."""
    return importlib.import_module(f"oomguard.probes.{name}")


def _cuda_unavailable(label: str, torch_reason: str) -> MemorySnapshot:
    """Why CUDA is unusable, with NVML's view where it has one (e.g. a CPU-only torch on a GPU host)."""
    nv_reason, built = nvml.unavailable_reason(), _backend("cuda").torch_has_cuda()
    if nv_reason is not None:
        reason = (f"no NVIDIA driver (NVML: {nv_reason})" if built
                  else f"{torch_reason}; no NVIDIA driver either (NVML: {nv_reason})")
        return MemorySnapshot(device=label, name="", available=False, reason=reason)
    count = nvml.device_count()
    reason = f"{torch_reason}; NVML sees {count} NVIDIA GPU(s)"
    if count and not built:
        reason += ": install a CUDA build of torch"
    return MemorySnapshot(device=label, name="", available=False, reason=reason,
                          extra={"nvml_devices": count, "driver": nvml.driver_version()})


def _merge_nvml(snap: MemorySnapshot, nv: nvml.NvmlDevice, how: str, ident: dict[str, Any]) -> None:
    """Put NVML's measured figures into ``snap``, naming the API behind each. The total is what
    CUDA can use: NVML v2's ``total - reserved``, else (v1, or a MIG slice above it) torch's
    ``total_memory``, the free bytes less what NVML counts beyond it."""
    what = f"NVML {nv.memory_api}" + (f" (MIG {nv.mig_profile or 'slice'})"
                                      if nv.mig_index is not None else "")
    snap.free_bytes = nv.free
    snap.sources["free"] = f"{what} free"
    if nv.usable is not None and nv.usable > ident["total"]:
        # NVML counts memory CUDA cannot use (MIG slices): its free part is not free here.
        excess = nv.usable - ident["total"]
        snap.total_bytes, snap.free_bytes = ident["total"], max(0, nv.free - excess)
        snap.sources["total"] = ("torch.cuda.get_device_properties total_memory (below "
                                 f"{what} total - reserved)")
        snap.sources["free"] = f"{what} free - what CUDA cannot use of NVML's total"
    elif nv.usable is not None:
        snap.total_bytes = nv.usable
        snap.sources["total"] = f"{what} total - reserved"
    else:
        snap.total_bytes = ident["total"]
        snap.sources["total"] = ("torch.cuda.get_device_properties total_memory (NVML v1 total "
                                 "includes driver-reserved memory)")
    snap.process_bytes, snap.other_processes_bytes = nv.process_bytes, nv.other_processes_bytes
    api = nv.process_api or "NVML running processes"
    snap.sources.update({"process": f"{api}, this pid", "other_processes": f"{api}, other pids"})
    snap.extra.update({"nvml_index": nv.index, "nvml_mapped_by": how, "nvml_total": nv.total,
                       "nvml_reserved": nv.reserved, "nvml_used": nv.used,
                       "pid_matched": nv.pid_matched})
    if nv.unknown_pids:
        # NVML gave no size for these (no permission, containers): unknown, not 0 B.
        snap.extra["other_processes_unknown_pids"] = nv.unknown_pids
        snap.extra["other_processes_at_least"] = nv.other_processes_known_bytes
    if nv.mig_index is not None:
        snap.extra.update({"mig_profile": nv.mig_profile, "mig_index": nv.mig_index,
                           "mig_uuid": nv.uuid})


def _cuda_snapshot(index: int | None) -> MemorySnapshot:
    label = "cuda" if index is None else f"cuda:{index}"
    cuda = _backend("cuda")
    torch_reason = cuda.unavailable_reason()
    if torch_reason is not None:
        return _cuda_unavailable(label, torch_reason)
    idx = cuda.current_device() if index is None else index
    label = f"cuda:{idx}"
    count = cuda.device_count()
    if idx >= count:
        return MemorySnapshot(device=label, name="", available=False,
                              reason=f"{label} does not exist: torch sees {count} CUDA device(s)")
    ident, stats = cuda.identity(idx), cuda.allocator_stats(idx)
    nv, how = nvml.query_for_torch_index(idx, uuid=ident.get("uuid"),
                                         pci_bus_id=ident.get("pci_bus_id"))
    snap = MemorySnapshot(device=label, name=ident["name"], available=True, extra={
        **{k: ident[k] for k in ("uuid", "pci_bus_id") if k in ident}, **stats,
        "free_in_allocator_cache": stats["reserved"] - stats["allocated"]})
    snap.sources.update({"allocated": "torch.cuda.memory_allocated",
                         "reserved": "torch.cuda.memory_reserved",
                         "peak_allocated": "torch.cuda.max_memory_allocated",
                         "peak_reserved": "torch.cuda.max_memory_reserved"})
    if nv is not None:
        _merge_nvml(snap, nv, how, ident)
        if not nv.pid_matched and cuda.has_context(idx):
            # A context but no NVML entry for our pid: a PID namespace; say nothing wrong.
            snap.process_bytes = snap.other_processes_bytes = None
            snap.extra["note"] = "this pid is not in NVML's process list (PID namespace?)"
        elif not nv.pid_matched:
            snap.process_bytes = 0  # no context here yet: this process uses nothing
    else:
        # No NVML: cudaMemGetInfo (all processes; creates a context if there is none).
        snap.free_bytes, snap.total_bytes = cuda.mem_get_info(idx)
        snap.sources.update({"total": "torch.cuda.mem_get_info", "free": "torch.cuda.mem_get_info"})
        snap.extra["nvml"] = how
    snap.extra["limited_by"] = "device free"
    cap = stats["fraction_cap"]
    if snap.total_bytes is not None and cap < snap.total_bytes:
        # A per-process fraction (an oomguard budget) caps what the allocator may reserve.
        cap_free = max(0, cap - stats["reserved"])
        if snap.free_bytes is None or cap_free < snap.free_bytes:
            snap.free_bytes = cap_free
            snap.sources["free"] = "set_per_process_memory_fraction cap - reserved"
            snap.extra["limited_by"] = "per-process fraction"
    return snap


def _mps_snapshot() -> MemorySnapshot:
    mps = _backend("mps")
    reason = mps.unavailable_reason()
    if reason is not None:
        return MemorySnapshot(device="mps", name="", available=False, reason=reason)
    st = mps.stats()
    total = st["recommended_max"]
    source_total = "torch.mps.recommended_max_memory (Metal working-set size)"
    if total is None:  # older torch: unified memory, so the host's RAM is the ceiling
        total, source_total = host.host_memory()["total"], "host RAM (unified memory)"
    driver = st["driver_allocated"] or 0
    return MemorySnapshot(
        device="mps", name="Apple MPS", available=True, total_bytes=total,
        free_bytes=None if total is None else max(0, total - driver), process_bytes=driver,
        sources={"total": source_total, "free": "estimate: total - driver_allocated_memory",
                 "process": "torch.mps.driver_allocated_memory"},
        extra={"allocated": st["allocated"], "driver_allocated": driver})


def probe(device: Any = "cpu") -> MemorySnapshot:
    """Measure the memory of ``device`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``), in bytes; CUDA
    adds this process's allocator counters in ``extra``. A missing GPU or driver gives
    ``available=False`` and a ``reason``; another device string raises ``UsageError``."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return _cpu_snapshot()
    if kind == "mps":
        return _mps_snapshot()
    return _cuda_snapshot(index)


def probe_all() -> list[MemorySnapshot]:
    """The host, every CUDA device torch can see, and MPS where available. Where torch
    cannot use CUDA but NVML sees GPUs (a CPU-only torch), one unavailable ``cuda`` row
    says so; a host with no NVIDIA driver gets no CUDA row."""
    snaps = [_cpu_snapshot()]
    # Import torch only where CUDA could answer: already imported, an NVML GPU, or ROCm.
    if "torch" in sys.modules or nvml.device_count() > 0 or os.path.exists("/dev/kfd"):
        cuda = _backend("cuda")
        if cuda.unavailable_reason() is None:
            snaps += [_cuda_snapshot(i) for i in range(cuda.device_count())]
        elif nvml.device_count() > 0:
            snaps.append(_cuda_snapshot(None))
    if platform.system() == "Darwin" and _backend("mps").unavailable_reason() is None:
        snaps.append(_mps_snapshot())
    return snaps
