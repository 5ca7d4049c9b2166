"""How metrics see padding: every sample is right-aligned before a metric runs.

Why: with left padding, a query at a leading pad position has no key to attend to, and in a float64
model transformers' float32 softmax turns that row into NaN, which spreads into every gradient
(measured: docs/measurements.md#float64-attention-softmax). Right-aligned, every query has a key.
Models with relative or mask-counted positions (rotary, ALiBi, OPT) give the same results; absolute
positions (GPT-2) read a sample as without padding; reported positions count from each sample's
first valid token.
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
