"""Bad data fails first: token ids outside a model's vocabulary, a sequence length below 2,
and sizes whose batch no device could hold are refused in one line with exit code 2
before any work, in job files and on every command (the overnight job must not start and
fail at its first metric, nor a command end in a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import one_usage_error

from oomguard.engine.jobs.data import MAX_TOKENS

TINY = ("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32,bos_token_id=0,"
        "eos_token_id=0")
HUGE = "99999999999999"  # the size the issue met: "Storage size calculation overflowed"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a command that went ahead would write its folder here


def _job(tmp_path: Path, data: str, metric: str = 'name = "loss"',
         search: str = "enabled = false") -> str:
    path = tmp_path / "job.toml"
    path.write_text(f'output = "{tmp_path / "out"}"\nmodels = ["{TINY}"]\n[data]\n{data}\n'
                    f'[search]\n{search}\n[[metrics]]\n{metric}\n', encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("kind", ["tokens-npy", "tokens-text", "text", "bytes"])
def test_a_job_whose_token_ids_pass_the_vocabulary_is_refused_before_it_starts(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model has 64 ids; each file holds a larger one where the job reads."""
    if kind == "tokens-npy":
        np.save(tmp_path / "ids.npy", np.array([1, 2, 300, 4] * 8, dtype=np.int32))
        source, name, top = "tokens", "ids.npy", 300
    elif kind == "tokens-text":
        (tmp_path / "ids.txt").write_text(" ".join(["5", "70"] * 16), encoding="utf-8")
        source, name, top = "tokens", "ids.txt", 70
    else:
        (tmp_path / "corpus.bin").write_bytes(b"oomguard" * 64)  # bytes are the ids: "u" = 117
        source, name, top = kind, "corpus.bin", ord("u")
    job = _job(tmp_path, f'source = "{source}"\npath = "{name}"\nseq_len = 8\nn_samples = 2')
    line = one_usage_error(["run", job], capsys)
    assert f"data.path: models[0]: {tmp_path / name}: token id {top} is outside the model's " \
           "vocabulary (64 ids, 0-63)" in line
    # a tokens file is not told about byte-level data; a byte source is
    assert ("byte-level" in line) == (source != "tokens")
    assert not (tmp_path / "out").exists()  # refused before the output folder exists


def test_a_job_with_seq_len_1_or_an_overflowing_size_is_refused_inone_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_usage_error(["run", _job(tmp_path, "seq_len = 1\nn_samples = 2")], capsys)
    assert line.endswith("data.seq_len: a sequence length must be at least 2 (a causal LM "
                         "predicts each token from those before it), got 1; give 2 or more")
    line = one_usage_error(["run", _job(tmp_path, "seq_len = 8\nn_samples = 2", 'name = "loss"\n'
                                  f"sizes = {{ micro_batch_size = {HUGE} }}")], capsys)
    assert f"metrics[0].sizes.micro_batch_size: micro_batch_size {HUGE} is too large" in line
    assert f"(at most {MAX_TOKENS // 8} at seq_len 8)" in line
    line = one_usage_error(["run", _job(tmp_path, "seq_len = 8\nn_samples = 2",
                                  search=f"max_size = {HUGE}")], capsys)
    assert f"search.max_size: max_size {HUGE} is too large" in line


@pytest.mark.parametrize("argv, says", [
    (["estimate", "--sizes", HUGE], f"--sizes: {HUGE} is too large: {HUGE} x seq_len 32"),
    (["estimate", "--metric", "loss", "--sizes", f"1,{HUGE}"], f"--sizes: {HUGE} is too large"),
    (["reference", "--estimate", "--memory", "1GiB", "--batches", HUGE], f"--batches: {HUGE}"),
    (["reference", "--estimate", "--memory", "1GiB", "--max-size", HUGE], f"--max-size {HUGE}"),
    (["bench", "--max-size", HUGE], f"--max-size {HUGE} is too large"),
    (["search", "--metric", "loss", "--start", HUGE, "--max-size", HUGE],
     f"--start {HUGE} is too large"),
    (["reference", "--max-size", HUGE], f"--max-size {HUGE} is too large"),
    (["estimate", "--sizes", "1", "--seq-len", "1"], "--seq-len must be at least 2"),
    (["estimate", "--metric", "loss", "--sizes", "1", "--seq-len", "1"],
     "--seq-len must be at least 2"),
    (["search", "--metric", "loss", "--seq-len", "1"], "--seq-len must be at least 2"),
    (["bench", "--seq-len", "1"], "--seq-len must be at least 2"),
    (["reference", "--seq-len", "1"], "--seq-len must be at least 2"),
])
def test_commands_refuse_bad_sizes_and_seq_len_inone_usage_error(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert says in one_usage_error(argv, capsys)


def test_verify_refuses_a_size_no_device_holds(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A report's workload (written by hand, as `oomguard search` writes it) at a --size
    whose batch no device holds: refused before the model is built."""
    report = {"result": {"recommendation": {"safe": 2}, "device": "cpu", "mode": "in-process",
                         "size_name": "micro_batch_size", "budget_bytes": 2**30},
              "context": {"workload_spec": {"kind": "MetricTrial", "fields": {
                  "metric": "loss", "knob": "micro_batch_size", "model": TINY,
                  "n_samples": 2, "seq_len": 8}}}}
    (tmp_path / "report.json").write_text(json.dumps(report), encoding="utf-8")
    line = one_usage_error(["verify", str(tmp_path), "--size", HUGE], capsys)
    assert f"--size {HUGE} is too large: {HUGE} x seq_len 8 tokens" in line


def test_more_samples_than_the_host_holds_is_one_line_before_any_data_is_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 10**14 samples of 8 tokens would take about 18 PiB of ids, masks and labels
    line = one_usage_error(["run", _job(tmp_path, "seq_len = 8\nn_samples = 99999999999999")],
                           capsys)
    assert "data.n_samples: 99999999999999 samples x data.seq_len 8 take " in line
    assert line.endswith("of RAM; lower data.n_samples (at most "
                         + line.rpartition("(at most ")[2])
