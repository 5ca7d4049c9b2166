"""Core metrics: results do not depend on memory knobs, survive real OOMs, reject bad input.

Each metric is run at its smallest and largest memory size (float64: equal to
1e-9 relative), under a real CPU budget where its default size runs out of
memory (the executor's result equals the unconstrained one), and as a
:class:`~oomguard.metrics.workload.MetricTrial` under :func:`~oomguard.engine.core.search.search.search`.
Every test that expects an OOM or asserts a memory boundary runs in a fresh process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import pickle
from typing import Any

import pytest
import torch
from conftest import budget_after_warmup, in_fresh_process, numbers, tiny_data, tiny_model

from oomguard.engine.core.child import Child
from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.memory.oom import is_oom
from oomguard.engine.core.search.search import search
from oomguard.engine.errors import UsageError
from oomguard.metrics.base import get_metric
from oomguard.metrics.common import (
    group_name,
    iter_micro_batches,
    param_groups,
    token_count,
    token_nll_sum,
    total_tokens,
)
from oomguard.metrics.models import make_batch
from oomguard.metrics.workload import MetricTrial

MiB = 2**20
# metric -> fixed result knobs used in the tests (kept small for speed)
CORE = {
    "loss": {},
    "gradient_stats": {},
    "fisher_diagonal": {},
    "hessian_eigenvalues": {"k": 3, "iterations": 6},
    "ggn_eigenvalues": {"k": 3, "iterations": 6},
    "attention_stats": {},
}




def assert_same(a: dict, b: dict, rel: float) -> None:
    """Equal up to ``rel`` relative to the largest magnitude among same-named figures."""
    na, nb = numbers(a), numbers(b)
    assert na.keys() == nb.keys()
    scale = max(abs(v) for v in na.values())
    for key in na:
        tol = rel * max(abs(na[key]), abs(nb[key]), 1e-6 * scale)
        assert math.isfinite(na[key]) and abs(na[key] - nb[key]) <= tol, (key, na[key], nb[key])


def run(name: str, model: torch.nn.Module, data: dict, **params: Any) -> dict:
    metric = get_metric(name)
    return metric.summary(metric.run(model, data, **{**CORE[name], **params}))


# ----------------------------------------------------------------------------- helpers


def test_common_helpers(arch: str) -> None:
    model, data = tiny_model(arch), tiny_data(n=5)
    slices = list(iter_micro_batches(data, 2))
    assert [s["input_ids"].shape[0] for s in slices] == [2, 2, 1]
    assert sum(token_count(s) for s in slices) == total_tokens(data)
    assert total_tokens(data) == int((data["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        ours = sum(token_nll_sum(model, s) for s in slices) / total_tokens(data)
        hf = model(**data).loss  # transformers' own token-weighted mean loss
    assert ours.dtype == torch.float64 and abs(ours.item() - hf.item()) < 1e-6
    groups = param_groups(model)
    assert sum(1 for g in groups if g[-1].isdigit()) == model.config.num_hidden_layers
    assert sum(len(m) for m in groups.values()) == len(list(model.parameters()))
    assert group_name("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert group_name("lm_head.weight") == "lm_head"
    with pytest.raises(ValueError):
        next(iter_micro_batches(data, 0))


# ----------------------------------------------------------------------------- invariance


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CORE))
def test_result_does_not_depend_on_memory_knob(arch: str, name: str) -> None:
    model, data = tiny_model(arch, "float64"), tiny_data(n=6, seq_len=16)
    knob = get_metric(name).memory_knobs()[0].name
    small, large = run(name, model, data, **{knob: 1}), run(name, model, data, **{knob: 6})
    assert_same(small, large, rel=1e-9)
    assert small["n_samples"] == 6
    assert small["params"] == ({**CORE[name], "seed": 0} if CORE[name] else {})


def test_float32_invariance_and_low_precision() -> None:
    model, data = tiny_model("tiny-llama", "float32"), tiny_data(n=6, seq_len=16)
    assert_same(run("gradient_stats", model, data, micro_batch_size=1),
                run("gradient_stats", model, data, micro_batch_size=6), rel=1e-5)
    for dtype in ("bfloat16", "float16"):
        low = tiny_model("tiny-gpt2", dtype)
        for name in ("loss", "fisher_diagonal", "attention_stats"):
            assert all(math.isfinite(v) for v in numbers(run(name, low, data)).values())


# ----------------------------------------------------------------------------- real OOMs

# metric -> (n_samples, seq_len, budget MiB): the default memory size needs more than the budget.
OOM_CASES = {
    "loss": (32, 256, 48),
    "gradient_stats": (32, 128, 32),
    "fisher_diagonal": (32, 16, 64),
    "hessian_eigenvalues": (16, 128, 96),
    "attention_stats": (96, 64, 48),
}


def oom_scenario(name: str) -> dict[str, Any]:
    """In a fresh process: the unconstrained result, a direct run at the default size under
    the budget (must be a real OOM), and the executor's run under the same budget."""
    torch.set_num_threads(1)
    n, seq, mib = OOM_CASES[name]
    model, data = tiny_model("tiny-gpt2", "float32"), tiny_data(n=n, seq_len=seq)
    metric = get_metric(name)
    knob = metric.memory_knobs()[0]
    fixed = {k: v for k, v in CORE[name].items() if k != "iterations"} | (
        {"k": 2, "iterations": 2} if "k" in CORE[name] else {})
    reference = metric.summary(metric.run(model, data, **fixed))
    head = {key: value[:2] for key, value in data.items()}
    direct: str | None = None
    with budget_after_warmup(mib * MiB, lambda: metric.run(model, head, **fixed, **{knob.name: 1})):
        try:
            metric.run(model, data, **fixed)
        except Exception as exc:  # noqa: BLE001 - classified below, in the parent
            direct = "oom" if is_oom(exc) else f"{type(exc).__name__}: {exc}"
        ex = Executor()
        result = ex.run(lambda **kw: metric.summary(metric.run(model, data, **fixed, **kw)),
                        sizes={knob.name: int(knob.default)}, name=name)
    record = ex.history[-1]
    return {"reference": reference, "direct": direct, "result": result,
            "attempts": record.attempts, "default": int(knob.default), "knob": knob.name}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OOM_CASES))
def test_executor_survives_real_oom(name: str) -> None:
    got = in_fresh_process(oom_scenario, name)
    assert got["direct"] == "oom"  # the default size really does not fit the budget
    first = got["attempts"][0][got["knob"]]
    assert first == got["default"]
    assert len(got["attempts"]) >= 2 and got["attempts"][1][got["knob"]] == first // 2
    assert_same(got["reference"], got["result"], rel=1e-5)


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_one_line_usage_error() -> None:
    model, data = tiny_model("tiny-gpt2"), tiny_data(n=2, seq_len=8)
    cases = [
        (lambda: get_metric("nope"), "use one of attention_stats"),
        (lambda: get_metric("loss").run(model, data, batch=3), "use one of micro_batch_size"),
        (lambda: get_metric("loss").run(model, data, micro_batch_size=0), ">= 1"),
        (lambda: get_metric("attention_stats").run(model, data, chunk_size=-2), ">= 1"),
        (lambda: get_metric("hessian_eigenvalues").run(model, data, k=4, iterations=2), "<="),
        (lambda: get_metric("hessian_eigenvalues").run(model, data, seed=-1), "seed"),
        (lambda: MetricTrial("loss", knob="k"), "searchable knobs are micro_batch_size; use one"),
        (lambda: MetricTrial("hessian_eigenvalues", params={"micro_batch_size": 2}), "searched"),
        (lambda: MetricTrial("fisher_diagonal", n_samples=0), "positive"),
        (lambda: MetricTrial("nope"), "use one of attention_stats"),
    ]
    for call, text in cases:
        with pytest.raises(UsageError) as info:
            call()
        message = str(info.value)
        assert text in message and "\n" not in message, message
    empty = make_batch(2, 4, 16)
    empty["labels"][:] = -100
    with pytest.raises(UsageError, match="no scored tokens"):
        get_metric("loss").run(model, empty)


# ----------------------------------------------------------------------------- search


def metric_trial_search() -> tuple[int | None, int | None, list[int]]:
    # Each intra-op thread keeps memory of its own: two, as measured (the suite runs one;
    # on one thread this boundary moved between 11 and 12 from one run to the next).
    torch.set_num_threads(2)
    trial = MetricTrial("loss", n_samples=16, seq_len=128, seed=1)
    found = search(trial, start=4, size_step=4, budget=24 * MiB, max_size=trial.max_size())
    return found.max_ok, found.first_oom, [t.size for t in found.trials]


@pytest.mark.slow
def test_metric_trial_search_finds_the_boundary_in_a_fresh_process() -> None:
    # In a long test process the heap holds reusable freed memory that the budget does not
    # count (docs/measurements.md#free-heap-at-budget-entry): the boundary is asserted fresh,
    # in a spawned interpreter: a child of the worker's shared forkserver found 8 in one CI
    # run, its state being whatever the tests that started the server preloaded.
    with Child(mp.get_context("spawn"), metric_trial_search) as child:
        max_ok, first_oom, sizes = child.wait().result()
    # Measured: 10 fits and 11 does not, in three fresh processes out of three; the E10
    # routine went 4, 8 (fit), 12 (OOM), then bisected 10 (fit), 11 (OOM).
    assert (max_ok, first_oom) == (10, 11)
    assert sizes == [4, 8, 12, 10, 11]


def test_metric_trial_is_a_picklable_workload() -> None:
    trial = MetricTrial("loss", n_samples=16, seq_len=16, seed=1)
    assert trial.name == "loss.micro_batch_size" and trial.max_size() == 16
    assert "oomguard.metrics.loss" in trial.preload
    clone = pickle.loads(pickle.dumps(trial))
    assert clone._state == {} and clone == trial
    assert clone(5)["n_samples"] == 16


def test_metric_trial_runs_every_core_metric() -> None:
    for name in CORE:
        trial = MetricTrial(name, model="tiny-llama", n_samples=3, seq_len=8,
                            params={k: v for k, v in CORE[name].items()})
        trial.warmup()
        summary = trial(3)
        assert summary["n_samples"] == 3
        assert pickle.loads(pickle.dumps(summary)) == summary
