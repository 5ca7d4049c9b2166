"""The one JSON sanitiser: any result oomguard records, as plain JSON types.

Every file and ``--json`` output goes through :func:`to_jsonable`: ``nan``/``inf`` become
strings; a tensor or numpy value becomes a number or a nested list (with ``max_items``, a
larger one ``{"shape", "mean"}``); ``to_dict()`` and dataclasses give their fields; anything
else its ``str``. No torch or numpy import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any


def to_jsonable(value: Any, max_items: int | None = None) -> Any:
    """``value`` as plain JSON types."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # torch tensor, numpy array
        return _array(value, max_items)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v, max_items) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v, max_items) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_jsonable(to_dict(), max_items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable({f.name: getattr(value, f.name) for f in dataclasses.fields(value)},
                           max_items)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            return to_jsonable(item(), max_items)
    return str(value)


def _array(value: Any, max_items: int | None) -> Any:
    detach = getattr(value, "detach", None)
    if callable(detach):  # a tensor: drop autograd, bring it to the host
        value = detach().cpu()
    shape = list(value.shape)
    count = math.prod(shape)
    if count == 1:
        return to_jsonable(value.reshape(()).item() if shape else value.item())
    if max_items is not None and count > max_items:
        mean = value.double().mean() if callable(detach) else value.astype("float64").mean()
        return {"shape": shape, "mean": to_jsonable(float(mean))}
    return to_jsonable(value.tolist())


def stable_hash(value: Any) -> str:
    """A short, stable hash of ``value`` (a model config, a job task, a size-cache key):
    SHA-256 of its sanitised, key-sorted, one-line JSON (for plain dicts of strings and
    numbers, ``json.dumps(value, sort_keys=True)``: keys written before stay valid)."""
    return hashlib.sha256(json_text(value, indent=None).encode("utf-8")).hexdigest()[:16]


def json_text(value: Any, *, indent: int | None = 2) -> str:
    """``value`` as JSON text: sanitised, keys sorted, UTF-8 kept; a newline at the end
    when indented (a file), none when ``indent`` is None (one journal line)."""
    text = json.dumps(to_jsonable(value), indent=indent, sort_keys=True, ensure_ascii=False,
                      allow_nan=False)
    return text + "\n" if indent is not None else text
