"""Stepping down before the OOM: the CUDA caching allocator's retries as an early warning.

When a ``cudaMalloc`` fails, torch's caching allocator frees its cache and retries before
it reports an OOM, counting ``num_alloc_retries``. A step that needs such retries on
consecutive calls is thrashing and one fragment away from an OOM.

The rule is Composer's (``_update_num_consecutive_thrashes``): after each call without an
OOM, a rise of the count is a thrash, no rise resets it; at :data:`CONSECUTIVE` thrashes in
a row the size steps down as on an OOM. The call's result stands; the next call runs at the
smaller size (``SizeController(watch_alloc_retries=True)``).
"""

from __future__ import annotations

from typing import Any

from oomguard.probes import cuda
from oomguard.probes.device import resolve_device

CONSECUTIVE = 2  # Composer's threshold: thrashes in a row before stepping down


class AllocRetryWatch:
    """Counts the consecutive calls during which the allocator of ``device`` (None: the
    current CUDA device, once this process uses one) retried an allocation."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.index: int | None = None  # the CUDA device watched, once known
        self.off = False  # a device that is not CUDA: nothing to watch
        self.last: int | None = None  # num_alloc_retries read after the last call
        self.thrashes = 0

    def _index(self) -> int | None:
        if self.index is None and not self.off:
            if cuda.device_count() == 0:  # no CUDA in this process, ever: asked once
                self.off = True
                return None
            dev = resolve_device(self.device)
            if dev.type == "cuda" and cuda.unavailable_reason() is None:
                self.index = dev.index if dev.index is not None else cuda.current_device()
            elif self.device is not None:
                self.off = True  # an explicit CPU or MPS device never becomes CUDA
        return self.index

    def start(self) -> None:
        """Before a call: the count to compare with, when none was read after the last."""
        if self.last is None and self._index() is not None:
            self.last = cuda.alloc_retries(self.index)  # type: ignore[arg-type]

    def after_success(self) -> tuple[int, int] | None:
        """After a call without an OOM: ``(before, now)`` counts when this is the
        :data:`CONSECUTIVE`-th call in a row whose allocator retried (the count restarts),
        else None."""
        if self._index() is None:
            return None
        now = cuda.alloc_retries(self.index)  # type: ignore[arg-type]
        before, self.last = self.last, now
        if before is None or now <= before:
            self.thrashes = 0
            return None
        self.thrashes += 1
        if self.thrashes < CONSECUTIVE:
            return None
        self.thrashes = 0
        return before, now

    def after_oom(self) -> None:
        """An OOM changed the size anyway: the count restarts (Composer resets it too)."""
        self.thrashes = 0
        self.last = None
