"""Batches planned from a dataset's sample lengths: pure Python, no torch.

Samples are sorted by length and cut into batches greedily: a batch, padded to its longest
sample, holds at most ``max_batch(longest)`` rows. ``max_batch`` is any function of a length
that does not grow with it (a :class:`~oomguard.engine.core.shapes.ShapePlan`'s): the
longest sample is then always the one added last. :class:`LengthBatchSampler` hands the
batches to a ``DataLoader`` (``batch_sampler=``), one epoch at a time, split across ranks
and resumable mid-epoch::

    batches = plan_batches(lengths, plan.max_batch)     # [[3, 0, 7], [5, 1], ...]
    sampler = LengthBatchSampler(lengths, plan.max_batch, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad)

A training loop that keeps its effective batch (a number of rows, or of tokens, per optimizer
step) plans optimizer steps instead: :func:`plan_steps` cuts the length-sorted samples into
steps first, then each step into batches; :func:`step_shares` gives each batch's share of its
step, so that ``loss * share`` summed over a step's batches is the mean over the step's rows
or tokens, exactly (never a mean of batch means)::

    for step in plan_steps(lengths, plan.max_batch, tokens=16384):
        for batch, share in zip(step, step_shares(step, lengths)):
            (model(**pad(batch)).loss * share).backward()   # loss: mean over batch's tokens
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from numbers import Integral
from typing import Any

from oomguard.engine.errors import UsageError

MaxBatch = Callable[[int], int]  # length -> the largest batch at that length (rows)


# Named length distributions (tokens), for trying a plan without a dataset at hand:
# ``oomguard bench --lengths long-tail`` and bench/shapes.py.
DISTRIBUTIONS = ("uniform", "long-tail", "bimodal")


def named_lengths(name: str, n: int = 5000, seed: int = 0, shortest: int = 8,
                  longest: int = 256) -> list[int]:
    """``n`` sample lengths of distribution ``name`` from ``shortest`` to ``longest`` tokens,
    the last one ``longest`` (the same for the same ``seed``): ``uniform``, every length
    alike; ``long-tail``, log-normal around 37 tokens (text's long tail); ``bimodal``, 70%
    around 24 tokens and 30% around 192 (short prompts and long documents). A one-line
    :class:`UsageError` for another name or ``n`` below 1."""
    if name not in DISTRIBUTIONS:
        raise UsageError(f"unknown length distribution {name!r}: give one of "
                         f"{', '.join(DISTRIBUTIONS)}, or a file of lengths")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError(f"a distribution's sample count must be an int >= 1, got {n!r}; "
                         "give a whole number of samples such as 1000")
    rng = random.Random(seed)

    def clip(x: float) -> int:
        return min(longest, max(shortest, int(x)))

    if name == "uniform":
        out = [rng.randint(shortest, longest) for _ in range(n - 1)]
    elif name == "long-tail":
        out = [clip(rng.lognormvariate(math.log(37), 0.8)) for _ in range(n - 1)]
    else:
        out = [clip(rng.gauss(24, 6) if rng.random() < 0.7 else rng.gauss(192, 24))
               for _ in range(n - 1)]
    return [*out, longest]


def check_lengths(lengths: Iterable[Any]) -> list[int]:
    """``lengths`` (a list, a numpy array, a tensor) as a list of ints > 0 (each sample's
    length, in tokens or items); a one-line :class:`UsageError` for an empty list or any
    other value."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise UsageError(f"lengths must be a list of the samples' lengths (ints > 0), got "
                         f"{type(lengths).__name__}; pass e.g. [len(s) for s in dataset]")
    # A numpy array's or a tensor's elements are not ints: their tolist() is.
    out = list(lengths.tolist() if callable(getattr(lengths, "tolist", None)) else lengths)
    if not out:
        raise UsageError("lengths is empty: pass one length (an int > 0) per sample of the "
                         "dataset, e.g. [len(s) for s in dataset]")
    for i, n in enumerate(out):
        if not isinstance(n, Integral) or isinstance(n, bool) or n <= 0:
            raise UsageError(f"lengths[{i}] is {n!r}: every length must be an int > 0 (a "
                             "sample's token count); drop empty samples or pass int(length)")
    return [int(n) for n in out]


def plan_batches(lengths: Sequence[int], max_batch: MaxBatch, *, shuffle: bool = False,
                 seed: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` cut into batches: every index exactly once, each batch at most
    ``max_batch(its longest length)`` rows, by length from the shortest.

    With ``shuffle``, samples of equal length come in a random order and so do the batches,
    the same for the same ``seed`` (None: a fresh random order). :class:`UsageError` where a
    length's ``max_batch`` is below 1 (not even one row of it fits)."""
    lengths = check_lengths(lengths)
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)  # then a stable sort: equal lengths keep this random order
    order.sort(key=lengths.__getitem__)
    limits: dict[int, int] = {}
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        n = lengths[i]
        if n not in limits:
            limits[n] = int(max_batch(n))
            if limits[n] < 1:
                raise UsageError(f"no batch fits at length {n}: the plan's max_batch({n}) is "
                                 f"{limits[n]}; shorten samples longer than the longest length "
                                 "that fits, or plan with a larger budget")
        # Sorted ascending: the new sample is the batch's longest, so its limit is the batch's.
        if batch and len(batch) + 1 > limits[n]:
            batches.append(batch)
            batch = []
        batch.append(i)
    batches.append(batch)
    if shuffle:
        rng.shuffle(batches)
    return batches


# With shuffle, samples are sorted by length within windows of this many steps' samples (a
# random draw from the dataset each), not across the whole dataset: steps then hold samples
# of like length (little padding) without every epoch running from the shortest up.
SHUFFLE_WINDOW_STEPS = 50


def _check_per_step(rows: int | None, tokens: int | None, longest: int) -> None:
    if (rows is None) == (tokens is None):
        raise UsageError("give one of rows= (samples per optimizer step) or tokens= (tokens "
                         "per optimizer step)")
    for name, value in (("rows", rows), ("tokens", tokens)):
        if value is not None and (not isinstance(value, Integral) or isinstance(value, bool)
                                  or value <= 0):
            raise UsageError(f"{name} per step must be an int > 0, got {value!r}; give a whole "
                             "number such as 256")
    if tokens is not None and tokens < longest:
        raise UsageError(f"tokens={tokens} per step is below the longest sample ({longest} "
                         f"tokens): give at least {longest}, or shorten the longest samples")


def _cut_steps(order: list[int], lengths: list[int], rows: int | None,
               tokens: int | None) -> list[list[int]]:
    """``order`` cut into consecutive steps of ``rows`` samples (the last one the rest), or of
    at most ``tokens`` tokens (sum of lengths) each."""
    if rows is not None:
        return [order[i:i + rows] for i in range(0, len(order), rows)]
    steps: list[list[int]] = [[]]
    held = 0
    for i in order:
        if steps[-1] and held + lengths[i] > tokens:  # type: ignore[operator]
            steps.append([])
            held = 0
        steps[-1].append(i)
        held += lengths[i]
    return steps


def plan_steps(lengths: Sequence[int], max_batch: MaxBatch, *, rows: int | None = None,
               tokens: int | None = None, shuffle: bool = False,
               seed: int | None = None) -> list[list[list[int]]]:
    """Optimizer steps, each a list of batches (lists of indices of ``lengths``): every index
    exactly once, every step ``rows`` samples (the last one the rest) or at most ``tokens``
    tokens (the sum of its samples' lengths), every batch at most ``max_batch(its longest
    length)`` rows (:func:`plan_batches` within the step).

    Samples are sorted by length, so a step holds samples of like length and its batches
    little padding; with ``shuffle``, sorted within windows of
    :data:`SHUFFLE_WINDOW_STEPS` steps' samples drawn at random, and the steps come in a
    random order, the same for the same ``seed``. A one-line :class:`UsageError`, before
    any planning, unless exactly one of ``rows``/``tokens`` is an int > 0 (``tokens`` at
    least the longest sample)."""
    lengths = check_lengths(lengths)
    _check_per_step(rows, tokens, max(lengths))
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
        per_step = rows if rows is not None else max(1, tokens // max(  # type: ignore[operator]
            1, round(sum(lengths) / len(lengths))))
        span = per_step * SHUFFLE_WINDOW_STEPS
        order = [i for w in range(0, len(order), span)
                 for i in sorted(order[w:w + span], key=lengths.__getitem__)]
    else:
        order.sort(key=lengths.__getitem__)
    steps = _cut_steps(order, lengths, rows, tokens)
    if shuffle:
        rng.shuffle(steps)
    out = []
    for step in steps:
        local = plan_batches([lengths[i] for i in step], max_batch)
        out.append([[step[k] for k in batch] for batch in local])
    return out


def step_shares(step: Sequence[Sequence[int]], units: Sequence[int] | None = None
                ) -> list[float]:
    """Each batch's share of its optimizer ``step`` (batches of indices, as
    :func:`plan_steps` gives): its rows over the step's rows, or with ``units`` (per sample:
    the tokens its loss counts, e.g. the lengths, or the lengths less one for a causal
    language model's shifted labels) its units over the step's. A batch's loss, a mean over
    its rows or units, times its share, summed over the step, is the mean over the step's:
    exact, whatever the batches' sizes."""
    count = [sum(units[i] for i in batch) if units is not None else len(batch)
             for batch in step]
    total = sum(count)
    if total <= 0:
        raise UsageError("the step counts no units: every sample's units are 0; give units "
                         "that count what the loss averages over (e.g. the lengths)")
    return [c / total for c in count]


def _split_for_ranks(parts: list[Any], world_size: int, samples: Callable[[Any], int],
                     halves: Callable[[Any], list[Any]], what: str) -> list[Any]:
    """``parts`` (batches or steps) with the one of most ``samples`` cut in two (``halves``)
    until their number is a multiple of ``world_size``: every rank then takes as many, and
    every index is still used once. :class:`UsageError` where there are fewer samples than
    ranks."""
    out = list(parts)
    while len(out) % world_size:
        i = max(range(len(out)), key=lambda k: samples(out[k]))
        if samples(out[i]) < 2:
            raise UsageError(f"{sum(map(samples, out))} sample(s) cannot be split into equal "
                             f"numbers of {what} for {world_size} ranks; give at least "
                             f"{world_size} samples")
        out[i:i + 1] = halves(out[i])
    return out


def split_for_ranks(batches: list[list[int]], world_size: int) -> list[list[int]]:
    """``batches`` with the largest split in two until their number is a multiple of
    ``world_size`` (a part of a batch that fits fits too): every rank then takes as many
    batches, and every index is still used once. :class:`UsageError` where there are fewer
    samples than ranks."""
    return _split_for_ranks([list(b) for b in batches], world_size, len,
                            lambda b: [b[:len(b) // 2], b[len(b) // 2:]], "batches")


def _halved_step(step: list[list[int]]) -> list[list[list[int]]]:
    """A step's samples in two halves, each keeping the step's batches, cut where the halves
    part (parts of a batch that fits fit too)."""
    cut = sum(map(len, step)) // 2
    halves: list[list[list[int]]] = [[], []]
    seen = 0
    for batch in step:
        for part, piece in ((0, batch[:max(0, cut - seen)]), (1, batch[max(0, cut - seen):])):
            if piece:
                halves[part].append(piece)
        seen += len(batch)
    return halves


def _steps_for_ranks(steps: list[list[list[int]]], world_size: int) -> list[list[list[int]]]:
    """``steps`` with the one of most samples split in two until their number is a multiple of
    ``world_size``: every rank takes as many steps. :class:`UsageError` where there are
    fewer samples than ranks."""
    return _split_for_ranks([list(s) for s in steps], world_size,
                            lambda step: sum(map(len, step)), _halved_step, "steps")


class LengthBatchSampler:
    """A ``DataLoader`` batch sampler over :func:`plan_batches`'s batches, one epoch at a time.

    ``shuffle``: a new order each epoch (:meth:`set_epoch`), from ``seed + epoch``. Ranks
    (``rank`` of ``world_size``) take disjoint batches, every rank as many
    (:func:`split_for_ranks`). :meth:`state_dict` records the epoch and the batches this rank
    has handed out; a sampler given it (:meth:`load_state_dict`) yields exactly the epoch's
    remaining batches, then whole epochs again. A ``DataLoader`` with workers asks for batches
    ahead of the loop: save the batches the loop has consumed (``state["batches_done"]``)
    where that matters. ``len()``: the batches the next iteration yields.

    With ``rows_per_step`` or ``tokens_per_step``, the batches come a step at a time
    (:func:`plan_steps`), whole steps split across ranks, and :meth:`schedule` says, for each
    batch the next iteration yields, its share of its step's loss and whether it ends the step.
    """

    def __init__(self, lengths: Sequence[int], max_batch: MaxBatch, *, shuffle: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1,
                 rows_per_step: int | None = None, tokens_per_step: int | None = None) -> None:
        self.lengths = check_lengths(lengths)
        self.per_step = (rows_per_step, tokens_per_step)
        if self.per_step != (None, None):
            _check_per_step(rows_per_step, tokens_per_step, max(self.lengths))
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise UsageError(f"world_size must be an int >= 1, got {world_size!r}; give the "
                             "number of ranks")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise UsageError(f"rank must be an int from 0 to world_size - 1 ({world_size - 1}), "
                             f"got {rank!r}; give this rank's index")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise UsageError(f"seed must be an int, got {seed!r}; give a whole number")
        self.max_batch, self.shuffle, self.seed = max_batch, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._start = 0  # batches of this epoch to skip: a resumed sampler's progress
        self._done = 0  # batches of this epoch handed out
        self._cached: tuple[int, list[list[list[int]]]] | None = None

    def epoch_steps(self) -> list[list[list[int]]]:
        """This rank's batches of the current epoch grouped by optimizer step (one batch a
        step without ``rows_per_step``/``tokens_per_step``), in order."""
        if self._cached is None or self._cached[0] != self.epoch:
            rows, tokens = self.per_step
            seed = self.seed + self.epoch
            if rows is None and tokens is None:
                every = plan_batches(self.lengths, self.max_batch, shuffle=self.shuffle,
                                     seed=seed)
                mine = [[b] for b in split_for_ranks(every, self.world_size)[
                    self.rank::self.world_size]]
            else:
                steps = plan_steps(self.lengths, self.max_batch, rows=rows, tokens=tokens,
                                   shuffle=self.shuffle, seed=seed)
                mine = _steps_for_ranks(steps, self.world_size)[self.rank::self.world_size]
            self._cached = (self.epoch, mine)
        return self._cached[1]

    def epoch_batches(self) -> list[list[int]]:
        """This rank's batches of the current epoch, in order."""
        return [batch for step in self.epoch_steps() for batch in step]

    def schedule(self, units: Sequence[int] | None = None) -> list[tuple[float, bool]]:
        """For each batch the next iteration yields (call it before iterating): its share of
        its step's loss (:func:`step_shares`; ``units`` per sample, default the lengths with
        ``tokens_per_step``, one a row otherwise) and whether an optimizer step follows it.
        A resumed sampler's first step counts all its batches, those run before the save too."""
        if units is None and self.per_step[1] is not None:
            units = self.lengths
        out = []
        for step in self.epoch_steps():
            shares = step_shares(step, units)
            out += [(share, k == len(step) - 1) for k, share in enumerate(shares)]
        return out[self._start:]

    def __iter__(self) -> Iterator[list[int]]:
        batches, start = self.epoch_batches(), self._start
        self._start = 0
        for i in range(start, len(batches)):
            self._done = i + 1
            yield list(batches[i])

    def __len__(self) -> int:
        return len(self.epoch_batches()) - self._start

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (with ``shuffle``: its own order), from its first batch."""
        self.epoch, self._start, self._done = int(epoch), 0, 0

    def state_dict(self) -> dict[str, int]:
        """The epoch and the batches this rank handed out in it, with what must match on load."""
        return {"epoch": self.epoch, "batches_done": self._done, "seed": self.seed,
                "samples": len(self.lengths), "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume where ``state`` (:meth:`state_dict`) was taken: the next iteration yields the
        rest of its epoch. :class:`UsageError` where it came from another dataset, seed or split."""
        mine = self.state_dict()
        for key in ("seed", "samples", "rank", "world_size"):
            if state.get(key) != mine[key]:
                raise UsageError(f"the sampler state was saved with {key}={state.get(key)!r}, "
                                 f"this sampler has {key}={mine[key]!r}: build the sampler as "
                                 "it was when the state was saved")
        self.epoch = int(state["epoch"])
        self._start = self._done = int(state["batches_done"])
