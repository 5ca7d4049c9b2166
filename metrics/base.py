"""What a metric is: knobs of two kinds (:class:`Knob`), a ``run``, and a registry.

A metric declares whether its result stays meaningful in bfloat16 or float16
(``tolerates_lower_precision``): only then may a job's remedy ladder lower the precision after an
OOM at the minimum sizes, and the result is flagged. It also declares whether recomputation
helps it (``recomputes``): then ``run(..., recompute=True)`` checkpoints the model's repeated
blocks (:func:`~oomguard.engine.core.recompute.checkpointed`), the same result in less memory, and
a job measures that configuration against the plain one and keeps the faster.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

import oomguard.metrics as package
from oomguard.engine.core.recompute import checkpointed, repeated_blocks
from oomguard.engine.errors import UsageError
from oomguard.metrics.padding import right_align


@dataclass(frozen=True)
class Knob:
    """One parameter of a metric, of ``kind`` ``"memory"`` (tuned by oomguard; the result must
    not depend on it beyond float rounding) or ``"result"`` (part of the question, never tuned).
    ``scales_with``: what memory grows with. ``unit``: what one unit of its granularity is (its
    size: :meth:`Metric.size_unit`; empty: every size counts). ``largest``: from the transformers
    config, the size above which it changes nothing that runs (None: unknown)."""

    name: str
    kind: Literal["memory", "result"]
    default: int | float | str  # a string only for a result knob (a two-model metric's model)
    minimum: int | float = 1
    scales_with: str = ""
    help: str = ""
    unit: str = ""
    largest: Callable[[Any], int | None] | None = None


class Metric:
    """Base of every metric: subclasses set ``name``, ``description``, ``knobs`` and
    implement :meth:`compute`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    knobs: ClassVar[tuple[Knob, ...]] = ()
    # Whether the result is still the answer with the model in bfloat16/float16. False unless
    # a metric says so: a metric of small differences or eigenvalues would be wrong, not rounded.
    tolerates_lower_precision: ClassVar[bool] = False
    # Whether checkpointing the model's repeated blocks lowers this metric's peak: one backward
    # per forward, whose saved activations are most of the memory. False unless a metric says
    # so: a double backward (Hessian-vector products) keeps the recomputed activations alive
    # until its second backward, and torch.func transforms refuse the checkpoint's hooks
    # (docs/measurements.md#recompute-for-metrics).
    recomputes: ClassVar[bool] = False

    def can_recompute(self, model: torch.nn.Module) -> bool:
        """Whether ``run(model, ..., recompute=True)`` applies: the metric :attr:`recomputes`
        and the model has repeated blocks to checkpoint."""
        return self.recomputes and bool(repeated_blocks(model))

    def memory_knobs(self) -> tuple[Knob, ...]:
        return tuple(k for k in self.knobs if k.kind == "memory")

    def result_knobs(self) -> tuple[Knob, ...]:
        return tuple(k for k in self.knobs if k.kind == "result")

    def size_unit(self, knob: str, params: Mapping[str, Any], n_samples: int) -> int:
        """The granularity of memory knob ``knob`` (items: peak memory changes only at its
        multiples) with the other knobs at ``params`` (validated) on ``n_samples`` samples."""
        return 1

    def notes(self, knob: str, params: Mapping[str, Any], n_samples: int) -> dict[str, str]:
        """Lines a report of a search of ``knob`` should carry, by title."""
        return {}

    def largest_size(self, knob: str, params: Mapping[str, Any], n_samples: int) -> int | None:
        """The size above which ``knob`` no longer changes what runs (None: no such size).
        Knobs that slice the samples are bounded by the sample count elsewhere."""
        return None

    def unsupported(self, config: Any) -> str | None:
        """Why this metric cannot run on a model with this transformers ``config`` (one
        line), or None where it can; asked before any work."""
        return None

    def check_model(self, config: Any) -> None:
        """UsageError (one line) where :meth:`unsupported` gives a reason."""
        reason = self.unsupported(config)
        if reason:
            kind = getattr(config, "model_type", None) or type(config).__name__
            raise UsageError(f"{self.name} does not support {kind} models: {reason}; "
                             "choose another model or metric")

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Fill defaults; raise UsageError (one line, listing valid knobs) on bad input."""
        known = {k.name: k for k in self.knobs}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise UsageError(f"unknown knob(s) {', '.join(unknown)} for metric {self.name!r}: "
                             f"use one of {', '.join(known) or '(none)'}")
        out = {k.name: k.default for k in self.knobs}
        for key, value in params.items():
            knob = known[key]
            if isinstance(knob.default, str):
                if not isinstance(value, str) or not value:
                    raise UsageError(f"{self.name}.{key} must be a non-empty string, "
                                     f"got {value!r}; give one")
                out[key] = value
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{self.name}.{key} must be a number, got {value!r}; "
                                 "give one such as 0.5")
            if isinstance(knob.default, int) and not isinstance(value, int):
                raise UsageError(f"{self.name}.{key} must be an integer, got {value!r}; "
                                 "give a whole number")
            if value < knob.minimum:
                raise UsageError(
                    f"{self.name}.{key} must be >= {knob.minimum}, got {value!r} (knobs of "
                    f"{self.name}: {', '.join(f'{k.name} >= {k.minimum}' for k in self.knobs)}); "
                    f"give {knob.minimum} or more")
            out[key] = value
        return out

    def run(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor], *,
            recompute: bool = False, **params: Any) -> dict:
        """Validate ``params`` and compute the metric on ``data`` right-aligned
        (:func:`~oomguard.metrics.padding.right_align`). Returns a dict of results (tensors
        or floats) with the result knobs used as ``params``. ``recompute``: with the model's
        repeated blocks checkpointed (only for a metric that :attr:`recomputes`); the result is
        the same up to float rounding."""
        full = self.validate(params)
        self.check_model(getattr(model, "config", None))
        if recompute and not self.recomputes:
            raise UsageError(f"{self.name} does not gain from recomputation (recompute=True); "
                             "run it plain")
        with checkpointed(model) if recompute else contextlib.nullcontext():
            result = self.compute(model, right_align(data), **full)
        result["params"] = {k.name: full[k.name] for k in self.result_knobs()}
        return result

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                **params: Any) -> dict:
        raise NotImplementedError

    def summary(self, result: Mapping[str, Any]) -> dict[str, Any]:
        """A few JSON-friendly figures of a result, for reports."""
        out: dict[str, Any] = {}
        for key, value in result.items():
            if isinstance(value, torch.Tensor):
                out[key] = value.item() if value.numel() == 1 else {
                    "shape": list(value.shape), "mean": value.double().mean().item()}
            elif isinstance(value, (int, float, str)):
                out[key] = value
        return out


METRICS: dict[str, Metric] = {}


def register(cls: type[Metric]) -> type[Metric]:
    """Class decorator: add a metric to the registry under its ``name``."""
    METRICS[cls.name] = cls()
    return cls


def load_all() -> dict[str, Metric]:
    """Import every module of the ``metrics`` package so each registers itself (lazily,
    so that ``import oomguard.metrics.train_step`` does not pay for captum)."""
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"oomguard.metrics.{info.name}")
    return METRICS


def get_metric(name: str) -> Metric:
    """The metric called ``name``; UsageError listing the valid names otherwise."""
    load_all()
    try:
        return METRICS[name]
    except KeyError:
        raise UsageError(f"unknown metric {name!r}: use one of "
                         f"{', '.join(sorted(METRICS))}") from None
