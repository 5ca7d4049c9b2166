"""What the tasks of one job on Ray share: the size cache, and where each attempt runs.

One :class:`Hub` actor per ``oomguard run --ray``, placed on the driver's node. Ray runs an
actor's methods one at a time, so concurrent tasks merge their sizes into the cache in
turn and none overwrites another; the file itself is the driver's size cache, written
under its file lock (:class:`~oomguard.engine.jobs.cache.SizeCache`), so other jobs that
share the file merge as before. Workers need no shared storage: they read and write
sizes through the actor.

Every attempt of a task reports itself (:meth:`Hub.begin`) and the sizes it runs at
(:meth:`Hub.running`). When a worker dies, Ray runs the task again with the same
arguments; the new attempt learns from :meth:`Hub.begin` the sizes the dead one was
running at, and lowers the cache before it picks its own (:mod:`~oomguard.engine.jobs.ray_task`).
The driver reads :meth:`Hub.status` for its progress line and journal.

This module does not import Ray: :func:`~oomguard.engine.jobs.ray_job.OnRay` makes the
class an actor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from oomguard.engine.errors import CacheError
from oomguard.engine.jobs.cache import SizeCache

RUNNING, DONE, DIED = "running", "done", "died"


class Hub:
    """The size cache at ``cache_path`` (None: the user's default) and every attempt's state.

    An attempt is a dict: ``attempt`` (1, 2, ...), ``host``, ``pid``, ``node``,
    ``device`` (its identity), ``state`` (running, done, died), ``sizes`` (the sizes it
    runs at, once chosen), ``cache_key``, ``retries`` (OOM retries inside the task).
    """

    def __init__(self, cache_path: str | os.PathLike[str] | None) -> None:
        self.cache = SizeCache(cache_path)
        self.attempts: dict[str, list[dict[str, Any]]] = {}

    # ------------------------------------------------------------ the size cache
    def entries(self, device: str | None = None) -> dict[str, dict[str, Any]]:
        """The usable cache entries by key (:meth:`SizeCache.entries`), only ``device``'s if
        given (a :func:`~oomguard.engine.jobs.cache.device_key`); {} if unreadable."""
        try:
            entries = self.cache.entries()
        except CacheError:  # the file cannot be read: tasks go on without it (a warning)
            return {}
        return {k: v for k, v in entries.items()
                if device is None or k.startswith(f"{device}|")}

    def apply(self, changes: list[Mapping[str, Any]]) -> int:
        """Merge a task's cache changes, in order; returns how many were written.

        Each change is ``{"op": "put" | "lower", "key", "sizes", ...}`` with the keyword
        arguments of :meth:`SizeCache.put` (``source``, ``device``, ``workload``, extras)
        or :meth:`SizeCache.lower` (``reason``, ``device``, ``workload``). ``lower`` keeps
        a smaller size another task stored meanwhile.
        """
        written = 0
        for change in changes:
            kw = {k: v for k, v in change.items() if k not in ("op", "key", "sizes")}
            write = self.cache.lower if change["op"] == "lower" else self.cache.put
            written += bool(write(change["key"], change["sizes"], **kw))
        return written

    # ------------------------------------------------------------ attempts
    def begin(self, task: str, where: Mapping[str, Any]) -> dict[str, Any]:
        """A new attempt of ``task`` at ``where`` (host, pid, node, device); returns its
        number and the previous attempt (None for the first). A previous attempt still
        marked running ended without a word: its worker died."""
        attempts = self.attempts.setdefault(task, [])
        previous = attempts[-1] if attempts else None
        if previous is not None and previous["state"] == RUNNING:
            previous.update(state=DIED, ended=time.time())
        attempts.append({**where, "attempt": len(attempts) + 1, "state": RUNNING,
                         "sizes": None, "cache_key": None, "retries": 0,
                         "started": time.time()})
        return {"attempt": len(attempts), "previous": dict(previous) if previous else None}

    def running(self, task: str, attempt: int, sizes: Mapping[str, int],
                cache_key: str | None, retry: bool = False) -> None:
        """The attempt runs at ``sizes`` now (chosen, or lowered by an OOM retry)."""
        a = self.attempts[task][attempt - 1]
        a.update(sizes=dict(sizes), cache_key=cache_key)
        a["retries"] += int(retry)

    def end(self, task: str, attempt: int) -> None:
        """The attempt returned (its result, whatever it says, is on its way)."""
        self.attempts[task][attempt - 1].update(state=DONE, ended=time.time())

    def status(self) -> dict[str, list[dict[str, Any]]]:
        """Every task's attempts, oldest first."""
        return self.attempts
