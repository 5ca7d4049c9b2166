"""The typed records of a job: what a job file says, what a task is, what a task produced.

Every module of the package imports these; this one imports only the standard library and
:class:`~oomguard.engine.util.record.Record`.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from oomguard.engine.util.record import Record

OK, FAILED, INTERRUPTED, PENDING = "ok", "failed", "interrupted", "pending"


def now_iso() -> str:
    """The current UTC time, ISO 8601 with seconds (e.g. ``2025-01-31T02:14:07Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class DataSpec:
    """Where samples come from: ``n_samples`` rows of ``seq_len`` tokens."""

    source: str = "generated"
    path: str | None = None
    seq_len: int = 32
    n_samples: int = 8


@dataclass(frozen=True)
class SearchSpec:
    """A job file's ``[search]`` table: ``enabled`` (false: sizes from the cache or defaults)
    and ``options``, any :class:`~oomguard.engine.core.search.config.SearchConfig` field by
    name as plain values; a field not given takes SearchConfig's default."""

    enabled: bool = True
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def max_size(self) -> int:
        """The largest size a search may try: the job file's, else SearchConfig's default."""
        from oomguard.engine.core.search.config import SearchConfig

        return int(self.options.get("max_size", SearchConfig.max_size))


@dataclass(frozen=True)
class MetricSpec:
    """One metric of a job: ``params`` are result-defining, ``sizes`` pinned memory knobs."""

    id: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    time_limit: float = 1200.0
    on_oom: tuple[str, ...] | None = None  # None: the job's (engine/core/execute/remedies.py)
    pinned_from: str = "job file"  # where ``sizes`` came from, as results say it


@dataclass(frozen=True)
class Job:
    """A parsed, checked job file. Paths are absolute; times in seconds; budget in bytes."""

    path: str
    text: str
    name: str
    output: str
    device: str
    dtype: str
    seed: int
    models: tuple[str, ...]
    data: DataSpec
    search: SearchSpec
    metrics: tuple[MetricSpec, ...]
    budget_bytes: int | None = None
    plugins: tuple[str, ...] = ()
    on_oom: tuple[str, ...] | None = None  # the remedy ladder of every metric without its own


@dataclass(frozen=True)
class Task:
    """One metric on one model. ``key`` names its files; ``workload`` is what the size
    cache keys on (what memory depends on); ``inputs`` what defines the result
    (:func:`~oomguard.engine.jobs.fingerprint.task_inputs`), ``fingerprint`` its hash.
    ``rerun_because``: why an earlier result was set aside. ``on_oom``: its remedy ladder
    (None: retry at half only); it does not define the result."""

    key: str
    metric_id: str
    metric: str
    model: str
    params: dict[str, Any]
    pinned: dict[str, int]
    time_limit: float
    workload: dict[str, Any]
    fingerprint: str
    inputs: dict[str, Any] = field(default_factory=dict)
    rerun_because: tuple[str, ...] = ()
    on_oom: tuple[str, ...] | None = None
    pinned_from: str = "job file"  # where ``pinned`` came from (MetricSpec.pinned_from)


@dataclass
class Context:
    """What a task's process needs besides the task; picklable, ``log_setup`` included.
    ``log_setup``, ``snapshot_on_oom`` and ``threads`` are
    :func:`~oomguard.engine.jobs.runner.run_job`'s arguments."""

    job: Job
    out: str
    run_id: str
    cache_path: str | None
    search: bool
    device: dict[str, Any]
    start_method: str = "forkserver"
    log_setup: Callable[[Any], Any] | None = None
    snapshot_on_oom: bool = False
    threads: int | None = None


@dataclass
class TaskResult(Record):
    """What one task produced: ``results/<task>.json``, and one entry of ``results.json``;
    every field, ``null`` where one does not apply; unknown keys are kept in ``extra``."""

    task: str
    metric: str
    model: str
    status: str  # ok, failed; interrupted or pending (these two are never in a file)
    run: str | None = None
    fingerprint: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None  # the metric's own run (ok), or the time until it failed
    total_seconds: float | None = None  # with model build, warm-up and search
    finished: str | None = None
    reason: str | None = None
    traceback: str | None = None
    sizes: dict[str, Any] | None = None  # where the sizes came from, and every attempt
    search: dict[str, Any] | None = None  # the first of ``searches`` (None: none ran)
    searches: list[dict[str, Any]] | None = None  # every knob's search: SearchRecord dicts
    # One OomEvent.to_dict per OOM of the run; None where nothing was recorded.
    oom_events: list[dict[str, Any]] | None = None
    peak_bytes: int | None = None
    peak_source: str | None = None
    budget_bytes: int | None = None
    summary: Any = None
    tensors: str | None = None
    inputs: dict[str, Any] | None = None
    rerun_because: list[str] | None = None
    precision: str | None = None  # the dtype the result was computed at
    lowered_precision: bool | None = None  # whether a remedy lowered it below the job's
    remedy: str | None = None  # what produced it (None: the first attempt, or no on_oom)
    remedies: list[dict[str, Any]] | None = None  # every rung of the ladder tried
    restarts: list[str] | None = None  # why each fresh process was started
    device: dict[str, Any] | None = None  # measured where it ran (on Ray, by the worker)
    # torch's intra-op threads (they change a float sum's last bits).
    threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @classmethod
    def failure(cls, task: Task, run_id: str, reason: str, traceback: str | None,
                seconds: float, **fields: Any) -> TaskResult:
        """The record of a failed task (``traceback``: the file, relative to the output)."""
        return cls.of(task, run_id, FAILED, reason=reason, traceback=traceback,
                      seconds=round(seconds, 3), finished=now_iso(), **fields)

    @classmethod
    def of(cls, task: Task, run_id: str, status: str, **fields: Any) -> TaskResult:
        """The record of ``task`` in run ``run_id``: what identifies the task, ``status``
        (alone: a task that did not finish, ``interrupted`` or ``pending``) and ``fields``."""
        return cls(task=task.key, metric=task.metric, model=task.model, status=status, run=run_id,
                   fingerprint=task.fingerprint, params=dict(task.params), inputs=dict(task.inputs),
                   rerun_because=list(task.rerun_because) or None, **fields)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> TaskResult:
        """The record a result file holds; KeyError/TypeError if it is not one."""
        for required in ("task", "metric", "model", "status"):
            if not isinstance(doc.get(required), str):
                raise KeyError(f"a task result needs a string {required!r}")
        return super().from_dict(doc)
