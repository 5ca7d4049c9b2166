"""Adaptive sizes inside training scripts: a decorator and an accelerate-shaped helper.

Both wrappers are thin layers over the core's one size controller
(:class:`~oomguard.engine.core.execute.executor.SizeController`), agreed between ranks
under ``torch.distributed`` (:mod:`~oomguard.engine.training.distributed`). Size changes
are logged on the ``oomguard.adaptive`` logger and counted in
:func:`~oomguard.engine.core.execute.stats.stats`.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from oomguard.engine.core.execute.executor import SizeController, SizeMemory, qualname
from oomguard.engine.core.execute.retry import Halve, ReduceWith, RetryPolicy
from oomguard.engine.core.execute.stats import register
from oomguard.engine.errors import NoExecutableBatchSize, check_positive_int
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
               sync_ranks: bool = True, failure_message: str | None = None) -> SizeController:
    """The size controller of a training-script helper: one knob ``key``, agreed between
    the ranks of ``group`` with ``sync_ranks``."""
    if not isinstance(start, SizeMemory):
        check_positive_int("start", start, optional=True)
        start = remembered(name, key, start)
    agreement = RankAgreement(group, name) if sync_ranks else None
    return SizeController(name, start, minimum={key: minimum}, maximum={key: maximum},
                          policy=policy, grow_after=grow_after, agreement=agreement,
                          device=device, logger=log, failure_message=failure_message)


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


def _wrap(fn: Callable[..., T], size: SizeController | None) -> Callable[..., T]:
    guard = _batch_size_guard(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        guard(args, kwargs)
        if size is None:  # find_executable_batch_size(starting_batch_size=0)
            raise NoExecutableBatchSize(qualname(fn), [], [], ZERO_MESSAGE, verbatim=True)
        return size.run(lambda sizes: fn(sizes[KEY], *args, **kwargs))

    call.adaptive_size = size  # type: ignore[attr-defined]
    return call


def adaptive(fn: Callable[..., T] | None = None, *, batch_size: int = 64, minimum: int = 1,
             maximum: int | None = None, policy: RetryPolicy | None = None,
             grow_after: int | None = None, device: Any = None, group: Any = None,
             sync_ranks: bool = True, name: str | None = None) -> Any:
    """Decorate ``fn(batch_size, ...)`` so that an OOM costs a retry at a smaller size.

    The decorator supplies the batch size (passing one raises ``TypeError``). On OOM ``fn`` runs
    again at half the size (or by ``policy``) down to ``minimum``, then raises
    :class:`NoExecutableBatchSize`. The size that worked is kept; ``grow_after`` clean calls let it
    grow back, never above ``maximum`` (default ``batch_size``) nor to a size that failed. Under
    ``torch.distributed`` each call is collective (``sync_ranks=False``: not), and ``fn`` must be
    safe to re-run: a rank whose call succeeded runs again at the smaller size another rank needed.
    ``adaptive_size``: the wrapper's size controller.
    """
    def decorate(f: Callable[..., T]) -> Callable[..., T]:
        size = make_controller(name or qualname(f), KEY, batch_size, minimum=minimum,
                               maximum=maximum or batch_size, policy=policy,
                               grow_after=grow_after, device=device, group=group,
                               sync_ranks=sync_ranks)
        return _wrap(f, size)

    return decorate if fn is None else decorate(fn)


def find_executable_batch_size(function: Callable[..., T] | None = None,
                               starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[..., int] | None = None, *,
                               sync_ranks: bool = True) -> Any:
    """accelerate's helper, same call shape: switch with one import line.

    ``function(batch_size, ...)`` is called at ``starting_batch_size``, then after each
    OOM at half the size or at what ``reduce_batch_size_fn`` returns (``fn(size) -> int``
    or accelerate's ``fn() -> int``). At zero, accelerate's :data:`ZERO_MESSAGE` (a
    :class:`NoExecutableBatchSize`). Unlike accelerate's, under ``torch.distributed``
    every rank takes the same size, as with :func:`adaptive` (``sync_ranks=False``: not).
    """
    if function is None:
        return functools.partial(find_executable_batch_size,
                                 starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn,
                                 sync_ranks=sync_ranks)
    if starting_batch_size <= 0:
        return _wrap(function, None)
    policy = Halve() if reduce_batch_size_fn is None else ReduceWith(_unary(reduce_batch_size_fn))
    size = make_controller(qualname(function), KEY, starting_batch_size, policy=policy,
                           sync_ranks=sync_ranks, failure_message=ZERO_MESSAGE)
    return _wrap(function, size)


def _unary(fn: Callable[..., int]) -> Callable[[int], int]:
    """Accept both ``fn(size)`` and accelerate's ``fn()`` (which tracks the size itself)."""
    try:
        takes_size = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                         for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        takes_size = True
    return fn if takes_size else (lambda _size: fn())
