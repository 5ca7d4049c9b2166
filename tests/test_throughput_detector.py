"""Items per second per trial without the swallowed-OOM detector's cost, and the detector kept
where it protects results (engine/core/memory/swallowed.py, engine/core/search/trial.py).

Under a budget the detector (a dispatch mode) wraps every aten operator; a trial's steps after
the first, which its rate is timed on, run with it paused, unless the workload catches its own
errors (``catches_own_errors``: the metrics, and so the jobs). Real CPU budgets, each test in a
fresh process (a budget is a memory boundary).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from conftest import in_fresh_process

from oomguard.engine.core.memory.budget import budget
from oomguard.engine.core.memory.oom import call_catching_oom
from oomguard.engine.core.memory.swallowed import spotter_paused
from oomguard.engine.core.search.trial import run_trial
from oomguard.engine.core.workload import catches_own_errors
from oomguard.metrics.workload import MetricTrial

MiB = 2**20
SMALL_OPS = 400  # additions on a small tensor: the detector's per-operator cost dominates


def small_ops(size: int) -> float:
    """A step of many small operators: ``SMALL_OPS`` additions on ``size`` floats."""
    x = torch.zeros(size)
    for _ in range(SMALL_OPS):
        x = x + 1.0
    return float(x[0])


def _seconds(paused: bool) -> float:
    """Wall seconds of one call of :func:`small_ops` inside a witness (as a trial's step runs),
    with the detector on or paused."""
    def timed(n: int) -> float:
        with spotter_paused() if paused else _nothing():
            t0 = time.perf_counter()
            small_ops(n)
            return time.perf_counter() - t0
    return call_catching_oom(timed, 64)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _rates_side_by_side() -> dict[str, float]:
    """Seconds per step: the detector on, paused, and a trial's timed steps (the steps after
    its first), interleaved in one process under one budget; the fastest of ten of each, the
    one least disturbed by other work on the machine (medians varied 2x with other jobs
    running, minimums by 10%)."""
    small_ops(64)  # kernels and thread pool before the budget
    on: list[float] = []
    off: list[float] = []
    timed: list[float] = []
    with budget(64 * MiB, "cpu"):
        for _ in range(10):
            on.append(_seconds(paused=False))
            off.append(_seconds(paused=True))
            trial = run_trial(small_ops, 64, steps=2)
            assert trial.ok and trial.items_per_second == 64 / trial.step_seconds[1]
            timed.append(trial.step_seconds[1])
    return {"on": min(on), "off": min(off), "trial": min(timed)}


@pytest.mark.slow
def test_a_trials_rate_is_timed_without_the_detector() -> None:
    seconds = in_fresh_process(_rates_side_by_side)
    # The detector's cost is real on this step: about 2.5x here.
    assert seconds["on"] > 1.5 * seconds["off"], seconds
    # The trial's timed steps run at the detector-off speed, not the detector-on one.
    assert abs(seconds["trial"] - seconds["off"]) < abs(seconds["trial"] - seconds["on"]), seconds
    assert seconds["trial"] < 0.5 * (seconds["on"] + seconds["off"]), seconds


class CatchesItsOwn:
    """Allocates ``size`` MiB once per call; at call ``oom_at`` (counted from 1) far more, and
    catches the failure, returning a placeholder (as analysis code does)."""

    def __init__(self, oom_at: int, says: bool) -> None:
        self.oom_at, self.calls = oom_at, 0
        if says:
            self.catches_own_errors = True

    def __call__(self, size: int) -> dict[str, Any]:
        self.calls += 1
        try:
            mib = 4096 if self.calls == self.oom_at else size
            return {"computed": True, "first": float(torch.ones(mib * MiB // 4)[0])}
        except Exception as e:  # noqa: BLE001 - the shape of the code under test
            return {"computed": False, "error": str(e)[:40]}


def _outcomes() -> dict[str, Any]:
    out = {}
    torch.ones(64, 64).matmul(torch.ones(64, 64)).sum()
    with budget(256 * MiB, "cpu"):
        for name, oom_at, says in (("plain, first step", 1, False),
                                   ("says so, third step", 3, True)):
            trial = run_trial(CatchesItsOwn(oom_at, says), 8, steps=3)
            out[name] = (trial.ok, trial.error)
    return out


@pytest.mark.slow
def test_an_oom_a_workload_catches_is_still_caught_where_the_detector_stays_on() -> None:
    outcomes = in_fresh_process(_outcomes)
    # The first step of any trial keeps the detector: what it allocates once is watched.
    # A workload that catches its own errors keeps it in every step.
    for name, (ok, error) in outcomes.items():
        assert not ok and "out of memory caught by its own code" in error, (name, error)
    # The metrics (and the jobs, which search and run them) are such workloads.
    assert catches_own_errors(MetricTrial("loss"))
    assert not catches_own_errors(small_ops)
