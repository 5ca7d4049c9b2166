"""Jobs lose nothing and keep nothing that is no longer true: a result whose data file,
checkpoint or tensor file changed is rerun (the old one kept aside, the report says why);
an output folder belongs to one job; values that cannot work fail before any work; a full
disk and an interrupt during the final report end in a consistent state; CPU jobs fork
their children and GPU jobs never do.

Each job is the smallest that exercises its path: the tiny GPT-2 or a saved 1-layer GPT-2,
2 samples of 8 tokens, the ``loss`` metric and a test metric that returns a tensor big
enough to go to ``results/<task>.pt``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Started, cli_in_child

from oomguard.engine.core.child import server_method, start_method
from oomguard.engine.errors import JobError
from oomguard.engine.jobs.fingerprint import Digests, describe_changes
from oomguard.engine.jobs.journal import replay
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.spec import load_job, parse_job

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
import torch
from oomguard.metrics.base import Knob, Metric, register

@register
class Grid(Metric):
    """A 10 x 10 tensor from the data: more than 64 elements, so it goes to a .pt file."""
    name = "test_grid"
    knobs = (Knob("micro_batch_size", "memory", 2, 1),)
    def compute(self, model, data, micro_batch_size=2):
        return {"grid": torch.arange(100.0).reshape(10, 10) + float(data["input_ids"].sum())}
'''


def _job(tmp_path: Path, metrics: str, *, name: str = "job.toml", out: str = "out",
         model: str = "tiny-gpt2", data: str = 'source = "generated"') -> Path:
    plugin = tmp_path / "integrity_plugin.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    path = tmp_path / name
    path.write_text(f'output = "{tmp_path / out}"\nplugins = ["{plugin}"]\nmodels = ["{model}"]\n'
                    f'[data]\n{data}\nseq_len = 8\nn_samples = 2\n[search]\nenabled = false\n'
                    + metrics, encoding="utf-8")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return cli_in_child(*args, cwd=ROOT)


def _events(out: Path, event: str) -> list[dict]:
    return [e for e in replay(out / "journal.jsonl") if e["event"] == event]


def _result(out: Path, key: str) -> dict:
    return json.loads((out / "results" / f"{key}.json").read_text())


@pytest.mark.slow
def test_changed_data_or_missing_tensor_file_reruns_and_keeps_the_old_result(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog " * 4)
    job = load_job(_job(tmp_path, '[[metrics]]\nname = "loss"\n[[metrics]]\nname = "test_grid"\n',
                        data=f'source = "text"\npath = "{corpus}"'))
    out = Path(job.output)
    first = run_job(job, progress=False)
    assert first.exit_code == 0
    loss_before = (out / "results" / "loss.json").read_bytes()

    # Unchanged inputs: both kept, byte for byte.
    again = run_job(load_job(tmp_path / "job.toml"), progress=False)
    assert [e["task"] for e in _events(out, "skip")] == ["loss", "test_grid"]
    assert again.results["loss"].summary == first.results["loss"].summary

    # A missing tensor file: that result is not "done".
    (out / first.results["test_grid"].tensors).unlink()
    third = run_job(load_job(tmp_path / "job.toml"), progress=False)
    assert third.results["test_grid"].rerun_because == [
        "its tensor file results/test_grid.pt is missing"]
    assert (out / "results" / "test_grid.pt").is_file()
    assert (out / "results" / "loss.json").read_bytes() == loss_before

    # New data of the same size (same path, same length): loss is rerun, the old kept aside.
    corpus.write_bytes(b"THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG " * 4)
    fourth = run_job(load_job(tmp_path / "job.toml"), progress=False)
    loss = fourth.results["loss"]
    assert loss.ok and loss.rerun_because == [f"the data file's content changed ({corpus})"]
    assert loss.summary != first.results["loss"].summary  # the true value for the new data
    stale = sorted((out / "results" / "stale").glob("loss.*.json"))
    assert len(stale) == 1 and stale[0].read_bytes() == loss_before
    assert len(list((out / "results" / "stale").glob("test_grid.*.pt"))) == 1
    assert [e["reasons"] for e in _events(out, "stale") if e["task"] == "loss"] == [
        loss.rerun_because]
    report = (out / "report.md").read_text()
    assert "Rerun because their inputs changed" in report and "data file's content" in report


@pytest.mark.slow
def test_a_resaved_checkpoint_reruns_its_results(tmp_path):
    from oomguard.metrics.models import build_model

    ckpt = tmp_path / "ckpt"
    spec = "gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=256,n_positions=64"
    build_model(spec, seed=1).save_pretrained(ckpt)
    job = load_job(_job(tmp_path, '[[metrics]]\nname = "loss"\n', model=str(ckpt)))
    first = run_job(job, progress=False)
    build_model(spec, seed=2).save_pretrained(ckpt)  # new weights, same config and size
    second = run_job(load_job(tmp_path / "job.toml"), progress=False)
    loss = second.results["loss"]
    assert loss.rerun_because == ["the checkpoint's files changed (model.safetensors)"]
    assert loss.summary != first.results["loss"].summary


def test_digests_rehash_a_same_size_rewrite_and_reuse_an_unchanged_file(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(b"a" * 100)
    memo = Digests(tmp_path / "memo.json")
    first = memo.of(f)
    memo.save()
    reread = Digests(tmp_path / "memo.json")
    assert reread.of(f) == first and not reread.changed  # size and mtime unchanged: not read
    f.write_bytes(b"b" * 100)
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert reread.of(f) != first and reread.changed


def test_describe_changes_names_each_part():
    old = {"dtype": "float32", "seed": 0, "oomguard": "0.1.0", "params": {"k": 2}}
    new = {"dtype": "float64", "seed": 0, "oomguard": "0.2.0", "params": {"k": 3}}
    assert describe_changes(old, new) == ["the dtype changed (float32 -> float64)",
                                          "oomguard's version changed (0.1.0 -> 0.2.0)",
                                          "the metric's parameters changed"]
    assert describe_changes(None, new) == [
        "the result has no record of its inputs (written by an older oomguard?)"]


@pytest.mark.slow
def test_an_output_folder_belongs_to_one_job(tmp_path):
    a = _job(tmp_path, '[[metrics]]\nname = "test_grid"\n', name="a.toml")
    b = _job(tmp_path, '[[metrics]]\nname = "loss"\n', name="b.toml")
    out = tmp_path / "out"
    assert _cli("run", str(a)).returncode == 0
    a_results = (out / "results.json").read_bytes()

    refused = _cli("run", str(b))
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert "holds the results of another job ('a'" in refused.stderr and "--force" in refused.stderr
    assert (out / "results.json").read_bytes() == a_results  # nothing of A touched

    forced = _cli("run", str(b), "--force")
    assert forced.returncode == 0, forced.stderr
    moved = list((out / "moved-aside").iterdir())
    assert len(moved) == 1 and (moved[0] / "results.json").read_bytes() == a_results
    assert (moved[0] / "results" / "test_grid.pt").is_file()
    assert sorted(json.loads((out / "results.json").read_text())["tasks"]) == ["loss"]
    # The same job file again is the same job: it resumes.
    assert _cli("run", str(b)).returncode == 0
    assert [e["task"] for e in _events(out, "skip")] == ["loss"]


@pytest.mark.parametrize("top, message", [
    ('budget = "1KiB"\n', "too small for a CPU budget"),
    ('seed = 9223372036854775808\n', "seed: 9223372036854775808 is out of range"),
    ("time_limit = nan\n", "positive, finite number of seconds"),
])
def test_values_that_cannot_work_fail_when_the_job_is_read(tmp_path, top, message):
    text = _job(tmp_path, '[[metrics]]\nname = "loss"\n').read_text()
    with pytest.raises(JobError, match=message):
        parse_job(top + text, path="job.toml")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_budget_larger_than_the_device_fails_before_the_output_folder(tmp_path):
    path = _job(tmp_path, '[[metrics]]\nname = "loss"\n')
    path.write_text('budget = "100TiB"\n' + path.read_text())
    done = _cli("run", str(path))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "budget: 102400.00 GiB is more than cpu's" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_an_output_that_cannot_be_written_fails_before_any_work(tmp_path, kind):
    path = _job(tmp_path, '[[metrics]]\nname = "loss"\n')
    if kind == "file":
        out = tmp_path / "taken"
        out.write_text("not a folder")
    else:  # under a regular file: not creatable, for root too
        out = tmp_path / "taken" / "out"
        (tmp_path / "taken").write_text("not a folder")
    done = _cli("run", str(path), "--out", str(out))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and str(tmp_path / "taken") in done.stderr


def test_children_fork_only_for_cpu_jobs_never_for_a_gpu():
    # Elsewhere the forkserver, or spawn on macOS and Windows (server_method).
    assert start_method("cpu") == ("fork" if sys.platform.startswith("linux")
                                   else server_method())
    for device in ("cuda", "cuda:1", "mps"):
        assert start_method(device) == server_method()
    assert start_method("cpu", fork=False) == server_method()


@pytest.mark.slow
def test_a_cpu_job_from_the_command_line_forks_its_children(tmp_path):
    path = _job(tmp_path, '[[metrics]]\nname = "loss"\n')
    assert _cli("run", str(path)).returncode == 0
    starts = _events(tmp_path / "out", "start")
    assert [e["start_method"] for e in starts] == [start_method("cpu")]


@pytest.mark.slow
def test_a_full_disk_ends_in_one_line_and_keeps_finished_results(tmp_path):
    path = _job(tmp_path, '[[metrics]]\nname = "loss"\n')
    # 8 KiB per file: the job's JSON files fit (2-3 KiB), the memory plot (18 KiB) does not.
    done = subprocess.run(["bash", "-c", f'ulimit -f 8; exec "{sys.executable}" -m oomguard '
                           f'run "{path}"'], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line or "error" in line]
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert len(errors) == 1 and "File too large" in errors[0] and ".png" in errors[0]
    out = tmp_path / "out"
    assert _result(out, "loss")["status"] == "ok"
    assert json.loads((out / "results.json").read_text())["status"] == "complete"


@pytest.mark.slow
def test_an_interrupt_during_the_final_report_is_recorded_and_a_rerun_finishes_it(tmp_path):
    metrics = "".join(f'[[metrics]]\nname = "test_grid"\nid = "grid{i}"\n' for i in range(6))
    path = _job(tmp_path, metrics)
    out = tmp_path / "out"
    assert _cli("run", str(path)).returncode == 0
    for png in (out / "plots").glob("*.png"):
        png.unlink()
    (out / "report.md").unlink()
    # A fully resumed run spends its time on results.json and the report (matplotlib,
    # the memory plot): interrupt it once the last metric has been skipped.
    proc = Started("run", str(path), cwd=ROOT)
    deadline = time.monotonic() + 120
    while len(_events(out, "skip")) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    end = _events(out, "job-end")[-1]
    summary = json.loads((out / "results.json").read_text())
    assert "Traceback" not in err
    # The report was either finished before the signal or abandoned; the record says which.
    assert proc.returncode in (0, 130)
    assert summary["status"] == end["status"] == (
        "interrupted" if proc.returncode == 130 else "complete")
    assert summary["exit_code"] == end["exit_code"] == proc.returncode
    rerun = _cli("run", str(path))
    assert rerun.returncode == 0 and (out / "report.md").is_file()
    assert json.loads((out / "results.json").read_text())["status"] == "complete"
    assert (out / "plots" / "memory.png").is_file()


def test_a_sequence_longer_than_the_models_positions_fails_when_the_job_is_read(tmp_path):
    text = _job(tmp_path, '[[metrics]]\nname = "loss"\n',
                model="gpt2:n_layer=1,n_embd=32,n_head=2,n_positions=16").read_text()
    with pytest.raises(JobError, match=r"line \d+: data.seq_len: models\[0\]: sequence length "
                                       r"20 is longer than the model's 16 positions"):
        parse_job(text.replace("seq_len = 8", "seq_len = 20"), path="job.toml")


UNIT_PLUGIN = '''
from oomguard.metrics.base import Knob, Metric, register

@register
class Quads(Metric):
    """Memory changes only at multiples of 4 items; records every size it runs at."""
    name = "test_quads"
    knobs = (Knob("block", "memory", 4, 1, unit="4 items"),)
    def size_unit(self, knob, params, n_samples):
        return 4 if knob == "block" else 1
    def compute(self, model, data, block=4):
        with open(LOG, "a") as fh:
            fh.write(f"{block}\\n")
        return {"ok": 1}  # the same at every size: a memory knob
'''


@pytest.mark.slow
def test_a_job_searches_a_knob_with_a_unit_in_whole_units(tmp_path):
    plugin = tmp_path / "quads_plugin.py"
    log = tmp_path / "sizes.txt"
    # The log's path is in the plugin itself: a forkserver started by an earlier test
    # would not see an environment variable set now.
    plugin.write_text(f"LOG = {str(log)!r}\n" + UNIT_PLUGIN, encoding="utf-8")
    path = tmp_path / "job.toml"
    path.write_text(f'output = "{tmp_path / "out"}"\nplugins = ["{plugin}"]\n[data]\nseq_len = 8\n'
                    'n_samples = 2\n[search]\nstart = 3\nstep = 3\nmax_size = 20\nmax_trials = 3\n'
                    '[[metrics]]\nname = "test_quads"\n', encoding="utf-8")
    outcome = run_job(load_job(path), cache_path=tmp_path / "cache.json", progress=False)
    record = outcome.results["test_quads"]
    assert record.ok and record.search["unit"] == 4
    # the task's warm-up at the minimum (one sample, before any budget), the knob check's two
    # sizes (on the data, before the search), 3 trials, then the run
    assert [int(x) for x in log.read_text().split()] == [1, 1, 2, 4, 8, 12, 12]
    assert record.sizes["final"] == {"block": 12}
