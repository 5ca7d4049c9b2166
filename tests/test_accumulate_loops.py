"""accumulate inside the loops users write: their own accumulation loop (nanoGPT's
``micro_step``), their backward (a GradScaler, ``accelerator.backward``), DDP's ``no_sync``,
and the size it resumes at after an OOM.

Scenarios with a real OOM, a process group or accelerate's process-wide state run in a fresh
process and return plain data; the budgeted run goes first, the reference after it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import pytest
import torch
from conftest import budget_after_warmup, in_fresh_process
from test_accumulate import MiB, grads, mlp, regression_step, rel, rows, warm_up

from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.errors import UsageError
from oomguard.engine.training.accumulate import Accumulator, accumulate


def max_rel(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    return max(rel(g, ref) for g, ref in zip(grads(model), grads(reference), strict=True))


def whole_batch_grads(batches: list[dict], k: int) -> torch.nn.Module:
    """The reference: the mean loss of each batch, divided by k, back-propagated as is."""
    reference = mlp()
    for batch in batches:
        (regression_step(reference)(batch) / k).backward()
    return reference


def test_an_outer_loop_with_a_backward_hook_adds_up_to_the_whole_batch():
    model, k = mlp(), 3
    batches = [rows(4, 3, seed=i) for i in range(k)]
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT's fp32 path: scale is a no-op
    scaled: list[float] = []

    def backward(loss: torch.Tensor) -> None:
        scaled.append(float(loss.detach()))
        scaler.scale(loss / k).backward()

    for batch in batches:  # nanoGPT's micro_step loop, each step split in micro-batches of 3
        accumulate(regression_step(model), batch, 3, params=model, backward=backward,
                   name="outer-loop")
    assert len(scaled) == 3 * k  # 7 rows in micro-batches of 3: 3 per call, each hooked
    assert max_rel(model, whole_batch_grads(batches, k)) <= 1e-5


def test_a_grad_scaler_scales_every_micro_batch_and_unscales_to_the_whole_batch():
    model, k = mlp(), 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)  # enabled: grads are 4096 x
    batches = [rows(5, 5, seed=i) for i in range(k)]
    for batch in batches:
        accumulate(regression_step(model), batch, 4, optimizer=optimizer,
                   backward=lambda loss: scaler.scale(loss / k).backward(), name="scaled")
    scaler.unscale_(optimizer)
    assert max_rel(model, whole_batch_grads(batches, k)) <= 1e-5
    scaler.step(optimizer)  # finite gradients: the step is taken
    scaler.update()
    assert scaler.get_scale() == 2.0**12


def test_bad_backward_or_optimizer_is_one_usage_error_before_any_work():
    model, other = mlp(), mlp(seed=1)
    ran: list[int] = []

    def step(mb: dict) -> torch.Tensor:
        ran.append(1)
        return regression_step(model)(mb)

    cases = [
        ({"params": model, "backward": "loss.backward()"}, "backward= takes a function"),
        ({"params": model, "optimizer": torch.optim.SGD(other.parameters(), lr=0.1)},
         "not params="),
        ({}, "give params="),
        ({"optimizer": model}, "optimizer= takes a torch.optim.Optimizer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UsageError, match=message) as caught:
            accumulate(step, rows(2, 2), **kwargs)
        assert "\n" not in str(caught.value)
    with pytest.raises(UsageError, match="backward= takes a function"):
        Accumulator(step, model, backward=3)
    assert ran == []


def test_an_optimizer_of_part_of_the_model_is_accepted():
    model = mlp()
    head = torch.optim.AdamW(model[2].parameters())  # the last layer only: a subset
    accumulate(regression_step(model), rows(2, 2), params=model, optimizer=head)
    assert all(p.grad is not None for p in model.parameters())
    # A generator of parameters is checked against the optimizer and still used after it
    acc = Accumulator(regression_step(model), model.parameters(), optimizer=head)
    assert [id(p) for p in acc.params] == [id(p) for p in model.parameters()]


def _outer_loop_with_an_oom_in_the_middle() -> dict:
    model, k = mlp(), 3
    # The middle call's whole batch runs out of memory, and so does the long half of it
    # after its short half has added its gradients: two calls' gradients are already there.
    batches = [rows(64, 0, seed=1), rows(32, 32, seed=2), rows(16, 0, seed=3)]
    calls: list[int] = []
    with budget_after_warmup(32 * MiB, functools.partial(warm_up, model)):
        for batch in batches:
            accumulate(regression_step(model, calls), batch, params=model, name="outer-oom",
                       backward=lambda loss: (loss / k).backward())
    from oomguard.engine.core.execute.stats import stats
    return {"calls": calls, "ooms": stats()["outer-oom"].ooms,
            "grads": max_rel(model, whole_batch_grads(batches, k))}


@pytest.mark.slow
def test_an_oom_inside_an_outer_loop_neither_double_counts_nor_drops_a_micro_batch():
    got = in_fresh_process(_outer_loop_with_an_oom_in_the_middle)
    # 64 short rows fit; 64 with long ones ran out of memory; at 32 the short half ran and
    # the long half did not (the peaks of short rows predicted nothing: halved)
    assert got["calls"][:4] == [64, 64, 32, 32], got["calls"]
    assert got["ooms"] >= 2
    assert got["grads"] <= 1e-5


def _resume_after_adamw_state() -> dict:
    """The issue's nanoGPT run: the size fits the forward and backward, then AdamW's state
    (twice the weights, 12 MiB here) arrives at the first optimizer.step()."""
    model = mlp()
    table = torch.nn.Parameter(torch.zeros(6 * MiB // 4))  # 6 MiB of weights, cheap to use
    inner = regression_step(model)

    def step(mb: dict) -> torch.Tensor:
        return inner(mb) + table[0]

    params = [*model.parameters(), table]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    acc = Accumulator(step, params)
    batch = rows(0, 68)

    def warm_up() -> None:
        step(rows(0, 1)).backward()
        optimizer.zero_grad(set_to_none=True)

    with budget_after_warmup(112 * MiB, warm_up):
        acc(batch)  # 68 rows fit, and their peak is measured
        optimizer.step()  # AdamW creates its state
        optimizer.zero_grad(set_to_none=True)
        acc(batch)
        got = {"ooms": acc.size.stats.ooms, "micro": acc.micro_batch_size,
               "changes": [(c.old, c.new) for c in acc.size.stats.changes]}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        largest = 68  # the true maximum now: the largest whole step that runs, by brute force
        while largest > 1 and type(call_catching_oom(
                lambda n: step(rows(0, n)).backward(), largest)) is OOM:
            optimizer.zero_grad(set_to_none=True)
            largest -= 1
    return {**got, "largest": largest}


@pytest.mark.slow
def test_after_an_oom_accumulate_resumes_at_the_largest_predicted_fit_not_at_half():
    got = in_fresh_process(_resume_after_adamw_state)
    old, new = got["changes"][0]
    assert old == 68 and 34 < new < 68, got  # halving would have gone to 34
    assert got["ooms"] == 1, got  # the predicted size then ran
    assert got["micro"] == new
    assert 0.95 * got["largest"] <= new <= got["largest"] + 1, got


def test_the_policy_halves_where_nothing_was_measured_and_never_returns_a_size_that_failed():
    from oomguard.engine.core.execute.retry import FitPeaks

    policy = FitPeaks("cpu")  # no budget here: no limit is known
    assert policy.shrink({"n": 68}, {"n": 1}) == {"n": 34}
    policy.observe(68, 68 * MiB)
    assert policy.predict() is None  # points, but no limit to fit them against
    assert policy.shrink({"n": 2}, {"n": 2}) is None  # at the floor: retrying stops


def _ddp_micro_batches() -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
                                rank=0, world_size=1)
        try:
            ddp = torch.nn.parallel.DistributedDataParallel(mlp())
            entered, synced, reduced = [], [], []
            no_sync = ddp.no_sync

            @contextlib.contextmanager
            def counting_no_sync():
                entered.append(1)
                with no_sync():
                    yield

            def counting_allreduce(state, bucket):
                reduced.append(1)
                return allreduce_hook(state, bucket)

            ddp.no_sync = counting_no_sync
            ddp.register_comm_hook(None, counting_allreduce)
            step = regression_step(ddp)

            def recording(mb: dict) -> torch.Tensor:
                synced.append(ddp.require_backward_grad_sync)
                return step(mb)

            batch = rows(6, 4)
            accumulate(recording, batch, 3, params=ddp)  # 10 rows: 4 micro-batches
            split = {"entered": len(entered), "synced": list(synced), "reduced": len(reduced),
                     "grads": max_rel(ddp.module, whole_batch_grads([batch], 1))}
            ddp.zero_grad(set_to_none=True)
            entered.clear()
            accumulate(step, batch, params=ddp, name="whole")  # one micro-batch: no no_sync
            return {"split": split, "whole_entered": len(entered)}
        finally:
            dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_runs_every_micro_batch_but_the_last_under_no_sync():
    got = in_fresh_process(_ddp_micro_batches)
    split = got["split"]
    assert split["entered"] == 3
    assert split["synced"] == [False, False, False, True]
    assert split["reduced"] >= 1 and split["reduced"] <= 2  # one sync backward's buckets
    assert split["grads"] <= 1e-5
    assert got["whole_entered"] == 0


def _accelerate_loop() -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = [rows(4, 3, seed=i) for i in range(2)]
    seen, got = [], None
    for batch in batches:
        with accelerator.accumulate(model):
            accumulate(regression_step(model), batch, 3, params=model,
                       backward=accelerator.backward)
            seen.append(accelerator.sync_gradients)
            if accelerator.sync_gradients:
                got = max_rel(model, whole_batch_grads(batches, 2))
            optimizer.step()
            optimizer.zero_grad()
    return {"sync": seen, "grads": got}


@pytest.mark.slow
def test_accelerate_backward_inside_accelerator_accumulate_equals_the_whole_batch():
    got = in_fresh_process(_accelerate_loop)
    assert got["sync"] == [False, True]  # the first step only accumulated
    assert got["grads"] is not None and got["grads"] <= 1e-5


def test_after_an_oom_on_cuda_accumulate_resumes_at_the_predicted_fit_fake_cuda(
        monkeypatch: pytest.MonkeyPatch):
    from fakes.fake_cuda import FakeCuda, GiB

    from oomguard.engine.core.memory import budget as budget_mod
    from oomguard.engine.core.memory.budget import budget

    monkeypatch.setattr(budget_mod, "_fractions", {}, raising=False)
    gpu = FakeCuda(total=16 * GiB).install(monkeypatch)
    weight = torch.nn.Parameter(torch.ones(3))
    item = 64 * MiB  # a row's activations on the fake GPU, alive from forward to backward

    def step(mb: torch.Tensor) -> torch.Tensor:
        gpu.free(gpu.alloc(len(mb) * item))
        return (weight * mb).sum(1).mean()

    acc = Accumulator(step, [weight], device="cuda:0")
    gpu.alloc(1 * GiB)  # the model
    with budget(4 * GiB, "cuda"):
        acc(torch.ones(48, 3))  # 3 GiB of the 4: fits, and its peak is measured
        # What AdamW's state takes at the first step, in a segment of its own (from the cache
        # it would split the freed activations' segment, whose free rest stays reserved: the
        # headroom, and so the prediction, would then be lower than what fits)
        gpu.empty_cache()
        gpu.alloc(GiB + GiB // 4)
        acc(torch.ones(48, 3))
    # 4 GiB - 1.25 GiB leaves 2.75 GiB: 44 rows of 64 MiB; halving would have gone to 24
    assert [(c.old, c.new) for c in acc.size.stats.changes] == [(48, 44)]
    assert acc.size.stats.ooms == 1 and acc.micro_batch_size == 44
    assert gpu.num_ooms == 1


def test_the_policy_follows_the_line_unless_an_oom_refutes_it_fake_cuda(
        monkeypatch: pytest.MonkeyPatch):
    from fakes.fake_cuda import FakeCuda, GiB

    from oomguard.engine.core.execute.retry import FitPeaks
    from oomguard.engine.core.memory import budget as budget_mod
    from oomguard.engine.core.memory.budget import budget

    monkeypatch.setattr(budget_mod, "_fractions", {}, raising=False)
    gpu = FakeCuda(total=16 * GiB).install(monkeypatch)
    gpu.alloc(1 * GiB)
    policy = FitPeaks("cuda:0")
    policy.observe(10, 10 * 64 * MiB + 100 * MiB)  # a line: 100 MiB + 64 MiB per row
    policy.observe(20, 20 * 64 * MiB + 100 * MiB)
    with budget(2 * GiB, "cuda"):  # (2048 - 100) / 64 = 30.4: 30 rows predicted to fit
        assert policy.predict() == 30
        assert policy.shrink({"n": 40}, {"n": 1}) == {"n": 30}
        assert policy.shrink({"n": 30}, {"n": 1}) == {"n": 15}  # its prediction failed: halve
        assert policy.shrink({"n": 30}, {"n": 1}) == {"n": 15}  # 30 failed, the line says 30
        assert policy.shrink({"n": 36}, {"n": 31}) == {"n": 31}  # below the minimum: the rule
        policy.reserve_bytes = GiB  # gradients the retry creates: (1024 - 100) / 64 = 14
        assert policy.shrink({"n": 40}, {"n": 1}) == {"n": 14}
