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
from typing import TYPE_CHECKING, Any

import torch

from oomguard.engine.core.budget import tighten_active_budget
from oomguard.engine.core.jsonable import to_jsonable
from oomguard.engine.core.oom import OOM, call_catching_oom, release_memory
from oomguard.probes.peak import PeakMeter

if TYPE_CHECKING:
    from oomguard.engine.core.ramguard import RamGuard


@dataclass
class Trial:
    """The outcome of running a workload once at ``size``.

    ``peak_bytes`` is measured (see :class:`probes.PeakMeter` for what each
    device counts); it is None for an OOM, whose peak is unknown.
    ``mode`` is ``"in-process"`` or ``"isolated"`` (a fresh child process).
    ``guarded``: the outcome is the RAM guard's verdict against an estimated limit
    (:mod:`~oomguard.engine.core.ramguard`), not an allocation that failed; its
    ``peak_bytes`` is then the peak measured until it was stopped, or None for a
    size that did not run because its predicted peak was over the limit.
    """

    size: int
    ok: bool
    peak_bytes: int | None
    seconds: float
    value: Any = None
    error: str | None = None
    mode: str = "in-process"
    sizes: dict[str, int] = field(default_factory=dict)
    guarded: bool = False

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
    fn: Callable[[int], Any], size: int, device: str | torch.device = "cpu",
    guard: RamGuard | None = None,
) -> Trial:
    """Run ``fn(size)`` once in this process and measure it.

    Memory is released before the trial so the peak starts from a clean
    baseline. Raises whatever ``fn`` raises unless it is an OOM. With a
    ``guard`` (CPU only), its watchdog stops the trial past the guard's limit
    and a measured peak past it counts as out of memory (``Trial.guarded``).
    """
    release_memory(device)
    tighten_active_budget()
    meter = PeakMeter(device)
    meter.reset()
    watch = guard.watch() if guard is not None and torch.device(device).type == "cpu" else None

    def watched(n: int) -> Any:
        with watch:  # type: ignore[union-attr]
            return fn(n)

    start = time.perf_counter()
    result = call_catching_oom(fn if watch is None else watched, size, device=device)
    seconds = time.perf_counter() - start
    if isinstance(result, OOM):
        if watch is not None and watch.tripped is not None:
            peak = meter.read()
            return Trial(size=size, ok=False, peak_bytes=peak, seconds=seconds,
                         error=guard.over(max(peak, watch.tripped), True),  # type: ignore[union-attr]
                         guarded=True)
        return Trial(size=size, ok=False, peak_bytes=None, seconds=seconds, error=result.message)
    peak = meter.read()
    if watch is not None and guard is not None and peak > guard.limit_bytes:
        return Trial(size=size, ok=False, peak_bytes=peak, seconds=seconds,
                     error=guard.over(peak, False), guarded=True)
    return Trial(size=size, ok=True, peak_bytes=peak, seconds=seconds, value=to_jsonable(result))
