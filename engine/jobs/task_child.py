"""The process of one job task (child side): build, warm up, size, run, write the result.

Whatever happens, it ends by writing ``results/<task>.json`` (``ok`` with the summary, or
``failed`` with the reason and a traceback file) and a journal record, every output
through its sink (:mod:`~oomguard.engine.jobs.sink`); a crash or a kill leaves no
result, and the parent (:mod:`~oomguard.engine.jobs.task_process`) records that.

Sizes come from :func:`~oomguard.engine.jobs.sizing.choose_sizes` (a search runs in this
process, under the job's budget); for a metric that can run recomputed, the sizes of each
configuration, each timed once under the budget, and the faster configuration runs. An OOM during the run retries at half (the executor)
and lowers the cached sizes to what worked; each OOM is in the result's ``oom_events``
(memory measured at the OOM; with ``snapshot_on_oom``, an allocator snapshot on CUDA).

With a remedy ladder (``on_oom``, :mod:`~oomguard.engine.core.execute.remedies`) the
executor goes on past the minimum: :class:`_Work` lowers the model's precision or moves
model and data to the CPU. When the ladder needs a fresh process, this one sends the
parent a *handoff* (the ladder, the sizes, what ran so far) and ends without a result.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.execute.remedies import Ladder, apply_env
from oomguard.engine.core.memory.forensics import start_history
from oomguard.engine.core.memory.heap import return_freed_memory_to_os
from oomguard.engine.core.memory.oom import OOM, call_catching_oom, release_memory
from oomguard.engine.core.search.limit import limit_budget, unbudgeted_limit
from oomguard.engine.core.search.search import SearchConfig
from oomguard.engine.errors import ExecutionFailed, RestartNeeded, TrialFailed, first_line
from oomguard.engine.jobs import sizing
from oomguard.engine.jobs.cache import entry_key
from oomguard.engine.jobs.data import load_data
from oomguard.engine.jobs.records import OK, Context, Task, TaskResult, now_iso
from oomguard.engine.jobs.sink import Sink
from oomguard.engine.jobs.spec import import_plugin
from oomguard.engine.util.jsonable import json_text, to_jsonable
from oomguard.metrics.base import get_metric
from oomguard.metrics.knob_check import require_memory_knobs
from oomguard.metrics.models import build_model
from oomguard.probes.peak import PeakMeter

log = logging.getLogger("oomguard.job")

TENSOR_INLINE_MAX = 64  # tensors with more elements go to results/<task>.pt
# What the task's first process chose, handed to the next one (a restart keeps the sizes).
_CHOSEN = ("start", "source", "search", "searches", "cache_key", "configuration",
           "configurations")


def child_main(task: Task, ctx: Context, sink: Sink, handoff: dict[str, Any] | None = None,
               conn: Any = None) -> None:
    """Entry point of the child: run ``task`` and record its result or failure in ``sink``.
    ``handoff``: what the task's previous process sent (applied first: its environment
    must be in place before CUDA starts); ``conn``: where this process sends its own (a
    :class:`~oomguard.engine.core.child.ToParent`)."""
    if handoff is not None:
        apply_env(handoff["ladder"]["env"])
    # Freed tensors must go back to the kernel, or the resident peak meter sees
    # a reused heap as 0 bytes and budgets drift (docs/measurements.md#return-freed-memory).
    return_freed_memory_to_os()
    if ctx.threads:
        torch.set_num_threads(ctx.threads)
    out = Path(ctx.out)
    state: dict[str, Any] = {"handoff": handoff or {}}
    t0 = time.perf_counter()
    try:
        if ctx.log_setup is not None:  # the caller's logging (the CLI: job.log), per process
            ctx.log_setup(out)
        for plugin in ctx.job.plugins:
            import_plugin(plugin)
        record = _execute(task, ctx, sink, state, t0)
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, none escapes
        if isinstance(exc, RestartNeeded) and conn is not None:
            # The runner starts the next process; no result from this one.
            info = _sizes_info(state)
            conn.send({"why": exc.why, "ladder": exc.ladder.to_dict() if exc.ladder else {},
                       **{key: state.get(key) for key in _CHOSEN}, "attempts": info["attempts"],
                       "errors": info["errors"], "oom_events": _oom_events(state, out) or []})
            return
        # An ExecutionFailed's own message names the workload and every size tried.
        reason = (str(exc) if isinstance(exc, ExecutionFailed)
                  else f"{type(exc).__name__}: {first_line(exc)[:500]}")
        record = record_failure(task, ctx, sink, reason, "", time.perf_counter() - t0,
                                text="".join(traceback.format_exception(exc)),
                                **_what_ran(state, out))
        log.error("%s failed: %s (traceback in %s)", task.key, reason, out / record.traceback)
    if record.ok:
        sink.write(f"results/{task.key}.json", json_text(record))
        sink.event("success", task=task.key, run=ctx.run_id, seconds=record.seconds,
                   sizes=record.sizes["final"], source=record.sizes["source"],
                   retries=record.sizes["retries"], remedy=record.remedy)


def record_failure(task: Task, ctx: Context, sink: Sink, reason: str, detail: str,
                   seconds: float, *, text: str | None = None, **fields: Any) -> TaskResult:
    """Record a task's failure: the traceback file (``text``; default: ``reason`` and
    ``detail``, for a task whose process wrote no result), the result file (``fields``:
    its other fields), the journal's ``failure``."""
    tb = f"tracebacks/{task.key}.txt"
    sink.write(tb, text if text is not None else f"{task.key}: {reason}\n{detail.rstrip()}\n")
    record = TaskResult.failure(task, ctx.run_id, reason, tb, seconds, device=ctx.device, **fields)
    sink.write(f"results/{task.key}.json", json_text(record))
    sink.event("failure", task=task.key, run=ctx.run_id, reason=reason, traceback=record.traceback)
    return record


def interrupted(say: Callable[..., Any], task: Task, ctx: Context, stop: Any,
                **fields: Any) -> None:
    """Journal through ``say`` (a sink's ``event``, a journal's ``append``) that the job's
    signal ``stop.signum`` interrupted ``task``."""
    say("interrupted", task=task.key, run=ctx.run_id, signal=signal.Signals(stop.signum).name,
        **fields)


def _sizes_info(state: dict[str, Any]) -> dict[str, Any]:
    """Where the sizes came from and every attempt, the task's earlier processes' first."""
    executor: Executor | None = state.get("executor")
    rec = executor.history[-1] if executor and executor.history else None
    prior = state["handoff"]
    attempts = prior.get("attempts", []) + (rec.attempts if rec else [])
    # The configuration only where there was a choice (a metric that can run recomputed).
    chosen = ({key: state.get(key) for key in ("configuration", "configurations")}
              if state.get("configurations") else {})
    return {"start": state.get("start"), "source": state.get("source"),
            "final": rec.final if rec else None, "attempts": attempts,
            "errors": prior.get("errors", []) + (rec.errors if rec else []),
            "retries": max(0, len(attempts) - 1), "cache_key": state.get("cache_key"), **chosen}


def _what_ran(state: dict[str, Any], out: Path, work: Any = None,
              dtype: str = "") -> dict[str, Any]:
    """A result's fields on what ran: sizes, searches, OOM events, the ladder's rungs and
    restarts; with the workload that ran, its precision and whether a remedy lowered it
    below the job's ``dtype``."""
    executor: Executor | None = state.get("executor")
    ladder: Ladder | None = executor.ladder if executor else None
    fields = {"sizes": _sizes_info(state), "search": state.get("search"),
              "searches": state.get("searches"), "oom_events": _oom_events(state, out)}
    if work is not None:
        fields.update(precision=work.precision, lowered_precision=work.precision != dtype)
    if ladder is not None:
        fields.update(remedy=ladder.produced, restarts=list(ladder.restarts),
                      remedies=[dataclasses.asdict(r) for r in ladder.rungs])
    return fields


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


class _KnobTrial:
    """``fn(size)`` for the search: the metric at ``sizes`` but ``knob=size``."""

    def __init__(self, call: Any, knob: str, sizes: dict[str, int], name: str) -> None:
        self.call, self.knob, self.sizes, self.name = call, knob, sizes, name

    def __call__(self, size: int) -> None:
        self.call(**{**self.sizes, self.knob: size})

    def warmup(self) -> None:
        """Nothing: the task warmed its metric up before any budget (``_Work.on_device``),
        on one sample; the search would otherwise call it at size 1 on all of them."""


class _Search:
    """The job's evaluator for :func:`~oomguard.engine.jobs.sizing.choose_sizes`. Each
    knob's search gets at most ``search.max_seconds`` and a third of the task's time limit
    shared by its searches (each knob, in each configuration); one that fails for a reason
    other than memory fails the task."""

    def __init__(self, task: Task, ctx: Context, call: Any, n_searches: int,
                 on_record: Any) -> None:
        self.task, self.ctx, self.call, self.on_record = task, ctx, call, on_record
        self.seconds = task.time_limit / 3 / max(1, n_searches)

    def __call__(self, knob: str, sizes: dict[str, int], unit: int, cap: int
                 ) -> sizing.SearchRecord:
        job = self.ctx.job
        trial = _KnobTrial(self.call, knob, sizes, self.task.key)
        base = SearchConfig.from_options(**job.search.options, device=job.device,
                                         budget=job.budget_bytes)
        config = sizing.knob_config(base, unit, cap, self.seconds)
        try:
            return sizing.measure(trial, config, metric=self.task.metric, strict=True)
        except TrialFailed as exc:  # the task fails, with the trials that ran recorded
            self.on_record(sizing.record_of(exc.result, metric=self.task.metric, unit=unit,
                                            failure=exc))
            raise


def _choose_sizes(task: Task, ctx: Context, metric: Any, work: _Work, sink: Sink,
                  state: dict[str, Any]) -> dict[str, int]:
    """The sizes the run starts at (:func:`~oomguard.engine.jobs.sizing.choose_sizes`);
    every search journaled and kept in ``state``."""
    job = ctx.job
    searches: list[dict[str, Any]] = []

    def record(rec: sizing.SearchRecord) -> None:
        searches.append(rec.to_dict())
        state["search"], state["searches"] = searches[0], searches
        sink.event("search", task=task.key, run=ctx.run_id, **rec.to_dict())

    slot = None
    if metric.memory_knobs() and not task.pinned:
        slot = sizing.Slot(sink, entry_key(ctx.device, task.workload), ctx.device, task.workload)
        state["cache_key"] = slot.key
    searching = ctx.search and job.search.enabled
    both = metric.can_recompute(work.model)
    n_searches = (len(metric.memory_knobs()) - len(task.pinned)) * (2 if both else 1)
    evaluate = _Search(task, ctx, work.call, n_searches, record) if searching else None
    recompute = sizing.Recompute(
        _Search(task, ctx, functools.partial(work.call, recompute=True), n_searches, record)
        if searching else None,
        lambda configuration, sizes: _timed_run(task, ctx, work, configuration, sizes)
    ) if both else None
    request = sizing.Request(metric, task.params, job.data.n_samples, work.model.config,
                             job.search.max_size, task.pinned, task.pinned_from)
    got = sizing.choose_sizes(request, evaluate=evaluate, slot=slot, on_record=record,
                              check=lambda knobs, sizes: require_memory_knobs(
                                  metric, work.model, work.data, {**task.params, **sizes},
                                  knobs=knobs), recompute=recompute)
    state.update(source=got.source, configuration=got.configuration,
                 configurations=got.configurations)
    if got.configurations:
        sink.event("configuration", task=task.key, run=ctx.run_id, chosen=got.configuration,
                   measured=got.configurations)
    return got.sizes


def _run_limit(job: Any) -> Any:
    """The memory limit the metric runs under: the job's budget, else the one an enforced host
    limit (a cgroup: the kernel kills past it) leaves room for, so that running out is a
    retry, never a kill."""
    return limit_budget(job.budget_bytes or None, job.device,
                        None if job.budget_bytes else unbudgeted_limit(job.device))


def _timed_run(task: Task, ctx: Context, work: _Work, configuration: str,
               sizes: dict[str, int]) -> float | None:
    """Wall seconds of one run of the metric in ``configuration`` at ``sizes``, under the
    limit the real run has (measured); None where it ran out of memory."""
    def run() -> None:  # the result is dropped on return, as a search's trial drops it
        work.call(recompute=configuration == sizing.RECOMPUTE, **sizes)

    release_memory(ctx.job.device)
    with _run_limit(ctx.job):
        t0 = time.perf_counter()
        outcome = call_catching_oom(run, device=ctx.job.device, workload=task.key)
        took = time.perf_counter() - t0
    release_memory(ctx.job.device)
    return None if isinstance(outcome, OOM) else took


def _big_tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor) and value.numel() > TENSOR_INLINE_MAX:
        yield prefix, value.detach().cpu()
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _big_tensors(v, f"{prefix}.{k}" if prefix else str(k))


class _Work:
    """The task's metric as the executor calls it; the remedies' hooks: :meth:`at_precision`
    casts the model in place, :meth:`on_device` builds model and data again there, at the
    job's dtype (also the first build). Only it holds the model and the data: a remedy
    may replace them. ``meter`` measures the peak of the device the metric runs on."""

    def __init__(self, task: Task, ctx: Context, metric: Any, sink: Sink) -> None:
        self.task, self.ctx, self.metric, self.sink = task, ctx, metric, sink
        self.model = self.data = None
        self.executor: Executor | None = None  # the run's, once it is made
        self.recompute = False  # the configuration chosen: the model's blocks checkpointed
        self.tolerates_lower_precision = bool(metric.tolerates_lower_precision)

    def __call__(self, **sizes: int) -> dict[str, Any]:
        rec = self.executor.history[-1] if self.executor else None
        if rec is not None and len(rec.attempts) > 1:
            self.sink.event("retry", task=self.task.key, run=self.ctx.run_id, sizes=sizes,
                            after=rec.errors[-1] if rec.errors else None)
        return self.call(**sizes)

    def call(self, *, recompute: bool | None = None, **sizes: int) -> dict[str, Any]:
        """The metric at ``sizes`` (what the size search runs), recomputed or not (None: as
        chosen, :attr:`recompute`)."""
        again = self.recompute if recompute is None else recompute
        return self.metric.run(self.model, self.data, recompute=again, **self.task.params,
                               **sizes)

    def _warm_up_metric(self) -> None:
        """Run the metric once at its minimum sizes on the first sample, before any budget,
        as a search's warm-up does (:func:`~oomguard.engine.core.search.trial.warm_up_trials`):
        imports and one-time setup inside the metric are paid here, not charged to a trial or
        to the run. It is not the work: a failure is logged (debug) and the task goes on."""
        first = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in self.data.items()}
        sizes = sizing.minimums(self.metric)
        failed = None
        # both configurations where the metric may run recomputed: the checkpoint's own setup
        for again in (False, True)[:1 + self.metric.can_recompute(self.model)]:
            try:
                outcome = call_catching_oom(
                    lambda again=again: self.metric.run(self.model, first, recompute=again,
                                                        **self.task.params, **sizes),
                    device=self.ctx.job.device, workload=self.task.key)
                failed = failed or (outcome.message if isinstance(outcome, OOM) else None)
            except Exception as exc:  # noqa: BLE001 - the real run reports its own errors
                failed = failed or f"{type(exc).__name__}: {first_line(exc)[:300]}"
        if failed is not None:  # debug: a metric that fails here mostly fails in its run too
            log.debug("%s: the warm-up at the minimum sizes on one sample failed (%s): "
                      "one-time setup inside the metric is charged to its first call",
                      self.task.key, failed)
        self.model.zero_grad(set_to_none=True)

    def at_precision(self, dtype: torch.dtype) -> _Work:
        self.model.to(dtype)
        self.precision = str(dtype).removeprefix("torch.")
        return self

    def on_device(self, device: str) -> _Work:
        job = self.ctx.job
        if self.model is not None:  # a remedy's move: free the first copies
            self.model = self.data = None
            release_memory(job.device)
        self.model = build_model(self.task.model, job.dtype, device, seed=job.seed)
        self.data = load_data(job.data, self.model.config.vocab_size, seed=job.seed, device=device)
        # Warm up, one forward + backward on one short sample: thread pools and kernels
        # exist before any budget (docs/measurements.md#minimum-cpu-budget), and nothing
        # is charged to the metric.
        ids = self.data["input_ids"][:1, :8]
        with torch.enable_grad():
            self.model(input_ids=ids, labels=ids).loss.backward()
        self.model.zero_grad(set_to_none=True)
        self._warm_up_metric()
        self.precision, self.meter = job.dtype, PeakMeter(device)
        self.meter.reset()
        return self


def _execute(task: Task, ctx: Context, sink: Sink, state: dict[str, Any], t0: float) -> TaskResult:
    job, out = ctx.job, Path(ctx.out)
    if ctx.snapshot_on_oom:  # from the task's start, so the snapshot shows the model too
        start_history(job.device)
    metric = get_metric(task.metric)
    work = _Work(task, ctx, metric, sink).on_device(job.device)
    prior = state["handoff"]
    if prior:  # a fresh process of the same run: the sizes were chosen by the first one
        state.update({key: prior[key] for key in _CHOSEN})
    else:
        state["start"] = _choose_sizes(task, ctx, metric, work, sink, state)
        sink.event("sizes", task=task.key, run=ctx.run_id, sizes=state["start"],
                   source=state["source"])
    work.recompute = state.get("configuration") == sizing.RECOMPUTE
    executor = work.executor = state["executor"] = Executor(
        device=job.device, snapshot_on_oom=out / "snapshots" if ctx.snapshot_on_oom else None,
        on_oom=task.on_oom, fresh_process=True)
    ladder = Ladder.from_dict(prior["ladder"]) if prior else None
    work.meter.reset()
    with _run_limit(job):
        t_run = time.perf_counter()
        result = executor.run(work, sizes=state["start"], minimum=sizing.minimums(metric),
                              name=task.key, ladder=ladder)
        seconds = time.perf_counter() - t_run
    peak = work.meter.read()
    rec, info = executor.history[-1], _sizes_info(state)
    same = executor.ladder is None or executor.ladder.produced in (None, "halve")
    if info["retries"] and state.get("cache_key") and rec.final and same:
        # (sizes that worked after a lower precision or on the CPU say nothing of this one)
        sink.lower(state["cache_key"], rec.final, device=ctx.device, workload=task.workload,
                   reason=f"{task.key}: {info['errors'][-1]}")
    big = dict(_big_tensors(result))
    tensors = None
    if big:
        tensors, blob = f"results/{task.key}.pt", io.BytesIO()
        torch.save(big, blob)
        sink.write(tensors, blob.getvalue())
    summary = to_jsonable(metric.summary(result), max_items=TENSOR_INLINE_MAX)
    return TaskResult.of(
        task, ctx.run_id, OK, seconds=round(seconds, 3),
        total_seconds=round(time.perf_counter() - t0, 3), peak_bytes=peak,
        peak_source=f"measured: {work.meter.source}", budget_bytes=job.budget_bytes,
        summary=summary, tensors=tensors, finished=now_iso(), device=ctx.device,
        threads=torch.get_num_threads(), **_what_ran(state, out, work, job.dtype))
