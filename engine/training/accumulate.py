"""Micro-batching that keeps the effective batch: exact gradient accumulation on OOM.

When a whole batch does not fit, it is split along dim 0 into micro-batches; each micro-batch's loss
is scaled by its share of the batch's tokens (or samples) before ``backward()``, so ``.grad`` equals
the whole batch's within float rounding. The micro-batch size is the core's one size controller's
(:class:`~oomguard.engine.core.execute.executor.SizeController`).

For the scaling to be exact, ``step_fn(micro_batch)`` runs the forward pass and returns a scalar
loss tensor (it must not call ``backward`` itself):

- ``reduction="mean"`` (default): the **mean over the micro-batch's own units** (a transformers
  causal LM's ``model(**batch).loss`` with ``weight_by="causal-tokens"``), multiplied by
  ``units_micro / units_total``.
- ``reduction="sum"``: the sum over its units; losses are added unscaled.

``weight_by`` counts units: ``"samples"`` (rows), ``"tokens"`` (``labels != ignore_index``),
``"causal-tokens"`` (``labels[..., 1:] != ignore_index``, the shifted count causal LMs average
over), or a callable ``fn(batch) -> number`` that is additive over rows. A micro-batch with no units
is skipped (its mean would be 0/0 = NaN, its exact contribution is zero). Randomness in the step
(dropout) draws differently per micro-batch: disable it for bit-comparable results.

A micro-batch that runs out of memory during ``backward`` may already have added part of its
gradient to some ``.grad`` tensors, so every attempt sets the gradients of ``params`` to ``None``
and runs the whole batch again: :func:`accumulate` *replaces* ``.grad``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard.engine.core.execute.executor import SizeController, SizeMemory, qualname
from oomguard.engine.core.execute.retry import RetryPolicy
from oomguard.engine.errors import check_positive_int
from oomguard.engine.training.adaptive import make_controller, remembered
from oomguard.engine.util.weakmap import WeakIdMap

Batch = Any  # a tensor, a Mapping of tensors, or a tuple/list of them, rows on dim 0
Params = torch.nn.Module | torch.optim.Optimizer | Iterable[torch.Tensor]
WEIGHTS = ("samples", "tokens", "causal-tokens")
KEY = "micro_batch_size"


def batch_length(batch: Batch) -> int:
    """The number of rows (dim 0) shared by every tensor in ``batch``; ValueError otherwise."""
    flat = type(batch) is dict and all(type(v) is torch.Tensor for v in batch.values())
    lengths = {t.shape[0] for t in (batch.values() if flat else _tensors(batch)) if t.dim() > 0}
    if len(lengths) != 1:
        raise ValueError(
            "a batch needs tensors that share dim 0 (rows); found lengths "
            f"{sorted(lengths) or 'none'}")
    return lengths.pop()


def _tensors(batch: Batch) -> Iterable[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (Mapping, tuple, list)):
        for value in batch.values() if isinstance(batch, Mapping) else batch:
            yield from _tensors(value)


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``start:stop`` of every tensor in ``batch`` (views, no copies); other values as they are."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        out = {k: slice_batch(v, start, stop) for k, v in batch.items()}
        if type(batch) is not dict:  # keep dict subclasses such as transformers' BatchEncoding
            with contextlib.suppress(TypeError):
                return type(batch)(out)
        return out
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(v, start, stop) for v in batch)
    return batch


def _row_units(batch: Batch, weight_by: str, labels_key: str, ignore_index: int) -> list[int]:
    """Units per row: tokens that count towards the loss (``weight_by`` tokens/causal-tokens)."""
    if not isinstance(batch, Mapping) or labels_key not in batch:
        raise ValueError(f"weight_by={weight_by!r} needs a dict batch with {labels_key!r}")
    labels = batch[labels_key]
    if weight_by == "causal-tokens":
        labels = labels[..., 1:]
    return (labels != ignore_index).reshape(labels.shape[0], -1).sum(dim=1).tolist()


def _param_list(params: Params) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` a call replaces (a tied parameter may appear twice)."""
    if isinstance(params, torch.nn.Module):
        # Module.parameters() costs ~4 us per parameter tensor (generators, a memo set); this plain
        # walk costs ~0.5 us, and it runs every call (docs/measurements.md#parameter-walk).
        out: list[torch.Tensor] = []
        append = out.append
        stack: list[torch.nn.Module | None] = [params]
        while stack:
            module = stack.pop()
            if module is None:
                continue
            for p in module._parameters.values():
                if p is not None and p.requires_grad:
                    append(p)
            stack.extend(module._modules.values())
        return out
    if isinstance(params, torch.optim.Optimizer):
        return [p for g in params.param_groups for p in g["params"]]
    return [p for p in params if p.requires_grad]


class Accumulator:
    """Runs ``step_fn`` over a batch in micro-batches with exact gradient accumulation.

    ``params`` (a module, an optimizer, or tensors): whose ``.grad`` one call computes.
    ``micro_batch_size`` (rows): the first size tried (None: the whole batch). The size
    options (``policy``, ``minimum``, ...) are the size controller's; with ``size``, an
    existing controller (how :func:`accumulate` keeps the size between calls), its own
    apply and ``micro_batch_size`` only bounds the micro-batches.
    """

    def __init__(self, step_fn: Callable[[Batch], torch.Tensor], params: Params, *,
                 micro_batch_size: int | None = None, weight_by: str | Callable[[Batch], float]
                 = "samples", reduction: str = "mean", labels_key: str = "labels",
                 ignore_index: int = -100, minimum: int = 1, policy: RetryPolicy | None = None,
                 grow_after: int | None = None, device: Any = None, group: Any = None,
                 sync_ranks: bool = True, name: str | None = None,
                 size: SizeController | None = None) -> None:
        if not callable(weight_by) and weight_by not in WEIGHTS:
            raise ValueError(f"weight_by must be one of {', '.join(WEIGHTS)} or a callable, "
                             f"got {weight_by!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.step_fn = step_fn
        self.weight_by, self.reduction = weight_by, reduction
        self.labels_key, self.ignore_index = labels_key, ignore_index
        self.set_params(params)
        self.limit = micro_batch_size if size is not None else None
        self.size = size or make_controller(
            name or f"{qualname(step_fn)}:micro_batch", KEY, micro_batch_size, minimum=minimum,
            policy=policy, grow_after=grow_after, device=device, group=group,
            sync_ranks=sync_ranks)

    @property
    def micro_batch_size(self) -> int | None:
        """The remembered micro-batch size in rows (None: whole batches have fitted so far)."""
        return self.size.current

    def set_params(self, params: Params) -> None:
        """Change the tensors whose gradients are computed (and zeroed before each attempt)."""
        self.params = _param_list(params)

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Compute the gradients of the whole batch's loss into ``.grad``; return that loss
        (detached: the whole batch's mean, or sum, over its units)."""
        n = batch_length(batch)
        cap = n if self.limit is None else min(n, self.limit)
        weights: dict[str, Any] = {}  # units per row, computed once and only when splitting
        return self.size.run(lambda s: self._run_at(batch, n, s[KEY], weights), cap={KEY: cap})

    def _units(self, batch: Batch, n: int, cache: dict[str, Any]) -> tuple[list[float], float]:
        """Prefix sums of units over rows (length n + 1) and the total."""
        if "prefix" not in cache:
            if callable(self.weight_by):  # no prefix: _run_at counts each micro-batch's units
                cache["prefix"], cache["total"] = [], float(self.weight_by(batch))
            else:
                per_row = [1] * n if self.weight_by == "samples" else _row_units(
                    batch, self.weight_by, self.labels_key, self.ignore_index)
                prefix = [0.0, *itertools.accumulate(map(float, per_row))]
                cache["prefix"], cache["total"] = prefix, prefix[-1]
            if cache["total"] <= 0:
                raise ValueError("the batch has no units to weight the loss by (every label "
                                 f"is {self.ignore_index}?): its mean loss is undefined")
        return cache["prefix"], cache["total"]

    def _run_at(self, batch: Batch, n: int, m: int, cache: dict[str, Any]) -> torch.Tensor:
        """One attempt: zero the gradients, then every micro-batch of ``m`` rows."""
        for p in self.params:
            p.grad = None
        if m >= n:  # the whole batch: no scaling, nothing to count
            loss = self.step_fn(batch)
            loss.backward()
            return loss.detach()
        prefix, total = self._units(batch, n, cache)
        total_loss: torch.Tensor | None = None
        for start in range(0, n, m):
            stop = min(start + m, n)
            micro = slice_batch(batch, start, stop)
            units = float(self.weight_by(micro)) if callable(self.weight_by) \
                else prefix[stop] - prefix[start]
            if units == 0:
                continue
            loss = self.step_fn(micro)
            weight = units / total if self.reduction == "mean" else 1.0
            (loss * weight if weight != 1.0 else loss).backward()
            part = loss.detach() * weight
            total_loss = part if total_loss is None else total_loss + part
            del loss
        assert total_loss is not None  # total > 0 guarantees one micro-batch ran
        return total_loss


SIZE_OPTIONS = ("minimum", "policy", "grow_after", "device", "group", "sync_ranks")


@dataclass(eq=False)
class _Remembered:
    """The size :func:`accumulate` found for one (params, name), and its last controller."""

    memory: SizeMemory
    options: dict[str, Any] = field(default_factory=dict)
    size: SizeController | None = None

    def controller(self, options: dict[str, Any]) -> SizeController:
        """A controller with this call's options (the last one when they are the same)."""
        if self.size is None or options != self.options:
            self.size = make_controller(self.memory.name, KEY, self.memory, **options)
            self.options = options
        return self.size


# What accumulate() remembers: per params object (a module, an optimizer, or the first
# tensor of a list; weakly), then per name. Never the model, the step function or the data.
_MEMORY: WeakIdMap[Any, dict[str, _Remembered]] = WeakIdMap()


def accumulate(step_fn: Callable[[Batch], torch.Tensor], batch: Batch,
               micro_batch_size: int | None = None, *, params: Params,
               name: str | None = None, **options: Any) -> torch.Tensor:
    """Gradients of ``step_fn`` over the whole ``batch``, in micro-batches if it does not fit.

    The function form of :class:`Accumulator`, whose options apply to this call only. The
    micro-batch size found persists per ``params`` object (while it lives) and ``name``
    (default: the step function's qualified name, so a step function defined anew every
    iteration keeps its size). Returns the whole batch's loss (detached). Typical use::

        loss = oomguard.accumulate(lambda mb: model(**mb).loss, batch, params=model,
                                   weight_by="causal-tokens")
        optimizer.step()
    """
    tensors = _param_list(params)
    check_positive_int("micro_batch_size", micro_batch_size, optional=True)
    key = name or f"{qualname(step_fn)}:micro_batch"
    anchor = params if isinstance(params, (torch.nn.Module, torch.optim.Optimizer)) \
        else (tensors[0] if tensors else None)
    known = _MEMORY.get(anchor) if anchor is not None else {}
    if known is None:
        known = _MEMORY[anchor] = {}
    entry = known.get(key)
    if entry is None:
        entry = known[key] = _Remembered(remembered(key, KEY, micro_batch_size))
    size = entry.controller({k: options.pop(k) for k in SIZE_OPTIONS if k in options})
    return Accumulator(step_fn, tensors, micro_batch_size=micro_batch_size, size=size,
                       **options)(batch)


def forget(name: str | None = None) -> None:
    """Drop the sizes :func:`accumulate` remembers for ``name`` (every name when None)."""
    for known in _MEMORY.values():
        if name is None:
            known.clear()
        else:
            known.pop(name, None)
