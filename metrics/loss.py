"""``loss``: token-weighted mean loss and perplexity of a causal LM over all data.

Measured: the summed per-token NLL (nats) of every scored token
(:func:`metrics.common.nll_sum`) over their count; perplexity is ``exp`` of that mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import JsonMetric, n_samples, nll_sum, total_tokens


@register
class Loss(JsonMetric):
    name = "loss"
    # Log-softmax in float32, sums in float64: bfloat16 logits move it by about 1e-2 nats.
    tolerates_lower_precision = True
    description = "token-weighted mean loss (nats/token) and perplexity over all data"
    knobs = (Knob("micro_batch_size", "memory", 32, 1,
                  "micro_batch_size x seq_len x vocab (logits)",
                  "samples per forward pass; the result does not depend on it"),)

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                micro_batch_size: int = 32) -> dict[str, Any]:
        n_tok = total_tokens(data)
        nll = nll_sum(model, data, micro_batch_size)
        mean = nll / n_tok
        return {"loss": mean, "perplexity": math.exp(mean) if mean < 700 else math.inf,
                "nll_sum": nll, "n_tokens": n_tok, "n_samples": n_samples(data)}

