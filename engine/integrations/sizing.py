"""What the framework integrations share: search a framework's real step, then split the
user's effective batch (rows per optimizer step on one device, never changed) into the fewest
micro-batches that fit, as equal as the rows allow (:func:`~oomguard.engine.util.rows.micro_batches`).

A trial runs what the loop's step runs: the whole effective batch in memory (the loop holds it,
collated, while its micro-batches run), two forwards and backwards (the size tried, then a row
fewer: the second adds into the gradients, as accumulation does), the framework's gradient
clipping, then the optimizer's step. Measured on the transformers Trainer, the step a trial runs fits where the
Trainer's own loop fits in a fresh process, and with forked trials (the search's default on a
Linux CPU) the loop after the search has that room too
(docs/measurements.md#integrations-at-the-loops-maximum). The micro-batches keep under the
search's recommendation, the largest safe size (its margin is of what grows with the size),
or with ``largest`` under the largest size that ran.

With ``remedies=`` (e.g. ``("accumulate", "checkpoint")``), the size comes from
:func:`~oomguard.engine.core.execute.priced.choose_remedy` instead (:func:`priced_split`): each
configuration's largest safe micro-batch is searched and one effective step of each is timed;
the fastest safe one runs (its micro-batch, and its configuration while training lasts:
:attr:`Split.remedy`), the effective batch kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard.engine.core.execute.priced import RemedyChoice, choose_remedy
from oomguard.engine.core.search.search import SearchResult, search
from oomguard.engine.errors import UsageError
from oomguard.engine.training.distributed import agree, agree_remedy
from oomguard.engine.util.rows import micro_batches
from oomguard.engine.util.units import fmt_bytes

log = logging.getLogger("oomguard.integrations")

# Two steps per trial: the first allocates the optimizer's state, the second is the steady state.
STEPS_PER_TRIAL = 2


@dataclass(frozen=True)
class Split:
    """How one device's effective batch (rows per optimizer step) runs: ``sizes``, the rows of
    each micro-batch of a step (a forward and backward each), ``micro_batch`` the largest of
    them and ``accumulation`` their number. ``found``: the largest size the search ran
    (measured); ``allowed``: the size the split keeps under (the search's recommendation, or
    ``found`` with ``largest``); ``search``: its result (None when no search ran, or the
    remedies were priced); ``remedy``: the remedies' pricing, its table and the configuration
    chosen (None without ``remedies=``)."""

    effective: int
    micro_batch: int
    accumulation: int
    found: int | None
    search: SearchResult | None = None
    sizes: tuple[int, ...] = field(default=())
    allowed: int | None = None
    remedy: RemedyChoice | None = None
    plan: Any = None  # a ShapePlan: micro-batches cut per step by length (length_steps.py)

    def __post_init__(self) -> None:
        if not self.sizes:  # given as micro-batch x accumulation: equal micro-batches
            object.__setattr__(self, "sizes", (self.micro_batch,) * self.accumulation)

    @property
    def equal(self) -> bool:
        """Whether every micro-batch has the same rows (a loop's own accumulation runs it);
        never with a ``plan``, whose micro-batches follow each step's lengths."""
        return self.plan is None and len(set(self.sizes)) == 1

    def describe(self) -> str:
        """The micro-batches in words: ``32 x 2``, ``22 + 21 + 21`` or, with a plan, the
        largest batch at its longest length."""
        if self.plan is not None:
            longest = max(p.seq_len for p in self.plan.points)
            return (f"as each step's lengths allow ({self.plan.max_batch(longest)} rows at "
                    f"length {longest})")
        if self.equal:
            return f"{self.micro_batch} x {self.accumulation}"
        return " + ".join(map(str, self.sizes))


def size_found(result: SearchResult, largest: bool = False) -> int:
    """The size a run may use from a search's result: ``size_to_use`` (the largest safe size),
    or with ``largest`` ``max_ok`` (the largest that ran); under ``torch.distributed`` the
    smallest over the ranks (collective)."""
    size = result.max_ok if largest else result.size_to_use
    assert size is not None  # search raises NoSizeFits otherwise
    return agree(size, False).size


def split_for(effective: int, result: SearchResult, largest: bool = False,
              equal: bool = False) -> Split:
    """The :class:`Split` of ``effective`` rows a search's result allows: micro-batches of at
    most its ``size_to_use`` rows (with ``largest``: its ``max_ok``), the fewest that fit, as
    equal as the rows allow; with ``equal``, all the same (a divisor of ``effective``)."""
    allowed = size_found(result, largest)
    sizes = micro_batches(effective, allowed, equal)
    return Split(effective, sizes[0], len(sizes), result.max_ok, result, tuple(sizes), allowed)


def priced_split(micro_step: Callable[[int], Any], effective: int, rows: int,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 remedies: Sequence[str], name: str, where: str, largest: bool = False,
                 equal: bool = False, clip: Callable[[], Any] | None = None,
                 **options: Any) -> Split:
    """The :class:`Split` of ``effective`` rows in the fastest safe configuration of
    ``remedies``: :func:`~oomguard.engine.core.execute.priced.choose_remedy` prices one
    effective step of ``rows`` rows (the first ``rows`` the loop loads; at most
    ``effective``) of ``micro_step(n)`` (forward and backward of ``n`` rows, adding to
    ``.grad``), ``clip()`` (the framework's gradient clipping, where it clips) and
    ``optimizer``'s step, trials putting ``model`` and ``optimizer`` back; under
    ``torch.distributed`` every rank then runs one configuration at one micro-batch
    (:func:`~oomguard.engine.training.distributed.agree_remedy`). The micro-batches keep
    under the chosen configuration's micro-batch (with ``largest``, the largest that ran in
    it), as equal as the rows allow (with ``equal``, all the same). ``options``: the
    pricing's search options (``budget``, ``margin``, ...; trials forked unless
    ``fork=False``). The table is logged, one line per configuration, each starting with
    ``where``."""
    choice = agree_remedy(choose_remedy(micro_step, rows, model, optimizer=optimizer,
                                        remedies=remedies, name=name, clip=clip, **options))
    row = choice.row
    most = row.max_ok if largest and row.max_ok is not None else choice.micro_batch
    allowed = agree(most, False).size
    sizes = micro_batches(effective, allowed, equal)
    for r in choice.table:
        log.info("%s: remedy %s: micro-batch %s, peak %s, %s samples/s: %s%s", where,
                 r.configuration, "-" if r.micro_batch is None else r.micro_batch,
                 fmt_bytes(r.peak_bytes), "-" if r.samples_per_second is None
                 else f"{r.samples_per_second:.1f}", r.status, f" ({r.why})" if r.why else "")
    return Split(effective, sizes[0], len(sizes), row.max_ok, None, tuple(sizes), allowed,
                 choice)


def passes(size: int, effective: int) -> list[int]:
    """The rows of each forward and backward a trial runs at ``size`` before its optimizer
    step: the whole ``effective`` batch at once, else two passes (accumulating into ``.grad``
    needs a temporary), the second a row shorter where it can be: the two shapes near-equal
    micro-batches have, which a library that keeps kernels per input shape (oneDNN on a CPU)
    holds both of."""
    return [size] if size >= effective else [size, max(1, size - 1)]


def training_trial(micro_step: Callable[[int], torch.Tensor], optimizer: torch.optim.Optimizer,
                   effective: int, clip: Callable[[], Any] | None = None
                   ) -> Callable[[int], float]:
    """A framework's whole training step at ``size`` rows, as a trial: ``micro_step(rows)``
    (forward and backward of the first ``rows`` rows, returning the loss) for each of
    :func:`passes`, ``clip()`` (the framework's gradient clipping, where it clips), then the
    optimizer's step and ``zero_grad``; the trial's value is the last loss."""
    def step(size: int) -> float:
        for rows in passes(size, effective):
            loss = micro_step(rows)
        if clip is not None:
            clip()
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
