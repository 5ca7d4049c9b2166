"""The search on real OOMs under a CPU budget: the E10 sequence, brute-force
agreement in-process and isolated, termination and bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import in_fresh_process
from oomguard.engine.core.search import NoSizeFits, search
from oomguard.engine.core.strategies import Doubling, LinearJump
from oomguard.metrics.synthetic import LinearAlloc, e10_line
from oomguard.metrics.train_step import TrainStep

MiB = 1024**2


def _warm() -> None:
    torch.ones(256, 256).matmul(torch.ones(256, 256)).sum()


def _between(w: LinearAlloc, lo: int) -> int:
    """A budget halfway between the bytes at ``lo`` and at ``lo + 1``."""
    return (w.bytes_at(lo) + w.bytes_at(lo + 1)) // 2


def _e10_search(strategy_name: str | None = None):
    w = e10_line()
    nbytes = _between(w, 114)
    strategy = {None: None, "doubling": Doubling(start=32),
                "linear": LinearJump(capacity_bytes=nbytes)}[strategy_name]
    _warm()
    return search(w, start=32, step=8, strategy=strategy, budget=nbytes)


def test_e10_report_search_table_is_reproduced():
    w = e10_line()
    result = in_fresh_process(_e10_search)
    sizes = [(t.size, t.outcome) for t in result.trials]
    expected = [(s, "ok") for s in range(32, 113, 8)] + [
        (120, "oom"), (116, "oom"), (114, "ok"), (115, "oom")]
    assert sizes == expected
    assert result.max_ok == 114 and result.first_oom == 115
    assert result.stopped_because == "bracket closed"
    # The fitted line recovers the allocation line it measured (resident bytes).
    assert result.fit is not None and result.fit.r2 > 0.99
    assert result.fit.per_item_bytes == pytest.approx(w.per_item_bytes, rel=0.05)
    rec = result.recommendation
    assert rec is not None and rec.safe <= rec.maximum == 114
    assert rec.conservative <= rec.safe


@pytest.mark.parametrize("strategy", ["doubling", "linear"])
def test_faster_strategies_return_the_e10_answer(strategy):
    result = in_fresh_process(_e10_search, strategy)
    assert result.max_ok == 114
    assert all(t.ok for t in result.trials if t.size <= 114)
    assert len(result.trials) < 15  # the E10 routine needs 15 here


def _halving_search():
    w = LinearAlloc(base_bytes=8 * MiB, per_item_bytes=4 * MiB)
    _warm()
    return search(w, start=32, step=8, budget=_between(w, 13))


def test_start_that_does_not_fit_halves_then_continues():
    result = in_fresh_process(_halving_search)
    sizes = [t.size for t in result.trials]
    assert sizes[:2] == [32, 16] and result.max_ok == 13
    assert [t.ok for t in result.trials if t.size == 13] == [True]


def test_only_sizes_that_ran_are_returned_and_limits_terminate():
    w = LinearAlloc(base_bytes=1 * MiB, per_item_bytes=1 * MiB)
    result = search(w, start=4, step=4, max_size=30)
    assert result.max_ok == 30 and result.first_oom is None
    assert result.stopped_because.startswith("max_size")
    result = search(w, start=4, step=4, max_size=10_000, max_trials=3)
    assert len(result.trials) == 3 and result.max_ok == 12
    assert result.max_ok in {t.size for t in result.trials if t.ok}


def _search_that_fits_nothing() -> list[int]:
    w = LinearAlloc(base_bytes=64 * MiB, per_item_bytes=1 * MiB)
    _warm()
    try:
        search(w, start=8, budget=32 * MiB)
    except NoSizeFits as exc:
        return [t.size for t in exc.result.trials]
    return []


def test_nothing_fits_raises_with_every_trial():
    assert in_fresh_process(_search_that_fits_nothing) == [8, 4, 2, 1]


def test_non_oom_error_stops_the_search_with_the_original_error():
    def broken(size: int) -> None:
        if size > 40:
            raise KeyError("not a memory problem")

    with pytest.raises(KeyError, match="not a memory problem"):
        search(broken, start=32, step=8)


@pytest.mark.parametrize("kwargs", [dict(start=0), dict(step=-1), dict(max_size=0),
                                    dict(start=64, max_size=32), dict(budget=0)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        search(lambda s: s, **kwargs)


def _brute_force(fn, limit: int) -> int:
    """Largest size before the first OOM, trying 1, 2, 3, ... in order."""
    from oomguard.engine.core.trial import run_trial

    best = 0
    for size in range(1, limit + 1):
        if not run_trial(fn, size).ok:
            break
        best = size
    return best


GPT2 = dict(model="gpt2:n_embd=64,n_layer=2,n_head=4,vocab_size=256,n_positions=512,"
                  "bos_token_id=0,eos_token_id=0", seq_len=512)


def _calibrate() -> int:
    """A budget halfway between the step's memory at batch 6 and at batch 7.

    Fitted on measured peaks at 1-3 in a fresh process; the half-item of
    slack on each side keeps the boundary well clear of history effects
    (a few MiB of kernels and caches per new shape, against ~25 MiB per item).
    """
    from oomguard.engine.core.fit import fit_line
    from oomguard.engine.core.trial import run_trial

    step = TrainStep(**GPT2)
    step.warmup()
    fit = fit_line([run_trial(step, s) for s in (1, 2, 3, 2)])
    return int(fit.predict(6.5))


@pytest.fixture(scope="module")
def gpt2_budget() -> int:
    return in_fresh_process(_calibrate)


def _brute_in_fresh_process(nbytes: int) -> int:
    from oomguard.engine.core.budget import budget

    step = TrainStep(**GPT2)
    step.warmup()
    with budget(nbytes):
        return _brute_force(step, 64)


def _search_in_fresh_process(nbytes: int) -> int | None:
    return search(TrainStep(**GPT2), start=4, step=4, budget=nbytes).max_ok


def test_gpt2_step_search_matches_brute_force_in_process(gpt2_budget):
    # In-process answers depend on the process's history, so each side starts
    # from the same state: its own fresh process, model built, one warm-up step.
    brute = in_fresh_process(_brute_in_fresh_process, gpt2_budget)
    found = in_fresh_process(_search_in_fresh_process, gpt2_budget)
    assert 3 <= brute < 64
    assert found == brute


def test_gpt2_step_search_matches_brute_force_isolated(gpt2_budget):
    from oomguard.engine.core.isolate import IsolatedRunner

    step = TrainStep(**GPT2)
    result = search(step, start=4, step=4, budget=gpt2_budget, isolate=True)
    assert all(t.mode == "isolated" for t in result.trials)
    runner = IsolatedRunner(step, budget=gpt2_budget)
    # In a fresh process order does not matter, so brute force is: every size
    # up to max_ok fits and max_ok + 1 does not.
    assert [runner(s).ok for s in range(1, result.max_ok + 2)] == [True] * result.max_ok + [False]
