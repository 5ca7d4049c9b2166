"""``integrated_gradients``: token attribution with captum's ``LayerIntegratedGradients``.

The target, one scalar per sample: the log-probability (nats) of each sample's *last valid token*
given everything before it (the usual "which input tokens explain this prediction" question; one
number per sample for the completeness check). The path runs from the baseline token's embedding
(:func:`pad_id`) at every position to the real embeddings, ``method="gausslegendre"`` over
``n_steps`` points; attributions are summed over the hidden dimension (float64 on output).

One captum forward gets :func:`rows_per_forward` rows, so ``internal_batch_size`` changes memory
only at multiples of ``min(chunk_size, samples left)`` (its ``Knob.unit``; measured with forward
hooks) and nothing above that times ``n_steps``. The convergence delta per sample is
``sum(attributions) - (f(x) - f(baseline))``, reported as its absolute max and mean (nats).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from oomguard.engine.errors import UsageError
from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import (
    JsonMetric,
    attention_mask,
    expand_rows,
    iter_micro_batches,
    n_samples,
    select_samples,
    valid_tokens,
)

METHOD = "gausslegendre"
# attribute_to(layer): :func:`attribute` of one chunk to ``layer``'s output
AttributeTo = Callable[[torch.nn.Module], tuple[torch.Tensor, torch.Tensor]]


def rows_per_forward(chunk: int, internal: int, n_steps: int | None = None) -> int:
    """Rows of one forward pass inside captum for ``chunk`` examples per call: captum's
    ``_batch_attribution`` runs ``max(1, internal // chunk)`` steps per forward, each a copy
    of all ``chunk`` examples, and never more than ``n_steps`` steps."""
    if chunk <= 0 or internal <= 0:
        raise ValueError(f"chunk and internal must be positive, got {chunk}, {internal}")
    steps = max(1, internal // chunk)
    return chunk * (steps if n_steps is None else min(steps, n_steps))


def pad_id(model: torch.nn.Module) -> int:
    """Token id of the baseline: ``pad_token_id``, else ``eos_token_id``, else 0; an id
    outside the embedding table (GPT-2's 50256 with a smaller vocabulary) is skipped."""
    cfg = getattr(model, "config", None)
    vocab = model.get_input_embeddings().num_embeddings
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(cfg, key, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int) and 0 <= value < vocab:
            return value
    return 0


def _needs(min_valid: int) -> str:
    return ("2 valid tokens for a next-token target" if min_valid == 2
            else f"{min_valid} valid token(s)")


def last_positions(attention_mask: torch.Tensor, min_valid: int = 2) -> torch.Tensor:
    """Index of each row's last valid (mask 1) position; UsageError if a row has fewer
    than ``min_valid`` valid tokens (2 for a next-token target, the default)."""
    mask = attention_mask.long()
    if bool((mask.sum(dim=1) < min_valid).any()):
        raise UsageError(f"every sample needs at least {_needs(min_valid)}; give "
                         "longer samples")
    pos = torch.arange(mask.shape[1], device=mask.device)
    return (mask * (pos + 1)).argmax(dim=1)


def defined_samples(data: Mapping[str, torch.Tensor],
                    min_valid: int = 2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Which samples have at least ``min_valid`` valid tokens (bool ``[n]``, CPU), and the data of
    just those samples: a per-sample metric is undefined on the others, which it reports as NaN rows
    (:func:`~oomguard.metrics.common.expand_rows`). UsageError if no sample qualifies."""
    keep = (valid_tokens(data) >= min_valid).cpu()
    if not bool(keep.any()):
        raise UsageError(f"no sample has {_needs(min_valid)}: give data with longer samples")
    return keep, select_samples(data, keep)


def target_forward(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """captum forward ``f(input_ids, attention_mask, pred_pos, target_ids) -> [rows]``: the
    log-probability of ``target_ids`` at ``pred_pos`` (log-softmax in float32 at least)."""

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, pred_pos: torch.Tensor,
                target_ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        rows = torch.arange(logits.shape[0], device=logits.device)
        picked = logits[rows, pred_pos]
        picked = picked.to(torch.promote_types(picked.dtype, torch.float32))  # up-cast low precision
        return torch.log_softmax(picked, dim=-1)[rows, target_ids]

    return forward


def target_args(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """captum ``additional_forward_args`` for :func:`target_forward`: mask, position, token."""
    mask = attention_mask(batch)
    last = last_positions(mask)
    return mask, last - 1, batch["input_ids"].gather(1, last[:, None]).squeeze(1)


def attribute(layer: torch.nn.Module, *, forward: Callable[..., torch.Tensor],
              ids: torch.Tensor, args: tuple[torch.Tensor, ...], base_id: int, n_steps: int,
              internal_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """captum's attributions of ``forward`` to ``layer``'s output along the path from
    all-``base_id`` to ``ids`` (float64, detached), and its convergence delta per sample
    (``[rows]``, float64)."""
    from captum.attr import LayerIntegratedGradients  # why: captum loads only for its metrics

    with warnings.catch_warnings():  # captum's expected warning: internal_batch_size < examples
        warnings.filterwarnings("ignore", message="Internal batch size cannot be less")
        attr, delta = LayerIntegratedGradients(forward, layer).attribute(
            ids, baselines=torch.full_like(ids, base_id), additional_forward_args=args,
            n_steps=n_steps, method=METHOD, internal_batch_size=internal_batch_size,
            return_convergence_delta=True)
    return attr.detach().to(torch.float64), delta.detach().to(torch.float64).reshape(-1)


def captum_knobs(chunk_default: int) -> tuple[Knob, ...]:
    """The knobs every captum metric has: integration steps (result) and two memory knobs."""
    return (
        Knob("n_steps", "result", 16, 2, "", "integration points (gauss-legendre)"),
        Knob("chunk_size", "memory", chunk_default, 1,
             "rows_per_forward(chunk, internal) x seq_len x model width",
             "examples per captum call; results are concatenated"),
        Knob("internal_batch_size", "memory", 8, 1,
             "rows_per_forward(chunk, internal); only matters while > chunk_size",
             "captum's internal_batch_size (splits the integration steps)",
             unit="examples per captum call, min(chunk_size, samples)"),
    )


class CaptumMetric(JsonMetric):
    """A metric built on captum's attributions, with the knobs of :func:`captum_knobs`."""

    # No: bfloat16 gradients along the path would break the completeness check.
    tolerates_lower_precision = False
    # Yes: one forward and one backward per captum batch, whose activations (rows x steps)
    # are most of the peak; checkpointed blocks keep one block's at a time
    # (docs/measurements.md#recompute-for-metrics).
    recomputes = True

    def size_unit(self, knob: str, params: Mapping[str, Any], n_samples: int) -> int:
        if knob != "internal_batch_size":
            return 1
        return max(1, min(int(params["chunk_size"]), n_samples))

    def notes(self, knob: str, params: Mapping[str, Any], n_samples: int) -> dict[str, str]:
        other = "internal_batch_size" if knob == "chunk_size" else "chunk_size"
        out = {"knob interaction": (
            "captum runs chunk_size x max(1, internal_batch_size // chunk_size) rows per "
            "forward, so internal_batch_size only changes memory at multiples of "
            "min(chunk_size, samples), and nothing above that times n_steps; this search "
            f"varies {knob} with {other}={params[other]}")}
        unit = self.size_unit(knob, params, n_samples)
        if unit > 1:
            out["granularity"] = (f"{knob} was searched in multiples of {unit} (examples per "
                                  "captum call); sizes between two multiples use the memory "
                                  "of the one above")
        return out

    def largest_size(self, knob: str, params: Mapping[str, Any], n_samples: int) -> int | None:
        # internal_batch_size: examples x n_steps, every step in one forward
        if knob != "internal_batch_size":
            return None
        return self.size_unit(knob, params, n_samples) * int(params["n_steps"])

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor], *,
                n_steps: int, chunk_size: int, internal_batch_size: int) -> dict[str, Any]:
        """:meth:`attribute_chunk`'s tensors over every chunk (NaN rows for the samples left
        out), with the convergence deltas' absolute max and mean."""
        forward, base_id = target_forward(model), pad_id(model)
        keep, work = defined_samples(data)
        parts: dict[str, list[torch.Tensor]] = {}
        for mb in iter_micro_batches(work, chunk_size):
            args = target_args(mb)
            attribute_to = functools.partial(
                attribute, forward=forward, ids=mb["input_ids"], args=args, base_id=base_id,
                n_steps=n_steps, internal_batch_size=internal_batch_size)
            for key, value in self.attribute_chunk(model, attribute_to, args[0]).items():
                parts.setdefault(key, []).append(value)
        delta_all = torch.cat(parts.pop("delta")).cpu()
        return {**{key: expand_rows(torch.cat(v).cpu(), keep) for key, v in parts.items()},
                "delta": expand_rows(delta_all, keep),
                "delta_max": float(delta_all.abs().max()),
                "delta_mean": float(delta_all.abs().mean()),
                "baseline_token": base_id, "method": METHOD, "n_samples": n_samples(data),
                "n_samples_attributed": int(keep.sum())}

    def attribute_chunk(self, model: torch.nn.Module,
                        attribute_to: AttributeTo, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """One chunk's per-sample tensors by name, its convergence deltas as ``"delta"``;
        ``valid`` is the chunk's attention mask."""
        raise NotImplementedError


@register
class IntegratedGradients(CaptumMetric):
    name = "integrated_gradients"
    description = ("token attribution (LayerIntegratedGradients on the input embeddings) of the "
                   "last valid token's log-probability, with completeness delta")
    knobs = captum_knobs(chunk_default=128)  # the seed's ig_chunk_size

    def attribute_chunk(self, model: torch.nn.Module,
                        attribute_to: AttributeTo, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        attr, delta = attribute_to(model.get_input_embeddings())
        return {"attributions": attr.sum(dim=-1) * valid.to(torch.float64), "delta": delta}
