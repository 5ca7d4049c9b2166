"""The one way oomguard takes rows of a batch: a micro-batch for accumulation, a metric's chunk,
the rows an integration's search step runs."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch


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
