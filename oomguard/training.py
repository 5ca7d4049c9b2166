"""Training-script parts beyond ``adaptive``, ``find_executable_batch_size``,
``accumulate``, ``micro_batch_for`` and ``stats``: the :class:`Accumulator` that
``accumulate`` runs (for a step that keeps its own), :func:`micro_batches` (the rows of each
micro-batch an effective batch runs as, where ``micro_batch_for`` is the largest),
:func:`reset_stats` (zero the counters ``stats`` shows) and :class:`Snapshot` (a host copy of
models, optimizers and RNG states, put back exactly: what ``search(step, restore=(model,
optimizer))`` takes before its trials); :func:`plan_steps` and :func:`step_shares` (optimizer
steps of a fixed number of rows or tokens, cut into batches a shape plan's ``max_batch``
allows, and each batch's share of its step's loss: the mean over the step's rows or tokens,
exactly)."""

from oomguard.engine.core.execute.stats import reset_stats
from oomguard.engine.core.length_batches import plan_steps, step_shares
from oomguard.engine.core.snapshot import Snapshot
from oomguard.engine.training.accumulate import Accumulator, micro_batch_for
from oomguard.engine.util.rows import micro_batches

__all__ = ["Accumulator", "Snapshot", "micro_batch_for", "micro_batches", "plan_steps",
           "reset_stats", "step_shares"]
