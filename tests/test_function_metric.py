"""Any function is a workload (issue 27, item 1): ``@oomguard.metrics.metric`` registers a plain
function as a metric that ``Metric.run``, jobs and the knob check find by name, in each of its
forms: one call (the function uses its own memory knob), pieces combined by oomguard
(``concat``, ``sum``, a row-weighted ``mean``, a callable), an iterable of batches, and two
models (a representation comparison of two checkpoints). Results may be tensors, numpy arrays,
numbers or nested dicts of them. The functions below are written like analysis code: loops over
chunks, ``torch.no_grad``, numpy at the end."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_in_child, tiny_data

from oomguard.engine.errors import UsageError
from oomguard.metrics import metric
from oomguard.metrics.base import METRICS, Metric, get_metric
from oomguard.metrics.function import combine_pieces, normalise
from oomguard.metrics.models import build_model

SMALL = "gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32"
OTHER = "gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=32"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(SMALL, "float64")


@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    return tiny_data(5, 12, vocab=64)


def _token_entropy(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token entropy (nats) of each row's valid positions, shape [rows]."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    mask = batch["attention_mask"].to(entropy.dtype)
    return (entropy * mask).sum(1) / mask.sum(1)


# ------------------------------------------------------------------ one call
@metric(memory={"chunk_size": 4}, result={"top": 3})
def fn_entropy_chunks(model, batch, *, chunk_size, top):
    """Per-row entropy, chunked by the function itself; numpy arrays and scalars out."""
    rows = [_token_entropy(model, {k: v[i:i + chunk_size] for k, v in batch.items()})
            for i in range(0, batch["input_ids"].shape[0], chunk_size)]
    per_row = torch.cat(rows).numpy()
    return {"per_row": per_row, "stats": {"mean": np.float64(per_row.mean()),
                                          "top": np.sort(per_row)[-top:]}, "kind": "entropy"}


def test_a_function_is_a_registered_metric_with_its_knobs_and_results_normalised(model, data):
    m = get_metric("fn_entropy_chunks")
    assert isinstance(m, Metric) and m is fn_entropy_chunks.metric
    assert [(k.name, k.kind, k.default) for k in m.knobs] == [
        ("chunk_size", "memory", 4), ("top", "result", 3)]
    assert m.description == "Per-row entropy, chunked by the function itself; numpy arrays and " \
                            "scalars out."
    result = m.run(model, data, chunk_size=2)
    assert isinstance(result["per_row"], torch.Tensor) and result["per_row"].shape == (5,)
    assert isinstance(result["stats"]["mean"], float) and result["stats"]["top"].shape == (3,)
    assert result["kind"] == "entropy" and result["params"] == {"top": 3}
    expected = _token_entropy(model, data)
    torch.testing.assert_close(result["per_row"], expected)
    summary = m.summary(result)
    assert summary["stats"]["mean"] == pytest.approx(float(expected.mean()))
    json.dumps(summary)  # plain JSON
    with pytest.raises(UsageError, match=r"unknown knob\(s\) chunk for metric"):
        m.run(model, data, chunk=2)


def test_results_of_every_shape_are_normalised() -> None:
    t = torch.ones(2, requires_grad=True) * 2
    assert normalise(t)["value"].requires_grad is False  # a bare tensor, detached
    assert normalise(np.arange(3))["value"].tolist() == [0, 1, 2]
    assert normalise(np.float32(1.5)) == {"value": 1.5}
    assert normalise(7) == {"value": 7}
    assert normalise([1.0, 2.0])["value"].tolist() == [1.0, 2.0]
    nested = normalise({"a": {"b": np.ones((2, 2))}, "c": [torch.zeros(2), torch.ones(2)]})
    assert nested["a"]["b"].shape == (2, 2) and nested["c"].shape == (2, 2)
    for bad, words in ((None, "returned NoneType at 'value'"),
                       ({"x": {"y": object()}}, "returned object at 'x.y'"),
                       ({"params": 1}, "returned a key 'params'")):
        with pytest.raises(UsageError, match=words):
            normalise(bad, "m")


# ------------------------------------------------------------------ pieces combined
@metric(memory={"micro_batch_size": 2}, combine="concat")
def fn_entropy_rows(model, batch):
    return {"entropy": _token_entropy(model, batch)}


@metric(memory={"micro_batch_size": 2}, combine="mean")
def fn_entropy_mean(model, batch, *, micro_batch_size):
    assert batch["input_ids"].shape[0] <= micro_batch_size  # a piece, never more rows
    return {"entropy": _token_entropy(model, batch).mean(), "rows": batch["input_ids"].shape[0]}


@metric(memory={"micro_batch_size": 2}, combine="sum")
def fn_token_count(model, batch):
    return {"tokens": batch["attention_mask"].sum(), "rows": np.int64(batch["input_ids"].shape[0])}


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_pieces_combine_exactly_at_every_size(model, data, size):
    expected = _token_entropy(model, data)
    rows = get_metric("fn_entropy_rows").run(model, data, micro_batch_size=size)
    torch.testing.assert_close(rows["entropy"], expected)
    # the mean over rows, weighted by each piece's rows: not a mean of per-piece means
    mean = get_metric("fn_entropy_mean").run(model, data, micro_batch_size=size)
    torch.testing.assert_close(mean["entropy"], expected.mean())
    assert mean["rows"] == pytest.approx(sum(min(size, 5 - i) ** 2 for i in range(0, 5, size)) / 5)
    count = get_metric("fn_token_count").run(model, data, micro_batch_size=size)
    assert int(count["tokens"]) == int(data["attention_mask"].sum()) and count["rows"] == 5


def test_a_callable_combines_pieces_and_mismatched_pieces_are_refused() -> None:
    pieces = [{"hist": torch.tensor([1, 2])}, {"hist": torch.tensor([3, 4])}]
    out = combine_pieces(pieces, [2, 1], lambda rs, rows: {"max": max(int(r["hist"].max())
                                                                       for r in rs)})
    assert out == {"max": 4}
    with pytest.raises(UsageError, match="pieces returned different keys"):
        combine_pieces([{"a": 1.0}, {"b": 1.0}], [1, 1], "sum", "m")
    assert combine_pieces([{"s": "x"}, {"s": "x"}], [1, 1], "concat")["s"] == "x"
    floats = combine_pieces([{"a": 0.1}, {"a": 0.2}], [1, 1], "concat")["a"]
    assert floats.dtype == torch.float64 and floats.tolist() == [0.1, 0.2]  # not rounded
    assert combine_pieces([{"a": 0.1}, {"a": 0.2}], [1, 3], "mean")["a"] == pytest.approx(0.175)


def test_a_bare_decorator_registers_a_function_without_knobs(model, data):
    @metric
    def fn_bare(model, batch):
        return batch["input_ids"].shape[0]

    assert get_metric("fn_bare").run(model, data) == {"value": 5, "params": {}}
    assert get_metric("fn_bare").memory_knobs() == ()


# ------------------------------------------------------------------ an iterable of batches
SEEN: list[list[int]] = []


@metric(memory={"batch_size": 2}, batches=True)
def fn_streamed(model, batches):
    """Welford-style: a running token-weighted sum over the batches, in order."""
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    SEEN.append([])
    for batch in batches:
        SEEN[-1].append(int(batch["input_ids"].shape[0]))
        mask = batch["attention_mask"]
        total += (_token_entropy(model, batch) * mask.sum(1)).sum()
        tokens += int(mask.sum())
    return total / tokens


def test_an_iterable_of_batches_sees_every_row_once_in_order_at_every_size(model, data):
    mask = data["attention_mask"].to(torch.float64)
    expected = (_token_entropy(model, data) * mask.sum(1)).sum() / mask.sum()
    for size in (1, 2, 4, 5):
        SEEN.clear()
        result = get_metric("fn_streamed").run(model, data, batch_size=size)
        assert set(result) == {"value", "params"}
        torch.testing.assert_close(result["value"], expected)
        assert SEEN == [[min(size, 5 - i) for i in range(0, 5, size)]]


# ------------------------------------------------------------------ two models
def _linear_cka(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x, y = x - x.mean(0), y - y.mean(0)
    return (x.T @ y).square().sum() / ((x.T @ x).square().sum() * (y.T @ y).square().sum()).sqrt()


@metric(memory={"chunk_size": 2}, models=2, second_model=OTHER)
def fn_cka_ab(model_a, model_b, batch, *, chunk_size):
    """Linear CKA between the last hidden states of two models (valid tokens), from exact
    float64 Gram sums accumulated over chunks."""
    grams = None
    for i in range(0, batch["input_ids"].shape[0], chunk_size):
        piece = {k: v[i:i + chunk_size] for k, v in batch.items()}
        keep = piece["attention_mask"].bool()
        with torch.no_grad():
            feats = [m(input_ids=piece["input_ids"], attention_mask=piece["attention_mask"],
                       output_hidden_states=True).hidden_states[-1][keep].double()
                     for m in (model_a, model_b)]
        z = torch.cat(feats, dim=1)
        sums = (z.T @ z, z.sum(0), z.shape[0])
        grams = sums if grams is None else tuple(a + b for a, b in zip(grams, sums, strict=True))
    gram, total, n = grams
    mean = total / n
    cov = gram - n * torch.outer(mean, mean)
    d = feats[0].shape[1]
    hsic = [[cov[a:a + d, b:b + d].square().sum() for b in (0, d)] for a in (0, d)]
    return {"cka": hsic[0][1] / (hsic[0][0] * hsic[1][1]).sqrt(), "tokens": n}


def test_two_models_compared_through_metric_run(model, data):
    m = get_metric("fn_cka_ab")
    assert [(k.name, k.kind, k.default) for k in m.result_knobs()] == [
        ("second_model", "result", OTHER)]
    other = build_model(OTHER, "float64")
    keep = data["attention_mask"].bool()
    with torch.no_grad():
        xa = model(**{k: data[k] for k in ("input_ids", "attention_mask")},
                   output_hidden_states=True).hidden_states[-1][keep]
        xb = other(**{k: data[k] for k in ("input_ids", "attention_mask")},
                   output_hidden_states=True).hidden_states[-1][keep]
    expected = _linear_cka(xa, xb)
    for size in (1, 2, 5):
        result = m.run(model, data, chunk_size=size)
        torch.testing.assert_close(result["cka"], expected)
        assert result["params"] == {"second_model": OTHER} and result["tokens"] == int(keep.sum())
    # the same model on both sides: CKA 1; the second one built once, in the first's dtype
    same = m.run(model, data, chunk_size=2, second_model=SMALL)
    torch.testing.assert_close(same["cka"], torch.tensor(1.0, dtype=torch.float64))
    [(key, built)] = m._second.items()
    assert key[0] == SMALL and next(built.parameters()).dtype == torch.float64
    with pytest.raises(UsageError, match="fn_cka_ab.second_model must be a non-empty string"):
        m.run(model, data, second_model=3)


def test_a_job_file_names_the_second_model_and_a_bad_one_fails_at_its_line() -> None:
    from oomguard.engine.jobs.spec import JobError, parse_job

    text = (f'models = ["{SMALL}"]\n[data]\nseq_len = 8\n[[metrics]]\nname = "fn_cka_ab"\n'
            'params = { second_model = "%s" }\n')
    job = parse_job(text % SMALL)
    assert job.metrics[0].params == {"second_model": SMALL}
    with pytest.raises(JobError) as info:
        parse_job(text % "nosuchmodel:x=1")
    assert "\n" not in str(info.value) and "line 6: metrics[0].params: unknown model " \
        "'nosuchmodel:x=1'" in str(info.value)


# ------------------------------------------------------------------ bad declarations
@pytest.mark.parametrize(("kwargs", "fn", "words"), [
    ({"memory": {"chunk": 0}}, "def f(model, batch, *, chunk): ...",
     "memory knob 'chunk' needs a positive integer"),
    ({"memory": {"chunk": 2}}, "def f(model, batch): ...", "f takes no keyword argument chunk"),
    ({"memory": {"chunk": 2}}, "def f(batch, *, chunk): ...", r"must take \(model, batch"),
    ({"memory": {"a": 2, "b": 2}, "combine": "sum"}, "def f(model, batch, *, a, b): ...",
     "name the memory knob that sets each piece's rows"),
    ({"memory": {"a": 2}, "combine": "median"}, "def f(model, batch): ...",
     "unknown combine 'median'"),
    ({"memory": {"a": 2}, "split": "a"}, "def f(model, batch): ...", "needs combine="),
    ({"memory": {"a": 2}, "combine": "sum", "batches": True}, "def f(model, batch): ...",
     "not both"),
    ({"memory": {"a": 2}, "models": 2}, "def f(m1, m2, batch, *, a): ...",
     "models=2 needs second_model="),
    ({"memory": {"a": 2}, "result": {"a": 1}}, "def f(model, batch, *, a): ...",
     "declared twice"),
    ({"name": "loss", "memory": {"a": 2}}, "def f(model, batch, *, a): ...",
     "'loss' is a built-in metric"),
])
def test_a_bad_declaration_is_one_line(kwargs, fn, words):
    get_metric("loss")  # the built-ins registered
    scope: dict = {}
    exec(fn, scope)  # noqa: S102 - the function under test, declared from its text
    before = dict(METRICS)
    with pytest.raises(UsageError, match=words) as info:
        metric(**kwargs)(scope["f"])
    assert "\n" not in str(info.value) and METRICS == before


# ------------------------------------------------------------------ through a job
JOB_PLUGIN = f'''
import torch
from oomguard.metrics import metric


@metric(memory={{"batch_size": 1}}, batches=True)
def streamed_tokens(model, batches):
    return {{"rows": sum(int(b["input_ids"].shape[0]) for b in batches)}}


@metric(memory={{"chunk_size": 1}}, models=2, second_model="{OTHER}")
def logit_gap(model_a, model_b, batch, *, chunk_size):
    gaps = []
    for i in range(0, batch["input_ids"].shape[0], chunk_size):
        ids = batch["input_ids"][i:i + chunk_size]
        with torch.no_grad():
            gaps.append((model_a(input_ids=ids).logits - model_b(input_ids=ids).logits)
                        .abs().amax(dim=(1, 2)))
    return {{"gap": torch.cat(gaps), "layers_b": model_b.config.n_layer}}
'''


@pytest.mark.slow
def test_the_iterable_and_two_model_forms_run_in_a_job(tmp_path: Path) -> None:
    plugin = tmp_path / "forms_plugin.py"
    plugin.write_text(JOB_PLUGIN, encoding="utf-8")
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(f'''\
        output = "{tmp_path / 'out'}"
        plugins = ["{plugin}"]
        models = ["{SMALL}"]
        budget = "256MiB"
        [data]
        seq_len = 8
        n_samples = 3
        [search]
        max_trials = 3
        [[metrics]]
        name = "streamed_tokens"
        [[metrics]]
        name = "logit_gap"
        [[metrics]]
        name = "logit_gap"
        id = "logit_gap_self"
        params = {{ second_model = "{SMALL}" }}
        '''), encoding="utf-8")
    done = cli_in_child("run", str(job), "--cache", str(tmp_path / "cache.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    tasks = json.loads((tmp_path / "out" / "results.json").read_text())["tasks"]
    streamed = tasks["streamed_tokens"]
    assert streamed["summary"]["rows"] == 3 and streamed["sizes"]["start"]["batch_size"] == 3
    assert streamed["sizes"]["source"] == "search"  # after the knob check let it through
    gap, same = tasks["logit_gap"], tasks["logit_gap_self"]
    assert gap["params"] == {"second_model": OTHER} and gap["summary"]["layers_b"] == 2
    assert gap["sizes"]["source"] == same["sizes"]["source"] == "search"  # one cache entry each
    assert min(gap["summary"]["gap"]) > 0  # two different models
    assert same["summary"]["layers_b"] == 1 and max(same["summary"]["gap"]) == 0
