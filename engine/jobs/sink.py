"""Where a task's outputs go: its journal events, its size-cache puts and lowers, its files.

A task (:func:`~oomguard.engine.jobs.task_process.run_task` and the process it starts,
:func:`~oomguard.engine.jobs.child.child_main`) hands every output to one sink and opens
none of the job's files itself, so the same task code runs in one process and on Ray:

- :class:`FileSink`, in one process: each output written where it belongs, the journal
  (:class:`~oomguard.engine.jobs.journal.Journal`), the size cache
  (:class:`~oomguard.engine.jobs.cache.SizeCache`), a file of the job's folder (atomic).
  It is picklable, and every process that holds it writes directly.
- :class:`HubSink`, on a Ray worker: each output goes, in order, to the job's
  :class:`~oomguard.engine.jobs.ray_hub.Hub` actor on the driver's node, which applies it
  to its own :class:`FileSink`. The hub sees the sizes an attempt runs at as they are
  chosen (its ``sizes`` and ``retry`` events), so the retry of a worker that died knows
  them.

Why a pipe: the task runs in a child process of the Ray worker, and only a process that
joined Ray can call an actor (the child would have to join the cluster as a driver of its
own: seconds, and a connection per process). So the :class:`HubSink` the child inherits
sends each output over a ``multiprocessing`` pipe, and a thread of the worker forwards
them to the hub (:func:`forward`; Ray runs one caller's actor calls in the order they
were made). The worker's own outputs (the task's ``start``, a failure it records) take the
same pipe, so the hub gets them all in the order they happened; the child and the worker
never write at the same time (the worker writes before a child starts or after it ended).
A send is done once it returns, so a child that dies right after loses nothing it sent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oomguard.engine.jobs.cache import SizeCache
from oomguard.engine.jobs.journal import Journal, stamp
from oomguard.engine.util.atomic import atomic_write

__all__ = ["FileSink", "HubSink", "Sink", "forward"]

log = logging.getLogger("oomguard.job")


class Sink:
    """Where a task's outputs go; :class:`FileSink` and :class:`HubSink` say how."""

    def event(self, event: str, **fields: Any) -> None:
        """Journal one event, stamped with this moment and this process's id."""
        self.record(stamp(event, **fields))

    def record(self, record: dict[str, Any]) -> None:
        """Journal ``record`` (an event :meth:`event` stamped) as it is."""
        raise NotImplementedError

    def put(self, key: str, sizes: Mapping[str, int], **kw: Any) -> Any:
        """Store sizes in the cache (:meth:`~oomguard.engine.jobs.cache.SizeCache.put`)."""
        raise NotImplementedError

    def lower(self, key: str, sizes: Mapping[str, int], **kw: Any) -> Any:
        """Lower cached sizes (:meth:`~oomguard.engine.jobs.cache.SizeCache.lower`)."""
        raise NotImplementedError

    def cached(self, key: str) -> dict[str, Any] | None:
        """The cache entry under ``key`` (:meth:`~oomguard.engine.jobs.cache.SizeCache.get`)."""
        raise NotImplementedError

    def write(self, rel: str, data: bytes | str, append: bool = False) -> None:
        """Write the file ``rel`` of the job's folder: replaced atomically, or appended to."""
        raise NotImplementedError


def _write(out: Path, rel: str, data: bytes | str, append: bool) -> None:
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if not append:
        atomic_write(path, data)
        return
    with path.open("ab") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)


class FileSink(Sink):
    """The job's folder ``out`` (its journal and files) and the size cache at
    ``cache_path`` (None: the user's default), written by whichever process holds it."""

    def __init__(self, out: str | os.PathLike[str],
                 cache_path: str | os.PathLike[str] | None = None) -> None:
        self.out, self.cache_path = Path(out), cache_path
        self.journal = Journal(self.out / "journal.jsonl")

    def record(self, record: dict[str, Any]) -> None:
        self.journal.copy(record)

    def put(self, key: str, sizes: Mapping[str, int], **kw: Any) -> bool:
        return SizeCache(self.cache_path).put(key, sizes, **kw)

    def lower(self, key: str, sizes: Mapping[str, int], **kw: Any) -> bool:
        return SizeCache(self.cache_path).lower(key, sizes, **kw)

    def cached(self, key: str) -> dict[str, Any] | None:
        return SizeCache(self.cache_path).get(key)

    def write(self, rel: str, data: bytes | str, append: bool = False) -> None:
        _write(self.out, rel, data, append)


class HubSink(Sink):
    """Outputs sent over ``conn`` (a pipe's sending end) for :func:`forward` to pass to the
    hub. ``entries``: the hub's cache entries for this worker's device, read when the
    attempt began (what :meth:`cached` answers). A file is also written into ``out``,
    the worker's own folder, where the task reads its result back."""

    def __init__(self, out: str | os.PathLike[str], entries: Mapping[str, dict[str, Any]],
                 conn: Any) -> None:
        self.out, self.entries, self.conn = Path(out), dict(entries), conn

    def send(self, op: str, *args: Any, **kw: Any) -> None:
        """Send one output: the :class:`FileSink` method ``op`` and its arguments."""
        self.conn.send((op, args, kw))

    def record(self, record: dict[str, Any]) -> None:
        self.send("record", record)

    def put(self, key: str, sizes: Mapping[str, int], **kw: Any) -> None:
        self.send("put", key, dict(sizes), **kw)

    def lower(self, key: str, sizes: Mapping[str, int], **kw: Any) -> None:
        self.send("lower", key, dict(sizes), **kw)

    def cached(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def write(self, rel: str, data: bytes | str, append: bool = False) -> None:
        _write(self.out, rel, data, append)
        self.send("write", rel, data, append)


def forward(receive: Any, hub: Any, task: str, attempt: int) -> list[Any]:
    """Pass what the pipe's receiving end gets to ``hub.take``, in order, until a None;
    returns the calls' object refs (:func:`ray.get` them to know every output applied).

    A stream cut by a process killed halfway through a send (its time limit) ends it too,
    with a warning: what came after is lost, never misread."""
    refs = []
    try:
        for op, args, kw in iter(receive.recv, None):
            refs.append(hub.take.remote(task, attempt, op, args, kw))
    except Exception as exc:  # noqa: BLE001 - unpickling a torn message raises anything
        log.warning("%s: outputs after a torn message were lost: %s", task, exc)
    return refs
