"""Peak memory of one piece of work, per device, in bytes, measured (:class:`PeakMeter`)."""

from __future__ import annotations

import torch

from oomguard.probes import cuda, host
from oomguard.probes.sampler import Sampler


def cuda_async_backend() -> bool:
    """Whether CUDA runs ``backend:cudaMallocAsync`` (``torch.cuda.get_allocator_backend``)."""
    return torch.cuda.is_available() and cuda.async_backend()


def held_bytes(device: str | torch.device) -> int:
    """Bytes this process holds on a GPU ``device``, in the units its allocator's cap counts,
    measured after the cache is emptied (cached blocks are freed before the cap is met)."""
    dev = torch.device(device)
    if dev.type == "mps":
        torch.mps.empty_cache()
        return int(torch.mps.driver_allocated_memory())
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    current = torch.cuda.memory_allocated if cuda_async_backend() else torch.cuda.memory_reserved
    return int(current(dev))


def _host_source() -> str:
    """What a CPU peak is, on this OS (Linux: resettable VmHWM; elsewhere a lifetime peak)."""
    method = host.peak_method()
    if method.source is None:
        return f"unmeasured: {method.reason}"
    if method.resettable:
        return f"{method.source} - resident at reset"
    return (f"{method.source} - resident at reset (not resettable: an upper bound for work "
            "that stays below an earlier peak)")


# Seconds between two reads of the data segment: well under 1% of a core, and far shorter than
# a training step's peak lasts (measured: docs/measurements.md#cpu-limit-units).
DATA_INTERVAL_S = 0.0005


class PeakMeter:
    """Measures the peak bytes a piece of work adds on ``device``: ``reset()`` before the
    work, ``read()`` after it gives the peak above what was in use at reset, measured. On the
    CPU the resident high-water mark (``VmHWM`` after ``clear_refs``; untouched pages do not
    count); on CUDA ``max_memory_reserved`` (``max_memory_allocated`` under
    ``backend:cudaMallocAsync``, whose cap counts bytes in use), the units the allocator's
    cap counts; on MPS the driver's allocated bytes (no peak kept there: a lower bound). With
    ``limit_units`` on the CPU it also samples ``VmData`` (what a CPU budget counts) for
    :meth:`limit_read`."""

    def __init__(self, device: str | torch.device = "cpu", limit_units: bool = False) -> None:
        self.device = torch.device(device)
        self.baseline = 0
        self._data: host.DataSize | None = None
        self._sampler: Sampler | None = None
        if limit_units and self.device.type == "cpu":
            self._data = host.DataSize()
            self._sampler = Sampler(self._data.read, DATA_INTERVAL_S, name="oomguard-vmdata")
        self.source = {
            "cpu": _host_source(),
            "cuda": ("torch.cuda.max_memory_allocated - allocated at reset (cudaMallocAsync)"
                     if self.device.type == "cuda" and cuda_async_backend()
                     else "torch.cuda.max_memory_reserved - reserved at reset"),
            "mps": "torch.mps.driver_allocated_memory delta (lower bound)",
        }.get(self.device.type, "unmeasured")

    def reset(self) -> int:
        """Start a measurement; return the baseline in bytes."""
        kind = self.device.type
        if kind == "cpu":
            # None: this OS gives no resident size (the source says "unmeasured")
            self.baseline = host.reset_peak() or 0
            if self._sampler is not None:
                try:
                    self._sampler.start()
                except RuntimeError:  # no room left to start its thread: close what it opened
                    self._data.close()  # type: ignore[union-attr]
                    raise
        elif kind == "cuda" and torch.cuda.is_available():
            # Empty the cache (cached blocks hide a peak), then reset the peak.
            self.baseline = held_bytes(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif kind == "mps" and torch.backends.mps.is_available():
            self.baseline = held_bytes(self.device)
        return self.baseline

    def restart_peak(self) -> None:
        """Restart the device's high-water mark, keeping the baseline of :meth:`reset` (where
        the peak cannot be reset, a later :meth:`read` is an upper bound)."""
        kind = self.device.type
        if kind == "cpu":
            host.reset_peak()
        elif kind == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(self.device)

    def absolute(self) -> int:
        """The peak bytes in use on the device since :meth:`reset` (not minus the baseline)."""
        kind = self.device.type
        if kind == "cpu":
            return host.read_peak() or 0
        if kind == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated if cuda_async_backend() else torch.cuda.max_memory_reserved
            return peak(self.device)
        if kind == "mps" and torch.backends.mps.is_available():
            return torch.mps.driver_allocated_memory()
        return 0

    def read(self) -> int:
        """Peak bytes above the baseline since :meth:`reset`."""
        return max(0, self.absolute() - self.baseline)

    def limit_read(self) -> int | None:
        """Peak bytes since :meth:`reset` in the units the device's limit counts (on the CPU the
        sampled data segment, a lower bound; None without ``limit_units``); stops the sampling."""
        if self.device.type != "cpu":
            return self.read()
        if self._sampler is None or self._data is None:
            return None
        peak = self._sampler.stop()
        self._data.close()
        first = self._sampler.first
        return None if peak is None or first is None else max(0, peak - first)
