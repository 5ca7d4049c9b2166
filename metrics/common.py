"""Shared pieces of every metric: micro-batches, token counts, exact losses, parameter groups.
Sums over micro-batches are float64, divided by the whole data's token count at the end, so a
result does not depend on the memory knobs; logits are up-cast to float32 before the log-softmax.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from oomguard.engine.errors import UsageError, check_positive_int
from oomguard.engine.util.jsonable import to_jsonable
from oomguard.engine.util.rows import slice_rows
from oomguard.metrics.base import Metric

IGNORE_INDEX = -100
LOW_PRECISION = (torch.bfloat16, torch.float16)
# a dotted name up to its first all-digit part: the numbered block a parameter is under
_BLOCK = re.compile(r"^(?:[^.]*\.)*?\d+(?=\.|$)")

Batch = Mapping[str, torch.Tensor]


def n_samples(data: Batch) -> int:
    """Number of samples (rows along dim 0) of a data dict."""
    return int(data["input_ids"].shape[0])


def iter_micro_batches(data: Batch, size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive slices of every tensor of ``data`` of at most ``size`` samples (dim 0),
    covering every sample once, in order."""
    check_positive_int("micro-batch size", size)
    for start in range(0, n_samples(data), size):
        yield slice_rows(data, start, start + size)


def labels_of(batch: Batch) -> torch.Tensor:
    """Unshifted labels ``[n, L]`` of a batch (``labels``, else ``input_ids``), ``-100`` where
    nothing is scored: a position and the one before it must both be valid."""
    labels = batch["labels"] if batch.get("labels") is not None else batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is None:
        return labels
    valid = mask != 0
    scored = torch.cat([valid[:, :1], valid[:, 1:] & valid[:, :-1]], dim=1)
    return labels.masked_fill(~scored, IGNORE_INDEX)


def tokens_per_sample(batch: Batch) -> torch.Tensor:
    """Scored tokens of each sample, shape ``[n]`` (int64): the labels a causal LM predicts
    (``labels_of(batch)[:, 1:]``) that are not ``-100``."""
    return (labels_of(batch)[:, 1:] != IGNORE_INDEX).sum(dim=1)


def token_count(batch: Batch) -> int:
    return int(tokens_per_sample(batch).sum())


def total_tokens(data: Batch) -> int:
    """Scored tokens of the whole data; UsageError if there are none."""
    n = token_count(data)
    if n <= 0:
        raise UsageError("the data has no scored tokens (every shifted label is -100); "
                         "give samples with labels")
    return n


def attention_mask(batch: Batch) -> torch.Tensor:
    """The batch's ``attention_mask``, all ones (every token valid) where it has none."""
    mask = batch.get("attention_mask")
    return torch.ones_like(batch["input_ids"]) if mask is None else mask


def valid_tokens(batch: Batch) -> torch.Tensor:
    """Valid (``attention_mask != 0``) tokens of each sample, shape ``[n]`` (int64)."""
    return (attention_mask(batch) != 0).sum(dim=1)


def select_samples(batch: Batch, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """The samples of ``batch`` where the boolean ``keep [n]`` is true, every tensor alike (a
    shallow copy where it is true for all)."""
    if bool(keep.all()):
        return dict(batch)
    rows = keep.nonzero().squeeze(1)
    return {key: value[rows.to(value.device)] for key, value in batch.items()}


def expand_rows(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-sample ``values`` of the kept samples back at their rows of all ``len(keep)``
    samples; NaN on the rows of samples that were left out (their value is undefined)."""
    out = torch.full((keep.shape[0], *values.shape[1:]), float("nan"), dtype=values.dtype,
                     device=values.device)
    out[keep.to(values.device)] = values
    return out


def scored_samples(batch: Batch) -> dict[str, torch.Tensor] | None:
    """The samples of ``batch`` with a scored token (None if none has): the others add nothing
    and must not run (all-masked attention rows are NaN in float64 models)."""
    keep = tokens_per_sample(batch) > 0
    return select_samples(batch, keep) if bool(keep.any()) else None


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """The model's inputs of a batch (``input_ids`` and, if present, ``attention_mask``)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask") if batch.get(k) is not None}


def logits_nll(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Per-token NLL (nats, float64) of ``logits [.., L, V]`` against *unshifted* ``labels
    [.., L]`` (position ``t`` predicts label ``t+1``; ``-100`` skipped): ``reduction="sum"``
    a scalar, ``"none"`` shaped like ``labels[.., 1:]`` with zeros at ignored positions."""
    if logits.dtype in LOW_PRECISION:
        logits = logits.float()
    shift_logits = logits[..., :-1, :]
    shift_labels = labels[..., 1:]
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                          shift_labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    nll = nll.to(torch.float64).reshape(shift_labels.shape)
    return nll.sum() if reduction == "sum" else nll


def token_nll_sum(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed per-token NLL (nats) of ``batch`` under ``model``: a differentiable float64
    scalar; only :func:`scored_samples` run (none: an exact 0)."""
    scored = scored_samples(batch)
    if scored is None:
        return torch.zeros((), dtype=torch.float64, device=batch["input_ids"].device)
    logits = model(**model_inputs(scored)).logits
    return logits_nll(logits, labels_of(scored))


def nll_sum(model: torch.nn.Module, data: Batch, micro_batch_size: int) -> float:
    """Summed per-token NLL (nats) of all ``data``, without gradients, ``micro_batch_size``
    samples per forward."""
    with torch.no_grad():
        return float(sum(token_nll_sum(model, mb).cpu()
                         for mb in iter_micro_batches(data, micro_batch_size)))


def token_weighted_sum(model: torch.nn.Module, data: Batch, micro_batch_size: int,
                       per_batch: Callable[[Batch, list[torch.Tensor]], Sequence[Any]],
                       params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum ``per_batch(mb, params)`` (one tensor or None per parameter, summed over the
    micro-batch's tokens) over the :func:`scored_samples` of each micro-batch in float64,
    divided by the total tokens."""
    n_tok = total_tokens(data)
    acc = [torch.zeros(p.shape, dtype=torch.float64, device=p.device) for p in params]
    for mb in iter_micro_batches(data, micro_batch_size):
        scored = scored_samples(mb)
        if scored is None:
            continue
        for a, g in zip(acc, per_batch(scored, params), strict=True):
            if g is not None:
                a.add_(g.to(torch.float64))
    return [a.div_(n_tok) for a in acc]


def mean_loss_grad(model: torch.nn.Module, data: Batch, micro_batch_size: int,
                   params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradient of the token-weighted mean loss over all ``data``, one float64 tensor per
    parameter (:func:`token_weighted_sum`); ``model``'s ``.grad`` fields are not touched."""
    def grad(mb: Batch, ps: list[torch.Tensor]) -> Sequence[Any]:
        return torch.autograd.grad(token_nll_sum(model, mb), ps, allow_unused=True)

    return token_weighted_sum(model, data, micro_batch_size, grad, params)


def mean_loss_hvp(model: torch.nn.Module, data: Batch, micro_batch_size: int,
                  vec: Sequence[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Hessian-vector product ``H v`` of the token-weighted mean loss over all ``data``:
    ``vec`` has one tensor per parameter; a double backward per micro-batch, reduced by
    :func:`token_weighted_sum`."""
    v = [x.to(p.dtype) for x, p in zip(vec, params, strict=True)]

    def hvp(mb: Batch, ps: list[torch.Tensor]) -> Sequence[Any]:
        grads = torch.autograd.grad(token_nll_sum(model, mb), ps, create_graph=True,
                                    allow_unused=True)
        dot = sum((g * x).sum() for g, x in zip(grads, v, strict=True) if g is not None)
        return torch.autograd.grad(dot, ps, allow_unused=True)

    return token_weighted_sum(model, data, micro_batch_size, hvp, params)


def trainable(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters that require grad, in ``named_parameters`` order (tied weights once)."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


def group_name(param_name: str) -> str:
    """The group of a parameter, from its dotted name: the numbered block it is under
    (``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``), else the module that
    owns it (``transformer.wte``, ``model.norm``, ``lm_head``)."""
    block = _BLOCK.match(param_name)
    return block[0] if block else param_name.rpartition(".")[0] or param_name


def param_groups(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Trainable parameters grouped by :func:`group_name`, in model order:
    ``{group: [(param_name, param), ...]}``, tied weights once (as ``named_parameters``)."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(group_name(name), []).append((name, p))
    return groups


SUMMARY_MAX_ITEMS = 64  # tensors with more elements are summarised as {"shape", "mean"}


class JsonMetric(Metric):
    """A :class:`~oomguard.metrics.base.Metric` whose :meth:`summary` is the one JSON
    sanitiser's copy of the result, tensors over ``SUMMARY_MAX_ITEMS`` elements summarised."""

    def summary(self, result: Mapping[str, Any]) -> dict[str, Any]:
        return to_jsonable(dict(result), SUMMARY_MAX_ITEMS)
