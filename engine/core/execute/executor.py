"""The executor and the one size controller and retry loop behind every adaptive wrapper.

:class:`SizeController` runs ``attempt(sizes)``; on OOM its retry policy gives smaller sizes,
down to the minimums, then :class:`~oomguard.engine.errors.NoExecutableBatchSize`. Every
adaptive wrapper goes through it. A :class:`SizeAgreement` makes several processes decide
alike; a :class:`SizeMemory` holds what is learnt across calls (numbers only).

Only OOMs are retried, an OOM the function's own code caught included
(:mod:`~oomguard.engine.core.memory.swallowed`); the exception is dropped *before* memory is
released. The first attempt is a plain :func:`~oomguard.engine.core.memory.oom.call_catching_oom`;
tenacity's ``Retrying`` is built only after a first OOM. Every change of size is logged
(WARNING when it shrinks) and counted in :class:`~oomguard.engine.core.execute.stats.SizeStats`.
Past the minimum, the ``on_oom`` ladder takes over (:mod:`~oomguard.engine.core.execute.remedies`).
Every attempt runs inside a :class:`~oomguard.engine.core.execute.clean_retry.CleanRetry`;
``watch_alloc_retries`` steps down early (:mod:`~oomguard.engine.core.execute.alloc_retries`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from tenacity import RetryCallState, Retrying, retry_if_result, wait_none

from oomguard.engine.core.execute.alloc_retries import CONSECUTIVE, AllocRetryWatch
from oomguard.engine.core.execute.clean_retry import CleanRetry, Params
from oomguard.engine.core.execute.remedies import Ladder, parse_on_oom, run_ladder, sized_call
from oomguard.engine.core.execute.retry import Halve, RetryPolicy, RunRecord, Sizes
from oomguard.engine.core.execute.stats import SizeChange, SizeStats
from oomguard.engine.core.memory.forensics import OomEvent, OomWatch, start_history
from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.core.workload import qualname
from oomguard.engine.errors import (
    NoExecutableBatchSize,
    UsageError,
    check_positive_int,
    format_sizes,
)
from oomguard.engine.util.weakmap import WeakIdMap

T = TypeVar("T")
# Sizes that may be unknown: None means "whatever the call's cap is" (the whole input).
Start = Mapping[str, "int | None"]

log = logging.getLogger("oomguard.executor")

MAX_NAMES_KEPT = 1024  # named workloads whose sizes one executor remembers


class SizeAgreement(Protocol):
    """How the processes running one workload agree on its size after each attempt.
    ``active()`` is asked once per call (False: decide alone); then :meth:`agree` after
    *every* attempt with this process's next sizes (zeros: none lower) and whether it ran
    out of memory, returning the sizes every process takes and whether any ran out."""

    def active(self) -> bool: ...

    def agree(self, proposal: Mapping[str, int], oom: bool) -> tuple[Sizes, bool]: ...


def shown(sizes: Mapping[str, int | None]) -> Any:
    """A size as :class:`SizeStats` shows it: the int of a single knob, else a dict."""
    return next(iter(sizes.values())) if len(sizes) == 1 else dict(sizes)


@dataclass(eq=False)
class SizeMemory:
    """What one adaptive size has learnt across calls: ``sizes`` the next call starts at
    (None: the whole input); ``failed`` the smallest failed size per knob; ``last_good``;
    ``clean`` the calls without an OOM since the last change."""

    stats: SizeStats
    sizes: dict[str, int | None]
    failed: dict[str, int] = field(default_factory=dict)
    last_good: Sizes | None = None
    clean: int = 0
    agreed_start: bool = False
    warned: bool = False  # the "gradients left on the module" warning was given

    @classmethod
    def new(cls, name: str, start: Start) -> SizeMemory:
        """A memory with its own, unregistered stats record."""
        return cls(SizeStats(name, shown(start), shown(start)), dict(start))

    @property
    def name(self) -> str:
        return self.stats.name

    def failed_at(self, sizes: Mapping[str, int]) -> None:
        """Count ``sizes`` as failed: the smallest failure per knob, no clean call since."""
        self.clean = 0
        self.failed = {k: min(v, self.failed.get(k, v)) for k, v in sizes.items()}
        self.stats.failed = shown(self.failed)


class _Failed(NamedTuple):
    """The outcome of an attempt that ran out of memory (here or on another process)."""

    message: str
    next: Sizes | None
    event: OomEvent | None = None


class SizeController:
    """Runs attempts at adaptive sizes: shrink on OOM, remember, optionally grow back, agree.

    ``memory``: a shared :class:`SizeMemory` or the start sizes for a new one. On OOM the
    next sizes come from ``policy`` (default :class:`Halve`) down to ``minimum`` (per knob,
    default 1); an OOM at grown sizes falls back to the last sizes that worked.
    ``grow_after`` (off by default) tries larger sizes after that many clean calls: halfway
    to the smallest failed size, else twice, never above ``maximum``. ``device``: whose
    cache is emptied. ``failure_message``: the whole ``str()`` of
    :class:`~oomguard.engine.errors.NoExecutableBatchSize`. ``snapshot_dir``: a CUDA
    snapshot per OOM. ``clean``: what every retry leaves clean. ``watch_alloc_retries``: on
    CUDA, step down on allocator thrashing (off under an agreement)."""

    def __init__(self, name: str, memory: SizeMemory | Start, *,
                 minimum: Mapping[str, int] | None = None,
                 maximum: Mapping[str, int | None] | None = None, policy: RetryPolicy | None = None,
                 grow_after: int | None = None, agreement: SizeAgreement | None = None,
                 device: Any = None, logger: logging.Logger | None = None,
                 failure_message: str | None = None,
                 snapshot_dir: str | os.PathLike[str] | None = None,
                 clean: CleanRetry | None = None, watch_alloc_retries: bool = False) -> None:
        if not isinstance(memory, SizeMemory):
            for key, value in memory.items():
                check_positive_int(key, value, optional=True)
            memory = SizeMemory.new(name, memory)
        self.memory = memory
        self.name = memory.name
        for key, value in (minimum or {}).items():
            check_positive_int(f"minimum {key}", value)
        self.floor: Sizes = {k: (minimum or {}).get(k, 1) for k in memory.sizes}
        self.maximum = {k: v for k, v in (maximum or {}).items() if v is not None}
        for key, value in self.maximum.items():
            check_positive_int(f"maximum {key}", value, optional=True)
        check_positive_int("grow_after", grow_after, optional=True)
        self.policy: RetryPolicy = policy or Halve()
        self.grow_after = grow_after
        self.agreement = agreement  # None: this process decides alone
        self.device = device
        self.log = logger or log
        self.failure_message = failure_message
        what = next(iter(self.floor)).replace("_", " ") if len(self.floor) == 1 else "size"
        self.gave_up = failure_message or (f"no executable {what}: every size down to "
                                           f"{format_sizes(self.floor)} ran out of memory")
        self.snapshot_dir = snapshot_dir
        self.clean = clean or CleanRetry()
        self.alloc_watch = AllocRetryWatch(device) if watch_alloc_retries else None

    @property
    def stats(self) -> SizeStats:
        return self.memory.stats

    @property
    def current(self) -> Any:
        """The remembered size: an int for one knob, a dict for several; None: whole input."""
        return shown(self.memory.sizes)

    def run(self, attempt: Callable[[Sizes], T], cap: Mapping[str, int] | None = None,
            record: RunRecord | None = None) -> T:
        """Return ``attempt(sizes)``, retrying at smaller sizes on OOM. ``cap`` bounds this
        call's sizes only, not what is remembered. ``record`` gets every attempt's sizes,
        every OOM's message and measured event, and the final sizes. Raises
        :class:`~oomguard.engine.errors.NoExecutableBatchSize` when no size fits."""
        mem = self.memory
        mem.stats.calls += 1
        agreeing = self.agreement is not None and self.agreement.active()
        if agreeing and not mem.agreed_start:
            self._agree_start()
        if self.grow_after is not None and mem.clean >= self.grow_after:
            self._grow(cap)
        sizes: Sizes = mem.sizes  # type: ignore[assignment]
        if cap is not None:
            sizes = {k: v if v is not None and v <= cap[k] else cap[k] for k, v in sizes.items()}
        elif None in sizes.values():
            raise UsageError(f"{self.name}: an adaptive size without a start needs a cap; give "
                             "each size a start value, or a max_size")
        watch = None
        if record is not None:
            record.attempts.append(dict(sizes))
            watch = OomWatch(self.name, self.device, self.snapshot_dir)
        alloc_watch = self.alloc_watch if not agreeing else None
        if alloc_watch is not None:
            alloc_watch.start()
        result = self._attempt(attempt, sizes, agreeing, watch)
        if type(result) is not _Failed:
            mem.clean += 1
            mem.last_good = sizes
            if record is not None:
                record.final = dict(sizes)
            if alloc_watch is not None:
                self._step_down_early(sizes, alloc_watch)
            return result
        if alloc_watch is not None:
            alloc_watch.after_oom()
        if record is None:
            record = RunRecord(self.name, [dict(sizes)])
        return self._recover(attempt, result, agreeing, record, watch)

    def _attempt(self, attempt: Callable[[Sizes], T], sizes: Sizes,
                 agreeing: bool, watch: OomWatch | None = None) -> T | _Failed:
        """One attempt at ``sizes``, then (when agreeing) the one agreement. A ``watch``
        measures memory at an OOM, before ``call_catching_oom`` releases it."""
        result = self.clean.call(call_catching_oom, attempt, sizes, device=self.device,
                                 on_oom=watch.at(sizes) if watch is not None else None,
                                 workload=self.name)
        oom = type(result) is OOM
        if not (oom or agreeing):
            return result
        proposal = self._proposal(sizes) if oom else sizes
        any_oom = oom
        if agreeing:
            agreed, any_oom = self.agreement.agree(  # type: ignore[union-attr]
                proposal or dict.fromkeys(sizes, 0), oom)
            proposal = agreed if all(agreed.values()) else None
        if not any_oom:
            return result
        mem = self.memory
        mem.failed_at(sizes)
        mem.stats.ooms += oom
        mem.stats.peer_ooms += not oom
        nxt = proposal if proposal is not None and all(
            proposal[k] >= self.floor[k] for k in proposal) else None
        message = (result.message if oom  # type: ignore[union-attr]
                   else f"another process ran out of memory at {format_sizes(sizes)}")
        # Before a retry: a partly applied step raises here; gradients are cleared.
        self.clean.before_retry(self.name, message, self.memory)
        if nxt is not None:
            self._change(sizes, nxt, f"out of memory ({message})" if oom else message)
        return _Failed(message, nxt, watch.take(message) if oom and watch else None)

    def _proposal(self, sizes: Sizes) -> Sizes | None:
        """The next sizes after an OOM at ``sizes`` (None: nothing smaller is allowed)."""
        good = self.memory.last_good
        if good is not None and good.keys() == sizes.keys() and good != sizes and all(
                self.floor[k] <= good[k] <= sizes[k] for k in sizes):
            return dict(good)  # grown sizes failed: back to what worked
        return self.policy.shrink(sizes, self.floor)

    def _recover(self, attempt: Callable[[Sizes], T], first: _Failed, agreeing: bool,
                 record: RunRecord, watch: OomWatch | None) -> T:
        """After a first OOM: tenacity's retry loop at the sizes each OOM left behind."""
        self._note(record, first)
        pending = first.next

        def again() -> T | _Failed:
            assert pending is not None  # tenacity stops before an attempt without sizes
            record.attempts.append(dict(pending))
            return self._attempt(attempt, pending, agreeing, watch)

        def after(rs: RetryCallState) -> None:
            nonlocal pending
            failure: _Failed = rs.outcome.result()  # type: ignore[union-attr]
            self._note(record, failure)
            pending = failure.next

        def give_up(rs: RetryCallState | None = None) -> Any:
            tried = ", ".join(format_sizes(s) for s in record.attempts)
            self.log.error("%s: no executable size (tried %s)", self.name, tried)
            # A failure_message is the error's whole text (the accelerate shim's words).
            raise NoExecutableBatchSize(self.name, record.attempts, record.errors, self.gave_up,
                                        verbatim=self.failure_message is not None) from None

        if pending is None:
            give_up()
        # Retried until an OOM leaves no smaller sizes; no sleep: memory was released.
        value = Retrying(retry=retry_if_result(lambda r: type(r) is _Failed),
                         stop=lambda rs: rs.outcome.result().next is None,  # type: ignore[union-attr]
                         wait=wait_none(), after=after, retry_error_callback=give_up,
                         sleep=lambda _s: None)(again)
        assert pending is not None
        record.final = dict(pending)
        self.memory.clean, self.memory.last_good = 0, dict(pending)
        self.log.info("%s: succeeded at %s after %d retries", self.name,
                      format_sizes(pending), record.retries)
        return value

    def _step_down_early(self, sizes: Sizes, alloc_watch: AllocRetryWatch) -> None:
        """After a call that worked: step down as on an OOM when the allocator retried in
        consecutive calls (Composer's rule, :mod:`~oomguard.engine.core.execute.alloc_retries`).
        The size counts as failed, so growing back never returns to it."""
        thrash = alloc_watch.after_success()
        if thrash is None:
            return
        nxt = self.policy.shrink(sizes, self.floor)
        if nxt is None:
            return
        self.memory.failed_at(sizes)
        self._change(sizes, nxt, f"the CUDA allocator retried allocations in {CONSECUTIVE} "
                     f"consecutive calls (num_alloc_retries {thrash[0]} -> {thrash[1]}): "
                     "stepping down before an out-of-memory error")

    def _note(self, record: RunRecord, failure: _Failed) -> None:
        """Record an OOM's message and its event, saying what is done about it."""
        record.errors.append(failure.message)
        if failure.event is not None:
            record.events.append(failure.event.settle(failure.next, self.gave_up))

    def _agree_start(self) -> None:
        """The first call under an agreement: every process starts at the smallest start."""
        mem = self.memory
        mem.agreed_start = True
        if None in mem.sizes.values():
            return
        agreed, _ = self.agreement.agree(mem.sizes, False)  # type: ignore[arg-type,union-attr]
        if agreed != mem.sizes:
            self._change(mem.sizes, agreed, "agreed with the other processes")

    def _grow(self, cap: Mapping[str, int] | None) -> None:
        mem, cap = self.memory, cap or {}
        current = {k: v if v is not None else cap.get(k) for k, v in mem.sizes.items()}
        if None in current.values():
            return
        target = {}
        for k, size in current.items():
            assert size is not None
            new = (size + mem.failed[k]) // 2 if k in mem.failed else size * 2
            bounds = (b for b in (self.maximum.get(k), cap.get(k)) if b is not None)
            target[k] = max(min([new, *bounds]), size)
        if target != current:
            mem.clean = 0
            self._change(current, target, f"grow after {self.grow_after} clean calls")

    def _change(self, old: Mapping[str, int | None], new: Sizes, reason: str) -> None:
        st = self.memory.stats
        self.memory.sizes = dict(new)
        st.current = shown(new)
        shrink = any(new[k] < (old[k] or 0) for k in new)
        st.shrinks += shrink
        st.grows += not shrink and new != old
        (self.log.warning if shrink else self.log.info)(
            "%s: %s -> %s: %s", self.name, _show(old), format_sizes(new), reason)
        st.changes.append(SizeChange(self.name, shown(old), shown(new), reason, time.time()))


class Executor:
    """Runs workloads; on OOM retries at smaller sizes; remembers what worked.

    ``policy``, ``device`` and ``agreement`` as in :class:`SizeController`. ``history``
    holds a :class:`RunRecord` per call (the last 1024). ``snapshot_on_oom``: a folder for
    a CUDA allocator snapshot per OOM (``<name>-oom<k>.pickle``). ``on_oom`` (default None:
    halve only) is a remedy ladder such as ``["halve", "bfloat16", "cpu"]``; ``ladder``
    holds what the last run's did. ``fresh_process``: the caller can restart the run in a
    fresh process, so :class:`~oomguard.engine.errors.RestartNeeded` carries the ladder.

    What worked is remembered per ``name=`` (the last 1024), else per live function object;
    a later call starts at the remembered sizes when they are smaller than those asked.
    """

    def __init__(self, policy: RetryPolicy | None = None, device: str | torch.device | None = None,
                 agreement: SizeAgreement | None = None,
                 snapshot_on_oom: str | os.PathLike[str] | None = None,
                 on_oom: Sequence[str] | None = None, fresh_process: bool = False) -> None:
        self.on_oom = parse_on_oom(on_oom) if on_oom is not None else None
        if self.on_oom is not None and agreement is not None:
            raise UsageError("on_oom runs in one process: it cannot be combined with an "
                             "agreement; drop on_oom, or the agreement")
        self.fresh_process = fresh_process
        self.ladder: Ladder | None = None
        self.policy = policy or Halve()
        self.snapshot_on_oom = snapshot_on_oom
        self.device = device
        self.agreement = agreement
        # Bounded: an executor called every training step must not grow forever.
        self.history: deque[RunRecord] = deque(maxlen=1024)
        self._named: OrderedDict[str, SizeMemory] = OrderedDict()
        self._unnamed: WeakIdMap[Any, SizeMemory] = WeakIdMap()

    def run(self, fn: Callable[..., Any], batch_size: int | None = None, *,
            sizes: Mapping[str, int] | None = None, minimum: Mapping[str, int] | None = None,
            name: str | None = None, ladder: Ladder | None = None,
            params: Params | None = None, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Run ``fn(batch_size)``, or ``fn(**sizes)`` for several sizes; on OOM at smaller
        sizes, down to :class:`~oomguard.engine.errors.ExecutionFailed` naming every size
        tried. ``ladder`` resumes one a :class:`~oomguard.engine.errors.RestartNeeded`
        carried. ``params`` and ``optimizer``: what ``fn`` trains, kept clean between retries
        (:mod:`~oomguard.engine.core.execute.clean_retry`)."""
        if (batch_size is None) == (sizes is None):
            raise ValueError("give exactly one of batch_size or sizes")
        positional = sizes is None
        start: Sizes = {"batch_size": batch_size} if positional else dict(sizes)  # type: ignore[arg-type]
        for key, value in start.items():
            check_positive_int(key, value)
        clean = CleanRetry(params, optimizer, fn)
        label = name or qualname(fn)
        if self.snapshot_on_oom is not None:
            start_history(self.device)  # once per process: the snapshot needs the history
        record = RunRecord(workload=label)
        self.history.append(record)
        if self.on_oom is None and ladder is None:
            controller = self._controller(label, self._memory(fn, name, label, start), minimum,
                                          self.device, clean)
            return controller.run(sized_call(fn, positional), cap=start, record=record)
        self.ladder = ladder or Ladder(self.on_oom or ("halve",))

        def run_rung(attempt: Callable[[Sizes], Any], sizes: Sizes, fresh: bool,
                     device: Any) -> Any:
            memory = SizeMemory.new(label, sizes) if fresh else self._memory(fn, name, label,
                                                                             start)
            return self._controller(label, memory, minimum, device, clean).run(
                attempt, cap=sizes, record=record)

        return run_ladder(fn, start, self.ladder, run_rung=run_rung, record=record,
                          name=label, device=self.device, fresh_process=self.fresh_process,
                          positional=positional)

    def _controller(self, label: str, memory: SizeMemory, minimum: Mapping[str, int] | None,
                    device: Any, clean: CleanRetry) -> SizeController:
        return SizeController(label, memory, minimum=minimum, policy=self.policy,
                              agreement=self.agreement, device=device,
                              snapshot_dir=self.snapshot_on_oom, clean=clean)

    def _memory(self, fn: Any, name: str | None, label: str, start: Sizes) -> SizeMemory:
        """What this executor learnt about the workload, or a new memory starting at ``start``."""
        memory = self._named.get(name) if name is not None else self._unnamed.get(fn)
        if name in self._named:
            self._named.move_to_end(name)
        if memory is not None and memory.sizes.keys() == start.keys():
            return memory
        memory = SizeMemory.new(label, start)
        if name is not None:
            self._named[name] = memory
            if len(self._named) > MAX_NAMES_KEPT:
                self._named.popitem(last=False)
        else:
            with contextlib.suppress(TypeError):  # not weakly referenceable: nothing is remembered
                self._unnamed[fn] = memory
        return memory


def _show(sizes: Mapping[str, int | None]) -> str:
    """``batch_size 64`` for one knob, ``(a=1, b=2)`` for several."""
    if len(sizes) == 1:
        name, value = next(iter(sizes.items()))
        return f"{name} {value}"
    return format_sizes(sizes)  # type: ignore[arg-type]
