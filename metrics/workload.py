"""``MetricTrial``: one metric at one memory knob, as a searchable, picklable workload
(``search(MetricTrial("fisher_diagonal"), budget=...)``); :class:`InUnits` makes any strategy
propose only multiples of a knob's granularity.

The metric's result is defined by the padded data (``make_batch``: seeded lengths in
``[seq_len/2, seq_len]``); a trial's memory by the worst case, every sample at ``seq_len``, since
a metric may skip padded positions or whole samples. Trial values are the metric on the worst case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from oomguard.engine.core.search.strategies import why_chosen
from oomguard.engine.core.search.trial import SAMPLE_KNOBS
from oomguard.engine.core.workload import RebuiltInChild, replays_workspace
from oomguard.engine.errors import UsageError, check_positive_int
from oomguard.metrics.base import Metric, get_metric
from oomguard.metrics.models import make_batch, model_config, model_modules
from oomguard.metrics.train_step import build_for


def largest_useful(metric: Metric, knob: str, params: Mapping[str, Any], n_samples: int,
                   config: Any) -> tuple[int | None, str]:
    """``(size, what sets it)``: the size above which ``knob`` changes nothing that runs
    (``samples`` for knobs that slice them, else ``largest useful size``), other knobs at
    ``params``, for ``config``; ``(None, "")`` where there is none."""
    if knob in SAMPLE_KNOBS:
        return n_samples, "samples"
    size = metric.largest_size(knob, params, n_samples)
    declared = next((k.largest for k in metric.knobs if k.name == knob), None)
    if size is None and declared is not None:
        size = declared(config)
    return (size, "largest useful size") if size is not None else (None, "")


@dataclass
class MetricTrial(RebuiltInChild):
    """``MetricTrial(metric, knob)(size)`` runs ``metric`` with ``knob=size`` on ``n_samples``
    generated, padded sequences of ``seq_len`` tokens (seeded by ``seed``, as are the weights).
    ``knob``: default the first memory knob; ``params`` fixes the other knobs. ``recompute``:
    the model's repeated blocks checkpointed (a metric that ``recomputes``)."""

    # Metrics catch their own exceptions (and return a placeholder): every step of a trial
    # runs with the swallowed-OOM detector (engine.core.workload.catches_own_errors).
    catches_own_errors: ClassVar[bool] = True
    metric: str
    knob: str | None = None
    model: str = "tiny-gpt2"
    dtype: str = "float32"
    device: str = "cpu"
    n_samples: int = 32
    seq_len: int = 128
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    recompute: bool = False
    _state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        metric = get_metric(self.metric)  # UsageError listing the valid metrics
        memory = [k.name for k in metric.memory_knobs()]
        if self.knob is None:
            if not memory:
                raise UsageError(f"metric {self.metric!r} has no memory knob to search; choose a "
                                 "metric with one (oomguard metrics lists them)")
            self.knob = memory[0]
        if self.knob not in memory:
            raise UsageError(f"{self.knob!r} is not a memory knob of {self.metric!r}: "
                             f"searchable knobs are {', '.join(memory) or '(none)'}; use one of them")
        if self.knob in self.params:
            raise UsageError(f"{self.knob!r} is the searched knob: do not fix it in params")
        check_positive_int("n_samples", self.n_samples)
        check_positive_int("seq_len", self.seq_len)
        metric.validate(self.params)  # unknown or bad fixed knobs fail here, not in a trial
        if self.recompute and not metric.recomputes:
            raise UsageError(f"{self.metric} does not gain from recomputation "
                             "(recompute=True); use recompute=False")
        metric.check_model(model_config(self.model))  # from the config: no weights built

    @property
    def name(self) -> str:
        """Workload name for reports and the size cache: ``metric.knob``."""
        return f"{self.metric}.{self.knob}"

    @property
    def preload(self) -> tuple[str, ...]:
        """Modules a forkserver may import before the first isolated trial."""
        return (*model_modules(self.model), "oomguard.metrics.models",
                "oomguard.metrics.common", type(get_metric(self.metric)).__module__)

    def _sizing(self) -> tuple[Metric, str, dict[str, Any]]:
        """The metric, the searched knob and the fixed knobs validated (defaults filled)."""
        assert self.knob is not None
        metric = get_metric(self.metric)
        return metric, self.knob, metric.validate(self.params)

    def max_size(self) -> int | None:
        """Largest useful size of the knob (:func:`largest_useful`), or None."""
        return largest_useful(*self._sizing(), self.n_samples, model_config(self.model))[0]

    def report_context(self) -> dict[str, Any]:
        """What a report of a search of this knob shows: the configuration, the data, and
        ``Metric.notes``."""
        metric, knob, params = self._sizing()
        return {"title": f"{self.metric}.{self.knob}: Maximum Safe Size Report",
                "model": self.model, "dtype": self.dtype, "metric": self.metric,
                "knob": self.knob, "samples": self.n_samples,
                "data": {"source": "generated tokens (seeded)", "samples": self.n_samples,
                         "sequence_length": self.seq_len,
                         "lengths": "every sample at the full sequence length in the trials "
                                    "(the worst case); trial values are the metric on these"},
                **({"configuration": "recompute: the model's repeated blocks checkpointed "
                                     "(activations recomputed in the backward)"}
                   if self.recompute else {}),
                **metric.notes(knob, params, self.n_samples)}

    def unit(self) -> int:
        """The knob's granularity in items (``Metric.size_unit``)."""
        metric, knob, params = self._sizing()
        return metric.size_unit(knob, params, self.n_samples)

    def minimum(self) -> int:
        knob = next(k for k in get_metric(self.metric).knobs if k.name == self.knob)
        return max(1, int(knob.minimum))

    def describe(self) -> dict[str, Any]:
        return {"metric": self.metric, "knob": self.knob, "model": self.model,
                "dtype": self.dtype, "device": self.device, "n_samples": self.n_samples,
                "seq_len": self.seq_len, "seed": self.seed, "params": dict(self.params),
                **({"recompute": True} if self.recompute else {})}

    def warmup(self) -> None:
        """Build model and data (not budgeted) and run the metric once on the first sample, at
        the knob's minimum (for an estimate, at its largest useful size, the fewest operations,
        unless the estimate replays the multiplies' workspace)."""
        if "model" in self._state:
            return
        model = build_for(self._state, self.model, self.dtype, self.device, self.seed)
        data = make_batch(self.n_samples, self.seq_len, model.config.vocab_size, seed=self.seed,
                          device=self.device)
        # Built before the budget, like the data: a trial's peak counts neither.
        worst = make_batch(self.n_samples, self.seq_len, model.config.vocab_size, seed=self.seed,
                           pad=False, device=self.device)
        # Warm up on one sample: the same kernels and thread pools at a fraction of the cost.
        self._state.update(model=model, data={k: v[:1] for k, v in data.items()})
        # A workspace-replaying estimate warms up as its trial does (BLAS buffers depend on it).
        warm = None if replays_workspace() else self._state.get("warm_size")
        self(warm or self.minimum())
        self._state.update(data=data, worst_case=worst)

    def built(self) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """The model and the padded data (what the metric's result is defined on), built by
        :meth:`warmup` (called here)."""
        self.warmup()
        return self._state["model"], self._state["data"]

    def for_estimate(self, device: str) -> MetricTrial:
        """A copy with nothing built, for :func:`oomguard.engine.core.estimate.estimate.estimate` on
        ``device``: its ``warmup()`` (under the estimate's fake mode) builds the model with no
        weights; the data are real (small), so the metric's control flow follows them."""
        copy = dataclasses.replace(self, device=device, _state={"fake": True})
        copy._state["warm_size"] = copy.max_size()
        return copy

    def worst_case_batch(self, size: int) -> dict[str, torch.Tensor]:
        """The data at their most costly, the same for every ``size`` (which slices them):
        the padded data's tokens with every sample at full length (``attention_mask`` all
        ones, no label -100), built once by ``warmup()``."""
        self.warmup()  # builds once
        return self._state["worst_case"]

    def __call__(self, size: int, batch: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Run the metric with ``knob=size`` on ``batch`` (``input_ids``, ``attention_mask``,
        ``labels``), by default on the padded data; return its JSON-friendly summary."""
        self.warmup()
        metric = get_metric(self.metric)
        data = self._state["data"] if batch is None else batch
        with torch.enable_grad():
            result = metric.run(self._state["model"], data, recompute=self.recompute,
                                **{**self.params, self.knob: size})
        return metric.summary(result)


@dataclass(frozen=True)
class InUnits:
    """A strategy that proposes only multiples of ``unit``: ``inner`` runs on counts of units
    and its proposals are multiplied back, until the largest fit and the first OOM are one
    unit apart."""

    inner: Any
    unit: int

    def __post_init__(self) -> None:
        check_positive_int("unit", self.unit)
        if not callable(getattr(self.inner, "next", None)):
            raise UsageError(f"InUnits needs a strategy with next(trials, max_size), "
                             f"got {self.inner!r}; pass a strategy such as Guided()")

    @property
    def name(self) -> str:
        """The inner strategy's name (``e10``): the unit is a field of its own."""
        return str(self.inner.name)

    @property
    def start(self) -> int | None:
        """The first size in items (what SearchConfig compares with ``max_size``)."""
        start = getattr(self.inner, "start", None)
        return start * self.unit if isinstance(start, int) else None

    def describe(self) -> str:
        return (f"Sizes in units of {self.unit} (memory changes only at multiples of "
                f"{self.unit}); in those units: {self.inner.describe()}")

    def next(self, trials: Sequence[Any], max_size: int) -> int | None:
        """The next multiple of ``unit`` to try, at most ``max_size``; None when done."""
        if max_size < self.unit:
            return None
        scaled = [dataclasses.replace(t, size=t.size // self.unit) for t in trials]
        k = self.inner.next(scaled, max_size // self.unit)
        return None if k is None else k * self.unit

    def why(self, trials: Sequence[Any], size: int) -> str:
        """The inner strategy's reason, in units of ``unit``."""
        scaled = [dataclasses.replace(t, size=t.size // self.unit) for t in trials]
        return f"{why_chosen(self.inner, scaled, size // self.unit)} (in units of {self.unit})"


def in_whole_units(start: int, step: int, unit: int, max_size: int) -> tuple[int, int, int]:
    """``(unit, start, step)`` of a search of a knob of granularity ``unit`` (items), start and
    step in whole units (start rounded up, at most ``max_size``'s; step at least 1); a unit
    above ``max_size`` becomes 1."""
    unit = unit if unit <= max_size else 1
    return unit, min(-(-start // unit), max(1, max_size // unit)), max(1, step // unit)


def in_units(inner: Any, unit: int) -> Any:
    """``inner`` proposing only multiples of ``unit`` (:class:`InUnits`); ``inner`` itself
    for ``unit`` 1."""
    return inner if unit == 1 else InUnits(inner, unit)


def snap_to_unit(result: Any, unit: int) -> None:
    """Round ``result.recommendation`` (in place) of a search run in multiples of ``unit`` down to
    one, never below one unit: between two multiples memory is that of the one above."""
    rec = result.recommendation
    if unit <= 1 or rec is None:
        return
    safe = min(max(unit, rec.safe // unit * unit), rec.maximum)
    if safe == rec.safe:
        return
    result.recommendation = dataclasses.replace(
        rec, safe=safe, conservative=rec.conservative if rec.conservative_ran else safe,
        basis=f"{rec.basis}; rounded down to a multiple of {unit}")
