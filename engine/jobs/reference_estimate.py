"""An estimated quick reference: per metric and memory knob, the largest size whose
*estimated* peak fits a given memory with a margin, with no device and no weights.

Every figure here is an estimate (:data:`~oomguard.engine.core.estimate.estimate.LABEL`), made with
:func:`~oomguard.engine.core.estimate.estimate.estimate` (fake tensors): never a measurement, and
written apart from a measured reference (``estimate-reference.*``, ``"source": "estimated"``).

What makes it fast (measured: docs/measurements.md#estimate-reference):

- **Depth**: each size is estimated with 1, 2 and 3 hidden layers and extrapolated to
  the real depth (:class:`Estimator`).
- **Repeats**: what a metric repeats identically runs once
  (:func:`~oomguard.engine.core.estimate.hooks.shortcut`), and one warmed-up fake model
  per depth serves every size a knob's search asks for
  (:class:`~oomguard.engine.core.estimate.estimate.EstimateSession`).
- **Processes**: the metrics share nothing, so each is estimated in a worker of its own,
  as many at once as there are CPUs (:func:`_each_metric`).
- **Size**: sized as a job sizes a metric (:func:`~oomguard.engine.jobs.sizing.choose_sizes`),
  with an evaluator that estimates a few sizes instead of running (:class:`EstimateSearch`).

The total a size needs (bytes) is the storage alive after the warm-up plus the estimated
peak above it; it must fit ``memory x (1 - margin)``, the margin covering what estimates
leave out (CUDA context, allocator cache, cuBLAS workspace).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from oomguard.engine.core import child as launcher
from oomguard.engine.core.estimate.estimate import LABEL, EstimateSession
from oomguard.engine.core.search.record import SearchRecord
from oomguard.engine.errors import UsageError
from oomguard.engine.jobs.sizing import Request, choose_sizes
from oomguard.metrics.base import get_metric, load_all
from oomguard.metrics.models import BUILTIN_CONFIGS, model_config
from oomguard.metrics.workload import SAMPLE_KNOBS, MetricTrial
from oomguard.probes import host

GiB, MiB = 1024**3, 1024**2
# Total bytes of common GPUs as the driver reports them, not the marketed figure
# (measured: docs/measurements.md#gpu-tiers); the margin covers what a process cannot use.
GPUS: dict[str, int] = {"H100 80GB": 81559 * MiB, "A100 40GB": 40960 * MiB,
                        "RTX 4090 24GB": 24564 * MiB, "V100 16GB": 16160 * MiB}
# The share of the memory an estimate keeps free for what it leaves out (the CUDA context,
# the allocator's cache, cuBLAS's workspace): the E10 report's production advice, ~85%
# utilisation. A search's margin is another (SearchConfig.margin: of what grows, measured).
ESTIMATE_MARGIN = 0.15
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
DEPTHS = (1, 2, 3)  # the depths estimated, for a quadratic in the layer count
ROUNDS = 4  # line-and-confirm rounds per knob after sizes 1 and the largest
WORKERS: int | None = None  # processes for the metrics (None: one per CPU; 1: this one only)
# What a worker of the parallel reference imports once, before its first metric
PRELOAD = ("transformers", "oomguard.engine.core.estimate.estimate", "oomguard.metrics.workload")


def gpu_memory(name: str) -> int:
    """Total bytes of a GPU tier in :data:`GPUS` (as its driver reports them); UsageError
    listing the valid names."""
    for key, nbytes in GPUS.items():
        if key.lower() == name.strip().lower():
            return nbytes
    raise UsageError(f"unknown --gpu {name!r}: use one of " + ", ".join(repr(g) for g in GPUS))


def layer_specs(spec: str) -> tuple[int, list[str]] | None:
    """``(depth, [the spec with 1, 2 and 3 layers])`` for a built-in or ``MODEL_TYPE:key=value``
    spec of more than 3 layers; None otherwise (estimate at full depth: a checkpoint folder,
    or a model with no layer-count key)."""
    config = model_config(spec)
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth <= len(DEPTHS):
        return None
    if spec in BUILTIN_CONFIGS:
        kw = dict(BUILTIN_CONFIGS[spec])
        model_type, items = kw.pop("model_type"), [f"{k}={v}" for k, v in kw.items()]
    elif ":" in spec and not spec.startswith((".", "/", "~")):
        model_type, _, rest = spec.partition(":")
        items = list(filter(None, rest.split(",")))
    else:
        return None
    key = (getattr(config, "attribute_map", {}) or {}).get("num_hidden_layers", "num_hidden_layers")
    kept = [i for i in items if i.partition("=")[0].strip() not in LAYER_KEYS]
    return depth, [f"{model_type}:" + ",".join([*kept, f"{key}={n}"]) for n in DEPTHS]


class _Resident:
    """A workload for :func:`estimate` that also counts the bytes alive in its state after
    its warm-up (parameters, gradients, buffers, data), which the estimated peak excludes;
    rounded up to ``block`` bytes (the session's)."""

    def __init__(self, trial: MetricTrial) -> None:
        self.work, self.block, self.resident = trial, 1, 0

    def for_estimate(self, device: str) -> _Resident:
        self.work = self.work.for_estimate(device)
        return self

    def warmup(self) -> None:
        self.work.warmup()
        state = self.work._state
        model = state["model"]
        tensors = [*model.parameters(), *(p.grad for p in model.parameters()
                                          if p.grad is not None), *model.buffers(),
                   *(t for key in ("data", "worst_case") for t in state.get(key, {}).values())]
        seen: dict[int, int] = {id(t): t.untyped_storage().nbytes() for t in tensors}
        self.resident = sum(-(-n // self.block) * self.block for n in seen.values())

    def __call__(self, size: int) -> Any:
        return self.work(size)


class Estimator:
    """Totals (resident + peak, bytes, estimated) of one model's metrics, extrapolated from
    1, 2 and 3 layers to the real depth where the spec allows (:func:`layer_specs`) by the
    quadratic through them (per-layer and per-pair-of-layers parts, as CKA's Gram matrix)."""

    def __init__(self, model: str, dtype: str, seq_len: int, device: str) -> None:
        self.model, self.dtype, self.seq_len, self.device = model, dtype, seq_len, device
        self.layers = layer_specs(model)
        self.estimates = 0
        self.notes: set[str] = set()  # what the estimates changed or left out
        # The warmed-up sessions of the workload last asked for, per spec.
        self._sessions: dict[tuple, tuple[EstimateSession, _Resident]] = {}

    @property
    def method(self) -> str:
        if self.layers is None:
            return f"{LABEL}: fake tensors at the model's full depth"
        return (f"{LABEL}: fake tensors on the config with 1, 2 and 3 layers, extrapolated "
                f"to its {self.layers[0]} layers by the quadratic through them")

    def totals(self, metric: str, knob: str | None, n_samples: int, sizes: Sequence[int],
               params: Mapping[str, Any] | None = None) -> dict[int, tuple[int, int]]:
        """size -> (total bytes, peak bytes above the resident ones), both estimated at the
        real depth, the metric's other knobs at ``params`` (None: their defaults)."""
        fixed = tuple(sorted((params or {}).items()))

        def at(spec: str) -> dict[int, tuple[int, int]]:
            self.estimates += len(set(sizes))
            key = (metric, knob, n_samples, fixed, spec)
            if key not in self._sessions:
                if any(k[:4] != key[:4] for k in self._sessions):
                    self._sessions.clear()  # another workload: its fake models can go
                work = _Resident(MetricTrial(
                    metric, knob=knob, model=spec, dtype=self.dtype, n_samples=n_samples,
                    seq_len=self.seq_len, params=dict(fixed)))
                # workspace=False: a replay measures this host's BLAS, not the target device.
                session = EstimateSession(work, device=self.device, workspace=False)
                work.block = session.counter.block
                self._sessions[key] = session, work
            session, work = self._sessions[key]
            got = session.at(sorted(set(sizes)))
            self.notes.update(n for e in got for n in e.notes if "read as 1" not in n)
            return {e.size: (work.resident, e.peak_bytes) for e in got}
        if self.layers is None:
            return {s: (r + p, p) for s, (r, p) in at(self.model).items()}
        depth, specs = self.layers
        got = [at(spec) for spec in specs]
        both = {s: [_quadratic([g[s][i] for g in got], depth) for i in (0, 1)] for s in got[0]}
        return {s: (resident + peak, peak) for s, (resident, peak) in both.items()}


def _quadratic(f: Sequence[int], depth: int) -> int:
    """``f`` (bytes at 1, 2 and 3 layers) at ``depth``: the quadratic through them where they
    curve up; where they curve down (another term was the largest at 1 layer), the line
    through 2 and 3 layers. Never below the value at 3 layers."""
    n = depth - 1
    d1, d2 = f[1] - f[0], f[2] - 2 * f[1] + f[0]
    if d2 < 0:
        return f[2] + (depth - 3) * (f[2] - f[1])
    return max(f[2], f[0] + n * d1 + n * (n - 1) // 2 * d2)


class EstimateSearch:
    """The estimated reference's evaluator for :func:`~oomguard.engine.jobs.sizing.choose_sizes`:
    the largest size of a knob whose estimated total fits ``capacity`` bytes. The cap first, size
    1 only where it does not fit, then the line through the two nearest known sizes, for at most
    :data:`ROUNDS` rounds."""

    def __init__(self, est: Estimator, metric: str, n_samples: int, capacity: int) -> None:
        self.est, self.metric, self.n_samples, self.capacity = est, metric, n_samples, capacity

    def __call__(self, knob: str, sizes: dict[str, int], unit: int, cap: int) -> SearchRecord:
        t0, n0, capacity = time.perf_counter(), self.est.estimates, self.capacity
        others = {k: v for k, v in sizes.items() if k != knob}
        top = max(1, cap // unit)  # in units
        known: dict[int, tuple[int, int]] = {}

        def probe(ks: Sequence[int]) -> None:
            got = self.est.totals(self.metric, knob, self.n_samples, [k * unit for k in ks], others)
            known.update({s // unit: v for s, v in got.items()})

        probe([top])
        if known[top][0] > capacity and top > 1:
            probe([1])
        if 1 in known and known[1][0] > capacity:
            fit, over = None, 1
        elif known[top][0] <= capacity:
            fit, over = top, None
        else:
            fit, over = 1, top
            for _ in range(ROUNDS):
                if over - fit <= 1:
                    break
                slope = (known[over][0] - known[fit][0]) / (over - fit)
                k = fit + int((capacity - known[fit][0]) // slope)
                k = min(max(k, fit + 1), over - 1)
                probe([k, k + 1] if k + 1 < over else [k])
                fit = max(s for s, (t, _) in known.items() if t <= capacity)
                over = min(s for s, (t, _) in known.items() if t > capacity)
        largest = None if fit is None else fit * unit
        exact = over is None or fit is None or over - fit == 1
        note = ("" if exact else
                f"between {largest} (fits) and {over * unit} (does not): rounds ran out")
        if fit is None:
            note = f"does not fit: even size {unit} needs more than the memory less the margin"
        return SearchRecord(
            metric=self.metric, knob=knob, max_ok=largest, safe=largest,
            first_oom=None if over is None else over * unit, unit=unit, note=note,
            trials=self.est.estimates - n0, seconds=round(time.perf_counter() - t0, 3),
            extra={"kind": LABEL, "largest_useful": top * unit, "exact": exact,
                   "total_bytes": None if fit is None else known[fit][0],
                   "peak_bytes": None if fit is None else known[fit][1],
                   "next_total_bytes": None if over is None else known[over][0]})


def estimate_rows(est: Estimator, metric: str, n_samples: int, capacity: int,
                  max_size: int) -> list[dict[str, Any]]:
    """One row per memory knob of ``metric``, sized as a job sizes it: ``max_ok`` the largest
    size whose estimated total fits ``capacity`` bytes (None: none fits), ``first_oom`` the
    next one, with their totals."""
    request = Request(get_metric(metric), {}, n_samples, model_config(est.model), max_size)
    got = choose_sizes(request, evaluate=EstimateSearch(est, metric, n_samples, capacity))
    out = []
    for rec in got.records:
        row = {"metric": rec.metric, "knob": rec.knob, "unit": rec.unit, **rec.extra,
               "max_ok": rec.max_ok, "first_oom": rec.first_oom, "estimates": rec.trials,
               "seconds": rec.seconds, "others": rec.others, "note": rec.note}
        if rec.capped_by:
            row["note"] = f"fits at the knob's largest useful size ({rec.max_ok})"
        out.append(row)
    return out


def batch_table(est: Estimator, metrics: Sequence[str], batches: Sequence[int]
                ) -> list[dict[str, Any]]:
    """Per metric (its first memory knob at the batch size, over that many samples): the
    estimated total bytes at each batch size (no time: fake tensors compute nothing)."""
    rows = []
    for metric in metrics:
        knobs = get_metric(metric).memory_knobs()
        if not knobs or knobs[0].name not in SAMPLE_KNOBS:
            continue
        t0 = time.perf_counter()
        mem = {str(b): est.totals(metric, knobs[0].name, b, [b])[b][0] for b in batches}
        rows.append({"metric": metric, "knob": knobs[0].name, "total_bytes": mem, "kind": LABEL,
                     "seconds": round(time.perf_counter() - t0, 3)})
    return rows


def check_measured(measured: Any, **want: Any) -> None:
    """UsageError (one line) unless ``measured`` is a measured ``reference.json``'s content
    for what ``want`` names (``model``, ``dtype``, ``seq_len``, ``n_samples``)."""
    rows = measured.get("rows") if isinstance(measured, dict) else None
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("metric"), str)
            and isinstance(r.get("knob"), str) for r in rows):
        got = ("an object without them" if isinstance(measured, dict)
               else f"a JSON {type(measured).__name__}")
        raise UsageError(f"--measured: not a reference.json of `oomguard reference` (an object "
                         f"with rows of metric and knob; got {got}); give the reference.json "
                         "that `oomguard reference` wrote")
    for key, value in want.items():
        if measured.get(key) != value:
            raise UsageError(f"--measured was measured for {key} {measured.get(key)!r}, this "
                             f"estimate is for {value!r}: give the same model, dtype, "
                             "sequence length and samples")


def compare_measured(est: Estimator, rows: list[dict[str, Any]], measured: dict[str, Any],
                     n_samples: int) -> None:
    """Add to each row the measured reference's maximum, its measured peak at its safe size,
    the estimated peak there, and ``relative_error`` = (estimated - measured) / measured."""
    check_measured(measured, model=est.model, dtype=est.dtype, seq_len=est.seq_len,
                   n_samples=n_samples)
    by_key = {(r["metric"], r["knob"]): r for r in measured.get("rows", [])}
    for row in rows:
        m = by_key.get((row["metric"], row["knob"]))
        if m is None:
            continue
        row["measured_max"] = m.get("max_ok")
        safe, peak = m.get("safe"), m.get("peak_at_safe_bytes")
        if safe and peak and m.get("peak_source") == "measured":
            got = est.totals(row["metric"], row["knob"], n_samples, [safe],
                             m.get("others"))[safe][1]
            row.update(measured_size=safe, measured_peak_bytes=peak, estimated_peak_bytes=got,
                       relative_error=round((got - peak) / peak, 4))


def _metric_rows(name: str, model: str, dtype: str, seq_len: int, device: str, n_samples: int,
                 capacity: int, max_size: int) -> tuple[list[dict[str, Any]], int, set[str]]:
    """One metric's rows (:func:`estimate_rows`), its estimate count and notes."""
    est = Estimator(model, dtype, seq_len, device)
    return estimate_rows(est, name, n_samples, capacity, max_size), est.estimates, est.notes


def _each_metric(names: Sequence[str], *args: Any
                 ) -> Iterator[tuple[list[dict[str, Any]], int, set[str]]]:
    """:func:`_metric_rows` of each of ``names``, in their order: in parallel, one process per
    CPU (the estimate is Python-bound: docs/measurements.md#estimate-reference); sequential
    inside a daemonic process and with a plugin's metric, which a worker would not know."""
    workers = min(len(names), WORKERS or host.cpu_count())
    plugin = any(not type(get_metric(n)).__module__.startswith("oomguard.metrics.")
                 for n in names)
    if workers < 2 or plugin or mp.current_process().daemon:
        for name in names:
            yield _metric_rows(name, *args)
        return
    with launcher.pool(workers, PRELOAD) as executor:
        futures = [executor.submit(_metric_rows, name, *args) for name in names]
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def build_estimate_reference(model: str, dtype: str, seq_len: int, n_samples: int, *,
                             memory: int, memory_name: str, margin: float, device: str,
                             metrics: Sequence[str] | None = None, max_size: int = 65536,
                             batches: Sequence[int] = (), measured: dict[str, Any] | None = None,
                             on_row: Callable[[dict[str, Any]], None] | None = None
                             ) -> dict[str, Any]:
    """The estimated reference as a JSON-ready dict (every figure an estimate, in bytes)."""
    if not 0 <= margin < 1:
        raise UsageError(f"--margin must be a fraction in [0, 1) for an estimate, got {margin!r}; "
                         "give one such as 0.05")
    names = list(metrics) if metrics else sorted(load_all())
    t0 = time.perf_counter()
    est = Estimator(model, dtype, seq_len, device)
    capacity = int(memory * (1 - margin))
    rows = []
    for got, estimates, notes in _each_metric(names, model, dtype, seq_len, device, n_samples,
                                              capacity, max_size):
        est.estimates += estimates
        est.notes |= notes
        for row in got:
            rows.append(row)
            if on_row is not None:
                on_row(row)
    if measured is not None:
        compare_measured(est, rows, measured, n_samples)
    table = batch_table(est, names, batches) if batches else []
    return {"source": "estimated", "kind": LABEL, "method": est.method, "model": model,
            "dtype": dtype, "seq_len": seq_len, "n_samples": n_samples, "device": device,
            "memory_name": memory_name, "memory_bytes": memory, "margin": margin,
            "capacity_bytes": capacity, "rows": rows, "batches": list(batches),
            "batch_rows": table, "estimates": est.estimates, "notes": sorted(est.notes),
            "seconds": round(time.perf_counter() - t0, 3),
            "measured_source": None if measured is None else measured.get("created", "?")}
