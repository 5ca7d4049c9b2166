"""A fake Apple MPS device, for the budget and peak code paths a Linux host cannot reach.

Follows torch 2.13 ``torch/mps/__init__.py`` and aten/src/ATen/mps/MPSAllocator.mm:

- ``set_per_process_memory_fraction(fraction)`` takes a float in 0~2 (``TypeError``
  otherwise ``ValueError``) and sets the high-watermark limit to ``fraction *
  recommended_max_memory()``; 0.0 means unlimited. The default is 1.7
  (``default_high_watermark_ratio``). torch has no getter for it.
- ``current_allocated_memory()``: bytes in live tensors; ``driver_allocated_memory()``:
  what the Metal driver holds for the process, cached buffers included.
- An allocation fails when ``driver allocated + size`` would pass the limit, after the
  allocator has released its cached buffers and retried; the error is a
  ``RuntimeError`` (``TORCH_CHECK``) reading "MPS backend out of memory (MPS allocated:
  ..., other allocations: ..., max allowed: ...). Tried to allocate ... on private pool.
  ...".

Simplification: buffers are not rounded to heap sizes and there are no separate pools.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from fakes.fake_cuda import GiB, format_size


@dataclass
class FakeMps:
    """One fake MPS device; ``other`` bytes are MPS/MPSGraph allocations outside tensors."""

    recommended: int = 16 * GiB
    other: int = 0
    ratio: float = 1.7
    cached: int = 0  # freed buffers the allocator keeps
    live: dict[int, int] = field(default_factory=dict)
    _ids: Any = field(default_factory=itertools.count)

    def current_allocated_memory(self) -> int:
        return sum(self.live.values())

    def driver_allocated_memory(self) -> int:
        return self.current_allocated_memory() + self.cached + self.other

    def recommended_max_memory(self) -> int:
        return self.recommended

    def empty_cache(self) -> None:
        self.cached = 0

    def set_per_process_memory_fraction(self, fraction: Any) -> None:
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 2:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~2")
        self.ratio = fraction

    def max_allowed(self) -> int | None:
        return None if self.ratio == 0.0 else int(self.ratio * self.recommended)

    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` as a tensor would (reusing a cached buffer first)."""
        if self.cached >= nbytes:
            self.cached -= nbytes
        else:
            limit = self.max_allowed()
            if limit is not None and self.driver_allocated_memory() + nbytes > limit:
                self.cached = 0  # release_cached_buffers, then retry
            if limit is not None and self.driver_allocated_memory() + nbytes > limit:
                raise RuntimeError(
                    f"MPS backend out of memory (MPS allocated: "
                    f"{format_size(self.current_allocated_memory() + self.cached)}, other "
                    f"allocations: {format_size(self.other)}, max allowed: {format_size(limit)}"
                    f"). Tried to allocate {format_size(nbytes)} on private pool. Use "
                    "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory "
                    "allocations (may cause system failure).")
        handle = next(self._ids)
        self.live[handle] = nbytes
        return handle

    def free(self, handle: int) -> None:
        self.cached += self.live.pop(handle)

    def install(self, monkeypatch: Any) -> FakeMps:
        """Replace ``torch.backends.mps`` availability and the ``torch.mps`` memory functions."""
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
        monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
        for name in ("current_allocated_memory", "driver_allocated_memory",
                     "recommended_max_memory", "empty_cache", "set_per_process_memory_fraction"):
            monkeypatch.setattr(torch.mps, name, getattr(self, name))
        monkeypatch.delenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", raising=False)
        return self
