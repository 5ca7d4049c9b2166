"""The decorator and the accelerate-shaped helper, with real OOMs under a CPU budget.

Each sample of the workloads below really allocates ``PER_SAMPLE`` bytes; the
budget decides which batch sizes fit. Nothing raises on a threshold.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import budget_after_warmup
from oomguard.engine.core.executor import ExecutionFailed
from oomguard.engine.training import distributed
from oomguard.engine.training.adaptive import (
    NoExecutableBatchSize,
    adaptive,
    find_executable_batch_size,
    reset_stats,
    stats,
)

MiB = 1024**2
PER_SAMPLE = 2 * MiB  # float32 [512, 1024]


def work(batch_size: int) -> float:
    """A real allocation of ``batch_size * PER_SAMPLE`` bytes, touched."""
    x = torch.ones(batch_size, 512, 1024)
    return float(x[:, 0, 0].sum())


def test_decorator_ooms_at_64_and_32_and_returns_the_result_at_16(caplog):
    tried: list[int] = []

    @adaptive(batch_size=64)
    def step(batch_size: int, scale: float) -> tuple[int, float]:
        tried.append(batch_size)
        return batch_size, work(batch_size) * scale

    caplog.set_level(logging.INFO, logger="oomguard.adaptive")
    with budget_after_warmup(48 * MiB):  # 16 x 2 MiB fits, 32 x 2 MiB does not
        result = step(2.0)
        again = step(1.0)
    assert tried == [64, 32, 16, 16]
    assert result == (16, 32.0) and again == (16, 16.0)
    s = stats()[step.adaptive_size.name]
    assert (s.start, s.current, s.ooms, s.shrinks, s.failed) == (64, 16, 2, 2, 32)
    assert [(c.old, c.new) for c in s.changes] == [(64, 32), (32, 16)]
    changes = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert len(changes) == 2 and "64 -> 32" in changes[0] and "out of memory" in changes[0]


def test_every_size_out_of_memory_is_a_clear_error():
    tried: list[int] = []

    @adaptive(batch_size=8)
    def step(batch_size: int) -> float:
        tried.append(batch_size)
        return work(batch_size + 40)  # >= 82 MiB at every size

    with budget_after_warmup(48 * MiB), pytest.raises(NoExecutableBatchSize) as info:
        step()
    assert tried == [8, 4, 2, 1]
    text = str(info.value)
    assert "no executable batch size: every size down to 1 ran out of memory" in text
    assert "tried 8, 4, 2, 1" in text
    assert isinstance(info.value, ExecutionFailed) and info.value.tried[-1] == {"batch_size": 1}


def test_explicit_batch_size_is_a_type_error():
    @adaptive(batch_size=4)
    def step(batch_size: int, lr: float) -> int:
        return batch_size

    with pytest.raises(TypeError, match="decorator supplies it"):
        step(4, 0.1)
    with pytest.raises(TypeError, match="decorator supplies it"):
        step(0.1, batch_size=4)
    assert step(0.1) == 4


def test_other_errors_propagate_untouched():
    boom = ValueError("shape mismatch")

    @adaptive(batch_size=4)
    def step(batch_size: int) -> None:
        raise boom

    with pytest.raises(ValueError) as info:
        step()
    assert info.value is boom
    assert stats()[step.adaptive_size.name].ooms == 0


def test_grow_back_never_reaches_a_size_that_failed():
    calls: list[list[int]] = []

    @adaptive(batch_size=64, grow_after=2)
    def step(batch_size: int) -> int:
        calls[-1].append(batch_size)
        work(batch_size)
        return batch_size

    with budget_after_warmup(52 * MiB):  # 24 x 2 MiB fits, 28 x 2 MiB does not
        for _ in range(9):
            calls.append([])
            step()
    assert calls[0] == [64, 32, 16]
    smallest_failed = None
    for tried in calls:  # every size but the last of a call ran out of memory
        for size in tried:
            assert smallest_failed is None or size < smallest_failed
        for size in tried[:-1]:
            smallest_failed = size if smallest_failed is None else min(smallest_failed, size)
    grows = [c for c in stats()[step.adaptive_size.name].changes if c.new > c.old]
    assert grows and grows[0].old == 16 and 16 < grows[0].new < 32  # grew after 2 clean calls
    assert "grow after 2 clean calls" in grows[0].reason
    assert calls[1:3] == [[16], [16]] and calls[3][0] == grows[0].new


def test_stats_summary_and_reset():
    @adaptive(batch_size=2, name="summary-probe")
    def step(batch_size: int) -> int:
        return batch_size

    step()
    step()
    summary = stats()
    assert summary["summary-probe"].calls == 2
    assert "summary-probe" in str(summary)
    reset_stats()
    assert stats()["summary-probe"].calls == 0 and stats()["summary-probe"].current == 2


def test_agreement_is_a_no_op_without_a_process_group():
    agreed = distributed.agree(12, True)
    assert (agreed.size, agreed.any_oom) == (12, True)


# accelerate-shaped helper ---------------------------------------------------------------

PER_SAMPLE_ACC = 4 * MiB


def work4(batch_size: int) -> int:
    x = torch.ones(batch_size, 1024, 1024)
    return int(x[:, 0, 0].sum())


def test_halving_sequence_from_128():
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int, tag: str) -> tuple[int, str]:
        tried.append(batch_size)
        return work4(batch_size), tag

    with budget_after_warmup(48 * MiB):  # 8 x 4 MiB fits, 16 x 4 MiB does not
        assert train("hello") == (8, "hello")
    assert tried == [128, 64, 32, 16, 8]


def test_bare_decorator_defaults_to_128():
    tried: list[int] = []

    @find_executable_batch_size
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        return batch_size

    assert train() == 128 and tried == [128]


@pytest.mark.parametrize("form", ["decorator", "direct"])
@pytest.mark.parametrize("arity", ["unary", "accelerate-nullary"])
def test_reduce_batch_size_fn_is_honoured(form, arity):
    tried: list[int] = []
    current = {"bs": 128}

    def minus_40(n: int) -> int:
        return n - 40

    def minus_40_nullary() -> int:  # accelerate's shape: the function tracks the size
        current["bs"] -= 40
        return current["bs"]

    reduce = minus_40 if arity == "unary" else minus_40_nullary

    def train(batch_size: int) -> int:
        tried.append(batch_size)
        return work4(batch_size)

    if form == "decorator":
        wrapped = find_executable_batch_size(starting_batch_size=128,
                                             reduce_batch_size_fn=reduce)(train)
    else:
        wrapped = find_executable_batch_size(train, 128, reduce)
    with budget_after_warmup(48 * MiB):
        assert wrapped() == 8
    assert tried == [128, 88, 48, 8]


def test_zero_start_raises():
    @find_executable_batch_size(starting_batch_size=0)
    def train(batch_size: int) -> None:
        raise AssertionError("never called")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        train()


def test_approaching_zero_raises():
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        return work4(batch_size + 20)  # >= 84 MiB at every size

    with budget_after_warmup(48 * MiB), pytest.raises(RuntimeError) as info:
        train()
    assert "No executable batch size found, reached zero." in str(info.value)
    assert tried == [16, 8, 4, 2, 1]


def test_helper_explicit_batch_size_is_a_type_error():
    @find_executable_batch_size(starting_batch_size=128)
    def f(batch_size: int, arg1: str, arg2: str) -> None:
        pass

    with pytest.raises(TypeError) as info:
        f(128, "hello", "world")
    assert "Batch size was passed into `f`" in str(info.value)
    assert "`f(hello, world)`" in str(info.value)


def test_helper_other_error_passes_through():
    @find_executable_batch_size(starting_batch_size=16)
    def f(batch_size: int) -> None:
        raise ValueError("Oops, we had an error!")

    with pytest.raises(ValueError, match="Oops, we had an error!"):
        f()
