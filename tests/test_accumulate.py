"""Micro-batching that keeps the effective batch, with real OOMs under a CPU budget.

The budgeted runs go first and the whole-batch references after them, so the
reference's freed heap is not slack inside the budget.
"""

from __future__ import annotations

import copy
from collections import UserDict

import pytest
import torch
from conftest import budget_after_warmup
from oomguard.engine.training.accumulate import (
    Accumulator,
    accumulate,
    batch_length,
    forget,
    slice_batch,
)
from oomguard.engine.training.adaptive import stats
from oomguard.metrics.models import build_model, make_batch

MiB = 1024**2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_causal_lm_step_under_budget_equals_the_whole_batch_step():
    model = build_model("tiny-gpt2", dtype="float32", seed=0)  # no dropout
    reference = copy.deepcopy(model)
    batch = make_batch(24, 32, 256, seed=3)  # right-padded, labels -100 on padding
    assert (batch["labels"] == -100).any()
    acc = Accumulator(lambda mb: model(**mb).loss, model, weight_by="causal-tokens")
    warm = make_batch(2, 32, 256, seed=1)
    with budget_after_warmup(24 * MiB, lambda: model(**warm).loss.backward()):
        loss = acc(batch)
    s = stats()[acc.size.name]
    assert s.ooms >= 1 and acc.micro_batch_size < 24  # the whole batch really ran out

    whole = reference(**batch).loss
    whole.backward()
    assert rel(loss, whole.detach()) <= 1e-5
    for g, ref in zip(grads(model), grads(reference), strict=True):
        assert rel(g, ref) <= 1e-5
    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert rel(p.detach(), ref.detach()) <= 1e-5


# A regression model whose memory follows the longest row of each micro-batch
# (dynamic padding): short rows first, long rows last.
D, H, L = 8, 512, 256  # a long row holds ~1.5 MiB of activations and gradients


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, 1))


def regression_step(model: torch.nn.Module, calls: list[int] | None = None):
    def step(mb: dict) -> torch.Tensor:
        if calls is not None:
            calls.append(len(mb["y"]))
        n = int(mb["len"].max())
        y = model(mb["x"][:, :n]).squeeze(-1)
        mask = (torch.arange(n)[None, :] < mb["len"][:, None]).float()
        pred = (y * mask).sum(1) / mask.sum(1)
        return ((pred - mb["y"]) ** 2).mean()
    return step


def rows(n_short: int, n_long: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = n_short + n_long
    return {"x": torch.randn(n, L, D, generator=g),
            "len": torch.tensor([8] * n_short + [L] * n_long),
            "y": torch.randn(n, generator=g)}


def test_oom_in_the_middle_redoes_the_batch_without_double_counting():
    model, reference = mlp(), mlp()
    batch = rows(32, 32)
    calls: list[int] = []
    acc = Accumulator(regression_step(model, calls), model)
    with budget_after_warmup(32 * MiB, lambda: regression_step(model)(rows(1, 1)).backward()):
        loss = acc(batch)
    # 64 rows: OOM; 32: the short half ran (its gradient was accumulated), the long half
    # ran out of memory; then the whole batch again at a smaller size.
    assert calls[:3] == [64, 32, 32]
    assert acc.micro_batch_size <= 16 and stats()[acc.size.name].ooms >= 2

    whole = regression_step(reference)(batch)
    whole.backward()
    assert rel(loss, whole.detach()) <= 1e-5
    for g, ref in zip(grads(model), grads(reference), strict=True):
        assert rel(g, ref) <= 1e-5


def test_grow_back_after_clean_steps_never_to_a_size_that_failed():
    model = mlp()
    acc = Accumulator(regression_step(model), model, grow_after=2)
    with budget_after_warmup(40 * MiB, lambda: regression_step(model)(rows(0, 2)).backward()):
        for i in range(7):
            acc(rows(0, 64, seed=i))
    changes = list(stats()[acc.size.name].changes)
    assert (changes[0].old, changes[0].new) == (64, 32)  # the whole batch ran out of memory
    grows = [c for c in changes if c.new > c.old]
    assert grows, changes
    assert grows[0].new > grows[0].old and grows[0].new < changes[0].old
    failed_so_far: int | None = None
    for c in changes:  # sizes only ever grow to below every size that failed before
        if c.new > c.old:
            assert failed_so_far is None or c.new < failed_so_far
        else:
            failed_so_far = c.old if failed_so_far is None else min(failed_so_far, c.old)


def test_no_oom_path_runs_the_whole_batch_once_unscaled():
    model = mlp()
    batch = rows(3, 1)
    seen: list[object] = []

    def step(mb: dict) -> torch.Tensor:
        seen.append(mb)
        return regression_step(model)(mb)

    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # stale gradients are replaced, not added to
    loss = Accumulator(step, model)(batch)
    assert seen == [batch]
    reference = mlp()
    regression_step(reference)(batch).backward()
    for g, ref in zip(grads(model), grads(reference), strict=True):
        assert torch.equal(g, ref)
    assert loss.requires_grad is False


@pytest.mark.parametrize("weight_by, reduction", [
    ("samples", "mean"), ("samples", "sum"), ("tokens", "mean"), ("causal-tokens", "mean"),
    ("callable", "mean"),
])
def test_fixed_micro_batches_match_the_whole_batch(weight_by, reduction):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 4)
    head = torch.nn.Linear(4, 50)
    params = [*emb.parameters(), *head.parameters()]
    batch = make_batch(10, 12, 50, seed=5)
    batch["labels"][3] = -100  # a row with no tokens at all

    def step(mb: dict) -> torch.Tensor:
        logits = head(emb(mb["input_ids"]))
        labels = mb["labels"]
        if weight_by == "causal-tokens":
            logits, labels = logits[:, :-1], labels[:, 1:]
        if weight_by in ("samples",):
            per = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0),
                                                    reduction="none").mean(1)
            return per.mean() if reduction == "mean" else per.sum()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1))

    weight = ((lambda mb: int((mb["labels"] != -100).sum()))
              if weight_by == "callable" else weight_by)
    loss = Accumulator(step, params, micro_batch_size=3, weight_by=weight,
                       reduction=reduction)(batch)
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    whole = step(batch)
    whole.backward()
    assert rel(loss, whole.detach()) <= 1e-5
    for g, p in zip(got, params, strict=True):
        assert rel(g, p.grad) <= 1e-5


def test_a_batch_without_tokens_is_an_error():
    model = torch.nn.Linear(2, 2)
    batch = {"x": torch.ones(4, 2), "labels": torch.full((4, 3), -100)}
    acc = Accumulator(lambda mb: model(mb["x"]).sum(), model, micro_batch_size=2,
                      weight_by="tokens")
    with pytest.raises(ValueError, match="no units"):
        acc(batch)


def test_function_form_remembers_the_size_per_name():
    forget()
    model = mlp()
    for _ in range(2):
        accumulate(regression_step(model), rows(4, 4), 2, params=model, name="remember-me")
    s = stats()["remember-me"]
    assert s.calls == 2 and s.current == 2 and s.start == 2
    forget("remember-me")


def test_batches_slice_on_dim_0():
    encoding = UserDict({"input_ids": torch.arange(12).view(6, 2), "meta": "kept"})
    part = slice_batch(encoding, 2, 4)
    assert isinstance(part, UserDict) and part["meta"] == "kept"
    assert part["input_ids"].tolist() == [[4, 5], [6, 7]]
    assert slice_batch((torch.ones(5), [torch.zeros(5, 2)]), 0, 2)[1][0].shape == (2, 2)
    assert batch_length({"a": torch.ones(3), "b": torch.ones(3, 4)}) == 3
    with pytest.raises(ValueError, match="share dim 0"):
        batch_length({"a": torch.ones(3), "b": torch.ones(4)})
