"""``oomguard show OUT``: a job's table from its output folder: per metric its status (ok,
failed, interrupted, not run), sizes, headline numbers and result file; for a job stopped by
a signal or killed, what is done and what is not; a folder that is not a job's, or a corrupt
results file, is one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Started, cli_in_child

from oomguard.engine.cli.main import main

ROOT = Path(__file__).resolve().parents[1]

# A metric that stops the job it runs in: its process's parent is the job's (a CPU job
# forks it), so the signal arrives while this metric runs, as a Ctrl-C or Slurm's would.
PLUGIN = '''
import os, signal, time
from oomguard.metrics.base import Knob, Metric, register

@register
class StopsTheJob(Metric):
    name = "test_stops_the_job"
    knobs = (Knob("micro_batch_size", "memory", 4, 1), Knob("signal", "result", 15, 1))
    def compute(self, model, data, micro_batch_size=4, signal=15):
        os.kill(os.getppid(), signal)
        time.sleep(60)
        return {"never": 0}
'''

JOB = """output = "{out}"
plugins = ["{plugin}"]
models = ["gpt2:n_embd=32,n_layer=1,n_head=2,vocab_size=64,n_positions=32"]
[data]
seq_len = 8
n_samples = 2
[search]
enabled = false
[[metrics]]
name = "loss"
{middle}[[metrics]]
name = "gradient_stats"
"""


def _job(tmp_path: Path, middle: str = "") -> tuple[Path, Path]:
    plugin = tmp_path / "stops_plugin.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    job, out = tmp_path / "job.toml", tmp_path / "out"
    job.write_text(JOB.format(out=out, plugin=plugin, middle=middle), encoding="utf-8")
    return job, out


def _show(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["show", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_show_prints_every_metric_of_a_finished_job(tmp_path: Path, capsys) -> None:
    job, out = _job(tmp_path)
    assert cli_in_child("run", str(job), "--cache", str(tmp_path / "c.json")).returncode == 0
    text = _show(capsys, str(out))
    lines = text.splitlines()
    assert lines[0] == f"job job ({job}): complete (exit code 0)"
    loss = json.loads((out / "results" / "loss.json").read_text())
    sizes = loss["sizes"]  # the search is off: the metric's default, and it says so
    assert (sizes["final"], sizes["source"]) == ({"micro_batch_size": 32}, "metric default")
    assert lines[2].split()[:4] == ["loss", "ok", "micro_batch_size=32", "(metric"]
    assert f"perplexity={loss['summary']['perplexity']:.4g}" in lines[2]
    assert lines[2].endswith(str(out / "results" / "loss.json"))
    assert lines[3].split()[:2] == ["gradient_stats", "ok"] and "total_norm=" in lines[3]
    assert f"report.md: {out / 'report.md'}" in lines
    doc = json.loads(_show(capsys, str(out), "--json"))
    assert [(t["task"], t["status"], t["sizes"]) for t in doc["tasks"]] == [
        ("loss", "ok", {"micro_batch_size": 32}),
        ("gradient_stats", "ok", {"micro_batch_size": 32})]
    assert doc["tasks"][0]["headline"]["loss"] == loss["summary"]["loss"]


@pytest.mark.slow
def test_show_says_what_is_done_and_not_after_a_signal(tmp_path: Path, capsys) -> None:
    job, out = _job(tmp_path, '[[metrics]]\nname = "test_stops_the_job"\n')
    run = cli_in_child("run", str(job), "--cache", str(tmp_path / "c.json"))
    assert run.returncode == 143, run.stderr
    doc = json.loads(_show(capsys, str(out), "--json"))
    assert (doc["status"], doc["signal"], doc["killed"]) == ("interrupted", "SIGTERM", False)
    assert [(t["task"], t["status"]) for t in doc["tasks"]] == [
        ("loss", "ok"), ("test_stops_the_job", "interrupted"), ("gradient_stats", "not run")]
    assert doc["tasks"][1]["files"] == doc["tasks"][2]["files"] == {}
    lines = _show(capsys, str(out)).splitlines()
    assert lines[0] == f"job job ({job}): interrupted by SIGTERM (exit code 143)"
    assert [line.split()[:2] for line in lines[2:5]] == [
        ["loss", "ok"], ["test_stops_the_job", "interrupted"], ["gradient_stats", "not"]]
    assert ("not done: test_stops_the_job, gradient_stats: run the same `oomguard run` "
            "command again to finish (done metrics are kept)") in lines


@pytest.mark.slow
def test_show_reads_a_killed_run_from_its_results_and_journal(tmp_path: Path, capsys) -> None:
    # SIGKILL: the job's process writes nothing more (no results.json for this run).
    job, out = _job(tmp_path, '[[metrics]]\nname = "test_stops_the_job"\n'
                              'params = { signal = 9 }\n')
    run = Started("run", str(job), "--cache", str(tmp_path / "c.json"), cwd=ROOT)
    run.communicate(timeout=120)
    assert run.returncode == -9, run.returncode
    assert not (out / "results.json").exists()
    doc = json.loads(_show(capsys, str(out), "--json"))
    assert (doc["status"], doc["killed"]) == ("interrupted", True)
    assert [(t["task"], t["status"]) for t in doc["tasks"]] == [
        ("loss", "ok"), ("test_stops_the_job", "interrupted"), ("gradient_stats", "not run")]
    assert "interrupted (its process was killed" in _show(capsys, str(out)).splitlines()[0]


def _folder(tmp_path: Path, files: dict[str, str]) -> Path:
    out = tmp_path / "out"
    (out / "results").mkdir(parents=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return out


JOB_JSON = json.dumps({"name": "j", "path": "/j.toml", "tasks": ["loss"]})
NESTED = "[" * 5000 + "]" * 5000  # past what Python's json parser reads without recursing out
DEEP = "[" * 101 + "]" * 101  # past the nesting any file oomguard writes has


@pytest.mark.parametrize("files, message", [
    ({}, "is not a job's output folder (no job.json)"),
    ({"job.json": "{not json"}, "job.json: cannot read the job's record"),
    ({"job.json": "[1, 2]"}, "job.json: not a job's record"),
    ({"job.json": JOB_JSON, "results.json": "{\"tasks\": "}, "results.json: cannot read"),
    ({"job.json": JOB_JSON, "results.json": "[]"}, "results.json: not a job's results"),
    ({"job.json": JOB_JSON, "results/loss.json": "\x00garbage"}, "loss.json: cannot read"),
    ({"job.json": JOB_JSON, "results/loss.json": "{\"task\": 1}"},
     "loss.json: not a metric's result"),
    ({"job.json": NESTED}, "job.json: cannot read the job's record (nested deeper than 100 "
     "levels); run the job again to rewrite it"),
    ({"job.json": JOB_JSON, "results.json": DEEP}, "results.json: cannot read the job's "
     "results (nested deeper than 100 levels)"),
    ({"job.json": JOB_JSON, "results/loss.json": f'{{"task": {NESTED}}}'},
     "loss.json: cannot read a metric's result (nested deeper than 100 levels)"),
    # a record naming a task that climbs out would read a file outside the folder
    ({"job.json": json.dumps({"name": "j", "path": "/j.toml", "tasks": ["../../secret"]})},
     "job.json: 'results/../../secret.json' cannot be a path inside"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path: Path, capsys, files, message) -> None:
    out = _folder(tmp_path, files)
    assert main(["show", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("oomguard: error: ") and message in err[0], err


def test_a_missing_folder_is_one_line_and_exit_code_2(tmp_path: Path, capsys) -> None:
    assert main(["show", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"oomguard: error: {tmp_path / 'nowhere'}: no such folder: give the "
                   "output folder of `oomguard run`"]


def test_a_nested_journal_line_is_skipped_with_a_warning(tmp_path: Path, capsys) -> None:
    out = _folder(tmp_path, {"job.json": JOB_JSON, "journal.jsonl": '{"event": "job-start", '
                             f'"run": "r1"}}\n{{"event": "start", "task": {NESTED}}}\n'})
    assert main(["show", str(out), "--json"]) == 0
    printed, err = capsys.readouterr()
    state = json.loads(printed)
    assert [(t["task"], t["status"]) for t in state["tasks"]] == [("loss", "not run")]
    assert state["run"] == "r1"
    assert err.splitlines() == [f"WARNING oomguard.journal: {out / 'journal.jsonl'}:2: skipping "
                                "an unreadable journal line (torn write?)"]
