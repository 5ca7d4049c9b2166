"""Stepping down before the OOM on CUDA, against the fake caching allocator
(tests/fakes/fake_cuda.py follows c10/cuda/CUDACachingAllocator.cpp: a segment that does not
fit under the fraction cap frees the cache and retries, counting ``num_alloc_retries``).

The step allocates a little more each call (a growing sequence length), so at 8 rows every
call after the first needs a segment larger than the one cached, and reserved + new passes
the 1 GiB cap: the allocator frees its cache and retries, and the call still succeeds.
Composer's rule (engine/core/execute/alloc_retries.py): after 2 such calls in a row the size
steps down, before any OOM; at 4 rows the cached segment serves every call.
"""

from __future__ import annotations

import logging

import pytest
from fakes.fake_cuda import FakeCuda, GiB, MiB

from oomguard.engine.core.execute.stats import stats
from oomguard.engine.training.adaptive import adaptive


def _run(monkeypatch: pytest.MonkeyPatch, **options: object) -> tuple[list[int], object, int]:
    gpu = FakeCuda(total=16 * GiB).install(monkeypatch)
    gpu.set_per_process_memory_fraction(1.0 / 16)  # a 1 GiB cap
    tried: list[int] = []

    @adaptive(batch_size=8, name=f"thrash-{len(options)}", **options)
    def step(batch_size: int) -> int:
        tried.append(batch_size)
        grow = len(tried)  # MiB per row more on every call
        gpu.free(gpu.alloc(batch_size * (100 + grow) * MiB))
        return batch_size

    for _ in range(5):
        step()
    return tried, stats().sizes[step.adaptive_size.name], gpu.num_alloc_retries


def test_fake_cuda_alloc_retries_in_two_consecutive_calls_step_down_before_an_oom(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="oomguard"):
        tried, s, retries = _run(monkeypatch)
    assert tried == [8, 8, 8, 4, 4]
    assert retries == 2  # calls 2 and 3; at 4 rows the cached segment serves every call
    assert (s.ooms, s.shrinks, s.current, s.failed) == (0, 1, 4, 8)
    reasons = [c.reason for c in s.changes]
    assert len(reasons) == 1 and "num_alloc_retries 1 -> 2" in reasons[0]
    assert any("stepping down before an out-of-memory error" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_fake_cuda_alloc_retry_rule_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    tried, s, retries = _run(monkeypatch, watch_alloc_retries=False)
    assert tried == [8] * 5
    assert retries == 4 and s.shrinks == 0
