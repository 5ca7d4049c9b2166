"""The out-of-memory remedy ladder: what to try once retrying at half has failed.

``Executor(on_oom=["halve", "bfloat16", "expandable_segments", "cpu"])`` (or ``on_oom``
in a job file) runs the rungs in the order given; each one runs the workload again
through the executor's retry at half, from the call's start sizes:

- ``halve``: the executor's own retry at half down to the minimums; always first.
- ``bfloat16`` / ``float16``: ``at_precision(dtype)``, only for a workload that declares
  ``tolerates_lower_precision = True``; its result is flagged.
- ``expandable_segments``: a fresh process with that allocator setting (CUDA only), for a
  caller that can start one (``fresh_process=True``: :class:`RestartNeeded`); else skipped.
- ``cpu``: ``on_device("cpu")``, after logging a time estimate.

A rung keeps what earlier rungs changed (a lower precision stays). Between attempts
(:class:`_Checked`): memory must come back (else :class:`RestartNeeded`), and two failed
attempts in a row with the same remedy, sizes and error raise :class:`NoProgress`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from oomguard.engine.core.execute.retry import RunRecord, Sizes
from oomguard.engine.core.memory.heap import free_heap_bytes
from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.errors import (
    NoExecutableBatchSize,
    NoProgress,
    RestartNeeded,
    UsageError,
    format_sizes,
)
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import host
from oomguard.probes.device import resolve_device
from oomguard.probes.peak import cuda_async_backend

T = TypeVar("T")
log = logging.getLogger("oomguard.executor")

REMEDIES = ("halve", "bfloat16", "float16", "expandable_segments", "cpu")
PRECISIONS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"
# Bytes still in use after an OOM's clean-up, above their value before the failed attempt,
# that count as memory that did not come back (measured: docs/measurements.md#memory-back-after-oom).
MEMORY_BACK_TOLERANCE = 16 * 1024**2
# How much slower the CPU rung is assumed to run than the GPU attempts: stated, not measured.
CPU_SLOWDOWN = 30.0


def parse_on_oom(value: Any) -> tuple[str, ...]:
    """The remedy names of ``value`` (a list of strings), checked: a one-line
    :class:`UsageError` for anything a ladder cannot be."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) for v in value):
        raise UsageError(f"on_oom: expected a list of remedy names like [\"halve\", "
                         f"\"bfloat16\"], got {value!r}; give such a list")
    names = tuple(value)
    for name in names:
        if name not in REMEDIES:
            raise UsageError(f"on_oom: unknown remedy {name!r}: use one of "
                             f"{', '.join(REMEDIES)}")
    if not names or names[0] != "halve":
        raise UsageError(f"on_oom: the first remedy must be \"halve\" (the executor's retry "
                         f"at half), got {list(names)}; start the list with it")
    for i, name in enumerate(names):
        if name in names[:i]:
            raise UsageError(f"on_oom: {name!r} is given twice; list each remedy once")
    if "bfloat16" in names and "float16" in names:
        raise UsageError("on_oom: give one lower precision, bfloat16 or float16, not both")
    if "cpu" in names and names[-1] != "cpu":
        raise UsageError("on_oom: \"cpu\" must come last (no GPU remedy applies on the CPU); move it to "
                         "the end")
    return names


@dataclass
class Rung:
    """What one remedy did: ``outcome`` ``ok``, ``failed`` or ``skipped`` (``why``); the
    sizes of its attempts; for ``cpu`` the estimate logged before it started (seconds)."""

    remedy: str
    outcome: str
    why: str = ""
    attempts: list[Sizes] = field(default_factory=list)
    estimate_s: float | None = None

    def line(self) -> str:
        return f"{self.remedy} {self.outcome}" + (f" ({self.why})" if self.why else "")


@dataclass
class Ladder:
    """The state of one workload's ladder (plain data: it crosses into a fresh process):
    ``at`` the rung running; ``resume`` the sizes to go on at; ``precision``/``device``
    what earlier rungs changed; ``fresh_for`` the rung this process was started for; ``env``
    the next process's variables; ``restarts`` why each was started; ``last`` the last
    failed ``[remedy, sizes, error]``; ``seconds`` every attempt's; ``produced`` the
    remedy of the result (None: the first attempt worked)."""

    remedies: tuple[str, ...]
    at: int = 0
    resume: Sizes | None = None
    rungs: list[Rung] = field(default_factory=list)
    precision: str | None = None
    device: str | None = None
    fresh_for: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    restarts: list[str] = field(default_factory=list)
    last: list[Any] | None = None
    seconds: list[float] = field(default_factory=list)
    produced: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Ladder:
        return cls(**{**doc, "remedies": tuple(doc["remedies"]),
                      "rungs": [Rung(**r) for r in doc.get("rungs", ())]})

    def reason(self) -> str:
        """One line: every remedy tried, and why it failed or was skipped."""
        return "fits nowhere: " + "; ".join(r.line() for r in self.rungs)

    def failed(self, remedy: str, sizes: Sizes, error: str) -> str | None:
        """Note a failed attempt; the no-progress message when it repeats the last one."""
        now = [remedy, dict(sizes), error]
        repeat, self.last = now == self.last, now
        return (f"no progress: two attempts in a row ran out of memory with the same remedy "
                f"({remedy}), the same sizes ({format_sizes(sizes)}) and the same error"
                ) if repeat else None


def _restart(name: str, record: RunRecord, ladder: Ladder, why: str, shown: str) -> RestartNeeded:
    exc = RestartNeeded(name, record.attempts, record.errors, shown)
    exc.ladder, exc.why = ladder, why
    return exc


def live_bytes(device: Any) -> tuple[int | None, str]:
    """Bytes this process has in use on ``device`` now (measured), and how: CPU ``VmData``
    minus glibc's free heap chunks; CUDA ``memory_allocated``; None where unreadable."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        # why: probes.cuda imports CUDA helpers; only a CUDA run needs them.
        from oomguard.probes import cuda

        return cuda.allocator_stats(dev.index)["allocated"], "CUDA memory_allocated"
    if dev.type != "cpu":
        return None, f"not measured on {dev.type}"
    vm_data = host.proc_status("VmData")
    if vm_data is None:
        return None, "no /proc/self/status"
    free = free_heap_bytes()
    return vm_data - (free or 0), "VmData" + (" - free heap" if free is not None else "")


def device_kind(device: Any) -> str:
    """``cuda``, ``cpu``, ``mps``: None means CUDA where this process has a context, else CPU
    (:func:`~oomguard.probes.device.resolve_device`)."""
    return resolve_device(device).type


def apply_env(env: dict[str, str]) -> None:
    """Set a fresh process's variables before anything uses CUDA, and tell the allocator
    directly where torch can (its settings may be read already)."""
    os.environ.update(env)
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if ALLOC_CONF in env and setter is not None and torch.cuda.is_available():
        try:
            setter(env[ALLOC_CONF])
        except Exception as exc:  # noqa: BLE001 - an older torch reads only the variable
            log.info("allocator settings not changed at run time (%s): the variable holds", exc)


def cpu_estimate(seconds: Sequence[float], kind: str) -> tuple[float, str]:
    """Seconds the CPU rung is estimated to take (the longest attempt so far times
    :data:`CPU_SLOWDOWN`), and the line that says so."""
    longest = max(seconds, default=0.0)
    est = longest * CPU_SLOWDOWN
    return est, (f"estimated {est:.1f} s or more: the longest attempt on {kind} ran "
                 f"{longest:.2f} s before running out of memory, times {CPU_SLOWDOWN:g}, a "
                 "stated CPU/GPU time ratio, not measured here")


class _Checked:
    """One rung's attempt function: before a retry, the ladder moved and memory came back."""

    def __init__(self, call: Callable[[Sizes], Any], ladder: Ladder, remedy: str,
                 record: RunRecord, name: str, device: Any, fresh_process: bool) -> None:
        self.call, self.ladder, self.remedy, self.record = call, ladder, remedy, record
        self.name, self.device, self.fresh_process = name, device, fresh_process
        self.before: int | None = None
        self.runs = 0

    def __call__(self, sizes: Sizes) -> Any:
        if self.runs:  # a retry: the attempt before it ran out of memory
            self.progress(self.record.attempts[-2], pending=True)
            now = self.memory_back(self.record.attempts[-2], sizes)
        else:
            now, _ = live_bytes(self.device)
        self.runs += 1
        self.before = now
        t0 = time.perf_counter()
        try:
            return self.call(sizes)
        finally:
            self.ladder.seconds.append(time.perf_counter() - t0)

    def progress(self, failed: Sizes, pending: bool = False) -> None:
        """Note the OOM at ``failed``; :class:`NoProgress` when it repeats the one before."""
        rec = self.record
        stop = self.ladder.failed(self.remedy, failed, rec.errors[-1] if rec.errors else "")
        if stop is None:
            return
        log.error("%s: %s", self.name, stop)
        if pending:
            rec.attempts.pop()  # the retry the controller recorded does not run
        if rec.events:
            rec.events[-1].settle(None, stop)
        raise NoProgress(self.name, rec.attempts, rec.errors, stop)

    def memory_back(self, failed: Sizes, pending: Sizes | None) -> int | None:
        """Bytes in use now; :class:`RestartNeeded` when more than the tolerance is still in
        use since before ``failed`` (resuming at ``pending``, else the next rung)."""
        now, how = live_bytes(self.device)
        if now is None or self.before is None or now - self.before <= MEMORY_BACK_TOLERANCE:
            return now
        rec = self.record
        why = (f"memory did not come back after the OOM at {format_sizes(failed)}: "
               f"{fmt_bytes(now - self.before)} more in use than before that attempt "
               f"({how}; tolerance {fmt_bytes(MEMORY_BACK_TOLERANCE)}), so something keeps "
               "its tensors")
        if pending is not None:
            rec.attempts.pop()  # it runs in the fresh process instead
        self.ladder.resume = dict(pending) if pending is not None else None
        self.ladder.restarts.append(why)
        if rec.events:
            rec.events[-1].settle(None, "restart in a fresh process: " + why)
        return_here = "" if self.fresh_process else "; not retried in this process: run it again"
        raise _restart(self.name, rec, self.ladder, why, why + return_here)


def expandable_in_force() -> bool:
    """Whether this process's CUDA allocator was started with expandable segments
    (:data:`ALLOC_CONF` holds :data:`EXPANDABLE`)."""
    return EXPANDABLE in os.environ.get(ALLOC_CONF, "")


def expandable_unavailable(kind: str) -> str | None:
    """Why expandable segments cannot apply on a device of ``kind`` (``cuda``, ``cpu``, ...),
    or None: CUDA only, and not under ``backend:cudaMallocAsync``."""
    if kind != "cuda":
        return "CUDA only"
    if cuda_async_backend():
        return "backend:cudaMallocAsync has no expandable segments"
    return None


def _skip(remedy: str, work: Any, kind: str, ladder: Ladder, fresh_process: bool) -> str | None:
    """Why ``remedy`` cannot apply here, or None."""
    if remedy in PRECISIONS:
        current = getattr(work, "precision", None)
        if not getattr(work, "tolerates_lower_precision", False):
            return "the workload does not declare tolerates_lower_precision = True"
        if current in PRECISIONS or ladder.precision is not None:
            return f"already at {ladder.precision or current}"
        if not callable(getattr(work, "at_precision", None)):
            return "the workload has no at_precision(dtype) to lower its precision"
    elif remedy == "expandable_segments":
        unavailable = expandable_unavailable(kind)
        if unavailable is not None:
            return unavailable
        if expandable_in_force() and ladder.fresh_for != ladder.at:
            return f"already in force ({ALLOC_CONF}={os.environ[ALLOC_CONF]})"
        if not fresh_process:
            return (f"needs a fresh process (oomguard run starts one; in Python start yours "
                    f"with {ALLOC_CONF}={EXPANDABLE})")
    elif remedy == "cpu":
        if kind == "cpu":
            return "already on cpu"
        if not callable(getattr(work, "on_device", None)):
            return "the workload has no on_device(device) to move it"
    return None


def run_ladder(fn: Any, start: Sizes, ladder: Ladder, *,
               run_rung: Callable[[Callable[[Sizes], Any], Sizes, bool, Any], T], record: RunRecord,
               name: str, device: Any, fresh_process: bool, positional: bool) -> T:
    """Run ``fn`` through the rungs of ``ladder`` from ``ladder.at``; the first result.
    ``run_rung(attempt, sizes, fresh, device)`` is one retry at half from ``sizes``
    (``fresh``: nothing remembered). Raises :class:`NoExecutableBatchSize` listing every
    remedy, :class:`NoProgress`, or :class:`RestartNeeded`."""
    work = fn
    if ladder.device is not None:  # what earlier rungs changed, again in a fresh process
        work, device = work.on_device(ladder.device), ladder.device
    elif ladder.precision is not None:
        work = work.at_precision(PRECISIONS[ladder.precision])
    kind = device_kind(device)
    checked: _Checked | None = None
    while ladder.at < len(ladder.remedies):
        remedy = ladder.remedies[ladder.at]
        why = _skip(remedy, work, kind, ladder, fresh_process)
        if why is not None:
            ladder.rungs.append(Rung(remedy, "skipped", why))
            log.warning("%s: %s skipped: %s", name, remedy, why)
            ladder.at += 1
            continue
        if checked is not None:  # memory came back before another rung runs here
            checked.memory_back(record.attempts[-1], None)
        if remedy == "expandable_segments" and ladder.fresh_for != ladder.at:
            ladder.fresh_for = ladder.at
            prior = os.environ.get(ALLOC_CONF)
            ladder.env[ALLOC_CONF] = f"{prior},{EXPANDABLE}" if prior else EXPANDABLE
            why = f"{remedy}: a fresh process with {ALLOC_CONF}={ladder.env[ALLOC_CONF]}"
            ladder.restarts.append(why)
            raise _restart(name, record, ladder, why, why)
        rung = Rung(remedy, "running")
        if remedy in PRECISIONS:
            cast = call_catching_oom(work.at_precision, PRECISIONS[remedy], device=device)
            if isinstance(cast, OOM):  # the cast itself ran out: a failed rung, the next one tried
                _cast_failed(rung, cast, ladder, name)
                continue
            work, ladder.precision = cast, remedy
        elif remedy == "cpu":
            rung.estimate_s, line = cpu_estimate(ladder.seconds, kind)
            log.warning("%s: moving to the CPU: %s", name, line)
            work, device, kind, ladder.device = work.on_device("cpu"), "cpu", "cpu", "cpu"
        if ladder.at > 0:
            log.warning("%s: trying remedy %s", name, remedy)
        ladder.rungs.append(rung)
        first, resume, ladder.resume = len(record.attempts), ladder.resume, None
        checked = _Checked(sized_call(work, positional), ladder, remedy, record, name, device,
                           fresh_process)
        try:
            value = run_rung(checked, resume or start, ladder.at > 0, device)
        except RestartNeeded as exc:
            rung.outcome, rung.why, rung.attempts = "restarted", exc.why, record.attempts[first:]
            raise
        except NoExecutableBatchSize as exc:
            rung.outcome, rung.why, rung.attempts = "failed", exc.message, record.attempts[first:]
            if not isinstance(exc, NoProgress):
                checked.progress(record.attempts[-1])
                ladder.at += 1
                continue
            raise
        rung.outcome, rung.attempts = "ok", record.attempts[first:]
        ladder.produced = None if len(ladder.seconds) == 1 else remedy
        return value
    raise NoExecutableBatchSize(name, record.attempts, record.errors, ladder.reason())


def _cast_failed(rung: Rung, oom: OOM, ladder: Ladder, name: str) -> None:
    """Record ``rung`` (a lower precision) as failed because casting ran out of memory, and
    move on: the later rungs rebuild the model (``cpu``) or restart (``expandable_segments``)."""
    rung.outcome = "failed"
    rung.why = f"casting the model to {rung.remedy} ran out of memory ({oom.message})"
    ladder.rungs.append(rung)
    log.warning("%s: %s", name, rung.why)
    ladder.at += 1


def sized_call(work: Any, positional: bool) -> Callable[[Sizes], Any]:
    """``work(batch_size)`` when ``positional``, else ``work(**sizes)``, as an attempt."""
    return (lambda s: work(s["batch_size"])) if positional else (lambda s: work(**s))
