"""Retry policies: what sizes to try after an out-of-memory error.

:meth:`RetryPolicy.shrink` gets the sizes that ran out of memory and their minimums and
returns the next smaller sizes, or None (retrying stops); the size controller asks it after
every OOM. :class:`Halve` and :class:`ReduceWith` follow a rule; :class:`FitPeaks` goes to
the largest size the measured peaks predict fits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from oomguard.engine.core.memory.budget import headroom_bytes
from oomguard.engine.core.memory.forensics import OomEvent
from oomguard.engine.core.search.fit import peak_model
from oomguard.probes.peak import PeakMeter

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


# Peaks measured per micro-batch size; after that the meter costs nothing (and stops
# resetting CUDA's peak counters, which a user's own logging may read).
PEAKS_PER_SIZE = 3
SIZES_KEPT = 16  # the most recent sizes whose peaks are kept


@dataclass(eq=False)
class FitPeaks:
    """Shrink to the largest size the measured peaks predict fits the memory left
    (:func:`~oomguard.engine.core.search.fit.peak_model`), never at or above the size that
    failed; ``fallback`` (default :class:`Halve`) where nothing was measured, no limit is
    known, the line is refuted or not even the minimum fits.

    :meth:`observe` gets ``(size, peak bytes)`` points the caller measured (:meth:`probe`),
    the first :data:`PEAKS_PER_SIZE` per size. The capacity, measured after the OOM, is
    :func:`~oomguard.engine.core.memory.budget.headroom_bytes` of ``device`` minus
    ``reserve_bytes`` (what the retry allocates that the points miss, e.g. gradients). The
    size returned is an estimate (on CUDA it errs low); a wrong one costs one more OOM.
    """

    device: Any = "cpu"
    fallback: RetryPolicy = field(default_factory=Halve)
    reserve_bytes: int = 0
    peaks: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)
    predicted: int | None = None  # the last size this policy chose from the line

    def probe(self, size: int) -> PeakProbe | None:
        """A meter for one step at ``size``; None when that size has its
        :data:`PEAKS_PER_SIZE` peaks already or no limit is known (nothing to fit against)."""
        if len(self.peaks.get(size, ())) >= PEAKS_PER_SIZE or headroom_bytes(self.device) is None:
            return None
        try:
            return PeakProbe(self.device)
        except RuntimeError:  # no room left to start the sampler thread: the step runs unmeasured
            return None

    def observe(self, size: int, peak_bytes: int) -> None:
        """Record a measured peak (bytes above the step's start) of a step at ``size``."""
        self.peaks.setdefault(size, []).append(peak_bytes)
        self.peaks.move_to_end(size)
        if len(self.peaks) > SIZES_KEPT:
            self.peaks.popitem(last=False)

    def predict(self) -> int | None:
        """The largest size whose fitted peak fits the headroom now, less ``reserve_bytes``
        (an estimate); None without a limit, a point or a positive slope."""
        fit = peak_model([(s, p) for s, ps in self.peaks.items() for p in ps])
        room = headroom_bytes(self.device)
        if fit is None or room is None or fit.per_item_bytes <= 0:
            return None
        return fit.largest_size_within(room - self.reserve_bytes)

    def shrink(self, sizes: Mapping[str, int], minimum: Mapping[str, int]) -> Sizes | None:
        if len(sizes) != 1:  # one line per knob is not known: several knobs follow the rule
            return self.fallback.shrink(sizes, minimum)
        (key, size), = sizes.items()
        missed = self.predicted is not None and size <= self.predicted
        self.predicted = None
        guess = None if missed else self.predict()
        if guess is None or guess >= size or guess < minimum.get(key, 1):
            # Nothing to go by, the line just refuted, or not even the minimum fits.
            return self.fallback.shrink(sizes, minimum)
        self.predicted = guess
        return {key: guess}


class PeakProbe:
    """The peak bytes one step adds on ``device``, measured cheaply enough for every
    micro-batch: on the CPU the sampled data segment (a lower bound); on CUDA
    ``max_memory_allocated`` minus ``memory_allocated`` at the start, without emptying the
    cache; elsewhere nothing."""

    def __init__(self, device: Any) -> None:
        self.device = torch.device(device)
        self.kind = self.device.type
        self.meter: PeakMeter | None = None
        self.start = 0
        if self.kind == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        elif self.kind == "cpu":
            self.meter = PeakMeter("cpu", limit_units=True)
            self.meter.reset()  # RuntimeError where its sampler thread cannot start

    def read(self) -> int | None:
        """Peak bytes above the start (None: not measured); stops the CPU sampler."""
        if self.meter is not None:
            return self.meter.limit_read()
        if self.kind == "cuda" and torch.cuda.is_available():
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.start)
        return None


@dataclass
class RunRecord:
    """What one run did: the sizes of each attempt, each OOM's message, the sizes that worked,
    and one :class:`~oomguard.engine.core.memory.forensics.OomEvent` per OOM of this process."""

    workload: str
    attempts: list[Sizes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final: Sizes | None = None
    events: list[OomEvent] = field(default_factory=list)

    @property
    def retries(self) -> int:
        return max(0, len(self.attempts) - 1)
