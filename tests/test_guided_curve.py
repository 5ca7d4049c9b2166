"""The guided strategy on memory that grows faster than the size (attention over the sequence
length): it fits the curve the measured peaks show and closes in at most 6 trials, where a
line through them took 13 (bench/peers.py's attention row), and stays at 4 on lines.

The slow tests run a workload of real allocations (an ``n x n`` block plus a linear part)
under a real CPU budget in fresh processes; the brute-force maximum is the largest size that
runs in a fresh process while the size above it runs out of memory there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from conftest import in_fresh_process

from oomguard import search
from oomguard.engine.core.search.fit import LinearFit, QuadraticFit, curve_model, fit_quadratic
from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.core.search.strategies import Guided, bracket, predict_max
from oomguard.results import Trial

MiB = 1024**2


def _simulate(fits: Callable[[int], int | None], headroom: int, max_size: int = 65536) -> list:
    """Guided against an oracle (``fits(size)``: peak bytes, or None for an OOM), every trial
    reporting ``headroom`` bytes; no memory is used: this tests the proposals."""
    trials: list[Trial] = []
    while len(trials) < 40:
        size = Guided().next(trials, max_size)
        if size is None:
            break
        assert not any(t.size == size for t in trials)  # only new sizes
        peak = fits(size)
        trials.append(Trial(size, peak is not None, peak, 0.0, limit_peak_bytes=peak,
                            headroom_bytes=headroom))
    return trials


def _curve(base: float, per_item: float, per_item2: float, headroom: int) -> Callable:
    def fits(size: int) -> int | None:
        peak = int(base + per_item * size + per_item2 * size * size)
        return peak if peak <= headroom else None
    return fits


def _true_max(fits: Callable[[int], int | None]) -> int:
    return next(s for s in range(1, 100_000) if fits(s + 1) is None)


# ------------------------------------------------------------------ the fit (fast)


def test_the_quadratic_fit_recovers_a_curve_and_predicts_its_largest_size() -> None:
    # bench/peers.py's attention layer, isolated: the least-squares curve of its 40 trials
    a, b, c = 1_115_459.0, 38_109.8, 1012.46
    points = [(s, int(a + b * s + c * s * s)) for s in (32, 201, 329)]
    fit = curve_model(points)
    assert isinstance(fit, QuadraticFit)
    assert fit.per_item2_bytes == pytest.approx(c, rel=1e-3)
    assert fit.base_bytes == pytest.approx(a, rel=1e-2)
    cap = 133_804_032
    size = fit.largest_size_within(cap)
    assert size is not None and fit.predict(size) <= cap < fit.predict(size + 1)
    assert fit_quadratic(points[:2]) is None  # two sizes do not determine a curve


def test_a_line_with_noise_stays_a_line() -> None:
    # 0.5% noise on a line (GPT-2 step's in-process peaks scatter by about that): no curve
    line = [(32, int(1.005 * (30 * MiB + 7 * MiB * 32))), (99, 30 * MiB + 7 * MiB * 99),
            (114, int(0.995 * (30 * MiB + 7 * MiB * 114)))]
    assert isinstance(curve_model(line), LinearFit)
    # a concave curve (peaks that grow slower than a line) keeps the line's prediction too
    concave = [(s, int(1e6 * math.sqrt(s))) for s in (16, 64, 256)]
    assert isinstance(curve_model(concave), LinearFit)


def test_guided_closes_in_on_the_attention_curve_in_at_most_six_trials() -> None:
    # bench/peers.py's attention curves (isolated and in-process) at both headrooms seen there
    for a, b, c in [(1_115_459, 38_110, 1012.46), (641_325, 17_718, 1067.30)]:
        for headroom in (133_804_032, 130_400_256):
            fits = _curve(a, b, c, headroom)
            trials = _simulate(fits, headroom)
            m = _true_max(fits)
            assert bracket(trials) == (m, m + 1)
            assert len(trials) <= 6, [(t.size, t.ok) for t in trials]


def test_guided_on_a_pure_square_and_a_cubic_curve_still_brackets_the_maximum() -> None:
    for fits in (_curve(0, 0, 64 * 1024, 1024 * MiB),
                 lambda s: 64 * s**3 if 64 * s**3 <= 1024 * MiB else None):
        trials = _simulate(fits, 1024 * MiB, max_size=4096)
        m = _true_max(fits)
        assert bracket(trials) == (m, m + 1) and len(trials) < 14


def test_guided_on_lines_keeps_four_trials() -> None:
    # base + per item, including a negative base (a line measured in-process, part of the
    # small sizes absorbed by free heap) whose proportional guess from 32 runs out of memory
    for base, per_item in [(30 * MiB, 7 * MiB), (25 * MiB, 3.56 * MiB), (-1 * MiB, 5.9 * MiB),
                           (2 * MiB, 1.2 * MiB)]:
        fits = _curve(base, per_item, 0, 1024 * MiB)
        trials = _simulate(fits, 1024 * MiB)
        m = _true_max(fits)
        assert bracket(trials) == (m, m + 1) and len(trials) <= 4, (base, per_item)


def test_after_a_refuted_prediction_the_next_size_is_the_square_step() -> None:
    # 32 fitted with 3.39 MB of 133.8 MB; the proportional guess (1262) ran out of memory. The
    # next size assumes the peak grows at most as the square of the size from 32: it fits on
    # any curve a + b n + c n**2 with a, b, c >= 0.
    trials = [Trial(32, True, 0, 0.0, limit_peak_bytes=3_391_488, headroom_bytes=133_804_032),
              Trial(1262, False, None, 0.0, headroom_bytes=133_804_032)]
    assert predict_max(trials[:1]) == 1262
    assert Guided().next(trials, 65536) == int(32 * math.sqrt(133_804_032 / 3_391_488))


# ------------------------------------------------------------------ real allocations (slow)


@dataclass
class SquareBlock:
    """One step of ``size x size x 32`` float32 (128 bytes times ``size**2``, like attention's
    scores) and ``size x 8192`` float32 (32 KiB per item, like its activations), both alive at
    once and written, for 5 ms (a step outlasts the 0.5 ms between two samples of the data size,
    as a real step does); returns a value of each so neither is optimised away."""

    name: str = "square-block"

    def __call__(self, size: int) -> float:
        scores = torch.ones(size, size, 32)
        acts = torch.ones(size, 8192)
        time.sleep(0.005)
        return float(scores[-1, -1, -1] + acts[-1, -1])


BUDGET = 128 * MiB  # as bench/peers.py's attention row
# Six trials close the bracket on a fit that lands on the boundary; one more where the fit
# lands one item below it: near the boundary an item is 0.3 MB, within what a child's
# starting data size varies (1 in 12 fresh runs of the rlimit case, and more under load).
MOST_TRIALS = 7


def _guided(isolate: bool) -> dict:
    return search(SquareBlock(), budget=BUDGET, max_size=4096, isolate=isolate, fork=False).to_dict()


def _fresh_runs(size: int) -> bool:
    """Whether ``size`` runs in a fresh child under the same budget (warm-up, budget, trial)."""
    with IsolatedRunner(SquareBlock(), device="cpu", budget=BUDGET) as run:
        return run(size, 1).ok


@pytest.mark.slow
def test_guided_on_a_square_block_under_a_real_budget_closes_in_six_or_seven_trials() -> None:
    isolated = _guided(isolate=True)
    in_process = in_fresh_process(_guided, False)
    m = isolated["max_ok"]
    seen = {k: [(t["size"], t["outcome"], t["limit_peak_bytes"]) for t in r["trials"]]
            for k, r in (("isolated", isolated), ("in-process", in_process))}
    # the brute-force maximum: m runs in a fresh process and m + 1 does not (fitting is
    # monotone in the size: larger blocks)
    assert _fresh_runs(m) and not _fresh_runs(m + 1)
    assert isolated["first_oom"] == m + 1 and len(isolated["trials"]) <= MOST_TRIALS, seen
    # In-process trials share one heap, so their answer can sit one size off the fresh
    # maximum (901 against 902 in one loaded CI run; docs/measurements.md#in-process-vs-isolated);
    # the bracket still closes at adjacent sizes.
    assert abs(in_process["max_ok"] - m) <= 1, seen
    assert in_process["first_oom"] == in_process["max_ok"] + 1, seen
    assert len(in_process["trials"]) <= MOST_TRIALS, seen
    # it fitted a curve: a line through the first two fits would have run out of memory far
    # above m; after the first refuted guess no trial ran out except at the boundary itself
    # (a loaded CI run closed the bracket from above: m + 1 out of memory, then m)
    assert all(t["outcome"] == "ok" or t["size"] == m + 1
               for t in isolated["trials"][2:]), seen
