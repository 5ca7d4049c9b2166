"""Adaptive sizes inside training scripts: a decorator, an accelerate-shaped helper, stats.

One class, :class:`AdaptiveSize`, holds a memory-only size (a batch or a
micro-batch, in items) that shrinks on OOM, is remembered across calls, may
grow back, and is agreed between ranks under ``torch.distributed``. The
decorators here and :mod:`oomguard.engine.training.accumulate` are thin layers over it.

Hot path: a call that does not run out of memory costs one
:func:`oomguard.engine.core.oom.call_catching_oom` and a few attribute reads (well under a
microsecond here, plus one 16-byte collective per call under
``torch.distributed``). Tenacity's retry loop (the :class:`~oomguard.engine.core.executor.Executor`,
~30 us per call) is entered only after a first OOM, with a fresh executor
each time, so its history never grows over a long training run.

Every change of size is logged on the ``oomguard.adaptive`` logger (WARNING
when it shrinks, INFO when it grows or is agreed) and counted in
:func:`stats`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from oomguard.engine.core.executor import Executor, Halve, ReduceWith, RetryPolicy, Sizes
from oomguard.engine.core.oom import OOM, call_catching_oom
from oomguard.engine.errors import ExecutionFailed, NoExecutableBatchSize
from oomguard.engine.training import distributed

log = logging.getLogger("oomguard.adaptive")

T = TypeVar("T")
KEY = "batch_size"
MAX_CHANGES_KEPT = 100  # per size; older changes are only counted
ZERO_MESSAGE = "No executable batch size found, reached zero."  # accelerate's wording


@dataclass(frozen=True)
class SizeChange:
    """One change of an adaptive size: ``old`` -> ``new`` items, why, and when (Unix seconds)."""

    name: str
    old: int
    new: int
    reason: str
    at: float


@dataclass
class SizeStats:
    """The summary of one adaptive size (sizes in items; ``start`` None means "whole batch")."""

    name: str
    start: int | None
    current: int | None
    calls: int = 0
    ooms: int = 0  # OOMs on this rank
    peer_ooms: int = 0  # attempts this rank redid because another rank ran out of memory
    shrinks: int = 0
    grows: int = 0
    failed: int | None = None  # smallest size that ran out of memory in this run (any rank)
    changes: deque[SizeChange] = field(default_factory=lambda: deque(maxlen=MAX_CHANGES_KEPT))


@dataclass(frozen=True)
class Stats:
    """What :func:`stats` returns: one :class:`SizeStats` per adaptive size, by name."""

    sizes: dict[str, SizeStats]

    @property
    def ooms(self) -> int:
        return sum(s.ooms for s in self.sizes.values())

    @property
    def changes(self) -> int:
        return sum(s.shrinks + s.grows for s in self.sizes.values())

    def __getitem__(self, name: str) -> SizeStats:
        return self.sizes[name]

    def __str__(self) -> str:
        head = f"{'size':40} {'start':>7} {'now':>7} {'calls':>7} {'ooms':>5} {'peer':>5} " \
               f"{'shrink':>6} {'grow':>5} {'failed':>7}"
        rows = [head] + [
            f"{s.name[:40]:40} {_fmt(s.start):>7} {_fmt(s.current):>7} {s.calls:>7} {s.ooms:>5} "
            f"{s.peer_ooms:>5} {s.shrinks:>6} {s.grows:>5} {_fmt(s.failed, '-'):>7}"
            for s in self.sizes.values()
        ]
        return "\n".join(rows)


_REGISTRY: dict[str, SizeStats] = {}


def stats() -> Stats:
    """A snapshot of every adaptive size in this process: sizes, OOMs, shrinks and grows."""
    copies = {}
    for name, s in _REGISTRY.items():
        copy = SizeStats(**{k: v for k, v in vars(s).items() if k != "changes"})
        copy.changes.extend(s.changes)
        copies[name] = copy
    return Stats(copies)


def reset_stats() -> None:
    """Zero the counters of every adaptive size (current sizes and failed sizes are kept)."""
    for s in _REGISTRY.values():
        s.calls = s.ooms = s.peer_ooms = s.shrinks = s.grows = 0
        s.changes.clear()


def _register(name: str, start: int | None) -> SizeStats:
    unique, n = name, 1
    while unique in _REGISTRY:
        n += 1
        unique = f"{name}#{n}"
    _REGISTRY[unique] = SizeStats(name=unique, start=start, current=start)
    return _REGISTRY[unique]


def _exhausted(minimum: int) -> str:
    return f"no executable batch size: every size down to {minimum} ran out of memory"


def _fmt(size: int | None, none: str = "whole") -> str:
    return none if size is None else str(size)


@dataclass
class _Agreed:
    """The retry policy handed to the executor: the size :class:`AdaptiveSize` already agreed."""

    owner: AdaptiveSize

    def shrink(self, sizes: Sizes, minimum: Sizes) -> Sizes | None:
        nxt = self.owner.next_size
        return None if nxt is None else {KEY: nxt}


class AdaptiveSize:
    """A memory-only size that shrinks on OOM, is remembered, may grow back, and is agreed.

    ``start`` is the first size tried (items; None: the whole input, see
    ``cap`` in :meth:`run`). On OOM the next size comes from ``policy``
    (default :class:`~oomguard.engine.core.executor.Halve`) down to ``minimum``; after an
    OOM at a size reached by growing, it falls back to the last size that
    worked. ``grow_after`` (off by default, for bit-for-bit reproducible
    runs) tries a larger size after that many clean calls: halfway to the
    smallest size that failed in this run (never that size or above), else
    twice the size, never above ``maximum``. ``failure_message`` replaces
    the text of :class:`NoExecutableBatchSize`.
    """

    def __init__(self, name: str, start: int | None, *, minimum: int = 1,
                 maximum: int | None = None, policy: RetryPolicy | None = None,
                 grow_after: int | None = None, device: Any = None, group: Any = None,
                 failure_message: str | None = None) -> None:
        for label, value in (("start", start), ("maximum", maximum)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{label} must be a positive integer or None, got {value!r}")
        if not isinstance(minimum, int) or minimum < 1:
            raise ValueError(f"minimum must be a positive integer, got {minimum!r}")
        if grow_after is not None and (not isinstance(grow_after, int) or grow_after < 1):
            raise ValueError(f"grow_after must be a positive integer or None, got {grow_after!r}")
        self.stats = _register(name, start)
        self.name = self.stats.name
        self.size = start
        self.minimum, self.maximum = minimum, maximum
        self.policy: RetryPolicy = policy or Halve()
        self.grow_after, self.device, self.group = grow_after, device, group
        self.failure_message = failure_message
        self.failed: int | None = None
        self.next_size: int | None = None
        self._clean = 0
        self._last_good: int | None = None
        self._agreed_start = False

    def run(self, attempt: Callable[[int], T], cap: int | None = None) -> T:
        """Return ``attempt(size)``, retrying at smaller sizes on OOM.

        ``cap`` bounds the size of this call only (e.g. the length of this
        batch) without changing what is remembered. Raises
        :class:`NoExecutableBatchSize` when no size fits on every rank;
        any other error propagates untouched.
        """
        self.stats.calls += 1
        dist_on = distributed.is_active()
        if dist_on and not self._agreed_start:
            self._agreed_start = True
            if self.size is not None:
                agreed = distributed.agree(self.size, False, self.group).size
                if agreed != self.size:
                    self._change(self.size, agreed, "agreed with the other ranks")
        if self.grow_after is not None and self._clean >= self.grow_after:
            self._grow(cap)
        size = self.size if self.size is not None and (cap is None or self.size <= cap) else cap
        if size is None:
            raise ValueError("an adaptive size without a start needs a cap")
        result = self._attempt(attempt, size, dist_on)
        if type(result) is not OOM:
            self._clean += 1
            self._last_good = size
            return result
        return self._recover(attempt, size, result, dist_on)

    def _attempt(self, attempt: Callable[[int], T], size: int, dist_on: bool) -> T | OOM:
        """One attempt at ``size``, then (under distributed) the one agreement."""
        result = call_catching_oom(attempt, size, device=self.device)
        oom = type(result) is OOM
        if not (oom or dist_on):
            return result
        proposal = self._proposal(size) if oom else size
        any_oom = oom
        if dist_on:
            agreed = distributed.agree(proposal, oom, self.group)
            proposal, any_oom = agreed.size, agreed.any_oom
        if not any_oom:
            return result
        self._clean = 0
        self.failed = size if self.failed is None else min(self.failed, size)
        self.stats.failed = self.failed
        self.stats.ooms += oom
        self.stats.peer_ooms += not oom
        self.next_size = proposal if proposal >= self.minimum else None
        if self.next_size is not None:
            why = (f"out of memory ({result.message})" if oom  # type: ignore[union-attr]
                   else "out of memory on another rank")
            self._change(size, self.next_size, why)
        return result if oom else OOM(f"another rank ran out of memory at {KEY} {size}")

    def _proposal(self, size: int) -> int:
        """The next size after an OOM at ``size`` (0: nothing smaller is allowed)."""
        if self._last_good is not None and self.minimum <= self._last_good < size:
            return self._last_good  # a grown size failed: back to what worked
        out = self.policy.shrink({KEY: size}, {KEY: self.minimum})
        return out[KEY] if out else 0

    def _recover(self, attempt: Callable[[int], T], size: int, failure: OOM,
                 dist_on: bool) -> T:
        """After a first OOM: tenacity's retry loop (the executor) at the agreed sizes."""
        tried, errors = [size], [failure.message]
        if self.next_size is not None:
            executor = Executor(policy=_Agreed(self), device=self.device)
            try:
                value = executor.run(lambda s: self._attempt(attempt, s, dist_on),
                                     batch_size=self.next_size, minimum={KEY: self.minimum},
                                     name=self.name)
            except ExecutionFailed as exc:
                tried += [s[KEY] for s in exc.tried]
                errors += exc.errors
            else:
                final = executor.history[-1].final
                self._clean, self._last_good = 0, final[KEY] if final else self.size
                return value
        log.error("%s: no executable size (tried %s)", self.name, ", ".join(map(str, tried)))
        raise NoExecutableBatchSize(self.name, [{KEY: t} for t in tried], errors,
                                    self.failure_message or _exhausted(self.minimum))

    def _grow(self, cap: int | None) -> None:
        current = self.size if self.size is not None else cap
        if current is None:
            return
        target = (current + self.failed) // 2 if self.failed is not None else current * 2
        for bound in (self.maximum, cap):
            if bound is not None:
                target = min(target, bound)
        if target > current:
            self._clean = 0
            self._change(current, target, f"grow after {self.grow_after} clean calls")

    def _change(self, old: int, new: int, reason: str) -> None:
        self.size = self.stats.current = new
        if new < old:
            self.stats.shrinks += 1
            log.warning("%s: %s %d -> %d: %s", self.name, KEY, old, new, reason)
        else:
            self.stats.grows += new > old
            log.info("%s: %s %d -> %d: %s", self.name, KEY, old, new, reason)
        self.stats.changes.append(SizeChange(self.name, old, new, reason, time.time()))


def _batch_size_guard(fn: Callable[..., Any]) -> Callable[[tuple, dict], None]:
    """A check that raises TypeError when the caller passes the batch size the decorator supplies."""
    fname = getattr(fn, "__name__", type(fn).__name__)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return lambda args, kwargs: None
    if not params:
        raise TypeError(f"`{fname}` must take the batch size as its first argument")
    first = params[0].name
    rest = params[1:]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in rest)
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in rest)

    def guard(args: tuple, kwargs: dict) -> None:
        if first in kwargs or (not varargs and len(args) > positional):
            shown = ", ".join([str(a) for a in args[1:]] +
                              [f"{k}={v}" for k, v in kwargs.items() if k != first])
            raise TypeError(
                f"Batch size was passed into `{fname}` as the first argument when called; "
                f"remove it, the decorator supplies it: `{fname}({shown})`")

    return guard


def _wrap(fn: Callable[..., T], state: AdaptiveSize | None) -> Callable[..., T]:
    guard = _batch_size_guard(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        guard(args, kwargs)
        if state is None:  # find_executable_batch_size(starting_batch_size=0)
            raise NoExecutableBatchSize(getattr(fn, "__qualname__", "fn"), [], [], ZERO_MESSAGE)
        return state.run(lambda size: fn(size, *args, **kwargs))

    call.adaptive_size = state  # type: ignore[attr-defined]
    return call


def adaptive(fn: Callable[..., T] | None = None, *, batch_size: int = 64, minimum: int = 1,
             maximum: int | None = None, policy: RetryPolicy | None = None,
             grow_after: int | None = None, device: Any = None, group: Any = None,
             name: str | None = None) -> Any:
    """Decorate ``fn(batch_size, ...)`` so that an OOM costs a retry at a smaller size.

    The decorated function is called without its batch size: the decorator
    supplies it (passing one raises ``TypeError``). On OOM it is called again
    at half the size (or by ``policy``) down to ``minimum``; then
    :class:`NoExecutableBatchSize` ("no executable batch size: every size down
    to 1 ran out of memory", with the sizes tried). Any other error propagates
    untouched. The size that worked is kept for later calls; ``grow_after``
    clean calls let it grow back, never above ``maximum`` (default
    ``batch_size``) nor to a size that failed. Under ``torch.distributed``
    every rank takes the same size (see :mod:`oomguard.engine.training.distributed`): a rank
    whose call succeeded runs again at the agreed smaller size when another
    rank ran out of memory, so ``fn`` must be safe to re-run, as after an
    OOM. The wrapper's ``adaptive_size`` attribute is its
    :class:`AdaptiveSize`. Usable as ``@adaptive`` or ``@adaptive(batch_size=...)``.
    """
    def decorate(f: Callable[..., T]) -> Callable[..., T]:
        state = AdaptiveSize(name or _qualname(f), batch_size, minimum=minimum,
                             maximum=maximum or batch_size, policy=policy,
                             grow_after=grow_after, device=device, group=group)
        return _wrap(f, state)

    return decorate if fn is None else decorate(fn)


def find_executable_batch_size(function: Callable[..., T] | None = None,
                               starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[..., int] | None = None) -> Any:
    """accelerate's helper, same call shape: switch with one import line.

    ``function(batch_size, ...)`` is called at ``starting_batch_size``, then,
    after each OOM, at half the size or at what ``reduce_batch_size_fn``
    returns (either ``fn(size) -> int`` or accelerate's zero-argument form
    ``fn() -> int``). At zero, ``RuntimeError("No executable batch size found,
    reached zero.")`` (a :class:`NoExecutableBatchSize`). Usable as
    ``@find_executable_batch_size``, ``@find_executable_batch_size(starting_batch_size=64)``
    or ``find_executable_batch_size(fn, 64)``.
    """
    if function is None:
        return functools.partial(find_executable_batch_size,
                                 starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    if starting_batch_size <= 0:
        return _wrap(function, None)
    policy = Halve() if reduce_batch_size_fn is None else ReduceWith(_unary(reduce_batch_size_fn))
    state = AdaptiveSize(_qualname(function), starting_batch_size, policy=policy,
                         failure_message=ZERO_MESSAGE)
    return _wrap(function, state)


def _unary(fn: Callable[..., int]) -> Callable[[int], int]:
    """Accept both ``fn(size)`` and accelerate's ``fn()`` (which tracks the size itself)."""
    try:
        takes_size = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                         for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        takes_size = True
    return fn if takes_size else (lambda _size: fn())


def _qualname(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
