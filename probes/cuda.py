"""The torch CUDA allocator backend: what *this process's* caching allocator holds, in bytes,
measured. Gated on ``torch.cuda.is_available()``: on a CPU-only build ``memory_allocated()``
returns 0, which would be a lie.
"""

from __future__ import annotations

from typing import Any

import torch

from oomguard.probes.nvml_ids import pci_bus_id_from_ints


def unavailable_reason() -> str | None:
    """None when torch can use a CUDA device here, else why not (one line)."""
    if not torch_has_cuda():
        return f"torch {torch.__version__} was built without CUDA"
    try:
        if torch.cuda.is_available():
            return None
    except Exception as exc:  # noqa: BLE001 - a broken driver may raise here; report it
        return f"torch.cuda.is_available() failed: {exc}"
    return "torch.cuda.is_available() is False (no usable NVIDIA driver or device)"


def _require_cuda() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)


def torch_has_cuda() -> bool:
    """Whether this torch build was compiled for CUDA or ROCm at all."""
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def current_device() -> int:
    return torch.cuda.current_device()


def device_count() -> int:
    """Number of CUDA devices torch can see (after ``CUDA_VISIBLE_DEVICES``); 0 without CUDA."""
    return torch.cuda.device_count() if unavailable_reason() is None else 0


def identity(index: int) -> dict[str, Any]:
    """Name, total bytes, UUID and PCI bus id of ``cuda:index`` as torch reports them
    (without the keys whose property this torch build lacks)."""
    props = torch.cuda.get_device_properties(index)
    out: dict[str, Any] = {"name": props.name, "total": int(props.total_memory)}
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        out["uuid"] = str(uuid)
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    if bus is not None and dev is not None:
        out["pci_bus_id"] = pci_bus_id_from_ints(int(getattr(props, "pci_domain_id", 0)),
                                                 int(bus), int(dev))
    return out


def has_context(index: int) -> bool:
    """Whether this process already has a CUDA context on ``cuda:index`` (``mem_get_info``
    would create one: hundreds of MiB of device memory, avoided where NVML can answer)."""
    check = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return bool(check(index)) if check is not None else torch.cuda.is_initialized()


def mem_get_info(index: int) -> tuple[int, int]:
    """(free, total) bytes of ``cuda:index`` from ``cudaMemGetInfo``: measured, all processes.
    Creates a CUDA context on the device if there is none. ``RuntimeError`` without CUDA."""
    _require_cuda()
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def async_backend() -> bool:
    """Whether the allocator is ``backend:cudaMallocAsync``. ``get_allocator_backend`` reads
    ``CUDACachingAllocator::name()`` (torch/csrc/cuda/Module.cpp): no CUDA call, no context."""
    getter = getattr(torch.cuda, "get_allocator_backend", None)
    return getter is not None and getter() == "cudaMallocAsync"


def memory_fraction(index: int) -> float | None:
    """The per-process memory fraction in force on ``cuda:index``, 1.0 for "no limit"; None
    where torch cannot read it (torch < 2.6). Creates no context: under
    ``backend:cudaMallocAsync`` torch's getter would create one, and without one no fraction
    can have been set (1.0 unread); its "no fraction" reads about 2e8, also 1.0."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return None
    if async_backend() and not has_context(index):
        return 1.0
    return min(float(getter(index)), 1.0)


def alloc_retries(index: int) -> int:
    """The caching allocator's ``num_alloc_retries`` on ``cuda:index`` (measured, a count since
    the process started): how often a ``cudaMalloc`` failed and the allocator freed its whole
    cache to ask again; rising on every step means the step runs at the edge. 0 under
    ``backend:cudaMallocAsync``."""
    return int(torch.cuda.memory_stats(index).get("num_alloc_retries", 0))


def oom_count(index: int) -> int:
    """The caching allocator's ``num_ooms`` on ``cuda:index`` (measured, a count since the
    process started): every OOM it raised, whoever caught it (the user's code, or torch's own,
    as cuDNN does trying a convolution's next algorithm). 0 under ``backend:cudaMallocAsync``.
    Read from the nested stats: the flattened ones cost more (measured, 73 us a call on an
    H200), and this is read twice per executor attempt."""
    return int(torch.cuda.memory_stats_as_nested_dict(index).get("num_ooms", 0))


def unreported_oom_retries(index: int) -> int:
    """How many of the caching allocator's last-resort retries on ``cuda:index`` (the cap or
    the device was reached) were not followed by a reported OOM: ``num_alloc_retries -
    num_ooms``. An OOM whose report's NVML query fails counts the retry but not the OOM; a
    retry that then succeeded counts too. 0 under ``backend:cudaMallocAsync``."""
    stats = torch.cuda.memory_stats(index)
    return max(0, int(stats.get("num_alloc_retries", 0)) - int(stats.get("num_ooms", 0)))


def allocator_stats(index: int) -> dict[str, int]:
    """Measured bytes of this process's caching allocator on ``cuda:index``: ``allocated``,
    ``reserved``, ``peak_allocated``, ``peak_reserved`` and ``fraction_cap`` (the cap of
    ``set_per_process_memory_fraction``; the device's total when none). Creates no context.
    ``RuntimeError`` without CUDA."""
    _require_cuda()
    total = int(torch.cuda.get_device_properties(index).total_memory)
    fraction = memory_fraction(index)
    return {"allocated": int(torch.cuda.memory_allocated(index)),
            "reserved": int(torch.cuda.memory_reserved(index)),
            "peak_allocated": int(torch.cuda.max_memory_allocated(index)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(index)),
            "fraction_cap": int((1.0 if fraction is None else fraction) * total)}
