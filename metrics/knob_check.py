"""Is a memory knob really memory-only? The metric run at two sizes of the knob (its minimum
and the next size up) on the first 3 rows of the data, and the two results compared: the same
keys and shapes, every number within the model's precision (:data:`TOLERANCE`). A mean of
per-chunk means, a dropped remainder or other keys when chunked would make a search pick a size
that changes the answer. Jobs and ``oomguard search`` call :func:`require_memory_knobs` first;
``oomguard metrics --check`` prints every verdict. Verdicts are kept per process and model.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from oomguard.engine.core.memory.oom import is_oom
from oomguard.engine.errors import UsageError
from oomguard.engine.util.jsonable import stable_hash
from oomguard.metrics.base import Metric, get_metric
from oomguard.metrics.workload import MetricTrial, largest_useful

__all__ = ["KnobVerdict", "check_memory_knobs", "check_trial", "compare_results",
           "require_memory_knobs"]

ROWS = 3  # rows of the slice: at size 2 the pieces are uneven (2 + 1), as real data's often are
# (rtol, atol) by the model's precision: float rounding of a sum reordered by chunking
TOLERANCE = {"low": (2e-2, 1e-3), "full": (1e-4, 1e-6)}
OK, DIFFERS, UNCHECKED = "ok", "differs", "unchecked"

# model -> {(metric, knob, params): verdict}; a model that is freed takes its verdicts with it
_SEEN: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[str, str, str], KnobVerdict]] = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True)
class KnobVerdict:
    """Whether memory knob ``knob`` of ``metric`` left the result alone: ``status`` ``ok``,
    ``differs`` (``key``: the first that differed; ``detail``: how) or ``unchecked`` (``detail``:
    why), at ``sizes`` (items) on ``rows`` rows; ``max_abs_diff``: the largest difference."""

    metric: str
    knob: str
    status: str
    sizes: tuple[int, int] | None = None
    rows: int = 0
    key: str | None = None
    max_abs_diff: float | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status != DIFFERS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line: ``metric.knob: ok (...)`` or ``metric.knob: differs: key 'x', ...``."""
        where = (f"{self.knob}={self.sizes[0]} and {self.knob}={self.sizes[1]} on {self.rows} rows"
                 if self.sizes else "")
        diff = f", max abs diff {self.max_abs_diff:.3g}" if self.max_abs_diff is not None else ""
        if self.status == OK:
            return f"{self.metric}.{self.knob}: ok ({where}{diff})"
        if self.status == UNCHECKED:
            return f"{self.metric}.{self.knob}: unchecked ({self.detail})"
        return (f"{self.metric}.{self.knob}: differs: key {self.key!r} ({self.detail}) between "
                f"{where}{diff}")


def check_memory_knobs(metric: Metric, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                       params: Mapping[str, Any] | None = None, *,
                       knobs: Iterable[str] | None = None, rows: int = ROWS) -> list[KnobVerdict]:
    """A verdict for each memory knob of ``metric`` (or those in ``knobs``), run unbudgeted on
    the first ``rows`` rows of ``data``, other knobs at ``params``; an OOM leaves it unchecked."""
    full = metric.validate(dict(params or {}))
    names = [k.name for k in metric.memory_knobs()] if knobs is None else list(knobs)
    piece = {k: v[:rows] for k, v in data.items()}
    n = int(next(iter(piece.values())).shape[0]) if piece else 0
    seen = _SEEN.setdefault(model, {})
    out = []
    for name in names:
        key = (metric.name, name, stable_hash({**full, name: None, "rows": n}))
        if key not in seen:
            seen[key] = _check(metric, model, piece, full, name, n)
        out.append(seen[key])
    return out


def require_memory_knobs(metric: Metric, model: torch.nn.Module,
                         data: Mapping[str, torch.Tensor], params: Mapping[str, Any] | None = None,
                         *, knobs: Iterable[str] | None = None) -> list[KnobVerdict]:
    """:func:`check_memory_knobs`, refusing the first knob that changes the result: a one-line
    :class:`UsageError` naming the metric, the knob, the sizes and the key that differed."""
    verdicts = check_memory_knobs(metric, model, data, params, knobs=knobs)
    for v in verdicts:
        if not v.ok:
            raise UsageError(
                f"metric {v.metric!r}: memory knob {v.knob!r} changes the result (key {v.key!r}: "
                f"{v.detail}, between {v.knob}={v.sizes[0]} and {v.knob}={v.sizes[1]} on "
                f"{v.rows} rows): a memory knob must not change the result beyond float "
                "rounding; declare it a result knob, or combine the pieces exactly")
    return verdicts


def check_trial(trial: MetricTrial, knobs: Iterable[str]) -> list[KnobVerdict]:
    """:func:`require_memory_knobs` for ``knobs`` on the model and data ``trial`` (an
    ``oomguard search`` workload) builds, its fixed ``params`` for the other knobs. Picklable,
    for a child of an isolated search (its parent builds no model)."""
    model, data = trial.built()
    return require_memory_knobs(get_metric(trial.metric), model, data, trial.params, knobs=knobs)


def _sizes(metric: Metric, knob: str, params: Mapping[str, Any], rows: int,
           config: Any) -> tuple[int, int] | None:
    """The knob's minimum and the next size up (2 for a minimum of 1), at most its largest
    useful size on ``rows`` rows; None where only one size exists."""
    low = max(1, int(next(k.minimum for k in metric.knobs if k.name == knob)))
    high = max(low + 1, 2)
    cap, _ = largest_useful(metric, knob, params, rows, config)
    return None if cap is not None and high > cap else (low, high)


def _check(metric: Metric, model: torch.nn.Module, piece: Mapping[str, torch.Tensor],
           params: Mapping[str, Any], knob: str, rows: int) -> KnobVerdict:
    sizes = _sizes(metric, knob, params, rows, getattr(model, "config", None))
    if sizes is None:
        return KnobVerdict(metric.name, knob, UNCHECKED, rows=rows,
                           detail=f"only one size runs on {rows} rows")
    results = []
    for size in sizes:
        try:
            with torch.enable_grad():
                results.append(metric.run(model, piece, **{**params, knob: size}))
        except Exception as exc:  # noqa: BLE001 - only an OOM is absorbed; the rest re-raised
            if not is_oom(exc):
                raise
            return KnobVerdict(metric.name, knob, UNCHECKED, sizes, rows,
                               detail=f"out of memory at {knob}={size} on {rows} rows")
    low = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    rtol, atol = TOLERANCE["low" if low in (torch.bfloat16, torch.float16) else "full"]
    key, detail, diff = compare_results(results[0], results[1], rtol=rtol, atol=atol)
    return KnobVerdict(metric.name, knob, OK if key is None else DIFFERS, sizes, rows, key,
                       diff, detail)


def compare_results(a: Any, b: Any, *, rtol: float = 1e-4, atol: float = 1e-6
                    ) -> tuple[str | None, str, float | None]:
    """``(first key that differs or None, how, largest absolute difference)`` of two metric
    results (dicts of tensors, numbers and strings, nested; ``params`` left out): keys and
    shapes must match, numbers agree within ``rtol``/``atol`` (NaN equals NaN)."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    only = sorted(set(flat_a) ^ set(flat_b))
    first = (only[0], "present at one size only") if only else None
    worst: float | None = None
    for key in [k for k in flat_a if k in flat_b]:
        why, diff = _leaf_diff(flat_a[key], flat_b[key], rtol, atol)
        if diff is not None:
            worst = diff if worst is None else max(worst, diff)
        if why and first is None:
            first = (key, why)
    return (first[0], first[1], worst) if first else (None, "", worst)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not prefix and k == "params":
                continue
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def _numbers(value: Any) -> torch.Tensor | None:
    """``value`` (a tensor, a number, a list of numbers) as a CPU tensor; None for anything
    else (strings, booleans), which are compared by equality."""
    if isinstance(value, bool) or isinstance(value, str):
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _leaf_diff(a: Any, b: Any, rtol: float, atol: float) -> tuple[str, float | None]:
    """``(how a and b differ, '' if they agree; their largest absolute difference)``."""
    ta, tb = _numbers(a), _numbers(b)
    if ta is None or tb is None:
        return ("" if a == b else f"{a!r} != {b!r}"[:200]), None
    if ta.shape != tb.shape:
        return f"shape {list(ta.shape)} != {list(tb.shape)}", None
    if ta.numel() == 0:
        return "", 0.0
    if not (ta.is_floating_point() or ta.is_complex() or tb.is_floating_point()):
        diff = float((ta.long() - tb.long()).abs().max())
        return ("" if diff == 0 else "integers differ"), diff
    fa, fb = ta.to(torch.float64), tb.to(torch.float64)
    both_nan = fa.isnan() & fb.isnan()
    delta = torch.where(both_nan, torch.zeros_like(fa), (fa - fb).abs())
    diff = float(delta.nan_to_num(nan=math.inf).max())
    close = torch.isclose(fa, fb, rtol=rtol, atol=atol, equal_nan=True).all()
    return ("" if bool(close) else f"values differ beyond rtol {rtol:g}, atol {atol:g}"), diff
