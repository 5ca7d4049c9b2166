"""Confirmed searches: in-process trials, the answer re-run in fresh processes.

An in-process search's answer depends on what earlier trials left behind (measured on
the attention workload below: 141 in one process, 148 in another, where the fresh-process
maximum is 142). ``confirm=True`` runs the answer and the size above it in fresh children
and goes on there where they disagree, so its answer is the fresh-process maximum
whatever the in-process phase found. Real OOMs under a real CPU budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from peer_workloads import workloads  # noqa: E402
from peers import Fresh  # noqa: E402

from oomguard import search  # noqa: E402
from oomguard.engine.cli.options import search_config  # noqa: E402
from oomguard.engine.errors import UsageError  # noqa: E402


@pytest.mark.slow
def test_a_confirmed_answer_is_the_fresh_process_maximum() -> None:
    w = workloads(small=True)["attention"]
    result = search(w.make(), budget=w.budget_bytes, max_size=w.max_size, confirm=True)
    assert result.mode == "confirmed"
    fresh = [t for t in result.trials if t.mode == "isolated"]
    in_process = [t for t in result.trials if t.mode == "forked"]  # in forks of this process
    assert in_process and fresh, result.trials
    # The answer's bracket was closed by fresh children only.
    assert any(t.ok and t.size == result.max_ok for t in fresh)
    assert any(not t.ok and t.size == result.max_ok + 1 for t in fresh)
    assert result.first_oom == result.max_ok + 1
    brute = Fresh(w).brute_force(result.max_ok, confirm=False)
    assert result.max_ok == brute["max"], (result.trials, brute)
    assert "confirmed in fresh processes" in result.stopped_because


def test_confirm_with_isolate_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="give one of them"):
        search(lambda n: n, isolate=True, confirm=True)


def test_the_cli_confirm_flag_reaches_the_search_config() -> None:
    args = argparse.Namespace(start=32, budget=None, strategy=None, size_step=None, align=None,
                              max_trials=40, margin=0.15, isolate=False, confirm=True,
                              trial_timeout=None, max_size=1024)
    assert search_config(args, __import__("torch").device("cpu")).confirm is True


def test_an_answer_that_does_not_fit_fresh_is_followed_down_by_1_2_4_not_halved() -> None:
    from oomguard.engine.core.search.strategies import Confirm
    from oomguard.results import Trial

    def oom(size: int) -> Trial:
        return Trial(size, False, None, 0.0, headroom_bytes=50_000_000)

    def fit(size: int) -> Trial:
        return Trial(size, True, 0, 0.0, limit_peak_bytes=size * 500_000,
                     headroom_bytes=50_000_000)

    c = Confirm(start=100)
    assert c.next([], 4096) == 100
    assert c.next([oom(100)], 4096) == 99
    assert c.next([oom(100), oom(99)], 4096) == 97
    assert c.next([oom(100), oom(99), fit(97)], 4096) == 98
