"""Batch-size search: find the largest size that runs, by running it.

``search(fn, ...)`` calls ``fn(size)`` at sizes a :mod:`strategy
<oomguard.engine.core.strategies>` proposes (the E10 routine by default) until the bracket
between the largest fit and the smallest OOM is closed. It returns only sizes
that actually ran, always terminates (``max_size``, ``max_trials``,
``max_seconds``), and stops with the original error when a trial fails for a
reason other than memory.

Trials run in this process (fast; later trials inherit the caches and heap
fragments of earlier ones, so the answer can be lower than a fresh process's)
or isolated, each in a fresh child process (the faithful maximum). The result
says which mode produced it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from oomguard.engine.core.budget import budget as memory_budget
from oomguard.engine.core.fit import DEFAULT_MARGIN, LinearFit, Recommendation, fit_line, recommend
from oomguard.engine.core.strategies import E10, Strategy, bracket
from oomguard.engine.core.trial import Trial, run_trial
from oomguard.engine.core.units import fmt_bytes
from oomguard.engine.errors import NoSizeFits

log = logging.getLogger("oomguard.search")


@dataclass
class SearchResult:
    """What a search found. Sizes are items; bytes are bytes.

    ``max_ok`` is the largest size that ran; ``first_oom`` the smallest size
    above it that ran out of memory (None if none did). ``capacity_bytes`` is
    what the workload could use: the budget if one was set, otherwise the free
    memory probed before the search (an estimate of headroom, not a limit).
    """

    workload: str
    device: str
    mode: str
    strategy: str
    strategy_description: str
    max_ok: int | None
    first_oom: int | None
    trials: list[Trial]
    fit: LinearFit | None
    recommendation: Recommendation | None
    capacity_bytes: int | None
    budget_bytes: int | None
    stopped_because: str
    seconds: float
    config: dict[str, Any] = field(default_factory=dict)
    size_name: str = "batch_size"  # what the searched size is: the workload's ``knob``, if any

    @property
    def size_label(self) -> str:
        """The size's name for prose: ``batch size``, ``internal batch size``."""
        return self.size_name.replace("_", " ")

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "size_name": self.size_name,
            "device": self.device,
            "mode": self.mode,
            "strategy": self.strategy,
            "strategy_description": self.strategy_description,
            "max_ok": self.max_ok,
            "first_oom": self.first_oom,
            "trials": [t.to_dict() for t in self.trials],
            "fit": self.fit.to_dict() if self.fit else None,
            "recommendation": self.recommendation.to_dict() if self.recommendation else None,
            "capacity_bytes": self.capacity_bytes,
            "budget_bytes": self.budget_bytes,
            "stopped_because": self.stopped_because,
            "seconds": self.seconds,
            "config": self.config,
        }


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def search(
    fn: Callable[[int], Any],
    start: int = 32,
    step: int = 8,
    *,
    strategy: Strategy | None = None,
    max_size: int = 65536,
    max_trials: int = 64,
    max_seconds: float | None = None,
    device: str | torch.device = "cpu",
    budget: int | None = None,
    isolate: bool = False,
    margin: float = DEFAULT_MARGIN,
    capacity_bytes: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> SearchResult:
    """Find the largest size at which ``fn(size)`` runs without running out of memory.

    ``fn`` runs one trial; if it has a ``warmup()`` method, that is called once
    per process before the budget is applied (build the model, initialise
    thread pools). ``budget`` (bytes) caps memory above that point with
    :func:`oomguard.engine.core.budget.budget`. ``isolate=True`` runs each trial in a fresh
    child process (``fn`` must then be picklable). ``margin`` is the fraction
    of capacity the recommended safe size keeps free.

    Raises ``ValueError`` on bad arguments, :class:`NoSizeFits` when no size
    fits, and re-raises a trial's error that is not an OOM.
    """
    strategy = strategy or E10(start=start, step=step)
    _check_positive(start=getattr(strategy, "start", start), step=step, max_size=max_size,
                    max_trials=max_trials, budget=budget)
    first = getattr(strategy, "start", start)
    if first > max_size:
        raise ValueError(f"start ({first}) is larger than max_size ({max_size})")
    dev = torch.device(device)
    name = getattr(fn, "name", None) or getattr(fn, "__name__", type(fn).__name__)
    if capacity_bytes is None:
        capacity_bytes = budget if budget is not None else _free_bytes(dev)
    mode = "isolated" if isolate else "in-process"
    log.info("searching %s on %s (%s, %s)", name, dev, mode, strategy.name)

    trials: list[Trial] = []
    t0 = time.perf_counter()
    stopped = "bracket closed"
    with ExitStack() as stack:
        if isolate:
            from oomguard.engine.core.isolate import IsolatedRunner

            runner: Callable[[int], Trial] = stack.enter_context(
                IsolatedRunner(fn, device=dev, budget=budget))
        else:
            if hasattr(fn, "warmup"):
                fn.warmup()
            if budget is not None:
                stack.enter_context(memory_budget(budget, dev))

            def runner(size: int) -> Trial:
                return run_trial(fn, size, dev)

        while True:
            if len(trials) >= max_trials:
                stopped = f"max_trials ({max_trials}) reached"
                break
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                stopped = f"max_seconds ({max_seconds:g}) reached"
                break
            size = strategy.next(trials, max_size)
            if size is None:
                lo, _ = bracket(trials)
                if lo is not None and lo >= max_size:
                    stopped = f"max_size ({max_size}) reached"
                break
            if any(t.size == size for t in trials):  # a strategy that repeats itself is done
                break
            trial = runner(size)
            trial.mode = mode
            trials.append(trial)
            log.info("trial %2d: size %d %s%s (%.2f s)", len(trials), size, trial.outcome.upper(),
                     f", peak {fmt_bytes(trial.peak_bytes)}" if trial.ok else "", trial.seconds)
            if on_trial is not None:
                on_trial(trial)

    max_ok, first_oom = bracket(trials)
    fit = fit_line(trials)
    result = SearchResult(
        workload=name, device=str(dev), mode=mode, strategy=strategy.name,
        strategy_description=strategy.describe(), max_ok=max_ok, first_oom=first_oom,
        trials=trials, fit=fit, recommendation=None, capacity_bytes=capacity_bytes,
        budget_bytes=budget, stopped_because=stopped, seconds=time.perf_counter() - t0,
        config={"start": first, "step": step, "max_size": max_size, "max_trials": max_trials,
                "margin": margin},
        size_name=getattr(fn, "knob", None) or "batch_size",
    )
    if max_ok is None:
        result.stopped_because = "nothing fits"
        raise NoSizeFits(result)
    result.recommendation = recommend(trials, max_ok, capacity_bytes, fit, margin, first_oom)
    return result


def _free_bytes(dev: torch.device) -> int | None:
    from oomguard.probes import probe

    return probe(dev).free_bytes
