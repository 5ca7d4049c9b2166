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

A fused AdamW bumps only ``step``, before its kernel runs: enough to see it began (checked
on torch 2.13 CPU). A write through ``p.data`` has a version counter of its own: unseen.

Without ``params`` and ``optimizer``, nothing is cleared; a retry that can see gradients
left on the function's module (``fn.__self__`` when it is a ``Module``, or the ``Module``
objects in ``fn``'s closure cells) logs one warning per wrapper saying what to pass.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from oomguard.engine.errors import StepPartlyApplied, UsageError

log = logging.getLogger("oomguard.executor")
T = TypeVar("T")

Params = torch.nn.Module | torch.optim.Optimizer | Iterable[torch.Tensor]
WHAT_TO_DO = ("restore the model and optimizer (a checkpoint) before going on, or find a size "
              "that fits the whole step first with oomguard.search(step, restore=(model, "
              "optimizer)) and train at it")


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
    """What a retry must leave clean: the gradients of ``params`` (default: ``optimizer``'s)
    and ``optimizer``'s step. ``fn`` is looked at for a module with gradients when neither
    is given. Bad arguments raise one :class:`~oomguard.engine.errors.UsageError` line here."""

    def __init__(self, params: Params | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 fn: Callable[..., Any] | None = None) -> None:
        self.params = _check(params, optimizer)
        self.optimizer = optimizer
        self.fn = fn
        self.watch: _StepWatch | None = None

    @property
    def given(self) -> bool:
        """Whether the user said what to clean (``params`` or ``optimizer``)."""
        return bool(self.params) or self.optimizer is not None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One attempt, ``fn(*args, **kwargs)``, with the optimizer's step hooks registered
        only while it runs (without an optimizer: a plain call)."""
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
        keeps the warning to one per wrapper). Raises :class:`~oomguard.engine.errors.StepPartlyApplied`
        when the step had begun writing or had completed; else drops what an interrupted step
        created and clears the gradients."""
        watch, self.watch = self.watch, None
        if watch is not None:
            self._check_step(watch, name, message)
        if not self.given:
            self._warn_if_dirty(name, once)
            return
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
        modules = modules_of(self.fn)
        if any(p.grad is not None for m in modules for p in m.parameters()):
            once.warned = True
            log.warning("%s: retrying after an out-of-memory error with gradients left on %s "
                        "by the failed attempt; pass params=model, optimizer=optimizer to the "
                        "wrapper so that a retry starts from clean gradients", name,
                        type(modules[0]).__name__)


def modules_of(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules a function can reach directly: a bound method's ``__self__`` and the
    ``Module`` objects in its closure cells (its globals are not looked at)."""
    found: list[torch.nn.Module] = []
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        found.append(owner)
    code_fn = getattr(fn, "__func__", fn)
    for cell in getattr(code_fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            if isinstance(cell.cell_contents, torch.nn.Module):
                found.append(cell.cell_contents)
    return found
