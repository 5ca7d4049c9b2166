"""A Lightning callback that finds the exact largest micro-batch of the module's training step
with its optimizer, and keeps the effective batch.

Lightning's ``BatchSizeFinder`` takes a further margin off the size it finds (``binsearch``)
or stops at a power of two (``power``); this callback searches every size. The effective batch
``batch_size x accumulate_grad_batches`` is kept: it runs as the fewest micro-batches that fit
the recommended size, as equal as the rows allow (:func:`~.sizing.split_for`), and the epoch
loop and the automatic optimization both read ``trainer.accumulate_grad_batches`` while the fit
runs (lightning 2.6). Equal micro-batches are Lightning's own accumulation at a smaller
``batch_size``. Unequal ones (64 rows where 25 fit: 22 + 21 + 21) need a plain ``DataLoader``:
it is rebuilt to load the effective batch and hand it out in micro-batches
(:class:`ChunkedBatchSampler`), and each micro-batch's loss is weighted by its share of the
rows, so each optimizer step sees the mean gradient of the same rows.

With ``lengths=`` (one per training sample), the micro-batches are planned from the lengths
instead (:func:`~oomguard.engine.core.shapes.search_shapes` of the module's step on the
longest sample cut to each length): the loader is rebuilt to load each optimizer step's
samples, of like length, as one batch (:class:`~.length_steps.StepSampler`), and the
module's ``training_step`` runs it in the micro-batches the plan allows at their own length
(:func:`~.length_steps.cut_step`), each loss weighted by its share of the step's rows or
tokens (``weight_by``).

With ``remedies=("accumulate", "checkpoint")``, ``on_fit_start`` prices each configuration
instead of the one search (:func:`~.sizing.priced_split`): the fastest safe one's micro-batch
splits the effective batch, and its configuration (checkpointing the module's repeated
blocks) holds while the fit runs and is undone when it ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from oomguard.engine.core.execute.priced import (
    RemedyChoice,
    check_remedies,
    parse_remedies,
    pricing_options,
)
from oomguard.engine.core.length_batches import check_lengths
from oomguard.engine.core.shapes import search_shapes
from oomguard.engine.errors import UsageError
from oomguard.engine.integrations.length_steps import StepSampler, cut_step, trimmed
from oomguard.engine.integrations.sizing import (
    STEPS_PER_TRIAL,
    Split,
    batch_rows,
    priced_split,
    search_step,
    split_for,
    training_trial,
)
from oomguard.engine.training.accumulate import WEIGHTS, row_units
from oomguard.engine.util.rows import micro_batches, slice_rows

log = logging.getLogger("oomguard.integrations")


class BatchSizeCallback(pl.Callback):
    """Size the micro-batch in ``on_fit_start`` (the optimizer exists, the dataloaders do not
    yet): search the module's ``training_step``, ``backward``, gradient clipping and optimizer
    step, two steps per trial, module and optimizer restored afterwards; then split
    ``batch_size x accumulate_grad_batches`` rows into the fewest micro-batches of at most the
    recommended size (with ``largest``: the largest that ran), as equal as the rows allow.
    Equal ones set the batch size and ``trainer.accumulate_grad_batches``; unequal ones
    rebuild a plain ``DataLoader`` to hand out the micro-batches, with each loss weighted by
    its rows (a loader that cannot be rebuilt gets equal ones). ``batch_arg_name``: the
    attribute holding the batch size (on the module, its ``hparams`` or the datamodule).
    ``search_options`` go to ``oomguard.search``. ``split``: what was chosen.

    ``remedies`` (e.g. ``("accumulate", "checkpoint")``; default none): where the effective
    batch does not fit at one micro-batch, the fit runs in the fastest safe configuration,
    priced (:func:`~.sizing.priced_split`; ``search_options`` are then the pricing's:
    ``budget``, ``margin``, ...); its table is ``remedy``. The names and options are checked
    here, the module (repeated blocks for ``checkpoint``) when the fit starts, each in one
    line before any work.

    ``lengths`` (each training sample's length, in tokens; batches must be dicts of tensors
    padded along dim 1): plan the micro-batches from them (``search_options`` go to
    ``search_shapes``); ``weight_by`` how a step's micro-batches' losses add up to the
    step's: ``"samples"`` (a mean over rows), ``"tokens"`` or ``"causal-tokens"`` (a mean
    over the labels' tokens, or over all but each row's first: a causal language model's)."""

    def __init__(self, batch_arg_name: str = "batch_size", largest: bool = False,
                 remedies: Any = None, lengths: Any = None, weight_by: str = "samples",
                 **search_options: Any) -> None:
        super().__init__()
        self.batch_arg_name = batch_arg_name
        self.largest = largest
        self.remedies = None if remedies is None else parse_remedies(remedies)
        self.lengths = None if lengths is None else check_lengths(lengths)
        if self.lengths is not None and self.remedies is not None:
            raise UsageError("lengths= plans micro-batches by length and remedies= prices one "
                             "micro-batch size: give one of them")
        if weight_by not in WEIGHTS:
            raise UsageError(f"weight_by must be one of {', '.join(WEIGHTS)}, got {weight_by!r}; "
                             "give one of them")
        self.weight_by = weight_by
        if self.remedies is not None:
            pricing_options(search_options)
        self.search_options = search_options
        self.split: Split | None = None
        self._share = 1.0  # the running micro-batch's loss weight (unequal micro-batches)
        self._undo: list[Callable[[], None]] = []

    @property
    def remedy(self) -> RemedyChoice | None:
        """The remedies' pricing: its table (``.table``, ``.to_dict()``) and the configuration
        chosen (None: no ``remedies``, or no fit started)."""
        return None if self.split is None else self.split.remedy

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check(trainer, pl_module, self.batch_arg_name)
        if self.remedies is not None:
            check_remedies(self.remedies, pl_module, pl_module.device)
        configured = int(lightning_getattr(pl_module, self.batch_arg_name))
        effective = configured * trainer.accumulate_grad_batches
        optimizer = trainer.optimizers[0]
        loader, batch = _first_rows(trainer, pl_module, self.batch_arg_name, effective)
        micro_step = _micro_steps(trainer, pl_module, batch)

        def clip() -> None:  # what the loop calls before each optimizer step
            with _logging_off(pl_module):
                pl_module.configure_gradient_clipping(
                    optimizer, gradient_clip_val=trainer.gradient_clip_val,
                    gradient_clip_algorithm=trainer.gradient_clip_algorithm)

        name = f"{type(pl_module).__name__}.training_step"
        if self.lengths is not None:
            try:
                self.split = self._plan(trainer, pl_module, loader, batch, effective, clip, name)
            finally:
                lightning_setattr(pl_module, self.batch_arg_name, configured)
            return
        try:
            if self.remedies is not None:
                split = priced_split(micro_step, effective, min(effective, batch_rows(batch)),
                                     pl_module, optimizer, self.remedies, name, "Lightning",
                                     self.largest, equal=not _chunkable(loader), clip=clip,
                                     **self.search_options)
            else:
                result = search_step(training_trial(micro_step, optimizer, effective, clip),
                                     effective, (pl_module, optimizer), name,
                                     **self.search_options)
                split = split_for(effective, result, self.largest, equal=not _chunkable(loader))
        finally:
            lightning_setattr(pl_module, self.batch_arg_name, configured)
        self.split = split
        if split.remedy is not None:  # the chosen configuration while the fit runs
            applied = contextlib.ExitStack()
            applied.enter_context(split.remedy.applied(pl_module))
            self._undo.append(applied.close)
        if split.equal:
            lightning_setattr(pl_module, self.batch_arg_name, split.micro_batch)
        else:  # the loader loads every row of a step, and hands them out in micro-batches
            lightning_setattr(pl_module, self.batch_arg_name, effective)
            self._hand_out(trainer, pl_module, split)
        trainer.accumulate_grad_batches = split.accumulation
        log.info("Lightning: micro-batches %s = %d rows per optimizer step (at most %d rows; "
                 "largest that ran: %s)%s", split.describe(), effective, split.allowed,
                 split.found, "" if split.remedy is None
                 else f", in the configuration {split.remedy.chosen.name}")

    def _hand_out(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                  split: Split) -> None:
        """Run an unequal split: the training dataloader rebuilt with a
        :class:`ChunkedBatchSampler` and the module's ``backward`` weighting each micro-batch's
        loss by its rows (Lightning divides every loss by ``accumulate_grad_batches``); both
        undone when the fit ends."""
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        hook = source.train_dataloader
        backward = pl_module.backward

        def train_dataloader() -> DataLoader:
            return chunked(hook(), split.micro_batch)

        def weighted(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            backward(loss * self._share, *args, **kwargs)

        self._undo += [_replaced(source, "train_dataloader", train_dataloader),
                       _replaced(pl_module, "backward", weighted)]

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader: Any,
              batch: Any, effective: int, clip: Callable[[], None], name: str) -> Split:
        """Plan the micro-batches from :attr:`lengths` and hand out each step's samples as one
        batch, which the module's ``training_step`` runs in them (:meth:`_run_steps`)."""
        lengths = self.lengths
        assert lengths is not None
        if not _chunkable(loader) or not isinstance(batch, Mapping):
            raise UsageError("lengths= rebuilds the training DataLoader and cuts its batches "
                             "along dim 1: give a plain DataLoader of a map-style dataset whose "
                             "batches are dicts of padded tensors")
        if len(lengths) != len(loader.dataset):
            raise UsageError(f"lengths has {len(lengths)} entries and the training dataset "
                             f"{len(loader.dataset)} samples: give one length per sample")
        optimizer = trainer.optimizers[0]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        row = loader.dataset[longest]

        def step(size: int, seq_len: int) -> float:
            whole = trainer.strategy.batch_to_device(loader.collate_fn([row] * size))
            micro_step = _micro_steps(trainer, pl_module, trimmed(whole, slice(0, size), seq_len))
            return training_trial(micro_step, optimizer, effective, clip)(size)

        step.__name__ = name  # type: ignore[attr-defined]
        # No fake-tensor estimate unless asked: tracing a framework's step costs more than
        # the real trials (measured on the Trainer's: 10-28 s against 3.7 s).
        options = {"steps_per_trial": STEPS_PER_TRIAL, "max_size": effective,
                   "estimate": False} | self.search_options
        plan = search_shapes(step, lengths, restore=(pl_module, optimizer), **options)
        split = Split(effective, effective, 1, None, plan=plan)
        lightning_setattr(pl_module, self.batch_arg_name, effective)
        self._run_steps(trainer, pl_module, split)
        trainer.accumulate_grad_batches = 1
        log.info("Lightning: %d rows per optimizer step, micro-batches %s (%d real trials)",
                 effective, split.describe(), plan.trials)
        return split

    def _run_steps(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                   split: Split) -> None:
        """The training dataloader rebuilt to load each optimizer step's samples as one batch
        (:class:`StepSampler`, shuffled each epoch, whole steps per rank), and the step run
        in the plan's micro-batches, each loss weighted by its share of the step: the module's
        ``training_step`` returns the first one's loss, and its ``backward`` (which Lightning
        calls after setting the gradients to zero) back-propagates it, then runs every other
        micro-batch's ``training_step`` and backward in turn; all undone when the fit ends."""
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        hook, training_step, backward = (source.train_dataloader, pl_module.training_step,
                                         pl_module.backward)
        lengths, plan = self.lengths, split.plan
        assert lengths is not None
        seed = torch.initial_seed() % 2**31  # pl.seed_everything's, so a run repeats

        def train_dataloader() -> DataLoader:
            original = hook()
            sampler = StepSampler(lengths, plan.max_batch, split.effective, seed=seed,
                                  rank=trainer.global_rank, world_size=trainer.world_size)
            return DataLoader(original.dataset, batch_sampler=sampler,
                              collate_fn=original.collate_fn, num_workers=original.num_workers,
                              pin_memory=original.pin_memory,
                              worker_init_fn=original.worker_init_fn,
                              persistent_workers=original.persistent_workers)

        precision = trainer.strategy.precision_plugin
        pending: list[tuple[Any, float, tuple[Any, ...], dict[str, Any]]] = []

        def stepped(batch: Any, *args: Any, **kwargs: Any) -> Any:
            pieces = cut_step(batch, plan.max_batch)
            units = [sum(self._units(piece)) for piece in pieces]
            total = sum(units)
            pending[:] = [(p, n / total, args, kwargs)
                          for p, n in zip(pieces[1:], units[1:], strict=True)]
            self._share = units[0] / total
            return training_step(pieces[0], *args, **kwargs)

        def weighted(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            backward(loss * self._share, *args, **kwargs)
            rest = list(pending)
            pending.clear()
            for piece, share, step_args, step_kwargs in rest:
                with precision.train_step_context(), _fx_named(pl_module, "training_step"):
                    out = training_step(piece, *step_args, **step_kwargs)
                backward(_loss_of(out) * share, *args, **kwargs)

        self._undo += [_replaced(source, "train_dataloader", train_dataloader),
                       _replaced(pl_module, "training_step", stepped),
                       _replaced(pl_module, "backward", weighted)]

    def _units(self, batch: Any) -> list[int]:
        """Per row of ``batch``: 1, or the tokens its loss counts (``weight_by``)."""
        if self.weight_by == "samples":
            return [1] * batch_rows(batch)
        return row_units(batch, self.weight_by)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        split = self.split
        if split is not None and split.plan is not None:
            return  # whole steps: stepped() sets each micro-batch's share
        if split is not None and not split.equal:  # rows x steps / effective: 1 on average
            self._share = batch_rows(batch) * split.accumulation / split.effective

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        """Put back what :meth:`_hand_out` replaced and undo the chosen remedy's
        configuration: the module and datamodule as before."""
        while self._undo:
            self._undo.pop()()


class ChunkedBatchSampler(BatchSampler):
    """The batches of ``batch_size`` indices that ``BatchSampler(sampler, batch_size,
    drop_last)`` yields, each handed out as :func:`~oomguard.engine.util.rows.micro_batches`
    of at most ``most`` indices (a short last batch too). Its arguments are a ``BatchSampler``'s,
    so Lightning can give it a distributed sampler."""

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool, most: int) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.most = most

    def __iter__(self) -> Iterator[list[int]]:
        for whole in super().__iter__():
            stop = 0
            for rows in micro_batches(len(whole), self.most):
                start, stop = stop, stop + rows
                yield whole[start:stop]

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size)  # type: ignore[arg-type]
        count = full * len(micro_batches(self.batch_size, self.most))
        return count + (len(micro_batches(rest, self.most)) if rest and not self.drop_last else 0)


def _chunkable(loader: Any) -> bool:
    """Whether ``loader`` can be rebuilt with a :class:`ChunkedBatchSampler`: a plain
    ``DataLoader`` batching a map-style dataset with its own ``BatchSampler``."""
    return (type(loader) is DataLoader and loader.batch_size is not None
            and type(loader.batch_sampler) is BatchSampler
            and not isinstance(loader.dataset, IterableDataset))


def chunked(loader: DataLoader, most: int) -> DataLoader:
    """``loader`` (a plain ``DataLoader``: :func:`_chunkable`) rebuilt to hand out each of its
    batches as micro-batches of at most ``most`` rows: the same dataset, sampler, order and
    workers."""
    sampler = ChunkedBatchSampler(loader.sampler, loader.batch_size, loader.drop_last, most)
    return DataLoader(
        loader.dataset, batch_sampler=sampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator, prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order)


def _replaced(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``owner.name`` to ``value`` on the instance; return what puts it back (the
    instance's own attribute where it had one, else the class's)."""
    own = name in vars(owner)
    before = vars(owner).get(name)
    setattr(owner, name, value)

    def undo() -> None:
        if own:
            setattr(owner, name, before)
        else:
            delattr(owner, name)
    return undo


def _check(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> None:
    """One-line :class:`UsageError` for what the callback cannot size, before any work."""
    if not pl_module.automatic_optimization:
        raise UsageError("BatchSizeCallback sizes automatic optimization; this module steps "
                         "its optimizers itself (automatic_optimization=False); size its batch "
                         "with oomguard.search instead")
    if len(trainer.optimizers) != 1:
        raise UsageError(f"BatchSizeCallback sizes a module with one optimizer; "
                         f"configure_optimizers returned {len(trainer.optimizers)}; size its "
                         "batch with oomguard.search instead")
    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise UsageError("BatchSizeCallback sets accumulate_grad_batches, which a "
                         "GradientAccumulationScheduler would change: use one of them")
    if not lightning_hasattr(pl_module, name):
        raise UsageError(f"BatchSizeCallback: no {name!r} on the module, its hparams or the "
                         f"datamodule; the dataloaders must read the batch size from there: "
                         f"give the module a {name!r} attribute and read it in them")
    if not trainer.fit_loop._data_source.is_module():
        raise UsageError("BatchSizeCallback cannot size dataloaders passed to fit() directly: "
                         "build them in the LightningModule or a LightningDataModule")


def _first_rows(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, n: int
                ) -> tuple[Any, Any]:
    """The training dataloader at ``n`` rows per batch, and its first batch as the fit loop
    would see it on the device; drawn with the RNG forked so that the run's shuffling is
    unchanged."""
    source = trainer.datamodule if trainer.datamodule is not None else pl_module
    lightning_setattr(pl_module, name, n)
    with torch.random.fork_rng(devices=[]):
        loader = source.train_dataloader()
        batch = next(iter(loader))
    return loader, trainer.strategy.batch_to_device(batch)


def _loss_of(out: Any) -> torch.Tensor:
    """The loss a ``training_step`` returned (a tensor, or a dict's ``"loss"``)."""
    return out["loss"] if isinstance(out, Mapping) else out


def _micro_steps(trainer: pl.Trainer, pl_module: pl.LightningModule,
                 batch: Any) -> Callable[[int], torch.Tensor]:
    """``micro_step(n)``: the module's ``training_step`` on the first ``n`` rows of ``batch``
    in the loop's precision context, logging nothing, and its backward; the loss."""
    precision = trainer.strategy.precision_plugin

    def micro_step(n: int) -> torch.Tensor:
        with precision.train_step_context(), _logging_off(pl_module):
            loss = _loss_of(pl_module.training_step(slice_rows(batch, 0, n), 0))
        loss.backward()
        return loss

    return micro_step


@contextlib.contextmanager
def _fx_named(pl_module: pl.LightningModule, name: str) -> Iterator[None]:
    """Lightning's record of the hook running (``self.log`` checks it) set to ``name`` for
    the block: a micro-batch's ``training_step`` run from within ``backward``."""
    before = pl_module._current_fx_name
    pl_module._current_fx_name = name
    try:
        yield
    finally:
        pl_module._current_fx_name = before


@contextlib.contextmanager
def _logging_off(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` raises outside the loop's hooks (on_fit_start may not log), so a trial's
    ``training_step`` logs nothing."""
    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.log, pl_module.log_dict = nothing, nothing  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
