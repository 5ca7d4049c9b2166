"""Preemptible clusters: a job stopped by Slurm's warning before its time limit
(``sbatch --signal=USR1@90``, sent to every process of the job step) or by SIGTERM (the
limit itself, preemption, ``scancel``) stops cleanly: what finished is kept, the running
metric is journaled as interrupted, one line says why it stopped and how to resume, the exit
code is 128 + the signal; the same command, as a requeued job runs it, resumes without
rerunning what finished."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import Started, cli_in_child

from oomguard.engine.jobs.journal import replay

ROOT = Path(__file__).resolve().parents[1]

# A metric that runs until the job is stopped (unless OOMGUARD_TEST_FAST is set, as in the
# rerun), so that the signal always finds it running; not in the task's warm-up, which runs
# it once on one sample before the run.
PLUGIN = '''
import os, time
from oomguard.metrics.base import Knob, Metric, register

@register
class Sleeper(Metric):
    name = "test_sleeper"
    knobs = (Knob("micro_batch_size", "memory", 4, 1),)
    def compute(self, model, data, micro_batch_size=4):
        t0 = time.time()
        while (len(data["input_ids"]) > 1 and not os.environ.get("OOMGUARD_TEST_FAST")
               and time.time() - t0 < 120):
            time.sleep(0.02)
        return {"slept": True}
'''


def _job(tmp_path: Path) -> Path:
    plugin = tmp_path / "sleeper_plugin.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    job = tmp_path / "job.toml"
    job.write_text(f'output = "{tmp_path / "out"}"\nplugins = ["{plugin}"]\n'
                   'models = ["tiny-gpt2"]\n[data]\nseq_len = 8\nn_samples = 2\n'
                   '[search]\nenabled = false\n[[metrics]]\nname = "loss"\n'
                   '[[metrics]]\nname = "test_sleeper"\n', encoding="utf-8")
    return job


def _events(out: Path, event: str) -> list[dict]:
    return [e for e in replay(out / "journal.jsonl") if e["event"] == event]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_signal_from_slurm_stops_the_job_cleanly_and_a_rerun_resumes(
        tmp_path: Path, sig: signal.Signals) -> None:
    job, out, cache = _job(tmp_path), tmp_path / "out", str(tmp_path / "cache.json")
    proc = Started("run", str(job), "--cache", cache, cwd=ROOT)  # a session of its own
    try:
        deadline = time.monotonic() + 120
        # The first metric's result is journaled, and the second one runs.
        while not (_events(out, "success") and [e for e in _events(out, "sizes")
                                                if e["task"] == "test_sleeper"]):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, sig)  # as Slurm signals a job step: every process of it
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    code = 128 + sig
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"oomguard: stopped on {sig.name}: 1 of 2 metrics done, kept in {out}; to resume, "
        f"run the same command again (exit code {code})")
    assert [e["task"] for e in _events(out, "success")] == ["loss"]
    assert [(e["task"], e["signal"]) for e in _events(out, "interrupted")] == [
        ("test_sleeper", sig.name)]
    summary = json.loads((out / "results.json").read_text())
    assert (summary["status"], summary["exit_code"], summary["signal"]) == (
        "interrupted", code, sig.name)
    assert {k: t["status"] for k, t in summary["tasks"].items()} == {
        "loss": "ok", "test_sleeper": "interrupted"}
    kept = (out / "results" / "loss.json").read_bytes()
    assert not (out / "results" / "test_sleeper.json").exists()

    # Requeued: the same command resumes; loss is not rerun (its file byte for byte).
    rerun = cli_in_child("run", str(job), "--cache", cache, cwd=ROOT,
                         env={"OOMGUARD_TEST_FAST": "1"})
    assert rerun.returncode == 0, rerun.stderr
    assert (out / "results" / "loss.json").read_bytes() == kept
    assert [e["task"] for e in _events(out, "success")] == ["loss", "test_sleeper"]
    assert [e["task"] for e in _events(out, "skip")] == ["loss"]
    assert json.loads((out / "results.json").read_text())["status"] == "complete"
    assert "stopped on" not in rerun.stderr


def _survives_sigusr1() -> tuple[bool, str]:
    """In a child: whether SIGUSR1 is ignored here, and that one sent here did not kill it."""
    os.kill(os.getpid(), signal.SIGUSR1)
    return signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN, "alive"


@pytest.mark.slow  # starts the forkserver (torch imported) where none runs yet
def test_a_metrics_process_and_its_forkserver_leave_sigusr1_to_the_command() -> None:
    # Slurm's warning reaches every process of the job step: a metric's process (started by
    # the forkserver on a GPU) and the server must not die of it, the command decides.
    from multiprocessing import forkserver

    from oomguard.engine.core.child import Child, context, start_forkserver

    with Child(context("fork"), _survives_sigusr1) as child:
        assert child.wait().result() == (True, "alive")
    ctx = start_forkserver()
    with Child(ctx, _survives_sigusr1) as child:  # the server runs from here on
        assert child.wait().result() == (True, "alive")
    server = forkserver._forkserver._forkserver_pid
    os.kill(server, signal.SIGUSR1)
    with Child(ctx, _survives_sigusr1) as child:
        assert child.wait().result() == (True, "alive")
    assert forkserver._forkserver._forkserver_pid == server  # the same server, alive
