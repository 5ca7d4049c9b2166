"""``oomguard bench --lengths FILE``: batches planned from a file of sample lengths, written as
shapes.json, shapes.png and shapes.md; bad input is one line and exit code 2 before any work."""

from __future__ import annotations

import json
import math

import pytest
from conftest import cli_in_child

from oomguard.engine.cli.main import main

TINY = ("gpt2:n_embd=32,n_layer=2,n_head=2,vocab_size=256,n_positions=64,bos_token_id=0,"
        "eos_token_id=0")


@pytest.mark.slow
def test_bench_lengths_writes_the_plan(tmp_path) -> None:
    # A long tail from 4 to 32 tokens: most samples short, a few at the longest length.
    lengths = [4] * 200 + [6] * 100 + [8] * 60 + [12] * 30 + [20] * 8 + [32] * 3
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    out = tmp_path / "rep"
    done = cli_in_child("bench", "--model", TINY, "--lengths", str(tmp_path / "lengths.txt"),
                        "--budget", "24MiB", "--max-size", "128", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "x the tokens per batch" in done.stdout
    assert {p.name for p in out.iterdir()} >= {"shapes.json", "shapes.png", "shapes.md",
                                                "report.md", "report.json", "memory.png"}
    assert (out / "shapes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "shapes.json").read_text())
    # The plan searched the longest length and shorter ones; its batches hold every sample.
    assert [p["seq_len"] for p in record["points"]][-1] == 32
    assert len(record["points"]) >= 2
    shapes = record["planned"]["shapes"]
    assert sum(rows for _, rows in shapes) == len(lengths)
    assert len(shapes) == record["planned"]["batches"]
    # The tokens per batch against sizing every batch at the longest length's safe batch.
    fixed = record["longest_length_sizing"]
    assert fixed["batch"] == record["points"][-1]["safe"]
    assert fixed["batches"] == math.ceil(len(lengths) / fixed["batch"])
    assert fixed["tokens_per_batch"] == pytest.approx(sum(lengths) / fixed["batches"])
    assert record["planned"]["tokens_per_batch"] == pytest.approx(sum(lengths) / len(shapes))
    assert record["tokens_ratio"] == pytest.approx(
        record["planned"]["tokens_per_batch"] / fixed["tokens_per_batch"])
    assert record["tokens_ratio"] > 1.0  # short samples: more rows a batch than at 32
    md = (out / "shapes.md").read_text()
    assert "Batches Planned from the Lengths" in md
    assert f"{record['tokens_ratio']:.2f}x the real tokens per batch" in md
    # report.md: the longest length's search, as bench's, with the plan as a section.
    report = (out / "report.md").read_text()
    assert "## Batches Planned from the Lengths" in report
    assert f"{record['tokens_ratio']:.2f}x the real tokens per batch" in report
    context = json.loads((out / "report.json").read_text())["context"]
    assert context["shapes"]["tokens_ratio"] == pytest.approx(record["tokens_ratio"])
    assert context["data"]["sequence_length"] == 32


@pytest.mark.parametrize(("content", "words"), [
    (None, "cannot read it"),
    ("8\n16\nabc\n", "line 3: 'abc' is not an integer"),
    ("8\n0\n", "line 2: length 0 is not above 0"),
    ("8\n-4\n", "line 2: length -4 is not above 0"),
    ("\n\n", "no lengths in it"),
])
def test_bad_lengths_are_one_line(content, words, tmp_path, capsys) -> None:
    path = tmp_path / "lengths.txt"
    if content is not None:
        path.write_text(content)
    assert main(["bench", "--lengths", str(path), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "one sample length" in err, err
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "rep").exists()  # checked before any model or folder


def test_lengths_refuses_isolate(tmp_path, capsys) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("8\n16\n")
    assert main(["bench", "--lengths", str(path), "--isolate", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "drop --isolate" in err and len(err.splitlines()) == 1, err
