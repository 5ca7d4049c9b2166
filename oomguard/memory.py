"""Memory beyond ``probe``, ``budget``, ``is_oom``, ``free_memory`` and ``release_memory``:
every device's snapshot (:func:`probe_all`), the peak of a piece of work (:class:`PeakMeter`), a
call whose OOM is a value (:func:`call_catching_oom` returns :data:`OOM`), the RAM guard of
searches without a budget (:class:`RamGuard`) and sizes with units (:func:`parse_size`:
``"1.5GiB"`` -> bytes)."""

from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.core.search.ramguard import RamGuard
from oomguard.engine.util.units import parse_size
from oomguard.probes import PeakMeter, probe_all

__all__ = ["OOM", "PeakMeter", "RamGuard", "call_catching_oom", "parse_size", "probe_all"]
