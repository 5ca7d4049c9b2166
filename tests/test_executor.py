"""The executor on real CPU OOMs: retry at half, propagate other errors,
remember what worked (per name or per function, never per ``__qualname__``),
and give memory back after every failed attempt.

Every scenario with an expected OOM runs in a fresh process and returns plain
data that the test asserts on.
"""

from __future__ import annotations

import pytest
import torch
from conftest import budget_after_warmup, in_fresh_process
from test_adaptive import logged

from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.execute.retry import Halve, ReduceWith
from oomguard.engine.core.memory.oom import is_oom
from oomguard.engine.errors import ExecutionFailed
from oomguard.probes.host import proc_status

MiB = 1024**2


def step(batch_size: int) -> torch.Tensor:
    """A real computation whose memory grows with the batch: 2 MiB of activations per item."""
    torch.manual_seed(0)
    x = torch.randn(batch_size, 512, 1024)
    w = torch.randn(1024, 64)
    return (x @ w).relu().sum(dim=(1, 2))


def _oom_at_64() -> dict:
    direct = step(32)
    ex = Executor()
    seen: list[tuple[int, int]] = []  # (batch size, attempts in the record when it ran)

    def watched(batch_size: int) -> torch.Tensor:
        seen.append((batch_size, len(ex.history[-1].attempts)))
        return step(batch_size)

    with logged("oomguard.executor") as messages:
        with budget_after_warmup(100 * MiB):
            got = ex.run(watched, batch_size=64)
        first = ex.history[-1]
        with budget_after_warmup(100 * MiB):
            ex.run(watched, batch_size=64)
    return {"attempts": first.attempts, "errors": first.errors, "final": first.final,
            "retries": first.retries, "equal": torch.equal(got, direct), "seen": seen,
            "messages": messages, "next": ex.history[-1].attempts}


@pytest.mark.slow
def test_oom_at_64_becomes_success_at_32_equal_to_a_direct_run():
    got = in_fresh_process(_oom_at_64)
    assert got["attempts"] == [{"batch_size": 64}, {"batch_size": 32}]
    assert got["final"] == {"batch_size": 32} and got["retries"] == 1
    assert len(got["errors"]) == 1 and "DefaultCPUAllocator" in got["errors"][0]
    assert got["equal"] is True
    assert got["seen"][:2] == [(64, 1), (32, 2)]  # the record is up to date inside the call
    assert any("watched: batch_size 64 -> 32: out of memory" in m for m in got["messages"])
    assert any("succeeded at 32 after 1 retries" in m for m in got["messages"])
    assert got["next"] == [{"batch_size": 32}]  # the next call starts at the size that worked


def test_non_oom_error_propagates_untouched_without_retry():
    calls = []
    error = ValueError("bad label id 50257")

    def broken(batch_size: int) -> None:
        calls.append(batch_size)
        raise error

    ex = Executor()
    with pytest.raises(ValueError) as info:
        ex.run(broken, batch_size=64)
    assert info.value is error
    assert calls == [64]
    assert ex.history[-1].attempts == [{"batch_size": 64}] and ex.history[-1].errors == []


def _nothing_fits() -> dict:
    with budget_after_warmup(32 * MiB):
        with pytest.raises(ExecutionFailed) as info:
            Executor().run(lambda b: torch.ones(b, 64 * MiB // 4 + 1), batch_size=8, name="fisher")
    return {"tried": info.value.tried, "text": str(info.value), "workload": info.value.workload}


@pytest.mark.slow
def test_gives_up_naming_the_workload_and_every_size():
    got = in_fresh_process(_nothing_fits)
    assert got["tried"] == [{"batch_size": s} for s in (8, 4, 2, 1)]
    assert got["workload"] == "fisher"
    assert got["text"].startswith("fisher: no executable batch size: every size down to 1")
    assert "(tried 8, 4, 2, 1)" in got["text"]


def _two_knobs() -> tuple[list[tuple[int, int]], int]:
    seen = []

    def work(chunk_size: int, internal_batch_size: int) -> int:
        seen.append((chunk_size, internal_batch_size))
        torch.ones(chunk_size * internal_batch_size, 512 * 1024)  # 2 MiB per unit
        return chunk_size * internal_batch_size

    with budget_after_warmup(48 * MiB):
        out = Executor().run(work, sizes={"chunk_size": 16, "internal_batch_size": 8},
                             minimum={"internal_batch_size": 4})
    return seen, out


@pytest.mark.slow
def test_several_knobs_halve_together_down_to_their_minimums():
    seen, out = in_fresh_process(_two_knobs)
    assert seen == [(16, 8), (8, 4), (4, 4)]
    assert out == 16


def _minus_10_from_40() -> list[int]:
    ex = Executor(policy=ReduceWith(lambda n: n - 10))
    with budget_after_warmup(56 * MiB):  # 20 x 2 MiB fits, 30 x 2 MiB does not
        ex.run(step, batch_size=40)
    return [a["batch_size"] for a in ex.history[-1].attempts]


@pytest.mark.slow
def test_custom_policy_is_used():
    assert in_fresh_process(_minus_10_from_40) == [40, 30, 20]


def test_policies_stop_at_the_minimum():
    assert Halve().shrink({"b": 1}, {}) is None
    assert Halve().shrink({"b": 9}, {"b": 8}) == {"b": 8}
    assert ReduceWith(lambda n: n - 10).shrink({"b": 12}, {}) == {"b": 2}
    assert ReduceWith(lambda n: n - 10).shrink({"b": 5}, {"b": 2}) == {"b": 2}


def _twenty_cycles() -> dict:
    ex = Executor()
    step(8)  # warm every kernel the cycles will use
    with budget_after_warmup(100 * MiB):
        ex.run(step, batch_size=64, name="cycle-0")
        before = proc_status("VmRSS")
        for i in range(1, 21):  # a new name: nothing remembered, so 64 runs out again
            ex.run(step, batch_size=64, name=f"cycle-{i}")
        after = proc_status("VmRSS")
    return {"attempts": [len(r.attempts) for r in ex.history], "before": before, "after": after}


@pytest.mark.slow
def test_memory_returns_after_20_oom_retry_cycles():
    got = in_fresh_process(_twenty_cycles)
    assert got["attempts"] == [2] * 21
    assert abs(got["after"] - got["before"]) <= 0.02 * got["before"]


def per_item(nbytes: int):
    """A factory: every workload it makes has the same ``__qualname__``."""
    return lambda batch_size: float(torch.ones(batch_size, nbytes // 4)[:, 0].sum())


def _two_lambdas_from_one_factory() -> dict:
    big, small = per_item(4 * MiB), per_item(64 * 1024)
    assert big.__qualname__ == small.__qualname__
    ex = Executor()
    runs = {}
    with budget_after_warmup(48 * MiB):  # big: 8 x 4 MiB fits, 16 x 4 MiB does not
        for label, fn, name in (("big", big, None), ("small", small, None),
                                ("big again", big, None), ("named big", big, "shared"),
                                ("named small", small, "shared")):
            result = ex.run(fn, batch_size=64, name=name)
            runs[label] = ([a["batch_size"] for a in ex.history[-1].attempts], result)
    return runs


@pytest.mark.slow
def test_two_lambdas_from_one_factory_do_not_share_what_was_learnt():
    runs = in_fresh_process(_two_lambdas_from_one_factory)
    assert runs["big"] == ([64, 32, 16, 8], 8.0)
    assert runs["small"] == ([64], 64.0)  # fits at 64: it must not inherit big's 8
    assert runs["big again"] == ([8], 8.0)  # what big learnt stays with big
    # An explicit name is the caller saying "the same workload": shared on purpose.
    assert runs["named big"] == ([64, 32, 16, 8], 8.0)
    assert runs["named small"] == ([8], 8.0)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="positive integer"):
        Executor().run(step, batch_size=bad)


def test_giving_up_is_not_itself_an_oom():
    exc = ExecutionFailed("w", [{"batch_size": 1}], ["DefaultCPUAllocator: can't allocate memory"])
    assert not is_oom(exc)
