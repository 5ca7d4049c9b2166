"""Optimizer steps planned from the lengths: an effective batch kept in rows or in tokens
across batches of unequal shape, and each batch's loss weighted so that a step's loss is
the mean over the step's rows or tokens (engine/core/length_batches.py)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader

import oomguard
from oomguard.engine.core.length_batches import (
    LengthBatchSampler,
    plan_steps,
    step_shares,
)
from oomguard.engine.errors import UsageError

# A long tail: most samples short, a few long (tokens).
_RNG = random.Random(3)
LENGTHS = [_RNG.choice([4, 5, 6, 8, 9, 12, 16, 40, 64]) for _ in range(202)] + [64]


def _tokens_cap(n: int) -> int:
    """A plan's max_batch: at most 256 padded tokens a batch."""
    return 256 // n


def _check(steps: list[list[list[int]]], lengths: list[int]) -> None:
    seen = sorted(i for step in steps for batch in step for i in batch)
    assert seen == list(range(len(lengths)))  # every index once
    for step in steps:
        for batch in step:
            assert batch and len(batch) <= _tokens_cap(max(lengths[i] for i in batch))


@pytest.mark.parametrize("shuffle", [False, True])
def test_steps_hold_exactly_the_rows_asked_for_in_batches_that_fit(shuffle: bool) -> None:
    steps = plan_steps(LENGTHS, _tokens_cap, rows=32, shuffle=shuffle, seed=1)
    _check(steps, LENGTHS)
    sizes = [sum(map(len, step)) for step in steps]
    assert sorted(sizes)[1:] == [32] * (len(steps) - 1) and min(sizes) == 203 % 32
    # unequal batches within steps: short samples run many rows, long ones few
    assert len({len(b) for step in steps for b in step}) > 2


@pytest.mark.parametrize("shuffle", [False, True])
def test_steps_hold_at_most_the_tokens_asked_for(shuffle: bool) -> None:
    steps = plan_steps(LENGTHS, _tokens_cap, tokens=300, shuffle=shuffle, seed=1)
    _check(steps, LENGTHS)
    tokens = [sum(LENGTHS[i] for b in step for i in b) for step in steps]
    assert max(tokens) <= 300
    # greedy: a step ends only where the next sample would pass 300 (all but the last step
    # are full to within the longest sample)
    assert sum(t > 300 - 64 for t in tokens) >= len(steps) - 1 - 2 * shuffle


def test_shuffled_steps_are_the_same_for_a_seed_and_differ_between_seeds() -> None:
    one = plan_steps(LENGTHS, _tokens_cap, rows=16, shuffle=True, seed=7)
    assert one == plan_steps(LENGTHS, _tokens_cap, rows=16, shuffle=True, seed=7)
    assert one != plan_steps(LENGTHS, _tokens_cap, rows=16, shuffle=True, seed=8)


@pytest.mark.parametrize("given, words", [
    (dict(), "give one of rows="),
    (dict(rows=4, tokens=64), "give one of rows="),
    (dict(rows=0), "rows per step must be an int > 0"),
    (dict(tokens=-5), "tokens per step must be an int > 0"),
    (dict(rows=2.5), "rows per step must be an int > 0"),
    (dict(tokens=32), "below the longest sample \\(64 tokens\\): give at least 64"),
])
def test_bad_steps_are_a_one_line_error_before_any_planning(given: dict, words: str) -> None:
    calls = []

    def max_batch(n: int) -> int:
        calls.append(n)
        return 8

    with pytest.raises(UsageError, match=words) as info:
        plan_steps(LENGTHS, max_batch, **given)
    assert "\n" not in str(info.value) and calls == []
    with pytest.raises(UsageError, match=words):
        LengthBatchSampler(LENGTHS, max_batch, **{f"{k}_per_step": v for k, v in given.items()}
                           ) if given else LengthBatchSampler(LENGTHS, max_batch,
                                                              rows_per_step=1, tokens_per_step=64)


class TinyLM(torch.nn.Module):
    """Next-token prediction: embedding, one mixing layer, a head; float64."""

    def __init__(self, vocab: int = 50, width: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width, dtype=torch.float64)
        self.mix = torch.nn.Linear(width, width, dtype=torch.float64)
        self.head = torch.nn.Linear(width, vocab, dtype=torch.float64)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean over the batch's real tokens (padding labelled -100) of the loss."""
        logits = self.head(torch.tanh(self.mix(self.embed(batch["input_ids"]))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 batch["labels"].flatten(), ignore_index=-100)


SAMPLES = [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(i))
           for i, n in enumerate(LENGTHS)]


def pad(indices: list[int]) -> dict[str, torch.Tensor]:
    """The samples at ``indices`` padded to the longest, the padding's labels -100."""
    longest = max(len(SAMPLES[i]) for i in indices)
    ids = torch.zeros(len(indices), longest, dtype=torch.long)
    labels = torch.full((len(indices), longest), -100)
    for row, i in enumerate(indices):
        ids[row, :len(SAMPLES[i])] = SAMPLES[i]
        labels[row, :len(SAMPLES[i])] = SAMPLES[i]
    return {"input_ids": ids, "labels": labels}


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def test_a_steps_loss_is_the_mean_over_its_tokens_exactly_with_and_without_accumulate() -> None:
    model = TinyLM()
    step = max(plan_steps(LENGTHS, _tokens_cap, tokens=600), key=len)  # the most batches
    assert len({max(LENGTHS[i] for i in b) for b in step}) > 1  # batches of unequal shape
    flat = [i for b in step for i in b]
    whole = model(pad(flat))  # one batch of the step's samples: the mean over its tokens
    whole.backward()
    want = _grads(model)

    shares = step_shares(step, LENGTHS)
    assert sum(shares) == pytest.approx(1.0, abs=1e-12)
    total = sum((model(pad(b)) * s for b, s in zip(step, shares, strict=True)),
                torch.zeros((), dtype=torch.float64))
    total.backward()
    assert float(total.detach()) == pytest.approx(float(whole.detach()), abs=1e-12)
    for got, expected in zip(_grads(model), want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-9)

    # accumulate over each batch (tokens weighted within it), its backward scaled by the share
    for batch, share in zip(step, shares, strict=True):
        oomguard.accumulate(model, pad(batch), params=model, weight_by="tokens",
                            name="length-steps",
                            backward=lambda loss, share=share: (loss * share).backward())
    for got, expected in zip(_grads(model), want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-9)

    # what the weighting prevents: a mean of batch means is another loss
    naive = sum(model(pad(b)) for b in step) / len(step)
    assert abs(float(naive.detach()) - float(whole.detach())) > 1e-5  # 1e6 x the tolerance above


def test_the_sampler_yields_whole_steps_and_their_shares_through_a_dataloader() -> None:
    sampler = LengthBatchSampler(LENGTHS, _tokens_cap, rows_per_step=24, shuffle=True, seed=4)
    schedule = sampler.schedule()
    loader = DataLoader(range(len(LENGTHS)), batch_sampler=sampler, collate_fn=list)
    step: list[list[int]] = []
    steps = []
    for batch, (_, ends) in zip(loader, schedule, strict=True):
        step.append(batch)
        if ends:
            steps.append(step)
            step = []
    assert step == [] and steps == sampler.epoch_steps()
    # shuffled: the one short step (203 = 8 x 24 + 11) may come anywhere
    assert sorted(sum(map(len, s)) for s in steps) == [11] + [24] * 8
    # shares of each step's batches add up to 1 (rows: its rows over the step's)
    at = 0
    for s in steps:
        assert sum(share for share, _ in schedule[at:at + len(s)]) == pytest.approx(1.0)
        at += len(s)


def test_a_resumed_step_sampler_yields_the_same_remaining_batches_and_shares() -> None:
    first = LengthBatchSampler(LENGTHS, _tokens_cap, tokens_per_step=400, shuffle=True, seed=2)
    first.set_epoch(1)
    every, shares = list(first), first.schedule()
    first.set_epoch(1)
    it = iter(first)
    done = [next(it) for _ in range(5)]
    state = first.state_dict()
    again = LengthBatchSampler(LENGTHS, _tokens_cap, tokens_per_step=400, shuffle=True, seed=2)
    again.load_state_dict(state)
    rest_shares = again.schedule()
    rest = list(again)
    assert done + rest == every
    assert rest_shares == shares[5:]


@pytest.mark.parametrize("world", [3, 4])  # 6 steps of 40 rows: 4 ranks split two of them
def test_steps_split_across_ranks_use_every_sample_once_in_as_many_steps_per_rank(world) -> None:
    ranks = [LengthBatchSampler(LENGTHS, _tokens_cap, rows_per_step=40, rank=r,
                                world_size=world) for r in range(world)]
    per_rank = [r.epoch_steps() for r in ranks]
    assert len({len(s) for s in per_rank}) == 1  # every rank runs as many optimizer steps
    seen = sorted(i for steps in per_rank for step in steps for b in step for i in b)
    assert seen == list(range(len(LENGTHS)))
    for steps in per_rank:
        for step in steps:
            for batch in step:
                assert len(batch) <= _tokens_cap(max(LENGTHS[i] for i in batch))


def test_a_shape_plans_steps_and_step_sampler_are_the_plans_max_batch() -> None:
    from oomguard.engine.core.shapes import ShapePlan, ShapePoint

    # a plan read back as the size cache keeps it: two measured points, no searches
    point = dict(max_ok=64, first_oom=None, per_row_bytes=1.0, fixed_bytes=0.0,
                 limit_bytes=None, trials=1)
    plan = ShapePlan(workload="w", device="cpu", budget_bytes=None,
                     points=[ShapePoint(seq_len=4, safe=64, **point),
                             ShapePoint(seq_len=64, safe=4, **point)],
                     fixed_bytes=0.0, per_row_const_bytes=0.0, per_token_bytes=1.0,
                     per_token2_bytes=0.0, max_size=64, seconds=0.0)
    steps = plan.steps(LENGTHS, rows=32)
    assert steps == plan_steps(LENGTHS, plan.max_batch, rows=32)
    for step in steps:
        for batch in step:
            assert len(batch) <= plan.max_batch(max(LENGTHS[i] for i in batch))
    sampler = plan.batch_sampler(LENGTHS, rows_per_step=32)
    assert sampler.epoch_steps() == steps
