"""A job's plan: its tasks (one per model and metric, each with the inputs that define
its result) and the device it runs on, measured before anything starts."""

from __future__ import annotations

import socket
from typing import Any

import torch

from oomguard.engine.errors import JobError
from oomguard.engine.jobs.fingerprint import Digests, model_inputs, task_inputs
from oomguard.engine.jobs.records import Job, Task
from oomguard.engine.jobs.spec import model_label
from oomguard.engine.util.jsonable import stable_hash
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import nvml, probe

__all__ = ["device_identity", "identify_device", "plan"]


def plan(job: Job, digests: Digests | None = None) -> list[Task]:
    """The job's tasks in order (model-major), keys file-name safe, each with its inputs
    (:func:`~oomguard.engine.jobs.fingerprint.task_inputs`) and their hash. ``digests``
    memoises file contents (default: in memory only)."""
    digests = digests if digests is not None else Digests()
    tasks = []
    for spec in job.models:
        model = model_inputs(spec, digests)
        for m in job.metrics:
            workload = {"model_config": model["config"], "dtype": job.dtype,
                        "seq_len": job.data.seq_len, "metric": m.name, "params": m.params}
            inputs = task_inputs(job, model, m, digests)
            key = m.id if len(job.models) == 1 else f"{model_label(spec)}.{m.id}"
            tasks.append(Task(key=key, metric_id=m.id, metric=m.name, model=spec,
                              params=dict(m.params), pinned=dict(m.sizes), time_limit=m.time_limit,
                              workload=workload, fingerprint=stable_hash(inputs), inputs=inputs,
                              on_oom=m.on_oom if m.on_oom is not None else job.on_oom,
                              pinned_from=m.pinned_from))
    return tasks


def device_identity(job: Job) -> dict[str, Any]:
    """The device this process runs ``job`` on: :func:`identify_device` of its device and
    budget. Raises :class:`JobError` if the device is missing or the job's budget is larger
    than its total memory."""
    return identify_device(job.device, job.budget_bytes, job.path)


def identify_device(device: str, budget_bytes: int | None, where: str) -> dict[str, Any]:
    """``device`` as this process sees it, measured by :func:`oomguard.probes.probe`: name and
    total bytes, ``budget_bytes``, torch's version, the host; on CUDA also the MIG profile,
    driver version and UUID: the size cache's device (:func:`~oomguard.engine.jobs.cache.device_key`).
    Raises :class:`JobError` naming ``where`` (a job file, a command) if the device is
    missing or the budget is larger than its total memory."""
    snap = probe(device)
    if not snap.available:
        raise JobError(f"{where}: device: {device} is not available here: {snap.reason}; "
                       "give another device (cpu runs anywhere)")
    if budget_bytes and snap.total_bytes and budget_bytes > snap.total_bytes:
        raise JobError(f"{where}: budget: {fmt_bytes(budget_bytes)} is more than "
                       f"{device}'s {fmt_bytes(snap.total_bytes)} in total; give a "
                       "smaller budget, or none")
    ident = {"device": device, "name": snap.name, "total_bytes": snap.total_bytes,
             "budget_bytes": budget_bytes, "torch": torch.__version__,
             "host": socket.gethostname()}
    if snap.device.startswith("cuda"):
        # A MIG profile and the driver make GPUs differ; the UUID is for reports only.
        ident.update({"mig_profile": snap.extra.get("mig_profile"),
                      "driver": nvml.driver_version(), "uuid": snap.extra.get("uuid")})
    return ident
