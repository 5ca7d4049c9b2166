"""The decorator and the accelerate-shaped helper, with real OOMs under a CPU budget.

Each sample of the workloads below really allocates ``PER_SAMPLE`` bytes; the
budget decides which batch sizes fit. Nothing raises on a threshold. Every
scenario with an expected OOM runs in a fresh process (``in_fresh_process``),
so what ran before in this process cannot move the boundary; it returns plain
data that the test asserts on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import budget_after_warmup, in_fresh_process

from oomguard.engine.core.execute.executor import SizeController
from oomguard.engine.core.execute.stats import MAX_SIZES_KEPT, register, reset_stats, stats
from oomguard.engine.errors import ExecutionFailed, NoExecutableBatchSize
from oomguard.engine.training import distributed
from oomguard.engine.training.adaptive import adaptive, find_executable_batch_size

MiB = 1024**2
PER_SAMPLE = 2 * MiB  # float32 [512, 1024]


def work(batch_size: int) -> float:
    """A real allocation of ``batch_size * PER_SAMPLE`` bytes, touched."""
    x = torch.ones(batch_size, 512, 1024)
    return float(x[:, 0, 0].sum())


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The messages of logger ``name`` at INFO and above, while inside (a child has no caplog)."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _decorator_at_48_mib() -> dict:
    tried: list[int] = []

    @adaptive(batch_size=64)
    def step(batch_size: int, scale: float) -> tuple[int, float]:
        tried.append(batch_size)
        return batch_size, work(batch_size) * scale

    with logged("oomguard.adaptive") as messages:
        with budget_after_warmup(48 * MiB):  # 16 x 2 MiB fits, 32 x 2 MiB does not
            result = step(2.0)
            again = step(1.0)
    s = stats()[step.adaptive_size.name]
    return {"tried": tried, "result": result, "again": again,
            "stats": (s.start, s.current, s.calls, s.ooms, s.shrinks, s.failed),
            "changes": [(c.old, c.new) for c in s.changes], "messages": messages}


@pytest.mark.slow
def test_decorator_ooms_at_64_and_32_and_returns_the_result_at_16():
    got = in_fresh_process(_decorator_at_48_mib)
    assert got["tried"] == [64, 32, 16, 16]
    assert got["result"] == (16, 32.0)
    assert got["again"] == (16, 16.0)
    assert got["stats"] == (64, 16, 2, 2, 2, 32)
    assert got["changes"] == [(64, 32), (32, 16)]
    changes = [m for m in got["messages"] if "->" in m]
    assert len(changes) == 2
    assert "batch_size 64 -> 32: out of memory" in changes[0]
    assert "batch_size 32 -> 16: out of memory" in changes[1]
    assert any("succeeded at 16 after 2 retries" in m for m in got["messages"])


def _every_size_runs_out() -> dict:
    tried: list[int] = []

    @adaptive(batch_size=8)
    def step(batch_size: int) -> float:
        tried.append(batch_size)
        return work(batch_size + 40)  # >= 82 MiB at every size

    with budget_after_warmup(48 * MiB), pytest.raises(NoExecutableBatchSize) as info:
        step()
    return {"tried": tried, "text": str(info.value), "sizes": info.value.tried,
            "is_execution_failed": isinstance(info.value, ExecutionFailed),
            "errors": info.value.errors}


@pytest.mark.slow
def test_every_size_out_of_memory_is_a_clear_error():
    got = in_fresh_process(_every_size_runs_out)
    assert got["tried"] == [8, 4, 2, 1]
    assert "no executable batch size: every size down to 1 ran out of memory" in got["text"]
    assert "tried 8, 4, 2, 1" in got["text"]
    assert got["is_execution_failed"] is True
    assert got["sizes"] == [{"batch_size": s} for s in (8, 4, 2, 1)]
    assert len(got["errors"]) == 4
    assert all("DefaultCPUAllocator" in e for e in got["errors"])


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


def _grow_back_at_52_mib() -> dict:
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
    changes = step.adaptive_size.stats.changes
    return {"calls": calls, "changes": [(c.old, c.new, c.reason) for c in changes]}


@pytest.mark.slow
def test_grow_back_never_reaches_a_size_that_failed():
    got = in_fresh_process(_grow_back_at_52_mib)
    calls = got["calls"]
    assert calls[0] == [64, 32, 16]
    smallest_failed = None
    for tried in calls:  # every size but the last of a call ran out of memory
        for size in tried:
            assert smallest_failed is None or size < smallest_failed
        for size in tried[:-1]:
            smallest_failed = size if smallest_failed is None else min(smallest_failed, size)
    grows = [c for c in got["changes"] if c[1] > c[0]]
    assert grows[0][0] == 16 and 16 < grows[0][1] < 32  # grew after 2 clean calls
    assert "grow after 2 clean calls" in grows[0][2]
    assert calls[1:3] == [[16], [16]] and calls[3][0] == grows[0][1]


def test_stats_summary_and_reset():
    @adaptive(batch_size=2, name="summary-probe")
    def step(batch_size: int) -> int:
        return batch_size

    step()
    step()
    summary = stats()
    name = step.adaptive_size.name
    assert name.startswith("summary-probe")
    assert summary[name].calls == 2
    assert name in str(summary)
    reset_stats()
    assert stats()[name].calls == 0 and stats()[name].current == 2


def test_stats_keep_only_the_most_recent_sizes():
    names = [register("bounded-probe", 1).name for _ in range(MAX_SIZES_KEPT + 500)]
    kept = stats().sizes
    assert list(kept) == names[-MAX_SIZES_KEPT:]  # the most recent, oldest first
    assert len(set(kept)) == MAX_SIZES_KEPT  # names are unique among the sizes kept


def test_registering_a_taken_name_takes_constant_time():
    register("taken-probe", 1)
    start = time.perf_counter()
    for _ in range(20_000):  # a search for a free "#N" suffix would be ~2e8 steps here
        register("taken-probe", 1)
    assert time.perf_counter() - start < 2.0


def test_agreement_is_a_no_op_without_a_process_group():
    agreed = distributed.agree(12, True)
    assert (agreed.size, agreed.any_oom) == (12, True)
    assert distributed.RankAgreement().active() is False


class FakeRanks:
    """An agreement strategy that plays back what the other ranks answer (no real ranks)."""

    def __init__(self, answers: list[tuple[dict[str, int], bool]]) -> None:
        self.answers = answers
        self.asked: list[tuple[dict[str, int], bool]] = []

    def active(self) -> bool:
        return True

    def agree(self, proposal, oom):
        self.asked.append((dict(proposal), oom))
        return self.answers.pop(0)


def test_fake_peer_oom_from_the_agreement_strategy_reruns_at_the_agreed_size():
    ranks = FakeRanks([({"batch_size": 32}, False),  # the start: everyone starts at 32
                       ({"batch_size": 8}, True),  # another rank ran out of memory at 32
                       ({"batch_size": 8}, False)])  # everyone ran 8
    tried: list[int] = []

    def step(sizes: dict[str, int]) -> int:
        tried.append(sizes["batch_size"])
        return sizes["batch_size"]

    size = SizeController("fake-peer", {"batch_size": 32}, agreement=ranks)
    assert size.run(step) == 8
    assert tried == [32, 8]
    assert ranks.asked == [({"batch_size": 32}, False), ({"batch_size": 32}, False),
                           ({"batch_size": 8}, False)]
    s = size.stats
    assert (s.current, s.ooms, s.peer_ooms, s.shrinks, s.failed) == (8, 0, 1, 1, 32)


# accelerate-shaped helper ---------------------------------------------------------------

PER_SAMPLE_ACC = 4 * MiB


def work4(batch_size: int) -> int:
    x = torch.ones(batch_size, 1024, 1024)
    return int(x[:, 0, 0].sum())


def _accelerates_sizes_from_128() -> tuple[tuple[int, str], list[int]]:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int, tag: str) -> tuple[int, str]:
        tried.append(batch_size)
        return work4(batch_size), tag

    with budget_after_warmup(48 * MiB):  # 11 x 4 MiB fits, 13 x 4 MiB does not
        return train("hello"), tried


@pytest.mark.slow
def test_default_sizes_are_accelerates_from_128():
    """accelerate >= 1.9 multiplies by 0.9 per OOM (int(size * 0.9)), and so does its drop-in."""
    result, tried = in_fresh_process(_accelerates_sizes_from_128)
    assert result == (11, "hello")
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19,
                     17, 15, 13, 11]


def test_bare_decorator_defaults_to_128():
    tried: list[int] = []

    @find_executable_batch_size
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        return batch_size

    assert train() == 128 and tried == [128]


def _reduced_by_40(form: str, arity: str) -> tuple[int, list[int]]:
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
        return wrapped(), tried


@pytest.mark.slow
@pytest.mark.parametrize("form", ["decorator", "direct"])
@pytest.mark.parametrize("arity", ["unary", "accelerate-nullary"])
def test_reduce_batch_size_fn_is_honoured(form, arity):
    result, tried = in_fresh_process(_reduced_by_40, form, arity)
    assert result == 8
    assert tried == [128, 88, 48, 8]


def test_zero_start_raises():
    @find_executable_batch_size(starting_batch_size=0)
    def train(batch_size: int) -> None:
        raise AssertionError("never called")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        train()


def _approaching_zero() -> tuple[str, list[int]]:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        return work4(batch_size + 20)  # >= 84 MiB at every size

    with budget_after_warmup(48 * MiB), pytest.raises(RuntimeError) as info:
        train()
    return str(info.value), tried


@pytest.mark.slow
def test_approaching_zero_raises():
    text, tried = in_fresh_process(_approaching_zero)
    assert "No executable batch size found, reached zero." in text
    assert tried == [16, 14, 12, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1]


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
