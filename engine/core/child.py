"""How the parent reads an isolated child's death: out of memory, or a crash.

A child that dies after it started is an OOM only with evidence (the module
docstring of :mod:`oomguard.engine.core.search.isolate` lists the kinds): an allocation
failure reported on its stderr, SIGKILL under a memory limit, or, under a CPU
budget, death by a signal after its data segment came close to the limit.
"""

from __future__ import annotations

import signal

from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import host
from oomguard.probes.peak import DATA_INTERVAL_S

# Text a child writes on stderr when it dies for want of memory (lower-case). libgomp
# prints "libgomp: Thread creation failed: Resource temporarily unavailable" and exits
# with code 1 when a thread's stack does not fit (docs/measurements.md#minimum-cpu-budget).
ALLOCATION_FAILURES: tuple[str, ...] = (
    "libgomp: out of memory",  # gomp_malloc: "libgomp: Out of memory allocating N bytes"
    "libgomp: thread creation failed",
    "std::bad_alloc",  # a C++ allocation failure nothing caught (terminate, SIGABRT)
)
# oneDNN's text counts only under a memory limit (docs/measurements.md#onednn-primitive).
_ONEDNN_PRIMITIVE = "could not create a primitive"

# How close to its limit a budgeted child's sampled data segment must have come for its
# death by a signal to count as running out of memory: a sixteenth of the budget, at least
# 4 MiB. Crashed LSTM steps had come within 32 KiB and 1.86 MiB of a 32 MiB budget's limit;
# a sample every 0.5 ms can miss the last rise before the failing allocation
# (docs/measurements.md#crashes-at-the-limit).
NEAR_LIMIT_FRACTION = 1 / 16
NEAR_LIMIT_MIN = 4 * 1024**2


def oom_evidence(exitcode: int | None, stderr: str, budgeted: bool) -> str | None:
    """Why a child's death counts as running out of memory, or None when nothing says so.

    ``budgeted``: an oomguard budget applied in the child. Limits inherited from
    the environment are read in this process (children share its cgroup).
    """
    text = stderr.lower()
    for pattern in ALLOCATION_FAILURES:
        if pattern in text:
            return f"it reported {pattern!r} on stderr"
    limits = (["the budget"] if budgeted else []) + list(host.memory_limits())
    if _ONEDNN_PRIMITIVE in text and limits:
        return f"it reported {_ONEDNN_PRIMITIVE!r} on stderr under {', '.join(limits)}"
    if exitcode == -signal.SIGKILL and limits:
        return f"under a memory limit: {', '.join(limits)}"
    return None


def how_it_ended(exitcode: int | None) -> str:
    """How a child process ended, in words: killed by which signal, or its exit code."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class LimitWatch:
    """The parent's view of a budgeted child's data segment (``VmData``, what its
    ``RLIMIT_DATA`` counts), sampled every ``interval`` seconds while it runs.

    Some native code does not check what ``malloc`` returns: under a CPU budget, an
    allocation refused at the limit can then kill the child with SIGSEGV instead of
    raising. A LSTM step's backward did, 1 time in 40 at the size above the maximum,
    with glibc's 4 KiB mmap threshold (docs/measurements.md#crashes-at-the-limit). A
    child that died by a signal after its data segment came within ``near`` bytes of
    the limit (:data:`NEAR_LIMIT_FRACTION` of the budget, at least :data:`NEAR_LIMIT_MIN`)
    ran out of memory; one that died far from it crashed.
    """

    interval = DATA_INTERVAL_S  # seconds between two samples

    def __init__(self, pid: int, limit: int, budget: int) -> None:
        self.limit, self.peak = limit, None
        self.near = max(NEAR_LIMIT_MIN, int(budget * NEAR_LIMIT_FRACTION))
        self._data = host.DataSize(pid)
        self.sample()

    def sample(self) -> None:
        value = self._data.read()
        if value is not None and (self.peak is None or value > self.peak):
            self.peak = value

    def close(self) -> None:
        self._data.close()

    def evidence(self, exitcode: int | None) -> str | None:
        """Why the child's death was an OOM, or None: a signal, and the peak near the limit."""
        if exitcode is None or exitcode >= 0 or self.peak is None:
            return None
        left = self.limit - self.peak
        if left > self.near:
            return None
        return (f"its data segment came within {fmt_bytes(max(left, 0))} of the budget's "
                f"limit, sampled every {DATA_INTERVAL_S * 1000:g} ms")
