"""Peak memory of one piece of work, per device, in bytes.

``PeakMeter(device).reset()`` before the work, ``.read()`` after it: the
result is the peak *above what was in use at reset*, measured, not estimated.

- CPU: resident high-water mark (``VmHWM`` after ``clear_refs``) minus the
  resident bytes at reset. Resident, so pages reserved but never touched are
  not counted.
- CUDA: ``torch.cuda.max_memory_reserved`` minus the reserved bytes at reset;
  reserved, not allocated, because the fraction budget and the OOM count
  reserved bytes.
- MPS: ``torch.mps.driver_allocated_memory`` after minus before (the MPS
  backend keeps no peak; this is a lower bound).
"""

from __future__ import annotations

import torch

from oomguard.probes import host


class PeakMeter:
    """Measures the peak bytes a piece of work adds on ``device``."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.baseline = 0
        self.source = {
            "cpu": "VmHWM - VmRSS at reset (resident)",
            "cuda": "torch.cuda.max_memory_reserved - reserved at reset",
            "mps": "torch.mps.driver_allocated_memory delta (lower bound)",
        }.get(self.device.type, "unmeasured")

    def reset(self) -> int:
        """Start a measurement; return the baseline in bytes."""
        kind = self.device.type
        if kind == "cpu":
            self.baseline = host.reset_peak()
        elif kind == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
            # Cached free blocks would serve the work without raising the
            # reserved peak, and the read would under-report (even 0).
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_reserved(self.device)
        elif kind == "mps" and torch.backends.mps.is_available():
            self.baseline = torch.mps.driver_allocated_memory()
        else:
            self.baseline = 0
        return self.baseline

    def absolute(self) -> int:
        """The peak bytes in use on the device since :meth:`reset` (not minus the baseline)."""
        kind = self.device.type
        if kind == "cpu":
            return host.read_peak()
        if kind == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_reserved(self.device)
        if kind == "mps" and torch.backends.mps.is_available():
            return torch.mps.driver_allocated_memory()
        return 0

    def read(self) -> int:
        """Peak bytes above the baseline since :meth:`reset`."""
        return max(0, self.absolute() - self.baseline)
