"""One task of a job in its own process: started, watched, stopped, restarted, recorded.

:func:`run_task` is the one way a task runs, whoever asks: the job's own process
(:mod:`~oomguard.engine.jobs.runner`) or a Ray worker
(:mod:`~oomguard.engine.jobs.ray_task`). It starts the task's process
(:func:`~oomguard.engine.jobs.child.child_main`), enforces the task's time limit (SIGTERM,
then SIGKILL), starts a fresh process whenever the remedy ladder hands one over, and
records a process that died or was stopped without a result as the task's failure.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import signal
import time
from pathlib import Path
from typing import Any

from oomguard.engine.core.search.isolate import forkserver_context
from oomguard.engine.jobs.child import child_main
from oomguard.engine.jobs.output import read_result
from oomguard.engine.jobs.plan import preload_modules, received, stop_child
from oomguard.engine.jobs.records import Context, Task, TaskResult
from oomguard.engine.jobs.sink import Sink
from oomguard.engine.util.jsonable import json_text

log = logging.getLogger("oomguard.job")


def run_task(task: Task, ctx: Context, sink: Sink, stop: Any) -> TaskResult | None:
    """Run one task in a child, and in a fresh one each time its remedy ladder asks for one
    (``expandable_segments``, memory that did not come back; journal ``restart``); the
    record written, or None if the job was interrupted. The time limit covers them all.
    Every output, the child's and this function's, goes to ``sink``.

    ``stop`` is anything with a ``signum`` attribute: None while the task may go on, a
    signal number once the job must stop (the child is then stopped and None returned).
    """
    out = Path(ctx.out)
    sink.event("start", task=task.key, run=ctx.run_id, metric=task.metric, model=task.model,
               time_limit_s=task.time_limit, start_method=ctx.start_method)
    if ctx.start_method == "forkserver":
        mp = forkserver_context(preload_modules(task))
    else:
        for module in preload_modules(task):  # imported once here, inherited by every child
            try:
                importlib.import_module(module)
            except ImportError:
                pass
        mp = multiprocessing.get_context(ctx.start_method)
    t0 = time.monotonic()
    handoff: dict[str, Any] | None = None
    while True:
        receive, send = mp.Pipe(duplex=False)
        proc = mp.Process(target=child_main, args=(task, ctx, sink, handoff, send),
                          name=f"oomguard-{task.key}")
        proc.start()
        send.close()
        handoff, reason = None, None
        while proc.is_alive():
            handoff = handoff or received(receive)
            proc.join(0.2)
            if stop.signum is not None and proc.is_alive():
                stop_child(proc)
                sink.event("interrupted", task=task.key, run=ctx.run_id,
                           signal=signal.Signals(stop.signum).name,
                           seconds=round(time.monotonic() - t0, 3))
                return None
            if time.monotonic() - t0 > task.time_limit and proc.is_alive():
                stop_child(proc)
                reason = f"time limit of {task.time_limit:g} s exceeded (stopped)"
        handoff = handoff or received(receive)
        receive.close()
        if handoff is None or reason is not None or stop.signum is not None:
            break
        sink.event("restart", task=task.key, run=ctx.run_id, why=handoff["why"],
                   env=handoff["ladder"].get("env"), resume=handoff["ladder"].get("resume"),
                   remedy=handoff["ladder"]["remedies"][handoff["ladder"]["at"]])
        log.warning("%s: restarting in a fresh process: %s", task.key, handoff["why"])
    record = read_result(out, task.key)
    if record is not None and record.run == ctx.run_id and reason is None:
        return record
    if stop.signum is not None and reason is None:
        sink.event("interrupted", task=task.key, run=ctx.run_id,
                   signal=signal.Signals(stop.signum).name)
        return None
    if reason is None:
        code = proc.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        reason = f"the metric's process {how} without a result (crash?)"
    return record_failure(task, ctx, sink, reason, "No Python traceback: the child "
                          "process was stopped or died (see job.log).",
                          time.monotonic() - t0)


def record_failure(task: Task, ctx: Context, sink: Sink, reason: str, detail: str,
                   seconds: float) -> TaskResult:
    """Record a task that ended without its process writing a result: the traceback file
    (``reason`` and ``detail``), the result file, the journal's ``failure``."""
    tb = f"tracebacks/{task.key}.txt"
    sink.write(tb, f"{task.key}: {reason}\n{detail.rstrip()}\n")
    record = TaskResult.failure(task, ctx.run_id, reason, tb, seconds, device=ctx.device)
    sink.write(f"results/{task.key}.json", json_text(record))
    sink.event("failure", task=task.key, run=ctx.run_id, reason=reason,
               traceback=record.traceback)
    return record
