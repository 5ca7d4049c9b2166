"""The executor on real CPU OOMs: retry at half, propagate other errors,
remember what worked, and give memory back after every failed attempt."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import budget_after_warmup
from oomguard.engine.core.executor import ExecutionFailed, Executor, Halve, ReduceWith
from oomguard.probes.host import proc_status

MiB = 1024**2


def step(batch_size: int) -> torch.Tensor:
    """A real computation whose memory grows with the batch: 2 MiB of activations per item."""
    torch.manual_seed(0)
    x = torch.randn(batch_size, 512, 1024)
    w = torch.randn(1024, 64)
    return (x @ w).relu().sum(dim=(1, 2))


def test_oom_at_64_becomes_success_at_32_equal_to_a_direct_run(caplog):
    direct = step(32)
    ex = Executor()
    with caplog.at_level(logging.WARNING, logger="oomguard.executor"):
        with budget_after_warmup(100 * MiB):
            got = ex.run(step, batch_size=64)
    assert ex.history[-1].attempts == [{"batch_size": 64}, {"batch_size": 32}]
    assert "DefaultCPUAllocator" in ex.history[-1].errors[0]
    assert torch.equal(got, direct)
    assert any("retrying at 32" in r.message for r in caplog.records)
    # The next call in this process starts at the size that worked.
    with budget_after_warmup(100 * MiB):
        ex.run(step, batch_size=64)
    assert ex.history[-1].attempts == [{"batch_size": 32}]


def test_non_oom_error_propagates_untouched_without_retry():
    calls = []

    def broken(batch_size: int) -> None:
        calls.append(batch_size)
        raise ValueError("bad label id 50257")

    with pytest.raises(ValueError, match="bad label id 50257"):
        Executor().run(broken, batch_size=64)
    assert calls == [64]


def test_gives_up_naming_the_workload_and_every_size():
    with budget_after_warmup(32 * MiB):
        with pytest.raises(ExecutionFailed) as info:
            Executor().run(lambda b: torch.ones(b, 64 * MiB // 4 + 1), batch_size=8, name="fisher")
    assert info.value.tried == [{"batch_size": s} for s in (8, 4, 2, 1)]
    assert "fisher" in str(info.value) and "8, 4, 2, 1" in str(info.value)


def test_several_knobs_halve_together_down_to_their_minimums():
    seen = []

    def work(chunk_size: int, internal_batch_size: int) -> int:
        seen.append((chunk_size, internal_batch_size))
        torch.ones(chunk_size * internal_batch_size, 512 * 1024)  # 2 MiB per unit
        return chunk_size * internal_batch_size

    with budget_after_warmup(48 * MiB):
        out = Executor().run(work, sizes={"chunk_size": 16, "internal_batch_size": 8},
                             minimum={"internal_batch_size": 4})
    assert seen == [(16, 8), (8, 4), (4, 4)]
    assert out == 16


def test_custom_policy_is_used():
    ex = Executor(policy=ReduceWith(lambda n: n - 10))
    with budget_after_warmup(48 * MiB):
        ex.run(step, batch_size=40)
    assert [a["batch_size"] for a in ex.history[-1].attempts][:2] == [40, 30]
    assert Halve().shrink({"b": 1}, {}) is None


def test_memory_returns_after_20_oom_retry_cycles():
    ex = Executor()
    step(8)  # warm every kernel the cycles will use
    with budget_after_warmup(100 * MiB):
        ex.run(step, batch_size=64)
        before = proc_status("VmRSS")
        for _ in range(20):
            ex.known.clear()
            ex.run(step, batch_size=64)
        after = proc_status("VmRSS")
    assert all(len(r.attempts) == 2 for r in ex.history)
    assert abs(after - before) <= 0.02 * before


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="positive integer"):
        Executor().run(step, batch_size=bad)


def test_giving_up_is_not_itself_an_oom():
    from oomguard.engine.core.oom import is_oom

    exc = ExecutionFailed("w", [{"batch_size": 1}], ["DefaultCPUAllocator: can't allocate memory"])
    assert not is_oom(exc)
