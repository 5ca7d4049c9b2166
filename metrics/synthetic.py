"""A synthetic workload whose memory follows a straight line, for rehearsals and tests.

Under a budget :class:`LinearAlloc` meets a real allocator OOM exactly where its line crosses the
budget; ``e10_line()`` is the E10 report's measured line scaled down to fit a CPU budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E10_AT_32 = 14.62e9
E10_PER_ITEM = 0.375e9


@dataclass
class LinearAlloc:
    """Allocates ``base_bytes + size * per_item_bytes`` of real, touched memory (bytes)."""

    base_bytes: int
    per_item_bytes: int
    name: str = "linear-alloc"
    preload: tuple[str, ...] = ()

    def __call__(self, size: int) -> int:
        blocks = [torch.ones(n, dtype=torch.uint8)
                  for n in [self.base_bytes] + [self.per_item_bytes] * size]
        return sum(b.numel() for b in blocks)

    def bytes_at(self, size: int) -> int:
        """Bytes this workload allocates at ``size`` (exact, by construction)."""
        return self.base_bytes + size * self.per_item_bytes


def e10_line(scale: float = 0.01) -> LinearAlloc:
    """The E10 report's memory line times ``scale`` (0.01: 26.2 MB + 3.75 MB per item)."""
    base = E10_AT_32 - 32 * E10_PER_ITEM
    return LinearAlloc(base_bytes=int(base * scale), per_item_bytes=int(E10_PER_ITEM * scale),
                       name="e10-line")
