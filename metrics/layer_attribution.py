"""``layer_attribution``: how much attribution flows through each transformer block.

For every decoder block (one captum call each: stacked blocks feed each other), captum's
``LayerIntegratedGradients`` attributes the target of ``integrated_gradients`` to the block's output.
Per sample and block (float64, ``[n_samples, n_layers]``): ``scores``, the L1 mass ``sum |attr|``
over valid positions and features; ``totals``, the signed sum, which by completeness approximates
``f(x) - f(baseline)`` for every block (a check beside ``delta``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from oomguard.engine.errors import UsageError
from oomguard.metrics.base import register
from oomguard.metrics.integrated_gradients import AttributeTo, CaptumMetric, captum_knobs


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder blocks: the ``nn.ModuleList`` of same-type modules of
    ``config.num_hidden_layers``, else the largest; UsageError if none."""
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    best: torch.nn.ModuleList | None = None
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len({type(m) for m in module}) != 1:
            continue  # not a stack of same-type modules (or empty)
        if n_layers is not None and len(module) == n_layers:
            return module
        if best is None or len(module) > len(best):
            best = module
    if best is None:
        raise UsageError(f"no stack of transformer blocks found in {type(model).__name__}; "
                         "use a transformer model")
    return best


def hidden_tap(block: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """An identity module that ``block``'s hidden-state output passes through, and its hook
    handle: captum would differentiate every tensor of a block's tuple output."""
    tap = torch.nn.Identity()

    def through_tap(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (tap(output[0]), *output[1:])
        return tap(output)

    return tap, block.register_forward_hook(through_tap)


@register
class LayerAttribution(CaptumMetric):
    name = "layer_attribution"
    description = ("layer-wise integrated gradients over each transformer block's output: "
                   "L1 attribution mass per block per sample, with completeness totals")
    knobs = captum_knobs(chunk_default=96)  # the seed's layer_wise_chunk_size

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                **params: Any) -> dict[str, Any]:
        n_layers = len(transformer_blocks(model))  # no stack of blocks: fails before any work
        return {**super().compute(model, data, **params), "n_layers": n_layers}

    def attribute_chunk(self, model: torch.nn.Module, attribute_to: AttributeTo,
                        valid: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = valid.to(torch.float64).unsqueeze(-1)
        cols: dict[str, list[torch.Tensor]] = {"scores": [], "totals": [], "delta": []}
        for block in transformer_blocks(model):
            tap, handle = hidden_tap(block)
            with handle:  # removes the hook on leaving
                attr, delta = attribute_to(tap)
            a = attr * mask
            cols["scores"].append(a.abs().sum(dim=(1, 2)))
            cols["totals"].append(a.sum(dim=(1, 2)))
            cols["delta"].append(delta)
            del attr, delta, a
        return {key: torch.stack(v, dim=1) for key, v in cols.items()}
