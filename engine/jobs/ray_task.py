"""One task of a job on a Ray worker: measure the device, size for it, run, through the hub.

:func:`run_on_worker` runs the task as the single-process job does
(:func:`~oomguard.engine.jobs.task_process.run_task`), except that the device is measured on
the worker (:func:`task_device`) and keys the size cache, and every output goes to the job's
hub (:class:`~oomguard.engine.jobs.sink.HubSink`). A dead worker's next attempt starts from
:func:`lowered_after_death`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from oomguard.engine.core.child import start_method
from oomguard.engine.jobs.cache import device_key, entry_key
from oomguard.engine.jobs.journal import stamp
from oomguard.engine.jobs.plan import device_identity
from oomguard.engine.jobs.records import Context, Task
from oomguard.engine.jobs.sink import HubSink, forward
from oomguard.engine.jobs.sizing import minimums
from oomguard.engine.jobs.spec import import_plugin
from oomguard.engine.jobs.task_process import run_task
from oomguard.metrics.base import get_metric

# Ray leaves CUDA_VISIBLE_DEVICES as the worker found it where this is "1" or "true".
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
DEATH = "halved after worker death"  # the cache's label of sizes a dead attempt ran at, halved
FORWARD_WAIT_S = 60.0  # for the last outputs to reach the hub, after the task's end


def lowered_after_death(task: Task, previous: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cache lower (:meth:`~oomguard.engine.jobs.cache.SizeCache.lower`'s arguments,
    labelled :data:`DEATH`) below a dead attempt ``previous``: its sizes halved, each at
    least its minimum; None without sizes, with pinned ones, or at every minimum."""
    sizes, key = previous.get("sizes"), previous.get("cache_key")
    if not sizes or not key or task.pinned:
        return None
    minimum = minimums(get_metric(task.metric))
    lowered = {k: max(minimum.get(k, 1), int(v) // 2) for k, v in sizes.items()}
    if lowered == sizes:
        return None
    return {"key": key, "sizes": lowered, "device": previous.get("device"),
            "workload": task.workload, "source": DEATH,
            "reason": f"{task.key}: the Ray worker (pid {previous.get('pid')} on "
                      f"{previous.get('host')}) died while running at {dict(sizes)}"}


def task_device(device: str) -> str:
    """The device string this Ray task runs a job on ``device`` with: ``device`` itself, but
    the GPU Ray assigned, ``cuda:<index>``, where Ray leaves every GPU visible
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``): ``ray.get_gpu_ids()`` are then entries
    of ``CUDA_VISIBLE_DEVICES`` (their position is torch's index) or the indices themselves;
    of several, the first."""
    if device != "cuda" or os.environ.get(NOSET_CUDA_VISIBLE_DEVICES, "").lower() not in ("1", "true"):
        return device
    import ray  # only ever called inside a Ray worker

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = [t.strip() for t in visible.split(",")] if visible is not None else None
    indices = []
    for gpu in (str(i).strip() for i in ray.get_gpu_ids()):
        if order is not None and gpu in order:
            indices.append(order.index(gpu))
        elif order is None and gpu.isdigit():
            indices.append(int(gpu))
    return f"cuda:{min(indices)}" if indices else device


def run_on_worker(task: Task, ctx: Context, hub: Any) -> dict[str, Any]:
    """Run ``task`` on this Ray worker, its outputs written by the hub; returns
    ``{"attempt", "record" (the result as a dict), "seconds" {"task": the task itself (its
    processes), "worker": all this function did}}``, measured here."""
    import ray  # only ever called inside a Ray worker

    t0 = time.perf_counter()
    for plugin in ctx.job.plugins:  # its metric may be a plugin's: a path must exist here too
        import_plugin(plugin)
    job = dataclasses.replace(ctx.job, device=task_device(ctx.job.device))
    device = device_identity(job)
    threads = ctx.threads
    if threads is None and job.device == "cpu":  # the CPUs Ray gave this task
        threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    where = {"host": socket.gethostname(), "pid": os.getpid(), "device": device,
             "device_key": device_key(device), "cache_key": entry_key(device, task.workload)}
    begun = ray.get(hub.begin.remote(task.key, where))
    attempt = begun["attempt"]
    halved = lowered_after_death(task, begun["previous"]) if begun["previous"] else None
    if halved is not None:  # before the entries are read: this attempt starts from them
        ray.get(hub.take.remote(task.key, attempt, "lower", (), halved))
        hub.take.remote(task.key, attempt, "record", (stamp(
            "halved", task=task.key, run=ctx.run_id, sizes=halved["sizes"], source=DEATH,
            reason=halved["reason"]),), {})
    entries = ray.get(hub.entries.remote(where["device_key"]))
    scratch = Path(tempfile.mkdtemp(prefix=f"oomguard-{task.key}-"))
    receive, send = multiprocessing.Pipe(duplex=False)
    sink, refs = HubSink(scratch, entries, send), []
    pump = threading.Thread(target=lambda: refs.extend(forward(receive, hub, task.key, attempt)),
                            daemon=True, name=f"oomguard-forward-{task.key}")
    pump.start()
    try:
        here = dataclasses.replace(ctx, job=job, out=str(scratch), device=device,
                                   start_method=start_method(job.device), threads=threads)
        t_task = time.perf_counter()
        # Never asked to stop: the driver cancels a Ray task by ending its worker.
        record = run_task(task, here, sink, SimpleNamespace(signum=None))
        t_task = time.perf_counter() - t_task
        # What the task's process wrote outside its sink: allocator snapshots, its log.
        for path in sorted(p for p in (scratch / "snapshots").rglob("*") if p.is_file()):
            sink.send("write", str(path.relative_to(scratch)), path.read_bytes())
        if (scratch / "job.log").exists():
            sink.send("write", "job.log", (scratch / "job.log").read_bytes(), True)
    finally:
        send.send(None)
        pump.join(FORWARD_WAIT_S)
        shutil.rmtree(scratch, ignore_errors=True)
        hub.end.remote(task.key, attempt)  # after its outputs: one caller's calls run in order
    ray.get(refs)  # every output written (an error writing one is this task's)
    return {"attempt": attempt, "record": record.to_dict(),
            "seconds": {"task": round(t_task, 3),
                        "worker": round(time.perf_counter() - t0, 3)}}
