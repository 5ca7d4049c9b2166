"""What adaptive sizes did: counters per size, and a bounded registry for :func:`stats`.

Every size controller counts into a :class:`SizeStats`; those of the training-script helpers
are also registered here for :func:`stats`: the most recent :data:`MAX_SIZES_KEPT`, plain
numbers only; a name already taken gets a ``#N`` suffix.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

MAX_SIZES_KEPT = 1024  # sizes in the registry; the oldest is dropped first
MAX_CHANGES_KEPT = 100  # per size; older changes are only counted

# A size: one int for a single knob, a dict for several; None: "the whole input".
Shown = int | dict[str, int] | None


@dataclass(frozen=True)
class SizeChange:
    """One change of an adaptive size: ``old`` -> ``new`` items, why, and when (Unix seconds)."""

    name: str
    old: Shown
    new: Shown
    reason: str
    at: float


@dataclass
class SizeStats:
    """The summary of one adaptive size (sizes in items; ``start`` None means "whole batch")."""

    name: str
    start: Shown
    current: Shown
    calls: int = 0
    ooms: int = 0  # OOMs on this rank
    peer_ooms: int = 0  # attempts this rank redid because another rank ran out of memory
    shrinks: int = 0
    grows: int = 0
    failed: Shown = None  # smallest size that ran out of memory in this run (any rank)
    changes: deque[SizeChange] = field(default_factory=lambda: deque(maxlen=MAX_CHANGES_KEPT))

    def copy(self) -> SizeStats:
        return replace(self, changes=deque(self.changes, maxlen=MAX_CHANGES_KEPT))


@dataclass(frozen=True)
class Stats:
    """What :func:`stats` returns: one :class:`SizeStats` per adaptive size, by name."""

    sizes: dict[str, SizeStats]

    @property
    def ooms(self) -> int:
        return sum(s.ooms for s in self.sizes.values())

    @property
    def changes(self) -> int:
        return sum(s.shrinks + s.grows for s in self.sizes.values())

    def __getitem__(self, name: str) -> SizeStats:
        return self.sizes[name]

    def __str__(self) -> str:
        head = f"{'size':40} {'start':>7} {'now':>7} {'calls':>7} {'ooms':>5} {'peer':>5} " \
               f"{'shrink':>6} {'grow':>5} {'failed':>7}"
        rows = [head] + [
            f"{s.name[:40]:40} {_fmt(s.start):>7} {_fmt(s.current):>7} {s.calls:>7} {s.ooms:>5} "
            f"{s.peer_ooms:>5} {s.shrinks:>6} {s.grows:>5} {_fmt(s.failed, '-'):>7}"
            for s in self.sizes.values()
        ]
        return "\n".join(rows)


def _fmt(size: Shown, none: str = "whole") -> str:
    if size is None:
        return none
    if isinstance(size, dict):
        return "/".join(str(v) for v in size.values())
    return str(size)


_REGISTRY: OrderedDict[str, SizeStats] = OrderedDict()
_SERIAL = itertools.count(2)


def register(name: str, start: Shown) -> SizeStats:
    """A new :class:`SizeStats` under ``name`` (``name#N`` if taken), in the registry (the
    oldest size is dropped beyond :data:`MAX_SIZES_KEPT`)."""
    unique = name if name not in _REGISTRY else f"{name}#{next(_SERIAL)}"
    record = _REGISTRY[unique] = SizeStats(name=unique, start=start, current=start)
    if len(_REGISTRY) > MAX_SIZES_KEPT:
        _REGISTRY.popitem(last=False)
    return record


def stats() -> Stats:
    """A snapshot of the adaptive sizes of this process (the most recent 1024): sizes, OOMs,
    shrinks and grows per size, in copies that do not change afterwards."""
    return Stats({name: s.copy() for name, s in _REGISTRY.items()})


def reset_stats() -> None:
    """Zero the counters of every adaptive size (current sizes and failed sizes are kept)."""
    for s in _REGISTRY.values():
        s.calls = s.ooms = s.peer_ooms = s.shrinks = s.grows = 0
        s.changes.clear()
