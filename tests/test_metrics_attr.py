"""Attribution and representation metrics: results do not depend on memory sizes.

integrated_gradients, layer_attribution, position_jacobian, loss_landscape and
cka, on both built-in architectures: the result at the smallest memory sizes
equals the result at the largest (float64: rel <= 1e-9; float32: <= 1e-5), and for
the metrics that can run recomputed (their blocks checkpointed) the same again that
way, equal to the plain result;
under a real CPU budget where the default sizes OOM, the executor returns the
unconstrained result; IG's completeness delta is small; CKA's diagonal is 1;
the landscape's centre is the model's loss and parameters come back bit-for-bit.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import torch
from conftest import budget_after_warmup, in_fresh_processes, once_per_run, tiny_data, tiny_model

from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.memory.heap import return_freed_memory_to_os
from oomguard.engine.core.memory.oom import is_oom
from oomguard.engine.errors import UsageError
from oomguard.metrics.base import get_metric
from oomguard.metrics.integrated_gradients import rows_per_forward
from oomguard.metrics.models import build_model, make_batch

MiB = 1024**2
# Narrow but many-headed: attention probabilities dominate memory and compute stays small,
# so the default sizes exceed a small budget cheaply. Budget cases (NARROW, float64):
# metric: (samples, seq_len, result params).
NARROW = ("gpt2:n_embd=16,n_head=8,n_layer=2,vocab_size=256,n_positions=512,"
          "eos_token_id=0,bos_token_id=0")

# metric: (result params, smallest memory sizes, largest memory sizes, result keys)
CASES: dict[str, tuple[dict, dict, dict, tuple[str, ...]]] = {
    "integrated_gradients": ({"n_steps": 8}, {"chunk_size": 1, "internal_batch_size": 1},
                             {"chunk_size": 4, "internal_batch_size": 64},
                             ("attributions", "delta")),
    "layer_attribution": ({"n_steps": 4}, {"chunk_size": 1, "internal_batch_size": 1},
                          {"chunk_size": 4, "internal_batch_size": 64},
                          ("scores", "totals", "delta")),
    # vjp_block 1 would cost one backward per hidden feature (128): 16 still splits the sum.
    "position_jacobian": ({}, {"micro_batch_size": 1, "vjp_block": 16},
                          {"micro_batch_size": 4, "vjp_block": 128}, ("norms",)),
    "loss_landscape": ({"grid": 3, "span": 0.5}, {"micro_batch_size": 1},
                       {"micro_batch_size": 4}, ("losses",)),
    "cka": ({}, {"chunk_size": 1}, {"chunk_size": 4}, ("cka",)),
}
OOM_CASES: dict[str, tuple[int, int, dict]] = {
    "integrated_gradients": (8, 128, {"n_steps": 2}),
    "layer_attribution": (6, 192, {"n_steps": 2}),
    "position_jacobian": (2, 96, {}),
    "loss_landscape": (8, 192, {"grid": 1}),
    "cka": (8, 192, {}),
}
BUDGET = 32 * MiB  # measured peaks (RSS) at the default sizes: 36-71 MiB; at half: 16-22 MiB
_results: dict[tuple[str, str, bool], dict[str, Any]] = {}
# (metric, recompute): every metric plain, and recomputed where it can run so
WAYS = [(name, False) for name in CASES] + [
    (name, True) for name in CASES if get_metric(name).recomputes]




def rel_diff(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |a - b| relative to max |scale| (default ``b``)."""
    ref = (b if scale is None else scale).abs().max().clamp_min(1e-300)
    return float((a - b).abs().max() / ref)


def compare(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...]) -> float:
    """Largest relative difference over ``keys``; a completeness delta (a difference
    of nearly equal numbers) is measured against the attributions it checks."""
    worst = 0.0
    for key in keys:
        assert a[key].shape == b[key].shape, key
        scale = b.get("attributions", b.get("totals")) if key == "delta" else None
        worst = max(worst, rel_diff(a[key], b[key], scale))
    return worst


def run_small_large(name: str, arch: str, recompute: bool = False
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Results at the smallest and largest sizes, plain or recomputed (cached for the property
    tests)."""
    key = (name, arch, recompute)
    if key not in _results:
        params, small, large, _ = CASES[name]
        model, data = tiny_model(arch), tiny_data(n=4, seq_len=8)
        metric = get_metric(name)
        _results[key] = {
            "small": metric.run(model, data, recompute=recompute, **params, **small),
            "large": metric.run(model, data, recompute=recompute, **params, **large),
            "model": model, "data": data}
    r = _results[key]
    return r["small"], r["large"]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "recompute"), WAYS,
                         ids=[f"{n}-{'recompute' if r else 'plain'}" for n, r in WAYS])
def test_result_does_not_depend_on_memory_sizes(name: str, recompute: bool, arch: str) -> None:
    small, large = run_small_large(name, arch, recompute)
    assert compare(small, large, CASES[name][3]) <= 1e-9
    assert small["params"] == large["params"] == {
        k.name: CASES[name][0].get(k.name, k.default) for k in get_metric(name).result_knobs()}
    if recompute:  # nor on the configuration: the plain results, up to float rounding
        plain_small, plain_large = run_small_large(name, arch)
        assert compare(small, plain_small, CASES[name][3]) <= 1e-9
        assert compare(large, plain_large, CASES[name][3]) <= 1e-9


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_float32_integrated_gradients_agree_to_1e5(recompute: bool) -> None:
    model, data = tiny_model("tiny-gpt2", "float32"), tiny_data(n=4, seq_len=8)
    ig = get_metric("integrated_gradients")
    a = ig.run(model, data, recompute=recompute, n_steps=8, chunk_size=1, internal_batch_size=1)
    b = ig.run(model, data, n_steps=8, chunk_size=4, internal_batch_size=64)
    assert rel_diff(a["attributions"], b["attributions"]) <= 1e-5


def test_internal_batch_size_only_rounds_and_rows_per_forward_is_what_captum_runs() -> None:
    model, data = tiny_model("tiny-llama"), tiny_data(n=4, seq_len=8)
    ig = get_metric("integrated_gradients")
    rows: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda mod, inp, out: rows.append(int(out.shape[0])))
    results = {}
    try:
        for chunk, internal in ((4, 2), (2, 8), (4, 12), (4, 64)):
            rows.clear()
            results[(chunk, internal)] = ig.run(model, data, n_steps=6, chunk_size=chunk,
                                                internal_batch_size=internal)["attributions"]
            # captum's own passes on inputs and baselines have `chunk` rows; the rest are steps
            assert max(rows) == max(chunk, rows_per_forward(chunk, internal, n_steps=6))
    finally:
        hook.remove()
    ref = results[(4, 64)]
    for value in results.values():
        assert rel_diff(value, ref) <= 1e-12
    assert rows_per_forward(128, 8) == 128 and rows_per_forward(4, 16) == 16
    assert rows_per_forward(2, 8, n_steps=3) == 6 and rows_per_forward(4, 2) == 4


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_ig_completeness_delta_is_small(arch: str, recompute: bool) -> None:
    small, large = run_small_large("integrated_gradients", arch, recompute)
    change = large["attributions"].sum(dim=1) - large["delta"]  # f(x) - f(baseline)
    rel = large["delta_max"] / float(change.abs().max())
    assert large["delta_max"] < 1e-3 and rel < 1e-2
    assert large["delta_mean"] <= large["delta_max"]
    pads = _results[("integrated_gradients", arch, recompute)]["data"]["attention_mask"] == 0
    assert bool((large["attributions"][pads] == 0).all())


def test_layer_attribution_totals_match_output_change(arch: str) -> None:
    _, large = run_small_large("layer_attribution", arch)
    assert large["scores"].shape == (4, large["n_layers"]) and bool((large["scores"] > 0).all())
    # every block's output is a bottleneck: signed totals all approximate f(x) - f(x')
    assert float((large["totals"] - large["totals"][:, :1]).abs().max()) < 1e-2


def test_cka_diagonal_is_one(arch: str) -> None:
    _, large = run_small_large("cka", arch)
    m = large["cka"]
    diag_err = float((m.diagonal() - 1).abs().max())
    assert diag_err < 1e-12
    assert torch.allclose(m, m.T, rtol=0, atol=1e-12) and bool((m >= 0).all() & (m <= 1 + 1e-12).all())


def test_landscape_centre_is_the_loss_and_parameters_come_back(arch: str) -> None:
    small, large = run_small_large("loss_landscape", arch)
    model, data = (_results[("loss_landscape", arch, False)][k] for k in ("model", "data"))
    reference = tiny_model(arch)
    for (n1, p1), (_, p2) in zip(model.named_parameters(), reference.named_parameters(),
                                 strict=True):
        assert torch.equal(p1, p2), n1
    with torch.no_grad():  # token-weighted mean NLL, computed here in float64
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
        labels = data["labels"][:, 1:]
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels,
                                                ignore_index=-100, reduction="sum")
        loss = float(nll) / int((labels != -100).sum())
    assert abs(large["center_loss"] - loss) <= 1e-12 * loss
    assert float(large["losses"][1, 1]) == large["center_loss"]
    assert large["axis"].tolist() == [-0.5, 0.0, 0.5] and large["losses"].shape == (3, 3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_models_run(dtype: str) -> None:
    model, data = tiny_model("tiny-llama", dtype), tiny_data(n=2, seq_len=6)
    for name, (params, _, large, keys) in CASES.items():
        out = get_metric(name).run(model, data, **params, **large)
        for key in keys:
            assert out[key].dtype == torch.float64 and bool(out[key].isfinite().all()), (name, key)
    assert float((out["cka"].diagonal() - 1).abs().max()) < 1e-9


def budget_scenario(name: str) -> dict[str, Any]:
    """Default sizes OOM under :data:`BUDGET`; the executor's retries give the unconstrained result."""
    n, seq_len, params = OOM_CASES[name]
    model, data = build_model(NARROW, "float64", seed=0), make_batch(n, seq_len, 256, seed=1)
    metric = get_metric(name)
    before = [p.detach().clone() for p in model.parameters()]
    expected = metric.run(model, data, **params)  # default sizes, no budget
    sizes = {k.name: int(k.default) for k in metric.memory_knobs()}
    minimum = {k.name: int(k.minimum) for k in metric.memory_knobs()}
    warm = make_batch(2, 16, 256, seed=2)
    executor = Executor()
    start = time.perf_counter()
    with budget_after_warmup(BUDGET, lambda: metric.run(model, warm, **params, **minimum)):
        direct = "fit"
        try:
            metric.run(model, data, **params, **sizes)
        except RuntimeError as exc:
            direct = "oom" if is_oom(exc) else repr(exc)
        gc.collect()
        got = executor.run(lambda **s: metric.run(model, data, **params, **s), sizes=sizes,
                           minimum=minimum, name=name)
    record = executor.history[-1]
    return {"direct": direct, "sizes": sizes, "attempts": record.attempts,
            "final": record.final, "diff": compare(got, expected, CASES[name][3]),
            "restored": all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), before,
                                                                      strict=True)),
            "seconds": round(time.perf_counter() - start, 2)}


def fresh_budget_scenario(name: str) -> dict[str, Any]:
    """One budget scenario in a fresh process: see :func:`budget_reports`."""
    return_freed_memory_to_os()  # before anything is allocated: freed memory leaves VmData
    torch.set_num_threads(1)
    return budget_scenario(name)


# Once per run (shared by the xdist workers), not once per visit of a worker's shuffled
# order to this module.
@pytest.fixture(scope="session")
def budget_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every budget scenario's report, once per run (:func:`_budget_reports`)."""
    return once_per_run(tmp_path_factory, "attr-budget-reports", _budget_reports)


def _budget_reports() -> dict[str, dict[str, Any]]:
    """Run each budget scenario in its own fresh process.

    A budget counts from the process's VmData when it is entered; heap that
    earlier work freed but glibc kept is inside VmData and would be reused for
    free (measured: in one pytest process after the other tests, the default
    sizes fitted a 48 MiB budget they exceeded 2-3x in a fresh process). One
    process per scenario, so no scenario inherits another's heap either.
    """
    # two at a time: each scenario runs single-threaded under its own budget
    got = in_fresh_processes(fresh_budget_scenario, [[name] for name in OOM_CASES], workers=2)
    return dict(zip(OOM_CASES, got, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OOM_CASES))
def test_executor_under_budget_returns_unconstrained_result(
        name: str, budget_reports: dict[str, dict[str, Any]]) -> None:
    report = budget_reports[name]
    assert report["direct"] == "oom", f"default sizes {report['sizes']} did not OOM"
    assert len(report["attempts"]) >= 2 and report["final"] != report["sizes"]
    assert report["diff"] <= 1e-9
    assert report["restored"]  # parameters untouched, also after OOMs inside a landscape


@pytest.mark.parametrize("name", list(CASES))
def test_bad_knobs_are_one_line_usage_errors(name: str) -> None:
    metric = get_metric(name)
    model, data = tiny_model("tiny-gpt2"), tiny_data(n=2, seq_len=4)
    knobs = [k.name for k in metric.knobs]
    with pytest.raises(UsageError) as info:
        metric.run(model, data, batch_sizee=4)
    msg = str(info.value)
    assert "\n" not in msg and "batch_sizee" in msg and all(k in msg for k in knobs)
    memory = metric.memory_knobs()[0].name
    for bad in (0, -2):
        with pytest.raises(UsageError) as info:
            metric.run(model, data, **{memory: bad})
        assert "\n" not in str(info.value) and memory in str(info.value)
    if name == "loss_landscape":  # seed 0 is valid (the default); negative is not
        with pytest.raises(UsageError, match="seed"):
            metric.run(model, data, seed=-1)
