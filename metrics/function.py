"""Any function as a metric: ``@metric`` registers ``fn(model, batch, *, knobs...)`` as a
:class:`~oomguard.metrics.base.Metric` that jobs, searches and every command find by name.

``batch`` is the data right-aligned: a dict of ``input_ids``, ``attention_mask``, ``labels``
tensors ``[rows, seq_len]``. A two-model metric's second model is built once per process, in the
first model's dtype and device, on the first call (before any budget: a job, a search and the
knob check run the metric once at its smallest sizes first).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from oomguard.engine.errors import UsageError
from oomguard.metrics.base import METRICS, Knob, register
from oomguard.metrics.common import JsonMetric, iter_micro_batches, n_samples

__all__ = ["FunctionMetric", "combine_pieces", "metric", "normalise"]

COMBINES = ("concat", "sum", "mean")
SECOND_MODEL = "second_model"  # the result knob that names a two-model metric's second model
Combine = str | Callable[[list[dict[str, Any]], list[int]], Any]


def metric(name: str | None = None, *, memory: Mapping[str, int | Knob] | None = None,
           result: Mapping[str, int | float | Knob] | None = None, description: str = "",
           combine: Combine | None = None, split: str | None = None, batches: bool = False,
           models: int = 1, second_model: str | None = None,
           tolerates_lower_precision: bool = False) -> Callable[[Callable[..., Any]],
                                                                Callable[..., Any]]:
    """Register the decorated function as the metric ``name`` (default: the function's name) and
    return the function unchanged (its ``.metric`` attribute is the registered metric).

    ``memory``: memory-only knobs, ``{name: default}`` (sizes in items; minimum 1) or
    :class:`~oomguard.metrics.base.Knob`; the result must not depend on them beyond float
    rounding (oomguard checks it, :mod:`~oomguard.metrics.knob_check`). ``result``:
    result-defining knobs, never tuned. ``combine``/``split``/``batches``/``models``/
    ``second_model``: which form the function takes. By default it is called once,
    ``fn(model, batch, **knobs)``, and uses its memory knobs itself. With ``combine=``
    (``"concat"``, ``"sum"``, ``"mean"`` weighted by rows, or ``fn(results, rows)``) oomguard
    calls it on pieces of at most ``split`` rows (``split``: a memory knob, the only one by
    default) and combines their results. With ``batches=True`` it gets an iterator of those
    pieces. ``models=2`` passes a second model first, ``fn(model_a, model_b, batch, ...)``,
    built from the result knob ``second_model`` (a model spec; default the decorator's; a
    job file sets it per metric). A result may be a tensor, a numpy array, a number, a
    string, or a (nested) dict of them (:func:`normalise`). ``description``: default, the
    docstring's first line. A bad declaration is a one-line :class:`UsageError` here. Bare
    ``@metric`` (no knobs) works too."""
    if callable(name):  # @metric without parentheses
        return metric()(name)  # type: ignore[return-value]

    def register_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
        label = name or fn.__name__
        knobs = _knobs(label, memory or {}, result or {}, models, second_model)
        cut = _split(label, knobs, split, combine, batches)
        _check_signature(label, fn, knobs, cut, models)
        existing = METRICS.get(label)
        if existing is not None and type(existing).__module__.startswith("oomguard.metrics."):
            raise UsageError(f"metric name {label!r} is a built-in metric: choose another name")
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        cls = type(f"Metric_{label}", (FunctionMetric,), {
            "name": label, "knobs": knobs, "fn": staticmethod(fn), "split": cut,
            "combine": combine, "batches": batches, "models": models,
            "description": description or (doc[0] if doc else f"{fn.__name__} (a function)"),
            "tolerates_lower_precision": tolerates_lower_precision,
            "__module__": fn.__module__, "__qualname__": f"Metric_{label}"})
        register(cls)
        with contextlib.suppress(AttributeError, TypeError):  # a builtin takes no attribute
            fn.metric = METRICS[label]  # type: ignore[attr-defined]
        return fn
    return register_fn


def _knobs(label: str, memory: Mapping[str, Any], result: Mapping[str, Any], models: int,
           second_model: str | None) -> tuple[Knob, ...]:
    """The declared knobs as :class:`Knob` (memory ones first, in order); UsageError naming
    ``label`` for a bad default, a name declared twice, or a bad ``models``."""
    if models not in (1, 2):
        raise UsageError(f"metric {label!r}: models must be 1 or 2, got {models!r}; give "
                         "one of those")
    if (models == 2) != (second_model is not None):
        raise UsageError(f"metric {label!r}: models=2 needs second_model= (a model spec: the "
                         "default second model), and second_model= needs models=2: give both "
                         "or neither")
    if models == 2 and (not isinstance(second_model, str) or not second_model):
        raise UsageError(f"metric {label!r}: second_model must be a model spec (a string), "
                         f"got {second_model!r}; give one such as 'gpt2:n_layer=2'")
    knobs = [_knob(label, key, value, "memory") for key, value in memory.items()]
    knobs += [_knob(label, key, value, "result") for key, value in result.items()]
    if models == 2:
        knobs.append(Knob(SECOND_MODEL, "result", second_model, help="the second model (spec)"))
    names = [k.name for k in knobs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"metric {label!r}: knob(s) {', '.join(twice)} declared twice; "
                         "declare each once")
    if "params" in names:
        raise UsageError(f"metric {label!r}: 'params' is reserved (the result knobs used); "
                         "rename that knob")
    return tuple(knobs)


def _knob(label: str, key: str, value: Any, kind: str) -> Knob:
    if isinstance(value, Knob):
        if value.kind != kind or value.name != key:
            raise UsageError(f"metric {label!r}: knob {key!r} is declared under {kind} but is "
                             f"Knob({value.name!r}, {value.kind!r}); declare it under its "
                             "own kind")
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not isinstance(key, str) or not key.isidentifier() or not number or (
            kind == "memory" and (not isinstance(value, int) or value < 1)):
        want = "a positive integer" if kind == "memory" else "a number"
        raise UsageError(f"metric {label!r}: {kind} knob {key!r} needs {want} as its default "
                         f"(and a name that is a Python identifier), got {value!r}; give such a "
                         "default")
    # result knobs: integers (counts, seeds) from 0, other numbers unbounded
    low = 1 if kind == "memory" else 0 if isinstance(value, int) else float("-inf")
    return Knob(key, kind, value, low)  # type: ignore[arg-type]


def _split(label: str, knobs: tuple[Knob, ...], split: str | None, combine: Combine | None,
           batches: bool) -> str | None:
    """The memory knob whose size sets the rows of each piece (None: one call)."""
    memory = [k.name for k in knobs if k.kind == "memory"]
    if combine is not None and batches:
        raise UsageError(f"metric {label!r}: give combine= (oomguard combines the pieces) or "
                         "batches=True (the function does), not both")
    if combine is not None and not callable(combine) and combine not in COMBINES:
        raise UsageError(f"metric {label!r}: unknown combine {combine!r}: use "
                         f"{', '.join(COMBINES)} or a callable(results, rows)")
    if combine is None and not batches:
        if split is not None:
            raise UsageError(f"metric {label!r}: split={split!r} needs combine= (how the "
                             "pieces' results combine) or batches=True")
        return None
    if split is None and len(memory) != 1:
        raise UsageError(f"metric {label!r}: name the memory knob that sets each piece's rows "
                         f"(split=), one of {', '.join(memory) or '(none declared)'}")
    cut = split if split is not None else memory[0]
    if cut not in memory:
        raise UsageError(f"metric {label!r}: split={cut!r} is not one of its memory knobs "
                         f"({', '.join(memory) or 'none declared'})")
    return cut


def _check_signature(label: str, fn: Callable[..., Any], knobs: tuple[Knob, ...],
                     split: str | None, models: int) -> None:
    """UsageError unless ``fn`` takes ``models`` models and the data positionally and every
    knob it is given (all but ``split`` and ``second_model``) by keyword."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < models + 1 and not varargs:
        want = "model, batch" if models == 1 else "model_a, model_b, batch"
        raise UsageError(f"metric {label!r}: {fn.__name__} must take ({want}, *, knobs...); "
                         "define it that way")
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params[models + 1:]} | {
        p.name for p in params if p.kind == p.KEYWORD_ONLY}
    missing = [k.name for k in knobs if k.name not in names and k.name not in (split, SECOND_MODEL)]
    if missing:
        raise UsageError(f"metric {label!r}: {fn.__name__} takes no keyword argument "
                         f"{', '.join(missing)} (every declared knob is passed by name); add "
                         "them, or **knobs")


class FunctionMetric(JsonMetric):
    """A metric made from a function by :func:`metric` (class attributes set there)."""

    fn: Callable[..., Any]
    split: str | None = None
    combine: Combine | None = None
    batches: bool = False
    models: int = 1

    def __init__(self) -> None:
        self._second: dict[tuple[str, str, str], torch.nn.Module] = {}  # one model at most

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                **params: Any) -> dict[str, Any]:
        models: tuple[torch.nn.Module, ...] = (model,)
        if self.models == 2:
            models = (model, self.second_model(model, params[SECOND_MODEL]))
        kwargs = self._kwargs(params)
        if self.split is None:
            return normalise(self.fn(*models, data, **kwargs), self.name)
        pieces: Iterator[dict[str, torch.Tensor]] = iter_micro_batches(data, params[self.split])
        if self.batches:
            return normalise(self.fn(*models, pieces, **kwargs), self.name)
        results, rows = [], []
        for piece in pieces:
            results.append(normalise(self.fn(*models, piece, **kwargs), self.name))
            rows.append(n_samples(piece))
        return combine_pieces(results, rows, self.combine, self.name)

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`Metric.validate`, and a two-model metric's ``second_model`` resolved to a
        config (one line for a spec that names no model; no weights are loaded)."""
        out = super().validate(params)
        if self.models == 2:
            _second_config(out[SECOND_MODEL])
        return out

    def _kwargs(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The knobs the function is given: those it takes (``split`` and ``second_model``
        only where its signature names them)."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return {k: v for k, v in params.items() if k not in (self.split, SECOND_MODEL)}
        names = set(sig.parameters)
        every = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
        optional = (self.split, SECOND_MODEL)
        return {k: v for k, v in params.items()
                if k in names or (every and k not in optional)}

    def second_model(self, like: torch.nn.Module, spec: str) -> torch.nn.Module:
        """The model ``spec`` names, in ``like``'s dtype and device, built once per process."""
        from oomguard.metrics.models import build_model

        first = next(like.parameters(), None)
        dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        key = (spec, str(dtype), str(device))
        if key not in self._second:
            self._second.clear()  # the previous one is freed before the next is built
            self._second[key] = build_model(spec, dtype, device)
        return self._second[key]


@functools.lru_cache(maxsize=8)
def _second_config(spec: str) -> Any:
    """The config of a second model's spec (UsageError if it names none), once per spec."""
    from oomguard.metrics.models import model_config

    return model_config(spec)


def normalise(value: Any, name: str = "metric") -> dict[str, Any]:
    """A function's result as a metric's: a (nested) dict of detached tensors, numbers and
    strings (numpy and lists of numbers as tensors), anything but a dict as ``{"value": ...}``;
    UsageError naming ``name`` and the key for anything else."""
    out = _leaf(value, name, "value")
    if not isinstance(out, dict):
        return {"value": out}
    if "params" in out:
        raise UsageError(f"metric {name!r} returned a key 'params', which oomguard fills in "
                         "(the result knobs used): rename it")
    return out


def _leaf(value: Any, name: str, where: str) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _leaf(v, name, f"{where}.{k}" if where != "value" else str(k))
                for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (bool, int, float, str)):
        return value
    if type(value).__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(value))
        if isinstance(value, np.generic):
            return value.item()
    if isinstance(value, (list, tuple)) and value:
        items = [_leaf(v, name, f"{where}[{i}]") for i, v in enumerate(value)]
        if all(isinstance(v, torch.Tensor) for v in items):
            return torch.stack(items)
        if all(isinstance(v, (int, float)) for v in items):
            return _tensor(items)
    raise UsageError(f"metric {name!r} returned {type(value).__name__} at {where!r}: return "
                     "tensors, numpy arrays, numbers, strings, or dicts of them")


def combine_pieces(results: list[dict[str, Any]], rows: list[int], how: Combine | None,
                   name: str = "metric") -> dict[str, Any]:
    """The pieces' results (each :func:`normalise`-d, of ``rows[i]`` rows) as one: ``concat``
    (tensors along dimension 0, numbers as a 1-D tensor), ``sum``, ``mean`` (weighted by rows),
    or ``how(results, rows)``; strings must agree. Sums are taken in float64 and cast back."""
    if callable(how):
        return normalise(how(results, rows), name)
    return _combine(results, rows, how or "concat", name, "")


def _combine(values: list[Any], rows: list[int], how: str, name: str, where: str) -> Any:
    first = values[0]
    if isinstance(first, dict):
        keys = list(first)
        if any(not isinstance(v, dict) or list(v) != keys for v in values):
            raise UsageError(f"metric {name!r}: its pieces returned different keys"
                             f"{f' under {where!r}' if where else ''}; combine needs the same "
                             "keys from every piece: return them")
        return {k: _combine([v[k] for v in values], rows, how, name, f"{where}.{k}".lstrip("."))
                for k in keys}
    if isinstance(first, str) or isinstance(first, bool):
        if any(v != first for v in values):
            raise UsageError(f"metric {name!r}: {where!r} differs between pieces ({first!r}, ...)"
                             f"; it cannot be combined by {how}: return the same value from "
                             "every piece")
        return first
    tensors = [v if isinstance(v, torch.Tensor) else _tensor(v) for v in values]
    if how == "concat":
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in tensors])
    floating = tensors[0].is_floating_point()
    wide = [t.to(torch.float64) if floating else t for t in tensors]
    total = sum(t * (r if how == "mean" else 1) for t, r in zip(wide, rows, strict=True))
    if how == "mean":
        total = total / sum(rows)
    out = total.to(tensors[0].dtype) if floating else total
    return out if isinstance(first, torch.Tensor) else out.item()


def _tensor(numbers: Any) -> torch.Tensor:
    """Python numbers as a tensor: float64 where any is a float (torch's default float32
    would round them), else int64."""
    flat = numbers if isinstance(numbers, list) else [numbers]
    wide = any(isinstance(x, float) for x in flat)
    return torch.tensor(numbers, dtype=torch.float64 if wide else torch.int64)
