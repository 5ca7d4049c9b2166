"""The size cache: sizes that worked, per device and workload, shared by jobs.

One JSON file (default ``user_cache_dir("oomguard")/sizes.json``)::

    {"version": 1,
     "entries": {"<device key>|<workload hash>": {
         "device": {"name": ..., "total_bytes": ..., "budget_bytes": ...},
         "workload": {"model_config": ..., "dtype": ..., "seq_len": ..., "metric": ...,
                      "params": {...}},
         "sizes": {"micro_batch_size": 8}, "source": "search", "max_ok": 12,
         "updated": "...Z", "history": [...]}}}

The key is the device (name, total memory in bytes, and the job's budget if
any: a budget is a smaller device) and a hash of the workload fingerprint
(model config hash, dtype, sequence length, metric and its result-defining
parameters). Every read-modify-write holds a :class:`filelock.FileLock` on
``<file>.lock`` and ends with an atomic replace, so two jobs can share one
cache and the file is valid JSON at every moment. A file that is not a valid
cache is moved aside to ``<file>.corrupt-<timestamp>`` with a warning, and the
cache starts empty: a bad cache never stops a job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from platformdirs import user_cache_dir

from oomguard.engine.core.atomic import atomic_write_json
from oomguard.engine.core.jsonable import stable_hash
from oomguard.engine.errors import CacheError
from oomguard.engine.jobs.records import now_iso

log = logging.getLogger("oomguard.cache")

VERSION = 1
LOCK_TIMEOUT_S = 60.0
_HISTORY = 20  # changes kept per entry


def default_cache_path() -> Path:
    """``$OOMGUARD_CACHE`` if set, else ``sizes.json`` in the user's cache folder."""
    env = os.environ.get("OOMGUARD_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(user_cache_dir("oomguard")) / "sizes.json"


def device_key(device: Mapping[str, Any]) -> str:
    """``"<name>/<total bytes>[/budget=<bytes>]"``: what makes two devices the same."""
    key = f"{device.get('name') or device.get('device', '?')}/{device.get('total_bytes')}"
    if device.get("budget_bytes"):
        key += f"/budget={device['budget_bytes']}"
    return key


def workload_hash(workload: Mapping[str, Any]) -> str:
    """A short, stable hash of a workload fingerprint dict (:func:`records.stable_hash`)."""
    return stable_hash(workload)


def entry_key(device: Mapping[str, Any], workload: Mapping[str, Any]) -> str:
    """The cache key of a workload on a device."""
    return f"{device_key(device)}|{workload_hash(workload)}"


def _valid(doc: Any) -> bool:
    return (isinstance(doc, dict) and isinstance(doc.get("entries"), dict)
            and all(isinstance(e, dict) and isinstance(e.get("sizes"), dict)
                    for e in doc["entries"].values()))


class SizeCache:
    """Sizes that worked, persisted in a JSON file shared between processes."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_cache_path()
        self.lock = FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S)
        self.moved_aside: Path | None = None

    # ------------------------------------------------------------- reading
    def _read_unlocked(self) -> dict[str, Any]:
        """The cache document; a corrupt file is moved aside (caller holds the lock)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {"version": VERSION, "entries": {}}
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        if _valid(doc):
            return doc
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        os.replace(self.path, aside)
        self.moved_aside = aside
        log.warning("size cache %s is not a valid cache file; moved it aside to %s and "
                    "started an empty cache", self.path, aside)
        return {"version": VERSION, "entries": {}}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the cache's file lock; a lock held too long or a folder that cannot be
        written is a :class:`CacheError` (one line)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.lock:
                yield
        except Timeout:
            raise CacheError(f"cannot lock the size cache {self.path} within "
                             f"{LOCK_TIMEOUT_S:g} s (held by another job?)") from None
        except OSError as exc:
            raise CacheError(f"cannot use the size cache {self.path}: {exc.strerror or exc}; "
                             "give a writable --cache PATH") from None

    def load(self) -> dict[str, Any]:
        """The whole cache document (``{"version", "entries"}``)."""
        with self._locked():
            return self._read_unlocked()

    def entries(self) -> dict[str, dict[str, Any]]:
        return self.load()["entries"]

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry under ``key`` (see :func:`entry_key`), or None."""
        return self.entries().get(key)

    # ------------------------------------------------------------- writing
    def update(self, fn: Callable[[dict[str, dict[str, Any]]], None]) -> dict[str, Any]:
        """Apply ``fn(entries)`` (mutating) under the lock and write the file atomically."""
        with self._locked():
            doc = self._read_unlocked()
            fn(doc["entries"])
            doc["version"] = VERSION
            atomic_write_json(self.path, doc)
            return doc

    def put(self, key: str, sizes: Mapping[str, int], *, source: str,
            device: Mapping[str, Any] | None = None, workload: Mapping[str, Any] | None = None,
            **extra: Any) -> None:
        """Store ``sizes`` for ``key``; ``source`` says where they came from (e.g. ``search``)."""

        def change(entries: dict[str, dict[str, Any]]) -> None:
            old = entries.get(key, {})
            history = list(old.get("history", []))
            history.append({"t": now_iso(), "sizes": dict(sizes), "source": source})
            entry = {**old, **extra, "sizes": dict(sizes), "source": source, "updated": now_iso(),
                     "history": history[-_HISTORY:]}
            if device is not None:
                entry["device"] = dict(device)
            if workload is not None:
                entry["workload"] = dict(workload)
            entries[key] = entry

        self.update(change)
        log.info("size cache: %s -> %s (%s)", key, dict(sizes), source)

    def lower(self, key: str, sizes: Mapping[str, int], *, reason: str,
              device: Mapping[str, Any] | None = None,
              workload: Mapping[str, Any] | None = None) -> None:
        """After an OOM: store ``sizes`` where each is at most the cached one.

        A concurrent job that already stored something smaller keeps its value.
        """

        def change(entries: dict[str, dict[str, Any]]) -> None:
            old = entries.get(key)
            cached = old.get("sizes", {}) if old else {}
            new = {k: min(v, cached.get(k, v)) for k, v in sizes.items()}
            if old and new == cached:
                return
            history = list(old.get("history", [])) if old else []
            history.append({"t": now_iso(), "sizes": new, "source": "lowered after OOM",
                            "reason": reason})
            entries[key] = {**(old or {}), "sizes": new, "source": "lowered after OOM",
                            "updated": now_iso(), "history": history[-_HISTORY:],
                            **({"device": dict(device)} if device is not None else {}),
                            **({"workload": dict(workload)} if workload is not None else {})}

        self.update(change)
        log.warning("size cache: lowered %s to %s (%s)", key, dict(sizes), reason)

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        count = {"n": 0}

        def change(entries: dict[str, dict[str, Any]]) -> None:
            count["n"] = len(entries)
            entries.clear()

        self.update(change)
        return count["n"]


def format_entries(entries: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of cache entries for ``oomguard cache show``."""
    rows = [("device", "metric", "model config", "dtype", "seq", "sizes", "source", "updated")]
    for key, e in sorted(entries.items()):
        w = e.get("workload", {})
        sizes = ", ".join(f"{k}={v}" for k, v in e.get("sizes", {}).items()) or "-"
        rows.append((key.split("|", 1)[0], str(w.get("metric", "?")),
                     str(w.get("model_config", "?")), str(w.get("dtype", "?")),
                     str(w.get("seq_len", "?")), sizes, str(e.get("source", "?")),
                     str(e.get("updated", "?"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)
