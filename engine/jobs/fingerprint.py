"""What defines a task's result, and how to say what changed.

A finished result is kept on resume only while every input that defines it is
unchanged. Those inputs (:func:`task_inputs`) are:

- the **model**: its config hash and, for a local checkpoint folder, the SHA-256 of its
  config and weight files;
- the **data**: the job's data section and, for a file source, the file's SHA-256;
- the dtype, the seed, the device, the metric and its result-defining parameters, the
  content of ``.py`` plugins and of the user's modules they import
  (:func:`~oomguard.engine.jobs.plugins.user_code`), and oomguard's version.

Memory knobs and the budget are not inputs (results do not depend on them beyond rounding).
Content digests are memoised by (size, mtime in ns) in a :class:`Digests` file in the output
folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oomguard.engine.jobs.plugins import user_code
from oomguard.engine.jobs.records import Job, MetricSpec
from oomguard.engine.util.atomic import atomic_write_json
from oomguard.engine.util.jsonable import read_json
from oomguard.metrics.models import config_fingerprint
from oomguard.reports.json_report import oomguard_version

log = logging.getLogger("oomguard.job")

__all__ = ["Digests", "WEIGHT_SUFFIXES", "describe_changes", "task_inputs"]

# Files of a checkpoint folder that define the model's outputs. Trainer folders
# also hold optimizer, scheduler and RNG states: they do not change the model.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_WEIGHTS = ("optimizer", "scheduler", "rng_state", "training_args", "trainer_state")
_CHUNK = 1 << 20


class Digests:
    """SHA-256 of files, memoised by (size, mtime_ns) in a JSON file (or only in memory);
    :meth:`save` writes the memo back (a memo that cannot be written costs a warning and
    the speed-up, never a result)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.memo: dict[str, dict[str, Any]] = {}
        self.changed = False
        if self.path is not None:  # absent or unreadable: start empty, files are hashed again
            with contextlib.suppress(OSError, ValueError, AttributeError):  # (not an object)
                doc = read_json(self.path)
                self.memo = {k: v for k, v in doc.items() if isinstance(v, dict)}

    def of(self, file: str | os.PathLike[str]) -> str:
        """The SHA-256 (hex) of ``file``'s content; reads it only if size or mtime changed."""
        key = str(Path(file).resolve())
        st = os.stat(key)
        seen = self.memo.get(key)
        if seen and seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns:
            return str(seen["sha256"])
        h = hashlib.sha256()
        with open(key, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        self.memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        self.changed = True
        return digest

    def save(self) -> None:
        if self.path is None or not self.changed:
            return
        try:
            atomic_write_json(self.path, self.memo)
            self.changed = False
        except OSError as exc:
            log.warning("could not save file digests to %s (%s): files will be hashed again "
                        "next run", self.path, exc.strerror or exc)


def model_inputs(spec: str, digests: Digests) -> dict[str, Any]:
    """The model's part of a result's inputs: config hash, and checkpoint file digests."""
    out: dict[str, Any] = {"spec": spec, "config": config_fingerprint(spec)}
    folder = Path(spec).expanduser()
    if folder.is_dir():
        out["files"] = {
            p.name: digests.of(p) for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith((".", *_NOT_WEIGHTS))
            and (p.name == "config.json" or p.name.endswith((*WEIGHT_SUFFIXES, ".index.json")))}
    return out


def task_inputs(job: Job, model: Mapping[str, Any], metric: MetricSpec,
                digests: Digests) -> dict[str, Any]:
    """Everything that defines the result of ``metric`` on ``model`` (from
    :func:`model_inputs`); the task's fingerprint is the hash of this dict."""
    data: dict[str, Any] = dataclasses.asdict(job.data)
    if job.data.path is not None:
        data["sha256"] = digests.of(job.data.path)
    plugins = {p: (digests.of(p) if p.endswith(".py") else "module") for p in job.plugins}
    plugins.update({file: digests.of(file) for file in user_code(job.plugins)})
    return {"model": dict(model), "data": data, "dtype": job.dtype, "seed": job.seed,
            "device": job.device, "metric": metric.name, "params": dict(metric.params),
            "plugins": plugins, "oomguard": oomguard_version()}


_LABELS = {"model": "the model", "data": "the data", "dtype": "the dtype", "seed": "the seed",
           "device": "the device", "metric": "the metric", "params": "the metric's parameters",
           "plugins": "a plugin", "oomguard": "oomguard's version"}


def _differ(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The keys whose values differ between ``old`` and ``new`` (either may lack one)."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _what(part: str, old: Any, new: Any) -> str:
    label = _LABELS.get(part, part)
    if part == "model" and isinstance(old, dict) and isinstance(new, dict):
        if files := _differ(old.get("files", {}), new.get("files", {})):
            return f"the checkpoint's files changed ({', '.join(files)})"
        if old.get("config") != new.get("config"):
            return "the model's config changed"
    if part == "data" and isinstance(old, dict) and isinstance(new, dict):
        if old.get("path") == new.get("path") and old.get("sha256") != new.get("sha256"):
            return f"the data file's content changed ({new.get('path')})"
        return f"the data changed ({', '.join(_differ(old, new))})"
    if part == "plugins" and isinstance(old, dict) and isinstance(new, dict):
        return (f"a plugin or a module it imports changed "
                f"({', '.join(Path(n).name for n in _differ(old, new))})")
    if isinstance(old, (dict, list)) or isinstance(new, (dict, list)):
        return f"{label} changed"
    return f"{label} changed ({old} -> {new})"


def describe_changes(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """Why a result with inputs ``old`` (None: a result without a record of its inputs) no
    longer answers ``new``: one phrase per change."""
    if not isinstance(old, Mapping):
        return ["the result has no record of its inputs (written by an older oomguard?)"]
    return [_what(part, old.get(part), new.get(part)) for part in _differ(old, new)]
