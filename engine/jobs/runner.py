"""Run a job: every (model, metric) task once, losing nothing already computed.

This process plans the tasks, keeps the journal, and runs each task in a **child process**
(:mod:`~oomguard.engine.jobs.task_child`; from a forkserver,
docs/measurements.md#isolated-children-start-up, docs/measurements.md#fork-after-openmp): the
**time limit** really stops a metric (SIGTERM, then SIGKILL after 5 s), a budget or a crash
stays in the child, and each metric starts with a fresh heap. The limit covers the whole task;
the search is also bounded by ``search.max_trials`` and ``search.max_seconds``.

Resume: an ``ok`` result that still answers its task (:mod:`~oomguard.engine.jobs.fingerprint`)
is kept; a stale one is moved aside and rerun (:mod:`~oomguard.engine.jobs.output`); failed and
interrupted tasks run again.
SIGINT, SIGTERM and SIGUSR1 (Slurm's warning) stop cleanly: the running task is recorded as
interrupted, its child stopped, the report written; the exit code is 128 + the signal
(:data:`EXIT_SIGNAL`). ``kill -9`` of the parent also ends the child (PR_SET_PDEATHSIG).

Backends: :class:`Sequential` (the default) or :class:`~oomguard.engine.jobs.ray_job.OnRay`,
both through :func:`~oomguard.engine.jobs.task_process.run_task`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from oomguard.engine.core import child as launcher
from oomguard.engine.errors import JobError
from oomguard.engine.jobs.fingerprint import Digests
from oomguard.engine.jobs.journal import Journal
from oomguard.engine.jobs.output import (
    add_to_record,
    check_output_folder,
    claim,
    read_result,
    record,
    set_aside,
    stale_reasons,
)
from oomguard.engine.jobs.plan import device_identity, plan
from oomguard.engine.jobs.progress import Progress, Steps, wanted
from oomguard.engine.jobs.records import FAILED, PENDING, Context, Job, Task, TaskResult, now_iso
from oomguard.engine.jobs.sink import FileSink
from oomguard.engine.jobs.task_process import run_task
from oomguard.engine.util.atomic import atomic_write, atomic_write_json
from oomguard.reports.job_report import ReportInterrupted, write_job_report

log = logging.getLogger("oomguard.job")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# Stopped by a signal: 128 + its number, as a shell reports it. Slurm sends SIGUSR1 before a
# time limit (`sbatch --signal=USR1@90`), SIGTERM at it; Windows has no SIGUSR1.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1")
                     if hasattr(signal, name))
EXIT_SIGNAL = {sig: 128 + sig for sig in STOP_SIGNALS}  # Linux: 130, 143, 138


@dataclass
class Outcome:
    """What :func:`run_job` did: per task key, its :class:`TaskResult`."""

    exit_code: int
    results: dict[str, TaskResult] = field(default_factory=dict)
    out: str = ""
    seconds: float = 0.0
    stopped_by: str | None = None  # the signal that stopped the job (SIGTERM...), if one did
    report: str | None = None  # report.md's path once written this run (None: it was not)

    def failed(self) -> list[str]:  # in job order
        return [k for k, r in self.results.items() if r.status == FAILED]


class _Stop:
    """SIGINT/SIGTERM/SIGUSR1 handler state: the first signal asks to stop, and work in
    progress asks :attr:`signum`. The handler never raises (an exception could land in a
    finalizer, where Python prints it and carries on)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Stop:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            log.warning("received %s: stopping after recording the running metric",
                        signal.Signals(signum).name)
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Sequential:
    """Run a job's tasks one after another, each in a child of this process (the default)."""

    device = staticmethod(device_identity)  # every task's device, measured here

    def run(self, tasks: list[Task], ctx: Context, journal: Journal, stop: _Stop,
            progress: Progress) -> None:
        for task in tasks:
            if stop.signum is not None:
                return
            progress.show(task.key)
            record = run_task(task, ctx, FileSink(ctx.out, ctx.cache_path), stop)
            if record is None:
                progress.interrupted(task, ctx.run_id)
                return
            progress.finished(record)

    def close(self) -> None:
        """Nothing to release."""


def run_job(job: Job, *, cache_path: str | os.PathLike[str] | None = None, search: bool = True,
            progress: bool | None = None, start_method: str = "forkserver",
            log_setup: Callable[[Path], Any] | None = None, force: bool = False,
            snapshot_on_oom: bool = False, backend: Any = None,
            threads: int | None = None) -> Outcome:
    """Run (or resume) ``job`` into ``job.output`` (sizes from pins, the cache or a search;
    each metric in its own process); returns the exit code and every record. A stale
    result's reasons go to the log, the journal, the result (``rerun_because``) and the
    report; ``force``: see :func:`claim`.

    ``start_method``: ``forkserver`` or ``fork`` (only from a process that has run no torch
    code; :func:`~oomguard.engine.core.child.start_method` decides for GPUs, macOS and
    Windows). ``log_setup(out)`` (picklable) is called once the output folder is locked and
    in every metric's process; without it no logging is configured. ``threads``: torch's
    intra-op threads per metric's process (None: torch's default). ``snapshot_on_oom``: a
    CUDA allocator snapshot per OOM into ``snapshots/``.

    Raises :class:`JobError` before any work if the job cannot start (device, budget, output
    folder, Ray cluster). ``OSError`` from writing propagates; finished results are kept.
    """
    t0 = time.perf_counter()
    out = Path(job.output)
    digests = Digests(out / ".digests.json")
    tasks = plan(job, digests)
    backend = backend if backend is not None else Sequential()
    # What the platform allows, decided where every child starts: the journal records it.
    start_method = launcher.start_method(job.device, fork=start_method == "fork")
    try:
        device = backend.device(job)
        check_output_folder(out)
        lock = FileLock(str(out / ".job.lock"), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise JobError(f"{out}: another oomguard run is using this output folder; "
                           "wait for it to end, or give another --out") from None
        try:
            claim(out, job, force)
            record(out, job, [t.key for t in tasks])  # the record first: it says whose files
            digests.save()
            ctx = Context(job=job, out=str(out), run_id=uuid.uuid4().hex[:12],
                          cache_path=str(cache_path) if cache_path else None, search=search,
                          device=device, start_method=start_method, log_setup=log_setup,
                          snapshot_on_oom=snapshot_on_oom, threads=threads)
            return _run_locked(tasks, ctx, backend, progress, t0)
        finally:
            lock.release()
    finally:
        backend.close()


def _run_locked(tasks: list[Task], ctx: Context, backend: Any, progress: bool | None,
                t0: float) -> Outcome:
    job, out, run_id = ctx.job, Path(ctx.out), ctx.run_id
    for sub in ("results", "tracebacks", "plots"):
        (out / sub).mkdir(exist_ok=True)
    if ctx.log_setup is not None:
        ctx.log_setup(out)
    if (out / "job.toml").resolve() != Path(job.path).resolve():  # not over the job file itself
        atomic_write(out / "job.toml", job.text)
    journal = Journal(out / "journal.jsonl")
    journal.append("job-start", run=run_id, job=job.path, tasks=[t.key for t in tasks],
                   device=ctx.device, start_method=ctx.start_method, backend=type(backend).__name__)
    log.info("job %s: %d metric(s) on %s, output %s", job.name, len(tasks), job.device, out)
    results: dict[str, TaskResult] = {}
    with _Stop() as stop:
        with Steps(len(tasks), "metrics", job.name, wanted(progress)) as steps:
            sink = Progress(n_tasks=len(tasks), steps=steps, results=results)
            todo = []
            for task in tasks:
                done = read_result(out, task.key)
                if done is not None and done.ok:
                    why = stale_reasons(done, task, out)
                    if not why:
                        journal.append("skip", task=task.key, run=run_id, reason="already done")
                        sink.skipped(done)
                        continue
                    moved = set_aside(out, task.key, done)
                    journal.append("stale", task=task.key, run=run_id, reasons=why, moved_to=moved)
                    log.warning("%s: rerunning, because %s (the old result is in %s)",
                                task.key, "; ".join(why), moved)
                    task = dataclasses.replace(task, rerun_because=tuple(why))
                todo.append(task)
            backend.run(todo, ctx, journal, stop, sink)
        # In job order (the report's); a task that never ran is pending.
        results = {t.key: results.get(t.key) or TaskResult.of(t, run_id, PENDING) for t in tasks}
        # CUDA snapshots are named as they are written (in the tasks' processes): recorded here.
        snapshots = [Path(ev["snapshot"]) for r in results.values() for ev in r.oom_events or ()
                     if isinstance(ev, dict) and isinstance(ev.get("snapshot"), str)]
        if mine := [str(p.relative_to(out)) for p in snapshots if p.is_relative_to(out)]:
            add_to_record(out, mine)
        code, status, report = _finish(job, ctx.device, run_id, results, out, journal, stop)
    log.info("job %s: %s (%s) in %.1f s; results in %s", job.name, status,
             ", ".join(f"{k} failed" for k, r in results.items() if r.status == FAILED)
             or "nothing failed", time.perf_counter() - t0, out)
    return Outcome(exit_code=code, results=results, out=str(out), seconds=time.perf_counter() - t0,
                   stopped_by=signal.Signals(stop.signum).name if stop.signum else None,
                   report=report)


def _finish(job: Job, device: dict[str, Any], run_id: str, results: dict[str, TaskResult],
            out: Path, journal: Journal, stop: _Stop) -> tuple[int, str, str | None]:
    """Write ``results.json`` and the report; a signal during the report aborts it and
    leaves ``results.json`` saying "interrupted" (a rerun finishes the report). The exit
    code, the status, and report.md's path (None where it was not written)."""
    failed = [k for k, r in results.items() if r.status == FAILED]

    def summary_of(signum: int | None) -> dict[str, Any]:
        code = EXIT_SIGNAL.get(signum, 130) if signum is not None else (
            EXIT_FAILED if failed else EXIT_OK)
        status = "interrupted" if signum is not None else ("failed" if failed else "complete")
        return {"job": {"name": job.name, "path": job.path, "device": device,
                        "dtype": job.dtype, "models": list(job.models),
                        "data": dataclasses.asdict(job.data), "budget_bytes": job.budget_bytes},
                "run": run_id, "status": status, "exit_code": code, "failed": failed,
                "signal": signal.Signals(signum).name if signum is not None else None,
                "finished": now_iso(), "tasks": {k: r.to_dict() for k, r in results.items()}}

    signum = stop.signum
    summary = summary_of(signum)
    atomic_write_json(out / "results.json", summary)
    code, report = summary["exit_code"], None
    try:
        write_job_report(summary, out, cancelled=lambda: stop.signum != signum)
        report = str(out / "report.md")
    except ReportInterrupted:
        log.warning("interrupted while writing the report; run the same command again to finish it")
    except OSError as exc:  # a full disk: the results are complete, the report is not
        log.error("could not write the report: %s: %s (results.json is complete)",
                  exc.filename or out, exc.strerror or exc)
        code = max(code, EXIT_FAILED)
    except Exception:  # noqa: BLE001 - a report problem must not lose the results
        log.exception("could not write report.md / plots (results.json is complete)")
    if stop.signum != signum:  # a signal during the report: say so
        summary = summary_of(stop.signum)
        atomic_write_json(out / "results.json", summary)
        code = summary["exit_code"]
    journal.append("job-end", run=run_id, status=summary["status"], exit_code=code, failed=failed)
    journal.close()
    return code, summary["status"], report


def format_outcome(outcome: Outcome) -> str:
    """Plain lines for the terminal: one per task, then where the results are."""
    lines = [f"{key:<28} {r.status:<11} {(r.reason or '') if r.status == FAILED else ''}".rstrip()
             for key, r in outcome.results.items()]
    lines.append(f"results: {outcome.out}/results.json, " + (
        f"report: {outcome.report}" if outcome.report
        else "report.md not written (see above)"))
    return "\n".join(lines)
