"""One task of a job in its own process: started, watched, stopped, restarted, recorded.

:func:`run_task` starts the task's process (:func:`~oomguard.engine.jobs.task_child.child_main`),
enforces its time limit, restarts it when the remedy ladder asks, and records a process that
ended without a result as a failure.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from oomguard.engine.core import child as launcher
from oomguard.engine.jobs.output import read_result
from oomguard.engine.jobs.records import Context, Task, TaskResult
from oomguard.engine.jobs.sink import Sink
from oomguard.engine.jobs.task_child import child_main, interrupted, record_failure
from oomguard.metrics.base import get_metric
from oomguard.metrics.models import model_modules

log = logging.getLogger("oomguard.job")

STOP_POLL_S = 0.2  # how often a running task's process looks whether the job must stop


def run_task(task: Task, ctx: Context, sink: Sink, stop: Any) -> TaskResult | None:
    """Run one task in a child (a fresh one each time its remedy ladder asks), within the
    time limit (its process, and what that started, stopped there; the traceback file
    shows where it was); the record written, or None once ``stop.signum`` is set. Every
    output goes to ``sink``."""
    sink.event("start", task=task.key, run=ctx.run_id, metric=task.metric, model=task.model,
               time_limit_s=task.time_limit, start_method=ctx.start_method)
    mp = launcher.context(ctx.start_method, preload_modules(task))
    t0 = time.monotonic()
    handoff: dict[str, Any] | None = None
    while True:
        with launcher.Child(mp, child_main, task, ctx, sink, handoff, launcher.ToParent(),
                            name=f"oomguard-{task.key}", stack_on_stop=True,
                            own_group=True) as child:
            child.every = STOP_POLL_S
            ended = child.wait(task.time_limit - (time.monotonic() - t0),
                               lambda _: stop.signum is not None, grace=launcher.KILL_GRACE_S)
        if ended.how == launcher.STOPPED:
            interrupted(sink.event, task, ctx, stop, seconds=round(time.monotonic() - t0, 3))
            return None
        handoff = ended.messages[-1] if ended.messages else None
        if handoff is None or ended.how == launcher.TIMED_OUT or stop.signum is not None:
            break
        sink.event("restart", task=task.key, run=ctx.run_id, why=handoff["why"],
                   env=handoff["ladder"].get("env"), resume=handoff["ladder"].get("resume"),
                   remedy=handoff["ladder"]["remedies"][handoff["ladder"]["at"]])
        log.warning("%s: restarting in a fresh process: %s", task.key, handoff["why"])
    # The last process ended: the record it wrote, or the task's failure.
    timed_out = ended.how == launcher.TIMED_OUT
    record = read_result(Path(ctx.out), task.key)
    if record is not None and record.run == ctx.run_id and not timed_out:
        return record
    if stop.signum is not None and not timed_out:
        interrupted(sink.event, task, ctx, stop)
        return None
    how = launcher.how_it_ended(ended.exitcode)
    reason = (f"time limit of {task.time_limit:g} s exceeded (stopped); if the metric needs "
              "longer, raise its time_limit in the job file, else see where it hung in its "
              "traceback file" if timed_out
              else f"the metric's process {how} without a result (crash?)")
    detail = (f"Where its process was when the time limit stopped it:\n{ended.stack}"
              if timed_out and ended.stack.strip() else
              "No Python traceback: the child process was stopped or died (see job.log).")
    return record_failure(task, ctx, sink, reason, detail, time.monotonic() - t0)


def preload_modules(task: Task) -> tuple[str, ...]:
    """Modules a task's process needs, for its parent (or forkserver) to import once."""
    mods = [*model_modules(task.model), "oomguard.metrics.models", "oomguard.metrics.base",
            "oomguard.engine.jobs.task_child", type(get_metric(task.metric)).__module__]
    return tuple(m for m in mods if not m.startswith("oomguard_plugin_"))
