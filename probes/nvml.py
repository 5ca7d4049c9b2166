"""The NVML backend: what a physical NVIDIA GPU holds, all processes included, in bytes.

Measured as the driver sees it, other processes included. A missing library or driver is a
normal answer: a reason string, never a raise. Torch indices map to NVML's through
:mod:`oomguard.probes.nvml_ids`; a MIG slice is matched by its ``MIG-`` UUID and measured through
its own handle (its parent's bus id would report the whole card). Drivers before R510 lack the
``_v3`` process list, and 535.43-535.86 misfill it (``_v2`` is used there); a process whose
``usedGpuMemory`` is None is unknown, never 0 B.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oomguard.probes.nvml_ids import MigIdentity, match_mig, misparses_v3, nvml_index_for

log = logging.getLogger("oomguard.probes.nvml")

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "error": None, "module": None}


def _nvml() -> tuple[Any | None, str | None]:
    """(pynvml module, None) once NVML is initialised, else (None, reason). ``nvmlInit``
    runs at most once per process: a machine without a driver pays for the attempt once."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                import pynvml  # why: loaded once, on the first NVML question
            except ImportError as exc:  # the dependency is declared; be tolerant anyway
                _state["error"] = f"pynvml is not installed ({exc}); pip install nvidia-ml-py"
            else:
                try:
                    pynvml.nvmlInit()
                    _state["module"] = pynvml
                except pynvml.NVMLError as exc:
                    _state["error"] = f"{type(exc).__name__}: {exc}"
                except OSError as exc:  # a broken libnvidia-ml.so can fail at dlopen
                    _state["error"] = f"libnvidia-ml could not be loaded: {exc}"
            if _state["error"]:
                log.debug("NVML unavailable: %s", _state["error"])
        return _state["module"], _state["error"]


def unavailable_reason() -> str | None:
    """None when NVML works here, otherwise why not (one line)."""
    return _nvml()[1]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class NvmlDevice:
    """One GPU, or one MIG slice of it, as NVML measures it. Bytes; None = not reported.
    ``reserved`` (v2 API only): the driver-reserved part CUDA cannot use. ``process_bytes``:
    this process's, matched by pid. ``other_processes_bytes``: the others', None when any is
    unknown (``other_processes_known_bytes`` is then a lower bound)."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    total: int
    free: int
    used: int
    reserved: int | None = None
    memory_api: str = "nvmlDeviceGetMemoryInfo"
    process_api: str | None = None
    process_bytes: int | None = None
    other_processes_bytes: int | None = None
    other_processes_known_bytes: int = 0
    unknown_pids: list[int] = field(default_factory=list)
    pid_matched: bool = False
    processes: dict[int, int | None] = field(default_factory=dict)
    mig_index: int | None = None
    mig_profile: str | None = None

    @property
    def usable(self) -> int | None:
        """Bytes CUDA can use: ``total - reserved`` (v2 API), else None (unknown)."""
        return None if self.reserved is None else self.total - self.reserved


def _errors(nv: Any) -> tuple[type[BaseException], ...]:
    """What a pynvml call may raise for a driver answer; the mismatch error is no NVMLError."""
    mismatch = getattr(nv, "NVMLLibraryMismatchError", None)
    return (nv.NVMLError,) if mismatch is None else (nv.NVMLError, mismatch)


def _missing(nv: Any, exc: BaseException) -> bool:
    """Whether ``exc`` says this driver lacks the function (so an older version may work)."""
    kinds = tuple(getattr(nv, n) for n in ("NVMLLibraryMismatchError", "NVMLError_FunctionNotFound",
                                           "NVMLError_ArgumentVersionMismatch") if hasattr(nv, n))
    return isinstance(exc, kinds)


def _own_pids() -> set[int]:
    """This process's pid, in every PID namespace /proc shows (``NSpid``)."""
    pids = {os.getpid()}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    pids.update(int(p) for p in line.split()[1:])
    except (OSError, ValueError):
        pass
    return pids


def _ask(default: Any, ask: Callable[[Any], Any]) -> Any:
    """``ask(pynvml)``, or ``default`` where NVML is unavailable or the driver refuses."""
    nv, _ = _nvml()
    if nv is None:
        return default
    try:
        return ask(nv)
    except _errors(nv) as exc:
        log.debug("NVML query failed: %s", exc)
        return default


def device_count() -> int:
    """Number of GPUs NVML sees (0 where NVML is unavailable)."""
    return _ask(0, lambda nv: int(nv.nvmlDeviceGetCount()))


def identities() -> list[tuple[str, str]]:
    """``(uuid, pci_bus_id)`` of every NVML device, in NVML order (empty if unavailable)."""
    nv, _ = _nvml()
    if nv is None:
        return []
    out = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            out.append((_text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetPciInfo(h).busId)))
    except _errors(nv) as exc:
        log.debug("NVML identity query failed: %s", exc)
    return out


def mig_devices() -> list[MigIdentity]:
    """Every MIG device of every MIG-enabled GPU (empty without MIG or NVML)."""
    nv, _ = _nvml()
    if nv is None or not hasattr(nv, "nvmlDeviceGetMigMode"):  # a pynvml older than MIG
        return []
    out: list[MigIdentity] = []
    for i in range(device_count()):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            if nv.nvmlDeviceGetMigMode(h)[0] != getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
                continue
            slots = nv.nvmlDeviceGetMaxMigDeviceCount(h)
        except _errors(nv):  # NOT_SUPPORTED: a GPU without MIG
            continue
        for j in range(slots):
            try:
                mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                out.append(MigIdentity(_text(nv.nvmlDeviceGetUUID(mh)), i, j))
            except _errors(nv):  # NOT_FOUND: an empty slot
                continue
    return out


def _memory(nv: Any, handle: Any) -> tuple[int, int | None, int, int, str]:
    """(total, reserved or None, free, used, API name) in bytes: v2 where the driver has it."""
    version = getattr(nv, "nvmlMemory_v2", None)
    if version is not None:
        try:
            m = nv.nvmlDeviceGetMemoryInfo(handle, version=version)
            return int(m.total), int(m.reserved), int(m.free), int(m.used), \
                "nvmlDeviceGetMemoryInfo_v2"
        except TypeError:  # a pynvml without the version argument
            pass
        except _errors(nv) as exc:
            if not (_missing(nv, exc) or isinstance(exc, getattr(nv, "NVMLError_NotSupported", ()))):
                raise
    m = nv.nvmlDeviceGetMemoryInfo(handle)
    return int(m.total), None, int(m.free), int(m.used), "nvmlDeviceGetMemoryInfo"


_PROCESS_LISTS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")


def _processes(nv: Any, handle: Any) -> tuple[dict[int, int | None], str | None]:
    """pid -> used bytes for compute and graphics contexts (None where not reported),
    and the compute API that answered (None if none did)."""
    skip_v3 = misparses_v3(driver_version())
    procs: dict[int, int | None] = {}
    used_api: str | None = None
    for base in _PROCESS_LISTS:
        # v3 (R510+), v2 (R450+), then whatever the unversioned wrapper of this pynvml calls.
        names = [f"{base}_v2", base] if skip_v3 else [f"{base}_v3", f"{base}_v2", base]
        entries = None
        for name in names:
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                entries = fn(handle)
            except _errors(nv) as exc:
                log.debug("%s failed: %s", name, exc)
                if _missing(nv, exc):
                    continue
                break  # e.g. NOT_SUPPORTED / NO_PERMISSION: an older API will not do better
            if used_api is None and base == _PROCESS_LISTS[0]:
                used_api = name
            break
        for p in entries or ():
            used = getattr(p, "usedGpuMemory", None)
            pid = int(p.pid)
            # One process may be listed in both lists with the same context: keep the max.
            prev = procs.get(pid)
            procs[pid] = used if prev is None else max(prev, used if used is not None else 0)
    return procs, used_api


def _measure(nv: Any, dev: NvmlDevice, handle: Any) -> NvmlDevice:
    dev.total, dev.reserved, dev.free, dev.used, dev.memory_api = _memory(nv, handle)
    dev.processes, dev.process_api = _processes(nv, handle)
    mine = _own_pids()
    own = [b for pid, b in dev.processes.items() if pid in mine]
    dev.pid_matched = bool(own)
    dev.process_bytes = sum(b for b in own if b is not None) if own and None not in own else None
    dev.unknown_pids = sorted(p for p, b in dev.processes.items() if b is None and p not in mine)
    dev.other_processes_known_bytes = sum(b for p, b in dev.processes.items()
                                          if b is not None and p not in mine)
    dev.other_processes_bytes = None if dev.unknown_pids else dev.other_processes_known_bytes
    return dev


def query(nvml_index: int, mig_index: int | None = None) -> NvmlDevice | str:
    """Measure NVML device ``nvml_index`` (or its MIG slice ``mig_index``, through the slice's own
    handle; its profile from the name NVML gives it, ``"... MIG 1g.5gb"``, and ``index`` and
    ``pci_bus_id`` the parent's): an :class:`NvmlDevice`, or a reason string."""
    nv, reason = _nvml()
    if nv is None:
        return f"NVML: {reason}"
    try:
        parent = nv.nvmlDeviceGetHandleByIndex(nvml_index)
        h = parent if mig_index is None else nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, mig_index)
        name = _text(nv.nvmlDeviceGetName(h))
        profile = re.search(r"\bMIG\s+(\S+)", name) if mig_index is not None else None
        dev = NvmlDevice(
            index=nvml_index, name=name, uuid=_text(nv.nvmlDeviceGetUUID(h)),
            pci_bus_id=_text(nv.nvmlDeviceGetPciInfo(parent).busId), total=0, free=0, used=0,
            mig_index=mig_index, mig_profile=profile[1] if profile else None)
        return _measure(nv, dev, h)
    except _errors(nv) as exc:
        return f"NVML: {type(exc).__name__}: {exc}"


def query_for_torch_index(torch_index: int, *, uuid: str | None = None,
                          pci_bus_id: str | None = None) -> tuple[NvmlDevice | None, str]:
    """NVML's view of torch's ``cuda:torch_index``: (device or None, how it was mapped / why
    not), from torch's ``uuid`` and ``pci_bus_id`` where known. A MIG slice is found by its
    UUID; a device that maps only to a MIG-enabled parent is not reported as the whole card."""
    reason = unavailable_reason()
    if reason is not None:
        return None, f"NVML: {reason}"
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    migs = mig_devices()
    mig, how = match_mig(migs, torch_index, uuid=uuid, cuda_visible_devices=cvd)
    if mig is None:
        index, how = nvml_index_for(torch_index, identities(), cuda_visible_devices=cvd,
                                    uuid=uuid, pci_bus_id=pci_bus_id)
        if index is None:
            return None, how
        if any(m.parent_index == index for m in migs):
            return None, (f"NVML GPU {index} is in MIG mode and cuda:{torch_index} matches none "
                          f"of its MIG UUIDs: its slice is unknown (CUDA_VISIBLE_DEVICES=MIG-<uuid> "
                          "names it)")
    result = query(index) if mig is None else query(mig.parent_index, mig.mig_index)
    return (None, result) if isinstance(result, str) else (result, how)


def driver_version() -> str | None:
    return _ask(None, lambda nv: _text(nv.nvmlSystemGetDriverVersion()))
