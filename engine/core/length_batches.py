"""Batches planned from a dataset's sample lengths: pure Python, no torch.

Samples are sorted by length and cut into batches greedily: a batch, padded to its longest
sample, holds at most ``max_batch(longest)`` rows. ``max_batch`` is any function of a length
that does not grow with it (a :class:`~oomguard.engine.core.search.shapes.ShapePlan`'s): the
longest sample is then always the one added last. :class:`LengthBatchSampler` hands the
batches to a ``DataLoader`` (``batch_sampler=``), one epoch at a time, split across ranks
and resumable mid-epoch::

    batches = plan_batches(lengths, plan.max_batch)     # [[3, 0, 7], [5, 1], ...]
    sampler = LengthBatchSampler(lengths, plan.max_batch, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from numbers import Integral
from typing import Any

from oomguard.engine.errors import UsageError

MaxBatch = Callable[[int], int]  # length -> the largest batch at that length (rows)


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


def split_for_ranks(batches: list[list[int]], world_size: int) -> list[list[int]]:
    """``batches`` with the largest split in two until their number is a multiple of
    ``world_size`` (a part of a batch that fits fits too): every rank then takes as many
    batches, and every index is still used once. :class:`UsageError` where there are fewer
    samples than ranks."""
    out = [list(b) for b in batches]
    while len(out) % world_size:
        i = max(range(len(out)), key=lambda k: len(out[k]))
        if len(out[i]) < 2:
            raise UsageError(f"{sum(map(len, out))} sample(s) cannot be split into equal "
                             f"numbers of batches for {world_size} ranks; give at least "
                             f"{world_size} samples")
        half = len(out[i]) // 2
        out[i:i + 1] = [out[i][:half], out[i][half:]]
    return out


class LengthBatchSampler:
    """A ``DataLoader`` batch sampler over :func:`plan_batches`'s batches, one epoch at a time.

    ``shuffle``: a new order each epoch (:meth:`set_epoch`), from ``seed + epoch``. Ranks
    (``rank`` of ``world_size``) take disjoint batches, every rank as many
    (:func:`split_for_ranks`). :meth:`state_dict` records the epoch and the batches this rank
    has handed out; a sampler given it (:meth:`load_state_dict`) yields exactly the epoch's
    remaining batches, then whole epochs again. A ``DataLoader`` with workers asks for batches
    ahead of the loop: save the batches the loop has consumed (``state["batches_done"]``)
    where that matters. ``len()``: the batches the next iteration yields.
    """

    def __init__(self, lengths: Sequence[int], max_batch: MaxBatch, *, shuffle: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        self.lengths = check_lengths(lengths)
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
        self._cached: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self) -> list[list[int]]:
        """This rank's batches of the current epoch, in order."""
        if self._cached is None or self._cached[0] != self.epoch:
            every = plan_batches(self.lengths, self.max_batch, shuffle=self.shuffle,
                                 seed=self.seed + self.epoch)
            self._cached = (self.epoch, split_for_ranks(every, self.world_size)[
                self.rank::self.world_size])
        return self._cached[1]

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
