"""Job files and data sources: parsing, one-line errors with field and line, exit code 2,
no output folder after a bad job, every data source."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from oomguard.engine.cli.jobs import main
from oomguard.engine.jobs.data import load_data
from oomguard.engine.jobs.spec import (
    EXAMPLE,
    DataSpec,
    JobError,
    load_job,
    parse_duration,
    parse_job,
)

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
    job = parse_job(EXAMPLE, path="example.toml", base=tmp_path)
    assert job.models == ("tiny-gpt2",)
    assert [m.name for m in job.metrics] == ["loss", "gradient_stats"]
    assert job.data.source == "generated" and job.search.max_trials > 0
    assert job.metrics[0].time_limit == 20 * 60
    assert job.budget_bytes is None


def test_example_printed_by_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--example"]) == 0
    assert capsys.readouterr().out == EXAMPLE


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
    with pytest.raises(JobError, match="valid metrics are .*gradient_stats.*loss"):
        load_job(_write(tmp_path, GOOD.replace('"loss"', '"nope"')))


def test_toml_syntax_error_gives_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, GOOD.replace("n_samples = 4", "n_samples = = 4"))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid TOML" in err and "line 7" in err and not (tmp_path / "out").exists()


def test_missing_job_file_and_bad_arguments(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "nope.toml")]) == 2
    assert "job file not found" in capsys.readouterr().err
    assert main(["run"]) == 2
    assert main(["run", "--bogus"]) == 2


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
