"""A Lightning callback that finds the exact largest micro-batch of the module's training step
with its optimizer, and keeps the effective batch.

Lightning's ``BatchSizeFinder`` takes a further margin off the size it finds (``binsearch``)
or stops at a power of two (``power``); this callback searches every size. The effective batch
``batch_size x accumulate_grad_batches`` is kept: the micro-batch becomes its largest divisor
at or below the recommended size (:func:`~.sizing.split_for`), and the epoch loop and the
automatic optimization both read ``trainer.accumulate_grad_batches`` while the fit runs
(lightning 2.6), so each optimizer step sees the mean gradient of the same rows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)

from oomguard.engine.errors import UsageError
from oomguard.engine.integrations.sizing import Split, search_step, split_for, training_trial
from oomguard.engine.util.rows import slice_rows

log = logging.getLogger("oomguard.integrations")


class BatchSizeCallback(pl.Callback):
    """Size the micro-batch in ``on_fit_start`` (the optimizer exists, the dataloaders do not
    yet): search the module's ``training_step``, ``backward`` and optimizer step, two steps per
    trial, module and optimizer restored afterwards; then set the batch size to the largest
    divisor of ``batch_size x accumulate_grad_batches`` at or below the recommended size (with
    ``largest``: the largest that ran) and ``trainer.accumulate_grad_batches`` to the quotient.
    ``batch_arg_name``: the attribute holding the batch size (on the module, its ``hparams``
    or the datamodule). ``search_options`` go to ``oomguard.search``. ``split``: what was
    chosen."""

    def __init__(self, batch_arg_name: str = "batch_size", largest: bool = False,
                 **search_options: Any) -> None:
        super().__init__()
        self.batch_arg_name = batch_arg_name
        self.largest = largest
        self.search_options = search_options
        self.split: Split | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check(trainer, pl_module, self.batch_arg_name)
        configured = int(lightning_getattr(pl_module, self.batch_arg_name))
        effective = configured * trainer.accumulate_grad_batches
        optimizer = trainer.optimizers[0]
        batch = _first_rows(trainer, pl_module, self.batch_arg_name, effective)
        precision = trainer.strategy.precision_plugin

        def micro_step(size: int) -> torch.Tensor:
            with precision.train_step_context(), _logging_off(pl_module):
                out = pl_module.training_step(slice_rows(batch, 0, size), 0)
            loss = out["loss"] if isinstance(out, Mapping) else out
            loss.backward()
            return loss

        try:
            result = search_step(training_trial(micro_step, optimizer, effective), effective,
                                 (pl_module, optimizer), f"{type(pl_module).__name__}.training_step",
                                 **self.search_options)
        finally:
            lightning_setattr(pl_module, self.batch_arg_name, configured)
        self.split = split = split_for(effective, result, self.largest)
        lightning_setattr(pl_module, self.batch_arg_name, split.micro_batch)
        trainer.accumulate_grad_batches = split.accumulation
        log.info("Lightning: micro-batch %d x %d accumulated batches = %d rows per optimizer "
                 "step (largest that ran: %d)", split.micro_batch, split.accumulation,
                 effective, split.found)


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


def _first_rows(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, n: int) -> Any:
    """A batch of ``n`` rows from the training dataloader, as the fit loop would see it on
    the device; drawn with the RNG forked so that the run's shuffling is unchanged."""
    source = trainer.datamodule if trainer.datamodule is not None else pl_module
    lightning_setattr(pl_module, name, n)
    with torch.random.fork_rng(devices=[]):
        batch = next(iter(source.train_dataloader()))
    return trainer.strategy.batch_to_device(batch)


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
