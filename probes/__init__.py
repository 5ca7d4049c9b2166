"""Probes: measure memory, decide nothing.

``probe(device)`` returns a :class:`MemorySnapshot` in bytes; ``probe_all()``
one per device; :class:`PeakMeter` measures the peak of a piece of work.
A missing GPU or driver is a normal answer (``available=False`` with a
reason), never an exception.
"""

from oomguard.probes.peak import PeakMeter
from oomguard.probes.probe import MemorySnapshot, format_table, probe, probe_all

__all__ = ["MemorySnapshot", "PeakMeter", "format_table", "probe", "probe_all"]
