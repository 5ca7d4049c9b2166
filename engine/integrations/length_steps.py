"""A framework's optimizer steps planned from the dataset's lengths, the effective batch kept.

A loop whose samples vary in length (text) holds the whole effective batch of each optimizer
step as one collated batch, padded to the step's longest sample; the steps group samples of
like length (:func:`~oomguard.engine.core.length_batches.plan_steps`), so that padding is
small. The loop's step then runs it in micro-batches that a
:class:`~oomguard.engine.core.shapes.ShapePlan` allows at their own longest length
(:func:`cut_step`): many rows where samples are short, few where they are long. Each
micro-batch is trimmed to its own longest sample, so its shape is one the plan measured.

Used by :class:`~oomguard.engine.integrations.hf_trainer.OomguardTrainerMixin` when the
Trainer groups samples by length (``train_sampling_strategy="group_by_length"``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from oomguard.engine.core.length_batches import LengthBatchSampler, plan_batches

MaxBatch = Callable[[int], int]


class StepSampler:
    """A ``DataLoader`` batch sampler that yields each optimizer step's indices as one batch
    (from the shortest sample up), over a :class:`LengthBatchSampler` with ``rows_per_step``:
    the loop's step cuts it with :func:`cut_step`. ``set_epoch``, ``state_dict`` and
    ``load_state_dict`` are the inner sampler's (a step's batches count as it hands them out,
    so a state counts whole steps)."""

    def __init__(self, lengths: Sequence[int], max_batch: MaxBatch, rows_per_step: int, *,
                 shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        self.lengths = list(lengths)
        self.inner = LengthBatchSampler(lengths, max_batch, shuffle=shuffle, seed=seed,
                                        rank=rank, world_size=world_size,
                                        rows_per_step=rows_per_step)

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(self.inner)
        for step in self._remaining_steps():
            indices = [i for _ in step for i in next(batches)]
            yield sorted(indices, key=self.lengths.__getitem__)

    def _remaining_steps(self) -> list[list[list[int]]]:
        steps, skip = self.inner.epoch_steps(), self.inner._start
        while skip > 0:  # a resumed sampler skips whole steps' batches
            skip -= len(steps[0])
            steps = steps[1:]
        return steps

    def __len__(self) -> int:
        return len(self._remaining_steps())

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.inner.load_state_dict(state)


def row_lengths(inputs: Mapping[str, Any], key: str = "attention_mask") -> list[int]:
    """Each row's real length in a collated batch: the ones of its attention mask (padding
    is zeros, on either side); without a mask, the padded length for every row."""
    mask = inputs.get(key)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return [int(n) for n in mask.sum(dim=1).tolist()]
    ids = next(v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() == 2)
    return [ids.shape[1]] * ids.shape[0]


def trimmed(inputs: Mapping[str, Any], rows: slice | list[int], longest: int,
            key: str = "attention_mask") -> dict[str, Any]:
    """The ``rows`` (a slice or indices) of a collated batch, each tensor of the padded length
    cut to ``longest`` columns: the real tokens, from the side the padding is not on (left
    padding where a row's first column is padding and every row's last is not)."""
    mask = inputs.get(key)
    padded = next(v.shape[1] for v in inputs.values()
                  if isinstance(v, torch.Tensor) and v.dim() >= 2)
    left = (isinstance(mask, torch.Tensor) and bool((mask[rows, -1] != 0).all())
            and bool((mask[rows, 0] == 0).any()))
    cols = slice(padded - longest, padded) if left else slice(0, longest)
    out: dict[str, Any] = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            value = value[rows]
            if value.dim() >= 2 and value.shape[1] == padded:
                value = value[:, cols]
        out[name] = value
    return out


def cut_step(inputs: Mapping[str, Any], max_batch: MaxBatch,
             key: str = "attention_mask") -> list[dict[str, Any]]:
    """A collated optimizer step cut into the micro-batches that ``max_batch`` allows at their
    own longest length (:func:`~oomguard.engine.core.length_batches.plan_batches` of its
    rows' lengths: rows sorted by length, as :class:`StepSampler` yields them, stay in
    order), each trimmed to its longest row (:func:`trimmed`). A one-line
    :class:`UsageError` where a row's length has no room (``max_batch`` below 1)."""
    lengths = row_lengths(inputs, key)
    return [trimmed(inputs, batch, max(lengths[i] for i in batch), key)
            for batch in plan_batches(lengths, max_batch)]
