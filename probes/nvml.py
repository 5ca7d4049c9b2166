"""The NVML backend: what a physical NVIDIA GPU holds, all processes included, in bytes.

NVML (``pynvml``, distribution ``nvidia-ml-py``) sees the device as the driver
does: total, free and used memory of the whole GPU, and the memory of every
process with a context on it. These are *measured* figures (driver-side), so
``free`` already accounts for other processes, which torch's allocator cannot
see.

A missing library or driver (``NVMLError_LibraryNotFound``,
``NVMLError_DriverNotLoaded``, any ``NVMLError``) is a normal answer: the
functions here return a reason string, they do not raise.

NVML numbers devices in PCI bus order and ignores ``CUDA_VISIBLE_DEVICES``;
torch numbers the visible devices only, in CUDA's order. :func:`map_visible_devices`
(pure, testable without a GPU) translates torch indices to NVML indices.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("oomguard.probes.nvml")

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "error": None, "module": None}


def _nvml() -> tuple[Any | None, str | None]:
    """(pynvml module, None) once NVML is initialised, else (None, reason).

    ``nvmlInit`` runs at most once per process: a failure is remembered, so a
    machine without a driver pays for the attempt once.
    """
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


# ---------------------------------------------------------------------------
# Identity and CUDA_VISIBLE_DEVICES mapping (pure functions)
# ---------------------------------------------------------------------------

_PCI_RE = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.[0-9a-fA-F]+)?$")


def normalize_pci_bus_id(bus_id: str) -> str | None:
    """``"00000000:3B:00.0"`` or ``"0000:3b:00.0"`` -> ``"0000:3b:00"`` (None if unparsable).

    NVML writes an 8-digit domain, CUDA a 4-digit one; the PCI function is
    dropped because a GPU is one function.
    """
    m = _PCI_RE.match(bus_id.strip())
    if m is None:
        return None
    domain, bus, dev = (int(g, 16) if g else 0 for g in m.groups())
    return f"{domain:04x}:{bus:02x}:{dev:02x}"


def pci_bus_id_from_ints(domain: int, bus: int, device: int) -> str:
    """The normalised bus id from torch's ``pci_domain_id``/``pci_bus_id``/``pci_device_id``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def normalize_uuid(uuid: str) -> str:
    """Lower-case UUID without the ``GPU-`` prefix (torch prints it bare, NVML with it)."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def map_visible_devices(cuda_visible_devices: str | None,
                        nvml_devices: Sequence[tuple[str, str]]) -> list[int]:
    """NVML indices of the devices CUDA exposes, in torch's order (torch index -> position).

    ``cuda_visible_devices`` is the environment variable's value (None when
    unset: every device, in NVML's order). ``nvml_devices`` lists ``(uuid,
    pci_bus_id)`` per NVML index. Entries are integers (NVML/PCI order, which
    is CUDA's order only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical
    GPUs; prefer UUIDs or :func:`match_device`), ``GPU-`` UUIDs or unique UUID
    prefixes. As CUDA does, parsing stops at the first entry that names no
    device, and a device is listed at most once. ``MIG-`` entries name no
    whole GPU and stop the list too.
    """
    n = len(nvml_devices)
    if cuda_visible_devices is None:
        return list(range(n))
    uuids = [normalize_uuid(u) for u, _ in nvml_devices]
    out: list[int] = []
    for raw in cuda_visible_devices.split(","):
        token = raw.strip()
        index: int | None = None
        if re.fullmatch(r"[0-9]+", token):
            index = int(token) if int(token) < n else None
        elif token.lower().startswith("gpu-"):
            want = normalize_uuid(token)
            hits = [i for i, u in enumerate(uuids) if u.startswith(want)]
            index = hits[0] if len(hits) == 1 else None
        if index is None or index in out:
            break
        out.append(index)
    return out


def match_device(nvml_devices: Sequence[tuple[str, str]], *, uuid: str | None = None,
                 pci_bus_id: str | None = None) -> int | None:
    """The NVML index whose UUID (preferred) or PCI bus id equals the given one, or None."""
    if uuid:
        want = normalize_uuid(uuid)
        for i, (u, _) in enumerate(nvml_devices):
            if normalize_uuid(u) == want:
                return i
    if pci_bus_id:
        want_pci = normalize_pci_bus_id(pci_bus_id)
        for i, (_, p) in enumerate(nvml_devices):
            if want_pci is not None and normalize_pci_bus_id(p) == want_pci:
                return i
    return None


def nvml_index_for(torch_index: int, nvml_devices: Sequence[tuple[str, str]], *,
                   cuda_visible_devices: str | None, uuid: str | None = None,
                   pci_bus_id: str | None = None) -> tuple[int | None, str]:
    """Map torch's ``cuda:torch_index`` to an NVML index; return (index or None, how).

    Tries torch's own identity of the device first (UUID, then PCI bus id),
    which is exact whatever ``CUDA_DEVICE_ORDER`` is; falls back to parsing
    ``CUDA_VISIBLE_DEVICES``. ``how`` names the method or why it failed.
    """
    by_id = match_device(nvml_devices, uuid=uuid, pci_bus_id=pci_bus_id)
    if by_id is not None:
        how = "uuid" if uuid and normalize_uuid(nvml_devices[by_id][0]) == normalize_uuid(uuid) \
            else "pci bus id"
        return by_id, how
    visible = map_visible_devices(cuda_visible_devices, nvml_devices)
    if 0 <= torch_index < len(visible):
        src = "CUDA_VISIBLE_DEVICES" if cuda_visible_devices is not None else "index order"
        return visible[torch_index], src
    return None, (f"cuda:{torch_index} is not among the {len(visible)} device(s) NVML "
                  f"matches to CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}")


# ---------------------------------------------------------------------------
# Queries (need a driver)
# ---------------------------------------------------------------------------


@dataclass
class NvmlDevice:
    """One physical GPU as NVML measures it. Sizes in bytes; None = not reported.

    ``process_bytes`` is this process's usage (matched by pid; in a container
    with its own PID namespace NVML reports host pids and the match can fail,
    then ``pid_matched`` is False). ``other_processes_bytes`` sums the others.
    """

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    total: int
    free: int
    used: int
    process_bytes: int | None = None
    other_processes_bytes: int | None = None
    pid_matched: bool = False
    processes: dict[int, int | None] = field(default_factory=dict)


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


def device_count() -> int:
    """Number of GPUs NVML sees (0 where NVML is unavailable)."""
    nv, _ = _nvml()
    if nv is None:
        return 0
    try:
        return int(nv.nvmlDeviceGetCount())
    except nv.NVMLError as exc:
        log.debug("nvmlDeviceGetCount failed: %s", exc)
        return 0


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
    except nv.NVMLError as exc:
        log.debug("NVML identity query failed: %s", exc)
    return out


def _processes(nv: Any, handle: Any) -> dict[int, int | None]:
    """pid -> used bytes for compute and graphics contexts (None where not reported)."""
    procs: dict[int, int | None] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        fn = getattr(nv, getter, None)
        if fn is None:
            continue
        try:
            entries = fn(handle)
        except nv.NVMLError as exc:  # e.g. NOT_SUPPORTED on some vGPUs / MIG
            log.debug("%s failed: %s", getter, exc)
            continue
        for p in entries:
            used = getattr(p, "usedGpuMemory", None)
            # One process may be listed in both lists with the same context: keep the max.
            prev = procs.get(int(p.pid))
            procs[int(p.pid)] = used if prev is None else max(prev, used or 0)
    return procs


def query(nvml_index: int) -> NvmlDevice | str:
    """Measure NVML device ``nvml_index``: an :class:`NvmlDevice`, or a reason string."""
    nv, reason = _nvml()
    if nv is None:
        return f"NVML: {reason}"
    try:
        h = nv.nvmlDeviceGetHandleByIndex(nvml_index)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        dev = NvmlDevice(
            index=nvml_index, name=_text(nv.nvmlDeviceGetName(h)),
            uuid=_text(nv.nvmlDeviceGetUUID(h)), pci_bus_id=_text(nv.nvmlDeviceGetPciInfo(h).busId),
            total=int(mem.total), free=int(mem.free), used=int(mem.used),
        )
        procs = _processes(nv, h)
    except nv.NVMLError as exc:
        return f"NVML: {type(exc).__name__}: {exc}"
    mine = _own_pids()
    dev.processes = procs
    dev.pid_matched = bool(mine & procs.keys())
    known = {pid: b for pid, b in procs.items() if b is not None}
    dev.process_bytes = sum(b for pid, b in known.items() if pid in mine) if dev.pid_matched else None
    dev.other_processes_bytes = sum(b for pid, b in known.items() if pid not in mine)
    return dev


def query_for_torch_index(torch_index: int, *, uuid: str | None = None,
                          pci_bus_id: str | None = None) -> tuple[NvmlDevice | None, str]:
    """NVML's view of torch's ``cuda:torch_index``: (device or None, how it was mapped / why not).

    ``uuid`` and ``pci_bus_id`` are torch's identity of the device, where known.
    """
    reason = unavailable_reason()
    if reason is not None:
        return None, f"NVML: {reason}"
    ids = identities()
    index, how = nvml_index_for(torch_index, ids, cuda_visible_devices=os.environ.get(
        "CUDA_VISIBLE_DEVICES"), uuid=uuid, pci_bus_id=pci_bus_id)
    if index is None:
        return None, how
    result = query(index)
    if isinstance(result, str):
        return None, result
    return result, how


def driver_version() -> str | None:
    """The NVIDIA driver version, or None."""
    nv, _ = _nvml()
    if nv is None:
        return None
    try:
        return _text(nv.nvmlSystemGetDriverVersion())
    except nv.NVMLError:
        return None
