"""The workload protocol as a third party writes against it: ``oomguard.search``,
``oomguard.estimate`` and ``oomguard.Executor`` on a plain callable, on a workload object
with the optional hooks (``warmup``, ``worst_case_batch``, ``steps_per_trial``, ``name``,
``knob``), and on one with the estimate hooks (``estimate_peak``; ``for_estimate`` with
:func:`fake_module`, :func:`shortcut` and :func:`host_device`), all imported from
``oomguard.engine.core.workload``. The searches here stop at ``max_size`` (every size fits):
what is checked is how each hook is called, so no budget is set and no child started.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import oomguard
from oomguard.engine.core.search.strategies import Doubling
from oomguard.engine.core.workload import (
    RebuiltInChild,
    Workload,
    fake_module,
    host_device,
    shortcut,
)
from oomguard.engine.errors import TrialFailed, UsageError

WIDTH = 256  # float32 features per item: 1 KiB


def plain_step(batch_size: int) -> float:
    return float(torch.ones(batch_size, WIDTH).sum())


def test_a_plain_callable_is_a_workload_for_search_estimate_and_the_executor():
    step: Workload = plain_step
    result = oomguard.search(step, strategy=Doubling(start=1), max_size=8)
    assert result.max_ok == 8 and [t.size for t in result.trials] == [1, 2, 4, 8]
    assert result.workload == "plain_step" and result.size_name == "batch_size"
    assert not any(t.worst_case for t in result.trials) and result.trials[-1].value == 8 * WIDTH
    (e,) = oomguard.estimate(step, [4], workspace=False)
    assert e.peak_bytes == 4 * WIDTH * 4 + 4  # the ones tensor and its sum, a float32 scalar
    assert oomguard.Executor().run(step, batch_size=3) == 3 * WIDTH


class Padded:
    """A third party's workload: builds its layer in ``warmup()``, offers its most costly
    batch (every sample at full length), and runs two steps per trial."""

    name = "padded-encoder"
    knob = "micro_batch_size"
    steps_per_trial = 2
    max_len = 32

    def __init__(self) -> None:
        self.warmups = 0
        self.calls: list[tuple[int, int | None]] = []  # (size, longest sample given)
        self.layer: torch.nn.Module | None = None

    def warmup(self) -> None:
        self.warmups += 1
        self.layer = torch.nn.Linear(WIDTH, WIDTH)

    def worst_case_batch(self, size: int) -> torch.Tensor:
        return torch.full((size,), self.max_len)

    def __call__(self, size: int, batch: torch.Tensor | None = None) -> int:
        assert self.layer is not None, "called before warmup()"
        lengths = batch if batch is not None else torch.randint(1, self.max_len + 1, (size,))
        self.calls.append((size, None if batch is None else int(batch.max())))
        with torch.no_grad():
            self.layer(torch.ones(size, int(lengths.max()), WIDTH))
        return int(lengths.max())


def test_warmup_worst_case_batch_steps_name_and_knob_are_used_by_a_search():
    work = Padded()
    # In this process (fork=False), where the calls the workload records are seen here.
    result = oomguard.search(work, strategy=Doubling(start=2), max_size=8, fork=False)
    assert work.warmups == 1  # once, before the first trial
    assert result.max_ok == 8 and result.workload == "padded-encoder"
    assert result.size_name == "micro_batch_size"
    assert all(t.worst_case and t.steps == 2 and t.value == Padded.max_len
               for t in result.trials)
    # every step of every trial got the worst case, built at the trial's size
    assert work.calls == [(s, Padded.max_len) for s in (2, 4, 8) for _ in range(2)]
    # the real run calls fn(size): the executor never builds a worst case
    work.calls.clear()
    oomguard.Executor().run(work, batch_size=3)
    assert work.calls == [(3, None)]


class Rebuilt(RebuiltInChild):
    def __init__(self, width: int) -> None:
        self.width, self._state = width, {}

    def warmup(self) -> None:
        self._state["layer"] = torch.nn.Linear(self.width, self.width)

    def __call__(self, size: int) -> int:
        return int(self._state["layer"](torch.ones(size, self.width)).shape[0])


def test_rebuilt_in_child_ships_its_description_not_what_warmup_built():
    work = Rebuilt(WIDTH)
    work.warmup()
    copy = pickle.loads(pickle.dumps(work))
    assert copy.width == WIDTH and copy._state == {}  # rebuilt by warmup() in the child
    assert "layer" in work._state


class SaysItsPeak:
    """A workload that knows its own peak: an estimate asks it and runs nothing."""

    def estimate_peak(self, size: int, device: str) -> int:
        return 1000 * size + (1 if device.startswith("cuda") else 0)

    def __call__(self, size: int) -> None:
        raise AssertionError("an estimate with estimate_peak runs no work")


class Model:
    """A model workload with the estimate hooks: ``for_estimate`` gives a copy whose
    ``warmup()`` builds the model with :func:`fake_module` (no weights); the step repeats a
    layer ``repeats`` times, identical in memory, so an estimate may run it once
    (:func:`shortcut`); a per-step record stays on :func:`host_device`."""

    def __init__(self, device: str = "cpu", repeats: int = 3) -> None:
        self.device, self.repeats = device, repeats
        self.model: torch.nn.Module | None = None
        self.cut: bool | None = None
        self.host: str | None = None

    def for_estimate(self, device: str) -> Model:
        return Model(device, self.repeats)

    def warmup(self) -> None:
        def build() -> torch.nn.Module:
            return torch.nn.Linear(WIDTH, WIDTH)

        self.model = fake_module(build, self.device)

    def __call__(self, size: int) -> int:
        assert self.model is not None
        self.cut = shortcut(f"1 repeat of {self.repeats}")
        self.host = host_device()
        x = torch.ones(size, WIDTH, device=self.device)
        with torch.no_grad():  # no graph: each repeat frees the output before it
            for _ in range(1 if self.cut else self.repeats):
                x = self.model(x)
        return x.shape[0]


def test_the_estimate_hooks_as_a_third_party_writes_them():
    (own,) = oomguard.estimate(SaysItsPeak(), [4])
    assert own.peak_bytes == 4000 and own.method == "SaysItsPeak.estimate_peak"

    model = Model()
    (e,) = oomguard.estimate(model, [4], workspace=False)
    # the input and one layer's output (4 items x 1 KiB each); the fake weights were made
    # in warmup() and count nothing, and a repeat frees the output before it
    assert e.peak_bytes == 2 * 4 * WIDTH * 4
    assert "1 repeat of 3" in e.notes
    assert model.model is None  # the estimate ran its copy, never the workload itself
    (full,) = oomguard.estimate(model, [4], workspace=False, shortcuts=False)
    assert full.peak_bytes == e.peak_bytes and "1 repeat of 3" not in full.notes
    # outside an estimate: every repeat runs, bookkeeping on the cpu, no fake model
    assert not shortcut("outside") and host_device() == "cpu"
    with pytest.raises(RuntimeError, match="only inside"):
        model.warmup()


@pytest.mark.parametrize(("hook", "error"), [
    ("warmup", UsageError), ("for_estimate", UsageError), ("estimate_peak", UsageError),
    ("worst_case_batch", TrialFailed)])  # found by the trial, so the search's error says it
def test_a_hook_that_is_not_a_method_is_a_usage_error(hook: str, error: type[Exception]):
    class Broken:
        name = "broken"

        def __call__(self, size: int, batch: Any = None) -> int:
            return size

    setattr(Broken, hook, 3)
    with pytest.raises(error, match=f"broken: {hook} must be a method"):
        if hook in ("for_estimate", "estimate_peak"):
            oomguard.estimate(Broken(), [1], workspace=False)
        else:
            oomguard.search(Broken(), strategy=Doubling(start=1), max_size=1)
