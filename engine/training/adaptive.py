"""Adaptive sizes inside training scripts: :func:`adaptive` and
:func:`find_executable_batch_size` (a drop-in for accelerate's and transformers' helpers), thin
layers over the core's size controller, agreed between ranks under ``torch.distributed``; size
changes are logged on the ``oomguard.adaptive`` logger and counted in ``oomguard.stats()``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from oomguard.engine.core.execute.clean_retry import CleanRetry, Params, Restore
from oomguard.engine.core.execute.executor import SizeController, SizeMemory, qualname
from oomguard.engine.core.execute.priced import PricedCalls
from oomguard.engine.core.execute.retry import ReduceWith, RetryPolicy
from oomguard.engine.core.execute.stats import register
from oomguard.engine.errors import NoExecutableBatchSize, UsageError, check_positive_int
from oomguard.engine.training.distributed import RankAgreement

log = logging.getLogger("oomguard.adaptive")

T = TypeVar("T")
KEY = "batch_size"
ZERO_MESSAGE = "No executable batch size found, reached zero."  # accelerate's wording


def remembered(name: str, key: str, start: int | None) -> SizeMemory:
    """A new memory for one adaptive size ``key``, registered for ``stats()``."""
    return SizeMemory(register(name, start), {key: start})


def make_controller(name: str, key: str, start: int | None | SizeMemory, *, minimum: int = 1,
               maximum: int | None = None, policy: RetryPolicy | None = None,
               grow_after: int | None = None, device: Any = None, group: Any = None,
               sync_ranks: bool = True, failure_message: str | None = None,
               clean: CleanRetry | None = None,
               watch_alloc_retries: bool = True) -> SizeController:
    """The size controller of a training-script helper: one knob ``key``, agreed between
    the ranks of ``group`` with ``sync_ranks``; ``clean``: what a retry leaves clean."""
    if not isinstance(start, SizeMemory):
        check_positive_int("start", start, optional=True)
        start = remembered(name, key, start)
    agreement = RankAgreement(group, name) if sync_ranks else None
    return SizeController(name, start, minimum={key: minimum}, maximum={key: maximum},
                          policy=policy, grow_after=grow_after, agreement=agreement,
                          device=device, logger=log, failure_message=failure_message,
                          clean=clean, watch_alloc_retries=watch_alloc_retries)


def _batch_size_guard(fn: Callable[..., Any]) -> Callable[[tuple, dict], None]:
    """A check that raises TypeError when the caller passes the batch size itself."""
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


def _wrap(fn: Callable[..., T], size: SizeController | None,
          priced: PricedCalls | None = None) -> Callable[..., T]:
    guard = _batch_size_guard(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        guard(args, kwargs)
        if size is None:  # find_executable_batch_size(starting_batch_size=0)
            raise NoExecutableBatchSize(qualname(fn), [], [], ZERO_MESSAGE, verbatim=True)
        with size.clean.starting_point():  # restore=: the call's start, for every retry
            if priced is not None:  # remedies=: priced on the first call, then in force
                return priced.run(size, KEY, lambda n: fn(n, *args, **kwargs))
            return size.run(lambda sizes: fn(sizes[KEY], *args, **kwargs))

    call.adaptive_size = size  # type: ignore[attr-defined]
    return call


def adaptive(fn: Callable[..., T] | None = None, *, batch_size: int = 64, minimum: int = 1,
             maximum: int | None = None, policy: RetryPolicy | None = None,
             grow_after: int | None = None, device: Any = None, group: Any = None,
             sync_ranks: bool = True, name: str | None = None, params: Params | None = None,
             optimizer: Any = None, restore: Restore = None, watch_alloc_retries: bool = True,
             remedies: Any = None) -> Any:
    """Decorate ``fn(batch_size, ...)`` so that an OOM costs a retry at a smaller size.

    The decorator supplies the batch size (passing one raises ``TypeError``). On OOM ``fn`` runs
    again at half the size (or by ``policy``) down to ``minimum``, then raises
    :class:`NoExecutableBatchSize`. The size that worked is kept; ``grow_after`` clean calls let it
    grow back, never above ``maximum`` (default ``batch_size``) nor to a size that failed. Under
    ``torch.distributed`` each call is collective (``sync_ranks=False``: not), and ``fn`` must be
    safe to re-run. ``adaptive_size``: the wrapper's size controller. ``params`` and
    ``optimizer``: what ``fn`` trains; a retry first sets their gradients to None and puts
    the modules' buffers (BatchNorm's running statistics) back, and an OOM after
    ``optimizer.step()`` began writing raises :class:`~oomguard.engine.errors.StepPartlyApplied`.
    ``restore`` (a model and optimizer, ``restore=(model, optimizer)``, as ``search`` takes):
    each call copies them to the host when it starts and every retry starts from that copy,
    so that ``fn`` may be a whole training loop. ``watch_alloc_retries`` (CUDA): step down
    before the OOM when the allocator retries in consecutive calls. ``remedies`` (e.g.
    ``("accumulate", "checkpoint")``, with ``params=model``): where ``batch_size`` does not
    fit, the first call measures each way to run (a smaller batch, checkpointing, ...) and
    runs the fastest (:class:`~oomguard.engine.core.execute.priced.PricedCalls`).
    """
    def decorate(f: Callable[..., T]) -> Callable[..., T]:
        priced = None if remedies is None else PricedCalls(remedies, params, optimizer,
                                                           batch_size, name or qualname(f), device)
        size = make_controller(name or qualname(f), KEY, batch_size, minimum=minimum,
                               maximum=maximum or batch_size, policy=policy,
                               grow_after=grow_after, device=device, group=group,
                               sync_ranks=sync_ranks,
                               clean=CleanRetry(params, optimizer, f, restore),
                               watch_alloc_retries=watch_alloc_retries)
        return _wrap(f, size, priced)

    return decorate if fn is None else decorate(fn)


def accelerate_reduce(batch_size: int) -> int:
    """accelerate's default step after an OOM (1.9 and later): ``int(batch_size * 0.9)``;
    from 128: 115, 103, ... 2, 1, then 0, where accelerate (and this helper) gives up."""
    return int(batch_size * 0.9)


def find_executable_batch_size(function: Callable[..., T] | None = None,
                               starting_batch_size: int = 128,
                               auto_find_batch_size: bool | Callable[..., int] = True, *,
                               reduce_batch_size_fn: Callable[..., int] | None = None,
                               params: Params | None = None, optimizer: Any = None,
                               restore: Restore = None, sync_ranks: bool = True) -> Any:
    """accelerate's and transformers' helper, same calls: switch with one import line.

    Accepts accelerate's ``(function, starting_batch_size, reduce_batch_size_fn)`` and
    transformers' ``(function, starting_batch_size, auto_find_batch_size)`` (a callable third
    argument is accelerate's reduce function, a bool transformers' switch).
    ``function(batch_size, ...)`` runs at ``starting_batch_size``, then after each OOM at
    :func:`accelerate_reduce` of it or what ``reduce_batch_size_fn`` returns (``fn(size)`` or
    accelerate's ``fn()``); at zero, accelerate's :data:`ZERO_MESSAGE` as a
    :class:`NoExecutableBatchSize`. ``auto_find_batch_size=False``: one call, no retry.
    Beyond accelerate: ``params``/``optimizer`` keep retries clean and ``restore`` starts each
    retry of a whole loop from the call's start (as in :func:`adaptive`), and under
    ``torch.distributed`` every rank takes the same size (``sync_ranks=False``: not).
    """
    if callable(auto_find_batch_size) and not isinstance(auto_find_batch_size, bool):
        if reduce_batch_size_fn is not None:
            raise UsageError("find_executable_batch_size: give the reduce function once "
                             "(third argument or reduce_batch_size_fn=)")
        auto_find_batch_size, reduce_batch_size_fn = True, auto_find_batch_size
    if not isinstance(auto_find_batch_size, bool):
        raise UsageError("find_executable_batch_size: the third argument is "
                         "auto_find_batch_size (a bool) or a reduce function, got "
                         f"{type(auto_find_batch_size).__name__}; pass True, False or a function")
    if function is None:
        return functools.partial(find_executable_batch_size,
                                 starting_batch_size=starting_batch_size,
                                 auto_find_batch_size=auto_find_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn,
                                 params=params, optimizer=optimizer, restore=restore,
                                 sync_ranks=sync_ranks)
    if not auto_find_batch_size:  # transformers: functools.partial(function, batch_size=start)
        return functools.partial(function, starting_batch_size)
    if starting_batch_size <= 0:
        return _wrap(function, None)
    reduce = accelerate_reduce if reduce_batch_size_fn is None else _unary(reduce_batch_size_fn)
    size = make_controller(qualname(function), KEY, starting_batch_size,
                           policy=ReduceWith(reduce), sync_ranks=sync_ranks,
                           failure_message=ZERO_MESSAGE,
                           clean=CleanRetry(params, optimizer, function, restore))
    return _wrap(function, size)


def _unary(fn: Callable[..., int]) -> Callable[[int], int]:
    """Accept both ``fn(size)`` and accelerate's ``fn()`` (which tracks the size itself)."""
    try:
        takes_size = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                         for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        takes_size = True
    return fn if takes_size else (lambda _size: fn())
