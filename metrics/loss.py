"""``loss``: token-weighted mean loss and perplexity of a causal LM over all data.

Measured: the sum of per-token negative log-likelihoods (nats) over every
scored token (shifted labels that are not ``-100``), divided by the number of
such tokens; perplexity is ``exp`` of that mean. Micro-batches only split the
sum (float64), so ``micro_batch_size`` changes nothing beyond float rounding.
Memory grows with ``micro_batch_size x seq_len x vocab`` (the logits).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import (
    JsonMetric,
    iter_micro_batches,
    n_samples,
    token_count,
    token_nll_sum,
    total_tokens,
)


@register
class Loss(JsonMetric):
    """Token-weighted mean NLL (nats/token) and perplexity over the whole data."""

    name = "loss"
    # A mean of per-token log-likelihoods, log-softmax in float32 and sums in float64:
    # bfloat16 logits move it by about 1e-2 nats, not its meaning.
    tolerates_lower_precision = True
    description = "token-weighted mean loss (nats/token) and perplexity over all data"
    knobs = (
        Knob("micro_batch_size", "memory", 32, 1, "micro_batch_size x seq_len x vocab (logits)",
             "samples per forward pass; the result does not depend on it"),
    )

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                micro_batch_size: int = 32) -> dict[str, Any]:
        n_tok = total_tokens(data)
        nll = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for mb in iter_micro_batches(data, micro_batch_size):
                if token_count(mb):
                    nll += token_nll_sum(model, mb).cpu()
        mean = float(nll) / n_tok
        return {"loss": mean, "perplexity": math.exp(mean) if mean < 700 else math.inf,
                "nll_sum": float(nll), "n_tokens": n_tok, "n_samples": n_samples(data)}

