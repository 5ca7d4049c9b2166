"""``oomguard show OUT``: a job's table from its output folder, finished or not: per metric
its status (ok, failed, interrupted, not run), the sizes it ran at and where they came
from, its headline numbers (the top-level numbers of its summary) and where its result
files are.

What it reads, as :mod:`~oomguard.engine.jobs.runner` writes it: ``job.json`` (the tasks of
the last run; its absence means the folder is not a job's), ``results.json`` (written when a
run ends, interrupted or not), ``results/<task>.json`` (each as it finishes) and the journal
(every event, fsynced). A run that was killed (``kill -9``, a node lost) left no
``results.json`` of its own: the result files and the journal's events of that run say what
finished and what was running. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from oomguard.engine.errors import UsageError, size_list
from oomguard.engine.jobs.journal import replay
from oomguard.engine.jobs.records import FAILED, INTERRUPTED, OK, PENDING, TaskResult
from oomguard.engine.util.atomic import inside
from oomguard.engine.util.jsonable import json_text, read_json

NOT_RUN, RUNNING = "not run", "running"
HEADLINE_MAX = 6  # numbers per metric in the table (--json has them all)
_ENDS = {"success": OK, "failure": FAILED, "interrupted": INTERRUPTED, "start": INTERRUPTED}


def add_show(p: argparse.ArgumentParser) -> None:
    p.description = ("Print a job's table from its output folder (`oomguard run`'s --out), "
                     "finished or interrupted: per metric its status (ok, failed, interrupted, "
                     "not run), the sizes it ran at, its headline numbers and where its result "
                     "files are.")
    p.add_argument("out", metavar="OUT", help="the job's output folder")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=cmd_show)


def _read_json(path: Path, what: str) -> Any:
    """``path``'s JSON; a one-line UsageError naming it when it cannot be read (nested too
    deep included)."""
    try:
        return read_json(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read {what} ({getattr(exc, 'strerror', None) or exc}); "
                         "run the job again to rewrite it") from None


def _result(out: Path, key: str) -> TaskResult | None:
    """``results/<key>.json`` (None when absent); a UsageError when it is corrupt, or when
    ``key`` (read from the folder's job record) would make it a path outside ``out``."""
    try:
        path = inside(out, f"results/{key}.json")
    except ValueError as exc:
        raise UsageError(f"{out / 'job.json'}: {exc}; run the job again to rewrite its "
                         "record") from None
    if not path.exists():
        return None
    try:
        return TaskResult.from_dict(_read_json(path, "a metric's result"))
    except (KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not a metric's result ({exc}); run the job again to "
                         "rewrite it") from None


def job_state(out: Path) -> dict[str, Any]:
    """What ``out`` says of its job: name, status, the signal that stopped it, and per task
    (in job order) its status, sizes, headline numbers and files. UsageError (one line) for
    a folder that is not a job's output, or a corrupt results file."""
    if not out.is_dir():
        raise UsageError(f"{out}: no such folder: give the output folder of `oomguard run`")
    if not (out / "job.json").is_file():
        raise UsageError(f"{out} is not a job's output folder (no job.json): give the "
                         "output folder of `oomguard run` (its --out)")
    job = _read_json(out / "job.json", "the job's record")
    if not isinstance(job, dict) or not isinstance(job.get("tasks"), list):
        raise UsageError(f"{out / 'job.json'}: not a job's record (no task list); run the "
                         "job again to rewrite it")
    events = replay(out / "journal.jsonl")
    starts = [e for e in events if e["event"] == "job-start"]
    run = starts[-1].get("run") if starts else None
    summary = _read_json(out / "results.json", "the job's results") if (
        out / "results.json").exists() else None
    if summary is not None and not (isinstance(summary, dict)
                                    and isinstance(summary.get("tasks"), dict)):
        raise UsageError(f"{out / 'results.json'}: not a job's results (no tasks); run the "
                         "job again to rewrite it")
    # results.json speaks for the last run only if that run wrote it (one killed did not,
    # one still running has not yet).
    ended = summary is not None and (run is None or summary.get("run") == run)
    running = not ended and _running(out)
    last = {e["task"]: RUNNING if running and e["event"] == "start" else _ENDS[e["event"]]
            for e in events if e["event"] in _ENDS and e.get("run") == run and "task" in e}
    tasks = [_task(out, key, summary["tasks"].get(key) if ended else None, last.get(key))
             for key in job["tasks"]]
    status = summary.get("status") if ended else RUNNING if running else INTERRUPTED
    return {"out": str(out), "job": job.get("name"), "path": job.get("path"), "run": run,
            "status": status, "signal": summary.get("signal") if ended else None,
            "exit_code": summary.get("exit_code") if ended else None,
            "killed": not ended and not running and run is not None, "tasks": tasks,
            "files": {name: str(out / name) for name in (
                "results.json", "report.md", "journal.jsonl", "job.log") if (out / name).exists()}}


def _running(out: Path) -> bool:
    """Whether a run holds the folder's lock now (``oomguard run`` holds it throughout)."""
    from filelock import FileLock, Timeout

    if not (out / ".job.lock").exists():
        return False
    lock = FileLock(str(out / ".job.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return True
    except OSError:  # a folder this user cannot write: nobody runs there as this user
        return False
    lock.release()
    return False


def _task(out: Path, key: str, entry: dict[str, Any] | None, last: str | None) -> dict[str, Any]:
    """One task's row: from results.json's ``entry`` when the last run wrote one, else from
    its result file and the last run's journal events (``last``: how they end)."""
    record = _result(out, key)
    if entry is not None:
        status = entry.get("status")
    elif record is not None and record.ok:
        status = OK  # kept: a rerun does not run it again
    else:
        status = last or (record.status if record is not None else PENDING)
    if status == PENDING:
        status = NOT_RUN
    done = record if record is not None and status in (OK, FAILED) else None
    sizes = (done.sizes or {}) if done else {}
    files = {"result": out / "results" / f"{key}.json" if done else None,
             "tensors": out / done.tensors if done and done.tensors else None,
             "traceback": out / done.traceback if done and done.traceback else None}
    return {"task": key, "metric": done.metric if done else (entry or {}).get("metric"),
            "status": status, "sizes": sizes.get("final") or sizes.get("start"),
            "sizes_source": sizes.get("source"), "headline": headline(done.summary if done
                                                                      else None),
            "reason": done.reason if done and not done.ok else None,
            "files": {k: str(v) for k, v in files.items() if v is not None}}


def headline(summary: Any) -> dict[str, float | int]:
    """A summary's headline numbers: its top-level numbers (nested groups and the recorded
    ``params`` left to the result file)."""
    if not isinstance(summary, dict):
        return {}
    return {k: v for k, v in summary.items() if k != "params"
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _numbers(figures: dict[str, float | int]) -> str:
    shown = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
             for k, v in list(figures.items())[:HEADLINE_MAX]]
    more = len(figures) - HEADLINE_MAX
    return ", ".join(shown) + (f", ... ({more} more)" if more > 0 else "") or "-"


def render(state: dict[str, Any]) -> str:
    """The table, and what to do next when the job stopped before the end."""
    rows = [("metric", "status", "sizes", "headline numbers", "result")]
    for t in state["tasks"]:
        sizes = size_list(t["sizes"]) + (f" ({t['sizes_source']})" if t["sizes_source"] else "")
        where = t["files"].get("result", t["reason"] or "-")
        if "tensors" in t["files"]:
            where += f" (tensors: {t['files']['tensors']})"
        rows.append((t["task"], t["status"], sizes or "-", _numbers(t["headline"]), where))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"job {state['job']} ({state['path']}): {_status(state)}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4]
              for r in rows]
    for t in state["tasks"]:
        if t["status"] == FAILED and "traceback" in t["files"]:
            lines.append(f"{t['task']}: traceback in {t['files']['traceback']}")
    undone = [t["task"] for t in state["tasks"] if t["status"] in (INTERRUPTED, NOT_RUN)]
    if undone and state["status"] != RUNNING:
        lines.append(f"not done: {', '.join(undone)}: run the same `oomguard run` command "
                     f"again to finish (done metrics are kept)")
    lines += [f"{name}: {path}" for name, path in state["files"].items()]
    return "\n".join(line.rstrip() for line in lines)


def _status(state: dict[str, Any]) -> str:
    if state["killed"]:
        return "interrupted (its process was killed: no results.json for the last run)"
    signal = f" by {state['signal']}" if state["signal"] else ""
    code = f" (exit code {state['exit_code']})" if state["exit_code"] is not None else ""
    return f"{state['status']}{signal}{code}"


def cmd_show(args: argparse.Namespace) -> int:
    state = job_state(Path(args.out))
    print(json_text(state), end="") if args.json else print(render(state))
    return 0
