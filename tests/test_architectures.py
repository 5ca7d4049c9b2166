"""Every metric on every decoder-only family transformers builds from a config.

Each family is a tiny random model (two layers, width 16-32, vocabulary 64) and
runs every metric on padded data that holds an all-padding sample, a one-token
sample, and 5 samples (divisible by neither memory size used). Left-padded data
at a memory size of 2 must give the same numbers as right-padded data at 5, and
every number must be finite: in float64 (where transformers' float32 attention
softmax turns a fully masked row into NaN) and float32. References written
without the metrics' code: plain token-weighted cross-entropy over each sample
run alone without padding, and captum called directly for integrated gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import cli_in_child, numbers

from oomguard.engine.errors import UsageError
from oomguard.metrics.base import get_metric, load_all
from oomguard.metrics.models import build_model

FAMILIES = {
    "gpt2": "gpt2:n_embd=32,n_layer=2,n_head=2,vocab_size=64,n_positions=32,"
            "bos_token_id=0,eos_token_id=0",
    "llama": "llama:hidden_size=32,intermediate_size=64,num_hidden_layers=2,"
             "num_attention_heads=2,num_key_value_heads=1,vocab_size=64,max_position_embeddings=32",
    "opt": "opt:hidden_size=16,word_embed_proj_dim=16,num_hidden_layers=2,ffn_dim=32,"
           "num_attention_heads=2,vocab_size=64,max_position_embeddings=32",
    "opt-projected": "opt:hidden_size=16,word_embed_proj_dim=8,num_hidden_layers=2,ffn_dim=32,"
                     "num_attention_heads=2,vocab_size=64,max_position_embeddings=32",
    "gpt_neox": "gpt_neox:num_hidden_layers=2,hidden_size=32,num_attention_heads=2,"
                "intermediate_size=64,vocab_size=64",
    "mistral": "mistral:hidden_size=32,intermediate_size=64,num_hidden_layers=2,"
               "num_attention_heads=2,num_key_value_heads=1,vocab_size=64",
    "qwen2": "qwen2:hidden_size=32,intermediate_size=64,num_hidden_layers=2,"
             "num_attention_heads=2,num_key_value_heads=1,vocab_size=64",
    "phi": "phi:hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,"
           "vocab_size=64",
    "gptj": "gptj:n_embd=32,n_layer=2,n_head=2,vocab_size=64,n_positions=32,rotary_dim=8,"
            "bos_token_id=0,eos_token_id=0",
    "falcon": "falcon:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,vocab_size=64",
    "bloom": "bloom:hidden_size=32,n_layer=2,n_head=2,vocab_size=64",
}
MAMBA = "mamba:hidden_size=32,num_hidden_layers=2,vocab_size=64,state_size=4"
# result knobs kept small for speed; the memory knobs are what the test varies
FIXED = {"hessian_eigenvalues": {"k": 2, "iterations": 3},
         "ggn_eigenvalues": {"k": 2, "iterations": 3},
         "loss_landscape": {"grid": 2},
         "integrated_gradients": {"n_steps": 3},
         "layer_attribution": {"n_steps": 3}}
# transformers takes the attention softmax in float32 even in float64 models, so a
# padded sample and the same sample alone agree to float32 rounding of the attention
# weights, not to float64's: measured up to 4e-9 relative (integrated gradients on
# LLaMA) and 4e-11 (loss)
FLOAT32_SOFTMAX = 1e-8
LENGTHS = (12, 0, 1, 7, 12)  # an all-padding and a one-token sample among them
SEQ = 12



def padded(side: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """The same samples (token ids 1..63), padded with id 0 on ``side``."""
    tokens = torch.randint(1, 64, (len(LENGTHS), SEQ), generator=torch.Generator().manual_seed(seed))
    ids = torch.zeros(len(LENGTHS), SEQ, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        where = slice(SEQ - n, SEQ) if side == "left" else slice(0, n)
        ids[i, where], mask[i, where] = tokens[i, :n], 1
    return {"input_ids": ids, "attention_mask": mask}


def summary(name: str, model: torch.nn.Module, data: dict, size: int) -> dict[str, float]:
    metric = get_metric(name)
    sizes = {k.name: size for k in metric.memory_knobs()}
    return numbers(metric.summary(metric.run(model, data, **FIXED.get(name, {}), **sizes)))


def builtin_metrics() -> dict:
    """oomguard's own metrics (other tests register plugin metrics in this process)."""
    return {n: m for n, m in load_all().items()
            if type(m).__module__.startswith("oomguard.metrics.")}


def metric_names() -> list[str]:
    return sorted(n for n, m in builtin_metrics().items() if m.memory_knobs())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_metric_is_finite_and_invariant_on_every_family(family: str, dtype: str) -> None:
    model = build_model(FAMILIES[family], dtype=dtype, seed=0)
    # float32: a completeness delta is a difference of near-equal numbers, so its
    # rounding is absolute (about 1e-8 against attributions of order 1)
    rel, floor = (1e-9, 1e-12) if dtype == "float64" else (2e-4, 1e-6)
    for name in metric_names():
        left, right = summary(name, model, padded("left"), 2), summary(name, model, padded("right"), 5)
        assert left.keys() == right.keys(), name
        scale = max(abs(v) for v in left.values() if math.isfinite(v))
        for key, value in left.items():
            other = right[key]
            if math.isnan(value) or math.isnan(other):
                # only the rows of samples a per-sample metric is undefined on (index 1
                # has no token, index 2 no next-token target)
                assert math.isnan(value) and math.isnan(other), (name, key, value, other)
                assert any(f".{i}." in f".{key}." for i in (1, 2)), (name, key)
                continue
            assert abs(value - other) <= rel * max(abs(value), abs(other)) + floor * scale, (
                name, key, value, other)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_is_plain_cross_entropy_of_each_sample_alone(family: str) -> None:
    """Reference: each sample run alone, unpadded, through the model; the summed
    cross-entropy of its next-token predictions over all scored tokens."""
    model = build_model(FAMILIES[family], dtype="float64", seed=0)
    data = padded("left")
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in zip(data["input_ids"], data["attention_mask"], strict=True):
            tokens = ids[mask.bool()][None]
            if tokens.shape[1] < 2:
                continue
            logits = model(input_ids=tokens).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, tokens[0, 1:], reduction="sum"))
            count += tokens.shape[1] - 1
    for side in ("left", "right"):
        result = get_metric("loss").run(model, padded(side), micro_batch_size=2)
        assert result["n_tokens"] == count
        assert result["loss"] == pytest.approx(total / count, rel=FLOAT32_SOFTMAX)


def test_integrated_gradients_match_captum_called_directly() -> None:
    from captum.attr import LayerIntegratedGradients

    model = build_model(FAMILIES["llama"], dtype="float64", seed=0)
    data = padded("left")
    ours = get_metric("integrated_gradients").run(model, data, n_steps=5, chunk_size=2)
    assert ours["n_samples_attributed"] == 3
    for i, (ids, mask) in enumerate(zip(data["input_ids"], data["attention_mask"], strict=True)):
        tokens = ids[mask.bool()][None]
        if tokens.shape[1] < 2:
            assert torch.isnan(ours["attributions"][i]).all()
            continue

        def log_prob(x: torch.Tensor, tokens: torch.Tensor = tokens) -> torch.Tensor:
            logits = model(input_ids=x).logits[:, -2]
            return torch.log_softmax(logits, dim=-1)[:, tokens[0, -1]]

        lig = LayerIntegratedGradients(log_prob, model.get_input_embeddings())
        attr = lig.attribute(tokens, baselines=torch.full_like(tokens, ours["baseline_token"]),
                             n_steps=5, method="gausslegendre").sum(dim=-1)[0]
        n = tokens.shape[1]
        gap = (ours["attributions"][i, :n] - attr).abs().max()
        assert gap <= FLOAT32_SOFTMAX * attr.abs().max(), (i, gap)
        assert (ours["attributions"][i, n:] == 0).all()


@pytest.mark.slow
def test_a_metric_that_cannot_run_says_so_in_one_line_before_any_work() -> None:
    model = build_model(MAMBA, dtype="float32", seed=0)
    with pytest.raises(UsageError, match="attention_stats does not support mamba models: the "
                                         "model has no attention layers"):
        get_metric("attention_stats").run(model, padded("right"))
    fisher = get_metric("fisher_diagonal").run(model, padded("right"), micro_batch_size=2)
    assert fisher["method"].startswith("per-sample backward loop")  # vmap refuses Mamba
    assert math.isfinite(fisher["total_trace"])
    listing = cli_in_child("metrics", "--model", MAMBA)  # a fresh catalogue
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert ("attention_stats: not supported: the model has no attention layers (no attention "
            "probabilities to measure)") in lines
    assert "loss: supported" in lines and len(lines) == len(builtin_metrics())
