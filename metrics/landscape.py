"""``loss_landscape``: the loss on a 2-D plane through the parameters (Li et al. 2018).

Two seeded random directions ``d1, d2`` are *filter-normalised*: every slice along dim 0 of a
parameter (a 1-D one as a whole) is rescaled to the norm of the same slice of the parameter; unlike
Li et al.'s default, biases and norms move too. On the ``grid x grid`` points ``(a_i, b_j)``
(:func:`axis`) the parameters are ``theta + a_i d1 + b_j d2`` and the loss is the token-weighted mean
NLL (nats per token) over *all* data. Parameters are restored bit-for-bit afterwards, also after an
OOM. Memory: 3x the parameters (fixed) beside the forward; cost: ``grid^2`` passes over the data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from oomguard.engine.core.workload import host_device, shortcut
from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import JsonMetric, n_samples, nll_sum, total_tokens


def filter_normalised_direction(params: list[torch.Tensor], generator: torch.Generator,
                                ) -> list[torch.Tensor]:
    """One random direction per parameter, filter-normalised, drawn on the host from
    ``generator`` (a seed gives the same direction on any device), in float32 at least."""
    out = []
    host = host_device()  # the host's memory, never the accelerator's
    for p in params:
        d = torch.randn(p.shape, generator=generator, dtype=torch.float64, device=host)
        ref = p.detach().to(device=host, dtype=torch.float64)
        if p.dim() < 2:  # one filter: the whole parameter
            d, ref = d.reshape(1, -1), ref.reshape(1, -1)
        scale = ref.flatten(1).norm(dim=1) / d.flatten(1).norm(dim=1).clamp_min(1e-30)
        d = (d.flatten(1) * scale[:, None]).view(p.shape)
        out.append(d.to(device=p.device,
                        dtype=torch.float64 if p.dtype == torch.float64 else torch.float32))
    return out


def axis(grid: int, span: float) -> torch.Tensor:
    """Coordinates ``span * (2 i / (grid - 1) - 1)`` for ``i < grid`` (float64: the middle
    of an odd grid is exactly 0); [0.] if grid is 1."""
    if grid == 1:
        return torch.zeros(1, dtype=torch.float64)
    i = torch.arange(grid, dtype=torch.float64)
    return span * (2 * i / (grid - 1) - 1)


@register
class LossLandscape(JsonMetric):
    name = "loss_landscape"
    # No: neighbouring points differ by weight steps that bfloat16 rounds away.
    tolerates_lower_precision = False
    description = ("2-D loss landscape (token-weighted mean NLL) along two filter-normalised "
                   "random directions, Li et al. 2018")
    knobs = (
        Knob("grid", "result", 25, 1, "", "points per axis (grid x grid evaluations)"),
        Knob("span", "result", 1.0, 1e-12, "", "axis runs from -span to +span"),
        Knob("seed", "result", 0, 0, "", "seed of the two random directions"),
        Knob("micro_batch_size", "memory", 16, 1, "micro_batch_size x seq_len x vocab (logits)",
             "samples per forward; sums are exact"),
    )

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                grid: int = 25, span: float = 1.0, seed: int = 0,
                micro_batch_size: int = 16) -> dict[str, Any]:
        n_tok = total_tokens(data)
        params = [p for _, p in model.named_parameters()]
        center = nll_sum(model, data, micro_batch_size) / n_tok
        gen = torch.Generator().manual_seed(seed)
        d1 = filter_normalised_direction(params, gen)
        d2 = filter_normalised_direction(params, gen)
        coords = axis(grid, span)
        if shortcut(f"{self.name}: 1 point of {grid}x{grid} estimated: every point repeats "
                    "the same work on the same tensors"):
            coords = coords[:1]
        losses = torch.empty(len(coords), len(coords), dtype=torch.float64)
        saved = [p.detach().clone() for p in params]
        try:
            with torch.no_grad():
                for i, a in enumerate(coords.tolist()):
                    for j, b in enumerate(coords.tolist()):
                        for p, p0, u, v in zip(params, saved, d1, d2, strict=True):
                            p.copy_(p0.to(u.dtype) + a * u + b * v)
                        losses[i, j] = nll_sum(model, data, micro_batch_size) / n_tok
        finally:
            with torch.no_grad():
                for p, p0 in zip(params, saved, strict=True):
                    p.copy_(p0)
        return {"losses": losses, "center_loss": center, "axis": coords,
                "n_tokens": n_tok, "n_samples": n_samples(data)}
