"""The command-line defects a new user met, each fixed: a bad option value is one line (no
usage block), ``reference --estimate --measured`` checks its file before any estimate, an
unknown metric in a ``--sizes-file`` is refused and the sizes it pins are said to come from
it, and ``reference`` options that did nothing either work (``--json``) or are not offered
(``--verify-steps``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import one_usage_error

from oomguard.engine.cli.main import main

TINY = ("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32,bos_token_id=0,"
        "eos_token_id=0")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a command that went ahead would write its folder here


@pytest.mark.parametrize("argv, line", [
    (["reference", "--estimate", "--memory", "0"], "oomguard reference: error: argument "
     "--memory: invalid size '0': a memory size must be greater than 0 bytes"),
    (["reference", "--estimate", "--memory", "-5GiB"], "oomguard reference: error: argument "
     "--memory: invalid size '-5GiB': give bytes or a number with a unit"),
    (["verify", "rep", "--size", "0"], "oomguard verify: error: argument --size: must be a "
     "positive integer, got 0"),
    (["search", "--metric", "loss", "--seq-len", "0"], "oomguard: error: --seq-len must be a "
     "positive integer, got 0"),
    (["reference", "--seq-len", "0"], "oomguard: error: --seq-len must be a positive integer, "
     "got 0"),
    (["search", "--metric", "loss", "--budget", "0"], "oomguard search: error: argument "
     "--budget: invalid size '0'"),
    (["search"], "oomguard search: error: the following arguments are required: --metric"),
    (["search", "--metric", "loss", "--colour", "red"], "oomguard: error: unrecognized "
     "arguments: --colour red"),
    ([], "oomguard: error: the following arguments are required: COMMAND"),
])
def test_a_bad_option_value_is_one_line_without_the_usage_block(
        argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert one_usage_error(argv, capsys).startswith(line)


def test_help_still_shows_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: oomguard verify")


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "not a reference.json of `oomguard reference` (an object with rows of metric "
               "and knob; got a JSON list)"),
    ('{"rows": [1]}', "got an object without them"),
    ('{"rows": []', "cannot read a reference.json"),
    (json.dumps({"model": "tiny-gpt2", "dtype": "float32", "seq_len": 16, "n_samples": 8,
                 "rows": []}), "--measured was measured for seq_len 16, this estimate is for 32"),
])
def test_measured_is_checked_before_any_estimate(
        content: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from oomguard.engine.jobs import reference_estimate

    def no_estimates(*args, **kwargs):
        raise AssertionError("an estimate started before --measured was checked")

    monkeypatch.setattr(reference_estimate, "Estimator", no_estimates)
    (tmp_path / "measured.json").write_text(content, encoding="utf-8")
    line = one_usage_error(["reference", "--estimate", "--memory", "1GiB", "--metric", "loss",
                      "--measured", "measured.json"], capsys)
    assert says in line


def test_reference_does_not_offer_verify_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert one_usage_error(["reference", "--verify-steps", "3"], capsys) == (
        "oomguard: error: unrecognized arguments: --verify-steps 3")


@pytest.mark.slow
def test_reference_json_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reference", "--estimate", "--memory", "1GiB", "--model", TINY, "--seq-len",
                 "8", "--samples", "2", "--metric", "loss", "--json", "--out", "est"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(Path("est/estimate-reference.json").read_text(encoding="utf-8"))
    assert [r["metric"] for r in doc["rows"]] == ["loss"]


def _sizes_job(tmp_path: Path, sizes_metric: str) -> tuple[str, str]:
    """A job on the tiny model and a sizes file for its device pinning ``sizes_metric``."""
    from oomguard.engine.jobs.plan import device_identity
    from oomguard.engine.jobs.spec import load_job

    job = tmp_path / "job.toml"
    job.write_text(f'output = "{tmp_path / "out"}"\nmodels = ["{TINY}"]\n[data]\nseq_len = 8\n'
                   'n_samples = 2\n[[metrics]]\nname = "loss"\n', encoding="utf-8")
    dev = device_identity(load_job(job))
    sizes = tmp_path / "sizes.toml"
    sizes.write_text(f'[reference]\nmodel = "{TINY}"\ndtype = "float32"\nseq_len = 8\n'
                     f'device = "cpu"\ndevice_name = "{dev["name"]}"\n'
                     f'total_bytes = {dev["total_bytes"]}\n\n[[metrics]]\n'
                     f'name = "{sizes_metric}"\nsizes = {{ micro_batch_size = 2 }}\n',
                     encoding="utf-8")
    return str(job), str(sizes)


def test_an_unknown_metric_in_a_sizes_file_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, sizes = _sizes_job(tmp_path, "los")
    line = one_usage_error(["run", job, "--sizes-file", sizes], capsys)
    assert line.startswith(f"oomguard: error: {sizes}: metrics[0]: unknown metric 'los': "
                           "use one of ")
    assert "loss" in line.partition("use one of ")[2].split(", ")


@pytest.mark.slow
def test_sizes_pinned_by_a_sizes_file_are_said_to_come_from_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, sizes = _sizes_job(tmp_path, "loss")
    assert main(["run", job, "--sizes-file", sizes]) == 0
    capsys.readouterr()
    result = json.loads((tmp_path / "out" / "results" / "loss.json").read_text())
    assert result["sizes"]["source"] == f"sizes file {sizes}"
    assert result["sizes"]["final"] == {"micro_batch_size": 2}
    report = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert f"| sizes file {sizes} |" in report and "job file" not in report
