"""Memory budgets make real OOMs on CPU, and always give the old limit back."""

from __future__ import annotations

import resource

import pytest
import torch
from oomguard.engine.core.budget import MIN_CPU_BUDGET, BudgetError, active_budget, budget
from oomguard.engine.core.oom import is_oom
from oomguard.probes.host import meminfo

MiB = 1024**2


@pytest.fixture(autouse=True)
def _warm_up() -> None:
    # Thread pools and kernels created on first use must not be charged to a budget.
    torch.ones(4, 4).sum()


def test_allocation_over_the_budget_is_a_real_cpu_oom() -> None:
    with budget(256 * MiB) as b:
        assert b.mechanism == "RLIMIT_DATA" and active_budget() is b
        with pytest.raises(RuntimeError) as info:
            torch.empty(512 * MiB, dtype=torch.uint8)
        small = torch.ones(64 * MiB // 4)  # well inside: fits, and is really written
        assert float(small[-1]) == 1.0
        del small
    assert "DefaultCPUAllocator: can't allocate memory" in str(info.value)
    assert not isinstance(info.value, torch.OutOfMemoryError)  # CPU OOMs are plain RuntimeErrors
    assert is_oom(info.value)
    assert active_budget() is None


def test_rlimit_is_restored_on_exit_and_after_an_error_inside() -> None:
    before = resource.getrlimit(resource.RLIMIT_DATA)
    with budget(256 * MiB) as b:
        assert resource.getrlimit(resource.RLIMIT_DATA) == (b.limit, before[1])
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with budget(128 * MiB):
            torch.empty(1024 * MiB, dtype=torch.uint8)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    with pytest.raises(KeyError):
        with budget(128 * MiB):
            raise KeyError("not memory")
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert active_budget() is None
    torch.empty(512 * MiB, dtype=torch.uint8)  # the limit is really gone


def test_nested_budgets_only_shrink() -> None:
    with budget(256 * MiB) as outer:
        with budget(1024 * MiB) as looser:  # asks for more: gets the outer limit
            assert looser.limit <= outer.limit
            assert resource.getrlimit(resource.RLIMIT_DATA)[0] == looser.limit
            with pytest.raises(RuntimeError, match="can't allocate memory"):
                torch.empty(512 * MiB, dtype=torch.uint8)
        with budget(64 * MiB) as tighter:
            assert tighter.limit < outer.limit and active_budget() is tighter
            with pytest.raises(RuntimeError, match="can't allocate memory"):
                torch.empty(128 * MiB, dtype=torch.uint8)
        assert resource.getrlimit(resource.RLIMIT_DATA)[0] == outer.limit
        assert active_budget() is outer
        torch.ones(128 * MiB // 4)  # the outer budget still has room for it


@pytest.mark.parametrize(("nbytes", "device", "words"), [
    (0, "cpu", "positive"),
    (-MiB, "cpu", "positive"),
    (1.5 * 1024**3, "cpu", "positive"),  # not an int of bytes
    (MIN_CPU_BUDGET - 1, "cpu", "too small"),
    (None, "cpu", "positive"),
    (256 * MiB, "tpu", "unknown device"),
    (256 * MiB, "mps", "cpu and cuda"),
])
def test_bad_budgets_raise_one_line_budget_errors(nbytes: object, device: str, words: str) -> None:
    before = resource.getrlimit(resource.RLIMIT_DATA)
    with pytest.raises(BudgetError) as info:
        with budget(nbytes, device):  # type: ignore[arg-type]
            pass
    assert words in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_budget_larger_than_mem_available_is_refused() -> None:
    too_much = meminfo()["MemAvailable"] + 1024 * MiB
    with pytest.raises(BudgetError, match="available") as info:
        with budget(too_much):
            pass
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_budget_without_cuda_is_a_budget_error() -> None:
    for dev in ("cuda", "cuda:0"):
        with pytest.raises(BudgetError, match="no CUDA device") as info:
            with budget(256 * MiB, dev):
                pass
        assert "\n" not in str(info.value)
