"""Jobs end to end, with real processes: SIGTERM then SIGKILL mid-metric, then a resume that
keeps every finished result byte for byte; failing metrics (a non-OOM error, a real OOM at
every size under a budget, a time limit) recorded while the others complete; a corrupt
cache; two jobs sharing one cache at once; a warm cache that skips every search; job.log
from the command line's parent and children, and no logging set up by the library.

Workloads are the smallest that still exercise each path: the tiny GPT-2, 2 samples of
8-12 tokens, the ``loss``/``gradient_stats`` metrics and test metrics from a plugin; the
search is off except where a test is about it."""

from __future__ import annotations

import json
import logging
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Started, cli_in_child

from oomguard.engine.jobs.cache import SizeCache
from oomguard.engine.jobs.journal import replay
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.spec import load_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"

# Test metrics, loaded by each job through `plugins` (the metric's process imports it).
PLUGIN = '''
import os, time
import torch
from oomguard.metrics.base import Knob, Metric, register

@register
class Boom(Metric):
    name = "test_boom"
    knobs = (Knob("micro_batch_size", "memory", 4, 1),)
    def compute(self, model, data, micro_batch_size=4):
        raise ValueError("boom: this metric always fails")

@register
class Hog(Metric):
    """Needs 256 MiB at every size: under a 64 MiB budget, a real OOM down to the minimum."""
    name = "test_hog"
    knobs = (Knob("chunk", "memory", 8, 1),)
    def compute(self, model, data, chunk=8):
        block = torch.ones(256 * 2**20 // 8 + chunk, dtype=torch.float64)
        return {"sum": float(block.sum())}

@register
class Slow(Metric):
    """Sleeps `seconds` (skipped when OOMGUARD_TEST_FAST is set, and in the task's warm-up,
    which runs it once on one sample), then returns a tensor."""
    name = "test_slow"
    knobs = (Knob("micro_batch_size", "memory", 4, 1), Knob("seconds", "result", 1.0, 0.001))
    def compute(self, model, data, micro_batch_size=4, seconds=1.0):
        t0 = time.time()
        while (len(data["input_ids"]) > 1 and not os.environ.get("OOMGUARD_TEST_FAST")
               and time.time() - t0 < seconds):
            time.sleep(0.02)
        return {"grid": torch.arange(100.0).reshape(10, 10), "seconds": seconds}
'''


def _job(tmp_path: Path, body: str, name: str = "job.toml", seq_len: int = 8,
         search: str = "enabled = false", top: str = "") -> Path:
    plugin = tmp_path / "test_metrics_plugin.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    text = (f'output = "{tmp_path / "out"}"\nplugins = ["{plugin}"]\nmodels = ["tiny-gpt2"]\n{top}'
            f'[data]\nseq_len = {seq_len}\nn_samples = 2\n[search]\n{search}\n' + body)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _cli(*args: str) -> Started:
    return Started(*args, cwd=ROOT)


def _events(out: Path, event: str, task: str | None = None) -> list[dict]:
    return [e for e in replay(out / "journal.jsonl")
            if e["event"] == event and (task is None or e.get("task") == task)]


def _wait(proc: Started, ready: Callable[[], bool], seconds: float = 120) -> None:
    """Poll until ``ready()``; fail with the process's output if it ends or time runs out."""
    deadline = time.monotonic() + seconds
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"not ready (exit {proc.poll()}): {proc.communicate()}")
        time.sleep(0.05)


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state


def _statuses(out: Path) -> dict[str, str]:
    return {k: t["status"] for k, t in json.loads((out / "results.json").read_text())
            ["tasks"].items()}


def _log_pids(log: Path) -> dict[int, list[str]]:
    """job.log's records by process id (``DATE TIME PID LOGGER LEVEL MESSAGE``)."""
    by_pid: dict[int, list[str]] = {}
    for line in log.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^\d{4}-\d\d-\d\d \S+ (\d+) oomguard", line):
            by_pid.setdefault(int(m.group(1)), []).append(line)
    return by_pid


def test_sigterm_sigkill_mid_metric_then_resume_keeps_results(tmp_path: Path) -> None:
    body = ('[[metrics]]\nname = "loss"\n[[metrics]]\nname = "test_slow"\n'
            'params = { seconds = 60.0 }\n[[metrics]]\nname = "gradient_stats"\n')
    job = _job(tmp_path, body)
    out, cache = tmp_path / "out", str(tmp_path / "cache.json")

    # A clean stop while test_slow runs: recorded, reported, exit code 143.
    proc = _cli("run", str(job), "--cache", cache)
    _wait(proc, lambda: bool(_events(out, "sizes", "test_slow")))
    child = _events(out, "sizes", "test_slow")[-1]["pid"]
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert [e["signal"] for e in _events(out, "interrupted", "test_slow")] == ["SIGTERM"]
    assert _statuses(out) == {"loss": "ok", "test_slow": "interrupted",
                              "gradient_stats": "pending"}
    assert json.loads((out / "results.json").read_text())["exit_code"] == 143
    kept = (out / "results" / "loss.json").read_bytes()
    assert json.loads(kept)["status"] == "ok"
    assert _dead(child)

    # A hard kill of the parent while test_slow runs again: its child dies with it.
    proc = _cli("run", str(job), "--cache", cache)
    _wait(proc, lambda: len(_events(out, "sizes", "test_slow")) == 2)
    child = _events(out, "sizes", "test_slow")[-1]["pid"]
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not _dead(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(child)
    assert (out / "results" / "loss.json").read_bytes() == kept
    assert not (out / "results" / "test_slow.json").exists()

    # The same command resumes: loss kept byte for byte, the rest run.
    rerun = cli_in_child("run", str(job), "--cache", cache, cwd=ROOT,
                         env={"OOMGUARD_TEST_FAST": "1"})
    stdout, stderr = rerun.stdout, rerun.stderr
    assert rerun.returncode == 0, stderr
    assert (out / "results" / "loss.json").read_bytes() == kept
    assert [e["task"] for e in _events(out, "skip")] == ["loss", "loss"]
    assert len(_events(out, "start", "test_slow")) == 3  # interrupted, killed, done
    assert len(_events(out, "start", "gradient_stats")) == 1  # pending until now
    assert _statuses(out) == {"loss": "ok", "test_slow": "ok", "gradient_stats": "ok"}
    grid = torch.load(out / "results" / "test_slow.pt", weights_only=True)["grid"]
    assert torch.equal(grid, torch.arange(100.0).reshape(10, 10))  # in full, beside the JSON
    assert [line.split()[:2] for line in stdout.splitlines()[:3]] == [
        ["loss", "ok"], ["test_slow", "ok"], ["gradient_stats", "ok"]]
    assert "- **Status**: complete (exit code 0); 3 ok" in (out / "report.md").read_text()


def test_failures_are_recorded_and_the_rest_completes(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    torn = b'{"entries": {"x": '  # yesterday's half-written cache
    cache.write_bytes(torn)
    body = ('[[metrics]]\nname = "test_boom"\n[[metrics]]\nname = "loss"\n'
            '[[metrics]]\nname = "test_hog"\n[[metrics]]\nname = "test_slow"\n'
            'time_limit = "2s"\nparams = { seconds = 60.0 }\n'
            '[[metrics]]\nname = "loss"\nid = "loss_pinned"\nsizes = { micro_batch_size = 1 }\n')
    job = load_job(_job(tmp_path, body, top='budget = "64MiB"\n'))
    logger = logging.getLogger("oomguard")
    before = (list(logger.handlers), logger.level, logger.propagate)
    outcome = run_job(job, cache_path=cache, progress=False)
    # The library configures no logging: no handler, level or propagate change, no job.log.
    assert (list(logger.handlers), logger.level, logger.propagate) == before
    out = Path(outcome.out)
    assert not (out / "job.log").exists()

    status = {k: r.status for k, r in outcome.results.items()}
    assert status == {"test_boom": "failed", "loss": "ok", "test_hog": "failed",
                      "test_slow": "failed", "loss_pinned": "ok"}
    assert outcome.exit_code == 1
    assert outcome.failed() == ["test_boom", "test_hog", "test_slow"]
    boom = outcome.results["test_boom"]
    assert boom.reason == "ValueError: boom: this metric always fails"
    assert "raise ValueError" in (out / boom.traceback).read_text()
    hog = outcome.results["test_hog"]
    assert hog.reason.startswith("test_hog: ") and "(tried 8, 4, 2, 1)" in hog.reason
    assert [a["chunk"] for a in hog.sizes["attempts"]] == [8, 4, 2, 1]
    assert len(hog.sizes["errors"]) == 4 and hog.sizes["final"] is None
    hog_tb = (out / hog.traceback).read_text()
    assert "DefaultCPUAllocator: can't allocate memory" in hog_tb  # a real OOM, every time
    assert hog_tb.rstrip().endswith(hog.reason)
    assert len(_events(out, "retry", "test_hog")) == 3
    slow = outcome.results["test_slow"]
    assert slow.reason.startswith("time limit of 2 s exceeded (stopped); if the metric needs "
                                  "longer, raise its time_limit in the job file")
    # where it was when stopped: the test metric's sleep (or the model's warm-up under load)
    assert "Where its process was when the time limit stopped it:" in (
        out / slow.traceback).read_text()
    assert outcome.results["loss_pinned"].sizes["source"] == "job file"
    assert outcome.results["loss_pinned"].sizes["final"] == {"micro_batch_size": 1}
    # Reading never moves a corrupt cache (only a write does): it is ignored, the job went on.
    assert cache.read_bytes() == torn and not list(tmp_path.glob("cache.json.corrupt-*"))

    summary = json.loads((out / "results.json").read_text())
    assert (summary["status"], summary["exit_code"], summary["failed"]) == (
        "failed", 1, ["test_boom", "test_hog", "test_slow"])
    assert {k: t["status"] for k, t in summary["tasks"].items()} == status
    for key, result in outcome.results.items():  # the file holds what run_job returned
        assert json.loads((out / "results" / f"{key}.json").read_text()) == summary["tasks"][key]
        assert summary["tasks"][key]["reason"] == result.reason
    report = (out / "report.md").read_text()
    assert "- **Status**: failed (exit code 1); 3 failed, 2 ok" in report
    assert "## Failures" in report
    assert "- **test_boom**: ValueError: boom: this metric always fails" in report
    assert (out / "plots" / "memory.png").read_bytes()[:8] == PNG


def test_two_jobs_share_one_cache_then_warm_cache_skips_search(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    search = "max_trials = 2\nstart = 2\nstep = 2"
    a = _job(tmp_path, '[[metrics]]\nname = "loss"\n[[metrics]]\nname = "gradient_stats"\n',
             "a.toml", seq_len=8, search=search)
    b = _job(tmp_path, '[[metrics]]\nname = "loss"\n[[metrics]]\nname = "test_boom"\n',
             "b.toml", seq_len=12, search=search)
    # Job b from the command line while job a runs in this process: two processes, one cache.
    proc = _cli("run", str(b), "--out", str(tmp_path / "out_b"), "--cache", str(cache))
    outcome = run_job(load_job(a, output=str(tmp_path / "out_a")), cache_path=cache,
                      progress=False)
    _, err = proc.communicate(timeout=150)
    assert outcome.exit_code == 0
    assert proc.returncode == 1, err  # test_boom failed, and is listed on stderr
    assert err.splitlines()[-1] == "failed: test_boom"
    entries = json.loads(cache.read_text())["entries"]  # valid JSON, both jobs' entries
    assert sorted((e["workload"]["metric"], e["workload"]["seq_len"]) for e in entries.values()) \
        == [("gradient_stats", 8), ("loss", 8), ("loss", 12)]
    assert [e["task"] for e in _events(tmp_path / "out_a", "search")] == ["loss",
                                                                         "gradient_stats"]
    # job.log (the command line's): the parent's records and each metric process's records.
    children = {e["pid"] for e in replay(tmp_path / "out_b" / "journal.jsonl")} - {proc.pid}
    assert len(children) == 2  # one process per metric
    by_pid = _log_pids(tmp_path / "out_b" / "job.log")
    assert set(by_pid) == {proc.pid, *children}
    assert any("job b: failed (test_boom failed)" in line for line in by_pid[proc.pid])
    loss_pid = _events(tmp_path / "out_b", "sizes", "loss")[0]["pid"]
    assert any("searching loss" in line for line in by_pid[loss_pid])

    outcome = run_job(load_job(a, output=str(tmp_path / "out_warm")), cache_path=cache,
                      progress=False)
    assert outcome.exit_code == 0
    assert _events(tmp_path / "out_warm", "search") == []  # no search trials at all
    cached = SizeCache(cache).entries()
    assert [r.sizes["source"] for r in outcome.results.values()] == ["cache", "cache"]
    for r in outcome.results.values():
        assert r.search is None
        assert r.sizes["start"] == cached[r.sizes["cache_key"]]["sizes"]
