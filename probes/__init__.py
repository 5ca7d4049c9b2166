"""Probes: measure memory, decide nothing.

``probe(device)`` returns a :class:`MemorySnapshot` in bytes; ``probe_all()`` one per device;
:class:`PeakMeter` measures the peak of a piece of work. A missing GPU or driver is a normal answer
(``available=False`` with a reason), never an exception. This package imports nothing else of
oomguard but its exception tree (an unknown device name is a one-line ``UsageError``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oomguard.probes.probe import MemorySnapshot, probe, probe_all

__all__ = ["MemorySnapshot", "PeakMeter", "probe", "probe_all"]


def __getattr__(name: str) -> Any:
    # PeakMeter needs torch; the host probe does not, so it is resolved on first use.
    if name == "PeakMeter":
        from oomguard.probes.peak import PeakMeter

        return PeakMeter
    raise AttributeError(f"module 'oomguard.probes' has no attribute {name!r}")


if TYPE_CHECKING:
    from oomguard.probes.peak import PeakMeter
