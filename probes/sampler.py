"""A thread that reads a figure (bytes) at a fixed interval while work runs.

Two things need one: the CPU peak in the units ``RLIMIT_DATA`` counts (the
process's data segment, which the kernel keeps no high-water mark of, so it is
sampled: :class:`~oomguard.probes.peak.PeakMeter`), and the RAM guard's
watchdog (resident bytes). A sampled peak is a lower bound: a rise and fall
shorter than the interval between two reads is missed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

STACK_BYTES = 256 * 1024  # enough for a loop of small reads; the default is 8 MiB


class Sampler:
    """Calls ``read()`` every ``interval`` seconds on a daemon thread between :meth:`start`
    and :meth:`stop`; ``peak`` is the largest value read (None reads skipped);
    ``on_sample(value)`` sees each value after the first and stops the sampling with True."""

    def __init__(self, read: Callable[[], int | None], interval: float,
                 on_sample: Callable[[int], bool] | None = None, name: str = "oomguard-sampler"
                 ) -> None:
        self.read, self.interval, self.on_sample, self.name = read, interval, on_sample, name
        self.first: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Sampler:
        """Take the first reading now and start the thread; without one, sample nothing."""
        self.first = self.peak = self.read()
        if self.first is not None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            # RLIMIT_DATA counts a thread's stack: a small one (docs/measurements.md#cpu-limit-units).
            previous = threading.stack_size(STACK_BYTES)
            try:
                self._thread.start()
            finally:
                threading.stack_size(previous)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            value = self.read()
            if value is None:
                continue
            self.peak = value if self.peak is None else max(self.peak, value)
            if self.on_sample is not None and self.on_sample(value):
                return

    def stop(self) -> int | None:
        """Stop the thread, take one last reading, and return the peak."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            last = self.read()
            if last is not None:
                self.peak = last if self.peak is None else max(self.peak, last)
        return self.peak

    @property
    def running(self) -> bool:
        return self._thread is not None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
