"""Micro-batching that keeps the effective batch: exact gradient accumulation on OOM.

When a whole batch does not fit, it is split along dim 0 into micro-batches (the fewest that fit,
as equal as the rows allow: :func:`micro_batches`); each micro-batch's loss is scaled by its share
of the batch's units before ``backward()``, so ``.grad`` equals the whole batch's within float
rounding. Modules that normalise with batch statistics (BatchNorm) are the exception: each
micro-batch is normalised with its own statistics, so :func:`accumulate` warns once per module. ``step_fn(micro_batch)`` returns a scalar loss, the mean over the
micro-batch's own units (``reduction="mean"``) or their sum (``"sum"``), and does not call
``backward`` itself. ``weight_by`` counts units: ``"samples"`` (rows), ``"tokens"`` (``labels !=
ignore_index``), ``"causal-tokens"`` (``labels[..., 1:] != ignore_index``) or a callable additive
over rows; a micro-batch with no units is skipped (its exact contribution is zero).

Each call *adds* to the gradients it finds, as ``loss.backward()`` does, so it can sit inside a
loop of one's own. Under DistributedDataParallel every micro-batch but the last runs under
``no_sync``. An attempt that fails (or is redone because another rank ran out of memory) puts the
gradients of ``params`` back as they were at entry (one copy of them, on their device), so each
micro-batch counts exactly once. The size after an OOM comes from the controller's policy
(default :class:`~oomguard.engine.core.execute.retry.FitPeaks`: the largest size the measured
peaks predict fits, halving where nothing was measured).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard.engine.core.execute.executor import SizeController, SizeMemory, qualname
from oomguard.engine.core.execute.priced import batch_remedy
from oomguard.engine.core.execute.retry import FitPeaks, RetryPolicy, Sizes
from oomguard.engine.core.snapshot import BufferCopy
from oomguard.engine.errors import UsageError, check_positive_int
from oomguard.engine.training.adaptive import make_controller, remembered
from oomguard.engine.util.rows import micro_batches, slice_rows
from oomguard.engine.util.weakmap import WeakIdMap

Batch = Any  # a tensor, a Mapping of tensors, or a tuple/list of them, rows on dim 0
Params = torch.nn.Module | torch.optim.Optimizer | Iterable[torch.Tensor]
WEIGHTS = ("samples", "tokens", "causal-tokens")
KEY = "micro_batch_size"


def micro_batch_for(effective: int, fits: int) -> int:
    """The micro-batch (rows) to run ``effective`` rows in where ``fits`` rows fit: the largest
    of :func:`micro_batches` (``micro_batch_for(64, 37)`` is 32: 64 rows as 32 + 32)."""
    return micro_batches(effective, fits)[0]


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


def row_units(batch: Batch, weight_by: str, labels_key: str = "labels",
              ignore_index: int = -100) -> list[int]:
    """Units per row: tokens that count towards the loss (``weight_by`` tokens/causal-tokens)."""
    if not isinstance(batch, Mapping) or labels_key not in batch:
        raise ValueError(f"weight_by={weight_by!r} needs a dict batch with {labels_key!r}")
    labels = batch[labels_key]
    if weight_by == "causal-tokens":
        labels = labels[..., 1:]
    return (labels != ignore_index).reshape(labels.shape[0], -1).sum(dim=1).tolist()


def _param_list(params: Params) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` a call adds to (a tied parameter may appear twice)."""
    if isinstance(params, torch.nn.Module):
        # A plain walk: cheaper than parameters() (measured: docs/measurements.md#parameter-walk).
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


def resolve_params(params: Params | None, optimizer: torch.optim.Optimizer | None) -> Params:
    """The params a call computes gradients for: ``params``, else ``optimizer``'s. With both,
    every trainable parameter of ``optimizer`` must be one of ``params``' (one-line
    :class:`UsageError` otherwise, before any work). An iterable comes back as a list."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"optimizer= takes a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                         "pass the optimizer your loop steps")
    if params is None:
        if optimizer is None:
            raise UsageError("give params= (the model, or its tensors) or optimizer=: whose "
                             "gradients the micro-batches add to")
        return optimizer
    if not isinstance(params, (torch.nn.Module, torch.optim.Optimizer)):
        params = list(params)  # walked more than once: a generator (model.parameters()) too
    if optimizer is not None:
        ours = {id(p) for p in _param_list(params)}
        if any(id(p) not in ours for p in _param_list(optimizer) if p.requires_grad):
            raise UsageError("optimizer= holds parameters that are not params=' (pass the "
                             "optimizer of this model, or params= alone)")
    return params


def _walk_modules(params: Params) -> tuple[list[torch.nn.Module], torch.nn.Module | None]:
    """The DistributedDataParallel modules ``params`` is or contains (outermost ones only), and
    its first module that normalises with the statistics of its batch (a BatchNorm in training
    mode, or one that keeps no running statistics), or None."""
    ddp = torch.nn.parallel.DistributedDataParallel
    batch_norm = torch.nn.modules.batchnorm._BatchNorm
    if not isinstance(params, torch.nn.Module):
        return [], None
    found: list[torch.nn.Module] = []
    batch_stats: torch.nn.Module | None = None
    stack: list[torch.nn.Module | None] = [params]
    while stack:
        module = stack.pop()
        if module is None:
            continue
        if batch_stats is None and isinstance(module, batch_norm) and (
                module.training or not module.track_running_stats):
            batch_stats = module
        if type(module) is ddp or isinstance(module, ddp):
            found.append(module)
        stack.extend(module._modules.values())
    return found, batch_stats


# The models accumulate() warned about (batch statistics), weakly: once per model.
_WARNED: WeakIdMap[torch.nn.Module, bool] = WeakIdMap()


def warn_batch_statistics(model: torch.nn.Module, norm: torch.nn.Module, rows: int,
                          sizes: list[int]) -> None:
    """Say once per ``model`` that its ``norm`` module (a BatchNorm) normalises each micro-batch
    with that micro-batch's statistics: gradients and running statistics then differ from one
    step over the whole ``rows``, which accumulation cannot reproduce."""
    if _WARNED.get(model):
        return
    _WARNED[model] = True
    shown = " + ".join(map(str, sizes)) if len(sizes) <= 4 else f"{len(sizes)} x ~{sizes[0]}"
    warnings.warn(
        f"{type(norm).__name__} normalises each micro-batch with its own statistics: "
        f"{rows} rows run as {shown} differ from one {rows}-row step (gradients and running "
        "statistics; accumulation cannot equal the whole batch here). Where that matters, "
        "use GroupNorm or LayerNorm, or give the batch room to run whole. Said once per model.",
        UserWarning, stacklevel=2)


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


def check_backward(backward: Callable[[torch.Tensor], Any] | None) -> Callable[[torch.Tensor], Any]:
    """``backward`` (default ``loss.backward()``); :class:`UsageError` when not callable."""
    if backward is None:
        return _default_backward
    if not callable(backward):
        raise UsageError(f"backward= takes a function of the loss (e.g. accelerator.backward), "
                         f"got {type(backward).__name__}; pass such a function, or leave it out")
    return backward


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


class EntryGrads:
    """The gradients present when a call starts, so that an attempt that fails can be undone:
    a copy of each existing ``.grad`` on its device."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = list({id(p): p for p in params}.values())  # a tied parameter once
        self.saved = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    def missing_bytes(self, device: Any) -> int:
        """What the gradients absent at entry will take on ``device`` once created (bytes, from
        the parameters' sizes: an estimate of what a first backward allocates there)."""
        dev = torch.device(device)
        if dev.index is None and dev.type != "cpu":  # "cuda": whichever index the params use
            return sum(p.nbytes for p in self.params if p.grad is None and p.device.type == dev.type)
        return sum(p.nbytes for p in self.params if p.grad is None and p.device == dev)

    @torch.no_grad()
    def restore(self) -> None:
        """Put the gradients back as they were at entry (in place where one exists, so a
        DistributedDataParallel bucket view stays a view)."""
        for p, saved in zip(self.params, self.saved, strict=True):
            if saved is None:
                p.grad = None
            elif p.grad is None or p.grad.shape != saved.shape or p.grad.dtype != saved.dtype:
                p.grad = saved.clone()
            else:
                p.grad.copy_(saved)


class Accumulator:
    """Runs ``step_fn`` over a batch in micro-batches with exact gradient accumulation.

    ``params`` (a module, an optimizer, or tensors): whose ``.grad`` one call adds to;
    ``optimizer``: its parameters when ``params`` is not given (with both, they must be
    ``params``'). ``backward(loss)``: how a scaled micro-batch loss is back-propagated
    (default ``loss.backward()``; ``accelerator.backward``). ``micro_batch_size`` (rows): the
    first size tried (None: the whole batch). The size options (``policy``, ``minimum``, ...)
    are the size controller's. With ``size``, an existing controller (how :func:`accumulate`
    keeps the size between calls), its options apply and ``micro_batch_size`` only bounds
    the micro-batches.
    """

    def __init__(self, step_fn: Callable[[Batch], torch.Tensor], params: Params | None = None,
                 *, optimizer: torch.optim.Optimizer | None = None,
                 backward: Callable[[torch.Tensor], Any] | None = None,
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
        self.backward = check_backward(backward)
        self.step_fn = step_fn
        self.weight_by, self.reduction = weight_by, reduction
        self.labels_key, self.ignore_index = labels_key, ignore_index
        self.set_params(resolve_params(params, optimizer))
        self.limit = micro_batch_size if size is not None else None
        if size is None and policy is None:
            policy = FitPeaks(device if device is not None else _device_of(self.params))
        self.size = size or make_controller(
            name or f"{qualname(step_fn)}:micro_batch", KEY, micro_batch_size, minimum=minimum,
            policy=policy, grow_after=grow_after, device=device, group=group,
            sync_ranks=sync_ranks)

    @property
    def micro_batch_size(self) -> int | None:
        """The remembered micro-batch size in rows (None: whole batches have fitted so far)."""
        return self.size.current

    def set_params(self, params: Params) -> None:
        """Change the tensors whose gradients are computed (and the DDP modules synced)."""
        self.params = _param_list(params)
        self._holder = params
        self._ddp: list[torch.nn.Module] | None = None
        self._split: tuple[int, list[int]] | None = None  # rows and sizes of a split batch
        # Whose buffers (BatchNorm's running statistics) a failed attempt's forward updated.
        self._modules = [params] if isinstance(params, torch.nn.Module) else []

    @property
    def ddp(self) -> list[torch.nn.Module]:
        """The DistributedDataParallel modules in ``params``, looked for only when a batch is
        split (whole batches need no ``no_sync``, and the walk costs about what the parameter
        walk does); the same walk warns once about batch statistics
        (:func:`warn_batch_statistics`)."""
        if self._ddp is None:
            holder, self._holder = self._holder, None  # hold no reference to the model longer
            self._ddp, norm = _walk_modules(holder)
            if norm is not None and self._split is not None:
                warn_batch_statistics(holder, norm, *self._split)
        return self._ddp

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Add the gradients of the whole batch's loss to ``.grad``; return that loss
        (detached: the whole batch's mean, or sum, over its units)."""
        n = batch_length(batch)
        cap = n if self.limit is None else min(n, self.limit)
        weights: dict[str, Any] = {}  # units per row, computed once and only when splitting
        entry = EntryGrads(self.params)
        buffers = BufferCopy.take(self._modules)  # put back with the gradients
        policy = self.size.policy
        guided = policy if isinstance(policy, FitPeaks) else None
        if guided is not None:
            guided.reserve_bytes = entry.missing_bytes(guided.device)

        added = False  # whether .grad holds an attempt's gradients

        def attempt(sizes: Sizes) -> torch.Tensor:
            nonlocal added
            if added:  # an attempt that ran, redone because another rank ran out of memory
                entry.restore()
                buffers.restore()
            added = True
            try:
                return self._run_at(batch, n, sizes[KEY], weights, guided, entry)
            except BaseException:
                # Undo the partial gradients before the retry: each micro-batch counts once.
                entry.restore()
                buffers.restore()
                added = False
                raise

        return self.size.run(attempt, cap={KEY: cap})

    def _units(self, batch: Batch, n: int, cache: dict[str, Any]) -> tuple[list[float], float]:
        """Prefix sums of units over rows (length n + 1) and the total."""
        if "prefix" not in cache:
            if callable(self.weight_by):  # no prefix: _plan counts each micro-batch's units
                cache["prefix"], cache["total"] = [], float(self.weight_by(batch))
            else:
                per_row = [1] * n if self.weight_by == "samples" else row_units(
                    batch, self.weight_by, self.labels_key, self.ignore_index)
                prefix = [0.0, *itertools.accumulate(map(float, per_row))]
                cache["prefix"], cache["total"] = prefix, prefix[-1]
            if cache["total"] <= 0:
                raise ValueError("the batch has no units to weight the loss by (every label "
                                 f"is {self.ignore_index}?): its mean loss is undefined")
        return cache["prefix"], cache["total"]

    def _plan(self, batch: Batch, n: int, m: int, cache: dict[str, Any]
              ) -> list[tuple[Batch, int, float]]:
        """The micro-batches of at most ``m`` rows (:func:`micro_batches`) that have units:
        (rows, their count, their weight)."""
        prefix, total = self._units(batch, n, cache)
        plan = []
        stop = 0
        for rows in micro_batches(n, m):
            start, stop = stop, stop + rows
            micro = slice_rows(batch, start, stop)
            units = float(self.weight_by(micro)) if callable(self.weight_by) \
                else prefix[stop] - prefix[start]
            if units != 0:  # no units: its mean is 0/0, its exact contribution zero
                plan.append((micro, stop - start, units / total if self.reduction == "mean"
                             else 1.0))
        return plan

    def _run_at(self, batch: Batch, n: int, m: int, cache: dict[str, Any],
                guided: FitPeaks | None, entry: EntryGrads) -> torch.Tensor:
        """One attempt: every micro-batch of ``m`` rows, added to the gradients; all but the
        last under each DDP module's ``no_sync`` (one all-reduce per call, as DDP expects)."""
        plan = [(batch, n, 1.0)] if m >= n else self._plan(batch, n, m, cache)
        assert plan  # total > 0 guarantees one micro-batch with units
        if len(plan) > 1:
            self._split = (n, [rows for _, rows, _ in plan])
            _ = self.ddp  # the modules' walk, once per call that splits
        # The first backward creates the missing gradients: not part of a micro-batch's line.
        created = guided.reserve_bytes if guided is not None else 0
        total_loss: torch.Tensor | None = None
        for i, (micro, rows, weight) in enumerate(plan):
            probe = guided.probe(rows) if guided is not None else None
            try:
                with contextlib.ExitStack() as quiet:
                    if i < len(plan) - 1:  # (a whole batch is one micro-batch: the last)
                        for module in self.ddp:
                            quiet.enter_context(module.no_sync())
                    loss = self.step_fn(micro)
                    self.backward(loss * weight if weight != 1.0 else loss)
            finally:  # a probe's sampler stops also when the step runs out of memory
                peak = probe.read() if probe is not None else None
            if peak is not None:
                guided.observe(rows, max(0, peak - created))  # type: ignore[union-attr]
            created = 0
            part = loss.detach() * weight if weight != 1.0 else loss.detach()
            total_loss = part if total_loss is None else total_loss + part
            del loss
        assert total_loss is not None
        return total_loss


SIZE_OPTIONS = ("minimum", "policy", "grow_after", "device", "group", "sync_ranks",
                "watch_alloc_retries")


@dataclass(eq=False)
class _Remembered:
    """The size :func:`accumulate` found for one (params, name), and its last controller."""

    memory: SizeMemory
    options: dict[str, Any] = field(default_factory=dict)
    size: SizeController | None = None
    peaks: FitPeaks | None = None

    def guided(self, device: Any, params: Params) -> FitPeaks:
        """The default policy, one per entry so that its measured peaks last across calls."""
        if self.peaks is None:
            where = device if device is not None else _device_of(_param_list(params))
            self.peaks = FitPeaks(where)
        return self.peaks

    def controller(self, options: dict[str, Any]) -> SizeController:
        """A controller with this call's options (the last one when they are the same)."""
        if self.size is None or options != self.options:
            self.size = make_controller(self.memory.name, KEY, self.memory, **options)
            self.options = options
        return self.size


# What accumulate() remembers, weakly per params object (or a list's first tensor), then per name.
_MEMORY: WeakIdMap[Any, dict[str, _Remembered]] = WeakIdMap()


def accumulate(step_fn: Callable[[Batch], torch.Tensor], batch: Batch,
               micro_batch_size: int | None = None, *, params: Params | None = None,
               optimizer: torch.optim.Optimizer | None = None,
               backward: Callable[[torch.Tensor], Any] | None = None,
               name: str | None = None, remedies: Any = None, **options: Any) -> torch.Tensor:
    """Add the gradients of ``step_fn`` over the whole ``batch`` to ``.grad``, in micro-batches
    if it does not fit.

    ``remedies`` (e.g. ``("accumulate", "checkpoint")``; ``params`` the model): the first call
    measures each way to fit the batch and runs the fastest, remembered for later calls
    (:mod:`~oomguard.engine.core.execute.priced`).

    The function form of :class:`Accumulator`, whose options apply to this call only. The
    micro-batch size found (and the measured peaks) persists per ``params`` object, else
    ``optimizer`` (while it lives), and ``name`` (default: the step function's qualified
    name). Returns the whole batch's loss (detached, not scaled by ``backward``)::

        loss = oomguard.accumulate(lambda mb: model(**mb).loss, batch, params=model,
                                   weight_by="causal-tokens")
        optimizer.step()
    """
    check_backward(backward)
    check_positive_int("micro_batch_size", micro_batch_size, optional=True)
    params = resolve_params(params, optimizer)
    key = name or f"{qualname(step_fn)}:micro_batch"
    anchor = params if isinstance(params, (torch.nn.Module, torch.optim.Optimizer)) \
        else (params[0] if params else None)
    known = _MEMORY.get(anchor) if anchor is not None else {}
    if known is None:
        known = _MEMORY[anchor] = {}
    entry = known.get(key)
    if entry is None:
        entry = known[key] = _Remembered(remembered(key, KEY, micro_batch_size))
    chosen = {k: options.pop(k) for k in SIZE_OPTIONS if k in options}
    if chosen.get("policy") is None:
        chosen["policy"] = entry.guided(chosen.get("device"), params)
    applied: Any = contextlib.nullcontext()
    if remedies is not None:  # the configuration priced fastest, at most its micro-batch
        choice = batch_remedy(step_fn, batch, batch_length(batch), params,
                              backward=check_backward(backward), optimizer=optimizer,
                              remedies=remedies, name=key, device=chosen.get("device"))
        micro_batch_size = min(micro_batch_size or choice.micro_batch, choice.micro_batch)
        applied = choice.applied(params)  # type: ignore[arg-type]
    with applied:
        return Accumulator(step_fn, params, backward=backward, micro_batch_size=micro_batch_size,
                           size=entry.controller(chosen), **options)(batch)


def forget(name: str | None = None) -> None:
    """Drop the sizes :func:`accumulate` remembers for ``name`` (every name when None)."""
    for known in _MEMORY.values():
        if name is None:
            known.clear()
        else:
            known.pop(name, None)
