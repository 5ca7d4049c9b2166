"""``gradient_stats``: norms of the full-data mean-loss gradient, per parameter group.

The L2 norm of the gradient of the token-weighted mean loss over *all* data, per parameter group
and in total, in nats/token per unit parameter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import (
    JsonMetric,
    mean_loss_grad,
    n_samples,
    param_groups,
    total_tokens,
)


@register
class GradientStats(JsonMetric):
    name = "gradient_stats"
    # Norms add squares, nothing cancels: about three significant digits in bfloat16.
    tolerates_lower_precision = True
    description = "L2 norm of the full-data token-weighted mean-loss gradient per parameter group"
    knobs = (
        Knob("micro_batch_size", "memory", 32, 1,
             "micro_batch_size x seq_len x (hidden x layers + vocab) (activations for backward)",
             "samples per forward/backward; the result does not depend on it"),
    )

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                micro_batch_size: int = 32) -> dict[str, Any]:
        groups = param_groups(model)
        params = [p for members in groups.values() for _, p in members]
        squares = iter([float(g.pow(2).sum())
                        for g in mean_loss_grad(model, data, micro_batch_size, params)])
        sq = {group: sum(next(squares) for _ in members) for group, members in groups.items()}
        total = sum(sq.values())
        return {"group_norms": {k: math.sqrt(v) for k, v in sq.items()},
                "total_norm": math.sqrt(total), "n_tokens": total_tokens(data),
                "n_samples": n_samples(data)}
