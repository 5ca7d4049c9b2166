"""``oomguard bench --lengths FILE``: batches planned from a file of sample lengths, written as
shapes.json, shapes.png and shapes.md; bad input is one line and exit code 2 before any work."""

from __future__ import annotations

import json
import math
import time

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
    args = ("bench", "--model", TINY, "--lengths", str(tmp_path / "lengths.txt"), "--budget",
            "24MiB", "--max-size", "128", "--cache", str(tmp_path / "sizes.json"))
    started = time.perf_counter()
    done = cli_in_child(*args, "--out", str(out))
    searched_s = time.perf_counter() - started
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
    # At most 6 real trials of the step, counted from the searches.
    runs = sum(len(r["trials"]) + len(r["checks"]) for r in record["results"])
    assert record["source"] == "search" and record["trials"] == runs <= 6, record["trials"]
    assert all(p["safe"] <= 128 for p in record["points"]), record["points"]  # --max-size

    # The plan is in the size cache: a second run reads it back, no trial, the same plan.
    started = time.perf_counter()
    again = cli_in_child(*args, "--out", str(tmp_path / "again"))
    cached_s = time.perf_counter() - started
    assert again.returncode == 0, again.stderr[-2000:]
    assert "from the size cache" in again.stderr and "0 trials" in again.stdout, again.stdout
    cached = json.loads((tmp_path / "again" / "shapes.json").read_text())
    assert cached["source"] == "cache" and cached["trials"] == 0 and cached["results"] == []
    assert cached["points"] == record["points"] and cached["planned"] == record["planned"]
    assert cached["cache_key"] == record["cache_key"]
    assert not (tmp_path / "again" / "report.md").exists()  # no search to report
    assert cached_s < searched_s, (cached_s, searched_s)
    # An entry whose plan cannot be read is ignored with a warning, and searched again.
    doc = json.loads((tmp_path / "sizes.json").read_text())
    doc["entries"][record["cache_key"]]["plan"]["points"] = "not points"
    (tmp_path / "sizes.json").write_text(json.dumps(doc))
    redone = cli_in_child(*args, "--out", str(tmp_path / "redone"))
    assert redone.returncode == 0, redone.stderr[-2000:]
    assert f"entry {record['cache_key']} ignored" in redone.stderr, redone.stderr[-2000:]
    assert json.loads((tmp_path / "redone" / "shapes.json").read_text())["trials"] > 0


def test_plan_cache_key_is_the_device_with_its_budget_and_the_searched_lengths() -> None:
    from oomguard.engine.cli.shapes import plan_workload
    from oomguard.engine.core.search.config import SearchConfig
    from oomguard.engine.jobs.cache import entry_key
    from oomguard.engine.jobs.plan import identify_device
    from oomguard.metrics.train_step import TrainStep

    step, config = TrainStep(model=TINY, seq_len=32), SearchConfig(budget=24 * 2**20)
    lengths = [4] * 200 + [8] * 60 + [32] * 3
    work = plan_workload(step, config, lengths)
    key = entry_key(identify_device("cpu", 24 * 2**20, "test"), work)
    # Another budget is another device, so another entry.
    assert key != entry_key(identify_device("cpu", 32 * 2**20, "test"), work)
    # Other lengths that the plan searches alike (the same 10th percentile and longest) share
    # the entry: the batches come from each run's own lengths; other searched lengths do not.
    assert work == plan_workload(step, config, lengths + [4] * 50 + [16] * 10)
    assert work["params"]["searched_lengths"] == [4, 11, 32]
    assert work != plan_workload(step, config, [8] * 200 + [32] * 3)
    assert work != plan_workload(step, SearchConfig(budget=24 * 2**20, margin=0.1), lengths)


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


def test_lengths_take_a_named_distribution_where_no_such_file_exists(tmp_path, monkeypatch,
                                                                    capsys) -> None:
    from oomguard.engine.cli.shapes import read_lengths

    monkeypatch.chdir(tmp_path)
    tail = read_lengths("long-tail:400")
    assert len(tail) == 400 and min(tail) >= 8 and tail[-1] == max(tail) == 256
    assert tail == read_lengths("long-tail:400")  # the same every run
    assert sorted(tail)[200] < 64  # a long tail: the median far below the longest
    assert len(read_lengths("bimodal")) == 5000
    uniform = read_lengths("uniform:1000")
    assert len(set(uniform)) > 200  # every length from 8 to 256 alike
    (tmp_path / "uniform").write_text("5\n7\n")  # a file of that name is a file
    assert read_lengths("uniform") == [5, 7]
    assert main(["bench", "--lengths", "long-tail:many", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "'many' is not a sample count" in err and len(err.splitlines()) == 1, err
    assert main(["bench", "--lengths", "zipf", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "uniform, long-tail, bimodal" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r").exists()
