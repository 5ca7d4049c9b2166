"""Searching a whole training step: ``search(step, restore=(model, optimizer))``.

A search of forward and backward alone misses the optimizer's state, which AdamW
allocates lazily at the first ``optimizer.step()`` (twice the parameters): the real loop
then runs out of memory at the size found. Searching the whole step needs each trial to
start from the user's state and the search to leave it untouched: :class:`Snapshot`.
Memory boundaries are real (a CPU budget) and asserted in fresh processes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import in_fresh_process

import oomguard
from oomguard.engine.core.snapshot import Snapshot
from oomguard.engine.errors import TrialFailed, UsageError

MiB = 1024**2
# A tiny GPT-2 with a large vocabulary against its width: 922k parameters (3.5 MiB) and
# about 0.8 MiB of activations per sequence of 8 tokens, so AdamW's state (7 MiB) is
# worth ~9 sequences. Under 40 MiB, forward+backward alone fitted 44-45 sequences and the
# whole step 34-35 (measured in two runs: 3-4 trials, 0.7 s; 50 steps at 35 took 3.4 s).
GPT = {"n_layer": 2, "n_embd": 128, "n_head": 2, "vocab_size": 4096, "n_positions": 8}
SEQ = GPT["n_positions"]
BUDGET = 40 * MiB


def _gpt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)  # state made at 1st step


class TrainStep:
    """The user's whole step at batch size n: forward, backward, optimizer.step(),
    zero_grad, on generated tokens (drawn from torch's global generator)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def __call__(self, n: int) -> float:
        ids = torch.randint(GPT["vocab_size"], (n, SEQ))
        out = self.model(input_ids=ids, labels=ids)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out.loss.item()


class ForwardBackward:
    """What a search could run before restore=: forward and backward, the grads dropped."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, n: int) -> float:
        ids = torch.randint(GPT["vocab_size"], (n, SEQ))
        out = self.model(input_ids=ids, labels=ids)
        out.loss.backward()
        self.model.zero_grad(set_to_none=True)
        return out.loss.item()


def _prepared() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh process's model and optimizer, thread pools warmed before any budget."""
    from oomguard.engine.core.memory.heap import return_freed_memory_to_os

    return_freed_memory_to_os()
    model, opt = _gpt()
    torch.ones(64, 64).matmul(torch.ones(64, 64))
    return model, opt


def _search_forward_backward(budget: int) -> int:
    model, _ = _prepared()
    # In this process, as such a search ran before restore= (forked trials find one to three
    # sizes more, where the real loop without a warm-up fails in its first backward).
    return oomguard.search(ForwardBackward(model), budget=budget, max_size=512,
                           fork=False).max_ok


def _real_loop(n: int, steps: int, budget: int, warm: bool = False) -> tuple[int, str] | None:
    """``steps`` steps of the real loop at ``n`` under ``budget``: None, or the step and
    the phase of the first OOM (the run stops there). ``warm``: one forward and backward at
    one row before the budget, as a script does (kernels, lazy setup; no optimizer state)."""
    model, opt = _prepared()
    if warm:
        ids = torch.randint(GPT["vocab_size"], (1, SEQ))
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    phase = ""
    with oomguard.budget(budget, "cpu"):
        for i in range(steps):
            try:
                ids = torch.randint(GPT["vocab_size"], (n, SEQ))
                phase = "forward"
                out = model(input_ids=ids, labels=ids)
                phase = "backward"
                out.loss.backward()
                phase = "optimizer.step"
                opt.step()
                phase = "zero_grad"
                opt.zero_grad(set_to_none=True)
            except Exception as exc:
                if oomguard.is_oom(exc):
                    return i, phase
                raise
    return None


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Everything restore promises, copied: values, grads, optimizer state and groups, RNG."""
    return {"tensors": {k: v.clone() for k, v in model.state_dict().items()},
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "opt_state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                          for i, s in enumerate(opt.state.values())},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "rng": torch.get_rng_state()}


def _same(a: dict, b: dict) -> dict[str, bool]:
    def equal(x, y) -> bool:
        if torch.is_tensor(x) or torch.is_tensor(y):
            return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and (
                x.shape == y.shape) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(
                equal(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(equal(i, j) for i, j in zip(x, y, strict=True))
        return x == y
    return {k: equal(a[k], b[k]) for k in a}


def _search_with_restore(budget: int) -> dict:
    model, opt = _prepared()
    before = _state(model, opt)
    params = [id(p) for p in model.parameters()]
    result = oomguard.search(TrainStep(model, opt), budget=budget, max_size=512,
                             restore=(model, opt))
    after = _state(model, opt)
    torch.set_rng_state(before["rng"])
    expected_draw = torch.rand(8)
    torch.set_rng_state(after["rng"])
    return {"max_ok": result.max_ok, "size_to_use": result.size_to_use,
            "steps": {t.steps for t in result.trials},
            "trials": len(result.trials), "same": _same(before, after),
            "grads_none": all(p.grad is None for p in model.parameters()),
            "opt_state_empty": len(opt.state) == 0,
            "same_objects": params == [id(p) for p in model.parameters()] and params == [
                id(p) for g in opt.param_groups for p in g["params"]],
            "next_draw_equal": torch.equal(torch.rand(8), expected_draw)}


@pytest.mark.slow
def test_whole_step_search_holds_for_the_run_and_leaves_state_untouched():
    # The defect: the size forward+backward allows fails in the real loop once the
    # first optimizer.step() has allocated AdamW's state (measured: in step 1's forward or
    # backward, with the state held; twice out of two at 44-45 against 34-35).
    old = in_fresh_process(_search_forward_backward, BUDGET)
    assert 20 <= old <= 80
    failed = in_fresh_process(_real_loop, old, 5, BUDGET)
    assert failed is not None, f"the real loop ran 5 steps at {old}"
    assert failed[0] == 1 or failed == (0, "optimizer.step"), failed  # not a steady step

    found = in_fresh_process(_search_with_restore, BUDGET)
    assert found["steps"] == {2}  # the first optimizer step and a steady one
    assert all(found["same"].values()), found["same"]
    assert found["grads_none"] and found["opt_state_empty"] and found["same_objects"]
    assert found["next_draw_equal"]
    assert 20 <= found["max_ok"] < old
    # The size to use holds for the run, warmed up as the search's trials are (measured with
    # forked trials: the largest size that ran, 38, ran 50 steps warmed up, 2 of 2, and ran
    # out at step 4 without the warm-up, 2 of 2; 37 ran 50 either way in 4 of 5).
    assert in_fresh_process(_real_loop, found["size_to_use"], 50, BUDGET, True) is None


def _bn_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
           zero: bool = True) -> None:
    for _ in range(steps):
        x = torch.randn(32, 6) + np.random.rand() + random.random()
        model(x).pow(2).mean().backward()
        opt.step()
        if zero:
            opt.zero_grad(set_to_none=True)


def test_snapshot_round_trip_restores_state_buffers_grads_and_rng():
    model, opt = _bn_model()
    _train(model, opt, 3, zero=False)  # state with step counters 3, grads present
    before = _state(model, opt)
    draws = (random.random, np.random.rand)
    rng_states = (random.getstate(), np.random.get_state())
    objects = [id(t) for t in [*model.parameters(), *model.buffers()]]
    snap = Snapshot.take((model, opt))
    expected_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    expected_bytes += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    expected_bytes += sum(v.numel() * v.element_size() for s in opt.state.values()
                          for v in s.values())
    assert expected_bytes < snap.nbytes < expected_bytes + 64 * 1024  # + RNG states

    _train(model, opt, 4)  # running stats, num_batches_tracked, state, counters all move
    opt.param_groups[0]["lr"] = 0.5
    assert not all(_same(before, _state(model, opt)).values())
    snap.restore()

    assert all(_same(before, _state(model, opt)).values()), _same(before, _state(model, opt))
    assert [s["step"].item() for s in opt.state.values()] == [3.0] * 6
    assert model[1].num_batches_tracked.item() == 3
    assert objects == [id(t) for t in [*model.parameters(), *model.buffers()]]  # in place
    assert [d() for d in draws] == [(random.setstate(rng_states[0]), random.random())[1],
                                    (np.random.set_state(rng_states[1]), np.random.rand())[1]]


def test_snapshot_of_a_fresh_optimizer_leaves_its_state_empty_again():
    model, opt = _bn_model()
    snap = Snapshot.take([model, opt])
    _train(model, opt, 2)
    assert len(opt.state) == 6
    snap.restore()
    assert len(opt.state) == 0 and all(p.grad is None for p in model.parameters())
    # the next step allocates the state as a fresh optimizer's first step does
    _train(model, opt, 1)
    assert [s["step"].item() for s in opt.state.values()] == [1.0] * 6


@pytest.mark.parametrize(("error", "raised"), [(ValueError, TrialFailed),
                                               (KeyboardInterrupt, KeyboardInterrupt)])
def test_search_restores_after_each_trial_and_when_it_raises(error, raised):
    model, opt = _bn_model()
    before = _state(model, opt)
    seen: list[tuple[int, int, int]] = []

    def step(n: int) -> int:
        seen.append((n, len(opt.state), int(model[1].num_batches_tracked)))
        _train(model, opt, 1)
        if n == 3:
            raise error("stopped in the middle of a step")
        return n

    with pytest.raises(raised):  # in this process: a fork's trials change only its copies
        oomguard.search(step, start=1, size_step=1, max_size=8, restore=(model, opt), fork=False)
    # every trial's first step saw the user's state: no optimizer state, counters at 0
    assert [s for s in seen if s[1] == 0] == [(1, 0, 0), (2, 0, 0), (3, 0, 0)]
    assert all(_same(before, _state(model, opt)).values())


class BatchNormStep:
    """A whole step of a small model with BatchNorm and AdamW; module-level, so an isolated
    child can unpickle it (with its own copy of the model and optimizer)."""

    def __init__(self) -> None:
        self.model, self.opt = _bn_model()

    def __call__(self, n: int) -> int:
        self.model(torch.randn(n, 6)).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return len(self.opt.state)


@pytest.mark.slow
def test_isolated_search_checks_restore_and_leaves_the_objects_here_alone():
    step = BatchNormStep()
    before = _state(step.model, step.opt)
    result = oomguard.search(step, start=2, size_step=1, max_size=3, isolate=True,
                             restore=(step.model, step.opt))
    assert [(t.size, t.ok, t.steps, t.value) for t in result.trials] == [
        (2, True, 2, 6), (3, True, 2, 6)]  # each child stepped its own copy twice
    assert all(_same(before, _state(step.model, step.opt)).values())
    assert len(step.opt.state) == 0
    with pytest.raises(UsageError, match="restore= takes"):
        oomguard.search(step, max_size=4, isolate=True, restore=(step.model, "opt"))


def test_verify_and_verify_steps_restore_too():
    step = BatchNormStep()
    before = _state(step.model, step.opt)
    done = oomguard.verify(step, 4, 3, restore=(step.model, step.opt))
    assert done["ok"] and done["steps"] == 3
    result = oomguard.search(step, start=2, size_step=1, max_size=3, verify_steps=2,
                             restore=(step.model, step.opt))
    assert result.verification["ok"] and [t.steps for t in result.trials] == [2, 2]
    assert all(_same(before, _state(step.model, step.opt)).values())
    assert len(step.opt.state) == 0


def test_restore_bad_input_is_one_usage_error_before_any_work():
    model, opt = _bn_model()
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    calls: list[int] = []
    cases = {(42,): "restore= takes torch.nn.Module and torch.optim.Optimizer objects",
             42: "restore= takes a tuple",
             (model, other): "2 of the 2 parameters that SGD updates are not parameters"}
    for restore, text in cases.items():
        with pytest.raises(UsageError, match=text) as err:
            oomguard.search(calls.append, max_size=4, restore=restore)
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="steps_per_trial must be at least 2"):
        oomguard.SearchConfig(restore=(model, opt), steps_per_trial=1)
    with pytest.raises(UsageError, match="restore= takes"):
        Snapshot.take(("model",))
    assert calls == []
