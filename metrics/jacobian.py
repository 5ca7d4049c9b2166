"""``position_jacobian``: how strongly each input position moves the final hidden state.

For every sample, let ``h`` be the final hidden state (the base model's ``last_hidden_state``, after
the final norm; ``d`` features) at the sample's last valid position, and ``e_p`` the input embedding
at position ``p``. The result is the Frobenius norm of the Jacobian block ``dh / de_p`` for every
``p``: ``[n_samples, seq_len]``, float64, unit "hidden units per embedding unit"; 0 after the last
valid position, by causality and masking; NaN rows for samples without a valid token
(``n_samples_defined`` counts the others). Exact, not estimated.

How: the ``d`` VJPs (row ``k`` of the Jacobian each) run ``vjp_block`` at a time by replicating each
sample ``vjp_block`` times and back-propagating feature ``k`` from replica ``k``: one ordinary
backward per block (measured several times faster than vmap over cotangents), so one forward holds
``micro_batch_size x vjp_block`` rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from oomguard.engine.core.workload import shortcut
from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import (
    JsonMetric,
    attention_mask,
    expand_rows,
    iter_micro_batches,
    n_samples,
)
from oomguard.metrics.integrated_gradients import defined_samples, last_positions


def output_width(config: Any) -> int | None:
    """Features of ``last_hidden_state`` (OPT projects it to ``word_embed_proj_dim``): the
    largest useful ``vjp_block``, above which every block is the whole width."""
    width = getattr(config, "word_embed_proj_dim", None) or getattr(config, "hidden_size", None)
    return int(width) if width else None


def _micro_batch_norms(model: torch.nn.Module, batch: Mapping[str, torch.Tensor],
                       vjp_block: int) -> torch.Tensor:
    """Per-position Jacobian Frobenius norms ``[b, seq_len]`` (float64) of one micro-batch."""
    ids = batch["input_ids"]
    mask = attention_mask(batch)
    n, seq_len = ids.shape
    last = last_positions(mask, min_valid=1)
    emb = model.get_input_embeddings()(ids).detach()
    # The width of h comes from the tensor: OPT projects its output to another width.
    with torch.no_grad():
        width = int(model.base_model(inputs_embeds=emb[:1],
                                     attention_mask=mask[:1]).last_hidden_state.shape[-1])
    sq = torch.zeros(n, seq_len, dtype=torch.float64, device=ids.device)
    starts = list(range(0, width, vjp_block))
    if len(starts) > 2 and shortcut(f"position_jacobian: 2 VJP blocks of {len(starts)} "
                                    "estimated: every block repeats the same work"):
        starts = starts[:2]
    for start in starts:
        k = min(vjp_block, width - start)
        # k replicas of each sample; replica j back-propagates output feature start + j
        rep = emb.repeat_interleave(k, dim=0).requires_grad_(True)
        hidden = model.base_model(inputs_embeds=rep,
                                  attention_mask=mask.repeat_interleave(k, dim=0)).last_hidden_state
        rows = torch.arange(n * k, device=ids.device)
        feats = torch.arange(start, start + k, device=ids.device).repeat(n)
        picked = hidden[rows, last.repeat_interleave(k), feats]
        (g,) = torch.autograd.grad(picked.sum(), rep)
        sq += g.to(torch.float64).view(n, k, seq_len, -1).square().sum(dim=(1, 3))
        del g, rep, hidden, picked
    return sq.sqrt() * mask.to(torch.float64)


@register
class PositionJacobian(JsonMetric):
    name = "position_jacobian"
    # No: far positions' small norms are the signal, and bfloat16 errors are of their size.
    tolerates_lower_precision = False
    description = ("Frobenius norm of the Jacobian of the last valid position's final hidden "
                   "state w.r.t. the input embedding at every position (VJPs)")
    knobs = (
        Knob("micro_batch_size", "memory", 32, 1, "micro_batch_size x vjp_block x seq_len x width",
             "samples per forward"),
        Knob("vjp_block", "memory", 8, 1, "micro_batch_size x vjp_block x seq_len x width",
             "output features per backward (replicated rows)", largest=output_width),
    )

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                micro_batch_size: int = 32, vjp_block: int = 8) -> dict[str, Any]:
        keep, work = defined_samples(data, min_valid=1)
        with torch.enable_grad():
            norms = torch.cat([_micro_batch_norms(model, mb, vjp_block).cpu()
                               for mb in iter_micro_batches(work, micro_batch_size)])
        last = last_positions(attention_mask(work), min_valid=1).cpu()
        return {"norms": expand_rows(norms, keep),
                "last_positions": expand_rows(last.to(torch.float64), keep),
                "n_samples": n_samples(data), "n_samples_defined": int(keep.sum()),
                "self_norm_mean": float(norms.gather(1, last[:, None]).mean())}
