"""The Apple MPS backend, in bytes.

Measured: ``torch.mps.current_allocated_memory`` (bytes in live tensors) and
``driver_allocated_memory`` (what the Metal driver holds for this process, cache included).
``recommended_max_memory`` (newer torch) is Metal's recommended working-set size, the ceiling before
the system pages. MPS shares unified memory with the CPU, so ``free`` is an *estimate*: that ceiling
minus the driver's bytes; other processes are not visible.
"""

from __future__ import annotations

import torch


def unavailable_reason() -> str | None:
    """None when the MPS backend is usable here, else why not (one line)."""
    backend = getattr(torch.backends, "mps", None)
    if backend is None or not backend.is_built():
        return f"torch {torch.__version__} was built without MPS"
    if not backend.is_available():
        return "MPS is built but not available (needs macOS 12.3+ on Apple silicon)"
    return None


def stats() -> dict[str, int | None]:
    """``allocated``, ``driver_allocated`` (measured) and ``recommended_max`` (None if
    unknown), in bytes; ``RuntimeError`` where MPS is unavailable."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    rec = getattr(torch.mps, "recommended_max_memory", None)
    return {"allocated": int(torch.mps.current_allocated_memory()),
            "driver_allocated": int(torch.mps.driver_allocated_memory()),
            "recommended_max": int(rec()) if rec is not None else None}
