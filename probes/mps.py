"""The Apple MPS backend, in bytes.

- ``torch.mps.current_allocated_memory``: bytes in live tensors (measured).
- ``torch.mps.driver_allocated_memory``: bytes the Metal driver holds for this
  process, allocator cache included (measured).
- ``torch.mps.recommended_max_memory``: Metal's recommended working-set size,
  the practical ceiling before the system starts paging (reported by Metal;
  newer torch only).

MPS shares unified memory with the CPU, so ``free`` here is an *estimate*:
the recommended ceiling minus what the driver holds for this process. Other
processes' GPU usage is not visible.
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
    return {
        "allocated": int(torch.mps.current_allocated_memory()),
        "driver_allocated": int(torch.mps.driver_allocated_memory()),
        "recommended_max": int(rec()) if rec is not None else None,
    }
