"""A search seeded by an estimate (engine/core/search/seed.py): the estimate's predicted
maximum runs first, then Guided brackets it.

Unit tests drive :class:`Seeded` on synthetic trials (peaks from a formula, no memory); the
slow ones search the built-in workloads under a real CPU budget, each search in a fresh
process (an earlier search's free heap would absorb the budget), seeded and not.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from oomguard.engine.core.search.config import SearchConfig
from oomguard.engine.core.search.search import SearchResult, search
from oomguard.engine.core.search.seed import BELOW_ESTIMATE, ESTIMATE, SLOPE, Seeded
from oomguard.engine.core.search.strategies import Guided
from oomguard.engine.core.search.trial import Trial
from oomguard.engine.errors import UsageError
from oomguard.metrics.train_step import TrainStep
from oomguard.metrics.workload import MetricTrial
from oomguard.reports.json_report import strategy_steps
from tests.conftest import in_fresh_process

MiB = 1024**2
HEADROOM = 1024 * MiB


def _run(strategy: object, peak: Callable[[int], int], max_size: int = 4096) -> list[Trial]:
    """The trials ``strategy`` runs on a workload whose peak at a size is ``peak(size)``
    bytes, against :data:`HEADROOM` (what the search's loop does, without memory)."""
    trials: list[Trial] = []
    while len(trials) < 40:
        chooser = getattr(strategy, "chosen_by", None)
        by = chooser(trials) if chooser else None
        size = strategy.next(trials, max_size)  # type: ignore[attr-defined]
        if size is None or any(t.size == size for t in trials):
            return trials
        fits = peak(size) <= HEADROOM
        trials.append(Trial(size, ok=fits, peak_bytes=peak(size) if fits else None, seconds=0.0,
                            limit_peak_bytes=peak(size) if fits else None,
                            headroom_bytes=HEADROOM, chosen_by=by))
    raise AssertionError("the strategy did not stop")


def _line(size: int) -> int:
    return 30 * MiB + 7 * MiB * size  # the maximum is 142


def _quadratic(size: int) -> int:
    return 10 * MiB + size * size * MiB // 64  # the maximum is 254


@pytest.mark.parametrize("first, most", [(142, 2), (143, 2), (141, 3), (100, 3), (145, 4), (146, 5)])
def test_seeded_closes_the_bracket_in_few_trials_near_the_estimate(first: int, most: int) -> None:
    trials = _run(Seeded(first, per_item_bytes=7 * MiB), _line)
    ok = [t.size for t in trials if t.ok]
    assert max(ok) == 142 and any(t.size == 143 and not t.ok for t in trials)
    assert len(trials) <= most, [t.size for t in trials]


def test_an_estimate_far_too_high_falls_back_to_guided_knowing_the_oom() -> None:
    # 4000, 3999 and 3997 run out; then Guided's own start (32), its peak plus the estimated
    # slope gives 142, and 143 closes: the same answer, at most two trials more than Guided
    seeded, plain = _run(Seeded(4000, per_item_bytes=7 * MiB), _line), _run(Guided(), _line)
    assert [t.size for t in seeded] == [4000, 3999, 3997, 32, 142, 143]
    assert max(t.size for t in seeded if t.ok) == max(t.size for t in plain if t.ok) == 142
    assert len(seeded) <= len(plain) + 2


def test_seeded_on_a_curve_that_is_not_a_line_still_finds_the_maximum() -> None:
    seeded, plain = _run(Seeded(240), _quadratic), _run(Guided(), _quadratic)
    best = max(t.size for t in plain if t.ok)
    assert max(t.size for t in seeded if t.ok) == best == 254
    assert len(seeded) <= len(plain)


def test_chosen_by_names_the_estimate_then_the_strategy() -> None:
    trials = _run(Seeded(143), _line)
    assert [t.chosen_by for t in trials] == [ESTIMATE, BELOW_ESTIMATE]
    trials = _run(Seeded(120), _line)
    assert trials[0].chosen_by == ESTIMATE  # no slope given: guided from the first trial on
    assert {t.chosen_by for t in trials[1:]} == {"guided"}
    trials = _run(Seeded(100, per_item_bytes=7 * MiB), _line)
    assert [t.chosen_by for t in trials] == [ESTIMATE, SLOPE, SLOPE]
    assert [t.size for t in trials] == [100, 142, 143]


def test_two_fits_a_size_apart_whose_peaks_read_backwards_do_not_send_it_doubling() -> None:
    # Sampled peaks are noisy: 142 read 12 MiB below 141 (the GPT-2 step read 3 MB less a
    # size up). A line through the two slopes down; the estimated slope still says 143.
    def noisy(size: int) -> int:
        return _line(size) - (12 * MiB if size == 142 else 0)
    trials = _run(Seeded(141, per_item_bytes=7 * MiB), noisy)
    assert [t.size for t in trials] == [141, 142, 143]


def test_seeded_never_proposes_above_max_size() -> None:
    trials = _run(Seeded(500), _line, max_size=100)
    assert [t.size for t in trials] == [100]


def test_the_estimate_seeds_only_where_asked() -> None:
    # off by default: measured, it cost more seconds than it saved on CPU and more trials on
    # curves (docs/measurements.md#estimate-seed-cost)
    assert SearchConfig().estimate is False and "estimate" not in SearchConfig().to_dict()
    assert SearchConfig(estimate=True).to_dict()["estimate"] is True


def test_estimate_option_must_be_a_bool_or_none() -> None:
    with pytest.raises(UsageError, match="estimate must be True or False"):
        search(lambda n: n, estimate="yes")


# Real budgets, fresh processes ------------------------------------------------------------


def _gpt2(estimate: bool | None) -> SearchResult:
    # The built-in training step (forward, backward, AdamW) on tiny GPT-2, each trial in a
    # fresh child: in-process answers depend on the trials before them (one size apart
    # between two orders), isolated ones do not, so the two searches can be compared exactly.
    return search(TrainStep(seq_len=64), budget=192 * MiB, steps_per_trial=1, isolate=True,
                  estimate=estimate)


@pytest.mark.slow
def test_a_search_seeded_by_the_estimate_closes_on_the_gpt2_step_in_at_most_three_trials() -> None:
    seeded = in_fresh_process(_gpt2, True)
    plain = in_fresh_process(_gpt2, False)
    assert seeded.seed is not None and seeded.trials[0].chosen_by == ESTIMATE
    assert len(seeded.trials) <= 3, [(t.size, t.ok) for t in seeded.trials]
    assert seeded.max_ok == plain.max_ok and seeded.first_oom == plain.first_oom
    assert len(seeded.trials) < len(plain.trials)
    steps = strategy_steps(seeded)
    assert "chosen by the estimate" in steps[0] and "estimates, not measurements" in steps[0]
    assert all(t.chosen_by == "guided" for t in plain.trials) and plain.seed is None


# Budgets with the maximum well inside the 128 samples (estimated peaks at seq_len 32: loss
# 0.41 MiB per sample, gradient_stats 0.92, attention_stats 0.37, above a few MiB).
SUITE = [("loss", 28 * MiB), ("gradient_stats", 48 * MiB), ("attention_stats", 24 * MiB)]


def _metric(metric: str, budget: int, estimate: bool) -> SearchResult:
    # isolated, as _gpt2: the two searches' answers compare exactly
    return search(MetricTrial(metric, n_samples=128, seq_len=32), budget=budget,
                  max_size=128, isolate=True, estimate=estimate)


@pytest.mark.slow
@pytest.mark.parametrize("metric, budget", SUITE)
def test_a_seeded_search_never_takes_more_trials_than_the_unseeded_one(metric: str,
                                                                       budget: int) -> None:
    seeded = in_fresh_process(_metric, metric, budget, True)
    plain = in_fresh_process(_metric, metric, budget, False)
    assert plain.first_oom is not None  # the budget bounds the search, not max_size
    assert seeded.seed is not None and seeded.trials[0].chosen_by == ESTIMATE
    assert seeded.max_ok == plain.max_ok
    assert len(seeded.trials) <= min(3, len(plain.trials)), (
        [(t.size, t.ok) for t in seeded.trials], [(t.size, t.ok) for t in plain.trials])
