"""Run a job's tasks on Ray: every GPU of a node, or a cluster, each task sized where it lands.

:class:`OnRay` is the backend for ``oomguard run JOB --ray [ADDRESS]``: each task is one
Ray task asking for one GPU (or ``cpus_per_task`` CPUs), run as the single-process job would
(:mod:`~oomguard.engine.jobs.ray_task`). Ray knows nothing of GPU memory; oomguard adds it:

- each task measures the device it got and takes its sizes from the cache for that device;
- an OOM is retried inside the task at half the size (the executor);
- a worker that dies (the host's OOM killer, a driver fault) is retried by Ray
  (``max_retries``), and the new attempt starts from the dead one's sizes halved, through
  the cache, labelled as a death (:func:`~oomguard.engine.jobs.ray_task.lowered_after_death`);
- the tasks' outputs and the size cache go through one actor on this node
  (:mod:`~oomguard.engine.jobs.ray_hub`); the job's folder is what the single-process job
  writes, and a rerun resumes from it.

Ray is an optional dependency (``pip install 'oomguard[ray]'``), imported only here.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from typing import Any

from oomguard.engine.errors import JobError, UsageError, first_line
from oomguard.engine.jobs.cache import default_cache_path
from oomguard.engine.jobs.journal import Journal
from oomguard.engine.jobs.ray_hub import DIED, DONE, RUNNING, Hub
from oomguard.engine.jobs.ray_task import run_on_worker
from oomguard.engine.jobs.records import Context, Job, Task, TaskResult
from oomguard.engine.jobs.sink import FileSink
from oomguard.engine.jobs.task_child import interrupted, record_failure

log = logging.getLogger("oomguard.job")

INSTALL = "pip install 'oomguard[ray]'"
START = ("start one with `ray start --head` (and `ray start --address HEAD:6379` on the "
         "other nodes), or give --ray no address for a local instance")
CONNECT_TIMEOUT_S = 5.0
POLL_S = 0.5


def import_ray() -> Any:
    """The ``ray`` module, or a one-line :class:`UsageError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"--ray needs Ray, which is not installed here; install it: {INSTALL}") from None
    return ray


def _reachable(address: str) -> str | None:
    """Why ``host:port`` cannot be reached (None if a TCP connection opens): checked first,
    because ``ray.init`` retries an unreachable address for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return f"{address!r} is not HOST:PORT"
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return None


class OnRay:
    """Run the tasks as Ray tasks. ``address``: a running cluster (``HOST:PORT`` or ``auto``);
    None does what ``ray.init()`` does; ``num_cpus`` starts a new local instance with that
    many CPUs. An instance this starts is stopped at the end. ``max_retries``: how often Ray
    runs a task again after its worker died."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 cpus_per_task: int = 1, max_retries: int = 3) -> None:
        self.address, self.num_cpus = address, num_cpus
        self.cpus_per_task, self.max_retries = cpus_per_task, max_retries
        self.ray: Any = None
        self.owns = False

    # ------------------------------------------------------------ backend protocol
    def device(self, job: Job) -> dict[str, Any]:
        """Connect to Ray and check it can run ``job``; the job's device as the report
        heads it (each task's own device is measured on its worker)."""
        if job.device not in ("cpu", "cuda"):
            raise JobError(f"{job.path}: device: {job.device!r} under --ray: write "
                           "device = \"cuda\" (Ray gives each task its own GPU) or \"cpu\"")
        self.ray = ray = import_ray()
        if not ray.is_initialized():
            if self.address not in (None, "auto") and (why := _reachable(self.address)):
                raise UsageError(f"cannot reach the Ray cluster at {self.address}: {why}; {START}")
            local = self.address is None and self.num_cpus is not None
            try:
                ray.init(address="local" if local else self.address,
                         num_cpus=self.num_cpus if local else None, include_dashboard=False,
                         log_to_driver=False, logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise UsageError(f"cannot start or join Ray at {self.address or 'this machine'}"
                                 f": {first_line(exc) or type(exc).__name__}; {START}") from None
            self.owns = True
        resources = ray.cluster_resources()
        have = f"{int(resources.get('CPU', 0))} CPU(s), {int(resources.get('GPU', 0))} GPU(s)"
        if job.device == "cuda" and resources.get("GPU", 0) < 1:
            raise JobError(f"{job.path}: device: cuda, but the Ray cluster has no GPU ({have}); "
                           "add a node with GPUs, or run the job with device = \"cpu\"")
        return {"device": job.device, "name": f"Ray cluster: {have}",
                "total_bytes": None, "budget_bytes": job.budget_bytes,
                "ray": {"address": self.address or "local",
                        "nodes": len([n for n in ray.nodes() if n.get("Alive")])}}

    def run(self, tasks: list[Task], ctx: Context, journal: Journal, stop: Any,
            progress: Any) -> None:
        """Submit the tasks as Ray has room for them, and write each result as it arrives."""
        if not tasks:
            return
        ray = self.ray
        here = ray.get_runtime_context().get_node_id()
        # The hub lives on this node, beside the job's folder and the cache file.
        strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(here, soft=False)
        cache = str(ctx.cache_path or default_cache_path())  # this process's, not the actor's
        hub = ray.remote(num_cpus=0, scheduling_strategy=strategy)(Hub).remote(ctx.out, cache)
        ray.get(hub.status.remote())  # up before the first task asks it
        kind, each = (("GPU", 1) if ctx.job.device == "cuda" else ("CPU", self.cpus_per_task))
        remote = ray.remote(max_retries=self.max_retries, retry_exceptions=False,
                            **{f"num_{kind.lower()}s": each})(run_on_worker)
        waiting = list(tasks)
        pending: dict[Any, tuple[Task, float]] = {}  # with when it was submitted
        seen: dict[tuple[str, int], Any] = {}
        try:
            while waiting or pending:
                # No more tasks in flight than the cluster has room for now: a task blocked in
                # ray.get lends its CPU back to Ray (docs/measurements.md#ray).
                room = max(1, int(ray.cluster_resources().get(kind, 0) // each))
                while waiting and len(pending) < room:
                    task = waiting.pop(0)
                    pending[remote.remote(task, ctx, hub)] = task, time.monotonic()
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                progress.show(self._watch(ray.get(hub.status.remote()), seen, journal, ctx.run_id))
                for ref in ready:
                    task, submitted = pending.pop(ref)
                    record = self._collect(ref, task, ctx, journal,
                                           time.monotonic() - submitted, stop)
                    if record is None:
                        progress.interrupted(task, ctx.run_id)
                    else:
                        progress.finished(record)
                if stop.signum is not None:
                    for ref, (task, _) in pending.items():
                        ray.cancel(ref, force=True)
                        interrupted(journal.append, task, ctx, stop)
                        progress.interrupted(task, ctx.run_id)
                    return
        finally:
            status = ray.get(hub.status.remote())
            ray.kill(hub)
            for line in device_lines(status):
                log.info("%s", line)

    def close(self) -> None:
        if self.owns:
            self.ray.shutdown()
        self.owns = False

    # ------------------------------------------------------------ the driver's part
    def _collect(self, ref: Any, task: Task, ctx: Context, journal: Journal,
                 seconds: float, stop: Any) -> TaskResult | None:
        """The task's outcome (the hub wrote its files), a failure Ray reports recorded as
        the task's failure, or None: the job's own signal ended it (interrupted)."""
        ray = self.ray
        try:
            payload = ray.get(ref)
        except ray.exceptions.RayError as exc:
            if stop.signum is not None:  # Ctrl-C reaches a local instance's workers too
                interrupted(journal.append, task, ctx, stop)
                return None
            if isinstance(exc, ray.exceptions.RayTaskError):  # raised outside the metric
                cause = exc.cause or exc
                reason = f"{type(cause).__name__}: {first_line(cause)[:500]}"
            else:  # the worker died every time it was tried
                reason = (f"its Ray worker died {self.max_retries + 1} times "
                          f"({type(exc).__name__}); see job.log")
            return record_failure(task, ctx, FileSink(ctx.out, ctx.cache_path), reason,
                                  str(exc), seconds)
        took = payload["seconds"]
        # Where the time went, from submission on: the task's processes and the worker's part.
        journal.append("ray-task", task=task.key, run=ctx.run_id, attempt=payload["attempt"],
                       task_seconds=took["task"],
                       worker_seconds=round(took["worker"] - took["task"], 3),
                       submitted_to_written=round(seconds, 3))
        return TaskResult.from_dict(payload["record"])

    def _watch(self, status: dict[str, list[dict[str, Any]]],
               seen: dict[tuple[str, int], Any], journal: Journal, run_id: str) -> str:
        """Journal what the hub tells of each attempt (``running`` when first seen and
        whenever its sizes change while it runs, ``worker-died`` before Ray's retry);
        returns the progress line: tasks running, per device what is done and retried."""
        for key, attempts in status.items():
            for a in attempts:
                at = (key, a["attempt"])
                if at not in seen and a["attempt"] > 1:
                    dead = attempts[a["attempt"] - 2]
                    journal.append("worker-died", task=key, run=run_id, host=dead["host"],
                                   pid=dead["pid"], sizes=dead["sizes"],
                                   retry=a["attempt"] - 1, of=self.max_retries)
                    log.warning("%s: its Ray worker (pid %s on %s) died%s; Ray runs it again "
                                "(retry %d of %d)", key, dead["pid"], dead["host"],
                                f" at {dead['sizes']}" if dead["sizes"] else "",
                                a["attempt"] - 1, self.max_retries)
                if at not in seen or (seen[at] != a["sizes"] and a["state"] == RUNNING):
                    journal.append("running", task=key, run=run_id, attempt=a["attempt"],
                                   host=a["host"], pid=a["pid"], device=a["device_key"],
                                   sizes=a["sizes"], retries=a["retries"])
                seen[at] = a["sizes"]
        running = sum(a["state"] == RUNNING for v in status.values() for a in v[-1:])
        return f"{running} running; " + "; ".join(device_lines(status, short=True))


def device_lines(status: dict[str, list[dict[str, Any]]], short: bool = False) -> list[str]:
    """Per device: tasks done, OOM retries inside tasks, workers that died."""
    done, retries, died = Counter[str](), Counter[str](), Counter[str]()
    for attempts in status.values():
        for a in attempts:
            name = a["device"].get("name") or a["device_key"]
            done[name] += a["state"] == DONE
            retries[name] += a["retries"]
            died[name] += a["state"] == DIED
    names = sorted(done)  # every device counted in all three
    if short:
        return [f"{n[:24]}: {done[n]} done, {retries[n] + died[n]} retries" for n in names]
    return [f"device {n}: {done[n]} task(s) done, {retries[n]} OOM retr"
            f"{'y' if retries[n] == 1 else 'ies'} inside tasks, {died[n]} worker(s) died"
            for n in names]
