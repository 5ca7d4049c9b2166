"""Batches planned from the data's lengths (docs/guides/shapes.md).

The planning is pure Python (fast tests). The plan itself is checked under a real CPU budget
in fresh processes: ``max_batch`` against a fresh-process brute force (the largest batch at
which a fresh process runs ``STEPS`` optimizer steps at that length, bracketed by two fresh
processes around the answer, as tests/test_integrations_truth.py does), and a whole epoch of
the plan's batches with no OOM.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from oomguard.engine.core.length_batches import (
    LengthBatchSampler,
    plan_batches,
    split_for_ranks,
)
from oomguard.engine.errors import UsageError


def _long_tail(n: int, longest: int, seed: int = 0) -> list[int]:
    """``n`` lengths from 8 to ``longest``, log-normal around 30: text's long tail."""
    rng = random.Random(seed)
    return [min(longest, max(8, int(rng.lognormvariate(math.log(30), 0.7)))) for _ in range(n)]


def _tokens_cap(n: int) -> int:
    """A max_batch of about 4096 padded tokens: falls with the length, as memory rises."""
    return max(1, 4096 // n)


LENGTHS = _long_tail(3000, 256)


# --- pure planning -----------------------------------------------------------------------------

def _check_batches(batches: list[list[int]], lengths: list[int]) -> None:
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # every index exactly once
    for b in batches:
        assert b and len(b) <= _tokens_cap(max(lengths[i] for i in b))


def test_batches_use_every_index_once_and_each_fits():
    for shuffle in (False, True):
        _check_batches(plan_batches(LENGTHS, _tokens_cap, shuffle=shuffle, seed=1), LENGTHS)
    batches = plan_batches(LENGTHS, _tokens_cap)
    longest = [max(LENGTHS[i] for i in b) for b in batches]
    assert longest == sorted(longest)  # unshuffled: by length
    # Packed: a batch is cut only where the next sample would not fit.
    for b, nxt in zip(batches, batches[1:], strict=False):
        assert len(b) + 1 > _tokens_cap(max(LENGTHS[i] for i in [*b, nxt[0]]))


def test_shuffled_batches_are_deterministic_for_a_seed_and_differ_across_seeds():
    one = plan_batches(LENGTHS, _tokens_cap, shuffle=True, seed=7)
    assert one == plan_batches(LENGTHS, _tokens_cap, shuffle=True, seed=7)
    other = plan_batches(LENGTHS, _tokens_cap, shuffle=True, seed=8)
    assert one != other
    # Shuffled batches are still made of similar lengths: as little padding as sorted ones.
    def padded(batches: list[list[int]]) -> int:
        return sum(len(b) * max(LENGTHS[i] for i in b) for b in batches)
    assert padded(one) <= 1.01 * padded(plan_batches(LENGTHS, _tokens_cap))


def test_bad_lengths_are_one_line_usage_errors():
    for bad, said in (([], "empty"), ([3, 0], r"lengths\[1\] is 0"), ([2.5], "int"),
                      ("abc", "list"), ([True], "int")):
        with pytest.raises(UsageError, match=said) as info:
            plan_batches(bad, _tokens_cap)
        assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="no batch fits at length 300"):
        plan_batches([10, 300], lambda n: 0 if n > 256 else 4)


def test_sampler_is_a_dataloader_batch_sampler():
    data = torch.utils.data.TensorDataset(torch.arange(len(LENGTHS)))
    sampler = LengthBatchSampler(LENGTHS, _tokens_cap, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    got = [b[0].tolist() for b in loader]
    assert len(loader) == len(got) == len(sampler.epoch_batches())
    _check_batches(got, LENGTHS)
    sampler.set_epoch(1)
    assert [b[0].tolist() for b in loader] != got  # a new order each epoch


def test_sampler_resumed_mid_epoch_yields_exactly_the_remaining_batches():
    sampler = LengthBatchSampler(LENGTHS, _tokens_cap, shuffle=True, seed=5)
    sampler.set_epoch(2)
    whole = list(sampler)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    state = sampler.state_dict()
    resumed = LengthBatchSampler(LENGTHS, _tokens_cap, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    assert len(resumed) == len(whole) - 4
    assert head + list(resumed) == whole
    assert list(resumed) == whole  # then whole epochs again
    with pytest.raises(UsageError, match="seed=5"):
        LengthBatchSampler(LENGTHS, _tokens_cap, shuffle=True, seed=6).load_state_dict(state)


def test_ranks_take_disjoint_batches_as_many_each_covering_every_index():
    for world in (2, 3, 4):
        per_rank = [list(LengthBatchSampler(LENGTHS, _tokens_cap, shuffle=True, seed=1, rank=r,
                                            world_size=world)) for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1
        _check_batches([b for rank in per_rank for b in rank], LENGTHS)
    assert [len(b) for b in split_for_ranks([[0, 1, 2, 3], [4]], 3)] == [2, 2, 1]
    with pytest.raises(UsageError, match="at least 3 samples"):
        split_for_ranks([[0], [1]], 3)
    with pytest.raises(UsageError, match="rank"):
        LengthBatchSampler(LENGTHS, _tokens_cap, rank=2, world_size=2)


def test_search_shapes_checks_lengths_before_any_trial():
    import oomguard

    def step(batch_size: int, seq_len: int) -> None:  # pragma: no cover - never called
        raise AssertionError("a trial ran")

    for bad in ([], [4, -1], None):
        with pytest.raises(UsageError, match="lengths"):
            oomguard.search_shapes(step, bad)


def test_plan_bounds_the_surface_by_what_the_searches_measured():
    from oomguard.engine.core.search.shapes import ShapePlan, ShapePoint

    def point(n: int, safe: int) -> ShapePoint:
        return ShapePoint(n, safe, safe + 1, safe + 2, 0.0, 0.0, None, 3)

    # 1 MB per token, 1000 MB of room: the surface says 1000 // n rows.
    plan = ShapePlan("w", "cpu", None, [point(10, 90), point(100, 9)], 0.0, 1e6, 0.0, 1e9,
                     65536, 0.0)
    assert plan.max_batch(10) == 90 and plan.max_batch(100) == 9  # as searched
    assert plan.max_batch(50) == 20  # the surface, between them
    assert plan.max_batch(11) == 90  # never above the shorter length's measured batch
    assert plan.max_batch(200) == 5  # above the longest: the surface
    assert plan.max_batch(5) == 200  # below the shortest: in proportion to the length
    widths = [plan.max_batch(n) for n in range(1, 300)]
    assert widths == sorted(widths, reverse=True)
    assert plan.to_dict()["points"][0]["safe"] == 90
