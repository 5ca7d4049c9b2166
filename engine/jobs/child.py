"""The child process of one job task: build, warm up, size, run, write the result.

Runs in a process of its own (see :mod:`oomguard.engine.jobs.runner`). Whatever happens,
it ends by writing ``results/<task>.json`` atomically (``ok`` with the
summary, or ``failed`` with the reason and a traceback file) and a journal
record; a crash or a kill leaves no result, and the parent records that.

Sizes, in order: pinned in the job file (``sizes``); the size cache; a
bounded search of the first memory knob (in this process, under the job's
budget), stored in the cache; the metric's defaults. An OOM during the run
retries at half (the executor) and lowers the cached sizes to what worked; each
OOM of the run is in the result's ``oom_events`` (memory measured at the OOM;
with ``snapshot_on_oom``, an allocator snapshot in ``snapshots/`` on CUDA).

With a remedy ladder (``on_oom``) the executor goes on past the minimum
(:mod:`~oomguard.engine.core.execute.remedies`): :class:`_Work` lowers the model's precision
or moves model and data to the CPU. When the ladder needs a fresh process
(``expandable_segments``, or memory that did not come back after an OOM), this process
sends the runner a *handoff* (the ladder, the sizes, what ran so far) and ends without
a result; the runner starts the next process with it (:func:`child_main`'s ``handoff``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.execute.remedies import Ladder, apply_env
from oomguard.engine.core.memory.budget import budget
from oomguard.engine.core.memory.forensics import start_history
from oomguard.engine.core.memory.heap import return_freed_memory_to_os
from oomguard.engine.core.memory.oom import release_memory
from oomguard.engine.core.search.search import search
from oomguard.engine.core.search.strategies import E10, Guided
from oomguard.engine.errors import ExecutionFailed, NoSizeFits, RestartNeeded, TrialFailed
from oomguard.engine.jobs.cache import SizeCache, entry_key
from oomguard.engine.jobs.data import load_data
from oomguard.engine.jobs.journal import Journal
from oomguard.engine.jobs.records import OK, Context, Task, TaskResult, now_iso
from oomguard.engine.jobs.spec import import_plugin
from oomguard.engine.util.atomic import atomic_write, atomic_write_json
from oomguard.engine.util.jsonable import to_jsonable
from oomguard.metrics.base import get_metric
from oomguard.metrics.models import build_model
from oomguard.metrics.workload import SAMPLE_KNOBS, in_units, in_whole_units, snap_to_unit
from oomguard.probes.peak import PeakMeter

log = logging.getLogger("oomguard.job")

TENSOR_INLINE_MAX = 64  # tensors with more elements go to results/<task>.pt


def child_main(task: Task, ctx: Context, handoff: dict[str, Any] | None = None,
               conn: Any = None) -> None:
    """Entry point of the child: run ``task`` and record its result or failure.

    ``handoff``: what the task's previous process sent when its remedy ladder needed a
    fresh one (applied first: its environment must be in place before CUDA starts).
    ``conn``: where this process sends its own handoff (a
    :class:`~oomguard.engine.core.child.ToParent`).
    """
    if handoff is not None:
        apply_env(handoff["ladder"]["env"])
    # Freed tensors must go back to the kernel, or the resident peak meter sees
    # a reused heap as 0 bytes and budgets drift (docs/measurements.md#return-freed-memory).
    return_freed_memory_to_os()
    if ctx.threads:
        torch.set_num_threads(ctx.threads)
    out = Path(ctx.out)
    journal = Journal(out / "journal.jsonl")
    state: dict[str, Any] = {"handoff": handoff or {}}
    t0 = time.perf_counter()
    try:
        if ctx.log_setup is not None:  # the caller's logging (the CLI: job.log), per process
            ctx.log_setup(out)
        for plugin in ctx.job.plugins:
            import_plugin(plugin)
        record = _execute(task, ctx, journal, state, t0)
    except RestartNeeded as exc:
        if conn is not None:  # the runner starts the next process; no result from this one
            info = _sizes_info(state)
            conn.send({"why": exc.why, "ladder": exc.ladder.to_dict() if exc.ladder else {},
                       "start": state.get("start"), "source": state.get("source"),
                       "search": state.get("search"), "cache_key": state.get("cache_key"),
                       "attempts": info["attempts"], "errors": info["errors"],
                       "oom_events": _oom_events(state, out) or []})
            return
        record = _failed(task, ctx, exc, state, out, journal, t0)
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, none escapes
        record = _failed(task, ctx, exc, state, out, journal, t0)
    if record.ok:
        atomic_write_json(out / "results" / f"{task.key}.json", record)
        sizes = record.sizes or {}
        journal.append("success", task=task.key, run=ctx.run_id, seconds=record.seconds,
                       sizes=sizes.get("final"), source=sizes.get("source"),
                       retries=sizes.get("retries"), remedy=record.remedy)


def _failed(task: Task, ctx: Context, exc: BaseException, state: dict[str, Any], out: Path,
            journal: Journal, t0: float) -> TaskResult:
    """Record ``exc`` as the task's failure: result file, traceback file, journal."""
    if isinstance(exc, ExecutionFailed):
        reason = str(exc)  # names the workload and every size tried
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"{type(exc).__name__}: {first[:500]}"
    tb = out / "tracebacks" / f"{task.key}.txt"
    atomic_write(tb, "".join(traceback.format_exception(exc)))
    del exc
    record = TaskResult.failure(task, ctx.run_id, reason, str(tb.relative_to(out)),
                                time.perf_counter() - t0, sizes=_sizes_info(state),
                                search=state.get("search"),
                                oom_events=_oom_events(state, out), device=ctx.device,
                                **_ladder_info(state))
    atomic_write_json(out / "results" / f"{task.key}.json", record)
    journal.append("failure", task=task.key, run=ctx.run_id, reason=reason,
                   traceback=record.traceback)
    log.error("%s failed: %s (traceback in %s)", task.key, reason, tb)
    return record


def _sizes_info(state: dict[str, Any]) -> dict[str, Any]:
    """Where the sizes came from and every attempt, the task's earlier processes' first."""
    executor: Executor | None = state.get("executor")
    rec = executor.history[-1] if executor and executor.history else None
    prior = state["handoff"]
    attempts = prior.get("attempts", []) + (rec.attempts if rec else [])
    return {"start": state.get("start"), "source": state.get("source"),
            "final": rec.final if rec else None, "attempts": attempts,
            "errors": prior.get("errors", []) + (rec.errors if rec else []),
            "retries": max(0, len(attempts) - 1), "cache_key": state.get("cache_key")}


def _ladder_info(state: dict[str, Any], work: Any = None, dtype: str = "") -> dict[str, Any]:
    """A result's remedy fields: the ladder's rungs and restarts; with the workload that
    ran, its precision and whether a remedy lowered it below the job's ``dtype``."""
    executor: Executor | None = state.get("executor")
    ladder: Ladder | None = executor.ladder if executor else None
    out: dict[str, Any] = {} if work is None else {
        "precision": work.precision, "lowered_precision": work.precision != dtype}
    if ladder is not None:
        out.update(remedy=ladder.produced, restarts=list(ladder.restarts),
                   remedies=[dataclasses.asdict(r) for r in ladder.rungs])
    return out


def _oom_events(state: dict[str, Any], out: Path) -> list[dict[str, Any]] | None:
    """The run's OOM events (snapshot paths relative to ``out``), the task's earlier
    processes' first; None if it never ran."""
    executor: Executor | None = state.get("executor")
    if not executor or not executor.history:
        return state["handoff"].get("oom_events")
    events = state["handoff"].get("oom_events", []) + [
        e.to_dict() for e in executor.history[-1].events]
    for e in events:
        if e["snapshot"] and Path(e["snapshot"]).is_relative_to(out):
            e["snapshot"] = str(Path(e["snapshot"]).relative_to(out))
    return events


def _warm_up(model: Any, data: dict[str, Any]) -> None:
    """One forward + backward on one short sample: thread pools and kernels exist
    before any budget (docs/measurements.md#minimum-cpu-budget), and nothing is
    charged to the metric."""
    ids = data["input_ids"][:1, : min(8, data["input_ids"].shape[1])]
    with torch.enable_grad():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    model.zero_grad(set_to_none=True)


def _search_cap(knob: Any, n_samples: int, max_size: int) -> int:
    """Sizes of per-sample knobs above the number of samples all do the same work."""
    return min(max_size, n_samples) if knob.name in SAMPLE_KNOBS else max_size


class _KnobTrial:
    """``fn(size)`` for the search: the metric at ``knob=size``, other knobs fixed."""

    def __init__(self, call: Any, knob: str, others: dict[str, int], name: str) -> None:
        self.call, self.knob, self.others, self.name = call, knob, others, name

    def __call__(self, size: int) -> None:
        self.call(**{**self.others, self.knob: size})


def _choose_sizes(task: Task, ctx: Context, metric: Any, call: Any, journal: Journal,
                  state: dict[str, Any]) -> dict[str, int]:
    knobs = metric.memory_knobs()
    defaults = {k.name: int(k.default) for k in knobs}
    job = ctx.job
    if not knobs:
        state["source"] = "none (no memory knobs)"
        return {}
    if task.pinned:
        state["source"] = "job file"
        return {**defaults, **task.pinned}
    cache = SizeCache(ctx.cache_path)
    key = state["cache_key"] = entry_key(ctx.device, task.workload)
    hit = cache.get(key)
    if hit and set(hit["sizes"]) == set(defaults):
        state["source"] = "cache"
        return {k: int(v) for k, v in hit["sizes"].items()}
    if not (ctx.search and job.search.enabled):
        state["source"] = "metric default"
        return defaults
    primary = knobs[0].name
    cap = _search_cap(knobs[0], job.data.n_samples, job.search.max_size)
    seconds = min(job.search.max_seconds, task.time_limit / 3)
    trial = _KnobTrial(call, primary, {k: v for k, v in defaults.items() if k != primary},
                       task.key)
    # A knob whose memory changes only at multiples of a unit is searched in whole units.
    unit = metric.size_unit(primary, metric.validate({**task.params, **defaults}),
                            job.data.n_samples)
    # The default strategy (Guided) from ``start``; a ``step`` the job file gives names the
    # E10 routine with that increment, as --step does on the command line (None: no step).
    explicit_step = job.search.step
    unit, start, step = in_whole_units(job.search.start, explicit_step or 1, unit, cap)
    inner = Guided(start=start) if explicit_step is None else E10(start=start, step=step)
    try:
        result = search(trial, strategy=in_units(inner, unit), max_size=cap,
                        max_trials=job.search.max_trials, max_seconds=seconds,
                        device=job.device, budget=job.budget_bytes)
    except NoSizeFits as exc:
        res = exc.result
        state["search"] = {"trials": len(res.trials), "max_ok": None,
                           "seconds": round(res.seconds, 3), "stopped_because": "nothing fits"}
        journal.append("search", task=task.key, run=ctx.run_id, **state["search"])
        state["source"] = "search (nothing fit; minimum)"
        return {k.name: int(k.minimum) for k in knobs}
    except TrialFailed as exc:  # not memory: the task fails, with the trials that ran recorded
        res = exc.result
        state["search"] = {"trials": len(res.trials), "max_ok": res.max_ok,
                           "seconds": round(res.seconds, 3),
                           "stopped_because": res.stopped_because}
        journal.append("search", task=task.key, run=ctx.run_id, **state["search"])
        raise
    snap_to_unit(result, unit)
    size = result.size_to_use
    state["search"] = {"trials": len(result.trials), "max_ok": result.max_ok,
                       "first_oom": result.first_oom, "safe": size, "mode": result.mode,
                       "strategy": result.strategy,
                       "seconds": round(result.seconds, 3),
                       "stopped_because": result.stopped_because, "unit": unit}
    journal.append("search", task=task.key, run=ctx.run_id, **state["search"])
    sizes = {**defaults, primary: int(size)}
    cache.put(key, sizes, source="search", device=ctx.device, workload=task.workload,
              max_ok=result.max_ok, trials=len(result.trials))
    state["source"] = "search"
    return sizes


def _split_tensors(value: Any, prefix: str, big: dict[str, Any]) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() > TENSOR_INLINE_MAX:
            big[prefix] = value.detach().cpu()
    elif isinstance(value, dict):
        for k, v in value.items():
            _split_tensors(v, f"{prefix}.{k}" if prefix else str(k), big)


class _Work:
    """The task's metric as the executor calls it, and what remedies change in it
    (:mod:`~oomguard.engine.core.execute.remedies`): :meth:`at_precision` casts the model in
    place; :meth:`on_device` builds model and data again there, at the job's dtype.
    ``meter`` measures the peak of the device the metric runs on."""

    def __init__(self, task: Task, ctx: Context, metric: Any, model: Any, data: Any,
                 journal: Journal) -> None:
        self.task, self.ctx, self.metric, self.model, self.data = task, ctx, metric, model, data
        self.journal = journal
        self.executor: Executor | None = None  # the run's, once it is made
        self.tolerates_lower_precision = bool(metric.tolerates_lower_precision)
        self.precision = ctx.job.dtype
        self.meter = PeakMeter(ctx.job.device)

    def __call__(self, **sizes: int) -> dict[str, Any]:
        rec = self.executor.history[-1] if self.executor else None
        if rec is not None and len(rec.attempts) > 1:
            self.journal.append("retry", task=self.task.key, run=self.ctx.run_id, sizes=sizes,
                                after=rec.errors[-1] if rec.errors else None)
        return self.call(**sizes)

    def call(self, **sizes: int) -> dict[str, Any]:
        """The metric at ``sizes`` (what the size search runs)."""
        return self.metric.run(self.model, self.data, **self.task.params, **sizes)

    def at_precision(self, dtype: torch.dtype) -> _Work:
        self.model.to(dtype)
        self.precision = str(dtype).removeprefix("torch.")
        return self

    def on_device(self, device: str) -> _Work:
        job = self.ctx.job
        self.model = self.data = None
        release_memory(job.device)
        self.model = build_model(self.task.model, job.dtype, device, seed=job.seed)
        self.data = load_data(job.data, self.model.config.vocab_size, seed=job.seed,
                              device=device)
        _warm_up(self.model, self.data)
        self.precision, self.meter = job.dtype, PeakMeter(device)
        self.meter.reset()
        return self


def _execute(task: Task, ctx: Context, journal: Journal, state: dict[str, Any],
             t0: float) -> TaskResult:
    job, out = ctx.job, Path(ctx.out)
    if ctx.snapshot_on_oom:  # from the task's start, so the snapshot shows the model too
        start_history(job.device)
    metric = get_metric(task.metric)
    model = build_model(task.model, job.dtype, job.device, seed=job.seed)
    data = load_data(job.data, model.config.vocab_size, seed=job.seed, device=job.device)
    _warm_up(model, data)
    # Only the workload holds the model and the data: a remedy may replace them.
    work = _Work(task, ctx, metric, model, data, journal)
    del model, data
    prior = state["handoff"]
    if prior:  # a fresh process of the same run: the sizes were chosen by the first one
        for key in ("start", "source", "search", "cache_key"):
            state[key] = prior[key]
        start = prior["start"]
    else:
        start = state["start"] = _choose_sizes(task, ctx, metric, work.call, journal, state)
        journal.append("sizes", task=task.key, run=ctx.run_id, sizes=start,
                       source=state["source"])
    minimum = {k.name: int(k.minimum) for k in metric.memory_knobs()}
    executor = work.executor = state["executor"] = Executor(
        device=job.device, snapshot_on_oom=out / "snapshots" if ctx.snapshot_on_oom else None,
        on_oom=task.on_oom, fresh_process=True)
    ladder = Ladder.from_dict(prior["ladder"]) if prior else None
    guard = budget(job.budget_bytes, job.device) if job.budget_bytes else nullcontext()
    work.meter.reset()
    with guard:
        t_run = time.perf_counter()
        result = executor.run(work, sizes=start, minimum=minimum, name=task.key, ladder=ladder)
        seconds = time.perf_counter() - t_run
    peak = work.meter.read()
    rec, info = executor.history[-1], _sizes_info(state)
    same = executor.ladder is None or executor.ladder.produced in (None, "halve")
    if info["retries"] and state.get("cache_key") and rec.final and same:
        # (sizes that worked after a lower precision or on the CPU say nothing of this one)
        SizeCache(ctx.cache_path).lower(state["cache_key"], rec.final, device=ctx.device,
                                        workload=task.workload,
                                        reason=f"{task.key}: {info['errors'][-1]}")
    big: dict[str, Any] = {}
    _split_tensors(result, "", big)
    tensors = None
    if big:
        pt = out / "results" / f"{task.key}.pt"
        atomic_write(pt, lambda tmp: torch.save(big, tmp))
        tensors = str(pt.relative_to(out))
    summary = metric.summary(result)
    return TaskResult(
        task=task.key, metric=task.metric, model=task.model, status=OK, run=ctx.run_id,
        fingerprint=task.fingerprint, params=task.params, sizes=info,
        search=state.get("search"), oom_events=_oom_events(state, out),
        seconds=round(seconds, 3),
        total_seconds=round(time.perf_counter() - t0, 3), peak_bytes=peak,
        peak_source=f"measured: {work.meter.source}", budget_bytes=job.budget_bytes,
        summary=to_jsonable(summary, max_items=TENSOR_INLINE_MAX), tensors=tensors,
        inputs=dict(task.inputs), rerun_because=list(task.rerun_because) or None,
        finished=now_iso(), device=ctx.device, threads=torch.get_num_threads(),
        **_ladder_info(state, work, job.dtype))
