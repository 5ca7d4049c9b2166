"""``attention_stats``: per layer and head, how attention is spread, over all valid queries.

Per layer and head, averaged over every valid query position: ``entropy`` of the attention row
(nats), ``first_token`` (the weight on key 0, a probability) and ``distance`` (``sum_k p_k (q - k)``,
positions). Chunks add float64 sums; the means are taken at the end. Needs eager attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from oomguard.engine.errors import UsageError
from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import JsonMetric, iter_micro_batches, model_inputs, n_samples

STATS = ("entropy", "first_token", "distance")


def attention_sums(model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                   chunk_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """Float64 sums ``[layers, heads]`` of each statistic over valid queries, and their count."""
    sums: dict[str, torch.Tensor] = {}
    count = 0
    with torch.no_grad():
        for chunk in iter_micro_batches(data, chunk_size):
            out = model(**model_inputs(chunk), output_attentions=True)
            if not out.attentions:
                raise UsageError("the model returned no attention probabilities: build it with "
                                 "attn_implementation='eager'")
            n, seq = chunk["input_ids"].shape
            mask = chunk.get("attention_mask")
            valid = (torch.ones(n, seq, dtype=torch.bool) if mask is None else mask.bool())
            valid = valid.to(out.attentions[0].device)[:, None, :]  # [B, 1, Q]
            pos = torch.arange(seq, device=valid.device, dtype=torch.float64)
            lookback = (pos[:, None] - pos[None, :]).clamp(min=0)  # [Q, K]
            per_layer: dict[str, list[torch.Tensor]] = {s: [] for s in STATS}
            for attn in out.attentions:  # [B, H, Q, K]
                p = attn.to(torch.float64)
                values = {"entropy": -torch.special.xlogy(p, p).sum(-1),
                          "first_token": p[..., 0],
                          "distance": (p * lookback).sum(-1)}
                for s, v in values.items():  # where(): pad rows may hold NaN
                    per_layer[s].append(torch.where(valid, v, 0.0).sum(dim=(0, 2)).cpu())
            for s in STATS:
                sums[s] = sums.get(s, 0) + torch.stack(per_layer[s])
            count += int(valid.sum())
            del out
    return sums, count


@register
class AttentionStats(JsonMetric):
    name = "attention_stats"
    # Means of probabilities summed in float64: bfloat16 moves the third digit, nothing cancels.
    tolerates_lower_precision = True
    description = ("per layer and head: mean attention entropy (nats), mean weight on the first "
                   "token, mean attention distance (positions), over all valid query positions")
    knobs = (Knob("chunk_size", "memory", 96, 1, "chunk_size x layers x heads x seq_len^2",
                  "samples per forward pass; the result does not depend on it"),)

    def unsupported(self, config: Any) -> str | None:
        if config is not None and not getattr(config, "num_attention_heads", None):
            return "the model has no attention layers (no attention probabilities to measure)"
        return None

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                chunk_size: int = 96) -> dict[str, Any]:
        sums, count = attention_sums(model, data, chunk_size)
        if count == 0:
            raise UsageError("the data has no valid query positions (attention_mask is all "
                             "0); give samples with unmasked tokens")
        means = {s: (sums[s] / count) for s in STATS}
        layers, heads = means["entropy"].shape
        return {**{s: m.tolist() for s, m in means.items()},  # [layer][head]
                **{f"mean_{s}": float(m.mean()) for s, m in means.items()},
                "n_queries": count, "n_samples": n_samples(data), "layers": layers, "heads": heads}
