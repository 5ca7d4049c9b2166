"""Activation checkpointing per block: trade recomputation for memory, while a ``with`` lasts.

:func:`repeated_blocks` finds a model's repeated blocks (a transformer's layers, a residual
net's blocks): the modules of the class that repeats most often, weighted by the parameters
it holds, outermost only. :func:`checkpointed` runs each chosen block (every one, or every
``every``-th: selective checkpointing) through ``torch.utils.checkpoint`` with
``use_reentrant=False``: the block's activations are dropped after its forward and
recomputed in the backward, so a step holds one block's activations at a time instead of
all of them, at the cost of one more forward per block (measured: docs/measurements.md#recompute).

The model itself is not changed: an instance attribute ``forward`` shadows the class's while
the ``with`` lasts and is deleted on exit, so a block's hooks, state dict and class stay as
they were. Results equal the plain run's up to float rounding: the RNG state (dropout) is
replayed by ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from oomguard.engine.errors import UsageError, check_positive_int

# Containers and leaf modules that are never a "block" worth checkpointing on their own.
_NOT_BLOCKS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
_UNSET = object()


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, in forward order: the instances of the module class
    (not a container, holding parameters, with children of its own) that appears at least
    twice and holds the most parameters in all; nested instances count once (the outermost).
    An empty list where nothing repeats."""
    by_class: dict[type, list[torch.nn.Module]] = defaultdict(list)
    for module in model.modules():
        if (module is not model and not isinstance(module, _NOT_BLOCKS)
                and next(module.children(), None) is not None):
            by_class[type(module)].append(module)
    best: list[torch.nn.Module] = []
    best_params = 0
    for modules in by_class.values():
        outer = _outermost(modules)
        params = sum(_param_count(m) for m in outer)
        if len(outer) >= 2 and params > best_params:
            best, best_params = outer, params
    return best


def _outermost(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """``modules`` less those inside another of them (kept in the order given)."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def _checkpointed_forward(block: torch.nn.Module, forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to save: a plain forward
            return forward(*args, **kwargs)
        calls = 0

        def once_for_buffers(*a: Any, **kw: Any) -> Any:
            # The backward's recomputation is the second call: buffers a forward updates in
            # place (BatchNorm's running statistics) must not be updated twice.
            nonlocal calls
            calls += 1
            if calls == 1:
                return forward(*a, **kw)
            saved = [b.detach().clone() for b in block.buffers()]
            try:
                return forward(*a, **kw)
            finally:
                with torch.no_grad():
                    for buf, value in zip(block.buffers(), saved, strict=True):
                        buf.copy_(value)

        return checkpoint(once_for_buffers, *args, use_reentrant=False, **kwargs)

    return run


@contextlib.contextmanager
def checkpointed(model: torch.nn.Module, every: int = 1) -> Iterator[list[torch.nn.Module]]:
    """Within the ``with``, every ``every``-th of ``model``'s :func:`repeated_blocks` (1: all;
    2: every other one, selective) recomputes its activations in the backward instead of
    keeping them (a transformers model's ``config.use_cache`` is off meanwhile); yields the
    checkpointed blocks. Raises :class:`UsageError` for a model
    with no repeated blocks."""
    check_positive_int("every", every)
    blocks = repeated_blocks(model)[::every]
    if not blocks:
        raise UsageError(f"{type(model).__name__} has no repeated blocks to checkpoint; "
                         "use another remedy (accumulate) for this model")
    # A forward another library already set on the instance (accelerate's hooks) is wrapped
    # and put back, not replaced.
    before = [vars(b).get("forward", _UNSET) for b in blocks]
    for block in blocks:
        block.forward = _checkpointed_forward(block, block.forward)  # type: ignore[method-assign]
    # A transformers model fills its key/value cache inside each block: the recomputation
    # would append to it a second time (attention then sees twice the keys and fails), so
    # the cache is off while the ``with`` lasts, as transformers' own checkpointing does.
    config = getattr(model, "config", None)
    cache_was = getattr(config, "use_cache", None)
    if cache_was:
        config.use_cache = False
    try:
        yield blocks
    finally:
        if cache_was:
            config.use_cache = cache_was
        for block, forward in zip(blocks, before, strict=True):
            if forward is _UNSET:
                del block.forward
            else:
                block.forward = forward  # type: ignore[method-assign]
