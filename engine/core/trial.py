"""One trial: run a workload once at given sizes and record what happened.

A trial records whether it fitted (``ok``) or ran out of memory (``oom``),
the measured peak bytes above the pre-trial baseline, the wall seconds, and
the value the workload returned (as plain JSON types, through
:func:`~oomguard.engine.core.jsonable.to_jsonable`). An error that is not an
OOM is not a trial outcome: it propagates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from oomguard.engine.core.budget import tighten_active_budget
from oomguard.engine.core.jsonable import to_jsonable
from oomguard.engine.core.oom import OOM, call_catching_oom, release_memory
from oomguard.probes.peak import PeakMeter


@dataclass
class Trial:
    """The outcome of running a workload once at ``size``.

    ``peak_bytes`` is measured (see :class:`probes.PeakMeter` for what each
    device counts); it is None for an OOM, whose peak is unknown.
    ``mode`` is ``"in-process"`` or ``"isolated"`` (a fresh child process).
    """

    size: int
    ok: bool
    peak_bytes: int | None
    seconds: float
    value: Any = None
    error: str | None = None
    mode: str = "in-process"
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def outcome(self) -> str:
        return "ok" if self.ok else "oom"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outcome"] = self.outcome
        return out


class RebuiltInChild:
    """Mixin for picklable workloads whose ``warmup()`` fills ``self._state``.

    What warmup built (model, data, optimizer) is dropped from the pickle, so
    an isolated trial ships only the workload's description and rebuilds the
    rest in the child, where the budget must not count it.
    """

    _state: dict[str, Any]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_state"] = {}
        return state


def run_trial(
    fn: Callable[[int], Any], size: int, device: str | torch.device = "cpu"
) -> Trial:
    """Run ``fn(size)`` once in this process and measure it.

    Memory is released before the trial so the peak starts from a clean
    baseline. Raises whatever ``fn`` raises unless it is an OOM.
    """
    release_memory(device)
    tighten_active_budget()
    meter = PeakMeter(device)
    meter.reset()
    start = time.perf_counter()
    result = call_catching_oom(fn, size, device=device)
    seconds = time.perf_counter() - start
    if isinstance(result, OOM):
        return Trial(size=size, ok=False, peak_bytes=None, seconds=seconds, error=result.message)
    peak = meter.read()
    return Trial(size=size, ok=True, peak_bytes=peak, seconds=seconds, value=to_jsonable(result))
