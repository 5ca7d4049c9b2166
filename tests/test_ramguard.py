"""The RAM guard: CPU searches without a budget stop before the host runs out.

Where the OS cannot cap memory (macOS, Windows), the guard is all that keeps a
search from swapping the host. These tests give it a small limit on this
machine, with no budget set, and real allocations: the watchdog must stop a
trial that grows past it, a size predicted past it must not run, and what the
search returns must have stayed below it. Memory boundaries are asserted in a
fresh process (freed heap from earlier tests would serve a trial without its
resident bytes growing).
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import in_fresh_process

from oomguard import SearchConfig, is_oom, search
from oomguard.engine.core.search.fit import fit_line
from oomguard.engine.core.search.ramguard import Watchdog
from oomguard.engine.core.search.strategies import Doubling
from oomguard.engine.core.search.trial import run_trial
from oomguard.engine.errors import UsageError
from oomguard.errors import RamLimitReached
from oomguard.memory import RamGuard
from oomguard.probes import host
from oomguard.reports import write_report
from oomguard.results import Trial

MiB = 1024**2
CHUNK = 10 * MiB  # one item: ten MiB, in its own mmap'd block, touched


def grow(n: int) -> int:
    """``n`` x 10 MiB, allocated one chunk at a time (a Python step between chunks)."""
    keep = [torch.ones(CHUNK // 4) for _ in range(n)]
    return len(keep)


def _stopped_trial() -> dict:
    guard = RamGuard(limit_bytes=150 * MiB)
    trial = run_trial(grow, 200, "cpu", guard)  # 2 GiB asked, 150 MiB allowed
    after = torch.ones(MiB).sum().item()  # nothing pending surfaces after the trial
    return {"trial": trial.to_dict(), "after": after}


@pytest.mark.slow
def test_watchdog_stops_a_trial_that_grows_past_the_limit() -> None:
    got = in_fresh_process(_stopped_trial)
    trial = got["trial"]
    assert trial["outcome"] == "oom" and trial["guarded"]
    assert "RAM guard: stopped at" in trial["error"] and "not enforced" in trial["error"]
    # Stopped near 150 MiB, far below the 2 GiB the trial would have taken.
    assert 150 * MiB < trial["peak_bytes"] < 600 * MiB
    assert got["after"] == MiB


def _guarded_search() -> dict:
    result = search(grow, strategy=Doubling(start=4), max_size=1000,
                    ram_guard=RamGuard(limit_bytes=300 * MiB))
    return result.to_dict()


@pytest.mark.slow
def test_search_without_budget_stays_under_the_guard_and_says_it_is_estimated(tmp_path) -> None:
    result = in_fresh_process(_guarded_search)
    trials = result["trials"]
    # 300 MiB of 10 MiB items: the answer is just below 30, never above it.
    assert 26 <= result["max_ok"] <= 30
    assert all(t["peak_bytes"] <= 300 * MiB for t in trials if t["outcome"] == "ok")
    guarded = [t for t in trials if t["guarded"]]
    assert guarded and all(t["size"] > result["max_ok"] for t in guarded)
    # Doubling from 4 reaches 32, which its measured peaks predict past the limit: not run.
    assert any(t["peak_bytes"] is None and t["seconds"] == 0 and "not run" in t["error"]
               for t in guarded)
    assert result["limit"]["enforced"] is False
    assert "estimated, not enforced" in result["limit"]["description"]


def test_report_marks_guard_verdicts_and_the_estimated_limit(tmp_path) -> None:
    trials = [Trial(4, True, 40 * MiB, 0.1), Trial(8, True, 80 * MiB, 0.1),
              Trial(16, False, 170 * MiB, 0.1, error="RAM guard: stopped", guarded=True),
              Trial(12, True, 120 * MiB, 0.1)]
    guard = RamGuard(limit_bytes=150 * MiB, available_bytes=200 * MiB, fraction=0.75)
    from oomguard.engine.core.search.search import SearchResult

    result = SearchResult(workload="grow", device="cpu", mode="in-process", strategy="doubling",
                          strategy_description="doubling", max_ok=12, first_oom=16,
                          trials=trials, fit=fit_line(trials), recommendation=None,
                          capacity_bytes=200 * MiB, budget_bytes=None, stopped_because="x",
                          seconds=1.0, limit=guard.to_dict())
    write_report(result, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "RAM guard 150.00 MiB (75% of 200.00 MiB available RAM; estimated, not enforced)" in text
    assert "RAM guard (estimated limit)" in text
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_a_size_predicted_past_the_limit_is_refused_from_the_measured_peaks() -> None:
    guard = RamGuard(limit_bytes=100 * MiB)
    one = [Trial(10, True, 20 * MiB, 0.1)]
    assert guard.refuse(one, 40) is None  # 80 MiB, proportional from one
    assert "predicted peak 120.00 MiB" in guard.refuse(one, 60)
    two = one + [Trial(20, True, 30 * MiB, 0.1)]  # 10 MiB + 1 MiB/item
    assert guard.refuse(two, 90) is None
    assert guard.refuse(two, 91) is not None
    assert guard.refuse([], 10**9) is None  # nothing measured yet: the watchdog's job


def test_watchdog_raises_a_memory_error_in_the_watched_thread_only() -> None:
    reads = iter([0] + [10**9] * 1000)
    seen: list[BaseException] = []

    def spin() -> None:
        try:
            with Watchdog(limit_bytes=MiB, interval=0.001, read=lambda: next(reads)) as dog:
                while dog.tripped is None:
                    pass
                while True:  # the exception arrives at a bytecode boundary
                    pass
        except RamLimitReached as exc:
            seen.append(exc)

    worker = threading.Thread(target=spin)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    assert len(seen) == 1 and is_oom(seen[0]) and isinstance(seen[0], MemoryError)


def test_watchdog_watches_nothing_where_resident_bytes_cannot_be_read() -> None:
    with Watchdog(limit_bytes=1, interval=0.001, read=lambda: None) as dog:
        pass
    assert not dog.watching and dog.tripped is None


@pytest.mark.parametrize("bad", [{"limit_bytes": 0}, {"limit_bytes": -5},
                                 {"limit_bytes": 1.5}, {"limit_bytes": 10, "interval": 0}])
def test_bad_guard_settings_are_one_line_usage_errors(bad: dict) -> None:
    with pytest.raises(UsageError, match="RamGuard"):
        RamGuard(**bad)


def test_ram_guard_option_is_checked_before_any_trial() -> None:
    with pytest.raises(UsageError, match="ram_guard must be"):
        SearchConfig(ram_guard="on")
    with pytest.raises(UsageError, match="fraction"):
        RamGuard.for_host(fraction=1.5)


@pytest.mark.slow
def test_default_guard_is_a_share_of_the_available_ram_on_cpu_without_budget() -> None:
    result = search(lambda n: n, strategy=Doubling(start=1), max_size=4)
    assert result.limit is not None
    guard = RamGuard.for_host()
    tighter = [lim for lim in host.enforced_limits() if lim.room_bytes < guard.limit_bytes]
    if tighter:  # a container's cgroup or a ulimit leaves less room: it binds instead
        assert result.limit["kind"] in {lim.name for lim in tighter}
    else:
        assert result.limit["enforced"] is False
        assert 0 < result.limit["limit_bytes"] == int(result.limit["available_bytes"] * 0.8)
    budgeted = search(lambda n: n, strategy=Doubling(start=1), max_size=4, budget=256 * MiB)
    assert budgeted.limit is None  # a budget the OS enforces needs no estimate
    off = search(lambda n: n, strategy=Doubling(start=1), max_size=4, ram_guard=False)
    assert off.limit is None
