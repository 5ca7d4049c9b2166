"""``cka``: linear CKA between the hidden states of every pair of layers.

Features: the ``L + 1`` hidden states (embedding output, then every block's) at every *valid
token* (not pooled: pooling would mix in sequence length). Linear CKA on centred features
(Kornblith et al. 2019), ``||Xc^T Yc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)``: chunks accumulate
exact float64 sums (the Gram ``Z^T Z`` of ``Z = [X_0 | ... | X_L]``, the feature sums, the count),
centred at the end, after a fixed shift (the first sample's mean) that keeps the subtraction well
conditioned. Memory (estimated): a ``((L + 1) d)^2`` float64 accumulator (fixed), plus a forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from oomguard.engine.errors import UsageError
from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import JsonMetric, iter_micro_batches, model_inputs, n_samples


def cka_from_gram(gram: torch.Tensor, sums: torch.Tensor, n: int,
                  widths: Sequence[int]) -> torch.Tensor:
    """Linear CKA matrix ``[L, L]`` from ``gram = Z^T Z`` and ``sums = Z^T 1`` of ``Z = [X_0 |
    ... | X_{L-1}]`` over ``n`` rows; ``widths[i]``: the features of ``X_i`` (they may
    differ: OPT's ``word_embed_proj_dim``)."""
    mean = sums / n
    cov = gram - n * torch.outer(mean, mean)  # Zc^T Zc, exactly centred
    edges = [0, *itertools.accumulate(widths)]
    spans = list(zip(edges[:-1], edges[1:], strict=True))
    # ||Xi^T Xj||_F^2 for every pair
    hsic = torch.stack([torch.stack([cov[a:b, c:d].square().sum() for c, d in spans])
                        for a, b in spans])
    self_norm = hsic.diagonal().sqrt()
    return hsic / torch.outer(self_norm, self_norm)


@register
class CKA(JsonMetric):
    name = "cka"
    # No: centring subtracts nearly equal sums; layers differ where bfloat16 already errs.
    tolerates_lower_precision = False
    description = ("linear CKA between every pair of layers' hidden states (all valid tokens), "
                   "from exact Gram accumulators")
    knobs = (Knob("chunk_size", "memory", 16, 1, "chunk_size x seq_len x (layers + 1) x width",
                  "samples per forward; Gram sums are exact"),)

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                chunk_size: int = 16) -> dict[str, Any]:
        gram: torch.Tensor | None = None
        sums: torch.Tensor | None = None
        shift: torch.Tensor | None = None
        n = 0
        widths: list[int] = []
        with torch.no_grad():
            for mb in iter_micro_batches(data, chunk_size):
                out = model.base_model(**model_inputs(mb), output_hidden_states=True)
                mask = mb.get("attention_mask")
                keep = (mask if mask is not None else torch.ones_like(mb["input_ids"])).bool()
                z = torch.cat([h[keep].to(torch.float64) for h in out.hidden_states], dim=1)
                widths = [int(h.shape[-1]) for h in out.hidden_states]  # from the tensors
                del out
                if shift is None:
                    first = int(keep[0].sum())
                    shift = z[:first].mean(dim=0) if first else torch.zeros_like(z[0])
                    gram, sums = z.new_zeros(z.shape[1], z.shape[1]), z.new_zeros(z.shape[1])
                z = z - shift
                gram.addmm_(z.T, z)  # type: ignore[union-attr]
                sums.add_(z.sum(dim=0))  # type: ignore[union-attr]
                n += z.shape[0]
                del z
        if gram is None or sums is None or n < 2:
            raise UsageError("cka needs at least 2 valid tokens; give longer samples or more "
                             "of them")
        matrix = cka_from_gram(gram, sums, n, widths).cpu()
        return {"cka": matrix, "n_layers": len(widths), "n_tokens": n,
                "n_samples": n_samples(data)}
