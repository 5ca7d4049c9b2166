"""The output folder of a job: whose it is, which files in it are the job's, and which
results in it are still true.

A job's record, ``job.json``, names the job, its tasks and every file it writes
(:func:`record`). :func:`claim` refuses another job's folder, or with ``force`` moves exactly
the files that job's record lists into ``moved-aside/``; a folder that holds anything else
and no record is refused. A result that no longer answers its task (:func:`stale_reasons`) is
moved into ``results/stale/`` by :func:`set_aside` and the task runs again. Every path built
from a name (a task's key, a file a record lists) goes through
:func:`~oomguard.engine.util.atomic.inside`.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from oomguard.engine.errors import JobError, first_line
from oomguard.engine.jobs.fingerprint import describe_changes
from oomguard.engine.jobs.records import Job, Task, TaskResult
from oomguard.engine.util.atomic import atomic_write_json, inside, unused_path
from oomguard.engine.util.jsonable import read_json

log = logging.getLogger("oomguard.job")

__all__ = ["MOVED_ASIDE", "add_to_record", "check_output_folder", "claim", "job_identity",
           "read_result", "record", "set_aside", "stale_reasons", "task_files"]

RECORD = "job.json"
# What a job writes at fixed names (the runner, its log, the report), and per task
# (task_child: result, tensors, traceback; reports/job_report.py: plots): its record lists
# them, and --force moves them and nothing else. Stale results and CUDA snapshots, whose
# names are made as they are written, are added to the record then.
JOB_FILES = (RECORD, "job.toml", "job.log", "journal.jsonl", "results.json", "report.md",
             ".digests.json", "plots/memory.png")


def task_files(key: str) -> list[str]:
    """The files a task ``key`` may write, relative to the output folder."""
    return [f"results/{key}.json", f"results/{key}.pt", f"tracebacks/{key}.txt",
            f"plots/{key}-landscape.png", f"plots/{key}-entropy.png"]


def read_result(out: Path, key: str) -> TaskResult | None:
    """``results/<key>.json``, or None if absent or not a task result."""
    try:
        doc = read_json(inside(out, f"results/{key}.json"))  # refuses hostile nesting
        return TaskResult.from_dict(doc)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _tensor_file(out: Path, done: TaskResult) -> Path | None:
    """The tensor file a result names, if the name stays inside ``out`` (a result file is
    read from disk: its ``tensors`` may say ``../x``)."""
    try:
        return inside(out, done.tensors) if isinstance(done.tensors, str) else None
    except ValueError:
        return None


def stale_reasons(done: TaskResult, task: Task, out: Path) -> list[str]:
    """Why the finished result ``done`` no longer answers ``task`` ([] if it still does)."""
    reasons = []
    if done.fingerprint != task.fingerprint:
        reasons = describe_changes(done.inputs, task.inputs) or [
            "the result's inputs were recorded differently (written by another oomguard?)"]
    if done.tensors and not ((path := _tensor_file(out, done)) and path.is_file()):
        reasons.append(f"its tensor file {done.tensors} is missing")
    return reasons


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def set_aside(out: Path, key: str, done: TaskResult) -> str:
    """Move a stale result (``results/<key>.json`` and its tensor file) into
    ``results/stale/``; returns the new place of the JSON file, relative to ``out``."""
    folder = out / "results" / "stale"
    folder.mkdir(exist_ok=True)
    stem = unused_path(inside(folder, f"{key}.{_stamp()}"))
    moved = []
    if (tensors := _tensor_file(out, done)) is not None and tensors.is_file():
        os.replace(tensors, stem.with_name(stem.name + ".pt"))
        moved.append(stem.with_name(stem.name + ".pt"))
    target = stem.with_name(stem.name + ".json")
    os.replace(inside(out, f"results/{key}.json"), target)
    add_to_record(out, [str(p.relative_to(out)) for p in [target, *moved]])
    return str(target.relative_to(out))


def job_identity(job: Job) -> dict[str, str]:
    """What makes two runs the same job: its name and the path of its file (an edited job
    file keeps its identity; results whose inputs changed are rerun)."""
    return {"name": job.name, "path": job.path}


def _inputs(job: Job) -> set[Path]:
    """The files a job reads (its job file, data file, ``.py`` plugins): never moved aside,
    never overwritten by the copy of the job file, never what makes a folder "not empty"."""
    paths = [job.path, job.data.path, *(p for p in job.plugins if p.endswith(".py"))]
    return {Path(p).resolve() for p in paths if p and p != "<job>"}


def _read_record(out: Path) -> dict[str, Any] | None:
    """The job record in ``out``: None if there is none; JobError if it is not one."""
    try:
        owner = read_json(out / RECORD)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise JobError(f"{out / RECORD}: not a readable job record ({first_line(exc)}); give "
                       "another --out, or move the folder's files away") from None
    if not isinstance(owner, dict):
        raise JobError(f"{out / RECORD}: not a job record (not a JSON object); give another "
                       "--out, or move the folder's files away")
    return owner


def _same(owner: dict[str, Any], job: Job) -> bool:
    return {"name": owner.get("name"), "path": owner.get("path")} == job_identity(job)


def _recorded_files(out: Path, owner: dict[str, Any]) -> list[str]:
    """The files ``owner`` (a job record) says its job wrote, each checked to stay inside
    ``out``; JobError before anything moves if one does not. A record without ``files``
    (from an oomguard before this one) is read from its tasks."""
    files = owner.get("files")
    if files is None:
        keys = [k for k in owner.get("tasks") or [] if isinstance(k, str)]
        files = [*JOB_FILES, *(f for k in keys for f in task_files(k))]
        stale = out / "results" / "stale"
        files += [f"results/stale/{p.name}" for p in (stale.iterdir() if stale.is_dir() else ())
                  if any(p.name.startswith(f"{k}.") for k in keys)]
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise JobError(f"{out / RECORD}: its files are not a list of names; move the files "
                       "by hand, or give another --out")
    top = out.resolve()
    for rel in files:
        try:
            path = inside(out, rel)
        except ValueError as exc:
            raise JobError(f"{out / RECORD}: {exc}; move the files by hand, or give another "
                           "--out") from None
        if not path.parent.resolve().is_relative_to(top):  # a folder linked elsewhere
            raise JobError(f"{out / RECORD}: {rel} lies outside {out} (through a symbolic "
                           "link); move the files by hand, or give another --out")
    return files


def record(out: Path, job: Job, keys: Iterable[str]) -> None:
    """Write ``job.json``: the job (:func:`job_identity`), its tasks ``keys``, and every
    file it writes (:data:`JOB_FILES`, :func:`task_files`; its own input files excluded),
    with those an earlier run of the same job recorded. Written before any other file of
    the run, so that a folder with the job's files always has its record."""
    keys = list(keys)
    owner = _read_record(out)
    earlier = owner.get("files") if owner and _same(owner, job) else None
    inputs = _inputs(job)
    files = {f for f in [*JOB_FILES, *(f for k in keys for f in task_files(k))]
             if inside(out, f).resolve() not in inputs}
    files |= set(earlier) if isinstance(earlier, list) else set()
    atomic_write_json(out / RECORD, {**job_identity(job), "tasks": keys, "files": sorted(files)})


def add_to_record(out: Path, files: Iterable[str]) -> None:
    """Add ``files`` (relative to ``out``, named as they were written: a stale result, a
    CUDA snapshot) to the job record. Only the job's own process calls it (the record is
    rewritten whole)."""
    owner = _read_record(out) or {}
    atomic_write_json(out / RECORD, {**owner, "files": sorted(
        {*(owner.get("files") or []), *files})})


def check_output_folder(out: Path, fix: str = "give a writable --out") -> None:
    """Create ``out`` if needed and prove it writable, a first block on its disk included,
    before any work (a run never computes results it cannot keep); :class:`JobError` (one
    line, ending in ``fix``: what to do) if not."""
    if out.exists() and not out.is_dir():
        raise JobError(f"{out}: the output folder is an existing file; give another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out) as probe:
            # why: a full disk still creates an empty file; a byte needs a block and finds it
            # full (one byte: a file-size limit, `ulimit -f`, is met by the real files)
            probe.write(b"\0")
            probe.flush()
    except OSError as exc:
        raise JobError(f"{out}: cannot write the output folder ({exc.strerror or exc}); "
                       f"{fix}") from None


MOVED_ASIDE = "moved-aside"
_KEEP = {".job.lock", MOVED_ASIDE}  # the lock of the run now, and what earlier --force moved


def claim(out: Path, job: Job, force: bool) -> None:
    """Make ``out`` this job's: refuse another job's folder, or with ``force`` move the files
    its record lists (and only those) into ``out/moved-aside/<time>-<name>/``, each at its
    place below it. A folder with no record must be empty (but for this job's own input
    files): its files are nobody's to move."""
    owner = _read_record(out)
    if owner is None:
        inputs = _inputs(job)
        others = sorted(e.name for e in out.iterdir()
                        if e.name not in _KEEP and e.resolve() not in inputs)
        if others:
            raise JobError(f"{out} holds {len(others)} files or folders ({', '.join(others[:3])}"
                           f"{', ...' if len(others) > 3 else ''}) and no oomguard job record "
                           f"({RECORD}): give an empty or new output folder (--out)")
        return
    if _same(owner, job):
        return
    theirs = {"name": owner.get("name"), "path": owner.get("path")}
    if not force:
        raise JobError(f"{out} holds the results of another job ({theirs['name']!r} from "
                       f"{theirs['path']}): give another --out, or --force to move them into "
                       f"{out / MOVED_ASIDE}/")
    files = _recorded_files(out, owner)  # every name checked before anything moves
    # The old job's name is read from disk: a label only, each character outside a plain
    # file name replaced (a "../" in it must not move anything elsewhere).
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(theirs["name"] or "")).strip("._") or "job"
    aside = unused_path(inside(out / MOVED_ASIDE, f"{_stamp()}-{label}"))
    inputs, moved = _inputs(job), 0
    for rel in sorted(files):
        src = inside(out, rel)
        if not (src.is_symlink() or src.is_file()) or src.resolve() in inputs:
            continue  # never written, a folder (its files are listed), or this job's input
        target = inside(aside, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, target)
        moved += 1
    log.warning("--force: moved the %d files of job %r (%s) into %s; nothing else was moved",
                moved, theirs["name"], theirs["path"], aside)
