"""GPU budgets and peaks against fake CUDA and MPS allocators (tests/fakes/fake_cuda.py,
fake_mps.py follow torch 2.13 and c10's allocators): what a CPU host cannot reach."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from fakes.fake_cuda import FakeCuda, GiB, KiB, MiB
from fakes.fake_mps import FakeMps

from oomguard.engine.core.memory import budget as budget_mod
from oomguard.engine.core.memory.budget import active_budget, budget, tighten_active_budget
from oomguard.engine.core.memory.oom import is_oom


@pytest.fixture(autouse=True)
def _no_remembered_fractions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget_mod, "_fractions", {}, raising=False)


def _ooms(device: Any, nbytes: int) -> str | None:
    """The OOM text of allocating ``nbytes`` on the fake, or None when it fits (then freed)."""
    try:
        handle = device.alloc(nbytes)
    except RuntimeError as exc:
        assert is_oom(exc)
        return str(exc)
    device.free(handle)
    return None


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(start=8, budget=None, strategy="expand-bisect", size_step=None, isolate=False,
                margin=0.15, trial_timeout=None, max_trials=40, max_size=64)
    return argparse.Namespace(**base | kw)


@dataclass
class FakeStep:
    """A workload on the fake GPU: warm-up holds ``model`` bytes, size n adds n * ``item``."""

    gpu: Any
    model: int = 2 * GiB
    item: int = 256 * MiB
    name: str = "fake-step"

    def warmup(self) -> None:
        if not hasattr(self, "_held"):
            self._held = self.gpu.alloc(self.model)

    def __call__(self, size: int) -> int:
        self.gpu.free(self.gpu.alloc(size * self.item))
        return size


@pytest.mark.slow
def test_fake_cuda_default_search_after_warmup_meets_the_device_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 1: the default budget used to be the free memory probed before the warm-up,
    # and warm-up + that budget > total raised BudgetError on an idle GPU.
    from oomguard.engine.cli.options import search_config as _search_config
    from oomguard.engine.core.search.search import search

    gpu = FakeCuda(total=16 * GiB, context=512 * MiB).install(monkeypatch)
    config = _search_config(_args(), torch.device("cuda"))
    result = search(FakeStep(gpu), config)
    # 16 GiB - 0.5 GiB context - 2 GiB model = 13.5 GiB = 54 items of 256 MiB
    assert (result.max_ok, result.first_oom) == (54, 55)


def test_fake_cuda_budget_does_not_count_cached_free_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 2: a warm-up that left 3 GiB cached made a 2 GiB budget allow 5 GiB.
    gpu = FakeCuda().install(monkeypatch)
    gpu.alloc(1 * GiB)  # the model, kept
    gpu.free(gpu.alloc(3 * GiB))  # warm-up scratch, now a cached free segment
    with budget(2 * GiB, "cuda") as b:
        assert b.limit == 3 * GiB
        assert _ooms(gpu, 2 * GiB - 64 * MiB) is None
        text = _ooms(gpu, 2 * GiB + 64 * MiB)
        assert text is not None and "CUDA out of memory. Tried to allocate 2.06 GiB" in text
        assert "3.00 GiB allowed;" in text
    assert gpu.get_per_process_memory_fraction() == 1.0 and active_budget() is None


def test_fake_cuda_budget_tightens_to_the_smallest_usage_seen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 2: memory the warm-up held at entry and freed later must not become room.
    gpu = FakeCuda().install(monkeypatch)
    gpu.alloc(1 * GiB)
    extra = gpu.alloc(1 * GiB)
    with budget(2 * GiB, "cuda"):
        gpu.free(extra)
        tighten_active_budget()  # run_trial does this before each trial
        assert _ooms(gpu, 2 * GiB + 512 * MiB) is not None
        assert _ooms(gpu, 2 * GiB - 64 * MiB) is None
    assert gpu.allowed is None


@pytest.mark.parametrize("getter", [True, False], ids=["torch>=2.6", "torch-2.4-2.5"])
def test_fake_cuda_nested_budget_gives_back_the_outer_fraction(
        monkeypatch: pytest.MonkeyPatch, getter: bool) -> None:
    # Item 8: without get_per_process_memory_fraction, leaving a budget restored 1.0.
    gpu = FakeCuda(total=16 * GiB, has_fraction_getter=getter).install(monkeypatch)
    with budget(4 * GiB, "cuda") as outer:
        with budget(1 * GiB, "cuda"):
            assert gpu.allowed == 1 * GiB
        assert gpu.allowed == outer.limit == 4 * GiB
    assert gpu.allowed is None


def test_fake_cuda_fraction_set_through_oomguard_survives_a_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 8: a user's own fraction, set through oomguard, on torch 2.4-2.5.
    from oomguard.engine.core.memory.budget import set_memory_fraction

    gpu = FakeCuda(total=16 * GiB, has_fraction_getter=False).install(monkeypatch)
    set_memory_fraction(0.5, "cuda")
    with budget(1 * GiB, "cuda"):
        assert gpu.allowed == 1 * GiB
    assert gpu.allowed == 8 * GiB


def test_fake_cuda_malloc_async_budget_and_peak_count_bytes_in_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 9: cudaMallocAsync caps bytes in use; its "reserved" is the pool's and keeps
    # freed memory, so a baseline or peak in reserved bytes is in the wrong units.
    from oomguard.engine.core.search.trial import run_trial

    gpu = FakeCuda(backend="cudaMallocAsync").install(monkeypatch)
    gpu.alloc(1 * GiB)
    gpu.free(gpu.alloc(3 * GiB))  # the pool keeps 3 GiB reserved
    with budget(512 * MiB, "cuda"):
        text = _ooms(gpu, 1 * GiB)
        assert text is not None and "would exceed allowed memory" in text
    step = 3 * MiB + 1
    with budget(step + 64 * KiB, "cuda") as b:
        trial = run_trial(lambda n: gpu.free(gpu.alloc(n)), step, "cuda")
    assert trial.ok and trial.peak_bytes == step <= b.nbytes  # reserved said 4 MiB


def test_fake_mps_budget_caps_driver_bytes_and_gives_the_default_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 12: budget() rejected MPS; the fraction is of the recommended working set.
    mps = FakeMps(recommended=16 * GiB).install(monkeypatch)
    mps.alloc(1 * GiB)
    mps.free(mps.alloc(2 * GiB))  # cached buffers, counted by the driver
    with budget(2 * GiB, "mps") as b:
        assert b.limit == 3 * GiB and b.device == "mps"
        assert _ooms(mps, 1536 * MiB) is None
        text = _ooms(mps, 2 * GiB + 512 * MiB)
        assert text is not None and text.startswith("MPS backend out of memory (MPS allocated:")
        assert "max allowed: 3.00 GiB" in text
    assert mps.ratio == 1.7


def test_fake_mps_search_config_defaults_to_isolated_trials_under_a_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from oomguard.engine.cli.options import search_config as _search_config

    mps = FakeMps(recommended=16 * GiB).install(monkeypatch)
    mps.alloc(1 * GiB)
    config = _search_config(_args(), torch.device("mps"))
    assert config.isolate and config.budget == 15 * GiB


def test_fake_cuda_isolated_bench_parent_holds_nothing_while_children_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # Item 7: the parent warmed its model up on the GPU (describe()) and kept it there
    # while the isolated children measured beside it.
    from oomguard.engine.cli.main import main
    from oomguard.engine.core import child as launcher
    from oomguard.engine.core.search import isolate
    from oomguard.engine.core.search.trial import Trial
    from oomguard.metrics.models import build_model
    from oomguard.metrics.train_step import TrainStep

    gpu = FakeCuda().install(monkeypatch)
    def warmup_on_the_fake_gpu(self: TrainStep) -> None:
        if not self._state:  # what warmup() builds, with its GPU bytes on the fake
            model = build_model(self.model, self.dtype, "cpu", seed=self.seed)
            self._state.update(model=model, vocab=model.config.vocab_size,
                               params=sum(p.numel() for p in model.parameters()),
                               on_gpu=gpu.alloc(600 * MiB))

    seen: list[tuple[int, int]] = []

    def child(self: Any, size: int, steps: int = 1) -> Trial:
        seen.append((gpu.memory_allocated(), gpu.memory_reserved()))
        return Trial(size=size, ok=size <= 40, peak_bytes=size * MiB if size <= 40 else None,
                     seconds=0.0, mode="isolated")

    monkeypatch.setattr(TrainStep, "warmup", warmup_on_the_fake_gpu)
    monkeypatch.setattr(isolate.IsolatedRunner, "__call__", child)
    monkeypatch.setattr(launcher, "start_forkserver", lambda preload=(): None)  # no server
    code = main(["bench", "--device", "cuda", "--isolate", "--budget", "1GiB", "--seq-len", "16",
                 "--max-size", "64", "--out", str(tmp_path / "r"), "--json"])
    assert code == 0 and seen and set(seen) == {(0, 0)}


def test_fake_windows_budget_imports_without_resource_and_says_why_no_cpu_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 10 (part): `import resource` at the top crashed every command on Windows.
    import importlib.util
    import sys

    from oomguard.engine.cli.options import default_budget
    from oomguard.engine.errors import BudgetError

    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` raises ImportError
    spec = importlib.util.spec_from_file_location("budget_on_windows", budget_mod.__file__)
    assert spec is not None and spec.loader is not None
    windows = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "budget_on_windows", windows)  # dataclasses look it up
    spec.loader.exec_module(windows)
    assert windows.resource is None and not windows.host_budgets_available()
    with pytest.raises(BudgetError) as info:
        windows.check_budget(256 * MiB, "cpu")
    text = str(info.value)
    assert "unavailable on this OS" in text and "without --budget" in text and "\n" not in text
    monkeypatch.setattr(budget_mod, "resource", None)
    assert default_budget(torch.device("cpu"), None) is None
