"""Job files, data sources and job records: parsing, one-line errors with field and line,
exit code 2, no output folder after a bad job, every data source, the example job file, and
the result record that result files hold."""

from __future__ import annotations

import configparser
import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oomguard.engine.cli.jobs import JobLog
from oomguard.engine.cli.main import main
from oomguard.engine.jobs.data import load_data
from oomguard.engine.jobs.example import example_text
from oomguard.engine.jobs.records import Task, TaskResult
from oomguard.engine.jobs.spec import (
    EXAMPLE,
    DataSpec,
    JobError,
    load_job,
    parse_duration,
    parse_job,
)
from oomguard.engine.util.jsonable import stable_hash

GOOD = """\
output = "out"
models = ["tiny-gpt2"]

[data]
source = "generated"
seq_len = 16
n_samples = 4

[[metrics]]
name = "loss"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_example_parses_and_names_every_section(tmp_path: Path) -> None:
    assert EXAMPLE == example_text() and EXAMPLE.startswith("# oomguard job file")
    job = parse_job(EXAMPLE, path="example.toml", base=tmp_path)
    assert job.models == ("tiny-gpt2",)
    assert [m.name for m in job.metrics] == ["loss", "gradient_stats"]
    assert (job.data.source, job.data.seq_len, job.data.n_samples) == ("generated", 32, 8)
    assert job.search.enabled and (job.search.options["max_trials"], job.search.options["start"],
                                   job.search.options["strategy"]) == (6, 8, "guided")
    assert [m.time_limit for m in job.metrics] == [20 * 60, 20 * 60]
    assert job.budget_bytes is None and job.output == str(Path.cwd() / "oomguard-job")


def test_example_printed_by_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--example"]) == 0
    captured = capsys.readouterr()
    assert captured.out == EXAMPLE and captured.err == ""


def test_example_is_package_data() -> None:
    """A wheel carries example.toml only if setup.cfg lists it (editable installs hide this)."""
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    listed = cfg.get("options.package_data", "oomguard.engine.jobs", fallback="").split()
    assert "example.toml" in listed


@pytest.mark.slow
def test_example_needs_no_torch() -> None:
    """``oomguard run --example`` (and ``--help``) must not pay for importing torch."""
    code = ("import sys\nfrom oomguard.engine.cli.main import main\n"
            "assert main(['run', '--example']) == 0\nsys.stdout.write(str('torch' in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout == EXAMPLE + "False"


@pytest.mark.parametrize(("patch", "field", "line"), [
    (lambda t: t.replace("seq_len = 16", 'seq_len = "16"'), "data.seq_len", 6),
    (lambda t: t.replace('name = "loss"', 'name = "lossy"'), "metrics[0].name", 10),
    (lambda t: t.replace("n_samples = 4", "n_samples = true"), "data.n_samples", 7),
    (lambda t: t + 'params = { micro_batch_size = 2 }\n', "metrics[0].params.micro_batch_size",
     11),
    (lambda t: t.replace('source = "generated"', 'source = "text"\npath = "missing.txt"'),
     "data.path", 6),
    (lambda t: t + 'time_limit = "soon"\n', "metrics[0].time_limit", 11),
    (lambda t: 'budget = "lots"\n' + t, "budget", 1),
    (lambda t: t.replace('"tiny-gpt2"', '"mamba:hidden_size=16,num_hidden_layers=1,vocab_size=64"')
     .replace('name = "loss"', 'name = "attention_stats"'), "metrics[0]", 10),
])
def test_bad_job_one_line_error_with_field_and_line(tmp_path: Path, patch, field: str, line: int,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, patch(GOOD))
    with pytest.raises(JobError) as info:
        load_job(path)
    message = str(info.value)
    assert "\n" not in message
    assert f"{field}:" in message and f"line {line}" in message, message
    code = main(["run", str(path), "--cache", str(tmp_path / "cache.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and field in err
    assert not (tmp_path / "out").exists()  # nothing half-made


def test_unknown_metric_lists_valid_names(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="use one of .*gradient_stats.*loss"):
        load_job(_write(tmp_path, GOOD.replace('"loss"', '"nope"')))


def test_toml_syntax_error_gives_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, GOOD.replace("n_samples = 4", "n_samples = = 4"))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid TOML" in err and "line 7" in err and not (tmp_path / "out").exists()


def test_missing_job_file_and_bad_arguments(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["run", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(f"oomguard: error: {missing}: job file not found; ")
    assert main(["run"]) == 2
    assert capsys.readouterr().err == ("oomguard: error: run: give a job file "
                                       "(oomguard run JOB.toml), or --example\n")
    assert main(["run", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_ids_pinned_sizes_and_out_override(tmp_path: Path) -> None:
    text = GOOD + '[[metrics]]\nname = "loss"\nid = "loss_pinned"\nsizes = { micro_batch_size = 2 }\n'
    job = load_job(_write(tmp_path, text), output=str(tmp_path / "elsewhere"))
    assert [m.id for m in job.metrics] == ["loss", "loss_pinned"]
    assert job.metrics[1].sizes == {"micro_batch_size": 2}
    assert job.output == str(tmp_path / "elsewhere")
    with pytest.raises(JobError, match=r"metrics\[1\].id: 'loss' appears twice"):
        load_job(_write(tmp_path, GOOD + '[[metrics]]\nname = "loss"\n'))


def test_durations() -> None:
    assert parse_duration(90) == 90 and parse_duration("90s") == 90
    assert parse_duration("20m") == 1200 and parse_duration("1h30m") == 5400
    for bad in ("", "soon", -1, 0, True):
        with pytest.raises(ValueError):
            parse_duration(bad)


# ------------------------------------------------------------------- data sources
def test_text_source_bytes_as_tokens(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello world! " * 10)
    data = load_data(DataSpec("text", str(path), seq_len=8, n_samples=3), vocab_size=256)
    assert data["input_ids"].shape == (3, 8) and data["input_ids"].dtype == torch.int64
    assert bytes(data["input_ids"][0].tolist()) == b"hello wo"
    assert torch.equal(data["labels"], data["input_ids"])


def test_token_sources_npy_and_whitespace(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(40, dtype=np.int32))
    (tmp_path / "ids.txt").write_text(" ".join(str(i) for i in range(40)))
    for name in ("ids.npy", "ids.txt"):
        d = load_data(DataSpec("tokens", str(tmp_path / name), seq_len=10, n_samples=4), 256)
        assert d["input_ids"][1].tolist() == list(range(10, 20))
    np.save(tmp_path / "rows.npy", np.arange(60).reshape(3, 20))
    d = load_data(DataSpec("tokens", str(tmp_path / "rows.npy"), seq_len=5, n_samples=2), 256)
    assert d["input_ids"].tolist() == [[0, 1, 2, 3, 4], [20, 21, 22, 23, 24]]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        load_data(DataSpec("tokens", str(tmp_path / "ids.txt"), seq_len=10, n_samples=4), 16)


def test_bytes_memmap_seeded_windows(tmp_path: Path) -> None:
    path = tmp_path / "pile.bin"
    path.write_bytes(bytes(range(256)) * 64)
    spec = DataSpec("bytes", str(path), seq_len=16, n_samples=5)
    a, b = load_data(spec, 256, seed=1), load_data(spec, 256, seed=1)
    c = load_data(spec, 256, seed=2)
    assert torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(a["input_ids"],
                                                                            c["input_ids"])
    row = a["input_ids"][0].tolist()
    assert all((y - x) % 256 == 1 for x, y in zip(row[:-1], row[1:], strict=True))  # a contiguous window


def test_too_little_data_is_a_job_error(tmp_path: Path) -> None:
    (tmp_path / "small.txt").write_text("tiny")
    text = GOOD.replace('source = "generated"', 'source = "text"\npath = "small.txt"')
    with pytest.raises(JobError, match=r"data.path: .*needs 64"):
        load_job(_write(tmp_path, text))


# ------------------------------------------------------------------- records
def _task() -> Task:
    return Task(key="loss", metric_id="loss", metric="loss", model="tiny-gpt2",
                params={"temperature": 1.0}, pinned={}, time_limit=60.0,
                workload={"metric": "loss"}, fingerprint="f" * 16)


def test_task_result_round_trips_and_keeps_unknown_keys() -> None:
    failed = TaskResult.failure(_task(), "run1", "ValueError: boom", "tracebacks/loss.txt", 1.23456,
                                sizes={"source": "cache"})
    doc = json.loads(json.dumps(failed.to_dict()))
    assert (doc["status"], doc["reason"], doc["seconds"], doc["sizes"]) == (
        "failed", "ValueError: boom", 1.235, {"source": "cache"})
    assert doc["peak_bytes"] is None and doc["summary"] is None  # every key, always
    assert TaskResult.from_dict(doc) == failed
    newer = {**doc, "status": "ok", "energy_joules": 12.5}  # a key from another version
    kept = TaskResult.from_dict(newer)
    assert kept.ok and kept.extra == {"energy_joules": 12.5} and kept.to_dict() == newer
    with pytest.raises(KeyError, match="'status'"):
        TaskResult.from_dict({"task": "loss", "metric": "loss", "model": "m"})
    pending = TaskResult.of(_task(), "run1", "pending")
    assert (pending.status, pending.seconds, pending.fingerprint) == ("pending", None, "f" * 16)


def test_stable_hash_matches_plain_sorted_json() -> None:
    """Fingerprints and cache keys made before the one sanitiser stay valid."""
    value = {"model_config": "abc", "seq_len": 16, "params": {"b": 1, "a": [1.5, None]}}
    old = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
    assert stable_hash(value) == old
    assert stable_hash({"x": (1, 2)}) == stable_hash({"x": [1, 2]})
    assert stable_hash({"x": 1}) != stable_hash({"x": 2})


def test_job_log_is_the_clis_and_picklable(tmp_path: Path) -> None:
    """The command line's ``log_setup``: job.log in this process; a pickled copy (what a
    forkserver child gets) holds no open file."""
    job_log = JobLog()
    job_log(tmp_path)
    logging.getLogger("oomguard.job").info("hello from %s", "the parent")
    copy = pickle.loads(pickle.dumps(job_log))
    assert copy.handler is None and copy.level == logging.INFO
    job_log.close()
    assert job_log.handler is None
    logging.getLogger("oomguard.job").info("not written: the handler is gone")
    lines = (tmp_path / "job.log").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1
    assert lines[0].endswith(f" {os.getpid()} oomguard.job INFO hello from the parent")
