"""The size cache: sizes that worked, per device and workload, shared by jobs.

One JSON file (default ``user_cache_dir("oomguard")/sizes.json``)::

    {"version": 1,
     "entries": {"<device key>|<workload hash>": {
         "device": {"name": ..., "total_bytes": ..., "budget_bytes": ...},
         "workload": {"model_config": ..., "dtype": ..., "seq_len": ..., "metric": ...,
                      "params": {...}},
         "sizes": {"micro_batch_size": 8}, "source": "search", "max_ok": 12,
         "trials": 5, "capped": {}, "finished": true, "search": [...],
         "updated": "...Z", "history": [...]}}}

``search`` holds each knob's search record (:class:`~oomguard.engine.core.search.record.SearchRecord`);
``capped`` the knobs whose answer reached a bound other than memory, with that bound: a request
allowing more searches again (:mod:`~oomguard.engine.jobs.sizing`); ``finished`` false where a
bound on the search's effort (:data:`UNFINISHED`) cut it short: no request takes its sizes. The key (:func:`entry_key`) is
the device (:func:`device_key`: a budget is a smaller device) and a hash of the workload (model
config hash, dtype, sequence length, metric and its result-defining parameters).

Writing holds a :class:`filelock.FileLock` on ``<file>.lock`` and ends with one atomic replace;
reading takes no lock and changes nothing on disk (a read-only cache can be shown).

The cache only saves time; it never costs a result: an unreadable cache warns once and answers
None; an unwritable one (or a lock held past ``LOCK_TIMEOUT_S``) warns and ``put``/``lower``
return False; an invalid file (not JSON, or nested deeper than
:data:`~oomguard.engine.util.jsonable.MAX_JSON_DEPTH` levels) is ignored and moved aside to ``<file>.corrupt-<timestamp>`` by the
next write; an entry whose sizes are not all positive integers is treated as absent, with a
warning. Only ``oomguard cache show`` and ``cache clear`` report an unusable cache as an error
(:class:`CacheError`, exit code 2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from platformdirs import user_cache_dir

from oomguard.engine.errors import CacheError, UsageError, check_positive_int, size_list
from oomguard.engine.jobs.records import now_iso
from oomguard.engine.util.atomic import atomic_write_json, unused_path
from oomguard.engine.util.jsonable import parse_json, stable_hash
from oomguard.engine.util.table import text_table

log = logging.getLogger("oomguard.cache")

VERSION = 1
LOCK_TIMEOUT_S = 60.0
_HISTORY = 20  # changes kept per entry
# What cuts a search short without answering it: bounds on its effort, not on the size; an
# entry whose search one of them ended says so (``"finished": false``) and answers nothing.
UNFINISHED = ("max_trials", "max_seconds")


def default_cache_path() -> Path:
    """``$OOMGUARD_CACHE`` if set, else ``sizes.json`` in the user's cache folder."""
    env = os.environ.get("OOMGUARD_CACHE")
    return Path(env).expanduser() if env else Path(user_cache_dir("oomguard")) / "sizes.json"


def device_key(device: Mapping[str, Any]) -> str:
    """``"<name>/<total bytes>[/mig=..][/driver=..][/torch=..][/budget=<bytes>]"``: what
    makes two devices the same for sizes (not the host, not the GPU's UUID)."""
    key = f"{device.get('name') or device.get('device', '?')}/{device.get('total_bytes')}"
    for part in ("mig_profile", "driver", "torch", "budget_bytes"):
        if device.get(part):
            key += f"/{part.split('_')[0]}={device[part]}"
    return key


def workload_hash(workload: Mapping[str, Any]) -> str:
    """A short, stable hash of a workload fingerprint dict (:func:`stable_hash`)."""
    return stable_hash(workload)


def entry_key(device: Mapping[str, Any], workload: Mapping[str, Any]) -> str:
    return f"{device_key(device)}|{workload_hash(workload)}"


def finished(entry: Mapping[str, Any]) -> bool:
    """Whether an entry's search finished, i.e. was not cut short by :data:`UNFINISHED`: its
    ``finished`` field, else (an entry written before the field) none of its ``search``
    records says it was (an entry with no records counts as finished)."""
    if "finished" in entry:
        return entry["finished"] is True
    return not any(isinstance(doc, Mapping) and doc.get("capped_by") in UNFINISHED
                   for doc in entry.get("search") or [])


def _entry_problem(entry: Any) -> str | None:
    """Why a cache entry cannot be used, or None: ``sizes`` must be an object of positive
    integers (``true`` is not a size)."""
    if not isinstance(entry, dict):
        return f"the entry is {entry!r}, not an object"
    sizes = entry.get("sizes")
    if not isinstance(sizes, dict):
        return f"sizes = {sizes!r} is not an object"
    for name, value in sizes.items():
        try:
            check_positive_int(name, value)  # the one check of every size
        except UsageError as exc:
            return str(exc)
    return None


def _empty() -> dict[str, Any]:
    return {"version": VERSION, "entries": {}}


def _changed(old: Mapping[str, Any], sizes: dict[str, int], source: str,
             device: Mapping[str, Any] | None, workload: Mapping[str, Any] | None,
             **why: Any) -> dict[str, Any]:
    """Entry ``old`` holding ``sizes`` from ``source`` now, the change added to its history
    (``why``: the change's own fields), the device and workload stored where given."""
    history = [*old.get("history", []), {"t": now_iso(), "sizes": sizes, "source": source,
                                          **why}]
    entry = {**old, "sizes": sizes, "source": source, "updated": now_iso(),
             "history": history[-_HISTORY:]}
    entry.update({k: dict(v) for k, v in (("device", device), ("workload", workload))
                  if v is not None})
    return entry


class SizeCache:
    """Sizes that worked, persisted in a JSON file shared between processes (the module
    docstring says how reads and writes go)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_cache_path()
        self.lock = FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S)

    # ------------------------------------------------------------- reading
    def _parse(self) -> tuple[dict[str, Any] | None, str]:
        """``(the raw document, "")`` (empty if there is no file), or ``(None, why)`` if the
        file is not a valid cache. An :class:`OSError` (no permission, a folder) propagates."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return _empty(), ""
        try:
            doc = parse_json(raw)  # refuses text not UTF-8, not JSON, or nested too deep
        except ValueError as exc:
            return None, str(exc)
        # The file's shape: an object with an ``entries`` object (each entry is checked alone).
        if isinstance(doc, dict) and isinstance(doc.get("entries"), dict):
            return doc, ""
        return None, "no \"entries\" object"

    def _usable(self, entries: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The entries whose sizes can be used; each other one is named in a warning."""
        good = {}
        for key, entry in entries.items():
            if (problem := _entry_problem(entry)) is None:
                good[key] = entry
            else:
                log.warning("size cache %s: entry %s ignored: %s", self.path, key, problem)
        return good

    def load(self) -> dict[str, Any]:
        """The cache document (``{"version", "entries"}``) with only the usable entries;
        :class:`CacheError` if the file exists but cannot be read (corrupt or another program's)."""
        try:
            doc, why = self._parse()
        except OSError as exc:
            raise CacheError(f"cannot read the size cache {self.path}: "
                             f"{exc.strerror or exc}; give a cache file you can read "
                             "(--cache PATH)") from None
        if doc is None:
            log.warning("size cache %s is not a valid cache file (%s); ignored it: `oomguard "
                        "cache clear` moves it aside (so does the next write)", self.path, why)
            return _empty()
        return {**doc, "entries": self._usable(doc["entries"])}

    def entries(self) -> dict[str, dict[str, Any]]:
        """Every usable entry by key (see :meth:`load`)."""
        return self.load()["entries"]

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry under ``key`` (:func:`entry_key`), or None where it has none."""
        try:
            doc, why = self._parse()
        except OSError as exc:
            log.warning("cannot read the size cache %s: %s; going on without it", self.path,
                        exc.strerror or exc)
            return None
        if doc is None:
            log.warning("size cache %s is not a valid cache file (%s); going on without it "
                        "(the next write moves it aside)", self.path, why)
            return None
        return self._usable({key: doc["entries"][key]}).get(key) if key in doc["entries"] else None

    # ------------------------------------------------------------- writing
    def _read_for_writing(self) -> dict[str, Any]:
        """The raw document; a file that is not a valid cache is moved aside (caller holds
        the lock)."""
        doc, why = self._parse()
        if doc is not None:
            return doc
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = unused_path(self.path.with_name(f"{self.path.name}.corrupt-{stamp}"))
        os.replace(self.path, aside)
        log.warning("size cache %s is not a valid cache file (%s); moved it aside to %s and "
                    "started an empty cache", self.path, why, aside)
        return _empty()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the cache's file lock (creating the folder); a lock held too long or a file
        or folder that cannot be written is a :class:`CacheError` (one line)."""
        try:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except FileExistsError:  # mkdir's words ("File exists") would not say which
                raise CacheError(f"cannot write the size cache {self.path}: "
                                 f"{self.path.parent} is not a folder; give a writable "
                                 "--cache PATH") from None
            with self.lock:
                yield
        except Timeout:
            raise CacheError(f"cannot lock the size cache {self.path} within "
                             f"{LOCK_TIMEOUT_S:g} s (held by another job?); wait for "
                             "it to end, or give another --cache") from None
        except OSError as exc:
            raise CacheError(f"cannot write the size cache {self.path}: "
                             f"{exc.strerror or exc}; give a writable --cache PATH") from None

    def update(self, fn: Callable[[dict[str, dict[str, Any]]], None]) -> dict[str, Any]:
        """Apply ``fn(entries)`` (mutating the usable entries) under the lock and write the
        file atomically; unusable entries are dropped. Raises :class:`CacheError` if the
        cache cannot be written."""
        with self._locked():
            doc = self._read_for_writing()
            doc["entries"] = self._usable(doc["entries"])
            fn(doc["entries"])
            doc["version"] = VERSION
            atomic_write_json(self.path, doc)
            return doc

    def _update_or_warn(self, fn: Callable[[dict[str, dict[str, Any]]], None],
                        say: Callable[..., None], *message: Any) -> bool:
        """:meth:`update`, then ``say(*message)``; a cache that cannot be written is a
        warning instead (False): it costs the cache's speed-up, never the result."""
        try:
            self.update(fn)
        except CacheError as exc:
            log.warning("%s (sizes not cached; the run goes on)", exc)
            return False
        say(*message)
        return True

    def put(self, key: str, sizes: Mapping[str, int], *, source: str,
            device: Mapping[str, Any] | None = None, workload: Mapping[str, Any] | None = None,
            **extra: Any) -> bool:
        """Store ``sizes`` for ``key`` from ``source`` (e.g. ``search``); False if not written."""

        def change(entries: dict[str, dict[str, Any]]) -> None:
            entries[key] = _changed({**entries.get(key, {}), **extra}, dict(sizes), source,
                                    device, workload)

        return self._update_or_warn(change, log.info, "size cache: %s -> %s (%s)", key,
                                    dict(sizes), source)

    def lower(self, key: str, sizes: Mapping[str, int], *, reason: str,
              device: Mapping[str, Any] | None = None, workload: Mapping[str, Any] | None = None,
              source: str = "lowered after OOM") -> bool:
        """After an OOM: store ``sizes`` where each is at most the cached one (a concurrent
        job's smaller value stays); ``source`` labels why (a Ray worker that died is not an
        OOM). False, with a warning, if the cache cannot be written."""

        def change(entries: dict[str, dict[str, Any]]) -> None:
            old = entries.get(key)
            cached = old.get("sizes", {}) if old else {}
            new = {k: min(v, cached.get(k, v)) for k, v in sizes.items()}
            if not old or new != cached:
                entries[key] = _changed(old or {}, new, source, device, workload, reason=reason)

        return self._update_or_warn(change, log.warning, "size cache: lowered %s to %s (%s)",
                                    key, dict(sizes), reason)

    def clear(self) -> int:
        """Remove every entry, usable or not; returns how many there were. Raises
        :class:`CacheError` if the cache cannot be written."""
        with contextlib.suppress(OSError):  # a folder it may not search: the write below says so
            if not self.path.exists():  # nothing to clear: create no folder and no lock file
                return 0
        with self._locked():
            doc = self._read_for_writing()
            atomic_write_json(self.path, _empty())
            return len(doc["entries"])


def format_entries(entries: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of cache entries for ``oomguard cache show``."""
    rows = [("device", "metric", "model config", "dtype", "seq", "sizes", "source", "updated")]
    for key, e in sorted(entries.items()):
        w = e.get("workload", {})
        rows.append((key.split("|", 1)[0],
                     *(str(w.get(k, "?")) for k in ("metric", "model_config", "dtype", "seq_len")),
                     size_list(e.get("sizes")) or "-",
                     str(e.get("source", "?")) + ("" if finished(e) else " (unfinished)"),
                     str(e.get("updated", "?"))))
    return text_table(rows)
