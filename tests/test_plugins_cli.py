"""Every command loads plugins: ``--plugin FILE_OR_MODULE`` on ``search``, ``metrics``,
``estimate``, ``verify`` and ``reference``, resolved as a job resolves its plugins (a
``.py`` path against the current folder, else a module name); one that cannot be imported
is one line and exit code 2.

The plugin is written here as analysis code is: a metric over the samples in chunks of a
memory knob, whose working memory (a real allocation of ``chunk`` x 2 MiB) meets a real
CPU budget."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from oomguard.engine.cli.main import main
from oomguard.engine.jobs.plugins import PLUGINS_ENV
from oomguard.metrics.base import METRICS, get_metric
from tests.conftest import cli_in_child, once_per_run

TINY = ("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32,bos_token_id=0,"
        "eos_token_id=0")
WORKLOAD = ["--model", TINY, "--seq-len", "8", "--samples", "4"]

PLUGIN = '''
import torch

from oomguard.metrics.base import Knob, Metric, register

MiB = 2**20


@register
class ChunkedLogitNorm(Metric):
    """The logits' norm per sample, computed ``chunk`` samples at a time, each chunk with a
    scratch buffer of chunk x 2 MiB (what a chunked analysis holds per chunk)."""
    name = "{name}"
    description = "logit norm per sample, in chunks"
    knobs = (Knob("chunk", "memory", 2, scales_with="samples"),)

    def compute(self, model, data, *, chunk):
        ids, norms = data["input_ids"], []
        with torch.no_grad():
            for i in range(0, ids.shape[0], chunk):
                scratch = torch.ones(chunk * MiB // 2)  # chunk x 2 MiB of float32
                logits = model(input_ids=ids[i:i + chunk]).logits
                norms.append(logits.norm(dim=(1, 2)) * scratch[0])
        return {{"norm": torch.cat(norms)}}
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The plugin file in the current folder (the test's own); its metric's name (unique:
    a metric stays registered in this process)."""
    name = f"chunked_norm_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN.format(name=name), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return name


@pytest.mark.slow
def test_search_with_a_plugin_finds_a_size_and_every_command_uses_it(
        plugin: str, capsys: pytest.CaptureFixture[str]) -> None:
    file = f"{plugin}.py"  # relative: against the current folder
    # the searches assert a memory boundary: each in a fresh process (tests/conftest.py)
    ran = cli_in_child("search", "--plugin", file, "--metric", plugin, *WORKLOAD, "--budget",
                       "32MiB", "--max-size", "64", "--out", "rep", "--json", cwd=Path.cwd())
    assert ran.returncode == 0, ran.stderr
    found = json.loads(ran.stdout)
    # chunk x 2 MiB meets the 32 MiB budget (at 16 or below): a size found, the next one out of memory
    assert 1 <= found["max_ok"] <= 16 and found["first_oom"] == found["max_ok"] + 1

    assert main(["metrics", "--plugin", file, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)[plugin]
    assert listed["description"] == "logit norm per sample, in chunks"

    assert main(["estimate", "--plugin", file, "--metric", plugin, *WORKLOAD,
                 "--sizes", "1,2", "--no-workspace", "--json"]) == 0
    estimates = json.loads(capsys.readouterr().out)["estimates"]
    # the scratch buffer alone is 2 MiB a chunk: seen by the estimate
    assert estimates[1]["peak_bytes"] - estimates[0]["peak_bytes"] >= 2 * 2**20

    assert json.loads(Path("rep/report.json").read_text())["context"]["plugins"] == [
        str(Path(file).resolve())]
    assert main(["verify", "rep", "--plugin", file, "--steps", "2", "--json"]) == 0
    check = json.loads(capsys.readouterr().out)
    assert check["ok"] and check["size"] == found["recommendation"]["safe"]

    ran = cli_in_child("reference", "--plugin", file, "--metric", plugin, *WORKLOAD,
                       "--budget", "32MiB", "--max-size", "64", "--out", "ref", "--json",
                       cwd=Path.cwd())
    assert ran.returncode == 0, ran.stderr
    rows = json.loads(ran.stdout)["rows"]
    assert [(r["metric"], r["knob"]) for r in rows] == [(plugin, "chunk")]
    assert 1 <= rows[0]["max_ok"] <= 16 and rows[0]["first_oom"] == rows[0]["max_ok"] + 1


@pytest.mark.slow
def test_an_isolated_search_imports_the_plugin_in_its_children(plugin: str) -> None:
    """``--isolate``: each trial in a forkserver's child, which imports the plugin too (a
    command of its own: this test process's forkserver, which runs already, never imported
    the plugin; the command, forked from it, starts a forkserver of its own, as users' do)."""
    done = cli_in_child("search", "--plugin", f"{plugin}.py", "--metric", plugin, *WORKLOAD,
                        "--budget", "32MiB", "--max-size", "64", "--isolate", "--out", "rep",
                        "--json", cwd=Path.cwd())
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert found["mode"] == "isolated"
    assert 1 <= found["max_ok"] <= 16 and found["first_oom"] == found["max_ok"] + 1


@pytest.mark.parametrize("command", [
    ["search", "--metric", "loss"], ["metrics"], ["estimate", "--sizes", "1"],
    ["verify", "rep"], ["reference"]])
def test_a_plugin_that_cannot_be_imported_is_one_line(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import torch\ndef f(:\n", encoding="utf-8")
    for spec, says in (("missing.py", f"no such file {tmp_path / 'missing.py'}"),
                       ("broken.py", "cannot import 'broken.py': invalid syntax"),
                       ("no_such_module_q", "No module named 'no_such_module_q'")):
        assert main([*command, "--plugin", spec]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("oomguard: error: --plugin cannot import")
        assert says in err[0]


def test_verify_names_the_plugin_a_report_was_searched_with(tmp_path: Path) -> None:
    """A search with --plugin records it in its report; a verify that does not know the
    metric (a fresh process without --plugin) says which --plugin to give."""
    from oomguard.engine.cli.verify import _rebuild
    from oomguard.engine.errors import UsageError

    spec = {"kind": "MetricTrial", "fields": {"metric": "not_loaded_here", "model": TINY}}
    with pytest.raises(UsageError, match=r"its metric comes from a plugin: give "
                                         r"--plugin /lab/p\.py$"):
        _rebuild(spec, tmp_path / "report.json", ["/lab/p.py"])


def _metric(name: str, body: str = "return {'x': 1.0}") -> str:
    """A plugin's metric without memory knobs, its ``compute`` running ``body``."""
    return ("from oomguard.metrics.base import Metric, register\n\n\n@register\n"
            f"class M_{name}(Metric):\n    name = {name!r}\n    description = 'a test metric'\n\n"
            f"    def compute(self, model, data):\n        {body}\n")


def _job_file(folder: Path, plugins: list[str], metrics: str) -> Path:
    job = folder / "job.toml"
    job.write_text(f'output = "out"\nplugins = {json.dumps(plugins)}\nmodels = ["tiny-gpt2"]\n'
                   "[data]\nseq_len = 8\nn_samples = 2\n[search]\nenabled = false\n" + metrics,
                   encoding="utf-8")
    return job


@pytest.mark.parametrize("code", ["0", "3", "'stopping here'"])
def test_a_plugin_that_exits_at_import_is_one_line_naming_it_before_any_work(
        code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exits.py").write_text(f"import sys\nsys.exit({code})\n", encoding="utf-8")
    _job_file(tmp_path, ["exits.py"], '[[metrics]]\nname = "loss"\n')
    for argv, where in ((["metrics", "--plugin", "exits.py"], "--plugin "),
                        (["run", "job.toml"], "job.toml, line 2: plugins[0]: ")):
        assert main(argv) == 2  # (before the fix: SystemExit out of main, no message)
        assert capsys.readouterr().err.splitlines() == [
            f"oomguard: error: {where}cannot import 'exits.py': it called sys.exit({code}) "
            "while being imported; remove that call, or put it under "
            "'if __name__ == \"__main__\":'"]
    assert not (tmp_path / "out").exists()  # refused before any work


def test_same_named_plugins_in_two_folders_both_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLUGINS_ENV, "[]")  # what this test loads is not left for the next
    first, second = (f"from_{d}_{uuid.uuid4().hex[:8]}" for d in "ab")
    for folder, name in (("a", first), ("b", second)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "metrics.py").write_text(_metric(name), encoding="utf-8")
    assert main(["metrics", "--plugin", "a/metrics.py", "--plugin", "b/metrics.py",
                 "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert first in listed and second in listed


def test_two_plugins_defining_one_metric_name_clash_in_one_line_naming_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLUGINS_ENV, "[]")
    name = f"twice_{uuid.uuid4().hex[:8]}"
    for folder in "ab":
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "metrics.py").write_text(_metric(name), encoding="utf-8")
    assert main(["metrics", "--plugin", "a/metrics.py", "--plugin", "b/metrics.py"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"oomguard: error: --plugin 'b/metrics.py' ({tmp_path / 'b' / 'metrics.py'}) defines "
        f"metric {name!r}, which {tmp_path / 'a' / 'metrics.py'} defines too; rename one of "
        "them (its name attribute)"]


def test_a_plugin_reusing_a_built_in_metrics_name_is_one_line_and_the_built_in_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLUGINS_ENV, "[]")
    builtin = get_metric("loss")
    monkeypatch.setitem(METRICS, "loss", builtin)  # (before the fix the plugin's replaced it)
    (tmp_path / "mine.py").write_text(_metric("loss"), encoding="utf-8")
    assert main(["metrics", "--plugin", "mine.py"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "oomguard: error: --plugin cannot import 'mine.py': it defines metric 'loss', which "
        "oomguard's built-in metrics define too; rename yours (its name attribute)"]
    assert METRICS["loss"] is builtin


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper has ended)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _a_job_of_plugins_that_leave_processes_and_hang(folder: Path) -> dict[str, Any]:
    """Three plugins named ``metrics.py`` in three folders, one metric each: ``worker``
    starts a ``multiprocessing`` worker and returns; ``hangs`` starts a process, then sleeps
    past its 3 s time limit; ``leaves`` starts one and returns. The job's output, and which
    started processes still ran 5 s after it ended (then killed)."""
    popen = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(300)'])")
    worker = ("import multiprocessing, time; p = multiprocessing.get_context('fork').Process("
              "target=time.sleep, args=(300,)); p.start()")
    note = "; import os; open(os.path.join({where!r}, {name!r}), 'a').write(f'{{p.pid}}\\n')"
    for sub, name, start, then in (("a", "worker", worker, ""), ("b", "hangs", popen,
                                   "; import time; time.sleep(300)"), ("c", "leaves", popen, "")):
        (folder / sub).mkdir()
        body = (start + note.format(where=str(folder), name=f"{name}.pid") + then
                + "; return {'x': 1.0}")
        (folder / sub / "metrics.py").write_text(_metric(name, body), encoding="utf-8")
    job = _job_file(folder, ["a/metrics.py", "b/metrics.py", "c/metrics.py"],
                    '[[metrics]]\nname = "worker"\n'
                    '[[metrics]]\nname = "hangs"\ntime_limit = "3s"\n'
                    '[[metrics]]\nname = "leaves"\n')
    # A command line of its own, as users run it (a child of this worker's forkserver does
    # not show multiprocessing's wait for a worker at exit)
    ran = subprocess.run([sys.executable, "-m", "oomguard", "run", str(job)], cwd=folder,
                         capture_output=True, text=True, timeout=240)
    # (each metric runs twice: its warm-up on one sample, then the run)
    pids = [(p.stem, int(pid)) for p in folder.glob("*.pid") for pid in p.read_text().split()]
    deadline = time.monotonic() + 5
    while any(_alive(pid) for _, pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = sorted(name for name, pid in pids if _alive(pid))
    for _, pid in pids:  # the test's own processes: none may outlive it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    out = folder / "out"
    results = {p.stem: json.loads(p.read_text()) for p in (out / "results").glob("*.json")}
    tracebacks = {p.stem: p.read_text() for p in (out / "tracebacks").glob("*.txt")}
    journal = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    return {"code": ran.returncode, "stderr": ran.stderr, "started": sorted({n for n, _ in pids}),
            "alive": alive, "journal": journal,
            "results": results, "tracebacks": tracebacks}


@pytest.fixture(scope="module")
def plugin_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("plugin-job")
    return once_per_run(tmp_path_factory, "plugin-job",
                        lambda: _a_job_of_plugins_that_leave_processes_and_hang(folder))


@pytest.mark.slow
def test_same_named_plugins_of_a_job_both_run(plugin_job: dict[str, Any]) -> None:
    assert sorted(plugin_job["results"]) == ["hangs", "leaves", "worker"], plugin_job["stderr"]
    assert plugin_job["results"]["leaves"]["status"] == "ok"
    assert plugin_job["results"]["worker"]["status"] == "ok"


@pytest.mark.slow
def test_processes_a_metric_starts_end_with_its_task(plugin_job: dict[str, Any]) -> None:
    assert plugin_job["started"] == ["hangs", "leaves", "worker"], plugin_job["stderr"]
    assert plugin_job["alive"] == []
    # and at once: the task's process does not wait for its multiprocessing worker to end
    # (before: multiprocessing's exit joined it, and the parent killed it after 30 s)
    done = next(e["t"] for e in plugin_job["journal"]
                if e["event"] == "success" and e["task"] == "worker")
    nxt = next(e["t"] for e in plugin_job["journal"]
               if e["event"] == "start" and e["task"] == "hangs")
    assert (datetime.fromisoformat(nxt) - datetime.fromisoformat(done)).total_seconds() < 15


@pytest.mark.slow
def test_a_metric_past_its_time_limit_is_stopped_with_one_line_and_the_job_goes_on(
        plugin_job: dict[str, Any]) -> None:
    assert plugin_job["code"] == 1, plugin_job["stderr"]
    hangs = plugin_job["results"]["hangs"]
    assert hangs["status"] == "failed"
    assert hangs["reason"] == (
        "time limit of 3 s exceeded (stopped); if the metric needs longer, raise its "
        "time_limit in the job file, else see where it hung in its traceback file")
    said = [line for line in plugin_job["stderr"].splitlines() if "time limit" in line]
    assert len(said) == 1 and "hangs: FAILED: time limit of 3 s exceeded" in said[0], said
    # Where it was: sleeping in the plugin's metric (or still warming the model up, when a
    # loaded machine took the 3 s before the metric ran).
    where = plugin_job["tracebacks"]["hangs"]
    assert "Where its process was when the time limit stopped it:" in where
    assert "in compute" in where or "in on_device" in where, where
    assert plugin_job["results"]["leaves"]["status"] == "ok"  # the job went on


def test_a_plugin_whose_import_takes_long_says_so_while_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An import that hangs is not silent: the log says which plugin is still importing
    (after 30 s; here after 0.2 s, for an import of 1 s)."""
    from oomguard.engine.jobs import plugins

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLUGINS_ENV, "[]")
    monkeypatch.setattr(plugins, "SLOW_IMPORT_S", 0.2)
    name = f"slow_{uuid.uuid4().hex[:8]}"
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(1.0)\n" + _metric(name),
                                      encoding="utf-8")
    assert main(["metrics", "--plugin", "slow.py"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "slow.py" in line]
    assert said == ["WARNING oomguard.plugins: importing plugin 'slow.py' has taken 0.2 s so "
                    "far; if it hangs, press Ctrl-C and move the work it does at import into "
                    "its metric"]
