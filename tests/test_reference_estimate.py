"""``oomguard reference --estimate``: the quick reference from estimates, with no device and
no weights (oomguard.engine.jobs.reference_estimate).

A 7B LLaMA-like config is estimated for 80 GiB in a fresh process, as a user runs it, in
under a minute and under 2 GiB of peak resident memory (no weights are allocated); a
model whose weights alone exceed a small memory gets the "does not fit" row; the search
lands on the boundary of its own estimates; depth extrapolation agrees with an estimate at
full depth; an unknown GPU is one line listing the valid ones; every figure is labelled.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from oomguard.engine.cli.main import main
from oomguard.engine.core.estimate.estimate import LABEL
from oomguard.engine.errors import UsageError
from oomguard.engine.jobs.reference_estimate import (
    GPUS,
    Estimator,
    compare_measured,
    estimate_rows,
    layer_specs,
)
from oomguard.reports.reference_estimate import render_estimate_markdown

LLAMA_7B = ("llama:hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,"
            "num_attention_heads=32,num_key_value_heads=32,vocab_size=32000,"
            "max_position_embeddings=4096")
# Runs the command line in a child and prints the child's peak resident memory (KiB on
# Linux): this wrapper's only child, so no other test's children count.
RSS_WRAPPER = ("import resource, subprocess, sys; "
               "rc = subprocess.run([sys.executable, '-m', 'oomguard', *sys.argv[1:]]).returncode; "
               "print('maxrss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)")


def _oomguard(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``oomguard *args`` in this process (an estimate allocates nothing): the exit code and
    what went to stderr."""
    code = main(list(args))
    return code, capsys.readouterr().err


def _check_labelled(md: str) -> None:
    """Every byte figure in a table row is marked (est.), or (measured) where it comes from
    a measured reference; the header says estimate."""
    assert "Every figure here is an estimate" in md and LABEL in md
    for line in md.splitlines():
        if line.startswith("|") and "---" not in line:
            for m in re.finditer(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)", line):
                assert line[m.end():].startswith((" (est.)", " (measured)")), line


@pytest.mark.slow
def test_7b_llama_for_80gib_is_fast_and_allocates_no_weights(tmp_path):
    t0 = time.perf_counter()
    got = subprocess.run(
        [sys.executable, "-c", RSS_WRAPPER, "reference", "--estimate", "--memory", "80GiB",
         "--model", LLAMA_7B, "--dtype", "bfloat16", "--seq-len", "64", "--samples", "4",
         "--metric", "loss,attention_stats", "--out", str(tmp_path / "ref")],
        capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    assert got.returncode == 0, got.stderr
    maxrss_kib, rc = got.stdout.rsplit("maxrss", 1)[1].split()
    assert rc == "0", got.stderr
    assert seconds < 60, f"{seconds:.1f} s"
    assert int(maxrss_kib) * 1024 < 2 * 1024**3, f"peak RSS {int(maxrss_kib) / 1024:.0f} MiB"
    doc = json.loads((tmp_path / "ref" / "estimate-reference.json").read_text())
    assert doc["source"] == "estimated" and doc["kind"] == LABEL
    assert "extrapolated to its 32 layers" in doc["method"]
    for row in doc["rows"]:
        assert row["kind"] == LABEL
        # bf16 weights of 6.7e9 parameters: 12.5 GiB at least, well inside 80 GiB x 0.85.
        assert row["max_ok"] == 4 and 12.5 * 1024**3 < row["total_bytes"] < doc["capacity_bytes"]
    _check_labelled((tmp_path / "ref" / "estimate-reference.md").read_text())
    assert not (tmp_path / "ref" / "reference.json").exists()  # never confused with measured


@pytest.mark.slow
def test_weights_beyond_the_memory_get_the_does_not_fit_row(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _oomguard(capsys, "reference", "--estimate", "--memory", "1MiB", "--metric",
                          "loss", "--samples", "2", "--seq-len", "16", "--batches", "1,2",
                          "--out", "ref")
    assert code == 1, err
    assert "estimated not to fit even at size 1: loss.micro_batch_size" in err
    doc = json.loads((tmp_path / "ref" / "estimate-reference.json").read_text())
    (row,) = doc["rows"]
    assert row["max_ok"] is None and row["first_oom"] == 1
    assert row["next_total_bytes"] > doc["capacity_bytes"] == int(1024**2 * 0.85)
    md = (tmp_path / "ref" / "estimate-reference.md").read_text()
    assert "| loss | micro_batch_size | does not fit |" in md
    assert "| metric | knob | batch 1 | batch 2 |" in md
    _check_labelled(md)


def test_unknown_gpu_is_one_line_listing_the_valid_ones(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _oomguard(capsys, "reference", "--estimate", "--gpu", "H200")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and all(repr(name) in lines[0] for name in GPUS), err


@pytest.mark.slow
def test_search_lands_on_the_boundary_of_its_estimates():
    est = Estimator("tiny-gpt2", "float32", 8, "cpu")
    ends = est.totals("loss", "micro_batch_size", 4, [1, 4])
    capacity = (ends[1][0] + ends[4][0]) // 2
    (row,) = estimate_rows(est, "loss", 4, capacity, 65536)
    assert row["exact"] and 1 < row["max_ok"] < 4 and row["first_oom"] == row["max_ok"] + 1
    assert row["total_bytes"] <= capacity < row["next_total_bytes"]
    check = est.totals("loss", "micro_batch_size", 4, [row["max_ok"], row["first_oom"]])
    assert check[row["max_ok"]][0] == row["total_bytes"]
    # Against a measured reference of the same workload whose peak at its safe size reads
    # 10% above this estimate: the row shows both and the relative error.
    est_peak = check[row["max_ok"]][1]
    measured = {"model": "tiny-gpt2", "dtype": "float32", "seq_len": 8, "n_samples": 4,
                "rows": [{"metric": "loss", "knob": "micro_batch_size", "max_ok": 4,
                          "safe": row["max_ok"], "peak_at_safe_bytes": est_peak * 11 // 10,
                          "peak_source": "measured"}]}
    compare_measured(est, [row], measured, 4)
    assert row["estimated_peak_bytes"] == est_peak and row["measured_max"] == 4
    assert row["relative_error"] == pytest.approx(-1 / 11, abs=1e-3)
    doc = {"margin": 0.15, "model": "tiny-gpt2", "memory_name": "1 GiB", "kind": LABEL,
           "method": est.method, "memory_bytes": 1024**3, "capacity_bytes": capacity,
           "dtype": "float32", "seq_len": 8, "n_samples": 4, "device": "cpu", "estimates": 1,
           "seconds": 1.0, "rows": [row], "measured_source": "today", "batch_rows": []}
    md = render_estimate_markdown(doc)
    assert "## Estimate against measurement (today)" in md and "-9.1%" in md
    assert "(measured) |" in md
    _check_labelled(md)
    with pytest.raises(UsageError, match="seq_len"):
        compare_measured(est, [row], {**measured, "seq_len": 16}, 4)


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["cka", "attention_stats"])
def test_depth_extrapolation_matches_full_depth(metric):
    # loss: per-layer parts; cka: a per-pair-of-layers Gram matrix (quadratic in depth);
    # attention_stats: a peak whose largest term differs at 1 layer.
    spec = "gpt2:vocab_size=256,n_embd=32,n_layer=6,n_head=2"
    depth, specs = layer_specs(spec)
    assert depth == 6 and specs[0].endswith("n_layer=1") and "n_layer=6" not in specs[0]
    extrapolated = Estimator(spec, "float32", 16, "cpu")
    full = Estimator(spec, "float32", 16, "cpu")
    full.layers = None
    (a, pa), (b, pb) = (e.totals(metric, None, 2, [2])[2] for e in (extrapolated, full))
    assert abs(a - b) / b < 0.01 and abs(pa - pb) / pb < 0.02, (a, pa, b, pb)
