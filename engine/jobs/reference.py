"""A measured quick reference: every metric's maximum and safe size for every memory knob
on this device, from searches and the size cache.

:func:`build_reference` sizes each metric of the catalogue on one model, dtype and
sequence length as a job does (:func:`~oomguard.engine.jobs.sizing.choose_sizes`, each search in a
fresh process). Its rows are the searches' records; the sizes go in the size cache under the key a
job looks up, so later jobs and references reuse them. An entry a job already stored is used, never
overwritten: it may have been lowered after an OOM in a real run.

:func:`sizes_toml` writes those sizes as a job file's ``[[metrics]]`` blocks; :func:`load_sizes`
and :func:`apply_sizes` pin them in a job measured for the same model, dtype and device. A
memory knob's size is per batch or chunk, so it holds whatever the job's sample count; a size
that only reached a cap other than memory (the reference's sample count) is marked
``capped``, and a job that allows more searches that knob instead of pinning it, as it
would not reuse such a size cache entry (:mod:`~oomguard.engine.jobs.sizing`).
"""

from __future__ import annotations

import dataclasses
import logging
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
from oomguard.engine.util.units import fmt_bytes
from oomguard.metrics.base import get_metric, load_all
from oomguard.metrics.models import model_config
from oomguard.metrics.workload import MetricTrial

log = logging.getLogger("oomguard.job")


@dataclass
class Reference:
    """Every row, the job sizes per metric, and what they were measured for.
    ``job_capped``: per metric, the knobs whose size reached a cap other than memory (the
    sample count, ``max_size``, a search limit), each with that cap in items."""

    model: str
    dtype: str
    seq_len: int
    n_samples: int
    device: dict[str, Any]
    rows: list[SearchRecord] = field(default_factory=list)  # one per metric and knob
    job_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    job_sizes_source: dict[str, str] = field(default_factory=dict)
    job_capped: dict[str, dict[str, int]] = field(default_factory=dict)
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
                "job_sizes_source": self.job_sizes_source, "job_capped": self.job_capped}


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
            capped = {r.knob: int(r.cap) for r in got.records if r.capped_by and r.cap}
            if capped:
                ref.job_capped[task.metric] = capped
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
    table naming what they were measured for (``oomguard run JOB --sizes-file FILE`` checks
    it). A block's ``sizes`` are per batch or chunk, whatever the sample count; its
    ``capped`` (knob: cap) names the sizes that reached a cap other than memory."""
    dev = ref.device
    lines = ["# Sizes measured by `oomguard reference` "
             f"({ref.created}): paste the [[metrics]] blocks into a job file, or run",
             "# `oomguard run JOB.toml --sizes-file THIS_FILE`. Valid for what [reference] says,",
             "# on any number of samples, and under a larger budget or none (sizes are per",
             "# batch or chunk). `capped`: knobs whose size reached that cap (the sample count,",
             "# max_size) without running out of memory; a job that allows more searches them.",
             "", "[reference]", f"model = {_q(ref.model)}", f"dtype = {_q(ref.dtype)}",
             f"seq_len = {ref.seq_len}", f"device = {_q(dev.get('device'))}",
             f"device_name = {_q(dev.get('name'))}", f"total_bytes = {int(dev.get('total_bytes') or 0)}"]
    if dev.get("budget_bytes"):
        lines.append(f"budget_bytes = {int(dev['budget_bytes'])}")
    for metric, sizes in ref.job_sizes.items():
        inline = ", ".join(f"{k} = {int(v)}" for k, v in sizes.items())
        lines += ["", "[[metrics]]", f"name = {_q(metric)}", f"sizes = {{ {inline} }}"]
        if ref.job_capped.get(metric):
            caps = ", ".join(f"{k} = {int(v)}" for k, v in ref.job_capped[metric].items())
            lines.append(f"capped = {{ {caps} }}")
    return "\n".join(lines) + "\n"


def _q(value: Any) -> str:
    """A TOML basic string."""
    text = str(value if value is not None else "")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class SizesFile:
    """A sizes file, as :func:`load_sizes` reads it: ``path`` (as given), ``meta`` (its
    ``[reference]`` table: what the sizes were measured for), ``sizes`` (metric: knob: size,
    in items per batch or chunk) and ``capped`` (metric: knob: the cap, in items, its size
    reached without running out of memory)."""

    path: str
    meta: dict[str, Any]
    sizes: dict[str, dict[str, int]]
    capped: dict[str, dict[str, int]] = field(default_factory=dict)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def load_sizes(path: str | Path) -> SizesFile:
    """The sizes file at ``path``; :class:`JobError` with one line when it cannot be read or
    is not one."""
    from oomguard.engine.jobs.spec import tomllib  # tomllib, or tomli on Python 3.10

    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise JobError(f"{p}: cannot read the sizes file ({exc.strerror or exc}); check "
                       "the path and its permissions") from None
    except ValueError as exc:
        raise JobError(f"{p}: not a valid TOML sizes file ({exc}); write it again with "
                       "`oomguard reference`") from None
    meta, metrics = doc.get("reference"), doc.get("metrics")
    if not isinstance(meta, dict) or not isinstance(metrics, list):
        raise JobError(f"{p}: a sizes file needs a [reference] table and [[metrics]] blocks, "
                       "as `oomguard reference` writes them; write it again with "
                       "`oomguard reference`")
    sizes: dict[str, dict[str, int]] = {}
    capped: dict[str, dict[str, int]] = {}
    for i, m in enumerate(metrics):
        name, knobs = (m.get("name"), m.get("sizes")) if isinstance(m, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(knobs, dict) or not all(
                _whole(v) for v in knobs.values()):
            raise JobError(f"{p}: metrics[{i}] needs a name and sizes of positive whole "
                           "numbers: give them, e.g. sizes = {{ micro_batch_size = 8 }}")
        caps = m.get("capped", {})
        if not isinstance(caps, dict) or not all(
                k in knobs and _whole(v) for k, v in caps.items()):
            raise JobError(f"{p}: metrics[{i}]: capped names knobs of its sizes with positive "
                           "whole numbers, e.g. capped = {{ micro_batch_size = 8 }}; write the "
                           "file again with `oomguard reference`")
        try:
            get_metric(name)  # a metric the job cannot have would be ignored silently
        except UsageError as exc:
            raise JobError(f"{p}: metrics[{i}]: {exc}") from None
        sizes[name] = dict(knobs)
        if caps:
            capped[name] = dict(caps)
    return SizesFile(str(path), meta, sizes, capped)


def apply_sizes(job: Job, pins: SizesFile, device: Mapping[str, Any], *,
                search: bool = True) -> Job:
    """``job`` with the sizes file's sizes pinned on its metrics of the same name (a size the
    job file pins itself is kept), on any number of samples: a size is per batch or chunk.
    A size the file marks ``capped`` at less than this job allows (more samples than the
    reference's, a larger ``max_size``) is left to the job's search where it has one
    (``search`` and the job's ``[search] enabled``), said in one line. Sizes found under a
    budget hold under a larger one or none, said in one line. Raises :class:`JobError` when
    the file was measured for another model, dtype, sequence length or device, or under a
    budget larger than the job's (or none, where the job has one)."""
    source, meta = pins.path, pins.meta
    want = {"model": job.models[0] if len(job.models) == 1 else None, "dtype": job.dtype,
            "seq_len": job.data.seq_len, "device_name": device.get("name"),
            "total_bytes": device.get("total_bytes")}
    wrong = [f"{k} {meta.get(k)!r} (the job: {want[k]!r})" for k in want
             if meta.get(k) != want[k]]
    budget = _budget_fits(meta.get("budget_bytes") or None, device.get("budget_bytes") or None,
                          job.device, source, check_only=bool(wrong))
    if wrong or budget:
        raise JobError(f"{source} was measured for another setting: "
                       f"{'; '.join(wrong + ([budget] if budget else []))}; run "
                       "`oomguard reference` with the job's model, dtype, seq_len, device "
                       "and budget")
    searches = search and job.search.enabled
    metrics = []
    for m in job.metrics:
        ours = {k: v for k, v in pins.sizes.get(m.name, {}).items() if k not in m.sizes}
        if searches:
            for knob in _searched_instead(job, m, ours, pins.capped.get(m.name, {}), source):
                del ours[knob]
        pinned = {**ours, **m.sizes}
        if pinned:
            get_metric(m.name).validate({**m.params, **pinned})
        for knob, size in pinned.items():
            try:
                check_size(size, job.data.seq_len, f"{m.name}.{knob}")
            except ValueError as exc:
                raise JobError(f"{source}: {exc}") from None
        # Where the sizes came from, as the results and the report say it.
        came = (m.pinned_from if not ours else f"sizes file {source}" if not m.sizes
                else f"{m.pinned_from} + sizes file {source}")
        metrics.append(dataclasses.replace(m, sizes=pinned, pinned_from=came))
    return dataclasses.replace(job, metrics=tuple(metrics))


def _searched_instead(job: Job, m: MetricSpec, ours: Mapping[str, int],
                      capped: Mapping[str, int], source: str) -> list[str]:
    """The knobs of ``ours`` (``m``'s sizes from the file) whose size only reached its
    ``capped`` cap while ``job`` allows more: a job on 16 samples after a reference on 8
    searches them, as it would not reuse such a size cache entry
    (:func:`~oomguard.engine.jobs.sizing.choose_sizes`); each said in one line."""
    knobs = [k for k in capped if k in ours]
    if not knobs:
        return []
    metric = get_metric(m.name)
    sizes = {k.name: int(k.default) for k in metric.memory_knobs()} | dict(ours) | dict(m.sizes)
    request = Request(metric, m.params, job.data.n_samples, model_config(job.models[0]),
                      job.search.max_size)
    searched = []
    for knob in knobs:
        allows = request.bounds(knob, sizes)[1]
        if allows > capped[knob]:
            log.info("%s: %s.%s = %d reached the reference's cap (%d), not memory; this job "
                     "allows up to %d: it searches %s instead of pinning it", source, m.name,
                     knob, ours[knob], capped[knob], allows, knob)
            searched.append(knob)
    return searched


def _budget_fits(found: int | None, given: int | None, device: str, source: str,
                 check_only: bool = False) -> str | None:
    """None where sizes found under the budget ``found`` (bytes; None: none) hold in a job
    under the budget ``given``: the same, a larger one, or none (their peaks stayed under
    ``found``), said in one line where the budgets differ (not with ``check_only``); else
    what is wrong, for the one-line refusal."""
    if found == given:
        return None
    if found is None or (given is not None and given < found):
        return (f"budget {_bytes(found)} (the job: {_bytes(given)}; its sizes hold under the "
                "same budget, a larger one or none)")
    if check_only:
        return None
    if given is not None:
        log.info("%s: sizes found under a %s budget; this job's is %s: they fit, and a search "
                 "under it may find larger ones", source, fmt_bytes(found), fmt_bytes(given))
        return None
    from oomguard.probes import probe

    free = probe(device).free_bytes
    if free is not None and free < found:
        log.warning("%s: sizes found under a %s budget, more than the %s free now on %s; this "
                    "job has no budget: a size that does not fit runs out of memory and is "
                    "retried at half", source, fmt_bytes(found), fmt_bytes(free), device)
    else:
        log.info("%s: sizes found under a %s budget; this job has none (%s free on %s): they "
                 "fit, and a search without a budget may find larger ones", source,
                 fmt_bytes(found), "?" if free is None else fmt_bytes(free), device)
    return None


def _bytes(n: int | None) -> str:
    return "none" if n is None else fmt_bytes(n)
