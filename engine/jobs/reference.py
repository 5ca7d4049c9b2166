"""A measured quick reference: every metric's maximum and safe size for every memory knob
on this device, from searches and the size cache.

:func:`build_reference` sizes each metric of the catalogue on one model, dtype and
sequence length as a job does (:func:`~oomguard.engine.jobs.sizing.choose_sizes`, each search in a
fresh process). Its rows are the searches' records; the sizes go in the size cache under the key a
job looks up, so later jobs and references reuse them. An entry a job already stored is used, never
overwritten: it may have been lowered after an OOM in a real run.

:func:`sizes_toml` writes those sizes as a job file's ``[[metrics]]`` blocks; :func:`load_sizes`
and :func:`apply_sizes` pin them in a job measured for the same model, dtype and device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from oomguard.engine.core.child import DIED, Child, context, start_method
from oomguard.engine.core.search.record import MEASURED, SearchRecord
from oomguard.engine.core.search.search import SearchConfig
from oomguard.engine.core.workload import workload_preload
from oomguard.engine.errors import JobError, UsageError
from oomguard.engine.jobs.cache import SizeCache, entry_key
from oomguard.engine.jobs.data import check_size
from oomguard.engine.jobs.plan import device_identity, plan
from oomguard.engine.jobs.records import DataSpec, Job, MetricSpec, SearchSpec, now_iso
from oomguard.engine.jobs.sizing import Request, Slot, choose_sizes, measure
from oomguard.metrics.base import get_metric, load_all
from oomguard.metrics.models import model_config
from oomguard.metrics.workload import MetricTrial


@dataclass
class Reference:
    """Every row, the job sizes per metric, and what they were measured for."""

    model: str
    dtype: str
    seq_len: int
    n_samples: int
    device: dict[str, Any]
    rows: list[SearchRecord] = field(default_factory=list)  # one per metric and knob
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
    return Job(path="<oomguard reference>", text="", name="reference", output="", device=device,
               dtype=dtype, seed=0, models=(model,),
               data=DataSpec(seq_len=seq_len, n_samples=n_samples), search=SearchSpec(),
               metrics=tuple(MetricSpec(id=m, name=m) for m in metrics), budget_bytes=budget_bytes)


def build_reference(model: str, device: str, dtype: str, seq_len: int, n_samples: int, *,
                    budget_bytes: int | None, cache_path: str | Path | None,
                    config_for: Callable[[MetricTrial, int], SearchConfig],
                    metrics: Sequence[str] | None = None, max_size: int = 65536,
                    on_trial: Callable[[Any], None] | None = None,
                    on_row: Callable[[SearchRecord], None] | None = None) -> Reference:
    """Measure (or read from the cache) every memory knob of ``metrics`` (default: all).
    ``config_for(trial, cap)`` gives each knob's search configuration up to ``cap``. A
    knob where nothing fits, or whose search fails, gets a row saying so; the rest run."""
    names = list(metrics) if metrics else sorted(load_all())
    job = reference_job(model, device, dtype, seq_len, n_samples, budget_bytes, names)
    dev = device_identity(job)
    cache = SizeCache(cache_path)
    ref = Reference(model=model, dtype=dtype, seq_len=seq_len, n_samples=n_samples, device=dev)
    config = model_config(model)
    t0 = time.perf_counter()
    for task in plan(job):
        def evaluate(knob: str, sizes: dict[str, int], unit: int, cap: int,
                     name: str = task.metric) -> SearchRecord:
            trial = MetricTrial(metric=name, knob=knob, model=model, dtype=dtype,
                                device=device, n_samples=n_samples, seq_len=seq_len,
                                params={k: v for k, v in sizes.items() if k != knob})
            return _measure_fresh(trial, config_for(trial, cap), on_trial)

        request = Request(get_metric(task.metric), task.params, n_samples, config, max_size)
        got = choose_sizes(request, evaluate=evaluate, on_record=on_row, slot=Slot(
            cache, entry_key(dev, task.workload), dev, task.workload, source="reference"))
        ref.rows += got.records
        if got.entry is not None:  # every row from the cache
            for row in got.records:
                if on_row is not None:
                    on_row(row)
            ref.job_sizes_source[task.metric] = f"size cache ({got.entry.get('source', '?')})"
        elif got.source == "search":
            ref.job_sizes_source[task.metric] = "reference"
        if task.metric in ref.job_sizes_source:
            ref.job_sizes[task.metric] = got.sizes
    ref.seconds = time.perf_counter() - t0
    return ref


def _measure_fresh(trial: MetricTrial, config: SearchConfig,
                   on_trial: Callable[[Any], None] | None) -> SearchRecord:
    """:func:`~oomguard.engine.jobs.sizing.measure` (a row even when nothing fits or the
    search fails) in a fresh process, started as a job starts its tasks, so that no search
    inherits the free heap, caches or peaks of the ones before it
    (docs/measurements.md#free-heap-at-budget-entry). ``on_trial`` must pickle."""
    with Child(context(start_method(trial.device), workload_preload(trial)),
               partial(measure, metric=trial.metric, on_trial=on_trial), trial, config) as child:
        ended = child.wait()
    if ended.how != DIED:  # what it returned, or its exception raised here
        return ended.result()
    assert trial.knob is not None
    return SearchRecord(metric=trial.metric, knob=trial.knob, max_ok=None,
                        note=f"the search's process died (exit code {ended.exitcode})")


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
        try:
            get_metric(name)  # a metric the job cannot have would be ignored silently
        except UsageError as exc:
            raise JobError(f"{p}: metrics[{i}]: {exc}") from None
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
        for knob, size in pinned.items():
            try:
                check_size(size, job.data.seq_len, f"{m.name}.{knob}")
            except ValueError as exc:
                raise JobError(f"{source}: {exc}") from None
        # Where the sizes came from, as the results and the report say it.
        ours = set(sizes.get(m.name, {})) - set(m.sizes)
        came = (m.pinned_from if not ours else f"sizes file {source}" if not m.sizes
                else f"{m.pinned_from} + sizes file {source}")
        metrics.append(dataclasses.replace(m, sizes=pinned, pinned_from=came))
    return dataclasses.replace(job, metrics=tuple(metrics))
