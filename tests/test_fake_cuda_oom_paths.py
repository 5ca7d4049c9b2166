"""CUDA paths a CPU host cannot reach, through tests/fakes/fake_cuda.py (torch 2.13's caching
and cudaMallocAsync allocators) and fake_nvml.py (nvidia-ml-py's pynvml over a fake driver):

- an OOM whose NVML process report fails (MIG slices, WSL2, locked-down containers) reaches
  Python as torch's ``NVML_SUCCESS == r INTERNAL ASSERT FAILED`` ``RuntimeError``;
- budgets and probes under ``backend:cudaMallocAsync``, whose fraction getter answers
  about 2e8 with no limit and creates a CUDA context;
- what users read off the allocator: block splitting, cuBLAS workspaces, memory outside
  the allocator, a MIG slice whose NVML total exceeds CUDA's.
"""

from __future__ import annotations

import sys
from typing import Any

import pynvml
import pytest
import torch
from fakes.fake_cuda import FakeCuda, GiB, KiB, MiB, nvml_assert_text
from fakes.fake_nvml import FakeDriver, FakeGpu, FakeMig, make_fake_pynvml

from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.memory import budget as budget_mod
from oomguard.engine.core.memory.budget import budget, current_fraction, headroom_bytes
from oomguard.engine.core.memory.forensics import cuda_view
from oomguard.engine.core.memory.oom import cuda_memory_near_limit, is_oom
from oomguard.probes import nvml, probe

ME, OTHER = 4242, 5151
BUS = "00000000:3B:00.0"
GPU_UUID = "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"
MIG_1G = "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb"


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget_mod, "_fractions", {})


def _driver(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> FakeDriver:
    """A fake pynvml for the probe (sys.modules) and for the allocator's OOM path."""
    drv = FakeDriver(**kw)
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml(drv))
    monkeypatch.setattr(nvml, "_state", {"tried": False, "error": None, "module": None})
    monkeypatch.setattr(nvml, "_own_pids", lambda: {ME})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return drv


def _mig_card(**kw: Any) -> FakeGpu:
    """An A100 in MIG mode; its 1g.10gb slice is ours (NVML: 10 GiB, no reserved part)."""
    return FakeGpu(uuid=GPU_UUID, pci_bus_id=BUS, used=4 * GiB, mig_slots=7,
                   processes=[(ME, 2 * GiB), (OTHER, 2 * GiB)],
                   migs={2: FakeMig(MIG_1G, "1g.10gb", total=10 * GiB, used=2 * GiB,
                                    processes=[(ME, 2 * GiB)])}, **kw)


def _slice(monkeypatch: pytest.MonkeyPatch, drv: FakeDriver, **kw: Any) -> FakeCuda:
    """Our MIG slice as torch sees it: CUDA's total is 256 MiB below NVML's."""
    return FakeCuda(total=10 * GiB - 256 * MiB, uuid=MIG_1G[4:], pci_bus_id=BUS, pid=ME,
                    nvml=sys.modules["pynvml"], **kw).install(monkeypatch)


# --- item 1: the NVML assert in the OOM path ------------------------------------------


def _grow(gpu: FakeCuda, per_item: int = 64 * MiB) -> Any:
    def step(batch_size: int) -> int:
        gpu.free(gpu.alloc(batch_size * per_item))
        return batch_size
    return step


def test_fake_cuda_mig_oom_whose_nvml_query_fails_is_retried_by_the_executor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    drv = _driver(monkeypatch, gpus=[_mig_card()])
    gpu = _slice(monkeypatch, drv)
    gpu.alloc(512 * MiB)  # the model
    with budget(3 * GiB, "cuda"):
        # 4 GiB at 64: after the failed request the allocator holds 512 MiB of a 3.5 GiB
        # cap and the slice is half free, so only its retry count says "at the limit".
        assert Executor(device="cuda:0").run(_grow(gpu), batch_size=64, name="mig") == 32
    assert (gpu.num_alloc_retries, gpu.num_ooms) == (1, 0)  # the OOM was never reported


def test_fake_cuda_nvml_assert_with_the_limit_not_met_propagates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    drv = _driver(monkeypatch, gpus=[_mig_card()])
    gpu = _slice(monkeypatch, drv)
    gpu.alloc(512 * MiB)
    calls: list[int] = []

    def step(batch_size: int) -> None:
        calls.append(batch_size)
        raise RuntimeError(nvml_assert_text("processes"))  # not from an allocation

    assert not cuda_memory_near_limit()
    with pytest.raises(RuntimeError, match="NVML_SUCCESS == r INTERNAL ASSERT FAILED"):
        Executor(device="cuda:0").run(step, batch_size=64)
    assert calls == [64]


CASES = {  # driver -> the assert torch's OOM path fails on
    "mig parent, not root": (dict(gpus=[_mig_card()]), {}, "processes"),
    "wsl2": (dict(gpus=[FakeGpu(GPU_UUID, BUS, process_error=pynvml.NVML_ERROR_NOT_SUPPORTED)]),
             {}, "processes"),
    "no driver libraries": (dict(gpus=[FakeGpu(GPU_UUID, BUS)],
                                 init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), {}, "init"),
    "bus id NVML does not know": (dict(gpus=[FakeGpu(GPU_UUID, "00000000:AF:00.0")]), {},
                                  "handle"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fake_cuda_oom_with_a_failed_nvml_report_is_an_oom_near_the_cap(
        monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    driver_kw, cuda_kw, which = CASES[case]
    drv = _driver(monkeypatch, **driver_kw)
    gpu = _slice(monkeypatch, drv, **cuda_kw)
    torch.cuda.set_per_process_memory_fraction(0.25)
    with pytest.raises(RuntimeError) as info:
        gpu.alloc(4 * GiB)
    exc = info.value
    assert type(exc) is RuntimeError and str(exc) == nvml_assert_text(which)
    assert is_oom(exc)  # before: False, and the search, Executor and jobs failed
    assert not is_oom(exc, memory_constrained=False)


def test_fake_cuda_oom_report_of_nvml_as_root_and_in_a_container(
        monkeypatch: pytest.MonkeyPatch) -> None:
    drv = _driver(monkeypatch, gpus=[_mig_card()], privileged=True)
    gpu = _slice(monkeypatch, drv)
    with pytest.raises(torch.OutOfMemoryError) as info:
        gpu.alloc(16 * GiB)
    assert "this process has 2.00 GiB memory in use. Process 5151 has 2.00 GiB" in str(info.value)
    drv.gpus[0].processes = [(ME, None)]  # a container: NVML_VALUE_NOT_AVAILABLE
    with pytest.raises(torch.OutOfMemoryError) as info:
        gpu.alloc(16 * GiB)
    assert "this process has 17179869184.00 GiB memory in use." in str(info.value)
    assert is_oom(info.value) and gpu.num_ooms == 2


# --- item 2: cudaMallocAsync ----------------------------------------------------------


@pytest.mark.parametrize("users", [None, 0.5], ids=["no-limit", "half"])
def test_fake_cuda_malloc_async_budget_gives_the_users_fraction_back(
        monkeypatch: pytest.MonkeyPatch, users: float | None) -> None:
    gpu = FakeCuda(backend="cudaMallocAsync").install(monkeypatch)
    if users is not None:
        torch.cuda.set_per_process_memory_fraction(users)
    else:
        assert torch.cuda.get_per_process_memory_fraction() > 1e8  # UINT64_MAX / total
    gpu.alloc(1 * GiB)
    with budget(2 * GiB, "cuda") as b:  # before: ValueError on exit, the cap left in force
        assert gpu.limit == b.limit == 3 * GiB
    assert gpu.limit == int((users or 1.0) * gpu.total)
    assert current_fraction(torch.device("cuda:0")) == (users or 1.0)


def test_fake_cuda_malloc_async_probe_creates_no_context(monkeypatch: pytest.MonkeyPatch) -> None:
    # An isolated search's parent probes the device; its children need the context's memory.
    _driver(monkeypatch, gpus=[FakeGpu(GPU_UUID, BUS, reserved=512 * MiB, used=1 * GiB,
                                       processes=[(OTHER, 1 * GiB)])])
    gpu = FakeCuda(total=40 * GiB - 512 * MiB, backend="cudaMallocAsync", has_context=False,
                   uuid=GPU_UUID[4:], pci_bus_id=BUS).install(monkeypatch)
    snap = probe("cuda:0")
    assert not gpu.has_context  # before: the fraction getter created one
    assert snap.extra["fraction_cap"] == gpu.total and snap.extra["nvml_mapped_by"] == "uuid"
    assert snap.free_bytes == 40 * GiB - 512 * MiB - 1 * GiB and snap.process_bytes == 0
    assert current_fraction(torch.device("cuda:0")) == 1.0 and not gpu.has_context
    assert not cuda_memory_near_limit() and not gpu.has_context


# --- the allocator as users read it -------------------------------------------------


def test_fake_cuda_oom_leaves_the_split_remainder_reserved(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeCuda().install(monkeypatch)
    gpu.alloc(5 * MiB)  # a 20 MiB segment, split: 15 MiB stay free in it
    gpu.free(gpu.alloc(100 * MiB))  # a cached, unsplit segment
    torch.cuda.set_per_process_memory_fraction(0.01)  # 163.84 MiB
    with pytest.raises(torch.OutOfMemoryError) as info:
        gpu.alloc(150 * MiB)
    # The OOM path released the unsplit 100 MiB segment, never the split one.
    assert "Of the allocated memory 5.00 MiB is allocated by PyTorch, and 15.00 MiB is " \
           "reserved by PyTorch but unallocated." in str(info.value)
    view = cuda_view(gpu.memory_stats(), gpu.memory_snapshot(), 0)
    assert view["reserved_bytes"][0] == 20 * MiB and view["allocated_bytes"][0] == 5 * MiB
    assert view["largest_free_block_bytes"][0] == 15 * MiB and view["num_alloc_retries"][0] == 1
    whole = FakeCuda().install(monkeypatch)
    whole.alloc(19 * MiB + 512 * KiB)  # the 512 KiB rest is not over 1 MiB: no split
    assert whole.memory_allocated() == 20 * MiB


@pytest.mark.parametrize(("sm", "held"), [((8, 0), 120 * MiB), ((9, 0), 164 * MiB)])
def test_fake_cuda_budget_after_a_warmup_charges_the_cublas_workspaces(
        monkeypatch: pytest.MonkeyPatch, sm: tuple[int, int], held: int) -> None:
    gpu = FakeCuda(major=sm[0], minor=sm[1]).install(monkeypatch)
    gpu.alloc(100 * MiB)
    gpu.cublas_warmup()  # forward and autograd threads: a workspace each, kept alive
    with budget(1 * GiB, "cuda") as b:
        assert b.limit == held + 1 * GiB
        gpu.free(gpu.alloc(1 * GiB))  # the whole budget is the trial's
        with pytest.raises(torch.OutOfMemoryError):
            gpu.alloc(1 * GiB + 2 * MiB)
    assert gpu.memory_stats()["allocation.all.current"] == 3


def test_fake_cuda_memory_outside_the_allocator_lowers_free_not_the_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeCuda(total=16 * GiB, context=512 * MiB, outside=1 * GiB).install(monkeypatch)
    gpu.alloc(1 * GiB)
    assert headroom_bytes("cuda") == 16 * GiB - 512 * MiB - 1 * GiB - 1 * GiB
    with budget(2 * GiB, "cuda") as b:
        assert b.limit == 3 * GiB and headroom_bytes("cuda") == 2 * GiB
        gpu.outside += 4 * GiB  # kernels loaded lazily: the cap does not see them
        assert headroom_bytes("cuda") == 2 * GiB


def test_fake_probe_mig_slice_total_is_what_cuda_can_use(monkeypatch: pytest.MonkeyPatch) -> None:
    drv = _driver(monkeypatch, gpus=[_mig_card()])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_1G)
    gpu = _slice(monkeypatch, drv)
    snap = probe("cuda:0")
    assert snap.extra["mig_profile"] == "1g.10gb"
    assert snap.total_bytes == gpu.total  # before: NVML's 10 GiB
    assert snap.free_bytes == 10 * GiB - 2 * GiB - 256 * MiB  # before: 256 MiB more
    with budget(2 * GiB, "cuda") as b:  # the fraction multiplies CUDA's total
        assert b.limit == 2 * GiB + gpu.reserved() == gpu.allowed


class _Step:
    """A workload on the fake slice: the warm-up holds 1 GiB, size n adds n * 256 MiB."""

    name = "fake-mig-step"

    def __init__(self, gpu: FakeCuda) -> None:
        self.gpu, self.held = gpu, None

    def warmup(self) -> None:
        if self.held is None:
            self.held = self.gpu.alloc(1 * GiB)

    def __call__(self, size: int) -> int:
        self.gpu.free(self.gpu.alloc(size * 256 * MiB))
        return size


def test_fake_cuda_search_on_a_mig_slice_counts_the_nvml_assert_as_an_oom(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from oomguard.engine.cli.options import search_config
    from oomguard.engine.core.search.search import search

    drv = _driver(monkeypatch, gpus=[_mig_card()])
    gpu = _slice(monkeypatch, drv)
    args = argparse.Namespace(start=8, budget=None, strategy="expand-bisect", size_step=None,
                              isolate=False, margin=0.15, trial_timeout=None, max_trials=40,
                              max_size=64)
    result = search(_Step(gpu), search_config(args, torch.device("cuda")))
    # 9.75 GiB - 0.5 GiB context - 1 GiB model = 8.25 GiB: 33 items of 256 MiB
    assert (result.max_ok, result.first_oom) == (33, 34)  # before: the search raised
    assert gpu.num_ooms == 0 and gpu.num_alloc_retries > 0


def test_fake_cuda_headroom_without_a_context_creates_none(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.is_initialized() is True once CUDA is initialised, context or not.
    gpu = FakeCuda(has_context=False).install(monkeypatch)
    assert headroom_bytes("cuda") is None and not gpu.has_context  # before: a context made
    gpu.alloc(1 * GiB)
    assert headroom_bytes("cuda") == gpu.total - gpu.context - 1 * GiB
