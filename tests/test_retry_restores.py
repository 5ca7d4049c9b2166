"""A retry starts from the attempt's start: BatchNorm's buffers, whole loops, global modules.

- A forward pass updates BatchNorm's ``running_mean``, ``running_var`` and
  ``num_batches_tracked`` in place. A retry after an OOM later in the step puts them back,
  as it clears the gradients (before this fix: ``num_batches_tracked`` 2 against 1 after
  ``@adaptive``, 3 against 2 after ``accumulate``, the running variances' sum 0.72 off).
- accelerate's recipe decorates the whole training loop. With ``restore=(model, optimizer)``
  a loop that runs out of memory after some optimizer steps is retried from the call's
  start and ends with the weights of a run that started at the smaller size; with
  ``params=``/``optimizer=`` alone it raises ``StepPartlyApplied`` naming ``restore=``.
- A step written as a top-level function that uses global modules gets the "pass params="
  warning, as a closure does.

Every OOM is real: ``ROW`` bytes per row of the batch, allocated after BatchNorm's forward,
under a CPU budget of ``BUDGET`` in a fresh process (8 rows do not fit, 4 do).
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import budget_after_warmup, in_fresh_process
from test_adaptive import logged

from oomguard.engine.core.execute.clean_retry import reachable
from oomguard.engine.core.execute.retry import Halve
from oomguard.engine.core.snapshot import BufferCopy
from oomguard.engine.errors import StepPartlyApplied, UsageError
from oomguard.engine.training.accumulate import accumulate
from oomguard.engine.training.adaptive import adaptive, find_executable_batch_size

MiB = 1024**2
ROW = 4 * MiB
BUDGET = 24 * MiB  # 8 x 4 MiB does not fit, 4 x 4 MiB does


def model_and_optimizer() -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1)).double()
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def rows() -> torch.Tensor:
    return torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def loss_of(model: torch.nn.Module, x: torch.Tensor, late: bool = True) -> torch.Tensor:
    """The step's loss; ``late``: then ``ROW`` bytes per row, touched (after BatchNorm ran)."""
    loss = model(x).square().mean()
    if late:
        torch.ones(x.shape[0], ROW // 8, dtype=torch.float64).sum()
    return loss


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    """Parameters, buffers and (with ``opt``) Adam's step counts, as plain lists."""
    state = {n: t.detach().tolist() for n, t in model.state_dict().items()}
    if opt is not None:
        state["steps"] = [float(s["step"]) for s in opt.state.values()]
    return state


def _step_retried(case: str) -> tuple[list[int], dict]:
    """One ``@adaptive`` step retried at 4 rows; the model is in the step's closure."""
    model, opt = model_and_optimizer()
    x, tried = rows(), []
    options = {"params": model, "optimizer": opt} if case == "params" else {"optimizer": opt}

    @adaptive(batch_size=8, **options)
    def step(batch_size: int) -> None:
        tried.append(batch_size)
        loss_of(model, x[:batch_size]).backward()
        opt.step()
        opt.zero_grad()

    with budget_after_warmup(BUDGET):
        step()
    return tried, state_of(model)


def _buffers_after_a_retry() -> dict:
    got = {case: _step_retried(case) for case in ("params", "optimizer only")}
    model, _ = model_and_optimizer()
    with budget_after_warmup(BUDGET):
        accumulate(lambda mb: loss_of(model, mb), rows(), params=model, policy=Halve(),
                   name="bn-retry")
    got["accumulate"] = (model[1].num_batches_tracked.item(), state_of(model))
    return got


@pytest.mark.slow
def test_a_retry_puts_batchnorm_buffers_back():
    got = in_fresh_process(_buffers_after_a_retry)
    model, opt = model_and_optimizer()
    loss_of(model, rows()[:4], late=False).backward()
    opt.step()
    for case in ("params", "optimizer only"):  # the module found through the closure
        tried, state = got[case]
        assert tried == [8, 4]
        assert state == state_of(model), case  # num_batches_tracked 1, not 2
    model, _ = model_and_optimizer()
    accumulate(lambda mb: loss_of(model, mb, late=False), rows(), 4, params=model,
               name="bn-reference")
    tracked, state = got["accumulate"]
    assert tracked == 2  # two micro-batches of 4, not the failed 8 as well
    assert state == state_of(model)


STEPS, LATE = 4, 2  # the loop's steps; the one that runs out of memory at 8 rows


def train_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, batch_size: int,
               late: bool = True) -> int:
    """The whole loop at ``batch_size``: data from torch's global generator, an optimizer
    step per batch, and an OOM at step ``LATE`` (after ``LATE`` optimizer steps)."""
    for i in range(STEPS):
        x = torch.randn(batch_size, 8, dtype=torch.float64)
        loss_of(model, x, late=late and i == LATE).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return batch_size


def _whole_loops() -> dict:
    got = {}
    for wrapper, restore in (("adaptive", True), ("find_executable_batch_size", True),
                             ("adaptive", False)):
        model, opt = model_and_optimizer()
        tried: list[int] = []

        def loop(batch_size: int, model=model, opt=opt, tried=tried) -> int:
            tried.append(batch_size)
            return train_loop(model, opt, batch_size)

        if wrapper == "adaptive":  # restore= both, with params=/optimizer= as the docs show
            extra = {"restore": (model, opt)} if restore else {}
            call = adaptive(batch_size=8, params=model, optimizer=opt, **extra)(loop)
        else:  # restore= the model; optimizer= joins it
            call = find_executable_batch_size(loop, 8, lambda n: n // 2, restore=model,
                                              optimizer=opt)
        with logged("oomguard") as messages, budget_after_warmup(BUDGET):
            try:
                result = call()
            except StepPartlyApplied as exc:
                got["partly applied"] = (tried, str(exc))
                continue
        got[wrapper] = (tried, result, state_of(model, opt),
                        [m for m in messages if "restore=" in m])
    return got


@pytest.mark.slow
def test_a_decorated_whole_loop_recovers_from_a_late_oom():
    got = in_fresh_process(_whole_loops)
    model, opt = model_and_optimizer()
    train_loop(model, opt, 4, late=False)  # a run that started at 4 rows
    fresh = state_of(model, opt)
    assert fresh["steps"] == [STEPS] * 6
    for wrapper in ("adaptive", "find_executable_batch_size"):
        tried, result, state, restored = got[wrapper]
        assert tried == [8, 4] and result == 4
        assert state == fresh, wrapper  # weights, BatchNorm's buffers, Adam's state
        assert len(restored) == 1 and "put back as at the call's start" in restored[0]
    tried, text = got["partly applied"]
    assert tried == [8]
    assert "\n" not in text and "restore=(model, optimizer) to the wrapper" in text


GLOBAL_MODEL: torch.nn.Module | None = None
GLOBAL_OPT: torch.optim.Optimizer | None = None


def global_step(batch_size: int) -> None:
    """A top-level step on the module's global model and optimizer; it runs out of memory
    after its backward (the gradients are there)."""
    x = rows()[:batch_size]
    loss_of(GLOBAL_MODEL, x, late=False).backward()  # type: ignore[arg-type]
    torch.ones(batch_size, ROW // 8, dtype=torch.float64).sum()
    GLOBAL_OPT.step()  # type: ignore[union-attr]


def _global_step_retried() -> list[str]:
    global GLOBAL_MODEL, GLOBAL_OPT
    GLOBAL_MODEL, GLOBAL_OPT = model_and_optimizer()
    step = adaptive(batch_size=8)(global_step)
    with logged("oomguard") as messages, budget_after_warmup(BUDGET):
        step()
    return [m for m in messages if "params=model" in m]


@pytest.mark.slow
def test_a_top_level_step_on_global_modules_gets_the_params_warning():
    warnings = in_fresh_process(_global_step_retried)
    assert len(warnings) == 1 and "gradients left on Sequential" in warnings[0]


def test_reachable_finds_modules_in_closures_globals_partials_and_methods():
    global GLOBAL_MODEL, GLOBAL_OPT
    model, opt = model_and_optimizer()
    GLOBAL_MODEL, GLOBAL_OPT = model, opt
    try:
        assert reachable(global_step) == [model, opt]
        assert reachable(lambda n: [GLOBAL_MODEL for _ in range(n)]) == [model]  # nested code
    finally:
        GLOBAL_MODEL = GLOBAL_OPT = None
    assert reachable(global_step) == []  # a global that holds no module
    other = torch.nn.Linear(2, 2)
    assert reachable(lambda n: other(n)) == [other]  # a closure
    assert reachable(functools.partial(lambda m, n: m(n), other)) == [other]
    assert reachable(other.forward) == [other]

    def uses_an_attribute_named_like_a_global(n: torch.Tensor) -> torch.Tensor:
        return other.GLOBAL_MODEL  # an attribute name, not the global

    assert reachable(uses_an_attribute_named_like_a_global) == [other]


def test_buffer_copy_puts_back_running_statistics_and_replaced_buffers():
    model, _ = model_and_optimizer()
    bn = model[1]
    holder = torch.nn.ModuleDict({"model": model, "again": bn})  # a shared submodule: once
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = BufferCopy.take([holder, bn])
    assert copy.nbytes == sum(b.nbytes for b in bn.buffers()) == 16 * 8 * 2 + 8
    weight = model[0].weight
    model(rows())  # train mode: the running statistics move
    assert bn.num_batches_tracked.item() == 1
    original = bn.running_mean
    bn.running_mean = torch.full_like(original, 7.0)  # a module that replaced its buffer
    copy.restore()
    assert bn.running_mean is original
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model[0].weight is weight
    assert BufferCopy.take([torch.nn.Linear(2, 2)]).nbytes == 0


def test_restore_given_to_the_decorators_is_checked_before_any_work():
    model, _ = model_and_optimizer()
    foreign = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    for bad in ({"restore": "model"}, {"restore": (model, 3)},
                {"restore": model, "optimizer": foreign}):
        for wrap in (lambda kw: adaptive(batch_size=4, **kw)(lambda batch_size: None),
                     lambda kw: find_executable_batch_size(lambda batch_size: None, 4, **kw)):
            with pytest.raises(UsageError) as info:
                wrap(bad)
            assert "\n" not in str(info.value)
