"""The output folder of a job: whose it is, and which results in it are still true.

:func:`claim` refuses another job's folder, or with ``force`` moves its files into
``moved-aside/``. A result that no longer answers its task (:func:`stale_reasons`) is moved
into ``results/stale/`` by :func:`set_aside` and the task runs again.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from oomguard.engine.errors import JobError
from oomguard.engine.jobs.fingerprint import describe_changes
from oomguard.engine.jobs.records import Job, Task, TaskResult
from oomguard.engine.util.atomic import unused_path

log = logging.getLogger("oomguard.job")

__all__ = ["MOVED_ASIDE", "check_output_folder", "claim", "job_identity", "read_result",
           "set_aside", "stale_reasons"]


def read_result(out: Path, key: str) -> TaskResult | None:
    """``results/<key>.json``, or None if absent or not a task result."""
    try:
        doc = json.loads((out / "results" / f"{key}.json").read_text(encoding="utf-8"))
        return TaskResult.from_dict(doc)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def stale_reasons(done: TaskResult, task: Task, out: Path) -> list[str]:
    """Why the finished result ``done`` no longer answers ``task`` ([] if it still does)."""
    reasons = []
    if done.fingerprint != task.fingerprint:
        reasons = describe_changes(done.inputs, task.inputs) or [
            "the result's inputs were recorded differently (written by another oomguard?)"]
    if done.tensors and not (out / done.tensors).is_file():
        reasons.append(f"its tensor file {done.tensors} is missing")
    return reasons


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def set_aside(out: Path, key: str, done: TaskResult) -> str:
    """Move a stale result (``results/<key>.json`` and its tensor file) into
    ``results/stale/``; returns the new place of the JSON file, relative to ``out``."""
    folder = out / "results" / "stale"
    folder.mkdir(exist_ok=True)
    stem = unused_path(folder / f"{key}.{_stamp()}")
    if done.tensors and (out / done.tensors).is_file():
        os.replace(out / done.tensors, stem.with_name(stem.name + ".pt"))
    target = stem.with_name(stem.name + ".json")
    os.replace(out / "results" / f"{key}.json", target)
    return str(target.relative_to(out))


def job_identity(job: Job) -> dict[str, str]:
    """What makes two runs the same job: its name and the path of its file (an edited job
    file keeps its identity; results whose inputs changed are rerun)."""
    return {"name": job.name, "path": job.path}


def check_output_folder(out: Path, fix: str = "give a writable --out") -> None:
    """Create ``out`` if needed and prove it writable, a first block of 4 KiB included,
    before any work (a run never computes results it cannot keep); :class:`JobError` (one
    line, ending in ``fix``: what to do) if not."""
    if out.exists() and not out.is_dir():
        raise JobError(f"{out}: the output folder is an existing file; give another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out) as probe:
            # why: a full disk still creates an empty file; only a written block finds it full
            probe.write(bytes(4096))
            probe.flush()
    except OSError as exc:
        raise JobError(f"{out}: cannot write the output folder ({exc.strerror or exc}); "
                       f"{fix}") from None


MOVED_ASIDE = "moved-aside"
_KEEP = {".job.lock", MOVED_ASIDE}


def claim(out: Path, job: Job, force: bool) -> None:
    """Make ``out`` this job's: refuse another job's folder, or with ``force`` move its
    files into ``out/moved-aside/<time>-<name>/``."""
    try:
        owner = json.loads((out / "job.json").read_text(encoding="utf-8"))
        theirs = {"name": owner.get("name"), "path": owner.get("path")}
    except (OSError, ValueError, AttributeError):
        return  # a new folder (or one without a readable job record: not an object)
    if theirs == job_identity(job):
        return
    if not force:
        raise JobError(f"{out} holds the results of another job ({theirs['name']!r} from "
                       f"{theirs['path']}): give another --out, or --force to move them into "
                       f"{out / MOVED_ASIDE}/")
    aside = unused_path(out / MOVED_ASIDE / f"{_stamp()}-{theirs['name'] or 'job'}")
    aside.mkdir(parents=True)
    for entry in sorted(out.iterdir()):
        if entry.name not in _KEEP:
            os.replace(entry, aside / entry.name)
    log.warning("--force: moved the files of job %r (%s) into %s", theirs["name"],
                theirs["path"], aside)
