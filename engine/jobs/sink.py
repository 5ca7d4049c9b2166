"""Where a task's outputs go: its journal events, its size-cache puts and lowers, its files.

A task hands every output to one sink (``event``, ``put``, ``lower``, ``write``; ``get`` reads
the cache). :class:`FileSink` writes them directly (picklable); :class:`HubSink`, on Ray,
sends them in order to the job's :class:`~oomguard.engine.jobs.ray_hub.Hub` actor.

Why a pipe: only a process that joined Ray can call an actor, and the task runs in a child
of the Ray worker: the child's :class:`HubSink` sends each output over an inherited pipe and
a worker thread passes them on in order (:func:`forward`); a child that dies next loses
nothing it sent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oomguard.engine.jobs.cache import SizeCache
from oomguard.engine.jobs.journal import Journal, stamp
from oomguard.engine.util.atomic import atomic_write, inside

__all__ = ["FileSink", "HubSink", "Sink", "forward"]

log = logging.getLogger("oomguard.job")


class FileSink:
    """The job's folder ``out`` (its journal and files) and the size cache at
    ``cache_path`` (None: the user's default)."""

    def __init__(self, out: str | os.PathLike[str],
                 cache_path: str | os.PathLike[str] | None = None) -> None:
        self.out, self.cache_path = Path(out), cache_path
        self.journal = Journal(self.out / "journal.jsonl")

    def event(self, event: str, **fields: Any) -> None:
        """Journal one event, stamped with this moment and this process's id."""
        self.journal.append(event, **fields)

    def put(self, key: str, sizes: Mapping[str, int], **kw: Any) -> bool:
        return SizeCache(self.cache_path).put(key, sizes, **kw)

    def lower(self, key: str, sizes: Mapping[str, int], **kw: Any) -> bool:
        return SizeCache(self.cache_path).lower(key, sizes, **kw)

    def get(self, key: str) -> dict[str, Any] | None:
        return SizeCache(self.cache_path).get(key)

    def write(self, rel: str, data: bytes | str, append: bool = False) -> None:
        """The file ``rel`` of the job's folder (``/``-separated, each part a plain name:
        ValueError otherwise): replaced atomically, or appended to."""
        path = inside(self.out, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            atomic_write(path, data)
            return
        with path.open("ab") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)


class HubSink(FileSink):
    """Outputs sent over ``conn`` (a pipe's sending end) for :func:`forward`; files also
    written into ``out``, the worker's folder, where the task reads its result back.
    :meth:`get` answers from ``entries``, the hub's when the attempt began."""

    def __init__(self, out: str | os.PathLike[str], entries: Mapping[str, dict[str, Any]],
                 conn: Any) -> None:
        super().__init__(out)
        self.entries, self.conn = dict(entries), conn

    def send(self, op: str, *args: Any, **kw: Any) -> None:
        """Send one output: the :class:`FileSink` method ``op`` and its arguments."""
        self.conn.send((op, args, kw))

    def event(self, event: str, **fields: Any) -> None:
        self.send("record", stamp(event, **fields))  # stamped here, in the task's process

    def put(self, key: str, sizes: Mapping[str, int], **kw: Any) -> None:
        self.send("put", key, dict(sizes), **kw)

    def lower(self, key: str, sizes: Mapping[str, int], **kw: Any) -> None:
        self.send("lower", key, dict(sizes), **kw)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def write(self, rel: str, data: bytes | str, append: bool = False) -> None:
        super().write(rel, data, append)
        self.send("write", rel, data, append)


Sink = FileSink  # a HubSink is one whose outputs go to the hub


def forward(receive: Any, hub: Any, task: str, attempt: int) -> list[Any]:
    """Pass what the pipe's receiving end gets to ``hub.take``, in order, until a None; returns the
    calls' object refs. A process killed halfway through a send tears a message, and what follows is
    lost: a warning here, or a read the worker stops waiting for."""
    refs = []
    while True:
        try:
            message = receive.recv()
        except Exception as exc:  # noqa: BLE001 - unpickling a torn message raises anything
            log.warning("%s: outputs after a torn message were lost: %s", task, exc)
            return refs
        if message is None:
            return refs
        refs.append(hub.take.remote(task, attempt, *message))
