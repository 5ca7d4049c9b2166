"""One task of a job on a Ray worker: measure the device, size for it, run, send it all back.

:func:`run_on_worker` is the body of the Ray task
(:class:`~oomguard.engine.jobs.ray_job.OnRay` submits it). It runs the task exactly as the
single-process job does (:func:`~oomguard.engine.jobs.task_process.run_task`: a child
process, the time limit, the size cache or a search, the executor's retry at half on an
OOM, the remedy ladder), with three differences:

- **The device is measured here**, on the worker: :func:`~oomguard.engine.jobs.plan.device_identity`
  probes the GPU Ray assigned (``CUDA_VISIBLE_DEVICES`` names it; the probe finds it in
  NVML by UUID), and the size cache is keyed by that device.
- **The size cache is the job's hub** (:mod:`~oomguard.engine.jobs.ray_hub`): the task's
  process works on a scratch copy of it, and what the task stored or lowered is merged
  back into the hub when it ends. While it runs, the sizes it runs at are reported to the
  hub, so that if this worker dies, the attempt Ray starts next lowers them in the cache
  (halves each knob, not below its minimum) and starts from there, never from the same
  sizes.
- **Outputs go back to the driver**: the task writes into a scratch folder on the worker,
  and the driver gets the result and traceback files, snapshots, journal events and
  ``job.log`` lines to write into the job's folder (no shared storage needed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oomguard.engine.core.child import start_method
from oomguard.engine.jobs.cache import VERSION, SizeCache, device_key, entry_key
from oomguard.engine.jobs.journal import Journal, replay
from oomguard.engine.jobs.plan import device_identity
from oomguard.engine.jobs.records import Context, Task
from oomguard.engine.jobs.spec import import_plugin
from oomguard.engine.jobs.task_process import run_task
from oomguard.engine.util.atomic import atomic_write_json
from oomguard.metrics.base import get_metric

WATCH_S = 0.25  # how often the task's journal is read for the sizes it runs at


class _GoOn:
    """A job that never asks this task to stop: the driver cancels a Ray task by ending
    its worker, which ends the task's process with it."""

    signum = None


def lowered_after_death(task: Task, previous: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cache change that makes the next attempt start below where a dead one ran.

    ``previous`` is the dead attempt (:meth:`~oomguard.engine.jobs.ray_hub.Hub.begin`):
    its sizes halved, each knob at least its minimum, as a ``lower`` of that attempt's
    cache key (its device's). None when it had not chosen sizes yet, when the job file
    pins them, or when every knob is already at its minimum.
    """
    sizes, key = previous.get("sizes"), previous.get("cache_key")
    if not sizes or not key or task.pinned:
        return None
    minimum = {k.name: int(k.minimum) for k in get_metric(task.metric).memory_knobs()}
    lowered = {k: max(minimum.get(k, 1), int(v) // 2) for k, v in sizes.items()}
    if lowered == sizes:
        return None
    return {"op": "lower", "key": key, "sizes": lowered, "device": previous.get("device"),
            "workload": task.workload,
            "reason": f"{task.key}: the Ray worker (pid {previous.get('pid')} on "
                      f"{previous.get('host')}) died while running at {dict(sizes)}"}


def cache_changes(before: Mapping[str, Mapping[str, Any]],
                  after: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What a task's process changed in its copy of the cache, as the hub's changes."""
    changes = []
    for key, entry in after.items():
        if before.get(key) == entry:  # (not by "updated": it is to the second)
            continue
        common = {"key": key, "sizes": entry["sizes"], "device": entry.get("device"),
                  "workload": entry.get("workload")}
        if entry.get("source") == "lowered after OOM":
            reason = (entry.get("history") or [{}])[-1].get("reason", "an OOM")
            changes.append({"op": "lower", **common, "reason": reason})
        else:
            extra = {k: v for k, v in entry.items()
                     if k not in ("sizes", "source", "updated", "history", "device",
                                  "workload")}
            changes.append({"op": "put", **common, "source": entry.get("source", "search"),
                            **extra})
    return changes


class _Watch(threading.Thread):
    """Report the sizes the task runs at to the hub, from its journal's ``sizes`` and
    ``retry`` events, while it runs."""

    def __init__(self, path: Path, hub: Any, task: str, attempt: int, key: str) -> None:
        super().__init__(daemon=True, name=f"oomguard-watch-{task}")
        self.path, self.hub, self.task, self.attempt, self.key = path, hub, task, attempt, key
        self.done = threading.Event()
        self.offset = 0

    def poll(self) -> None:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(whole)
        for line in whole.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") in ("sizes", "retry") and event.get("sizes"):
                self.hub.running.remote(self.task, self.attempt, event["sizes"], self.key,
                                        retry=event["event"] == "retry")

    def run(self) -> None:
        while not self.done.wait(WATCH_S):
            self.poll()
        self.poll()


def _files(scratch: Path, key: str) -> dict[str, bytes]:
    """The task's files, by path relative to the job's folder."""
    paths = [scratch / "results" / f"{key}.json", scratch / "results" / f"{key}.pt",
             scratch / "tracebacks" / f"{key}.txt"]
    paths += sorted(p for p in (scratch / "snapshots").rglob("*") if p.is_file())
    return {str(p.relative_to(scratch)): p.read_bytes() for p in paths if p.is_file()}


def run_on_worker(task: Task, ctx: Context, hub: Any) -> dict[str, Any]:
    """Run ``task`` on this Ray worker; returns what the driver writes.

    ``{"attempt", "where", "record" (the result as a dict), "files" {path: bytes},
    "journal" [events], "log" (job.log text), "seconds" {"task": the task itself (its
    processes), "worker": all this function did}}``: measured on the worker.
    """
    import ray  # only ever called inside a Ray worker

    t0 = time.perf_counter()
    for plugin in ctx.job.plugins:  # its metric may be a plugin's: a path must exist here too
        import_plugin(plugin)
    device = device_identity(ctx.job)
    threads = ctx.threads
    if threads is None and ctx.job.device == "cpu":  # the CPUs Ray gave this task
        threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    where = {"host": socket.gethostname(), "pid": os.getpid(),
             "node": ray.get_runtime_context().get_node_id(), "device": device,
             "device_key": device_key(device)}
    begun = ray.get(hub.begin.remote(task.key, where))
    attempt, previous = begun["attempt"], begun["previous"]
    lowered = lowered_after_death(task, previous) if previous else None
    if lowered is not None:
        ray.get(hub.apply.remote([lowered]))
    scratch = Path(tempfile.mkdtemp(prefix=f"oomguard-{task.key}-"))
    try:
        for sub in ("results", "tracebacks", "plots", "snapshots"):
            (scratch / sub).mkdir()
        seed = ray.get(hub.entries.remote(where["device_key"]))
        atomic_write_json(scratch / "sizes.json", {"version": VERSION, "entries": seed})
        here = dataclasses.replace(ctx, out=str(scratch), device=device,
                                   cache_path=str(scratch / "sizes.json"),
                                   start_method=start_method(ctx.job.device),
                                   threads=threads)
        journal = Journal(scratch / "journal.jsonl")
        watch = _Watch(journal.path, hub, task.key, attempt, entry_key(device, task.workload))
        watch.start()
        t_task = time.perf_counter()
        try:
            record = run_task(task, here, journal, _GoOn())
        finally:
            t_task = time.perf_counter() - t_task
            watch.done.set()
            watch.join()
            journal.close()
        changes = cache_changes(seed, SizeCache(scratch / "sizes.json").entries())
        if changes:
            ray.get(hub.apply.remote(changes))
        log = scratch / "job.log"
        return {"attempt": attempt, "where": where,
                "seconds": {"task": round(t_task, 3),
                            "worker": round(time.perf_counter() - t0, 3)},
                "record": record.to_dict(),  # never None: nothing here asks it to stop
                "files": _files(scratch, task.key), "journal": replay(journal.path),
                "log": log.read_text(encoding="utf-8", errors="replace")
                if log.exists() else ""}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        hub.end.remote(task.key, attempt)
