"""Worst-case data: a workload's ``worst_case_batch(size)`` is what its trials run on.

A workload whose memory depends on its data (a collator that pads each batch to
its longest sample) fits more items on a batch of short samples than on one of
long samples; a search over such data must find a maximum that holds for the
longest batch. Trials build ``fn.worst_case_batch(size)`` in each step and call
``fn(size, batch=...)`` (:func:`~oomguard.engine.core.search.trial.run_trial`); a
workload without it is called ``fn(size)``. The boundaries are asserted under a
real CPU budget, in a fresh process.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import in_fresh_process

import oomguard
from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.core.search.search import search
from oomguard.engine.core.search.strategies import ExpandBisect
from oomguard.engine.core.search.trial import run_trial
from oomguard.engine.errors import UsageError
from oomguard.metrics.train_step import TrainStep
from oomguard.metrics.workload import MetricTrial

MiB = 1024**2
MAX_LEN = 64
TOKEN_BYTES = 64 * 1024  # float32 per token: a sample at MAX_LEN costs 4 MiB
BUDGET = 46 * MiB


@dataclass
class PadsToLongest:
    """Allocates ``size x longest x TOKEN_BYTES`` (touched): its memory follows the longest
    sample of the batch, as a collator that pads to it. Returns that longest length.

    The batch is a tensor of sample lengths; without one it draws a seeded batch of
    lengths in ``[1, max_len]`` (the data as they come)."""

    max_len: int = MAX_LEN
    name: str = "pads-to-longest"

    def worst_case_batch(self, size: int) -> torch.Tensor:
        return torch.full((size,), self.max_len)

    def __call__(self, size: int, batch: torch.Tensor | None = None) -> int:
        if batch is None:
            batch = torch.randint(1, self.max_len + 1, (size,),
                                  generator=torch.Generator().manual_seed(size))
        longest = int(batch.max())
        padded = torch.ones(size, longest, TOKEN_BYTES // 4)
        assert padded.shape[0] == size
        return longest


@dataclass
class ShortBatches:
    """``inner`` on lucky batches, every sample at a quarter of the longest length: a
    plain callable (no ``worst_case_batch``), as a search that trusts its draws sees it."""

    inner: PadsToLongest

    def __call__(self, size: int) -> int:
        return self.inner(size, batch=torch.full((size,), self.inner.max_len // 4))


def worst_case_and_lucky_maxima() -> dict:
    """In a fresh process: the maximum a search finds with the worst case and on lucky
    short batches, under the same CPU budget, and what the lucky maximum does on the
    longest batch."""
    workload = PadsToLongest()
    worst = search(workload, strategy=ExpandBisect(start=4, step=4), budget=BUDGET, max_size=64)
    lucky = search(ShortBatches(workload), strategy=ExpandBisect(start=4, step=4), budget=BUDGET,
                   max_size=64)
    with oomguard.budget(BUDGET, "cpu"):
        lucky_on_longest = run_trial(workload, lucky.max_ok)
        worst_again = run_trial(workload, worst.max_ok)
    return {"worst": (worst.max_ok, worst.first_oom),
            "worst_trials": [(t.worst_case, t.value) for t in worst.trials if t.ok],
            "lucky": (lucky.max_ok, lucky.first_oom),
            "lucky_trials": [t.worst_case for t in lucky.trials],
            "lucky_on_longest": lucky_on_longest.ok, "worst_again": worst_again.ok}


@pytest.mark.slow
def test_search_with_worst_case_batch_finds_a_maximum_that_holds_for_the_longest_batch():
    got = in_fresh_process(worst_case_and_lucky_maxima)
    # 4 MiB per item at full length under 46 MiB: 11 items (44 MiB) fit, 12 (48 MiB) do
    # not (measured: 3 fresh processes out of 3); at a quarter of the length, 1 MiB each.
    assert got["worst"] == (11, 12)
    assert got["worst_trials"] and all(wc and longest == MAX_LEN
                                       for wc, longest in got["worst_trials"])
    assert got["worst_again"]  # the maximum found holds on the longest batch
    lucky_max, _ = got["lucky"]
    assert not any(got["lucky_trials"])  # a plain callable: no worst case
    assert lucky_max >= 3 * 12  # lucky short batches pass at a far larger size...
    assert not got["lucky_on_longest"]  # ...which runs out of memory on the longest batch


def test_worst_case_batch_is_used_in_each_step_and_measured():
    class Recorder:
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        def worst_case_batch(self, size: int) -> torch.Tensor:
            return torch.ones(size, 8 * MiB, dtype=torch.uint8)  # 8 MiB per item, touched

        def __call__(self, size: int, batch: torch.Tensor | None = None) -> int:
            assert batch is not None
            self.seen.append((size, int(batch.sum()) // (8 * MiB)))
            return int(batch.shape[0])

    fn = Recorder()
    trial = run_trial(fn, 3, steps=2)
    assert trial.ok and trial.worst_case and trial.value == 3
    assert fn.seen == [(3, 3), (3, 3)]  # built anew for each step, at the trial's size
    # The batch is built inside the measured step: its 24 MiB are in each step's peak.
    assert len(trial.step_peaks) == 2 and min(trial.step_peaks) >= 24 * MiB


def test_plain_callable_is_called_as_before():
    calls: list[tuple] = []

    def plain(size: int) -> int:
        calls.append((size,))
        return size * 2

    trial = run_trial(plain, 5, steps=2)
    assert trial.ok and not trial.worst_case and trial.value == 10
    assert calls == [(5,), (5,)]


def test_a_function_can_offer_worst_case_batch_too():
    def fn(size: int, batch: list[int] | None = None) -> int:
        return max(batch or [0])

    fn.worst_case_batch = lambda size: [MAX_LEN] * size  # type: ignore[attr-defined]
    trial = run_trial(fn, 2)
    assert trial.worst_case and trial.value == MAX_LEN


def test_worst_case_batch_without_a_batch_argument_is_a_usage_error():
    calls: list[int] = []

    class NoBatch:
        def worst_case_batch(self, size: int) -> list[int]:
            return [0] * size

        def __call__(self, size: int) -> int:
            calls.append(size)
            return size

    with pytest.raises(UsageError, match="takes no 'batch' argument"):
        run_trial(NoBatch(), 2)
    assert calls == []  # refused before anything ran

    class NotCallable:
        worst_case_batch = 3

        def __call__(self, size: int, batch: object = None) -> int:
            return size

    with pytest.raises(UsageError, match="must be a method"):
        run_trial(NotCallable(), 2)


@pytest.mark.slow
def test_isolated_trial_runs_the_worst_case_in_the_child():
    with IsolatedRunner(PadsToLongest()) as runner:
        trial = runner(2)
    assert trial.ok and trial.worst_case and trial.value == MAX_LEN


@pytest.mark.slow
def test_train_step_worst_case_batch_is_every_sample_at_full_length():
    assert TrainStep.steps_per_trial == 2
    own = TrainStep(seq_len=16)
    loss = own(3)  # the step builds its batch itself
    given = TrainStep(seq_len=16)
    given.warmup()
    trial = run_trial(given, 3)  # the trial hands it worst_case_batch(3)
    # The same batch, so the same loss (dropout draws from the same seeded sequence).
    assert trial.worst_case and trial.value == loss
    batch = own.worst_case_batch(3)
    assert batch.shape == (3, 16) and batch.dtype == torch.int64
    assert torch.equal(batch, given.worst_case_batch(3))
    with pytest.raises(UsageError, match=r"shape \[3, length\]"):
        own(3, batch=batch[:2])


@pytest.mark.slow
def test_metric_trial_worst_case_is_its_tokens_at_full_length():
    trial = MetricTrial("loss", n_samples=6, seq_len=16, seed=1)
    worst = trial.worst_case_batch(2)
    padded = trial._state["data"]
    assert bool((padded["attention_mask"] == 0).any())  # the data do have padding
    assert worst["input_ids"].shape == padded["input_ids"].shape == (6, 16)
    assert bool((worst["attention_mask"] == 1).all()) and bool((worst["labels"] != -100).all())
    assert torch.equal(worst["labels"], worst["input_ids"])
    valid = padded["attention_mask"] == 1  # the same tokens where the data have them
    assert torch.equal(worst["input_ids"][valid], padded["input_ids"][valid])
    assert trial.worst_case_batch(5) is worst  # the knob slices the data, never chooses them
    # The metric's own result stays on its padded data; a trial runs on the worst case.
    on_padded, on_worst = trial(2), trial(2, batch=worst)
    assert on_padded == trial(2, batch=padded) and on_padded != on_worst
    ran = run_trial(trial, 2)
    assert ran.worst_case and ran.value == on_worst
