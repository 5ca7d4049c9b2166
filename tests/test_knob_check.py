"""Memory knobs verified (issue 27, item 5): before a job or ``oomguard search`` trusts a knob
declared memory-only, the metric runs at two sizes of it on 3 rows, and a knob that changes the
result is refused in one line naming the metric, the knob and the key; ``oomguard metrics
--check`` prints every verdict.

The metrics below are shaped like analysis code that breaks the rule: a mean of per-chunk means
(exact only when every chunk has the same rows), and an attribution that returns other keys
when it is chunked (TensorScope's integrated gradients did); beside them one that is exact
(token-weighted sums) and one whose chunks change only float rounding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_data

from oomguard.engine.cli.main import main
from oomguard.engine.errors import UsageError
from oomguard.metrics import metric
from oomguard.metrics.base import Knob, Metric, get_metric, register
from oomguard.metrics.knob_check import (
    check_memory_knobs,
    compare_results,
    require_memory_knobs,
)
from oomguard.metrics.models import build_model

SMALL = "gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32"
CALLS: list[int] = []


def _row_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token NLL (nats) of each row's valid tokens, and their count, [rows, 2]."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).double(),
                                           batch["input_ids"][:, 1:], reduction="none")
    keep = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).double()
    return torch.stack([(nll * keep).sum(1), keep.sum(1)], dim=1)


@metric(memory={"chunk_size": 4})
def kc_mean_of_means(model, batch, *, chunk_size):
    """The loss as a mean of each chunk's mean: wrong when chunks differ in tokens."""
    means = []
    for i in range(0, batch["input_ids"].shape[0], chunk_size):
        part = _row_loss(model, {k: v[i:i + chunk_size] for k, v in batch.items()})
        means.append(part[:, 0].sum() / part[:, 1].sum())
    return {"loss": torch.stack(means).mean(), "n_rows": batch["input_ids"].shape[0]}


@metric(memory={"chunk_size": 4})
def kc_exact(model, batch, *, chunk_size):
    """The token-weighted loss from exact float64 sums over chunks."""
    CALLS.append(chunk_size)
    total = sum(_row_loss(model, {k: v[i:i + chunk_size] for k, v in batch.items()}).sum(0)
                for i in range(0, batch["input_ids"].shape[0], chunk_size))
    return {"loss": total[0] / total[1], "tokens": int(total[1])}


@register
class KeysWhenChunked(Metric):
    """An attribution that returns one delta per chunk (``delta_0``, ``delta_1``, ...) when
    its data is chunked, and ``delta`` when it is not."""

    name = "kc_keys_when_chunked"
    description = "per-chunk keys"
    knobs = (Knob("chunk_size", "memory", 8, 1), Knob("n_steps", "result", 4, 2))

    def compute(self, model, data, chunk_size=8, n_steps=4):
        rows = data["input_ids"].shape[0]
        if chunk_size >= rows:
            return {"delta": torch.zeros(())}
        return {f"delta_{i // chunk_size}": torch.zeros(()) for i in range(0, rows, chunk_size)}


@metric(memory={"micro_batch_size": 2}, combine="sum")
def kc_float32_sum(model, batch):
    """A float32 sum: pieces change its rounding only."""
    return {"s": (batch["input_ids"].float() / 7).sum()}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(SMALL)


@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    return tiny_data(6, 12, vocab=64)


def test_a_mean_of_means_and_changing_keys_differ_an_exact_metric_passes(model, data):
    [wrong] = check_memory_knobs(get_metric("kc_mean_of_means"), model, data)
    assert (wrong.metric, wrong.knob, wrong.status, wrong.key) == (
        "kc_mean_of_means", "chunk_size", "differs", "loss")
    assert wrong.sizes == (1, 2) and wrong.rows == 3 and wrong.max_abs_diff > 1e-4
    assert wrong.line().startswith("kc_mean_of_means.chunk_size: differs: key 'loss' (values "
                                   "differ beyond rtol 0.0001, atol 1e-06) between chunk_size=1 "
                                   "and chunk_size=2 on 3 rows, max abs diff ")
    [keys] = check_memory_knobs(get_metric("kc_keys_when_chunked"), model, data, {"n_steps": 2})
    assert (keys.status, keys.key, keys.detail) == ("differs", "delta_2",  # 3 pieces, then 2
                                                    "present at one size only")
    [exact] = check_memory_knobs(get_metric("kc_exact"), model, data)
    assert exact.status == "ok" and exact.max_abs_diff < 1e-12
    assert exact.line().startswith("kc_exact.chunk_size: ok (chunk_size=1 and chunk_size=2 on 3 "
                                   "rows, max abs diff ")
    [rounding] = check_memory_knobs(get_metric("kc_float32_sum"), model, data)
    assert rounding.status == "ok"


def test_a_refusal_is_one_line_naming_metric_knob_and_key(model, data):
    with pytest.raises(UsageError) as info:
        require_memory_knobs(get_metric("kc_mean_of_means"), model, data)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("metric 'kc_mean_of_means': memory knob 'chunk_size' changes the "
                              "result (key 'loss': values differ beyond rtol 0.0001, atol 1e-06, "
                              "between chunk_size=1 and chunk_size=2 on 3 rows)")


def test_a_verdict_is_kept_per_process_for_the_same_model_and_metric(data):
    fresh = build_model(SMALL)
    CALLS.clear()
    first = check_memory_knobs(get_metric("kc_exact"), fresh, data)
    assert CALLS == [1, 2]
    assert check_memory_knobs(get_metric("kc_exact"), fresh, data) == first
    assert CALLS == [1, 2]  # not run again
    check_memory_knobs(get_metric("kc_exact"), build_model(SMALL), data)
    assert CALLS == [1, 2, 1, 2]  # another model: checked


def test_results_compare_by_keys_shapes_and_precision() -> None:
    a = {"x": torch.tensor([1.0, math.nan]), "n": 3, "name": "h", "params": {"k": 1}}
    assert compare_results(a, {**a, "x": torch.tensor([1.0 + 1e-7, math.nan]),
                               "params": {"k": 2}})[0] is None
    assert compare_results(a, {**a, "x": torch.tensor([1.1, math.nan])})[:2] == (
        "x", "values differ beyond rtol 0.0001, atol 1e-06")
    assert compare_results(a, {**a, "x": torch.ones(3)})[:2] == ("x", "shape [2] != [3]")
    assert compare_results(a, {**a, "n": 4})[:2] == ("n", "integers differ")
    assert compare_results(a, {**a, "name": "g"})[:2] == ("name", "'h' != 'g'")
    assert compare_results({"e": [1.0, 2.0]}, {"e": [1.0, 2.0 + 1e-9]})[0] is None
    assert compare_results({"a": {"b": 1.0}}, {"a": {"c": 1.0}})[:2] == (
        "a.b", "present at one size only")


def test_search_refuses_a_knob_that_changes_the_result_before_any_trial(tmp_path, capsys):
    out = tmp_path / "rep"
    code = main(["search", "--metric", "kc_mean_of_means", "--model", SMALL, "--samples", "4",
                 "--seq-len", "8", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(
        "oomguard: error: metric 'kc_mean_of_means': memory knob 'chunk_size' changes the result "
        "(key 'loss': ")
    assert not out.exists()  # no search ran, no folder left behind


def test_metrics_check_prints_a_line_per_knob_and_fails_on_a_difference(capsys):
    assert main(["metrics", "--check", "--metric", "kc_exact", "--model", SMALL]) == 0
    assert capsys.readouterr().out.startswith("kc_exact.chunk_size: ok (chunk_size=1 and ")
    assert main(["metrics", "--check", "--metric", "kc_mean_of_means", "--model", SMALL,
                 "--json"]) == 1
    [row] = json.loads(capsys.readouterr().out)
    assert (row["metric"], row["knob"], row["status"], row["key"]) == (
        "kc_mean_of_means", "chunk_size", "differs", "loss")
    assert main(["metrics", "--seq-len", "8"]) == 2
    assert capsys.readouterr().err == ("oomguard: error: --seq-len is for --check (the data the "
                                       "knobs are checked on): add --check, or drop "
                                       "--seq-len\n")


JOB_PLUGIN = '''
import torch
from oomguard.metrics import metric


@metric(memory={"chunk_size": 2})
def job_mean_of_means(model, batch, *, chunk_size):
    ids = batch["input_ids"].double()
    return {"mean": torch.stack([ids[i:i + chunk_size].mean()
                                 for i in range(0, ids.shape[0], chunk_size)]).mean()}


@metric(memory={"chunk_size": 2})
def job_exact(model, batch, *, chunk_size):
    ids = batch["input_ids"].double()
    return {"mean": sum(ids[i:i + chunk_size].sum() for i in range(0, ids.shape[0], chunk_size))
            / ids.numel()}
'''


@pytest.mark.slow
def test_a_job_refuses_the_knob_before_its_search_and_runs_the_others(tmp_path: Path) -> None:
    from oomguard.engine.jobs.journal import replay
    from oomguard.engine.jobs.runner import run_job
    from oomguard.engine.jobs.spec import load_job

    plugin = tmp_path / "kc_job_plugin.py"
    plugin.write_text(JOB_PLUGIN, encoding="utf-8")
    path = tmp_path / "job.toml"
    path.write_text(f'output = "{tmp_path / "out"}"\nplugins = ["{plugin}"]\n'
                    f'models = ["{SMALL}"]\nbudget = "256MiB"\n[data]\nseq_len = 8\n'
                    'n_samples = 5\n[search]\nmax_trials = 3\n'
                    '[[metrics]]\nname = "job_mean_of_means"\n[[metrics]]\nname = "job_exact"\n'
                    '[[metrics]]\nname = "job_mean_of_means"\nid = "pinned"\n'
                    'sizes = { chunk_size = 5 }\n', encoding="utf-8")
    outcome = run_job(load_job(path), cache_path=tmp_path / "cache.json", progress=False)
    wrong, exact, pinned = (outcome.results[k] for k in ("job_mean_of_means", "job_exact",
                                                         "pinned"))
    assert wrong.status == "failed" and "\n" not in wrong.reason
    assert wrong.reason.startswith("UsageError: metric 'job_mean_of_means': memory knob "
                                   "'chunk_size' changes the result (key 'mean': ")
    assert exact.ok and exact.sizes["source"] == "search"
    assert pinned.ok and pinned.sizes["source"] == "job file"  # nothing searched: no check
    searched = {e["task"] for e in replay(Path(outcome.out) / "journal.jsonl")
                if e["event"] == "search"}
    assert searched == {"job_exact"}  # the refused knob was never searched
