"""The executor: run a workload at its sizes; on OOM retry at half, never lose the run.

Retrying is tenacity's: a retry policy object (:class:`Halve` by default,
:class:`ReduceWith` for any other rule) says what the next sizes are, and the
retry loop stops when the policy has nothing smaller to offer. Only
out-of-memory errors are retried; any other error propagates at once,
untouched. The OOM's exception and traceback are dropped *before* memory is
released, so the failed attempt's tensors are really freed between attempts.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from oomguard.engine.core.oom import OOM, call_catching_oom
from oomguard.engine.errors import ExecutionFailed, format_sizes
from tenacity import RetryCallState, RetryError, Retrying, retry_if_result, wait_none

log = logging.getLogger("oomguard.executor")

Sizes = dict[str, int]


class RetryPolicy(Protocol):
    """Gives the sizes to retry at after an OOM, or None when it cannot go lower."""

    def shrink(self, sizes: Mapping[str, int], minimum: Mapping[str, int]) -> Sizes | None: ...


@dataclass(frozen=True)
class ReduceWith:
    """Shrink every size with ``fn`` (e.g. ``lambda n: n * 3 // 4``), never below its minimum.

    Sizes already at their minimum stay; when none can shrink, retrying stops.
    """

    fn: Callable[[int], int]

    def shrink(self, sizes: Mapping[str, int], minimum: Mapping[str, int]) -> Sizes | None:
        out: Sizes = {}
        for name, size in sizes.items():
            low = minimum.get(name, 1)
            new = self.fn(size)
            out[name] = new if low <= new < size else size
            if new < low and size > low:  # the rule overshot: stop at the floor
                out[name] = low
        return out if out != dict(sizes) else None


def _half(n: int) -> int:
    return n // 2


@dataclass(frozen=True)
class Halve(ReduceWith):
    """The default policy: halve every tunable size, down to its minimum."""

    fn: Callable[[int], int] = _half


@dataclass
class RunRecord:
    """What one :meth:`Executor.run` did: the sizes of each attempt and the one that worked."""

    workload: str
    attempts: list[Sizes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final: Sizes | None = None

    @property
    def retries(self) -> int:
        return max(0, len(self.attempts) - 1)


class Executor:
    """Runs workloads; on OOM retries at smaller sizes; remembers what worked.

    ``policy`` decides the retry sizes (default :class:`Halve`); ``device`` is
    the one whose cache is emptied between attempts. ``history`` holds a
    :class:`RunRecord` per call (the last 1024), ``known`` the last sizes that worked per
    workload name (used as the starting point of the next call in this
    process when they are smaller than the sizes asked for).
    """

    def __init__(self, policy: RetryPolicy | None = None,
                 device: str | torch.device | None = None) -> None:
        self.policy = policy or Halve()
        self.device = device
        self.known: dict[str, Sizes] = {}
        # Bounded: an executor called every training step must not grow forever.
        self.history: deque[RunRecord] = deque(maxlen=1024)

    def run(
        self,
        fn: Callable[..., Any],
        batch_size: int | None = None,
        *,
        sizes: Mapping[str, int] | None = None,
        minimum: Mapping[str, int] | None = None,
        name: str | None = None,
    ) -> Any:
        """Run ``fn(batch_size)``, or ``fn(**sizes)`` for several tunable sizes.

        On OOM the sizes shrink by the policy and ``fn`` runs again; when they
        cannot shrink any more, :class:`ExecutionFailed` names the workload and
        every size tried. Any error that is not an OOM propagates unchanged.
        Sizes must be positive integers (``ValueError`` otherwise).
        """
        if (batch_size is None) == (sizes is None):
            raise ValueError("give exactly one of batch_size or sizes")
        positional = sizes is None
        start: Sizes = {"batch_size": batch_size} if positional else dict(sizes)  # type: ignore[arg-type]
        for key, value in start.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        floor = dict(minimum or {})
        label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        remembered = self.known.get(label)
        if remembered and remembered.keys() == start.keys():
            start = {k: min(start[k], remembered[k]) for k in start}

        record = RunRecord(workload=label)
        self.history.append(record)
        state: dict[str, Sizes | None] = {"sizes": start, "next": start}

        def attempt() -> Any:
            current = state["next"]
            assert current is not None
            state["sizes"] = current
            record.attempts.append(dict(current))
            if positional:
                return call_catching_oom(fn, current["batch_size"], device=self.device)
            return call_catching_oom(fn, device=self.device, **current)

        def after(rs: RetryCallState) -> None:
            failure: OOM = rs.outcome.result()  # type: ignore[union-attr]
            record.errors.append(failure.message)
            current = state["sizes"]
            assert current is not None
            nxt = self.policy.shrink(current, floor)
            state["next"] = nxt
            if nxt is not None:
                log.warning("%s: out of memory at %s (%s); retrying at %s", label,
                            format_sizes(current), failure.message, format_sizes(nxt))

        retrying = Retrying(
            retry=retry_if_result(lambda r: isinstance(r, OOM)),
            stop=lambda rs: state["next"] is None,
            wait=wait_none(),
            after=after,
            reraise=True,
        )
        try:
            value = retrying(attempt)
        except RetryError:
            log.error("%s: gave up after %d attempts", label, len(record.attempts))
            raise ExecutionFailed(label, record.attempts, record.errors) from None
        record.final = dict(state["sizes"] or {})
        self.known[label] = record.final
        if record.retries:
            log.info("%s: succeeded at %s after %d retries", label, format_sizes(record.final),
                     record.retries)
        return value
