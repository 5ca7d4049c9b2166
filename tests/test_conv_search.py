"""Conv nets searched in the user's process on CPU: oneDNN compiles kernels for each input shape
and keeps them (its primitive cache), so in-process trials leave that memory behind and later
trials run out early. A search's trials run in forks of the process by default, so what a
trial leaves dies with it (docs/measurements.md#forked-trials). Real OOMs under real budgets;
every boundary asserted in fresh processes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import in_fresh_process, in_fresh_processes
from torch import nn

import oomguard
from oomguard.engine.core.memory.heap import return_freed_memory_to_os
from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.core.search.config import SearchConfig
from oomguard.engine.core.search.forked import ForkedRunner, fork_refused
from oomguard.engine.core.search.search import trial_mode
from oomguard.engine.core.search.trial import run_trial
from oomguard.reports import render_markdown
from oomguard.reports.json_report import summarise

MiB = 1 << 20
BUDGET = 28 * MiB
STEPS = 10  # a fresh process's maximum: the largest size that runs this many optimizer steps


class Block(nn.Module):
    """Conv-BN-ReLU twice, with the input added back."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.c2, self.b2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def _training_step(width: int = 8, side: int = 12):
    """The documented adoption: a closure over the user's model and AdamW, one optimizer step
    of ``n`` generated images per call (not picklable: isolated trials could not run it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                          nn.ReLU(), Block(width), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(n: int) -> float:
        x, y = torch.randn(n, 3, side, side), torch.randint(0, 10, (n,))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, model, opt


def _search(fork: bool) -> dict:
    return_freed_memory_to_os()
    step, model, opt = _training_step()
    # restore=: two steps per trial, the documented search of a training step. One step sees
    # only the first: a fresh process ran 564 for one step and 532 for two.
    result = oomguard.search(step, budget=BUDGET, start=64, fork=fork, restore=(model, opt))
    return {"max_ok": result.max_ok, "mode": result.mode,
            "modes": {t.mode for t in result.trials}, "trials": len(result.trials),
            "seconds": result.seconds}


def _fits(n: int) -> bool:
    """Whether a fresh process runs STEPS optimizer steps at ``n`` under the budget."""
    return_freed_memory_to_os()
    step, _, _ = _training_step()
    step(1)  # the warm-up a search runs too: thread pools and the size-1 kernels
    with oomguard.budget(BUDGET):
        return not any(isinstance(call_catching_oom(step, n), OOM) for _ in range(STEPS))


@pytest.fixture(scope="module")
def searched() -> dict[str, dict]:
    """The same search in two fresh processes: trials forked (the default), and in the process."""
    forked, in_process = in_fresh_processes(_search, [(True,), (False,)], workers=2)
    return {"forked": forked, "in-process": in_process}


@pytest.mark.slow
def test_a_conv_net_searched_in_its_own_process_lands_on_the_fresh_process_maximum(
        searched: dict[str, dict]) -> None:
    forked = searched["forked"]
    assert forked["mode"] == "forked" and forked["modes"] == {"forked"}, forked
    answer = forked["max_ok"]
    # Within 5% of the fresh-process maximum T: a fresh process runs ceil(answer / 1.05)
    # (so answer <= 1.05 T), and not floor(answer / 0.95) + 1 (so answer >= 0.95 T).
    low, high = math.ceil(answer / 1.05), math.floor(answer / 0.95) + 1
    assert in_fresh_processes(_fits, [(low,), (high,)], workers=2) == [True, False], forked


@pytest.mark.slow
def test_in_process_trials_keep_each_shapes_kernels_and_stop_far_below(
        searched: dict[str, dict]) -> None:
    old, forked = searched["in-process"], searched["forked"]
    assert old["mode"] == "in-process" and old["modes"] == {"in-process"}, old
    assert old["max_ok"] < 0.8 * forked["max_ok"], (old, forked)


def _kernel_bytes() -> int:
    """Bytes of this process's anonymous writable and executable mappings: oneDNN's compiled
    kernels (one set per input shape, kept by its primitive cache)."""
    total = 0
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split()
            if fields[1] == "rwxp" and len(fields) == 5:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                total += end - start
    return total


def _closure_search() -> dict:
    """A closure step searched in this process under a budget: what the search left in the
    process (kernels, the model's and the optimizer's values) and what it found."""
    step, model, opt = _training_step()
    step(1)  # the user's own first step: AdamW's state, the size-1 kernels
    before = [t.clone() for t in (*model.state_dict().values(), *(
        v for s in opt.state.values() for v in s.values()))]
    kernels = _kernel_bytes()
    result = oomguard.search(step, budget=BUDGET, start=16, max_size=48)
    after = [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]
    return {"mode": result.mode, "modes": {t.mode for t in result.trials},
            "sizes": [t.size for t in result.trials], "max_ok": result.max_ok,
            "values": [t.value for t in result.trials],
            "same": len(before) == len(after) and all(
                torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "kernels_added": _kernel_bytes() - kernels}


def test_a_closure_step_is_searched_in_forks_that_leave_its_process_and_objects_as_they_were(
        ) -> None:
    found = _closure_search()
    assert found["mode"] == "forked" and found["modes"] == {"forked"}, found
    assert found["max_ok"] == 48 and 48 in found["sizes"], found
    assert all(math.isfinite(v) for v in found["values"]), found  # each trial's loss came back
    # The model's weights, BatchNorm's running statistics and AdamW's moments: unchanged, with
    # no restore= (each trial changed its fork's copies), and no kernel compiled here.
    assert found["same"], found
    assert found["kernels_added"] == 0, found


def _threads_search() -> list[int]:
    """Two threads in a process whose OpenMP pool exists: each forked trial's thread count."""
    torch.set_num_threads(2)
    torch.ones(1 << 22).sum()  # a parallel op: libgomp's pool has its second thread now
    step, _, _ = _training_step()

    def counted(n: int) -> int:
        step(n)
        return torch.get_num_threads()

    result = oomguard.search(counted, budget=BUDGET, start=8, max_size=16, trial_timeout=60)
    return [t.value for t in result.trials]


@pytest.mark.slow
def test_a_forked_trial_runs_the_parents_threads_without_hanging() -> None:
    # A fork keeps GNU OpenMP's pool but not its threads: without releasing it first, the
    # child's first two-thread op waited forever (measured, docs/measurements.md#forked-trials).
    assert in_fresh_process(_threads_search) == [2, 2]


def test_forks_run_only_cpu_trials_and_fork_false_runs_them_here() -> None:
    assert fork_refused(torch.device("cuda")) is not None
    assert fork_refused(torch.device("cpu")) is None  # Linux, no CUDA context in the tests
    assert trial_mode(SearchConfig()) == "forked"
    assert trial_mode(SearchConfig(fork=False)) == "in-process"
    assert trial_mode(SearchConfig(isolate=True)) == "isolated"
    result = oomguard.search(lambda n: n, fork=False, max_size=4)
    assert result.mode == "in-process" and {t.mode for t in result.trials} == {"in-process"}


def test_a_forked_search_says_so_in_its_report() -> None:
    result = oomguard.search(lambda n: n, max_size=4)
    assert result.mode == "forked" and {t.mode for t in result.trials} == {"forked"}
    assert "- **Mode**: forked: each trial ran in a fork" in render_markdown(result)
    assert summarise(result)["mode_note"].startswith("forked: each trial in a fork")


def test_a_forked_trials_resident_peak_is_the_one_the_process_itself_measures() -> None:
    # A fork maps none of the parent's library code; a trial that faulted it back in read
    # 11-33 MiB more than in the process (docs/measurements.md#forked-trials).
    step, _, _ = _training_step()
    step(1)
    step(16)  # this size's kernels exist: neither trial compiles any
    device = torch.device("cpu")
    here = run_trial(step, 16, device)
    forked = ForkedRunner(step, device, None, 60.0)(16)
    assert forked.mode == "forked" and forked.ok and here.ok
    assert abs(forked.peak_bytes - here.peak_bytes) < 2 * MiB, (forked.peak_bytes, here.peak_bytes)
