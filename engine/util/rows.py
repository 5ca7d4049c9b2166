"""The one way oomguard takes rows of a batch: a micro-batch for accumulation, a metric's chunk,
the rows an integration's search step runs; and the one way it splits an effective batch into
micro-batches (:func:`micro_batches`: accumulation, the integrations, the remedies' pricing)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from oomguard.engine.errors import check_positive_int


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` (dim 0) of every tensor in ``batch`` (nested mappings, tuples and
    lists of them), as views; other values and 0-d tensors are kept, and a dict subclass
    keeps its type where it can be built from a dict."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        out = {k: slice_rows(v, start, stop) for k, v in batch.items()}
        if type(batch) is not dict:
            with contextlib.suppress(TypeError):
                return type(batch)(out)
        return out
    if isinstance(batch, (tuple, list)):
        parts = [slice_rows(v, start, stop) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


def micro_batches(rows: int, most: int, equal: bool = False) -> list[int]:
    """How ``rows`` (a batch; for a training step, its effective batch) run when at most ``most``
    rows fit in one forward and backward: the rows of each micro-batch, largest first. The
    fewest micro-batches that fit, ``ceil(rows / most)``, as equal as the rows allow (sizes
    differ by one row at most): 64 rows where 37 fit run as 32 + 32, not 37 + 27 (the same
    passes, a lower peak, and faster: measured, docs/measurements.md#unequal-micro-batches).
    With ``equal``, every micro-batch has the same rows: the largest divisor of ``rows`` at or
    below ``most`` (for a loop that cannot run unequal ones; 97 rows: 97 of 1)."""
    check_positive_int("rows", rows)
    check_positive_int("most", most)
    if equal:
        size = max(d for d in range(1, min(rows, most) + 1) if rows % d == 0)
        return [size] * (rows // size)
    count = -(-rows // most)
    base, extra = divmod(rows, count)
    return [base + 1] * extra + [base] * (count - extra)
