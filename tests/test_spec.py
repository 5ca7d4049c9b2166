"""Job-file parsing: every field of every table read from one table of fields, each problem
one line naming the file, the line and the field; defaults; the example names every field.
No child process, no budget: parsing only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from oomguard.engine.core.search.config import SearchConfig
from oomguard.engine.jobs import spec
from oomguard.engine.jobs.example import example_text
from oomguard.engine.jobs.spec import JobError, line_of, parse_job

METRIC = '[[metrics]]\nname = "loss"\n'
TOP = ("budget, data, device, dtype, metrics, models, name, on_oom, output, plugins, search, "
       "seed, time_limit")
DURATION = 'expected a duration like 90, "90s", "20m" or "1h30m", got '


def _error(text: str, tmp_path: Path) -> str:
    with pytest.raises(JobError) as info:
        parse_job(text, path="job.toml", base=tmp_path)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("text", "message"), [
    ("colour = 1\n" + METRIC, f"line 1: colour: unknown field (remove it, or fix its name); valid top-level fields are {TOP}"),
    ("device = 3\n" + METRIC, "line 1: device: expected a string, got int 3"),
    ('device = "tpu"\n' + METRIC, "line 1: device: unknown device 'tpu': use cpu, cuda, cuda:N "
                                  "or mps"),
    ('dtype = "int8"\n' + METRIC, "line 1: dtype: unknown dtype 'int8': use one of float32, "
                                  "float64, bfloat16, float16"),
    ("seed = true\n" + METRIC, "line 1: seed: expected an integer, got bool True"),
    ("seed = -1\n" + METRIC, "line 1: seed: -1 is out of range: use 0 <= seed < 2**63"),
    ("output = 3\n" + METRIC, "line 1: output: expected a string, got int 3"),
    ("name = 1\n" + METRIC, "line 1: name: expected a string, got int 1"),
    ("budget = 1.5\n" + METRIC, 'line 1: budget: expected a size like "1GiB", got float 1.5'),
    ('budget = "1KiB"\n' + METRIC, "line 1: budget: '1KiB' is too small for a CPU budget: thread "
                                   "pools need about 20 MiB of headroom; use at least 24.00 MiB"),
    ('time_limit = "soon"\n' + METRIC, f"line 1: time_limit: {DURATION}'soon'"),
    ("time_limit = true\n" + METRIC, "line 1: time_limit: expected a duration, got True"),
    ("models = 3\n" + METRIC, "line 1: models: expected a list of strings, got int 3"),
    ("models = []\n" + METRIC, "line 1: models: give at least one model"),
    ('models = ["tiny-gpt2", 3]\n' + METRIC, "line 1: models[1]: expected a string, got 3"),
    ('models = ["tiny-gpt2", "tiny-gpt2"]\n' + METRIC,
     "line 1: models: two models have the same label; list each model once"),
    ('plugins = "x"\n' + METRIC, "line 1: plugins: expected a list of strings, got str 'x'"),
    ("plugins = [1]\n" + METRIC, "line 1: plugins[0]: expected a string, got 1"),
    ('plugins = ["no_such_module_xyz"]\n' + METRIC,
     "line 1: plugins[0]: cannot import 'no_such_module_xyz': No module named "
     "'no_such_module_xyz'"),
    ('on_oom = ["halve", "pray"]\n' + METRIC, "line 1: on_oom: unknown remedy 'pray': use "
                                              "one of halve, bfloat16, float16, "
                                              "expandable_segments, cpu"),
    ("data = 3\n" + METRIC, "line 1: data: expected a table [data], got int"),
    ("[data]\nsize = 3\n" + METRIC, "line 2: data.size: unknown field (remove it, or fix its name); valid: source, path, "
                                    "seq_len, n_samples"),
    ('[data]\nsource = "web"\n' + METRIC, "line 2: data.source: unknown source 'web': use one "
                                          "of generated, text, tokens, bytes"),
    ('[data]\nseq_len = "16"\n' + METRIC, "line 2: data.seq_len: expected a positive integer, "
                                          "got str '16'"),
    ("[data]\nn_samples = 0\n" + METRIC, "line 2: data.n_samples: expected a positive integer, "
                                         "got 0"),
    ('[data]\nsource = "text"\n' + METRIC, "line 2: data.path: source 'text' needs a path"),
    ('[data]\nsource = "text"\npath = "missing.txt"\n' + METRIC,
     "line 3: data.path: data file not found: {tmp}/missing.txt"),
    ("search = 1\n" + METRIC, "line 1: search: expected a table [search], got int"),
    ("[search]\nfoo = 1\n" + METRIC, "line 2: search.foo: unknown field (remove it, or fix its name); valid: confirm, "
                                     "enabled, isolate, margin, max_seconds, max_size, "
                                     "max_trials, size_step, start, steps_per_trial, strategy, "
                                     "trial_timeout"),
    ('[search]\nstrategy = "fastest"\n' + METRIC, "line 2: search.strategy: unknown strategy "
                                                 "'fastest': use one of guided, expand-bisect"),
    ('[search]\nstrategy = "doubling"\nsize_step = 4\n' + METRIC,
     "line 2: search.strategy: the size step (size_step, --size-step) is expand-bisect's "
     "increment; strategy doubling takes no size step"),
    ("[search]\nenabled = 1\n" + METRIC, "line 2: search.enabled: expected true or false, got "
                                         "int 1"),
    ("[search]\nstep = 0\n" + METRIC, "line 2: search.step: expected a positive integer, got 0"),
    ('[search]\nmax_seconds = "x"\n' + METRIC, f"line 2: search.max_seconds: {DURATION}'x'"),
    ('models = ["tiny-gpt2"]\n', "metrics: no metrics: add at least one [[metrics]] table with "
                                 "a name"),
    ("metrics = [1, 2]\n", "line 1: metrics: expected [[metrics]] tables"),
    (METRIC + "colour = 1\n", "line 3: metrics[0].colour: unknown field (remove it, or fix its name); valid: id, name, "
                              "on_oom, params, sizes, time_limit"),
    ('[[metrics]]\nid = "x"\n', "line 1: metrics[0].name: missing: every [[metrics]] needs a "
                                "name"),
    ("[[metrics]]\nname = 3\n", "line 2: metrics[0].name: expected a string, got int 3"),
    (METRIC + 'id = "a b"\n', "line 3: metrics[0].id: 'a b': use letters, digits, '_', '-', "
                              "'.'"),
    (METRIC + "params = 3\n", "line 3: metrics[0].params: expected a table, got int 3"),
    (METRIC + "params = { micro_batch_size = 2 }\n",
     "line 3: metrics[0].params.micro_batch_size: is a memory knob (tuned, result-invariant): "
     "put it under sizes to pin it"),
    (METRIC + "params = { zz = 2 }\n", "line 3: metrics[0].params.zz: unknown parameter of "
                                       "'loss'; its result-defining parameters are (none)"),
    (METRIC + "sizes = { zz = 2 }\n", "line 3: metrics[0].sizes.zz: not a memory knob of 'loss'; "
                                      "its memory knobs are micro_batch_size"),
    ('[[metrics]]\nname = "loss_landscape"\nparams = { grid = -3 }\n',
     "line 3: metrics[0].params: loss_landscape.grid must be >= 1, got -3"),
    (METRIC + 'time_limit = "soon"\n', f"line 3: metrics[0].time_limit: {DURATION}'soon'"),
    (METRIC + 'on_oom = ["x"]\n', "line 3: metrics[0].on_oom: unknown remedy 'x'"),
    (METRIC + METRIC, "line 4: metrics[1].id: 'loss' appears twice: give each entry a distinct "
                      "id"),
    ('models = ["gpt2:n_layer=1,n_embd=32,n_head=2,n_positions=16"]\n[data]\nseq_len = 20\n'
     + METRIC, "line 3: data.seq_len: models[0]: sequence length 20 is longer than the "
               "model's 16 positions"),
    ('models = ["mamba:hidden_size=16,num_hidden_layers=1,vocab_size=64"]\n[[metrics]]\n'
     'name = "attention_stats"\n', "line 3: metrics[0]: attention_stats does not support "
                                   "models[0] (mamba_hidden_size_16_num_hidden_layers_1_vocab_"
                                   "size_64): the model has no attention layers"),
    ("a = = 1\n", "not valid TOML: Invalid value (at line 1, column 5)"),
])
def test_a_bad_field_is_one_line_naming_file_line_and_field(text: str, message: str,
                                                            tmp_path: Path) -> None:
    got = _error(text, tmp_path)
    expected = message.format(tmp=tmp_path)
    assert got.startswith("job.toml" + ("" if expected.startswith("line") else ": "))
    assert expected in got, got


def test_a_linear_jump_job_aims_at_the_jobs_budget(tmp_path: Path) -> None:
    text = 'budget = "1GiB"\n[search]\nstrategy = "linear-jump"\n' + METRIC
    job = parse_job(text, path="job.toml", base=tmp_path)
    config = SearchConfig.from_options(**job.search.options, budget=job.budget_bytes)
    assert (config.strategy.name, config.strategy.capacity_bytes) == ("linear-jump", 1024**3)
    # without a budget there is nothing to aim at: one line naming the field
    with pytest.raises(JobError, match="search.strategy: strategy linear-jump needs a budget"):
        parse_job('[search]\nstrategy = "linear-jump"\n' + METRIC, path="job.toml",
                  base=tmp_path)


def test_the_old_step_field_still_names_the_increment_with_a_deprecation(tmp_path: Path) -> None:
    with pytest.warns(FutureWarning, match="size_step"):
        job = parse_job("[search]\nstep = 4\n" + METRIC, path="job.toml", base=tmp_path)
    config = SearchConfig.from_options(**job.search.options)
    assert (config.strategy.name, config.strategy.step) == ("expand-bisect", 4)


def test_defaults_and_every_field_read(tmp_path: Path) -> None:
    job = parse_job(METRIC, path="night.toml", base=tmp_path)
    assert (job.name, job.device, job.dtype, job.seed, job.models) == (
        "night", "cpu", "float32", 0, ("tiny-gpt2",))
    assert (job.budget_bytes, job.plugins, job.on_oom) == (None, (), None)
    assert job.output == str(Path.cwd() / "oomguard-job")
    assert (job.data.source, job.data.path, job.data.seq_len, job.data.n_samples) == (
        "generated", None, 32, 8)
    # No search option given: every one is SearchConfig's default, as in the API and the CLI.
    assert (job.search.enabled, dict(job.search.options), job.search.max_size) == (
        True, {}, SearchConfig().max_size)
    (metric,) = job.metrics
    assert (metric.id, metric.params, metric.sizes, metric.time_limit) == ("loss", {}, {}, 1200)

    (tmp_path / "corpus.txt").write_text("hello world " * 50)
    job = parse_job(
        'name = "n"\ndevice = "cuda:1"\ndtype = "bfloat16"\nseed = 7\nbudget = "1KiB"\n'
        'time_limit = "1h30m"\nmodels = "tiny-llama"\non_oom = ["halve", "cpu"]\n'
        '[data]\nsource = "text"\npath = "corpus.txt"\nseq_len = 8\nn_samples = 2\n'
        '[search]\nenabled = false\nmax_trials = 3\nmax_seconds = "2m"\nstart = 4\n'
        'strategy = "expand-bisect"\nsize_step = 2\nmax_size = 100\n[[metrics]]\nname = "loss_landscape"\nid = "ll"\n'
        'params = { grid = 3 }\nsizes = { micro_batch_size = 2 }\ntime_limit = 30\n'
        'on_oom = ["halve"]\n', path="job.toml", base=tmp_path, output="elsewhere")
    assert (job.name, job.device, job.dtype, job.seed, job.budget_bytes) == (
        "n", "cuda:1", "bfloat16", 7, 1024)  # a CUDA budget has no minimum here
    assert job.models == ("tiny-llama",) and job.on_oom == ("halve", "cpu")
    assert job.output == str(Path.cwd() / "elsewhere")
    assert job.data.path == str(tmp_path / "corpus.txt")
    assert job.search.enabled is False and job.search.options == {
        "max_trials": 3, "max_seconds": 120, "start": 4, "strategy": "expand-bisect",
        "size_step": 2, "max_size": 100}
    (metric,) = job.metrics
    assert metric.id == "ll" and metric.params["grid"] == 3 and set(metric.params) > {"grid"}
    assert (metric.sizes, metric.time_limit, metric.on_oom) == ({"micro_batch_size": 2}, 30,
                                                                 ("halve",))


# Fields `oomguard run --example` does not show yet (its text is what users see: adding one
# changes that output).
NOT_IN_EXAMPLE = {"max_size", "id"}


def test_the_example_names_every_field_of_every_table() -> None:
    text = example_text()
    for fields in (spec._JOB, spec._DATA, spec._SEARCH, spec._METRIC):
        for field in fields:
            shown = re.search(rf"^#? ?{field.key} = ", text, flags=re.M) is not None
            assert shown != (field.key in NOT_IN_EXAMPLE), field.key
    assert parse_job(text, path="example.toml").metrics


def test_line_of_finds_a_field_or_its_table() -> None:
    text = 'seed = 1\n[data]\nseq_len = 8\n[[metrics]]\nname = "a"\n[[metrics]]\nid = "b"\n'
    assert line_of(text, "seed") == 1 and line_of(text, "data.seq_len") == 3
    assert line_of(text, "data.path") == 2  # absent: the table's header
    assert line_of(text, "metrics[0]") == 5 and line_of(text, "metrics[1].id") == 7
    assert line_of(text, "metrics[1]") == 6 and line_of(text, "metrics[2].id") is None
    assert line_of(text, "budget") is None
