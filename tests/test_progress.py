"""Progress on long work: ``search``, ``verify``, ``reference`` and a job's metrics show steps
done of the total and the time left, an estimate from the measured time per step so far,
on stderr when it is a terminal or with ``--progress``; ``--no-progress`` (or stderr not a
terminal) adds nothing to the output."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import cli_in_child

from oomguard.engine.cli.main import main
from oomguard.engine.jobs.progress import Steps, trials_left

TINY = ["--model", "gpt2:n_embd=32,n_layer=1,n_head=2,vocab_size=64,n_positions=32",
        "--samples", "2", "--seq-len", "8"]
# "3/3 steps done, 00:01 elapsed, about 00:00 left (estimate: 0.2 s per step so far)"
ESTIMATE = r"about \d\d:\d\d left \(estimate: \d+\.\d s per {} so far\)"


def _shown(err: str, done: str, unit: str) -> bool:
    """Whether stderr shows ``done`` (e.g. "3/3 steps done") and a time left estimated."""
    return bool(re.search(rf"{re.escape(done)}, \d\d:\d\d elapsed, {ESTIMATE.format(unit)}", err))


def test_the_time_left_is_the_mean_measured_time_per_step_times_the_steps_left() -> None:
    steps = Steps(5, "metrics")
    assert steps.left_seconds() is None and steps.estimate() == "time left not known yet"
    steps.skip()  # kept from an earlier run: done, but not timed
    steps.advance(2.0)
    steps.advance(4.0)
    assert steps.left_seconds() == pytest.approx(3.0 * 2)
    assert steps.estimate() == "about 00:06 left (estimate: 3.0 s per metric so far)"
    steps.set_total(None)  # a search before its bracket: not known
    assert steps.left_seconds() is None


def test_a_searchs_trials_left_are_estimated_from_its_bracket() -> None:
    def trials(*sizes: tuple[int, bool]) -> list:
        return [SimpleNamespace(size=s, ok=ok) for s, ok in sizes]

    assert trials_left(trials((8, True)), 1, 64) is None  # no OOM yet: not known
    assert trials_left(trials((8, True), (64, False)), 1, 4096) == 6  # bisect 56 sizes
    assert trials_left(trials((8, True), (64, False)), 8, 4096) == 3  # in units of 8
    assert trials_left(trials((8, True), (9, False)), 1, 64) == 0  # closed
    assert trials_left(trials((64, True)), 1, 64) == 0  # at max_size


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A search with --progress (its report, for verify) and its stderr."""
    out = tmp_path_factory.mktemp("search")
    with pytest.MonkeyPatch.context() as mp:
        err = _stderr(mp, ["search", "--metric", "loss", *TINY, "--budget", "256MiB",
                           "--start", "1", "--max-size", "2", "--out", str(out), "--progress"])
    return out, err


def _stderr(mp: pytest.MonkeyPatch, argv: list[str]) -> str:
    """``main(argv)`` in this process (exit 0); what it wrote to ``sys.stderr``."""
    import io
    import sys

    err = io.StringIO()
    mp.setattr(sys, "stderr", err)
    assert main(argv) == 0, err.getvalue()
    return err.getvalue()


@pytest.mark.slow
def test_search_shows_trials_done_and_the_time_left(searched, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _, err = searched
    assert _shown(err, "2/2 trials done", "trial"), err  # 1 and 2 fit: max_size reached
    assert "search micro_batch_size: 1/? trials done" in err  # no bracket yet: not known
    quiet = _stderr(monkeypatch, ["search", "--metric", "loss", *TINY, "--budget", "256MiB",
                                  "--start", "1", "--max-size", "2", "--out", str(tmp_path),
                                  "--no-progress"])
    assert " done, " not in quiet and "left" not in quiet
    trials = r"^  micro_batch_size +(\d+)  ok "  # each trial's line, above the bar or alone
    assert re.findall(trials, quiet, re.M) == re.findall(trials, err.replace("\r", "\n"),
                                                         re.M) == ["1", "2"]


@pytest.mark.slow
def test_verify_shows_steps_done_and_the_time_left(searched,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    report, _ = searched
    err = _stderr(monkeypatch, ["verify", str(report), "--steps", "3", "--progress"])
    assert _shown(err, "verify: 3/3 steps done", "step"), err
    quiet = _stderr(monkeypatch, ["verify", str(report), "--steps", "3"])  # not a terminal
    assert " done, " not in quiet and "left" not in quiet


@pytest.mark.slow
def test_reference_shows_rows_done_and_the_time_left(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["reference", *TINY, "--metric", "loss", "--budget", "256MiB", "--max-size", "2",
            "--start", "1", "--cache", str(tmp_path / "sizes.json")]
    err = _stderr(monkeypatch, [*argv, "--out", str(tmp_path / "a"), "--progress"])
    assert _shown(err, "reference: 1/1 rows done", "row"), err
    quiet = _stderr(monkeypatch, [*argv, "--out", str(tmp_path / "b"), "--no-progress"])
    assert " done, " not in quiet and "left" not in quiet


JOB = """output = "{out}"
models = ["gpt2:n_embd=32,n_layer=1,n_head=2,vocab_size=64,n_positions=32"]
[data]
seq_len = 8
n_samples = 2
[search]
enabled = false
[[metrics]]
name = "loss"
[[metrics]]
name = "gradient_stats"
"""


@pytest.mark.slow
def test_a_job_shows_metrics_done_and_the_time_left(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(out=tmp_path / "out"), encoding="utf-8")
    run = cli_in_child("run", str(job), "--progress", "--cache", str(tmp_path / "c.json"))
    assert run.returncode == 0, run.stderr
    assert _shown(run.stderr, "job: 1/2 metrics done", "metric"), run.stderr
    assert _shown(run.stderr, "job: 2/2 metrics done", "metric"), run.stderr
    quiet = cli_in_child("run", str(job), "--no-progress", "--out", str(tmp_path / "quiet"),
                         "--cache", str(tmp_path / "c.json"))
    assert quiet.returncode == 0, quiet.stderr
    assert " done, " not in quiet.stderr and "left" not in quiet.stderr


@pytest.mark.slow
def test_a_resumed_job_numbers_each_result_once_in_the_order_they_come(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from oomguard.engine.jobs.runner import run_job
    from oomguard.engine.jobs.spec import load_job

    path = tmp_path / "job.toml"
    path.write_text(f'output = "{tmp_path / "out"}"\nmodels = ["tiny-gpt2"]\n[data]\n'
                    'seq_len = 8\nn_samples = 2\n[search]\nenabled = false\n'
                    '[[metrics]]\nname = "loss"\nsizes = { micro_batch_size = 1 }\n'
                    '[[metrics]]\nname = "loss"\nid = "second"\n'
                    'sizes = { micro_batch_size = 2 }\n', encoding="utf-8")
    assert run_job(load_job(str(path)), progress=False).exit_code == 0
    (tmp_path / "out" / "results" / "loss.json").unlink()  # the first metric runs again
    caplog.clear()
    with caplog.at_level("INFO", logger="oomguard.job"):
        assert run_job(load_job(str(path)), progress=False).exit_code == 0
    counted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[")]
    assert counted == ["[1/2] second: already done, kept",
                       "[2/2] loss: ok in " + counted[1].partition(" ok in ")[2]]
