"""``oomguard bench --remedies``: the remedies table in the terminal, report.md and report.json;
bad input is one line and exit code 2 before any work."""

from __future__ import annotations

import json

import pytest
from conftest import cli_in_child

from oomguard.engine.cli.main import main

TINY = ("gpt2:n_embd=32,n_layer=2,n_head=2,vocab_size=256,n_positions=64,bos_token_id=0,"
        "eos_token_id=0")


@pytest.mark.slow
def test_bench_remedies_writes_the_table(tmp_path) -> None:
    out = tmp_path / "rep"
    done = cli_in_child("bench", "--model", TINY, "--seq-len", "32", "--budget", "48MiB",
                        "--start", "8", "--max-size", "8", "--remedies", "accumulate,checkpoint",
                        "--effective-batch", "12", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "remedies for 12 rows per optimizer step: accumulate at micro-batch 12" in done.stdout
    assert "configuration" in done.stdout and "samples/s" in done.stdout
    md = (out / "report.md").read_text()
    assert "## Remedies Priced by Speed" in md
    assert "| accumulate | 12 |" in md and "| checkpoint | - |" in md
    assert "not needed: the plain step fits 12 rows at one micro-batch" in md
    record = json.loads((out / "report.json").read_text())["context"]["remedies"]
    assert record["chosen"] == "accumulate" and record["rows"] == 12
    assert record["confirmation"]["ok"]
    plain = record["table"][0]
    assert plain["samples_per_second"] > 0 and plain["peak_bytes"] > 0


@pytest.mark.parametrize(("argv", "words"), [
    (["--remedies", "accumulate,bogus"], "--remedies: unknown remedy 'bogus': use one or more of"),
    (["--remedies", ""], "--remedies: no remedy named"),
    (["--effective-batch", "64"], "give --remedies too"),
    (["--remedies", "checkpoint", "--isolate"], "drop --isolate and --confirm"),
    (["--remedies", "checkpoint", "--effective-batch", "0"], "must be a positive integer"),
])
def test_bad_remedy_options_are_one_line(argv, words, tmp_path, capsys) -> None:
    assert main(["bench", *argv, "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "rep").exists()
