"""The one JSON sanitiser: any result oomguard records, as plain JSON types; and the one
reader of the JSON files it wrote (:func:`read_json`), which refuses hostile nesting.

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
from pathlib import Path
from typing import Any

# Nesting levels a JSON file oomguard reads may have. What it writes nests under 20 (a cache
# entry's trials, a summary's groups); deeper text is not ours, and Python's json parser (and
# every recursive walk after it: the sanitiser, a hash, the next write) would raise
# RecursionError near 1000 levels, or sooner deep in a task's stack
# (docs/measurements.md#hostile-files).
MAX_JSON_DEPTH = 100


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


class JSONTooDeep(ValueError):
    """JSON text nested deeper than :data:`MAX_JSON_DEPTH` (a ValueError, as a JSON syntax
    error is: every reader handles the two alike)."""


def parse_json(text: str | bytes) -> Any:
    """``text`` (bytes: UTF-8) as JSON; a :class:`ValueError` for text that is not UTF-8 or
    not JSON, and :class:`JSONTooDeep` for arrays and objects nested deeper than
    :data:`MAX_JSON_DEPTH` levels (checked without recursion, so it cannot itself overflow)."""
    try:
        value = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except RecursionError:
        raise JSONTooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    # The arrays and objects one level down at a time (``[]`` is one level).
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(MAX_JSON_DEPTH):
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)
                 if isinstance(child, (dict, list))]
        if not level:
            return value
    raise JSONTooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels")


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON file at ``path`` (:func:`parse_json`): an :class:`OSError` where it cannot be
    read, a :class:`ValueError` where it is not JSON or nests too deep."""
    return parse_json(Path(path).read_bytes())
