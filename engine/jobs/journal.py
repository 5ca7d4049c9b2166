"""The job journal: an append-only, fsynced JSON-lines record of every event.

One event per line, each one ``os.write`` with ``O_APPEND`` then ``os.fsync``: several
processes may append, and a line torn by a ``kill -9`` is skipped by :func:`replay`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from oomguard.engine.jobs.records import now_iso
from oomguard.engine.util.jsonable import json_text, parse_json

__all__ = ["Journal", "now_iso", "replay", "stamp"]

log = logging.getLogger("oomguard.journal")


class Journal:
    """``Journal(path).append("start", task="loss")`` writes ``{"t": "...Z", "pid": 1234,
    "event": "start", "task": "loss"}``. The descriptor is opened lazily per process, so a
    journal object may be handed to a child process."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_fd": None, "_pid": None}

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            self._pid = os.getpid()
            size = os.fstat(self._fd).st_size
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                os.write(self._fd, b"\n")  # end a line torn by a kill -9, keep ours whole
        return self._fd

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event durably and return the record written."""
        return self.copy(stamp(event, **fields))

    def copy(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write ``record`` as it is, durably: an event stamped elsewhere (a Ray worker's
        task, with its time and pid), or one :meth:`append` made."""
        fd = self._descriptor()
        os.write(fd, (json_text(record, indent=None) + "\n").encode("utf-8"))
        os.fsync(fd)
        return record

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None


def stamp(event: str, **fields: Any) -> dict[str, Any]:
    """The record of ``event`` happening now in this process: ``{"t", "pid", "event", ...}``."""
    return {"t": now_iso(), "pid": os.getpid(), "event": event, **fields}


def replay(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every well-formed event of a journal, in order ([] if it does not exist); a line
    that is not a JSON object (a torn write) is skipped with a warning."""
    p = Path(path)
    if not p.exists():
        return []
    events: list[dict[str, Any]] = []
    with p.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                record = parse_json(raw)
            except ValueError:  # not UTF-8, not JSON, or nested too deep
                record = None
            if not isinstance(record, dict) or "event" not in record:
                log.warning("%s:%d: skipping an unreadable journal line (torn write?)", p, number)
                continue
            events.append(record)
    return events
