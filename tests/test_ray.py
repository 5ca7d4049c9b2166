"""Jobs on Ray (``oomguard run JOB --ray``), on a local Ray instance with 2 CPUs: the same
``results.json`` values as the single-process job, and a rerun that resumes; a worker
killed mid-task (SIGKILL) whose task Ray runs again from halved sizes labelled as a death,
nothing lost and nothing run twice; a worker killed during a search, which leaves the cache
untouched and whose retry searches again; a task's outputs reaching the hub in order
through its sink; concurrent tasks that store different devices' sizes, all kept; and a
cluster that cannot be reached, a GPU job on a cluster without GPUs, or Ray missing, each
a one-line error with exit code 2."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import Started, cli_in_child

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'oomguard[ray]'")

from oomguard.engine.jobs.cache import SizeCache, device_key, entry_key  # noqa: E402
from oomguard.engine.jobs.journal import replay  # noqa: E402
from oomguard.engine.jobs.ray_hub import Hub  # noqa: E402
from oomguard.engine.jobs.ray_job import OnRay  # noqa: E402
from oomguard.engine.jobs.ray_task import DEATH, lowered_after_death  # noqa: E402
from oomguard.engine.jobs.runner import run_job  # noqa: E402
from oomguard.engine.jobs.sink import HubSink, forward  # noqa: E402
from oomguard.engine.jobs.spec import load_job  # noqa: E402

# One worker runs them all: they share one local Ray instance.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

ROOT = Path(__file__).resolve().parents[1]

# A metric that runs a few seconds at its sizes, so a test can kill its worker mid-run.
PLUGIN = '''
import os, time
import torch
from oomguard.metrics.base import Knob, Metric, register

@register
class Steady(Metric):
    """The mean loss over the samples, after holding the worker busy for `seconds` (not
    when OOMGUARD_TEST_FAST is set, nor in the task's warm-up on one sample, which comes
    before its sizes are chosen: the tests wait for those)."""
    name = "test_steady"
    knobs = (Knob("micro_batch_size", "memory", 8, 1), Knob("seconds", "result", 2.0, 0.0))
    def compute(self, model, data, micro_batch_size=8, seconds=2.0):
        if data["input_ids"].shape[0] == 1:
            seconds = 0.0
        t0 = time.time()
        while not os.environ.get("OOMGUARD_TEST_FAST") and time.time() - t0 < seconds:
            time.sleep(0.05)
        ids, total = data["input_ids"], 0.0
        with torch.no_grad():  # rows of one length: weighting by rows gives the exact mean
            for i in range(0, ids.shape[0], micro_batch_size):
                part = ids[i:i + micro_batch_size]
                total += float(model(input_ids=part, labels=part).loss) * part.shape[0]
        return {"loss": total / ids.shape[0]}
'''


@pytest.fixture(scope="module")
def local_ray() -> Any:
    """One local Ray instance with 2 CPUs for the module (``ray.init`` takes ~3 s)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _job(tmp_path: Path, name: str, metrics: list[str], search: bool = True,
         extra: str = "") -> Path:
    plugin = tmp_path / "steady_plugin.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    blocks = "".join(f'\n[[metrics]]\nname = "{m}"\n' for m in metrics)
    text = (f'output = "{tmp_path / name}"\nplugins = ["{plugin}"]\nmodels = ["tiny-gpt2"]\n'
            f'{extra}[data]\nseq_len = 8\nn_samples = 4\n[search]\nenabled = '
            f'{"true" if search else "false"}\nstart = 4\n{blocks}')
    path = tmp_path / f"{name}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _events(out: Path, event: str, task: str | None = None) -> list[dict]:
    return [e for e in replay(out / "journal.jsonl")
            if e["event"] == event and (task is None or e.get("task") == task)]


def test_a_job_on_ray_gives_the_single_process_results_and_a_rerun_resumes(
        local_ray: Any, tmp_path: Path) -> None:
    # Two tasks, one per CPU of the instance: one without a tensor file, one with.
    metrics = ["loss", "fisher_diagonal"]
    # Ray gives each task 1 CPU, and its metric process 1 thread: so does this run (a float
    # sum split over another number of threads rounds differently in its last bits).
    single = run_job(load_job(_job(tmp_path, "single", metrics)),
                     cache_path=tmp_path / "single.json", progress=False, threads=1)
    on_ray = run_job(load_job(_job(tmp_path, "ray", metrics)), cache_path=tmp_path / "ray.json",
                     progress=False, backend=OnRay())
    assert single.exit_code == on_ray.exit_code == 0
    a = json.loads((tmp_path / "single" / "results.json").read_text())["tasks"]
    b = json.loads((tmp_path / "ray" / "results.json").read_text())["tasks"]
    assert sorted(a) == sorted(b) == sorted(metrics)
    for key in metrics:
        assert b[key]["status"] == "ok", b[key]
        assert a[key]["summary"] == b[key]["summary"], key
        assert a[key]["threads"] == b[key]["threads"] == 1
        assert a[key]["sizes"]["final"] == b[key]["sizes"]["final"]
        assert (a[key]["tensors"] is None) == (b[key]["tensors"] is None)
        # Each task measured its own device (the worker's), and the cache is keyed by it.
        assert b[key]["device"]["name"] and b[key]["device"]["torch"]
        assert b[key]["sizes"]["cache_key"].startswith(device_key(b[key]["device"]))
    out = tmp_path / "ray"
    assert (out / "report.md").read_text().count("| ok |") >= len(metrics)
    assert any((out / "plots").iterdir())
    # The driver wrote each task's events once, and where each ran.
    assert sorted(e["task"] for e in _events(out, "success")) == sorted(metrics)
    assert {e["task"] for e in _events(out, "running")} == set(metrics)
    # One cache, written through the hub: every task's searched sizes are in it.
    cached = SizeCache(tmp_path / "ray.json").entries()
    assert {b[k]["sizes"]["cache_key"] for k in metrics} <= set(cached)

    again = run_job(load_job(_job(tmp_path, "ray", metrics)), cache_path=tmp_path / "ray.json",
                    progress=False, backend=OnRay())
    assert again.exit_code == 0
    assert len(_events(out, "skip")) == len(metrics)
    assert sorted(e["task"] for e in _events(out, "success")) == sorted(metrics)


# test_steady's run (not its warm-up) holds its worker until the test kills it, however
# late a loaded machine lets the test see its sizes; the retry, which finds HELD, runs at
# once. (Held for its 2 s, a kill that came after them met a finished task.)
HELD_ONCE = PLUGIN.replace("        t0 = time.time()\n", (
    "        if seconds:\n"
    "            seconds = 0.0 if os.path.exists(HELD) else 120.0\n"
    "            open(HELD, 'a').close()\n"
    "        t0 = time.time()\n"))


def test_a_worker_killed_mid_task_is_retried_from_halved_sizes_and_nothing_is_lost(
        local_ray: Any, tmp_path: Path) -> None:
    path = _job(tmp_path, "killed", ["loss", "test_steady"], search=False)
    (tmp_path / "steady_plugin.py").write_text(
        f"HELD = {str(tmp_path / 'held')!r}\n{HELD_ONCE}", encoding="utf-8")
    job = load_job(path)
    out = tmp_path / "killed"
    done: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: done.update(outcome=run_job(
        job, cache_path=tmp_path / "sizes.json", progress=False, backend=OnRay())))
    runner.start()
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and runner.is_alive():
        if (out / "journal.jsonl").exists():
            at = [e for e in _events(out, "running", "test_steady") if e["sizes"]]
            victim = at[0] if at else None
        time.sleep(0.05)
    assert victim is not None, "test_steady never reported its sizes"
    assert victim["sizes"] == {"micro_batch_size": 8}  # the metric's default: no search
    os.kill(victim["pid"], signal.SIGKILL)
    runner.join(180)
    assert not runner.is_alive()
    outcome = done["outcome"]
    assert outcome.exit_code == 0, outcome.results
    died = _events(out, "worker-died", "test_steady")
    assert len(died) == 1 and died[0]["pid"] == victim["pid"] and died[0]["sizes"] == {
        "micro_batch_size": 8}
    result = json.loads((out / "results.json").read_text())["tasks"]["test_steady"]
    assert result["status"] == "ok"
    # The retry started from the dead attempt's sizes halved, through the cache.
    assert result["sizes"]["source"] == "cache"
    assert result["sizes"]["start"] == {"micro_batch_size": 4}
    entry = SizeCache(tmp_path / "sizes.json").get(result["sizes"]["cache_key"])
    assert entry["sizes"] == {"micro_batch_size": 4}
    assert "died while running" in entry["history"][-1]["reason"]
    # Labelled as a worker's death, in the cache and the journal, never as an OOM.
    assert entry["source"] == entry["history"][-1]["source"] == DEATH
    assert all(h["source"] != "lowered after OOM" for h in entry["history"])
    halved = _events(out, "halved", "test_steady")
    assert len(halved) == 1 and halved[0]["sizes"] == {"micro_batch_size": 4}
    assert halved[0]["source"] == DEATH and halved[0]["attempt"] == 2
    assert not _events(out, "retry", "test_steady")  # no OOM inside the task either
    # Nothing lost, nothing run twice: one success per task, each result written once.
    assert sorted(e["task"] for e in _events(out, "success")) == ["loss", "test_steady"]
    assert json.loads((out / "results.json").read_text())["tasks"]["loss"]["status"] == "ok"


# test_steady's twin that appends the size of each of its calls to MARK: its first call is
# its first search trial (a new cache, nothing pinned).
MARKED = PLUGIN.replace('"test_steady"', '"test_marked"').replace("class Steady", "class Marked")
# Only the first call (the trial the test kills) holds its worker busy, long enough to be
# killed in it; the retry's search runs at full speed.
MARKED = MARKED.replace("        t0 = time.time()\n", "        seconds = 0.0 if os.path.exists(MARK)"
                        " else 60.0\n        with open(MARK, 'a') as fh:\n"
                        "            fh.write(f'{micro_batch_size}\\n')\n        t0 = time.time()\n")


def test_a_worker_killed_during_a_search_leaves_the_cache_untouched_and_its_retry_searches(
        local_ray: Any, tmp_path: Path) -> None:
    mark = tmp_path / "calls.txt"
    (tmp_path / "marked_plugin.py").write_text(f"MARK = {str(mark)!r}\n{MARKED}")
    path = _job(tmp_path, "searched", ["test_marked"])
    path.write_text(path.read_text().replace("steady_plugin.py", "marked_plugin.py"))
    out, cache = tmp_path / "searched", tmp_path / "sizes.json"
    done: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: done.update(outcome=run_job(
        load_job(path), cache_path=cache, progress=False, backend=OnRay())))
    runner.start()
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and runner.is_alive():
        if mark.exists() and (out / "journal.jsonl").exists():
            victim = (_events(out, "running", "test_marked") or [None])[0]
        time.sleep(0.05)
    assert victim is not None, "test_marked never ran its search"
    assert not _events(out, "sizes", "test_marked")  # still searching: no sizes chosen
    os.kill(victim["pid"], signal.SIGKILL)
    runner.join(180)
    assert not runner.is_alive()
    assert done["outcome"].exit_code == 0, done["outcome"].results
    died = _events(out, "worker-died", "test_marked")
    assert len(died) == 1 and died[0]["pid"] == victim["pid"] and died[0]["sizes"] is None
    assert not _events(out, "halved")
    # Both attempts started (each attempt's events reach the journal as they happen); only
    # the retry finished a search, and it ran at the sizes that search found.
    assert [e["attempt"] for e in _events(out, "start", "test_marked")] == [1, 2]
    assert [e["attempt"] for e in _events(out, "search", "test_marked")] == [2]
    result = json.loads((out / "results.json").read_text())["tasks"]["test_marked"]
    assert result["status"] == "ok" and result["sizes"]["source"] == "search"
    # The cache holds the retry's search and nothing from the dead attempt.
    entries = SizeCache(cache).entries()
    assert list(entries) == [result["sizes"]["cache_key"]]
    assert [h["source"] for h in entries[result["sizes"]["cache_key"]]["history"]] == ["search"]


@pytest.fixture
def hub_on_ray(local_ray: Any, tmp_path: Path) -> Any:
    hub = ray.remote(num_cpus=0)(Hub).remote(str(tmp_path), str(tmp_path / "shared.json"))
    yield hub
    ray.kill(hub)


def _store_for(device_name: str, scratch: str, hub: Any, start_at: float) -> int:
    """What a task's sink does when it stores its device's sizes: a put, sent to the hub."""
    import multiprocessing

    device = {"name": device_name, "total_bytes": 80 << 30, "torch": "2.13.0"}
    workload = {"metric": "loss", "model_config": "abc", "dtype": "float32", "seq_len": 8}
    attempt = ray.get(hub.begin.remote(device_name, {"host": "h"}))["attempt"]
    receive, send = multiprocessing.Pipe(duplex=False)
    HubSink(scratch, {}, send).put(entry_key(device, workload), {"micro_batch_size": 16},
                                   source="search", device=device, workload=workload)
    send.send(None)
    time.sleep(max(0.0, start_at - time.time()))  # both merge at the same moment
    return sum(ray.get(forward(receive, hub, device_name, attempt)))


def test_two_tasks_storing_different_devices_sizes_at_once_both_stay(
        hub_on_ray: Any, tmp_path: Path) -> None:
    # The workers cannot import this test module: send the function itself.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    store = ray.remote(num_cpus=1)(_store_for)
    start_at = time.time() + 2.0
    written = ray.get([store.remote("NVIDIA H100 80GB HBM3", str(tmp_path / "a.json"),
                                    hub_on_ray, start_at),
                       store.remote("NVIDIA A100-SXM4-80GB", str(tmp_path / "b.json"),
                                    hub_on_ray, start_at)])
    assert written == [1, 1]
    names = {e["device"]["name"] for e in SizeCache(tmp_path / "shared.json").entries().values()}
    assert names == {"NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"}


def test_a_dead_attempt_is_lowered_by_half_never_below_the_minimum() -> None:
    from oomguard.engine.jobs.plan import plan

    job_path = ROOT / "engine" / "jobs" / "example.toml"
    task = plan(load_job(job_path))[0]  # loss: micro_batch_size, minimum 1
    dead = {"sizes": {"micro_batch_size": 9}, "cache_key": "k", "pid": 1, "host": "h",
            "device": {"name": "d"}}
    assert lowered_after_death(task, dead)["sizes"] == {"micro_batch_size": 4}
    assert lowered_after_death(task, {**dead, "sizes": {"micro_batch_size": 1}}) is None
    assert lowered_after_death(task, {**dead, "sizes": None}) is None




class _Measured(Exception):
    """Stops a Ray task once its device is known."""


@pytest.mark.parametrize("noset, visible, ids, device, expected", [
    ("1", None, [2], "cuda", "cuda:2"),  # no CUDA_VISIBLE_DEVICES: the ids are GPU indices
    ("true", "4,6,7", ["6"], "cuda", "cuda:1"),  # entries of CUDA_VISIBLE_DEVICES: position
    (None, None, [2], "cuda", "cuda"),  # Ray set CUDA_VISIBLE_DEVICES to the task's GPU
    ("1", None, [], "cpu", "cpu"),  # a CPU job's task: as given
])
def test_a_ray_task_measures_and_runs_on_the_gpu_ray_assigned_fake_ray_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noset: str | None,
        visible: str | None, ids: list, device: str, expected: str) -> None:
    """``ray.get_gpu_ids()`` faked (no GPU here) as ray/_private/worker.py answers it: the
    slot indices, or the entries of the CUDA_VISIBLE_DEVICES the worker started with."""
    from oomguard.engine.jobs import ray_task
    from oomguard.engine.jobs.plan import plan
    from oomguard.engine.jobs.records import Context

    for name, value in (("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", noset),
                        ("CUDA_VISIBLE_DEVICES", visible)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ids)
    job = load_job(_job(tmp_path, "gpu", ["loss"], extra=f'device = "{device}"\n'))
    seen = []

    def identity(measured_job: Any) -> dict:
        seen.append(measured_job.device)
        raise _Measured

    monkeypatch.setattr(ray_task, "device_identity", identity)
    ctx = Context(job=job, out=str(tmp_path / "gpu"), run_id="r", cache_path=None,
                  search=True, device={"device": "cuda"})
    with pytest.raises(_Measured):
        ray_task.run_on_worker(plan(job)[0], ctx, hub=None)
    assert seen == [expected]


def test_an_unreachable_cluster_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    job = _job(tmp_path, "out", ["loss"])
    t0 = time.monotonic()
    run = cli_in_child("run", str(job), "--ray", "127.0.0.1:1", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("oomguard: error: cannot reach the Ray cluster at 127.0.0.1:1")
    assert "ray start --head" in line
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "out").exists()  # nothing written


def test_ray_not_installed_is_one_line_saying_how_to_install_it(tmp_path: Path) -> None:
    job = _job(tmp_path, "out", ["loss"])
    # Ray made unimportable in that process, as on a machine without it.
    run = cli_in_child("run", str(job), "--ray", cwd=tmp_path, missing=("ray",))
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "oomguard: error: --ray needs Ray, which is not installed here; install it: "
        "pip install 'oomguard[ray]'")


def test_a_gpu_job_on_a_cluster_without_gpus_is_one_line(local_ray: Any,
                                                         tmp_path: Path) -> None:
    job = load_job(_job(tmp_path, "gpu", ["loss"], extra='device = "cuda"\n'))
    from oomguard.engine.errors import JobError

    with pytest.raises(JobError, match="the Ray cluster has no GPU"):
        run_job(job, progress=False, backend=OnRay())
    assert not (tmp_path / "gpu").exists()


class _Here:
    """A hub called in this process, as a Ray worker calls the actor (``take.remote``)."""

    def __init__(self, hub: Hub) -> None:
        self.take = SimpleNamespace(remote=hub.take)


def test_a_tasks_outputs_reach_the_hub_in_order_as_puts_lowers_events_and_files(
        tmp_path: Path) -> None:
    import multiprocessing

    device = {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 80 << 30}
    (tmp_path / "job").mkdir()
    hub = Hub(tmp_path / "job", tmp_path / "shared.json")
    hub.sink.put("kept", {"micro_batch_size": 8}, source="search", device=device)
    hub.sink.put("lowered", {"micro_batch_size": 8}, source="search", device=device)
    hub.sink.put("smaller", {"micro_batch_size": 1}, source="search", device=device)
    attempt = hub.begin("t", {"host": "worker-1"})["attempt"]
    receive, send = multiprocessing.Pipe(duplex=False)
    sink = HubSink(tmp_path / "scratch", SizeCache(tmp_path / "shared.json").entries(), send)
    assert sink.get("kept")["sizes"] == {"micro_batch_size": 8}  # read when it began
    # The task's outputs, in the order it makes them, sent by its process (a child).
    child = multiprocessing.get_context("fork").Process(target=_outputs, args=(sink,))
    child.start()
    child.join(30)
    send.send(None)
    assert forward(receive, _Here(hub), "t", attempt) == [True, True, True, None, None]
    entries = SizeCache(tmp_path / "shared.json").entries()
    assert entries["lowered"]["sizes"] == {"micro_batch_size": 2}
    assert entries["lowered"]["history"][-1]["reason"] == "t: out of memory at 8"
    assert entries["lowered"]["source"] == "lowered after OOM"
    assert entries["smaller"]["sizes"] == {"micro_batch_size": 1}  # the smaller one kept
    assert entries["found"]["sizes"] == {"chunk_size": 4} and entries["found"]["max_ok"] == 5
    assert len(entries["kept"]["history"]) == 1  # nothing sent: untouched
    # The journal's event, stamped in the task's process, with where it ran; its sizes
    # are the attempt's now; the result file written into the job's folder and the worker's.
    [event] = replay(tmp_path / "job" / "journal.jsonl")
    assert event["event"] == "sizes" and event["pid"] == child.pid
    assert event["host"] == "worker-1" and event["attempt"] == attempt
    assert hub.status()["t"][0]["sizes"] == {"chunk_size": 4}
    for folder in ("job", "scratch"):
        assert (tmp_path / folder / "results" / "t.json").read_text() == '{"ok": true}'


def _outputs(sink: HubSink) -> None:
    sink.lower("lowered", {"micro_batch_size": 2}, reason="t: out of memory at 8")
    sink.lower("smaller", {"micro_batch_size": 2}, reason="t: out of memory at 8")
    sink.put("found", {"chunk_size": 4}, source="search", max_ok=5)
    sink.event("sizes", task="t", sizes={"chunk_size": 4})
    sink.write("results/t.json", '{"ok": true}')


def test_ctrl_c_under_ray_keeps_what_finished_and_a_rerun_finishes_the_rest(
        tmp_path: Path) -> None:
    # The command with its own local Ray instance, in a session of its own as a terminal
    # runs it (forked from the worker's forkserver, which imported torch: the command line's
    # own start-up is tests/test_interrupt_start.py's); Ctrl-C reaches the whole process
    # group, Ray's processes too.
    job = _job(tmp_path, "out", ["loss", "test_steady"], search=False)
    text = job.read_text().replace('name = "test_steady"\n',
                                   'name = "test_steady"\nparams = {seconds = 8.0}\n')
    job.write_text(text)
    out = tmp_path / "out"
    proc = Started("run", str(job), "--ray", "--cache", str(tmp_path / "sizes.json"),
                   cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "journal.jsonl").exists() and _events(out, "success", "loss") and [
                    e for e in _events(out, "running", "test_steady") if e["sizes"]]:
                break
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "interrupted"
    assert results["tasks"]["loss"]["status"] == "ok"
    assert results["tasks"]["test_steady"]["status"] == "interrupted"
    kept = (out / "results" / "loss.json").read_bytes()

    # The rerun resumes from the journal whatever runs its tasks: here a single process,
    # which spares a second Ray start.
    again = cli_in_child("run", str(job), "--cache", str(tmp_path / "sizes.json"), cwd=tmp_path,
                         env={"OOMGUARD_TEST_FAST": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {k: t["status"] for k, t in results["tasks"].items()} == {
        "loss": "ok", "test_steady": "ok"}
    assert (out / "results" / "loss.json").read_bytes() == kept  # kept byte for byte
    assert len(_events(out, "success", "loss")) == 1
