"""The estimated reference's speed-ups change no number: the reference of a small LLaMA-like
config (8 layers, so the depth extrapolation runs; bf16; for cuda) equals, row for row, the
JSON stored from the code before them (tests/golden/estimate_reference_small_llama.json;
the 7B config's whole reference, every metric, is compared in bench/bench_estimate.py
against tests/golden/estimate_reference_7b.json: it takes a minute, too long here).

The memory (1 MiB) puts loss's knob between sizes, so its search runs its line rounds
(12 estimates): every size of a session after its warm-up, and every depth.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses import fake_tensor as ft

from oomguard.engine.core.estimate.estimate import estimate
from oomguard.engine.jobs.reference_estimate import build_estimate_reference

GOLDEN = Path(__file__).parent / "golden"
SMALL_LLAMA = ("llama:hidden_size=64,intermediate_size=160,num_hidden_layers=8,"
               "num_attention_heads=4,num_key_value_heads=2,vocab_size=256,"
               "max_position_embeddings=64")
# What a row's numbers are (seconds are not)
FIGURES = ("metric", "knob", "unit", "max_ok", "first_oom", "total_bytes", "peak_bytes",
           "next_total_bytes", "largest_useful", "exact", "estimates", "others", "note")


def figures(doc: dict) -> list[dict]:
    return [{k: row.get(k) for k in FIGURES} for row in doc["rows"]]


@pytest.mark.slow
def test_small_llama_estimated_reference_equals_the_stored_one():
    want = json.loads((GOLDEN / "estimate_reference_small_llama.json").read_text())
    got = build_estimate_reference(SMALL_LLAMA, "bfloat16", 16, 4, memory=1024**2,
                                   memory_name="x", margin=0.15, device="cuda",
                                   metrics=["loss"])  # attention_stats: in the JSON too
    assert figures(got) == [row for row in figures(want) if row["metric"] == "loss"]
    assert got["notes"] == want["notes"]


def _two_metrics() -> dict:
    # two metrics: on two or more CPUs each is estimated in its own worker process
    return build_estimate_reference(SMALL_LLAMA, "bfloat16", 16, 4, memory=1024**2,
                                    memory_name="x", margin=0.15, device="cuda",
                                    metrics=["loss", "attention_stats"])


@pytest.mark.slow
def test_metrics_estimated_in_parallel_workers_equal_the_stored_reference():
    # The same numbers as the one process that stored them: Python's cycle collector is off
    # during an estimate, so what ran before in a process does not move a peak. The pool's
    # workers fork from this worker's forkserver, which runs already (a fresh process here
    # started a server of its own: 4-5 CPU-seconds more, docs/measurements.md#test-suite-cost).
    want = json.loads((GOLDEN / "estimate_reference_small_llama.json").read_text())
    got = _two_metrics()
    assert figures(got) == figures(want)
    assert got["notes"] == want["notes"] and got["estimates"] == want["estimates"]


def _real_ops(size: int) -> None:
    """Operations on real inputs only: token ids and a mask made from them (small), then a
    float table of ``size`` x ``size`` (small at 8, large at 1024: 4 MiB)."""
    ids = torch.arange(16).reshape(2, 8)
    mask = (ids % 3 == 0).long() + 1
    table = torch.zeros(size, size)
    _SEEN.append((type(mask), type(table)))


_SEEN: list[tuple[type, type]] = []


def test_a_repeated_small_real_operation_skips_the_conversion_to_fake(monkeypatch):
    calls = []
    convert = ft.FakeTensorConverter.from_real_tensor

    def counted(self, *args, **kwargs):
        calls.append(1)
        return convert(self, *args, **kwargs)

    monkeypatch.setattr(ft.FakeTensorConverter, "from_real_tensor", counted)
    _SEEN.clear()
    estimate(_real_ops, [8])
    first = len(calls)
    estimate(_real_ops, [8, 8])
    assert first > 0 and len(calls) == first  # the repeats convert nothing
    # the decision follows each operation's sizes: the large table stays fake
    e = estimate(_real_ops, [1024])
    assert _SEEN[-1] == (torch.Tensor, ft.FakeTensor)
    assert all(seen == (torch.Tensor, torch.Tensor) for seen in _SEEN[:-2])
    assert e[0].peak_bytes >= 1024 * 1024 * 4
