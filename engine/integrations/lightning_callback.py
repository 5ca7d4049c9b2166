"""A Lightning callback that finds the exact largest micro-batch of the module's training step
with its optimizer, and keeps the effective batch.

Lightning's own ``BatchSizeFinder`` runs the fit loop at doubling sizes; its ``binsearch``
mode then takes a further ``margin`` (5% by default) off the size found, and its ``power``
mode stops at a power of two (lightning 2.6 tuner/batch_size_scaling.py). This callback
searches every size (``oomguard.search``: the bracket between the largest fit and the
smallest OOM closes at adjacent sizes), running the module's ``training_step``,
``backward`` (twice below the effective batch: :func:`~.sizing.passes`) and the optimizer's
``step`` and ``zero_grad``, two such steps per trial (the first allocates the optimizer's
state), the module and optimizer restored afterwards.

The effective batch is ``batch_size x accumulate_grad_batches`` rows per optimizer step. It is
kept: the micro-batch becomes its largest divisor at or below the search's recommended size
(:func:`~.sizing.split_for`; the exact maximum stays in ``split.found``), set with
``lightning_setattr`` (the module, its ``hparams`` and the datamodule, as ``BatchSizeFinder``
sets it), and ``trainer.accumulate_grad_batches`` becomes the quotient. Both are read while
the fit runs: the epoch loop checks ``batch_idx % trainer.accumulate_grad_batches`` and the
automatic optimization divides each micro-batch's loss by it (lightning 2.6
loops/training_epoch_loop.py, loops/optimization/automatic.py), so each optimizer step sees
the mean gradient of the same rows. The callback runs in ``on_fit_start``: after
``strategy.setup`` (the optimizer exists, the module is on its device) and before the fit
loop builds its dataloaders (trainer.py ``_run``).
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
from oomguard.engine.integrations.sizing import (
    Split,
    search_step,
    split_for,
    training_trial,
)
from oomguard.engine.util.rows import slice_rows

log = logging.getLogger("oomguard.integrations")


class BatchSizeCallback(pl.Callback):
    """Size the micro-batch at the start of each ``fit`` (``on_fit_start``: the optimizer
    exists, the dataloaders are not built yet): search the module's ``training_step``,
    ``backward`` and the optimizer's step, two steps per trial, to the exact maximum, with the
    module and optimizer restored afterwards; then keep the effective batch
    (``batch_size x accumulate_grad_batches``) by setting the batch size to its largest divisor
    at or below the size chosen and ``trainer.accumulate_grad_batches`` to the quotient.
    ``batch_arg_name``: the attribute holding the batch size (on the module, its ``hparams``
    or the datamodule). The micro-batch is at most the search's recommended size, or with
    ``largest`` the largest size that ran (:func:`~.sizing.split_for`). ``search_options`` go to ``oomguard.search``. After ``fit`` starts,
    ``split`` holds what was chosen."""

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
            result = search_step(training_trial(micro_step, optimizer, effective), effective, (pl_module, optimizer),
                                 f"{type(pl_module).__name__}.training_step",
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
                         "its optimizers itself (automatic_optimization=False)")
    if len(trainer.optimizers) != 1:
        raise UsageError(f"BatchSizeCallback sizes a module with one optimizer; "
                         f"configure_optimizers returned {len(trainer.optimizers)}")
    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise UsageError("BatchSizeCallback sets accumulate_grad_batches, which a "
                         "GradientAccumulationScheduler would change: use one of them")
    if not lightning_hasattr(pl_module, name):
        raise UsageError(f"BatchSizeCallback: no {name!r} on the module, its hparams or the "
                         "datamodule; the dataloaders must read the batch size from there")
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
