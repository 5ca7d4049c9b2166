"""A measured quick reference: every metric's maximum and safe size for every memory knob
on this device, from searches and the size cache.

:func:`build_reference` searches each (metric, knob) of the catalogue on one model, dtype
and sequence length, the other knobs at their defaults, as ``oomguard search`` does, and
keeps each answer in the size cache. A second run on the same device and workload reads
every row back from the cache and runs no trial. It also stores, for each metric, the
sizes a job would store after its own search (the first knob's safe size, the others at
their defaults) under the key a job looks up, so a later job on the same device, model,
dtype and sequence length takes its sizes from there instead of searching. An entry a job
already stored is never overwritten: it may have been lowered after an OOM in a real run.

:func:`sizes_toml` writes those sizes as a job file's ``[[metrics]]`` blocks, with a
``[reference]`` table saying what they were measured for; :func:`load_sizes` reads one
back and :func:`apply_sizes` pins them in a job, refusing a job on another model, dtype,
sequence length or device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.engine.core.child import DIED, Child, start_forkserver, workload_preload
from oomguard.engine.core.search.search import SearchConfig, SearchResult, search
from oomguard.engine.errors import JobError, NoSizeFits, TrialFailed
from oomguard.engine.jobs.cache import SizeCache, entry_key
from oomguard.engine.jobs.plan import device_identity, plan
from oomguard.engine.jobs.records import DataSpec, Job, MetricSpec, SearchSpec, now_iso
from oomguard.metrics.base import get_metric, load_all
from oomguard.metrics.workload import MetricTrial, snap_to_unit

MEASURED, CACHE = "measured", "cache"


@dataclass
class Row:
    """One metric's knob: what its search found (sizes in items, bytes in bytes).

    ``max_ok`` ran; ``safe`` is the recommendation (the largest size whose peak keeps the
    margin free, never above ``max_ok``); ``peak_at_safe_bytes`` is measured when a trial
    ran at ``safe`` and estimated from the fitted line otherwise (``peak_source`` says
    which); ``seconds_per_item`` is measured at ``max_ok`` after each trial's first step.
    ``source``: ``measured`` (searched now) or ``cache`` (an earlier reference).
    """

    metric: str
    knob: str
    max_ok: int | None
    first_oom: int | None
    safe: int | None
    peak_at_safe_bytes: int | None
    peak_source: str
    seconds_per_item: float | None
    source: str
    trials: int
    seconds: float
    mode: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Reference:
    """Every row, the job sizes per metric, and what they were measured for."""

    model: str
    dtype: str
    seq_len: int
    n_samples: int
    device: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    job_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    job_sizes_source: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    created: str = field(default_factory=now_iso)

    @property
    def trials(self) -> int:
        """Search trials run by this reference (0 when every row came from the cache)."""
        return sum(r.trials for r in self.rows if r.source == MEASURED)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "seq_len": self.seq_len,
                "n_samples": self.n_samples, "device": self.device, "created": self.created,
                "seconds": round(self.seconds, 3), "trials": self.trials,
                "rows": [r.to_dict() for r in self.rows], "job_sizes": self.job_sizes,
                "job_sizes_source": self.job_sizes_source}


def reference_job(model: str, device: str, dtype: str, seq_len: int, n_samples: int,
                  budget_bytes: int | None, metrics: Sequence[str]) -> Job:
    """The job whose tasks a reference measures: the same cache keys as a job file with
    this model, device, dtype, data shape, budget and metrics (no parameters, no pins)."""
    for name in metrics:
        get_metric(name)  # a UsageError listing the valid ones
    return Job(path="<oomguard reference>", text="", name="reference", output="",
               device=device, dtype=dtype, seed=0, models=(model,),
               data=DataSpec(seq_len=seq_len, n_samples=n_samples), search=SearchSpec(),
               metrics=tuple(MetricSpec(id=m, name=m) for m in metrics),
               budget_bytes=budget_bytes)


def build_reference(model: str, device: str, dtype: str, seq_len: int, n_samples: int, *,
                    budget_bytes: int | None, cache_path: str | Path | None,
                    config_for: Callable[[MetricTrial], SearchConfig],
                    metrics: Sequence[str] | None = None,
                    on_trial: Callable[[Any], None] | None = None,
                    on_row: Callable[[Row], None] | None = None) -> Reference:
    """Measure (or read from the cache) every memory knob of ``metrics`` (default: all).

    ``config_for(trial)`` gives each knob's search configuration (strategy, bounds,
    budget, mode). A knob where nothing fits, or whose search fails for a reason other
    than memory, gets a row saying so; the others still run.
    """
    names = list(metrics) if metrics else sorted(load_all())
    job = reference_job(model, device, dtype, seq_len, n_samples, budget_bytes, names)
    dev = device_identity(job)
    cache = SizeCache(cache_path)
    ref = Reference(model=model, dtype=dtype, seq_len=seq_len, n_samples=n_samples, device=dev)
    t0 = time.perf_counter()
    for task in plan(job):
        metric = get_metric(task.metric)
        knobs = metric.memory_knobs()
        rows = []
        for knob in knobs:
            trial = MetricTrial(metric=task.metric, knob=knob.name, model=model, dtype=dtype,
                                device=device, n_samples=n_samples, seq_len=seq_len)
            key = entry_key(dev, {**task.workload, "knob": knob.name})
            row = _cached_row(cache.get(key), task.metric, knob.name)
            if row is None:
                row = _measure_fresh(trial, config_for(trial), on_trial)
                if row.max_ok is not None or row.note.startswith("nothing fits"):
                    # A knob where nothing fits is an answer too (no sizes): kept, so a
                    # second run measures nothing again.
                    fits = {knob.name: row.safe or row.max_ok} if row.max_ok else {}
                    cache.put(key, fits, source="reference", device=dev,
                              workload={**task.workload, "knob": knob.name}, row=row.to_dict())
            rows.append(row)
            ref.rows.append(row)
            if on_row is not None:
                on_row(row)
        if not knobs:
            continue
        _job_sizes(ref, cache, entry_key(dev, task.workload), task, dev,
                   {k.name: int(k.default) for k in knobs}, rows[0])
    ref.seconds = time.perf_counter() - t0
    return ref


def _cached_row(entry: Mapping[str, Any] | None, metric: str, knob: str) -> Row | None:
    doc = (entry or {}).get("row")
    if not isinstance(doc, Mapping):
        return None
    try:
        row = Row(**{f.name: doc[f.name] for f in dataclasses.fields(Row)})
    except (KeyError, TypeError):  # written by another version: measure again
        return None
    if (row.metric, row.knob) != (metric, knob):
        return None
    row.source, row.note = CACHE, f"measured {entry.get('updated', '?')}"  # type: ignore[union-attr]
    return row


def _measure_fresh(trial: MetricTrial, config: SearchConfig,
                   on_trial: Callable[[Any], None] | None) -> Row:
    """:func:`_measure` in a fresh process of its own (a forkserver's child), so that no
    search inherits the free heap, caches or peaks of the ones before it: run one after
    another in one process, later searches found 30-60 MiB of reusable free heap at their
    budget's entry and measured peaks of 4 KiB. ``on_trial`` must pickle."""
    with Child(start_forkserver(workload_preload(trial)), _measure, trial, config,
               on_trial) as child:
        ended = child.wait()
    if ended.how != DIED:  # what it returned, or its exception raised here
        return ended.result()
    assert trial.knob is not None
    return Row(metric=trial.metric, knob=trial.knob, max_ok=None, first_oom=None,
               safe=None, peak_at_safe_bytes=None, peak_source="", seconds_per_item=None,
               source=MEASURED, trials=0, seconds=0.0,
               note=f"the search's process died (exit code {ended.exitcode})")


def _measure(trial: MetricTrial, config: SearchConfig,
             on_trial: Callable[[Any], None] | None) -> Row:
    """Search one knob; a row even when nothing fits or the search fails."""
    assert trial.knob is not None
    blank = {"metric": trial.metric, "knob": trial.knob, "first_oom": None, "safe": None,
             "peak_at_safe_bytes": None, "peak_source": "", "seconds_per_item": None,
             "source": MEASURED}
    try:
        result = search(trial, config, on_trial=on_trial)
    except NoSizeFits as exc:
        r = exc.result
        return Row(**blank, max_ok=None, trials=len(r.trials), seconds=round(r.seconds, 3),
                   mode=r.mode, note="nothing fits: even the smallest size ran out of memory")
    except TrialFailed as exc:
        r = exc.result
        return Row(**blank, max_ok=r.max_ok, trials=len(r.trials), seconds=round(r.seconds, 3),
                   mode=r.mode, note=f"search failed: {str(exc)[:200]}")
    snap_to_unit(result, trial.unit())
    return _row(trial, result)


def _row(trial: MetricTrial, result: SearchResult) -> Row:
    safe = result.size_to_use
    ran = {t.size: t for t in result.trials if t.ok}
    if safe in ran:
        peak, source = ran[safe].peak_bytes, "measured"
    elif result.fit is not None and safe is not None:
        peak, source = int(result.fit.predict(safe)), "estimated from the fitted line"
    else:
        peak, source = None, "not measured"
    best = ran.get(result.max_ok) if result.max_ok is not None else None
    rate = best.items_per_second if best is not None else None
    note = (f"no OOM up to {result.max_ok}, the largest size tried"
            if result.first_oom is None else "")
    assert trial.knob is not None
    return Row(metric=trial.metric, knob=trial.knob, max_ok=result.max_ok,
               first_oom=result.first_oom, safe=safe, peak_at_safe_bytes=peak,
               peak_source=source, seconds_per_item=1.0 / rate if rate else None,
               source=MEASURED, trials=len(result.trials), seconds=round(result.seconds, 3),
               mode=result.mode, note=note)


def _job_sizes(ref: Reference, cache: SizeCache, key: str, task: Any, dev: dict[str, Any],
               defaults: dict[str, int], first: Row) -> None:
    """What a job on this device would use for ``task``: a job's own entry if there is one
    (kept: it may have been lowered after an OOM), else the first knob's safe size with the
    others at their defaults, stored under the job's key."""
    hit = cache.get(key)
    if hit and set(hit["sizes"]) == set(defaults):
        ref.job_sizes[task.metric] = {k: int(v) for k, v in hit["sizes"].items()}
        ref.job_sizes_source[task.metric] = f"size cache ({hit.get('source', '?')})"
        return
    if first.max_ok is None:
        return
    sizes = {**defaults, first.knob: int(first.safe or first.max_ok)}
    cache.put(key, sizes, source="reference", device=dev, workload=task.workload,
              max_ok=first.max_ok, trials=first.trials)
    ref.job_sizes[task.metric] = sizes
    ref.job_sizes_source[task.metric] = "reference"


def sizes_toml(ref: Reference) -> str:
    """``ref``'s job sizes as a job file's ``[[metrics]]`` blocks, with a ``[reference]``
    table naming what they were measured for (``oomguard run JOB --sizes FILE`` checks it)."""
    dev = ref.device
    lines = ["# Sizes measured by `oomguard reference` "
             f"({ref.created}): paste the [[metrics]] blocks into a job file, or run",
             "# `oomguard run JOB.toml --sizes THIS_FILE`. Valid only for what [reference] says.",
             "", "[reference]", f"model = {_q(ref.model)}", f"dtype = {_q(ref.dtype)}",
             f"seq_len = {ref.seq_len}", f"device = {_q(dev.get('device'))}",
             f"device_name = {_q(dev.get('name'))}", f"total_bytes = {int(dev.get('total_bytes') or 0)}"]
    if dev.get("budget_bytes"):
        lines.append(f"budget_bytes = {int(dev['budget_bytes'])}")
    for metric, sizes in ref.job_sizes.items():
        inline = ", ".join(f"{k} = {int(v)}" for k, v in sizes.items())
        lines += ["", "[[metrics]]", f"name = {_q(metric)}", f"sizes = {{ {inline} }}"]
    return "\n".join(lines) + "\n"


def _q(value: Any) -> str:
    """A TOML basic string."""
    text = str(value if value is not None else "")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def load_sizes(path: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    """(the ``[reference]`` table, sizes per metric) of a sizes file; :class:`JobError` with
    one line when it cannot be read or is not one."""
    from oomguard.engine.jobs.spec import tomllib  # tomllib, or tomli on Python 3.10

    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise JobError(f"{p}: cannot read the sizes file ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise JobError(f"{p}: not a valid TOML sizes file ({exc}); write it again with "
                       "`oomguard reference`") from None
    meta, metrics = doc.get("reference"), doc.get("metrics")
    if not isinstance(meta, dict) or not isinstance(metrics, list):
        raise JobError(f"{p}: a sizes file needs a [reference] table and [[metrics]] blocks, "
                       "as `oomguard reference` writes them")
    sizes: dict[str, dict[str, int]] = {}
    for i, m in enumerate(metrics):
        name, knobs = (m.get("name"), m.get("sizes")) if isinstance(m, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(knobs, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in knobs.values()):
            raise JobError(f"{p}: metrics[{i}] needs a name and sizes of positive whole "
                           "numbers, e.g. sizes = {{ micro_batch_size = 8 }}")
        sizes[name] = dict(knobs)
    return meta, sizes


def apply_sizes(job: Job, meta: Mapping[str, Any], sizes: Mapping[str, Mapping[str, int]],
                device: Mapping[str, Any], source: str) -> Job:
    """``job`` with the sizes file's sizes pinned on its metrics of the same name (a size the
    job file pins itself is kept). Raises :class:`JobError` when the file was measured for
    another model, dtype, sequence length, device or budget."""
    want = {"model": job.models[0] if len(job.models) == 1 else None, "dtype": job.dtype,
            "seq_len": job.data.seq_len, "device_name": device.get("name"),
            "total_bytes": device.get("total_bytes"),
            "budget_bytes": device.get("budget_bytes") or None}
    got = {**{k: meta.get(k) for k in want}, "budget_bytes": meta.get("budget_bytes") or None}
    wrong = [f"{k} {got[k]!r} (the job: {want[k]!r})" for k in want if got[k] != want[k]]
    if wrong:
        raise JobError(f"{source} was measured for another setting: {'; '.join(wrong)}; run "
                       "`oomguard reference` with the job's model, dtype, seq_len, device "
                       "and budget")
    metrics = []
    for m in job.metrics:
        pinned = {**sizes.get(m.name, {}), **m.sizes}
        if pinned:
            get_metric(m.name).validate({**m.params, **pinned})
        metrics.append(dataclasses.replace(m, sizes=pinned))
    return dataclasses.replace(job, metrics=tuple(metrics))
