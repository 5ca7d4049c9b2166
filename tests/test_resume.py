"""Jobs end to end, with real processes: SIGKILL mid-metric then resume byte for byte;
failing metrics (a non-OOM error, a real OOM at every size under a budget, a time limit)
recorded while the others complete; a corrupt cache; two jobs sharing one cache at
once; a warm cache that skips every search."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from oomguard.engine.jobs.cache import SizeCache
from oomguard.engine.jobs.journal import replay
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.spec import load_job

ROOT = Path(__file__).resolve().parents[1]

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
    """Sleeps `seconds` (skipped when OOMGUARD_TEST_FAST is set), then returns a tensor."""
    name = "test_slow"
    knobs = (Knob("micro_batch_size", "memory", 4, 1), Knob("seconds", "result", 1.0, 0.001))
    def compute(self, model, data, micro_batch_size=4, seconds=1.0):
        t0 = time.time()
        while not os.environ.get("OOMGUARD_TEST_FAST") and time.time() - t0 < seconds:
            time.sleep(0.02)
        return {"grid": torch.arange(100.0).reshape(10, 10), "seconds": seconds}
'''


def _job(tmp_path: Path, body: str, name: str = "job.toml", seq_len: int = 16,
         search: str = "enabled = false", top: str = "") -> Path:
    plugin = tmp_path / "test_metrics_plugin.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    text = (f'output = "{tmp_path / "out"}"\nplugins = ["{plugin}"]\nmodels = ["tiny-gpt2"]\n{top}'
            f'[data]\nseq_len = {seq_len}\nn_samples = 4\n[search]\n{search}\n' + body)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "oomguard.engine.cli.jobs", *args], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _events(out: Path, event: str, task: str | None = None) -> list[dict]:
    return [e for e in replay(out / "journal.jsonl")
            if e["event"] == event and (task is None or e.get("task") == task)]


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state


def test_sigterm_sigkill_mid_metric_then_resume_keeps_results(tmp_path: Path) -> None:
    body = ('[[metrics]]\nname = "loss"\n[[metrics]]\nname = "test_slow"\n'
            'params = { seconds = 60.0 }\n[[metrics]]\nname = "gradient_stats"\n')
    job = _job(tmp_path, body)
    out, cache = tmp_path / "out", str(tmp_path / "cache.json")
    kept = None
    for sig in (signal.SIGTERM, signal.SIGKILL):  # a clean stop, then a hard kill
        proc = _cli("run", str(job), "--cache", cache)
        deadline = time.time() + 90
        while not _events(out, "sizes", "test_slow")[int(sig == signal.SIGKILL):]:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        child = _events(out, "sizes", "test_slow")[-1]["pid"]
        proc.send_signal(sig)
        proc.wait(30)
        if sig == signal.SIGTERM:  # recorded, reported, resumable
            assert proc.returncode == 143
            assert _events(out, "interrupted", "test_slow")
            assert json.loads((out / "results.json").read_text())["status"] == "interrupted"
            kept = (out / "results" / "loss.json").read_bytes()
        else:
            assert proc.returncode == -signal.SIGKILL
        assert json.loads(kept)["status"] == "ok"
        assert (out / "results" / "loss.json").read_bytes() == kept
        assert not (out / "results" / "test_slow.json").exists()
        for _ in range(50):  # the metric's process dies with its parent
            if _dead(child):
                break
            time.sleep(0.1)
        assert _dead(child)

    rerun = _cli("run", str(job), "--cache", cache, env={"OOMGUARD_TEST_FAST": "1"})
    stdout, stderr = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, stderr
    assert (out / "results" / "loss.json").read_bytes() == kept
    assert [e["task"] for e in _events(out, "skip")] == ["loss", "loss"]
    assert len(_events(out, "start", "test_slow")) == 3  # the interrupted one is rerun
    results = json.loads((out / "results.json").read_text())
    assert {k: t["status"] for k, t in results["tasks"].items()} == {
        "loss": "ok", "test_slow": "ok", "gradient_stats": "ok"}
    assert (out / "results" / "test_slow.pt").exists()  # the 10x10 grid, in full
    assert "test_slow" in stdout and (out / "report.md").exists()


def test_failures_are_recorded_and_the_rest_completes(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text('{"entries": {"x": ')  # yesterday's half-written cache
    body = ('[[metrics]]\nname = "test_boom"\n[[metrics]]\nname = "loss"\n'
            '[[metrics]]\nname = "test_hog"\n[[metrics]]\nname = "test_slow"\n'
            'time_limit = "2s"\nparams = { seconds = 60.0 }\n'
            '[[metrics]]\nname = "loss"\nid = "loss_pinned"\nsizes = { micro_batch_size = 1 }\n')
    job = load_job(_job(tmp_path, body, top='budget = "64MiB"\n'))
    t0 = time.perf_counter()
    outcome = run_job(job, cache_path=cache, progress=False)
    assert time.perf_counter() - t0 < 60
    out = Path(outcome.out)
    status = {k: r["status"] for k, r in outcome.results.items()}
    assert status == {"test_boom": "failed", "loss": "ok", "test_hog": "failed",
                      "test_slow": "failed", "loss_pinned": "ok"}
    assert outcome.exit_code == 1 and sorted(outcome.failed()) == ["test_boom", "test_hog",
                                                                     "test_slow"]
    boom = outcome.results["test_boom"]
    assert boom["reason"].startswith("ValueError: boom")
    assert "raise ValueError" in (out / boom["traceback"]).read_text()
    hog = outcome.results["test_hog"]
    assert "every size down to the minimum ran out of memory" in hog["reason"]
    assert [a["chunk"] for a in hog["sizes"]["attempts"]] == [8, 4, 2, 1]
    assert "DefaultCPUAllocator" in (out / hog["traceback"]).read_text() or hog["sizes"]["errors"]
    assert "time limit of 2 s" in outcome.results["test_slow"]["reason"]
    assert len(_events(out, "retry", "test_hog")) == 3
    assert outcome.results["loss_pinned"]["sizes"]["source"] == "job file"
    assert list(tmp_path.glob("cache.json.corrupt-*"))  # moved aside, the job went on
    report = (out / "report.md").read_text()
    assert "## Failures" in report and "test_hog" in report and "boom" in report
    assert (out / "plots" / "memory.png").exists()
    summary = json.loads((out / "results.json").read_text())
    assert summary["exit_code"] == 1 and summary["status"] == "failed"


def test_two_jobs_share_one_cache_then_warm_cache_skips_search(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    search = "max_trials = 3\nstart = 2\nstep = 2"
    a = _job(tmp_path, '[[metrics]]\nname = "loss"\n[[metrics]]\nname = "gradient_stats"\n',
             "a.toml", seq_len=16, search=search)
    b = _job(tmp_path, '[[metrics]]\nname = "loss"\n', "b.toml", seq_len=24, search=search)
    procs = [_cli("run", str(a), "--out", str(tmp_path / "out_a"), "--cache", str(cache)),
             _cli("run", str(b), "--out", str(tmp_path / "out_b"), "--cache", str(cache))]
    for p in procs:
        _, err = p.communicate(timeout=150)
        assert p.returncode == 0, err
    entries = json.loads(cache.read_text())["entries"]  # valid JSON, every job's entries
    assert sorted((e["workload"]["metric"], e["workload"]["seq_len"]) for e in entries.values()) \
        == [("gradient_stats", 16), ("loss", 16), ("loss", 24)]
    assert _events(tmp_path / "out_a", "search")

    job = load_job(a, output=str(tmp_path / "out_warm"))
    outcome = run_job(job, cache_path=cache, progress=False)
    assert outcome.exit_code == 0
    assert _events(tmp_path / "out_warm", "search") == []  # no search trials at all
    cached = SizeCache(cache).entries()
    for r in outcome.results.values():
        assert r["sizes"]["source"] == "cache" and r["search"] is None
        assert r["sizes"]["start"] == cached[r["sizes"]["cache_key"]]["sizes"]
