"""Batch-size search: find the largest size that runs, by running it.

``search(fn, ...)`` calls ``fn(size)`` at sizes a :mod:`strategy
<oomguard.engine.core.search.strategies>` proposes until the bracket between the largest fit
and the smallest OOM is closed, or a bound is reached. It returns only sizes that ran; a
search without an answer raises a :class:`~oomguard.engine.errors.SearchFailed` carrying
every trial that ran::

    search(step, budget=2 * GiB)                          # Guided(start=32)
    search(step, start=64, budget=2 * GiB)                # Guided(start=64)
    search(step, start=64, size_step=16, budget=2 * GiB)  # ExpandBisect(64, 16)
    search(step, strategy=Doubling(start=64), isolate=True, budget=2 * GiB)
    search(step, SearchConfig(strategy=Doubling(start=64), budget=2 * GiB))

Trials run in this process (fast; later ones inherit earlier ones' caches and heap) or each in
a fresh child (the faithful maximum, docs/measurements.md#in-process-vs-isolated).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from oomguard.engine.core.memory.budget import check_budget
from oomguard.engine.core.memory.heap import freed_memory_returned
from oomguard.engine.core.memory.host_limit import HostLimit
from oomguard.engine.core.memory.oom import gc_frozen
from oomguard.engine.core.search.config import SearchConfig, resolve
from oomguard.engine.core.search.fit import (
    LinearFit,
    Recommendation,
    fit_line,
    recommend,
    step_down,
)
from oomguard.engine.core.search.forked import ForkedRunner, fork_refused
from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.core.search.limit import limit_budget, trial_limit
from oomguard.engine.core.search.ramguard import RamGuard
from oomguard.engine.core.search.strategies import Confirm, Strategy, bracket, why_chosen
from oomguard.engine.core.search.trial import Trial, run_trial, warm_up_trials
from oomguard.engine.core.snapshot import Snapshot
from oomguard.engine.core.workload import knob_of, name_of, steps_of
from oomguard.engine.errors import (
    NoSizeFits,
    TrialFailed,
    UsageError,
    check_positive_int,
    first_line,
)
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import probe

log = logging.getLogger("oomguard.search")
CHECKS = 3  # trials of the recommended size after a search, at most (each lower than the last)


@dataclass
class SearchResult:
    """What a search found (sizes in items). ``max_ok``: the largest size that ran; ``first_oom``:
    the smallest size above it that ran out of memory (None: none did). ``capacity_bytes``: the
    budget, else the free memory probed before the search (an estimate, not a limit). ``limit``:
    what bounded the trials without a budget: the RAM guard (``enforced`` False), or a cgroup or
    RLIMIT_DATA limit (``enforced`` True; :mod:`~oomguard.engine.core.memory.host_limit`).
    ``verification``: the ``verify_steps`` run at the recommended size, else None. ``checks``:
    trials at the recommended size after the search (:meth:`_Search.checked`), not in the bracket.
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
    limit: dict[str, Any] | None = None
    verification: dict[str, Any] | None = None
    checks: list[Trial] = field(default_factory=list)

    @property
    def size_to_use(self) -> int | None:
        """The size a run should use: the recommendation, or ``max_ok`` where nothing ran out
        of memory up to the cap."""
        rec = self.recommendation
        return self.max_ok if self.first_oom is None or rec is None else rec.safe

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workload": self.workload, "size_name": self.size_name}
        out |= {f.name: getattr(self, f.name) for f in fields(self)}  # size_name stays 2nd
        out |= {"trials": [t.to_dict() for t in self.trials],
                "checks": [t.to_dict() for t in self.checks],
                "fit": self.fit.to_dict() if self.fit else None,
                "recommendation": self.recommendation.to_dict() if self.recommendation else None}
        return out


def search(fn: Callable[[int], Any], config: SearchConfig | None = None, *,
           start: int | None = None, size_step: int | None = None,
           on_trial: Callable[[Trial], None] | None = None, step: int | None = None,
           **options: Any) -> SearchResult:
    """Find the largest size at which ``fn(size)`` runs without running out of memory.

    ``options`` are :class:`SearchConfig` fields and override those of ``config``.
    ``start`` and ``size_step`` choose the strategy as ``--start`` and ``--size-step`` do: guided
    from ``start``, expand-bisect where a size step is given; give another strategy its own
    (``Doubling(start=64)``). ``step`` is ``size_step``'s old name (one release, with a
    ``FutureWarning``). ``on_trial`` is called with each :class:`Trial`.

    ``fn`` runs one trial; its ``warmup()``, else ``fn(1)`` (not with ``restore=``), runs once per
    process before the budget, so one-time setup is not charged to a trial
    (:func:`warm_up_trials`). With ``isolate=True``, ``fn`` must be picklable and defined in an
    importable file, and a calling script needs an ``if __name__ == "__main__":`` guard.
    ``restore=(model, optimizer)`` lets ``fn`` be the whole training step (:class:`SearchConfig`).

    Raises :class:`UsageError` (a ``ValueError``) on bad options, :class:`ChildStartFailed` at
    once when an isolated ``fn`` cannot be pickled, :class:`NoSizeFits` when no size fitted and
    :class:`TrialFailed` (``from`` the error) when a trial failed otherwise; both carry the
    partial result with every trial that ran.
    """
    if step is not None:
        warnings.warn("search(step=) is now search(size_step=): a size increment, not a "
                      "training step", FutureWarning, stacklevel=2)
        size_step = step if size_step is None else size_step
    cfg, dev = _checked(config, start, size_step, options)
    run = _Search(fn, cfg, dev, on_trial)
    with ExitStack() as stack:
        # First: an unpicklable workload fails at once; the forkserver starts during the warm-up.
        fresh = stack.enter_context(_isolated(fn, cfg, dev)) if cfg.confirm else None
        runner, run.limit = _runner(fn, cfg, dev, stack)
        if run.capacity is None:  # after the warm-up: free memory then leaves the model out
            run.capacity = cfg.budget if cfg.budget is not None else probe(dev).free_bytes
        run.t_trials = time.perf_counter()  # max_seconds bounds the trials, not the warm-up
        run.trial_mode = _mode_of(runner)
        run.mode = "confirmed" if cfg.confirm else run.trial_mode
        stopped = run.phase(run.strategy, run.trials, runner, run.trial_mode)
        if fresh is not None:
            stopped = run.confirm(fresh, stopped)
        final = run.answered(stopped, fresh or runner)
        if cfg.verify_steps:
            final.verification = _verify(fresh or runner, final.recommendation.safe,
                                         cfg.verify_steps, "isolated" if fresh else run.mode)
    return final


class _Search:
    """One search's state: the trials that ran, the clock, and how its result is built."""

    def __init__(self, fn: Callable[[int], Any], cfg: SearchConfig, dev: torch.device,
                 on_trial: Callable[[Trial], None] | None) -> None:
        assert cfg.strategy is not None
        self.fn, self.cfg, self.dev, self.on_trial = fn, cfg, dev, on_trial
        self.strategy: Strategy = cfg.strategy
        self.name = name_of(fn)
        self.capacity = cfg.capacity_bytes
        # How each trial runs (_mode_of: in-process, forked, isolated), set once the runner
        # is chosen; mode: how the answer was found (with confirm: "confirmed").
        self.trial_mode = "isolated" if cfg.isolate else "in-process"
        self.mode = "isolated" if cfg.isolate else "confirmed" if cfg.confirm else "in-process"
        log.info("searching %s on %s (%s, %s)", self.name, dev, self.mode, self.strategy.name)
        self.trials: list[Trial] = []  # every trial, in the order they ran
        self.answer = self.trials  # the trials the answer comes from: with confirm, the fresh ones
        self.steps = cfg.trial_steps(steps_of(fn))
        self.limit: RamGuard | HostLimit | None = None
        self.t0 = self.t_trials = time.perf_counter()

    def result(self, stopped: str) -> SearchResult:
        max_ok, first_oom = bracket(self.answer)
        return SearchResult(
            workload=self.name, device=str(self.dev), mode=self.mode, strategy=self.strategy.name,
            strategy_description=self.strategy.describe(), max_ok=max_ok, first_oom=first_oom,
            trials=list(self.trials), fit=fit_line(self.trials), recommendation=None,
            capacity_bytes=self.capacity, budget_bytes=self.cfg.budget, stopped_because=stopped,
            seconds=time.perf_counter() - self.t0, config=self.cfg.to_dict(),
            size_name=knob_of(self.fn),
            limit=self.limit.to_dict() if self.limit is not None else None)

    def phase(self, proposer: Strategy, phase: list[Trial], run: Callable[[int, int], Trial],
              trial_mode: str) -> str:
        """Run the sizes ``proposer`` proposes from ``phase`` until it or a bound stops; why."""
        cfg = self.cfg
        while True:
            if len(self.trials) >= cfg.max_trials:
                return f"max_trials ({cfg.max_trials}) reached"
            seconds = time.perf_counter() - self.t_trials  # of trials, not of the warm-up
            if cfg.max_seconds is not None and seconds > cfg.max_seconds:
                return f"max_seconds ({cfg.max_seconds:g}) reached"
            size = proposer.next(phase, cfg.max_size)
            if size is None:
                lo, _ = bracket(phase)
                return (f"max_size ({cfg.max_size}) reached" if lo is not None
                        and lo >= cfg.max_size else "bracket closed")
            if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= cfg.max_size:
                raise UsageError(f"strategy {proposer.name} proposed size {size!r}: sizes must "
                                 f"be integers from 1 to max_size ({cfg.max_size}); make its next() "
                                 "return one")
            if any(t.size == size for t in phase):  # a strategy that repeats itself is done
                return f"strategy proposed size {size} again"
            refused = (self.limit.refuse(phase, size) if isinstance(self.limit, RamGuard)
                       else None)
            try:
                trial = (Trial(size, ok=False, peak_bytes=None, seconds=0.0, error=refused,
                               guarded=True) if refused else run(size, self.steps))
            except Exception as exc:  # not an OOM: the search cannot go on
                partial = self.result(f"trial at size {size} failed: {type(exc).__name__}")
                raise TrialFailed(_failure_text(self.name, size, exc, partial), partial) from exc
            trial.mode, trial.chosen_by = trial_mode, proposer.name
            trial.reason = why_chosen(proposer, phase, size)
            phase.append(trial)
            if phase is not self.trials:
                self.trials.append(trial)
            log.info("trial %2d: size %d %s%s (%.2f s)", len(self.trials), size,
                     trial.outcome.upper(),
                     f", peak {fmt_bytes(trial.peak_bytes)}" if trial.ok else "", trial.seconds)
            if self.on_trial is not None:
                self.on_trial(trial)

    def confirm(self, fresh: Callable[[int, int], Trial], stopped: str) -> str:
        """Confirm the in-process answer in fresh processes from its largest fit; why it stopped."""
        lo, _ = bracket(self.trials)
        if lo is not None and (stopped == "bracket closed" or stopped.startswith("max_size")):
            self.answer = []
            stopped = self.phase(Confirm(start=lo), self.answer, fresh, "isolated")
            return f"{stopped} (confirmed in fresh processes from {lo})"
        self.mode = self.trial_mode
        return stopped + " (not confirmed)"

    def answered(self, stopped: str, runner: Callable[[int, int], Trial]) -> SearchResult:
        """The result, its recommendation measured (:meth:`checked`); else :class:`NoSizeFits`."""
        final = self.result(stopped)
        if final.max_ok is None:
            final.stopped_because = "nothing fits" + ("" if stopped.startswith("bracket closed")
                                                       else f" ({stopped})")
            raise NoSizeFits(final)
        # Against the answer's own peaks: a confirmed answer's fresh children read other
        # bytes than the trials before them (a fork's copied pages count as resident).
        fit = final.fit if self.answer is self.trials else fit_line(self.answer)
        rec = recommend(self.answer, final.max_ok, self.capacity, fit, self.cfg.margin,
                        final.first_oom)
        final.recommendation = self.checked(rec, final, runner)
        final.seconds = time.perf_counter() - self.t0
        return final

    def checked(self, rec: Recommendation, final: SearchResult,
                runner: Callable[[int, int], Trial]) -> Recommendation:
        """``rec`` with its size measured, as ``oomguard verify`` would: where no trial ran it under
        its limit it runs, then, over the limit or out of memory, the size :func:`step_down`
        predicts, at most :data:`CHECKS` times in all (the result's ``checks``)."""
        limit = rec.limit_bytes
        if limit is None or rec.checked_peak_bytes is not None and rec.checked_peak_bytes <= limit:
            return rec
        size = rec.safe
        for _ in range(CHECKS):
            trial = runner(size, self.steps)
            trial.mode, trial.chosen_by = self.mode, "check"
            trial.reason = f"the recommended size, measured against {fmt_bytes(limit)}"
            final.checks.append(trial)
            peak = trial.peak_bytes if trial.ok else None
            log.info("check: size %d %s%s", size, trial.outcome.upper(),
                     f", peak {fmt_bytes(peak)} (limit {fmt_bytes(limit)})" if peak else "")
            if peak is not None and peak <= limit:
                return dataclasses.replace(rec, safe=size, checked_peak_bytes=peak,
                                           basis=f"{rec.basis}; measured at {size}")
            size = step_down(size, peak, limit, final.fit)
            if size < 1:
                break
        fallback = rec.conservative if rec.conservative_ran else 1
        return dataclasses.replace(rec, safe=fallback, basis=(
            f"the largest size measured under the limit: the fitted size ran over it in "
            f"{len(final.checks)} check(s)"))


def verify(fn: Callable[[int], Any], size: int, steps: int, config: SearchConfig | None = None,
           **options: Any) -> dict[str, Any]:
    """Run ``steps`` steps of ``fn`` at ``size`` as a search's trial runs them and say what
    happened: ``ok``, ``peak_bytes``, ``step_peaks``, ``seconds`` (``step_seconds``: each
    step's) and an OOM's ``error`` (reported, not raised). ``options`` are
    :class:`SearchConfig` fields."""
    check_positive_int("size", size)
    check_positive_int("steps", steps)
    cfg, dev = _checked(config, None, None, options)
    with ExitStack() as stack:
        runner, _ = _runner(fn, cfg, dev, stack)
        return _verify(runner, size, steps, _mode_of(runner))


def _checked(config: SearchConfig | None, start: int | None, size_step: int | None,
             options: dict[str, Any]) -> tuple[SearchConfig, torch.device]:
    """The config that runs (:func:`resolve`) and its device, the budget checked."""
    cfg = resolve(config, start, size_step, options)
    dev = torch.device(cfg.device)
    if cfg.budget is not None:
        check_budget(cfg.budget, dev)
    return cfg, dev


def _verify(runner: Callable[[int, int], Trial], size: int, steps: int, mode: str
            ) -> dict[str, Any]:
    """Run ``steps`` steps at ``size`` as the trials ran; what happened (an OOM reported)."""
    trial = runner(size, steps)
    trial.mode = mode
    log.info("verify: %d steps at size %d %s", steps, size, trial.outcome.upper())
    return {"size": size, "steps": steps} | {k: getattr(trial, k) for k in (
        "ok", "peak_bytes", "step_peaks", "seconds", "step_seconds", "error", "guarded")}


def _isolated(fn: Callable[[int], Any], cfg: SearchConfig, dev: torch.device) -> IsolatedRunner:
    return IsolatedRunner(fn, device=dev, budget=cfg.budget, timeout=cfg.trial_timeout,
                          limit=trial_limit(dev, cfg.budget, cfg.ram_guard), warm_call=not cfg.restore)


def trial_mode(cfg: SearchConfig) -> str:
    """How a search with ``cfg`` runs its trials, decided now: ``"isolated"``, ``"forked"``
    (``fork``, where :func:`~oomguard.engine.core.search.forked.fork_refused` allows) or
    ``"in-process"``."""
    if cfg.isolate:
        return "isolated"
    return "forked" if cfg.fork and fork_refused(torch.device(cfg.device)) is None else "in-process"


def _mode_of(runner: Callable[[int, int], Trial]) -> str:
    """How ``runner``'s trials run: ``"isolated"``, ``"forked"`` or ``"in-process"``."""
    return getattr(runner, "mode", "in-process")


def _runner(fn: Callable[[int], Any], cfg: SearchConfig, dev: torch.device, stack: ExitStack
            ) -> tuple[Callable[[int, int], Trial], RamGuard | HostLimit | None]:
    """What runs one trial, and what bounds it beside a budget (chosen after the warm-up):
    an isolated child, a fork of this process (``fork``, where :func:`fork_refused` allows),
    else this process."""
    if cfg.isolate:
        isolated = stack.enter_context(_isolated(fn, cfg, dev))
        return isolated, isolated.limit
    if dev.type == "cpu" and (cfg.budget is not None
                              or trial_limit(dev, cfg.budget, cfg.ram_guard) is not None):
        # Before the warm-up, as in an isolated child: the large blocks it frees leave the
        # heap instead of waiting there (docs/measurements.md#free-heap-at-budget-entry).
        stack.enter_context(freed_memory_returned())
    # Forks work on copies and warm up themselves: this process and the user's objects stay
    # as they were, never called (docs/measurements.md#forked-trials).
    forked = trial_mode(cfg) == "forked"
    snapshot = None if forked else _snapshot(cfg, stack)
    warm_up_trials(fn, dev, call=not cfg.restore and not forked)
    stack.enter_context(gc_frozen())  # the warmed-up objects are never a trial's garbage
    limit = trial_limit(dev, cfg.budget, cfg.ram_guard)  # after the warm-up
    stack.enter_context(limit_budget(cfg.budget, dev, limit))
    guard = limit if isinstance(limit, RamGuard) else None
    if forked:
        return ForkedRunner(fn, dev, guard, cfg.trial_timeout, cfg.restore), limit
    if snapshot is None:
        return (lambda size, steps: run_trial(fn, size, dev, guard, steps)), limit

    def restoring(size: int, steps: int) -> Trial:
        try:
            return run_trial(fn, size, dev, guard, steps)
        finally:  # the next trial starts from the user's state, whatever this one did
            snapshot.restore()
    return restoring, limit


def _snapshot(cfg: SearchConfig, stack: ExitStack) -> Snapshot | None:
    """With ``restore``: the objects' snapshot, taken before the warm-up and the budget (part
    of the baseline), restored once more when ``stack`` closes, however the search ends."""
    if not cfg.restore:
        return None
    snapshot = Snapshot.take(cfg.restore)
    stack.callback(snapshot.restore)
    log.info("restore: %s copied to the host (%s), restored after every trial",
             ", ".join(type(o).__name__ for o in cfg.restore), fmt_bytes(snapshot.nbytes))
    return snapshot


def _failure_text(name: str, size: int, exc: BaseException, partial: SearchResult) -> str:
    """One line: what failed, at which size, and what the trials before it found."""
    ran = (f"{len(partial.trials)} trial(s) ran before it, largest that fit: "
           f"{partial.max_ok if partial.max_ok is not None else 'none'}")
    return (f"{name}: the trial at size {size} failed ({type(exc).__name__}: "
            f"{first_line(exc)[:400]}); {ran}")

