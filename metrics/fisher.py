"""``fisher_diagonal``: the diagonal of the empirical Fisher, per parameter group.

``F_ii = (1/n) sum_s (d loss_s / d theta_i)^2``, ``loss_s`` sample ``s``'s mean NLL (nats/token),
``n`` the samples with a scored token; per-sample gradients by ``torch.func`` (``vmap(grad)``),
squares summed in float64. Reported per group: ``trace`` and ``mean`` (per parameter); total trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from oomguard.engine.core.memory.oom import is_oom
from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import (
    JsonMetric,
    attention_mask,
    iter_micro_batches,
    labels_of,
    logits_nll,
    n_samples,
    param_groups,
    scored_samples,
    total_tokens,
)

VMAP = "torch.func vmap(grad)"
LOOP = "per-sample backward loop (torch.func cannot transform the model)"
# Words of torch.func's errors for a model it cannot transform (Bloom's GeLU, Mamba's slow path).
TORCH_FUNC_REFUSALS = ("functorch", "setup_context", "vmap")


def fisher_diagonal_sums(model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                         micro_batch_size: int) -> tuple[dict[str, torch.Tensor], int, str]:
    """Sum over samples of squared per-sample gradients (float64, one tensor per parameter name),
    the number of samples that have scored tokens, and the method that computed them
    (:data:`VMAP`, or :data:`LOOP` where torch.func cannot transform the model)."""
    method = VMAP
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    names = list(params)

    def sample_loss(ps: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
                    labels: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, ps, (), {"input_ids": ids[None], "attention_mask": mask[None]})
        n_tok = (labels[1:] != -100).sum().clamp(min=1)
        return logits_nll(out.logits, labels[None]) / n_tok

    per_sample_grad = vmap(grad(sample_loss), in_dims=(None, 0, 0, 0))

    def looped_grad(ps: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
                    labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The same per-sample gradients, one backward per sample (exact; :data:`LOOP`)."""
        rows = []
        for i in range(ids.shape[0]):
            leaves = {n: p.detach().requires_grad_(True) for n, p in ps.items()}
            with torch.enable_grad():
                loss = sample_loss(leaves, ids[i], mask[i], labels[i])
                rows.append(torch.autograd.grad(loss, [leaves[n] for n in names],
                                                allow_unused=True, materialize_grads=True))
        return dict(zip(names, map(torch.stack, zip(*rows, strict=True)), strict=True))

    acc = {n: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for n, p in params.items()}
    counted = 0
    for mb in iter_micro_batches(data, micro_batch_size):
        scored = scored_samples(mb)  # a sample without scored tokens adds nothing, never runs
        if scored is None:
            continue
        counted += n_samples(scored)
        batch = (scored["input_ids"], attention_mask(scored), labels_of(scored))
        if method == VMAP:
            try:
                grads = per_sample_grad(params, *batch)
            except RuntimeError as exc:
                if is_oom(exc) or not any(word in str(exc) for word in TORCH_FUNC_REFUSALS):
                    raise
                method = LOOP
        if method == LOOP:
            grads = looped_grad(params, *batch)
        for n in names:
            acc[n].add_(grads[n].to(torch.float64).pow(2).sum(dim=0))
        del grads
    return acc, counted, method


@register
class FisherDiagonal(JsonMetric):
    name = "fisher_diagonal"
    # No: squares of near-0 per-sample gradients have unbounded relative error in bfloat16.
    tolerates_lower_precision = False
    description = ("diagonal empirical Fisher, mean over samples of squared per-sample "
                   "gradients: trace and mean per parameter group, total trace")
    knobs = (
        Knob("micro_batch_size", "memory", 32, 1,
             "micro_batch_size x (parameters + seq_len x activations) (per-sample gradients)",
             "samples whose gradients are computed at once (vmap); the result does not depend on it"),
    )

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                micro_batch_size: int = 32) -> dict[str, Any]:
        total_tokens(data)  # raises on data without scored tokens
        sums, counted, method = fisher_diagonal_sums(model, data, micro_batch_size)
        groups: dict[str, dict[str, float]] = {}
        for group, members in param_groups(model).items():
            trace = sum(float(sums[n].sum()) for n, _ in members) / counted
            numel = sum(p.numel() for _, p in members)
            groups[group] = {"trace": trace, "mean": trace / numel, "numel": numel}
        return {"groups": groups, "total_trace": sum(g["trace"] for g in groups.values()),
                "n_samples": n_samples(data), "n_samples_scored": counted, "method": method}
