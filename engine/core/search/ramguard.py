"""The RAM guard: an estimated limit for CPU searches without a budget or an enforced limit
(:mod:`~oomguard.engine.core.memory.host_limit`), where one size past the RAM would make the
host swap or its OOM killer end the run. A size predicted past it does not run; a watchdog
raises :class:`RamLimitReached` (a ``MemoryError``, so an OOM) in the trial's thread once
resident bytes pass it (a single larger allocation finishes first); a measured peak past it is
an OOM. Every verdict is marked ``Trial.guarded``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomguard.engine.core.search.fit import peak_model
from oomguard.engine.errors import RamLimitReached, UsageError
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import host
from oomguard.probes.sampler import Sampler

if TYPE_CHECKING:
    from oomguard.engine.core.search.trial import Trial

# Of the RAM available after the warm-up, what a trial may add without slowing the host.
DEFAULT_FRACTION = 0.8
# Seconds between two reads of the resident bytes; the `ps` fallback spawns a process.
FAST_INTERVAL_S = 0.02
SLOW_INTERVAL_S = 0.25


@dataclass(frozen=True)
class RamGuard:
    """An estimated, not enforced, limit: ``limit_bytes`` a CPU trial may add to the resident
    bytes at its start. ``available_bytes`` (RAM available when made), ``fraction`` and
    ``source``: None, None and "given" for a guard built from a number. ``interval``: seconds
    between the watchdog's reads."""

    limit_bytes: int
    available_bytes: int | None = None
    fraction: float | None = None
    source: str = "given"
    interval: float = FAST_INTERVAL_S

    def __post_init__(self) -> None:
        if isinstance(self.limit_bytes, bool) or not isinstance(self.limit_bytes, int) \
                or self.limit_bytes <= 0:
            raise UsageError(f"RamGuard limit_bytes must be a positive number of bytes, "
                             f"got {self.limit_bytes!r}; give one such as 2 << 30")
        if not (isinstance(self.interval, (int, float)) and 0 < self.interval <= 10):
            raise UsageError(f"RamGuard interval must be seconds in (0, 10], "
                             f"got {self.interval!r}; give one such as 0.01")

    @classmethod
    def for_host(cls, fraction: float = DEFAULT_FRACTION) -> RamGuard | None:
        """A guard at ``fraction`` of the physical RAM available now (probed); None where it
        cannot be read. An enforced limit that leaves less room binds instead
        (:func:`~oomguard.engine.core.search.limit.unbudgeted_limit`)."""
        if not 0 < fraction <= 1:
            raise UsageError(f"RAM guard fraction must be in (0, 1], got {fraction!r}; give one such as 0.8")
        _, free, sources = host.physical_memory()
        if not free:
            return None
        _, rss_source = host.resident_bytes()
        interval = SLOW_INTERVAL_S if rss_source.startswith("ps ") else FAST_INTERVAL_S
        return cls(limit_bytes=max(1, int(free * fraction)), available_bytes=int(free),
                   fraction=fraction, source=sources["free"], interval=interval)

    def describe(self) -> str:
        """The limit in words, for the search's first line and its report."""
        if self.available_bytes is not None and self.fraction is not None:
            return (f"RAM guard {fmt_bytes(self.limit_bytes)} ({self.fraction:.0%} of "
                    f"{fmt_bytes(self.available_bytes)} available RAM; estimated, not enforced)")
        return f"RAM guard {fmt_bytes(self.limit_bytes)} (estimated, not enforced)"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "ram-guard", "enforced": False, "limit_bytes": self.limit_bytes,
                "available_bytes": self.available_bytes, "fraction": self.fraction,
                "source": self.source, "interval_s": self.interval,
                "description": self.describe()}

    def refuse(self, trials: Sequence[Trial], size: int) -> str | None:
        """Why ``size`` must not run (its peak, predicted by
        :func:`~oomguard.engine.core.search.fit.peak_model`, is past the limit), or None."""
        model = peak_model([(t.size, t.peak_bytes) for t in trials
                            if t.ok and t.peak_bytes is not None])
        predicted = model.predict(size) if model is not None else None
        if predicted is None or predicted <= self.limit_bytes:
            return None
        return (f"RAM guard: not run, predicted peak {fmt_bytes(int(predicted))} is over "
                f"the limit {fmt_bytes(self.limit_bytes)} (estimated, not enforced)")

    def over(self, peak_bytes: int, stopped: bool) -> str:
        """The error text of a trial the guard stopped (``stopped``) or judged after it ran."""
        how = "stopped at" if stopped else "measured peak"
        return (f"RAM guard: {how} {fmt_bytes(peak_bytes)}, over the limit "
                f"{fmt_bytes(self.limit_bytes)} (estimated, not enforced)")

    def watch(self) -> Watchdog:
        """A context manager that watches the calling thread's process while it runs."""
        return Watchdog(self.limit_bytes, self.interval)


class Watchdog:
    """Reads the resident bytes every ``interval`` seconds while the ``with`` block runs; past
    ``limit_bytes`` above those at entry, raises :class:`RamLimitReached` in the thread that
    entered and sets ``tripped`` (bytes above the start). ``watching``: False where resident
    bytes cannot be read."""

    def __init__(self, limit_bytes: int, interval: float,
                 read: Callable[[], int | None] | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.tripped: int | None = None
        self._target = 0
        self._lock = threading.Lock()
        self._done = False
        self._sampler = Sampler(read or (lambda: host.resident_bytes()[0]), interval,
                                on_sample=self._check, name="oomguard-ram-guard")

    @property
    def watching(self) -> bool:
        return self._sampler.running

    def __enter__(self) -> Watchdog:
        self._target = threading.get_ident()
        self._sampler.start()
        return self

    def _check(self, now: int) -> bool:
        start = self._sampler.first
        assert start is not None
        if now - start <= self.limit_bytes:
            return False
        with self._lock:
            if not self._done:
                self.tripped = now - start
                _raise_in(self._target, RamLimitReached)
        return True

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done = True
            if self.tripped is not None:  # cancel one not yet delivered
                _raise_in(threading.get_ident(), None)
        self._sampler.stop()


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None: cancel a pending
    one), through CPython's ``PyThreadState_SetAsyncExc``."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)
