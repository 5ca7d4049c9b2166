"""Recomputation (activation checkpointing per block) for analysis metrics: the same results
both ways, and a job that measures both configurations and keeps the faster.

Models are tiny transformers built from configs; results are compared in float64.
"""

from __future__ import annotations

import torch
from conftest import tiny_data, tiny_model

from oomguard.engine.core.recompute import checkpointed


def test_a_transformers_model_checkpointed_gives_the_same_gradients_and_keeps_its_cache() -> None:
    # Its blocks fill the key/value cache: recomputed with the cache on, they appended to it
    # twice and attention failed on twice the keys.
    for arch in ("tiny-gpt2", "tiny-llama"):
        model, data = tiny_model(arch), tiny_data(n=2, seq_len=8)
        ids = data["input_ids"]
        model(input_ids=ids, labels=ids).loss.backward()
        plain = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        with checkpointed(model) as blocks:
            assert not model.config.use_cache
            model(input_ids=ids, labels=ids).loss.backward()
        assert len(blocks) == model.config.num_hidden_layers and model.config.use_cache
        for a, p in zip(plain, model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, a, rtol=0, atol=1e-12)
