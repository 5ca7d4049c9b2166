"""Shared fixtures: tiny models of two architectures, generated data, and a CPU
budget entered after a warm-up (CPU-OOM-FACTS.md: thread pools must exist first)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine.budget import budget
from metrics.models import build_model, make_batch

ARCHS = ("tiny-gpt2", "tiny-llama")


@pytest.fixture(scope="session", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


def tiny_model(arch: str, dtype: str = "float64") -> torch.nn.Module:
    """A built-in model in ``dtype`` with fixed random weights."""
    return build_model(arch, dtype=dtype, seed=0)


def tiny_data(n: int = 8, seq_len: int = 16, vocab: int = 256, seed: int = 0) -> dict:
    """Padded causal-LM data (input_ids, attention_mask, labels)."""
    return make_batch(n, seq_len, vocab, seed=seed)


@contextlib.contextmanager
def budget_after_warmup(nbytes: int, warmup=None):
    """Run ``warmup()`` (or a small matmul) then enter a CPU budget of ``nbytes``."""
    (warmup or (lambda: torch.ones(64, 64).matmul(torch.ones(64, 64)).sum()))()
    with budget(nbytes, "cpu") as b:
        yield b
