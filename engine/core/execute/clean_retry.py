"""Retries that never train on a failed attempt's leftovers: the retry hygiene of the adaptive
wrappers that run a user's whole step (``@adaptive``, ``find_executable_batch_size``,
``Executor``). ``accumulate`` keeps its own: it puts back the gradients an outer loop left
(:class:`~oomguard.engine.training.accumulate.EntryGrads`) instead of clearing them.

An OOM in the backward has already added part of a gradient to some ``.grad`` tensors; one
inside ``optimizer.step()`` may have updated parameters or state: a retry on top trains on a
mix of two attempts. :class:`CleanRetry`, built from the ``params=`` and ``optimizer=`` a
user hands a wrapper, runs around every attempt of the size controller:

- before a retry, the gradients of ``params`` are set to ``None``;
- during each attempt, the optimizer's step pre- and post-hooks (removed after it) record
  the version counters (``t._version``) of the parameters and of ``optimizer.state``'s
  tensors. After an OOM between the two hooks, if nothing was written (no version moved,
  lazily created state still at version 0) the new state is dropped and the attempt
  retried; else the step was partly applied and
  :class:`~oomguard.engine.errors.StepPartlyApplied` says so and what to do. An OOM after
  a completed step raises it too.

- the buffers of the modules trained (``params`` when it is a ``Module``, else the modules
  ``fn`` reaches whose parameters are ``params``' or ``optimizer``'s) are cloned on their
  device before each attempt (:class:`~oomguard.engine.core.snapshot.BufferCopy`) and put
  back before a retry: BatchNorm's running statistics and ``num_batches_tracked`` count the
  retried step once, not the failed attempt's forward too.

A fused AdamW bumps only ``step``, before its kernel runs: enough to see it began (checked
on torch 2.13 CPU). A write through ``p.data`` has a version counter of its own: unseen.

With ``restore`` (modules and optimizers, as ``search(restore=...)`` takes; ``optimizer``
and a ``params`` module join them), a wrapper's call takes a host
:class:`~oomguard.engine.core.snapshot.Snapshot` when it starts (:meth:`CleanRetry.starting_point`)
and every retry starts from it: a whole training loop that ran optimizer steps before its OOM
is retried from its start instead of raising ``StepPartlyApplied``.

Without ``params``, ``optimizer`` and ``restore``, nothing is cleared; a retry that can see
gradients left on what the function reaches (:func:`reachable`: ``fn.__self__``, its
closure cells, the globals its code names) logs one warning per wrapper saying what to pass.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from oomguard.engine.core.snapshot import BufferCopy, Restorable, Snapshot, check_restorable
from oomguard.engine.errors import StepPartlyApplied, UsageError

log = logging.getLogger("oomguard.executor")
T = TypeVar("T")

Params = torch.nn.Module | torch.optim.Optimizer | Iterable[torch.Tensor]
Restore = Restorable | Sequence[Restorable] | None  # restore=: one object or several
WHAT_TO_DO = ("restore the model and optimizer (a checkpoint) before going on, or find a size "
              "that fits the whole step first with oomguard.search(step, restore=(model, "
              "optimizer)) and train at it; for a whole loop, pass restore=(model, optimizer) "
              "to the wrapper so that a retry starts from the call's start")


def param_list(params: Params | None, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors whose gradients a retry clears: ``params`` (a module's parameters, an
    optimizer's, or the tensors given), else ``optimizer``'s; each tensor once."""
    if params is None and optimizer is None:
        return []
    source = params if params is not None else optimizer
    if isinstance(source, torch.nn.Module):
        tensors: Iterable[torch.Tensor] = source.parameters()
    elif isinstance(source, torch.optim.Optimizer):
        tensors = (p for g in source.param_groups for p in g["params"])
    else:
        tensors = source  # type: ignore[assignment]
    return list({id(t): t for t in tensors}.values())


def _check(params: Any, optimizer: Any) -> list[torch.Tensor]:
    """One :class:`UsageError` line for a ``params=``/``optimizer=`` that cannot be cleaned."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                         "pass the optimizer your loop steps")
    if params is not None and not isinstance(params, (torch.nn.Module, torch.optim.Optimizer)):
        if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
            raise UsageError("params= must be a torch.nn.Module, an optimizer or an iterable of "
                             f"tensors, got {type(params).__name__}; pass the model, its "
                             "optimizer or a list of its parameters")
        params = list(params)
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise UsageError("params= must hold tensors only; pass model.parameters() or a list "
                             "of tensors")
    tensors = param_list(params, optimizer)
    if params is not None and optimizer is not None:
        mine = {id(t) for t in tensors}
        if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
            raise UsageError("optimizer= updates parameters that are not in params=: pass the "
                             "model whose parameters the optimizer was built on")
    return tensors


class _StepWatch:
    """The optimizer's step between its pre- and post-hook, during one attempt."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.in_step = False
        self.completed = 0  # steps that ran to their post-hook in this attempt
        self.versions: dict[int, tuple[torch.Tensor, int]] = {}
        self.entries: dict[int, dict[Any, Any]] = {}  # per parameter with state: a shallow copy

    def pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.in_step = True
        versions: dict[int, tuple[torch.Tensor, int]] = {}
        entries: dict[int, dict[Any, Any]] = {}
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                versions[id(p)] = (p, p._version)
                entry = state.get(p)  # .get: the defaultdict creates nothing
                if entry:
                    entries[id(p)] = dict(entry)
                    for value in entry.values():
                        if isinstance(value, torch.Tensor):
                            versions[id(value)] = (value, value._version)
        self.versions, self.entries = versions, entries

    def post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.in_step = False
        self.completed += 1
        self.versions, self.entries = {}, {}

    def written(self) -> bool:
        """Whether the step in flight wrote anything: a recorded tensor's version moved, a
        recorded state value was replaced (an out-of-place update, a Python step counter
        incremented), or a state tensor it created lazily is no longer at version 0."""
        if any(t._version != v for t, v in self.versions.values()):
            return True
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                before, now = self.entries.get(id(p), {}), state.get(p) or {}
                if any(now.get(k, _GONE) is not v for k, v in before.items()):
                    return True
                if any(isinstance(v, torch.Tensor) and v._version != 0
                       for k, v in now.items() if k not in before):
                    return True
        return False

    def drop_new_state(self) -> None:
        """Remove the state the interrupted step created: the optimizer as before the step."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p not in state:
                    continue
                before = self.entries.get(id(p))
                if before is None:
                    del state[p]
                else:
                    for key in [k for k in state[p] if k not in before]:
                        del state[p][key]


_GONE = object()  # a state value that is no longer there


class CleanRetry:
    """What a retry must leave clean: the gradients of ``params`` (default: ``optimizer``'s),
    the buffers of the modules trained, and ``optimizer``'s step; with ``restore``, everything
    those objects hold, as at the call's start. ``fn`` is looked at for what it trains when
    nothing is given. Bad arguments raise one :class:`~oomguard.engine.errors.UsageError`
    line here."""

    def __init__(self, params: Params | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 fn: Callable[..., Any] | None = None,
                 restore: Restore = None) -> None:
        self.params = _check(params, optimizer)
        self.optimizer = optimizer
        self.fn = fn
        self.restore = _restorable(restore, params, optimizer)
        self.watch: _StepWatch | None = None
        self.buffers: BufferCopy | None = None
        self.start: Snapshot | None = None  # restore='s snapshot while a call runs
        # Whose buffers come back: found once, at the first attempt (a script's globals may
        # be assigned after the decorator ran).
        self._modules: list[torch.nn.Module] | None = (
            [params] if isinstance(params, torch.nn.Module) else None)

    @property
    def given(self) -> bool:
        """Whether the user said what to clean (``params``, ``optimizer`` or ``restore``)."""
        return bool(self.params) or self.optimizer is not None or bool(self.restore)

    @contextlib.contextmanager
    def starting_point(self) -> Iterator[None]:
        """One call of a wrapper: with ``restore``, the objects' host snapshot, taken here and
        dropped when the call ends (its cost: docs/measurements.md#buffer-copy)."""
        if not self.restore or self.start is not None:  # a call inside a call: the outer's
            yield
            return
        self.start = Snapshot.take(self.restore)
        try:
            yield
        finally:
            self.start = None

    def modules(self) -> list[torch.nn.Module]:
        """The modules whose buffers a retry puts back: a ``params`` module, else those ``fn``
        reaches that own a parameter of ``params`` (or ``optimizer``); none without them."""
        if self._modules is None:
            mine = {id(p) for p in self.params}
            self._modules = [m for m in (reachable(self.fn) if self.fn is not None and mine else ())
                             if isinstance(m, torch.nn.Module)
                             and any(id(p) in mine for p in m.parameters())]
        return self._modules

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One attempt, ``fn(*args, **kwargs)``: the modules' buffers cloned first, and the
        optimizer's step hooks registered only while it runs (without an optimizer, or
        within :meth:`starting_point`'s snapshot: neither)."""
        if self.start is not None:
            return fn(*args, **kwargs)
        modules = self.modules()
        self.buffers = BufferCopy.take(modules) if modules else None
        if self.optimizer is None:
            return fn(*args, **kwargs)
        watch = self.watch = _StepWatch(self.optimizer)
        handles = (self.optimizer.register_step_pre_hook(watch.pre),
                   self.optimizer.register_step_post_hook(watch.post))
        try:
            return fn(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    def before_retry(self, name: str, message: str, once: Any) -> None:
        """After a failed attempt, before its retry (``message``: why it failed; ``once.warned``
        keeps the warning to one per wrapper). Within :meth:`starting_point`'s snapshot:
        restores it. Else raises :class:`~oomguard.engine.errors.StepPartlyApplied` when the
        step had begun writing or had completed; else drops what an interrupted step created,
        puts the buffers back and clears the gradients."""
        watch, self.watch = self.watch, None
        buffers, self.buffers = self.buffers, None
        if self.start is not None:
            self.start.restore()
            log.info("%s: %s put back as at the call's start (restore=) for the retry", name,
                     ", ".join(type(o).__name__ for o in self.restore))
            return
        if watch is not None:
            self._check_step(watch, name, message)
        if not self.given:
            self._warn_if_dirty(name, once)
            return
        if buffers is not None:
            buffers.restore()
        for p in self.params:
            p.grad = None

    def _check_step(self, watch: _StepWatch, name: str, message: str) -> None:
        what = type(watch.optimizer).__name__
        if watch.in_step and watch.written():
            raise StepPartlyApplied(
                name, message, f"{name}: out of memory inside {what}.step() after it began "
                f"updating the parameters or its state: the step was partly applied and is "
                f"not retried; {WHAT_TO_DO}")
        if watch.completed:
            raise StepPartlyApplied(
                name, message, f"{name}: out of memory after {what}.step() had run in the "
                f"same attempt: a retry would apply the step again; {WHAT_TO_DO}")
        if watch.in_step:
            watch.drop_new_state()
            log.info("%s: out of memory inside %s.step() before it wrote anything: the state "
                     "it created is dropped and the step retried", name, what)

    def _warn_if_dirty(self, name: str, once: Any) -> None:
        if once.warned or self.fn is None:
            return
        found = reachable(self.fn)  # a module named before an optimizer
        for obj in sorted(found, key=lambda o: not isinstance(o, torch.nn.Module)):
            if any(p.grad is not None for p in param_list(obj, None)):
                once.warned = True
                log.warning("%s: retrying after an out-of-memory error with gradients left on "
                            "%s by the failed attempt; pass params=model, optimizer=optimizer "
                            "to the wrapper so that a retry starts from clean gradients", name,
                            type(obj).__name__)
                return


def _restorable(restore: Any, params: Any, optimizer: Any) -> tuple[Restorable, ...]:
    """``restore``'s objects (:func:`~oomguard.engine.core.snapshot.check_restorable`), with
    ``optimizer`` and a ``params`` module or optimizer added: what the retry would otherwise
    clean is put back too. Empty without ``restore``."""
    objects = list(check_restorable(restore))
    if not objects:
        return ()
    for extra in (params, optimizer):
        if isinstance(extra, (torch.nn.Module, torch.optim.Optimizer)) and all(
                extra is not o for o in objects):
            objects.append(extra)
    return check_restorable(objects)


def reachable(fn: Callable[..., Any]) -> list[Restorable]:
    """The modules and optimizers a function reaches directly: a bound method's
    ``__self__``, a ``functools.partial``'s arguments, the objects in its closure cells and
    the globals its code names (its nested functions' and lambdas' code included); each
    once, in that order."""
    found: dict[int, Restorable] = {}

    def keep(value: Any) -> None:
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            found.setdefault(id(value), value)

    while isinstance(fn, functools.partial):
        for value in (*fn.args, *fn.keywords.values()):
            keep(value)
        fn = fn.func
    keep(getattr(fn, "__self__", None))
    code_fn = getattr(fn, "__func__", fn)
    for cell in getattr(code_fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            keep(cell.cell_contents)
    names = getattr(code_fn, "__globals__", None)
    code = getattr(code_fn, "__code__", None)
    if isinstance(names, dict) and isinstance(code, types.CodeType):
        for name in _global_names(code):
            keep(names.get(name))
    return list(found.values())


def _global_names(code: types.CodeType) -> list[str]:
    """The names ``code`` and the code objects nested in it look up, in order (``co_names``:
    globals, and attribute names, which the caller's lookup in the globals filters out)."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return names
