"""Micro-batching that keeps the effective batch, with real OOMs under a CPU budget.

Every scenario with an expected OOM runs in a fresh process and returns plain
data; inside it the budgeted run goes first and the whole-batch reference
after it, so the reference's freed heap is not slack inside the budget.
"""

from __future__ import annotations

import collections
import copy
import functools
import gc
import weakref
from collections import UserDict

import pytest
import torch
from conftest import budget_after_warmup, in_fresh_process

from oomguard.engine.core.execute.stats import stats
from oomguard.engine.training import accumulate as accumulate_module
from oomguard.engine.training.accumulate import (
    Accumulator,
    accumulate,
    batch_length,
    forget,
)
from oomguard.engine.util.rows import slice_rows
from oomguard.metrics.models import build_model, make_batch

MiB = 1024**2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def warmed(model: torch.nn.Module, loss: torch.Tensor) -> None:
    """A warm-up backward whose gradients are dropped: accumulate adds to what it finds."""
    loss.backward()
    model.zero_grad(set_to_none=True)


def _causal_lm_at_24_mib() -> dict:
    model = build_model("tiny-gpt2", dtype="float32", seed=0)  # no dropout
    reference = copy.deepcopy(model)
    batch = make_batch(24, 32, 256, seed=3)  # right-padded, labels -100 on padding
    acc = Accumulator(lambda mb: model(**mb).loss, model, weight_by="causal-tokens")
    warm = make_batch(2, 32, 256, seed=1)
    with budget_after_warmup(24 * MiB, lambda: warmed(model, model(**warm).loss)):
        loss = acc(batch)
    s = acc.size.stats

    whole = reference(**batch).loss
    whole.backward()
    grad_errors = [rel(g, ref) for g, ref in zip(grads(model), grads(reference), strict=True)]
    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    param_errors = [rel(p.detach(), ref.detach())
                    for p, ref in zip(model.parameters(), reference.parameters(), strict=True)]
    return {"padded": bool((batch["labels"] == -100).any()), "ooms": s.ooms,
            "micro": acc.micro_batch_size, "loss": rel(loss, whole.detach()),
            "grads": max(grad_errors), "params": max(param_errors)}


@pytest.mark.slow
def test_causal_lm_step_under_budget_equals_the_whole_batch_step():
    got = in_fresh_process(_causal_lm_at_24_mib)
    assert got["padded"] is True
    assert got["ooms"] >= 1 and got["micro"] < 24  # the whole batch really ran out
    assert got["loss"] <= 1e-5
    assert got["grads"] <= 1e-5
    assert got["params"] <= 1e-5


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


def _oom_in_the_middle() -> dict:
    model, reference = mlp(), mlp()
    batch = rows(32, 32)
    calls: list[int] = []
    acc = Accumulator(regression_step(model, calls), model)
    with budget_after_warmup(32 * MiB, functools.partial(warm_up, model)):
        loss = acc(batch)
    whole = regression_step(reference)(batch)
    whole.backward()
    return {"calls": calls, "micro": acc.micro_batch_size, "ooms": acc.size.stats.ooms,
            "loss": rel(loss, whole.detach()),
            "grads": max(rel(g, ref) for g, ref in zip(grads(model), grads(reference),
                                                       strict=True))}


@pytest.mark.slow
def test_oom_in_the_middle_redoes_the_batch_without_double_counting():
    got = in_fresh_process(_oom_in_the_middle)
    # 64 rows: OOM; 32: the short half ran (its gradient was accumulated), the long half
    # ran out of memory; then the whole batch again at a smaller size.
    assert got["calls"][:3] == [64, 32, 32]
    assert got["micro"] <= 16 and got["ooms"] >= 2
    assert got["loss"] <= 1e-5
    assert got["grads"] <= 1e-5


def _grow_back_at_40_mib() -> list[tuple[int, int]]:
    model = mlp()
    acc = Accumulator(regression_step(model), model, grow_after=2)
    with budget_after_warmup(40 * MiB, lambda: regression_step(model)(rows(0, 2)).backward()):
        for i in range(7):
            acc(rows(0, 64, seed=i))
    return [(c.old, c.new) for c in acc.size.stats.changes]


@pytest.mark.slow
def test_grow_back_after_clean_steps_never_to_a_size_that_failed():
    changes = in_fresh_process(_grow_back_at_40_mib)
    assert changes[0] == (64, 32)  # the whole batch ran out of memory
    grows = [c for c in changes if c[1] > c[0]]
    assert grows, changes
    assert grows[0][0] < grows[0][1] < changes[0][0]
    failed_so_far: int | None = None
    for old, new in changes:  # sizes only ever grow to below every size that failed before
        if new > old:
            assert failed_so_far is None or new < failed_so_far
        else:
            failed_so_far = old if failed_so_far is None else min(failed_so_far, old)


def test_no_oom_path_runs_the_whole_batch_once_unscaled():
    model = mlp()
    batch = rows(3, 1)
    seen: list[object] = []

    def step(mb: dict) -> torch.Tensor:
        seen.append(mb)
        return regression_step(model)(mb)

    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # gradients present are added to, as backward() does
    loss = Accumulator(step, model)(batch)
    assert seen == [batch]
    reference = mlp()
    for p in reference.parameters():
        p.grad = torch.full_like(p, 7.0)
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
    accumulate(regression_step(model), rows(4, 4), params=model, name="remember-me")
    assert stats()["remember-me"].calls == 2  # forgotten: a new size, registered anew
    assert any(n.startswith("remember-me#") for n in stats().sizes)


def test_function_form_does_not_keep_the_model_alive():
    gc.collect()  # what earlier tests left behind goes now, not in the middle of the count
    model = mlp()
    step = regression_step(model)
    entries = len(accumulate_module._MEMORY)
    for _ in range(2):
        accumulate(step, rows(4, 4), params=model)
    assert len(accumulate_module._MEMORY) == entries + 1
    alive = weakref.ref(model)
    del model, step
    gc.collect()
    assert alive() is None
    assert len(accumulate_module._MEMORY) == entries  # its remembered size went with it


def warm_up(model: torch.nn.Module) -> None:
    warmed(model, regression_step(model)(rows(1, 1)))


def _collected_after_an_oom() -> dict:
    model = mlp()
    step = regression_step(model)
    with budget_after_warmup(32 * MiB, functools.partial(warm_up, model)):
        accumulate(step, rows(32, 32), params=model, name="collect-me")
    ooms = stats()["collect-me"].ooms
    alive = weakref.ref(model)
    del model, step
    gc.collect()
    return {"ooms": ooms, "collected": alive() is None,
            "entries": len(accumulate_module._MEMORY)}


@pytest.mark.slow
def test_function_form_does_not_keep_the_model_alive_after_an_oom():
    got = in_fresh_process(_collected_after_an_oom)
    assert got["ooms"] >= 1  # the retry loop really ran
    assert got["collected"] is True
    assert got["entries"] == 0


def squared_error(model: torch.nn.Module, reduction: str):
    """One factory for both call sites: the step functions share their ``__qualname__``."""
    def step(mb: dict) -> torch.Tensor:
        err = (model(mb["x"]).squeeze(-1) - mb["y"]) ** 2
        return err.mean() if reduction == "mean" else err.sum()
    return step


def test_each_call_uses_its_own_options():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8)}
    mean = accumulate(squared_error(model, "mean"), batch, 2, params=model, reduction="mean")
    mean_grads = grads(model)
    model.zero_grad(set_to_none=True)  # accumulate adds to the gradients it finds
    total = accumulate(squared_error(model, "sum"), batch, 2, params=model, reduction="sum")
    total_grads = grads(model)
    name = f"{squared_error(model, 'sum').__qualname__}:micro_batch"
    assert stats()[name].calls == 2  # one remembered size, shared by both call sites

    for reduction, loss, got in (("mean", mean, mean_grads), ("sum", total, total_grads)):
        model.zero_grad(set_to_none=True)
        whole = squared_error(model, reduction)(batch)
        whole.backward()
        assert rel(loss, whole.detach()) <= 1e-5, reduction
        for g, ref in zip(got, grads(model), strict=True):
            assert rel(g, ref) <= 1e-5, reduction
    assert float(total) > 4 * float(mean)  # a sum over 8 rows, not their mean


@pytest.mark.slow
def test_a_later_call_may_ask_for_smaller_micro_batches():
    model = mlp()
    seen: list[int] = []
    accumulate(regression_step(model, seen), rows(4, 4), params=model, name="bounded")
    accumulate(regression_step(model, seen), rows(4, 4), 3, params=model, name="bounded")
    accumulate(regression_step(model, seen), rows(4, 4), params=model, name="bounded")
    assert seen == [8, 3, 3, 2, 8]
    assert stats()["bounded"].current is None  # what is remembered: the whole batch fits


@pytest.mark.slow
def test_the_parameters_zeroed_are_the_models_trainable_ones():
    model = build_model("tiny-gpt2", dtype="float32", seed=0)  # tied embeddings
    frozen = model.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    walked = {id(p) for p in accumulate_module._param_list(model)}
    assert walked == {id(p) for p in model.parameters() if p.requires_grad}
    assert id(frozen) not in walked and len(walked) == len(list(model.parameters())) - 1


def test_batches_slice_on_dim_0():
    encoding = UserDict({"input_ids": torch.arange(12).view(6, 2), "meta": "kept"})
    part = slice_rows(encoding, 2, 4)
    assert isinstance(part, UserDict) and part["meta"] == "kept"
    assert part["input_ids"].tolist() == [[4, 5], [6, 7]]
    assert slice_rows((torch.ones(5), [torch.zeros(5, 2)]), 0, 2)[1][0].shape == (2, 2)
    # a named tuple (a dataset's record) keeps its type and fields
    Pair = collections.namedtuple("Pair", "x y")
    part = slice_rows(Pair(torch.ones(5, 3), torch.zeros(5)), 1, 3)
    assert type(part) is Pair and part.x.shape == (2, 3) and part.y.shape == (2,)
    assert batch_length({"a": torch.ones(3), "b": torch.ones(3, 4)}) == 3
    with pytest.raises(ValueError, match="share dim 0"):
        batch_length({"a": torch.ones(3), "b": torch.ones(4)})


def test_batch_statistics_are_warned_about_once_per_model_and_only_when_a_batch_is_split():
    import warnings

    torch.manual_seed(0)

    def net(norm: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), norm, torch.nn.Linear(8, 1))

    batch_norm, layer_norm = net(torch.nn.BatchNorm1d(8)), net(torch.nn.LayerNorm(8))
    frozen = net(torch.nn.BatchNorm1d(8)).eval()  # running statistics: no batch's own
    x = torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        accumulate(lambda mb: batch_norm(mb).square().mean(), x, params=batch_norm, name="bn")
        assert not seen  # whole: the batch's own statistics, as without accumulate
        for _ in range(3):
            accumulate(lambda mb: batch_norm(mb).square().mean(), x, 3, params=batch_norm,
                       name="bn-split")
        for model in (layer_norm, frozen):
            accumulate(lambda mb, m=model: m(mb).square().mean(), x, 3, params=model,
                       name="other")
    texts = [str(w.message) for w in seen]
    assert len(texts) == 1, texts  # once, not per call
    assert "BatchNorm1d" in texts[0] and "8 rows run as 3 + 3 + 2" in texts[0]
    assert "\n" not in texts[0] and "once per model" in texts[0]
