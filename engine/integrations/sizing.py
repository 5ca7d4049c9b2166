"""What the framework integrations share: search a framework's real step, then split the
user's effective batch (rows per optimizer step on one device, never changed) into equal
micro-batches, the largest that fit (:func:`micro_batch_for`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from oomguard.engine.core.search.search import SearchResult, search
from oomguard.engine.errors import UsageError, check_positive_int
from oomguard.engine.training.distributed import agree

log = logging.getLogger("oomguard.integrations")

# Two steps per trial: the first allocates the optimizer's state, the second is the steady state.
STEPS_PER_TRIAL = 2


@dataclass(frozen=True)
class Split:
    """How one device's effective batch (rows) is run: ``micro_batch`` rows per forward and
    backward, ``accumulation`` of them per optimizer step. ``found``: the largest size the
    search ran (measured); ``search``: its result (None when no search ran)."""

    effective: int
    micro_batch: int
    accumulation: int
    found: int | None
    search: SearchResult | None = None


def micro_batch_for(effective: int, fits: int) -> int:
    """The largest divisor of ``effective`` (rows) at or below ``fits`` (rows); 1 at least."""
    check_positive_int("effective", effective)
    check_positive_int("fits", fits)
    return max(d for d in range(1, min(effective, fits) + 1) if effective % d == 0)


def size_found(result: SearchResult, largest: bool = False) -> int:
    """The size a run may use from a search's result: ``size_to_use``, or with ``largest``
    ``max_ok``; under ``torch.distributed`` the smallest over the ranks (collective)."""
    size = result.max_ok if largest else result.size_to_use
    assert size is not None  # search raises NoSizeFits otherwise
    return agree(size, False).size


def split_for(effective: int, result: SearchResult, largest: bool = False) -> Split:
    """The :class:`Split` of ``effective`` rows a search's result allows: at most its
    ``size_to_use``, or with ``largest`` its ``max_ok`` (by default not: a framework's loop
    holds more than a trial, measured on a Trainer)."""
    micro = micro_batch_for(effective, size_found(result, largest))
    return Split(effective, micro, effective // micro, result.max_ok, result)


def passes(size: int, effective: int) -> int:
    """Forward and backward passes a trial runs at ``size`` before its optimizer step: 2 below
    the ``effective`` batch (accumulating into ``.grad`` needs a temporary), else 1."""
    return 2 if size < effective else 1


def training_trial(micro_step: Callable[[int], torch.Tensor], optimizer: torch.optim.Optimizer,
                   effective: int) -> Callable[[int], float]:
    """A framework's whole training step at ``size`` rows, as a trial: ``micro_step(size)``
    (forward and backward, returning the loss) :func:`passes` times, then the optimizer's
    step and ``zero_grad``; the trial's value is the last loss."""
    def step(size: int) -> float:
        for _ in range(passes(size, effective)):
            loss = micro_step(size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def batch_rows(batch: Any) -> int:
    """The number of rows (dim 0) of the first tensor in ``batch``."""
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return int(leaf.shape[0])
    raise UsageError("the batch holds no tensor with a batch dimension; give batches of "
                     "tensors whose first dimension is the batch")


def search_step(step: Callable[[int], Any], effective: int,
                restore: tuple[torch.nn.Module, torch.optim.Optimizer] | None, name: str,
                **options: Any) -> SearchResult:
    """Search the largest size from 1 to ``effective`` rows at which ``step(size)`` runs: a
    training step (``restore``: model and optimizer, restored after every trial)
    ``STEPS_PER_TRIAL`` times per trial, an evaluation step once."""
    step.__name__ = name  # type: ignore[attr-defined]  # what logs and results call it
    options.setdefault("steps_per_trial", STEPS_PER_TRIAL if restore is not None else 1)
    return search(step, max_size=effective, restore=restore, **options)
