"""The workload protocol: what oomguard asks of the work it sizes, runs and estimates.

A workload is any callable ``fn(size)`` (:class:`Workload`) that runs the work once at
``size`` items (whatever its memory knob counts) and returns a small result (recorded as
plain JSON): all that :func:`~oomguard.engine.core.search.search.search`, the
:class:`~oomguard.engine.core.execute.executor.Executor` and
:func:`~oomguard.engine.core.estimate.estimate.estimate` need. Everything below is
optional, read only through the helper named after it.

Attributes: ``name`` (default ``__name__``, else the class name: :func:`name_of`), ``knob``
(what ``size`` is called, default ``batch_size``: :func:`knob_of`), ``steps_per_trial``
(calls per search trial, default 1: :func:`steps_of`), ``preload`` (modules an isolated
trial's forkserver imports once: :func:`preload_of`), ``catches_own_errors`` (True: the
work catches exceptions itself, so every step of a trial runs with the swallowed-OOM
detector, not only the first: :func:`catches_own_errors`).

Methods:

- ``warmup()``: called once per process before the budget and the first trial (never by
  the executor). Build the model and data here and run the work once at its smallest size,
  so a trial's peak counts only what one call adds; without one, a search calls ``fn(1)``
  first. :func:`warm_up`
- ``worst_case_batch(size)``: the batch of ``size`` items that costs the most memory;
  trials and estimates then call ``fn(size, batch=fn.worst_case_batch(size))``.
  :func:`worst_case_maker`
- ``estimate_peak(size, device) -> int``: the workload's own estimated peak bytes at
  ``size`` on ``device``, above what existed before the call. :func:`own_estimate`
- ``for_estimate(device) -> workload``: the copy an estimate runs under fake tensors
  (typically built with :func:`fake_module`). :func:`estimate_copy`
- The ``on_oom`` remedies (:mod:`~oomguard.engine.core.execute.remedies`):
  ``tolerates_lower_precision = True`` with ``at_precision(dtype) -> workload``, and
  ``on_device(device) -> workload``.

An isolated trial pickles the workload into a fresh process and calls ``warmup()`` there;
with :class:`RebuiltInChild`, what ``warmup()`` keeps in ``self._state`` is not shipped.

Inside an estimate a workload may call :func:`shortcut`, :func:`host_device`,
:func:`fake_module` and :func:`replays_workspace`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

from oomguard.engine.core.estimate.hooks import (
    fake_module,
    host_device,
    replays_workspace,
    shortcut,
)
from oomguard.engine.errors import UsageError

__all__ = ["RebuiltInChild", "Workload", "catches_own_errors", "estimate_copy", "fake_module", "host_device",
           "knob_of", "name_of", "own_estimate", "preload_of", "replays_workspace", "shortcut",
           "steps_of", "warm_up", "worst_case_call", "worst_case_maker"]


class Workload(Protocol):
    """Runs the work once at ``size`` items; returns a small result; the optional hooks (``warmup``, ``worst_case_batch``, ``steps_per_trial``, ``estimate_peak``, ``for_estimate``) are listed in this module's docstring, which the API reference shows."""

    def __call__(self, size: int, /) -> Any: ...


class RebuiltInChild:
    """Mixin for picklable workloads whose ``warmup()`` fills ``self._state``: that state is
    dropped from the pickle, so an isolated trial ships only the description."""

    _state: dict[str, Any]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_state": {}}


def name_of(fn: Any) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__name__", type(fn).__name__)


def qualname(fn: Any) -> str:
    """What a workload is called by default: its ``__qualname__``, else its type's name."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def knob_of(fn: Any) -> str:
    return getattr(fn, "knob", None) or "batch_size"


def steps_of(fn: Any) -> int:
    return int(getattr(fn, "steps_per_trial", 1) or 1)


def catches_own_errors(fn: Any) -> bool:
    """Whether ``fn`` says its own code catches exceptions (``catches_own_errors = True``, as
    the metrics do): an OOM it catches can only be seen as it is raised, in every step."""
    return bool(getattr(fn, "catches_own_errors", False))


def preload_of(fn: Any) -> tuple[str, ...]:
    return tuple(getattr(fn, "preload", ()))


def workload_preload(fn: Any) -> tuple[str, ...]:
    """The modules a forkserver should import for ``fn``: its ``preload`` and its module."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return preload_of(fn) + (module,)


def _method(fn: Any, hook: str, signature: str) -> Callable[..., Any] | None:
    """``fn``'s method ``hook``, or None when it has none (or it is None); :class:`UsageError`
    when it is something that cannot be called."""
    method = getattr(fn, hook, None)
    if method is not None and not callable(method):
        raise UsageError(f"{name_of(fn)}: {hook} must be a method {signature}, "
                         f"got {type(method).__name__}; define it as one, or remove it")
    return method


def warm_up(fn: Any) -> None:
    method = _method(fn, "warmup", "warmup()")
    if method is not None:
        method()


def worst_case_maker(fn: Any) -> Callable[[int], Any] | None:
    """``fn.worst_case_batch``, else None. :class:`UsageError` when it is not callable, or
    when ``fn`` takes no ``batch`` keyword (else a trial would fail at its first step,
    after the warm-up, with a bare TypeError)."""
    maker = _method(fn, "worst_case_batch", "worst_case_batch(size) returning a batch")
    if maker is None:
        return None
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call tell
        return maker
    if not any(p.name == "batch" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               or p.kind == p.VAR_KEYWORD for p in params):
        raise UsageError(f"{name_of(fn)} has worst_case_batch(size), so trials call it "
                         f"fn(size, batch=fn.worst_case_batch(size)); its call takes no "
                         f"'batch' argument: add one (batch=None: build the batch yourself)")
    return maker


def worst_case_call(fn: Any) -> Callable[[int], Any]:
    """``fn`` as a trial and an estimate call it: ``fn(size, batch=fn.worst_case_batch(size))``
    where it has that hook (:func:`worst_case_maker`, which raises for a bad one), else ``fn``
    itself. The batch is built inside the call, so it counts in the call's peak."""
    make = worst_case_maker(fn)
    if make is None:
        return fn
    return lambda size: fn(size, batch=make(size))


def own_estimate(fn: Any) -> Callable[[int, str], int] | None:
    """The workload's ``estimate_peak(size, device)`` (bytes), or None."""
    return _method(fn, "estimate_peak", "estimate_peak(size, device) returning bytes")


def estimate_copy(fn: Any, device: str) -> Any:
    """What an estimate on ``device`` runs: ``fn.for_estimate(device)``, else ``fn`` itself."""
    method = _method(fn, "for_estimate", "for_estimate(device) returning a workload")
    return fn if method is None else method(device)
