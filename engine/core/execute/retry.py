"""Retry policies: what sizes to try after an out-of-memory error.

A policy's one method, :meth:`RetryPolicy.shrink`, gets the sizes that ran out of memory
and their minimums and returns the next (smaller) sizes, or None when nothing smaller is
allowed (retrying stops). :class:`~oomguard.engine.core.execute.executor.SizeController`
asks it after every OOM; it is the only place where a retry size is decided.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

Sizes = dict[str, int]


class RetryPolicy(Protocol):
    """Gives the sizes to retry at after an OOM, or None when it cannot go lower."""

    def shrink(self, sizes: Mapping[str, int], minimum: Mapping[str, int]) -> Sizes | None: ...


@dataclass(frozen=True)
class ReduceWith:
    """Shrink every size with ``fn`` (e.g. ``lambda n: n * 3 // 4``), never below its minimum
    (sizes already there stay; when none can shrink, retrying stops)."""

    fn: Callable[[int], int]

    def shrink(self, sizes: Mapping[str, int], minimum: Mapping[str, int]) -> Sizes | None:
        # A rule that overshoots stops at the floor; a size never grows.
        out = {name: min(size, max(self.fn(size), minimum.get(name, 1)))
               for name, size in sizes.items()}
        return out if out != dict(sizes) else None


def _half(n: int) -> int:
    return n // 2


@dataclass(frozen=True)
class Halve(ReduceWith):
    """The default policy: halve every tunable size, down to its minimum."""

    fn: Callable[[int], int] = _half
