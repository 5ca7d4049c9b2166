"""One search configuration: the Python API, the command line and a job file build the same
:class:`SearchConfig` with the same defaults (before, the CLI ran 40 trials from 8 or 32 and a
job 6 trials up to 4096 from 8), a job file can set any of its fields, and ``oomguard search
--metric`` sizes a metric's knobs through the one sizing path jobs and references use."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from oomguard.engine.cli.main import build_parser, main
from oomguard.engine.cli.options import search_config
from oomguard.engine.core.search.config import SearchConfig, resolve
from oomguard.engine.core.search.strategies import ExpandBisect, Guided
from oomguard.engine.jobs.spec import parse_job

# What a search runs with, beside where (device, budget: a command's and a job's own)
COMPARED = ("strategy", "max_size", "max_trials", "max_seconds", "margin", "steps_per_trial",
            "verify_steps", "trial_timeout", "isolate", "confirm", "ram_guard", "restore")
MINIMAL = {"bench": [], "search": ["--metric", "loss"], "reference": []}


def _parse(argv: list[str]) -> object:
    return build_parser(argv).parse_args(argv)


def _fields(config: SearchConfig) -> dict:
    return {name: getattr(config, name) for name in COMPARED}


def test_the_api_the_command_line_and_a_job_file_share_one_set_of_defaults(tmp_path: Path) -> None:
    api = resolve(None, None, None, {})
    assert api.strategy == Guided(start=32) and api.max_trials == 64 and api.max_size == 65536
    for command, argv in MINIMAL.items():
        args = _parse([command, *argv])
        assert _fields(search_config(args, torch.device("cpu"))) == _fields(api), command
    job = parse_job('[[metrics]]\nname = "loss"\n', path="job.toml", base=tmp_path)
    assert _fields(SearchConfig.from_options(**job.search.options)) == _fields(api)


def test_a_job_file_sets_any_field_the_strategy_included(tmp_path: Path) -> None:
    text = ('[search]\nstrategy = "expand-bisect"\nstart = 4\nsize_step = 2\nmax_trials = 9\n'
            'margin = "measured"\nconfirm = true\nsteps_per_trial = 3\ntrial_timeout = 30\n'
            '[[metrics]]\nname = "loss"\n')
    job = parse_job(text, path="job.toml", base=tmp_path)
    config = SearchConfig.from_options(**job.search.options)
    assert config.strategy == ExpandBisect(start=4, step=2)
    assert (config.max_trials, config.margin, config.confirm, config.steps_per_trial,
            config.trial_timeout) == (9, "measured", True, 3, 30)
    # the same options on the command line give the same config
    args = _parse([
        "bench", "--strategy", "expand-bisect", "--start", "4", "--size-step", "2",
        "--max-trials", "9", "--margin", "measured", "--confirm", "--steps-per-trial", "3",
        "--trial-timeout", "30"])
    cli = search_config(args, torch.device("cpu"))
    assert {k: v for k, v in _fields(cli).items()} == _fields(
        dataclasses.replace(config, device=torch.device("cpu")))


@pytest.mark.slow
def test_search_metric_sizes_each_knob_with_the_ones_before_it_at_their_found_sizes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # position_jacobian's rows are micro_batch_size x vjp_block: the second knob must be searched
    # with the first at the size found for it, as a job sizes them, not at its default
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--metric", "position_jacobian", "--samples", "2", "--seq-len", "16",
                 "--budget", "256MiB", "--out", "rep"]) == 0
    first = json.loads((tmp_path / "rep/micro_batch_size/report.json").read_text())
    second = json.loads((tmp_path / "rep/vjp_block/report.json").read_text())
    found = first["summary"]["safe"]
    assert second["context"]["workload_spec"]["fields"]["params"] == {"micro_batch_size": found}


@pytest.mark.parametrize("max_size", [1, 8, 16, 31])
def test_a_max_size_below_the_default_start_starts_there_and_an_explicit_start_is_still_checked(
        max_size: int) -> None:
    # A LoRA run's effective batch (4-8 rows x 2-4 steps) is below the default start of 32:
    # search(max_size=16) refused with "start (32) is larger than max_size (16)".
    from oomguard import search
    from oomguard.engine.errors import UsageError

    assert resolve(None, None, None, {"max_size": max_size}).strategy.start == max_size
    assert SearchConfig.from_options(max_size=max_size).strategy.start == max_size
    assert SearchConfig.from_options(max_size=64).strategy.start == 32  # the default stays
    result = search(lambda n: None, max_size=max_size)
    assert result.trials[0].size == max_size and result.max_ok == max_size
    with pytest.raises(UsageError, match=rf"start \(64\) is larger than max_size \({max_size}\)"):
        search(lambda n: None, start=64, max_size=max_size)
