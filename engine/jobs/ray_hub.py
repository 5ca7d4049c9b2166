"""What the tasks of one job on Ray share: the job's outputs, and where each attempt runs.

One :class:`Hub` actor per ``oomguard run --ray``, on the driver's node (made an actor by
:class:`~oomguard.engine.jobs.ray_job.OnRay`). Every task's outputs arrive through its
:class:`~oomguard.engine.jobs.sink.HubSink` and are written as the single-process job writes
them, one at a time; workers need no shared storage. The hub also keeps where each attempt
runs (:meth:`Hub.begin`), for retries after a worker died and the driver's progress.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from oomguard.engine.errors import CacheError
from oomguard.engine.jobs.cache import SizeCache
from oomguard.engine.jobs.sink import FileSink

RUNNING, DONE, DIED = "running", "done", "died"


class Hub:
    """The job's folder ``out``, the size cache at ``cache_path`` (None: the default), and
    every attempt: number, where it runs, ``state`` (running, done, died), ``sizes`` and
    ``retries``."""

    def __init__(self, out: str | os.PathLike[str],
                 cache_path: str | os.PathLike[str] | None) -> None:
        self.sink = FileSink(out, cache_path)
        self.attempts: dict[str, list[dict[str, Any]]] = {}

    def entries(self, device: str) -> dict[str, dict[str, Any]]:
        """The usable cache entries of the device key ``device``; {} if unreadable."""
        try:
            entries = SizeCache(self.sink.cache_path).entries()
        except CacheError:  # the file cannot be read: tasks go on without it (a warning)
            return {}
        return {k: v for k, v in entries.items() if k.startswith(f"{device}|")}

    def take(self, task: str, attempt: int, op: str, args: tuple[Any, ...],
             kw: Mapping[str, Any]) -> Any:
        """One output of an attempt: the :class:`FileSink` method ``op`` applied, or a
        journal ``record`` written with the attempt's host and number."""
        if op != "record":
            return getattr(self.sink, op)(*args, **kw)
        a = self.attempts[task][attempt - 1]
        record = {**args[0], "host": a["host"], "attempt": attempt}
        if record["event"] in ("sizes", "retry") and record.get("sizes"):
            a["sizes"] = dict(record["sizes"])
            a["retries"] += record["event"] == "retry"
        self.sink.journal.copy(record)

    def begin(self, task: str, where: Mapping[str, Any]) -> dict[str, Any]:
        """A new attempt of ``task`` at ``where``; returns its number and the previous one
        (None for the first), marked died if still running (it ended without a word)."""
        attempts = self.attempts.setdefault(task, [])
        previous = attempts[-1] if attempts else None
        if previous is not None and previous["state"] == RUNNING:
            previous.update(state=DIED, ended=time.time())
        attempts.append({**where, "attempt": len(attempts) + 1, "state": RUNNING,
                         "sizes": None, "retries": 0, "started": time.time()})
        return {"attempt": len(attempts), "previous": dict(previous) if previous else None}

    def end(self, task: str, attempt: int) -> None:
        """The attempt returned (its result, whatever it says, is written)."""
        self.attempts[task][attempt - 1].update(state=DONE, ended=time.time())

    def status(self) -> dict[str, list[dict[str, Any]]]:
        """Every task's attempts, oldest first."""
        return self.attempts
