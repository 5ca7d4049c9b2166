"""Memory budgets make real OOMs on CPU, and always give the old limit back."""

from __future__ import annotations

import resource

import pytest
import torch
from conftest import in_fresh_process

from oomguard.engine.core.memory.budget import (
    MIN_CPU_BUDGET,
    BudgetError,
    active_budget,
    budget,
    check_budget,
)
from oomguard.engine.core.memory.heap import freed_memory_returned, trim_heap
from oomguard.engine.core.memory.oom import is_oom
from oomguard.probes.host import meminfo

MiB = 1024**2


@pytest.fixture(autouse=True)
def _warm_up() -> None:
    # Thread pools and kernels created on first use must not be charged to a budget.
    torch.ones(4, 4).sum()


def _oom_over_the_budget() -> dict:
    torch.ones(4, 4).sum()
    with budget(256 * MiB) as b:
        seen = {"mechanism": b.mechanism, "active": active_budget() is b}
        try:
            torch.empty(512 * MiB, dtype=torch.uint8)
        except RuntimeError as exc:
            seen.update(error=str(exc), is_oom=is_oom(exc),
                        typed=isinstance(exc, torch.OutOfMemoryError))
        small = torch.ones(64 * MiB // 4)  # well inside: fits, and is really written
        seen["small"] = float(small[-1])
        del small
    seen["active after"] = active_budget()
    return seen


@pytest.mark.slow
def test_allocation_over_the_budget_is_a_real_cpu_oom() -> None:
    seen = in_fresh_process(_oom_over_the_budget)
    assert seen["mechanism"] == "RLIMIT_DATA" and seen["active"]
    assert "DefaultCPUAllocator: can't allocate memory" in seen["error"]
    assert seen["is_oom"] and not seen["typed"]  # CPU OOMs are plain RuntimeErrors
    assert seen["small"] == 1.0 and seen["active after"] is None


def _limits_around_budgets() -> list:
    torch.ones(4, 4).sum()
    seen = []
    before = resource.getrlimit(resource.RLIMIT_DATA)
    with budget(256 * MiB) as b:
        seen.append(resource.getrlimit(resource.RLIMIT_DATA) == (b.limit, before[1]))
    seen.append(resource.getrlimit(resource.RLIMIT_DATA) == before)
    try:
        with budget(128 * MiB):
            torch.empty(1024 * MiB, dtype=torch.uint8)
    except RuntimeError as exc:
        seen.append("can't allocate memory" in str(exc))
    seen.append(resource.getrlimit(resource.RLIMIT_DATA) == before)
    try:
        with budget(128 * MiB):
            raise KeyError("not memory")
    except KeyError:
        seen.append(resource.getrlimit(resource.RLIMIT_DATA) == before)
    seen.append(active_budget() is None)
    torch.empty(512 * MiB, dtype=torch.uint8)  # the limit is really gone
    seen.append("allocated after")
    return seen


@pytest.mark.slow
def test_rlimit_is_restored_on_exit_and_after_an_error_inside() -> None:
    assert in_fresh_process(_limits_around_budgets) == [True] * 6 + ["allocated after"]


def _nested_budgets() -> list:
    torch.ones(4, 4).sum()
    seen = []

    def ooms(nbytes: int) -> bool:
        try:
            torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as exc:
            return "can't allocate memory" in str(exc)
        return False

    with budget(256 * MiB) as outer:
        with budget(1024 * MiB) as looser:  # asks for more: gets the outer limit
            seen += [looser.limit <= outer.limit,
                     resource.getrlimit(resource.RLIMIT_DATA)[0] == looser.limit,
                     ooms(512 * MiB)]
        with budget(64 * MiB) as tighter:
            seen += [tighter.limit < outer.limit, active_budget() is tighter, ooms(128 * MiB)]
        seen += [resource.getrlimit(resource.RLIMIT_DATA)[0] == outer.limit,
                 active_budget() is outer, not ooms(128 * MiB)]  # the outer budget has room
    return seen


@pytest.mark.slow
def test_nested_budgets_only_shrink() -> None:
    assert in_fresh_process(_nested_budgets) == [True] * 9


@pytest.mark.parametrize(("nbytes", "device", "words"), [
    (0, "cpu", "positive"),
    (-MiB, "cpu", "positive"),
    (1.5 * 1024**3, "cpu", "positive"),  # not an int of bytes
    (True, "cpu", "positive"),  # a bool is not a number of bytes
    (MIN_CPU_BUDGET - 1, "cpu", "too small"),
    (None, "cpu", "positive"),
    (256 * MiB, "tpu", "unknown device"),
    (256 * MiB, "mps", "no MPS device"),  # MPS budgets exist; this host has no MPS
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


def test_check_budget_makes_the_entry_checks_without_a_budget() -> None:
    before = resource.getrlimit(resource.RLIMIT_DATA)
    assert check_budget(64 * MiB, "cpu") == torch.device("cpu")
    assert resource.getrlimit(resource.RLIMIT_DATA) == before and active_budget() is None
    with pytest.raises(BudgetError, match="too small"):
        check_budget(MIN_CPU_BUDGET - 1)


def test_glibc_helpers_answer_on_linux() -> None:
    with freed_memory_returned() as ok:
        assert ok is True
    assert isinstance(trim_heap(), bool)  # 1 if memory went back, 0 if there was none


def _mapped_inside_and_after(for_good: bool) -> list[bool]:
    """In a fresh process: whether a 1 MiB block is a mapping of its own (glibc's mmap
    threshold below it) inside a budget, after an inner budget ends, and after the budget."""
    import ctypes

    from oomguard.engine.core.memory import heap

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped() -> bool:
        # With the heap's free chunks filled: glibc maps a block only where none can hold it
        with heap.heap_plugged():
            before = heap._mallinfo2().hblks
            block = libc.malloc(1 << 20)
            grew = heap._mallinfo2().hblks > before
            libc.free(block)
        return grew

    if for_good:  # as every child oomguard starts and measures does
        heap.return_freed_memory_to_os()
    with budget(64 * MiB):
        inside = mapped()
        with budget(32 * MiB):
            pass
        after_inner = mapped()
    return [inside, after_inner, mapped()]


@pytest.mark.slow
def test_a_budget_returns_large_frees_to_the_os_and_leaves_glibc_fast_after_it() -> None:
    # Inside: 128 KiB and more is mapped, so a free leaves VmData. After the outermost
    # budget, large blocks come from the heap again (a training step at 128 KiB costs 1.8x
    # its time in page faults), unless the process set the threshold for good.
    assert in_fresh_process(_mapped_inside_and_after, False) == [True, True, False]
    assert in_fresh_process(_mapped_inside_and_after, True) == [True, True, True]
