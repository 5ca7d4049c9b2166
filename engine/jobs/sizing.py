"""Choosing a metric's memory-knob sizes: the one routine of jobs, the measured and the
estimated reference, ``oomguard search`` and the Ray backend's retry.

Every memory knob, in the order the metric declares them, takes: the size the job file
pins; else the size cache's (an entry for this device and workload holding every knob,
read only when nothing is pinned: its key does not describe pins); else what
``evaluate(knob, sizes, unit, cap)`` finds (a search, :func:`measure`, or an estimate),
up to ``cap`` in multiples of ``unit``; else the metric's default, rounded down to the unit.

Knobs combine in turn: each is searched with the knobs before it at their chosen sizes
and the ones after it at their defaults, so the last search ran the combination used
(knobs that multiply, as ``position_jacobian``'s ``micro_batch_size x vjp_block`` rows,
cannot each take a size found with the other at its default). A knob where nothing fits
takes its minimum, and the next is searched from there.

``cap`` is the smaller of ``max_size`` and the knob's largest useful size
(:func:`~oomguard.metrics.workload.largest_useful`). An answer that reached it without an
OOM is *capped* (its record's ``capped_by`` and ``cap``; the cache entry's ``capped``:
knob -> cap), and a later request whose cap is larger (a job on 64 samples after a
reference on 8) searches again instead of reusing it.

A cache entry is an answer only where its search finished: one cut short by a bound on the
search's effort (:data:`~oomguard.engine.jobs.cache.UNFINISHED`: ``max_seconds``, the task's time limit, ``max_trials``)
is stored with ``finished = false`` and searched again by every later request (an entry
written before the field existed counts as finished unless its search records say it was cut
short). A cached size above the request's ``cap`` is used only where the entry's own search
record measured it (``max_ok``), and then lowered to the cap (every smaller size fits too);
any other (a hand-edited ``10**12``) is refused with a warning and the knob searched again.

A metric that recomputes (``Metric.recomputes``), sized by a caller that can run it so
(:class:`Recompute`: a job), has two configurations: ``plain`` and ``recompute`` (the model's
repeated blocks checkpointed). Every knob is sized in each, each is timed once at its sizes,
and the faster in samples per second is kept (:func:`_faster`; a tie keeps plain). Where no
plain knob met its memory limit (every answer capped by the request), recomputation could
only add work and is not measured. The cache entry holds the ``configuration`` chosen and the
``configurations`` measured, and its search records each say theirs; an entry answers a caller
that can run its configuration, and a caller that would measure both only where both were.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from oomguard.engine.core.search.record import CACHE, SearchRecord, record_of
from oomguard.engine.core.search.search import SearchConfig, SearchResult, search
from oomguard.engine.core.search.strategies import strategy_params
from oomguard.engine.errors import NoSizeFits, TrialFailed, UsageError
from oomguard.engine.jobs.cache import UNFINISHED, SizeCache, finished
from oomguard.engine.jobs.sink import Sink
from oomguard.engine.util.faster import fastest
from oomguard.metrics.base import Metric
from oomguard.metrics.workload import in_units, in_whole_units, largest_useful, snap_to_unit

log = logging.getLogger("oomguard.cache")

_CAPS = {"samples": "the sample count", "largest useful size": "the knob's largest useful size",
         "max_size": "max_size"}


Evaluate = Callable[[str, dict[str, int], int, int], SearchRecord]
PLAIN, RECOMPUTE = "plain", "recompute"  # a metric as written; its blocks checkpointed


@dataclass(frozen=True)
class Recompute:
    """What a caller that can run a metric recomputed gives :func:`choose_sizes`: ``evaluate``
    searches a knob with the model's repeated blocks checkpointed, as ``choose_sizes``' own
    ``evaluate`` searches it plainly (None: no search); ``seconds(configuration, sizes)`` is
    one timed run of the metric in that configuration at those sizes (wall seconds,
    measured; None where it ran out of memory)."""

    evaluate: Evaluate | None
    seconds: Callable[[str, dict[str, int]], float | None]


@dataclass(frozen=True)
class Request:
    """What is sized: ``metric`` with its result ``params`` on ``n_samples`` samples of a model of
    transformers ``config``; searches go up to ``max_size``; ``pinned`` sizes are the job file's."""

    metric: Metric
    params: Mapping[str, Any]
    n_samples: int
    config: Any
    max_size: int = 65536
    pinned: Mapping[str, int] = field(default_factory=dict)
    pinned_from: str = "job file"  # where ``pinned`` came from, the sizes' source says it

    def bounds(self, knob: str, sizes: Mapping[str, int]) -> tuple[int, int, str]:
        """``(unit, cap, what sets cap)`` of ``knob`` with the other knobs at ``sizes``: a
        unit larger than the cap becomes 1 (no whole unit fits: every size counts)."""
        params = self.metric.validate({**self.params, **sizes})
        useful, why = largest_useful(self.metric, knob, params, self.n_samples, self.config)
        cap, why = ((useful, why) if useful is not None and useful <= self.max_size
                    else (self.max_size, "max_size"))
        unit = self.metric.size_unit(knob, params, self.n_samples)
        return (unit if unit <= cap else 1), cap, why


@dataclass(frozen=True)
class Slot:
    """Where a metric's sizes live in the size cache: ``key`` of ``cache`` (a
    :class:`~oomguard.engine.jobs.cache.SizeCache`, or a task's sink), with the device and
    workload stored beside them; ``source`` labels what a search stores there."""

    cache: SizeCache | Sink
    key: str
    device: Mapping[str, Any]
    workload: Mapping[str, Any]
    source: str = "search"


@dataclass
class Sizing:
    """The sizes chosen, where they came from (``job file``, ``cache``, ``search``,
    ``metric default``, joined by `` + `` where knobs differ), every knob's record (searched
    now, or read from the cache), and the cache entry used (None: none). ``configuration``:
    the one the sizes are for (:data:`PLAIN`, :data:`RECOMPUTE`); ``configurations``: each
    one measured, where there was a choice (:func:`_faster`), else empty."""

    sizes: dict[str, int]
    source: str
    records: list[SearchRecord]
    entry: dict[str, Any] | None = None
    configuration: str = PLAIN
    configurations: list[dict[str, Any]] = field(default_factory=list)


def minimums(metric: Metric) -> dict[str, int]:
    return {k.name: int(k.minimum) for k in metric.memory_knobs()}


def snap(size: int, unit: int) -> int:
    """``size`` rounded down to a multiple of ``unit``, at least one unit."""
    return max(unit, size // unit * unit)


def choose_sizes(req: Request, *, evaluate: Evaluate | None = None, slot: Slot | None = None,
                 on_record: Callable[[SearchRecord], None] | None = None,
                 check: Callable[[list[str], dict[str, int]], Any] | None = None,
                 recompute: Recompute | None = None) -> Sizing:
    """Every memory knob's size for ``req``: pinned, else the cache (``slot``), else
    ``evaluate`` (None: no search), else the default. ``on_record`` sees each new record
    as its search ends; the sizes are cached when no knob is pinned and each found one.
    ``check(knobs, sizes)`` runs before the first search, with the knobs to be searched and
    every knob's size meanwhile (defaults, pins): it raises to refuse a knob that is not
    memory-only (:func:`~oomguard.metrics.knob_check.require_memory_knobs`). ``recompute``
    (given only where the metric can run recomputed): every knob is also searched with the
    blocks checkpointed and the faster configuration kept (:func:`_faster`)."""
    knobs = req.metric.memory_knobs()
    if not knobs:
        return Sizing({}, "none (no memory knobs)", [])
    sizes = {k.name: int(k.default) for k in knobs} | dict(req.pinned)
    both = (recompute is not None and recompute.evaluate is not None and evaluate is not None
            and not req.pinned)
    entry = slot.cache.get(slot.key) if slot is not None and not req.pinned else None
    cached = (_cached_sizes(req, entry, sizes, slot.key, recompute is not None, both)
              if entry is not None else None)
    if cached is not None:
        return Sizing(cached, CACHE, _cached_records(req, entry, cached), entry,
                      _configuration(entry), _measured(entry))
    searched = [k.name for k in knobs if k.name not in req.pinned]
    if evaluate is not None and check is not None and searched:
        check(searched, dict(sizes))
    got = _search(req, sizes, evaluate, on_record, PLAIN if both else None)
    if both:
        assert recompute is not None and recompute.evaluate is not None
        got = _faster(req, sizes, got, recompute, on_record)
    chosen = [r for r in got.records if _configuration(r.extra) == got.configuration]
    if slot is not None and chosen and not req.pinned and all(r.safe is not None for r in chosen):
        # An entry chosen between configurations says so; a plain search that replaces one
        # says it is plain (a put keeps the fields it does not name).
        marks = ({"configuration": got.configuration, "configurations": got.configurations}
                 if both or (entry is not None and "configuration" in entry) else {})
        slot.cache.put(slot.key, got.sizes, source=slot.source, device=slot.device,
                       workload=slot.workload, max_ok=chosen[0].max_ok,
                       trials=sum(r.trials for r in got.records),
                       capped={r.knob: r.cap for r in chosen if r.capped_by},
                       finished=not any(r.capped_by in UNFINISHED for r in got.records),
                       search=[r.to_dict() for r in got.records], **marks)
    return got


def _search(req: Request, start: Mapping[str, int], evaluate: Evaluate | None,
            on_record: Callable[[SearchRecord], None] | None,
            configuration: str | None) -> Sizing:
    """Each knob in turn from ``start`` (defaults and pins): searched by ``evaluate``, else
    its default. ``configuration``: what each record says it was searched in (None: nothing,
    the metric has one)."""
    sizes, records, sources = dict(start), [], []
    for knob in req.metric.memory_knobs():
        name = knob.name
        if name in req.pinned:
            sources.append(req.pinned_from)
            continue
        unit, cap, why = req.bounds(name, sizes)
        if evaluate is None:
            sizes[name] = snap(sizes[name], unit)
            sources.append("metric default")
            continue
        rec = evaluate(name, dict(sizes), unit, cap)
        rec.others = {k: v for k, v in sizes.items() if k != name}
        if configuration is not None:
            rec.extra["configuration"] = configuration
        _mark_cap(rec, cap, why)
        records.append(rec)
        if on_record is not None:
            on_record(rec)
        sizes[name] = rec.safe if rec.safe is not None else int(knob.minimum)
        sources.append("search" if rec.safe is not None else "search (nothing fit; minimum)" if rec.max_ok is None
                       else "search (failed; minimum)")
    return Sizing(sizes, " + ".join(dict.fromkeys(sources)), records,
                  configuration=configuration or PLAIN)


def _faster(req: Request, start: Mapping[str, int], plain: Sizing, recompute: Recompute,
            on_record: Callable[[SearchRecord], None] | None) -> Sizing:
    """``plain`` (searched) against the same knobs searched recomputed: each timed once at its
    sizes, the faster kept by the rule every side-by-side timing uses
    (:func:`~oomguard.engine.util.faster.fastest`: a tie keeps plain, a run out of memory is
    never chosen; two out of memory keep plain).
    Not measured where every plain answer stopped at the request's cap, not at an OOM: larger
    sizes are not allowed, and recomputation only adds a forward per block."""
    if all(r.capped_by in _CAPS for r in plain.records):
        plain.configurations = [
            {"configuration": PLAIN, "sizes": dict(plain.sizes), "chosen": True},
            {"configuration": RECOMPUTE, "chosen": False,
             "note": "not measured: no plain size met a memory limit (each stopped at its cap)"}]
        return plain
    assert recompute.evaluate is not None
    other = _search(req, start, recompute.evaluate, on_record, RECOMPUTE)
    rows = [_timed(req, got, recompute.seconds) for got in (plain, other)]
    best = fastest([row["samples_per_second"] for row in rows])
    best = 0 if best is None else best  # neither ran: plain, as searched
    for i, row in enumerate(rows):
        row["chosen"] = i == best
    chosen = (plain, other)[best]
    return Sizing(chosen.sizes, chosen.source, plain.records + other.records,
                  configuration=chosen.configuration, configurations=rows)


def _timed(req: Request, got: Sizing, seconds: Callable[[str, dict[str, int]], float | None]
           ) -> dict[str, Any]:
    """One configuration's row: its sizes, the peak its last knob's search gives them, one timed
    run's wall seconds and the data's samples per second (None: it ran out of memory)."""
    took = seconds(got.configuration, dict(got.sizes))
    last = got.records[-1] if got.records else None
    return {"configuration": got.configuration, "sizes": dict(got.sizes),
            "peak_bytes": last.peak_at_safe_bytes if last else None,
            "peak_source": last.peak_source if last else "",
            "seconds": took, "samples_per_second": req.n_samples / took if took else None,
            **({} if took is not None else {"note": "ran out of memory in its timed run"})}


def _configuration(doc: Mapping[str, Any]) -> str:
    """The configuration a cache entry or a search record is for (none named: plain)."""
    return str(doc.get("configuration") or PLAIN)


def _measured(entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The configurations a cache entry's search measured (none: it had no choice)."""
    rows = entry.get("configurations")
    return [dict(r) for r in rows if isinstance(r, Mapping)] if isinstance(rows, list) else []


def _mark_cap(rec: SearchRecord, cap: int, why: str) -> None:
    """Record the bound of ``rec``'s search, and ``why`` (one of
    :data:`~oomguard.engine.core.search.record.CAPPED_BY`) where the answer reached it."""
    rec.cap = cap
    if rec.first_oom is None and rec.max_ok is not None and rec.max_ok + rec.unit > cap:
        rec.capped_by = why
        rec.note = (f"no OOM up to {rec.max_ok}: capped by {_CAPS[why]} ({cap}), not by "
                    "memory; a request allowing larger sizes searches again")


def _cached_sizes(req: Request, entry: Mapping[str, Any], defaults: Mapping[str, int],
                  key: str, recomputes: bool = False, measures: bool = False
                  ) -> dict[str, int] | None:
    """The sizes a cache entry answers ``req`` with, or None (search again): it needs a size
    for every knob, a finished search, and no capped answer whose cap is below what ``req``
    allows for that knob. A size above the knob's cap for ``req`` is lowered to the cap where
    the entry's search measured it, and refused (a warning) where nothing did. A recomputed
    entry answers only a caller that ``recomputes``; one that ``measures`` both configurations
    needs an entry where both were."""
    sizes, capped = entry["sizes"], entry.get("capped")
    if set(sizes) != set(defaults):
        return None
    configuration = _configuration(entry)
    if configuration not in (PLAIN, RECOMPUTE) or (configuration == RECOMPUTE and not recomputes):
        log.info("size cache entry %s: its sizes are for the configuration %r, which this "
                 "request does not run; searching again", key, configuration)
        return None
    if measures and not _measured(entry):
        log.info("size cache entry %s: sized plain only; measuring recomputation too", key)
        return None
    try:  # the metric's own check of its knobs (a minimum above 1), as a search would meet it
        bounds = {knob: req.bounds(knob, sizes) for knob in sizes}
    except UsageError as exc:
        log.warning("size cache entry %s ignored: %s; searching again", key, exc)
        return None
    if not finished(entry):
        log.info("size cache entry %s: its search was cut short (%s); searching again", key,
                 " or ".join(UNFINISHED))
        return None
    if isinstance(capped, Mapping) and not all(
            isinstance(cap, int) and knob in sizes and bounds[knob][1] <= cap
            for knob, cap in capped.items()):
        return None
    measured = {doc.get("knob"): doc.get("max_ok") for doc in _searches(entry)}
    out = {k: int(v) for k, v in sizes.items()}
    for knob, size in sizes.items():
        unit, cap, why = bounds[knob]
        if size <= cap:
            continue
        if not (isinstance(measured.get(knob), int) and size <= measured[knob]):
            log.warning("size cache entry %s: %s = %d is above %s (%d) and no search of it "
                        "measured it; ignored it and searching again", key, knob, size,
                        _CAPS[why], cap)
            return None
        out[knob] = snap(cap, unit)
    return out


def _cached_records(req: Request, entry: Mapping[str, Any],
                    sizes: Mapping[str, int]) -> list[SearchRecord]:
    """The records an entry holds for each knob (``source`` cache), ``safe`` the size used
    (``sizes``); one holding only the size (an entry written by another version) where it
    has none."""
    stored: dict[str, SearchRecord] = {}
    for doc in _searches(entry):
        try:
            rec = SearchRecord.from_dict(doc)
        except (KeyError, TypeError):
            continue
        stored[rec.knob] = rec
    out = []
    for knob, size in sizes.items():
        rec = stored.get(knob) or SearchRecord(
            metric=req.metric.name, knob=knob, max_ok=None, safe=int(size),
            note=f"size cache ({entry.get('source', '?')}), no search record")
        rec.source = CACHE
        if knob in stored:  # what capped it still holds
            rec.note = f"measured {entry.get('updated', '?')}" + (
                f"; {rec.note}" if rec.capped_by else "")
            if size != entry["sizes"][knob]:  # lowered to this request's cap
                rec.note += (f"; cached {entry['sizes'][knob]}, lowered to {size}, the most "
                             "this request can use")
                rec.safe = size
        out.append(rec)
    return out


def _searches(entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The search records of a cache entry's own configuration (not the one it did not keep)."""
    return [doc for doc in entry.get("search") or [] if isinstance(doc, Mapping)
            and _configuration(doc) == _configuration(entry)]


def knob_config(config: SearchConfig, unit: int, cap: int,
                max_seconds: float | None = None) -> SearchConfig:
    r"""The one configuration of a knob's search (jobs, references, ``oomguard search
    --metric``): ``config`` with its strategy's ``start`` and ``step`` counted in whole
    ``unit``\ s (only multiples of ``unit`` are tried), up to ``cap`` (the smaller of
    ``max_size`` and the knob's largest useful size), and at most ``max_seconds`` of trials
    where that is less than the config's."""
    strategy = config.strategy
    params = strategy_params(strategy)
    unit, start, step = in_whole_units(params.get("start", 1), params.get("step", 1), unit, cap)
    if params:
        strategy = dataclasses.replace(strategy, **{k: v for k, v in (
            ("start", start), ("step", step)) if k in params})
    seconds = min(s for s in (config.max_seconds, max_seconds, float("inf")) if s is not None)
    return dataclasses.replace(config, strategy=in_units(strategy, unit), max_size=cap,
                               max_seconds=None if seconds == float("inf") else seconds)


def run_search(fn: Any, config: SearchConfig,
               on_trial: Callable[[Any], None] | None = None) -> SearchResult:
    """:func:`~oomguard.engine.core.search.search.search`, its recommendation rounded down
    to a multiple of the strategy's unit (where it proposes only multiples of one)."""
    result = search(fn, config, on_trial=on_trial)
    snap_to_unit(result, getattr(config.strategy, "unit", 1))
    return result


def measure(fn: Any, config: SearchConfig, *, metric: str,
            on_trial: Callable[[Any], None] | None = None, strict: bool = False) -> SearchRecord:
    """Search ``fn`` (its ``knob`` is the knob searched) and summarise it: a record also
    where nothing fits. A search that fails for a reason other than memory is a record
    saying so, or, with ``strict``, raises its :class:`TrialFailed`."""
    unit = getattr(config.strategy, "unit", 1)
    try:
        return record_of(run_search(fn, config, on_trial), metric=metric, unit=unit)
    except NoSizeFits as exc:
        return record_of(exc.result, metric=metric, unit=unit)
    except TrialFailed as exc:
        if strict:
            raise
        return record_of(exc.result, metric=metric, unit=unit, failure=exc)
