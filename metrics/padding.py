"""How metrics see padding: every sample is right-aligned before a metric runs.

Measured facts behind it: docs/measurements.md#float64-attention-softmax.

Why: with left padding, a query at a leading pad position has no key it may attend to. transformers'
eager attention takes its softmax in float32, so in a float64 model the masked scores (float64's
most negative value) become ``-inf`` and the whole row NaN, which spreads into valid tokens in the
next layer and into every gradient. Moving each sample's leading padding to its end leaves every
query of a sample with a valid token at least one key (the sample's first token).

What it changes, and what not:

- nothing for models whose attention depends only on relative positions or on positions counted
  along the mask: rotary embeddings (LLaMA, Mistral, Qwen2, Phi, GPT-NeoX, GPT-J, Falcon), ALiBi
  (Bloom), OPT's learned positions (from the mask's cumulative sum). Left- and right-padded data
  give the same results up to float rounding;
- for absolute positions counted from 0 (GPT-2), a sample is read as it would be
  without padding (what transformers recommends), not shifted by its padding;
- positions a metric reports (``last_positions``, per-position norms, the attention weight on the
  first token) count from each sample's first valid token.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def right_align(data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``data`` (a shallow copy) with each sample's leading padding moved to its end: every
    tensor whose first two dimensions are ``[samples, positions]`` is rotated alike, so
    tokens keep their order and their labels."""
    out = dict(data)
    mask = data.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return out
    # masked positions before each sample's first valid token; 0 where there is none
    shift = (mask != 0).long().argmax(dim=1)
    if not bool(shift.any()):
        return out
    n, length = mask.shape
    index = (torch.arange(length, device=mask.device)[None, :] + shift[:, None]) % length
    rows = torch.arange(n, device=mask.device)[:, None]
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (n, length):
            out[key] = value[rows.to(value.device), index.to(value.device)]
    return out
