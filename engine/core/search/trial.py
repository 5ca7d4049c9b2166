"""One trial: run a workload at a size for a few steps (a training step's first creates the
optimizer state) and record what happened (:class:`Trial`); an error not an OOM propagates.
A workload with ``worst_case_batch(size)`` is called ``fn(size, batch=fn.worst_case_batch(size))``,
the batch built inside the measured region, so no size passes on a lucky batch (the
executor's real run calls ``fn(size)``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from oomguard.engine.core.memory.budget import active_budget, headroom_bytes, tighten_active_budget
from oomguard.engine.core.memory.oom import OOM, call_catching_oom, release_memory
from oomguard.engine.core.memory.swallowed import spotter_paused
from oomguard.engine.core.workload import catches_own_errors, name_of, warm_up, worst_case_call
from oomguard.engine.errors import first_line
from oomguard.engine.util.jsonable import to_jsonable
from oomguard.probes.peak import PeakMeter

log = logging.getLogger("oomguard.search")


@dataclass
class Trial:
    """The outcome of running a workload at ``size``: ``ok`` (fitted) or an OOM, wall
    ``seconds``, and the ``value`` it returned as plain JSON types.

    ``peak_bytes``: measured above the pre-trial baseline (:class:`probes.PeakMeter`); None for
    an OOM. ``mode``: ``"in-process"`` or ``"isolated"``. ``guarded``: the RAM guard's verdict
    (:mod:`~oomguard.engine.core.search.ramguard`), not a failed allocation; ``peak_bytes`` is
    then the peak until stopped, or None for a size not run. ``step_peaks``, ``step_seconds``:
    each of the ``steps`` calls' peak and wall seconds.
    ``limit_peak_bytes``: the peak in the units the limit counts, named by ``limit_units``
    (sampled ``VmData`` under a CPU budget: a lower bound); ``headroom_bytes``: what the limit
    left at the trial's start, in those units (None: no known limit). ``items_per_second``:
    throughput of the steps after the first (of the only one), which run without the
    swallowed-OOM detector (:func:`~oomguard.engine.core.memory.swallowed.spotter_paused`)
    unless the workload ``catches_own_errors``. ``worst_case``: each step ran
    on ``worst_case_batch(size)`` (counted in ``peak_bytes``). ``chosen_by`` and ``reason``:
    the strategy that proposed the size and why, where a search records them.
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
    steps: int = 1
    step_peaks: list[int] = field(default_factory=list)
    limit_peak_bytes: int | None = None
    headroom_bytes: int | None = None
    limit_units: str | None = None
    items_per_second: float | None = None
    worst_case: bool = False
    chosen_by: str | None = None
    reason: str | None = None
    step_seconds: list[float] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        return "ok" if self.ok else "oom"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"outcome": self.outcome}


# Size knobs that split the samples: above their number, all mean "everything at once".
SAMPLE_KNOBS = frozenset({"micro_batch_size", "chunk_size", "batch_size"})


def warm_up_trials(fn: Callable[[int], Any], device: str | torch.device = "cpu",
                   call: bool = True) -> None:
    """A process's one-time setup before its first trial and any limit: ``fn.warmup()``, else one
    call ``fn(1)`` as a trial calls it, so imports and kernels are not paid by the first trial
    (a lazy ``import`` under a tight budget can itself run out). A failed call is a warning.
    ``call=False`` (``restore=``): ``warmup()`` only; a warm-up step would allocate the
    optimizer's state outside the budget, which the real loop's first step pays inside."""
    if not call or getattr(fn, "warmup", None) is not None:
        warm_up(fn)
        return
    try:
        call = worst_case_call(fn)  # a bad hook: said by the first trial, as before
        outcome = call_catching_oom(call, 1, device=device, workload=name_of(fn))
        failed = outcome.message if isinstance(outcome, OOM) else None
    except Exception as exc:  # noqa: BLE001 - not a trial: a size-1 call may be refused
        failed = f"{type(exc).__name__}: {first_line(exc)[:300]}"
    if failed is not None:
        log.warning("%s: the warm-up call at size 1 failed (%s): imports and one-time setup "
                    "inside it are charged to the first trial (give the workload a warmup() "
                    "method that runs it once)", name_of(fn), failed)


def run_trial(fn: Callable[[int], Any], size: int, device: str | torch.device = "cpu",
              guard: Any = None, steps: int = 1) -> Trial:
    """Run ``fn(size)`` ``steps`` times in this process and measure it from a clean baseline.
    Raises what ``fn`` raises unless it is an OOM (in any step: the trial is an OOM). With a
    ``guard`` (CPU only), its watchdog stops the trial past the guard's limit and a measured
    peak past it counts as out of memory (``Trial.guarded``)."""
    call = worst_case_call(fn)
    dev = torch.device(device)
    release_memory(dev)
    tighten_active_budget()
    budgeted = active_budget() is not None
    meter = PeakMeter(dev, limit_units=budgeted)
    meter.reset()
    headroom = headroom_bytes(dev)
    if headroom is None and guard is not None and dev.type == "cpu":
        headroom = guard.limit_bytes
    watch = guard.watch() if guard is not None and dev.type == "cpu" else None
    step_peaks: list[int] = []
    step_seconds: list[float] = []

    watched = catches_own_errors(fn)

    def run_steps(n: int) -> Any:
        result = None
        with watch or nullcontext():  # inside: the watchdog's exception is a caught OOM
            for i in range(steps):
                if i:
                    meter.restart_peak()
                # The steps after the first are timed for throughput: without the swallowed-OOM
                # detector's cost, unless the workload catches its own errors.
                with spotter_paused() if i and not watched else nullcontext():
                    t0 = time.perf_counter()
                    result = call(n)  # the batch is freed on return, as the real run drops it
                    step_seconds.append(time.perf_counter() - t0)
                step_peaks.append(meter.read())
        return result

    start = time.perf_counter()
    try:
        result = call_catching_oom(run_steps, size, device=dev, workload=name_of(fn))
    finally:
        limit_peak = meter.limit_read()
    seconds = time.perf_counter() - start
    common: dict[str, Any] = {"size": size, "seconds": seconds, "steps": steps,
                              "step_peaks": step_peaks, "step_seconds": step_seconds,
                              "headroom_bytes": headroom,
                              "limit_units": _limit_units(meter, budgeted, guard),
                              "worst_case": call is not fn}
    # The guard's exception (a MemoryError raised into this thread) may have been caught by
    # the workload's own code: the guard tripped all the same.
    if watch is not None and watch.tripped is not None:
        peak = max([meter.read(), *step_peaks])
        return Trial(ok=False, peak_bytes=peak, guarded=True,
                     error=guard.over(max(peak, watch.tripped), True),  # type: ignore[union-attr]
                     **common)
    if isinstance(result, OOM):
        return Trial(ok=False, peak_bytes=None, error=result.message, **common)
    peak = max(step_peaks, default=0)
    if dev.type != "cpu" or not budgeted:
        limit_peak = peak  # the limit counts what the peak meter reads
    if watch is not None and guard is not None and peak > guard.limit_bytes:
        return Trial(ok=False, peak_bytes=peak, error=guard.over(peak, False), guarded=True,
                     limit_peak_bytes=limit_peak, **common)
    timed = step_seconds[1:] or step_seconds
    rate = size * len(timed) / sum(timed) if sum(timed) > 0 else None
    return Trial(ok=True, peak_bytes=peak, value=to_jsonable(result), limit_peak_bytes=limit_peak,
                 items_per_second=rate, **common)


def _limit_units(meter: PeakMeter, budgeted: bool, guard: Any) -> str | None:
    """What ``limit_peak_bytes`` and ``headroom_bytes`` count, in words."""
    if meter.device.type == "cpu":
        if budgeted:
            return "VmData (what RLIMIT_DATA counts), sampled every 0.5 ms"
        return "resident bytes (the RAM guard's estimate)" if guard is not None else None
    return meter.source
