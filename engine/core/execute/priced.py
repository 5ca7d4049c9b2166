"""Remedies priced by speed: when the effective batch does not fit at one micro-batch, measure
each way of fitting it and keep the fastest one whose peak keeps the margin.

The candidates (``remedies=``, the user's choice; default ``("accumulate", "checkpoint")``):

- ``accumulate``: plain steps at the largest micro-batch that fits, accumulated;
- ``checkpoint``: activation checkpointing per block
  (:func:`~oomguard.engine.core.recompute.checkpointed`), two configurations: every block,
  and every other block (selective), each at the largest micro-batch it allows;
- ``bf16``: bfloat16 autocast, only when named (naming it is the user allowing the dtype change);
- ``expandable_segments`` (CUDA): the allocator setting ``PYTORCH_CUDA_ALLOC_CONF=
  expandable_segments:True``, read when a process starts: priced where this process runs with
  it (then every row ran with it), else its row says to start a fresh process with it.

Each configuration's largest safe micro-batch is searched with
:func:`~oomguard.engine.core.search.search.search`, in this process with ``restore=`` (every
trial starts from the user's model and optimizer and leaves them as they were), from the whole
effective batch down; its micro-batch is the search's recommendation, so its peak keeps the
margin of :mod:`~oomguard.engine.core.search.fit`. A search trial runs two micro-batches (the
second adds to the gradients the first left, as accumulation does) and the optimizer's step.
Each configuration is then timed for one effective step (every micro-batch, then the
optimizer's step) as a trial under the same limit
(:func:`~oomguard.engine.core.search.search.verify`, whose timed steps run without the
swallowed-OOM detector), in :data:`TIMED_ROUNDS` rounds that take the configurations in turn,
so that other work on the machine slows them alike; a timed step that runs out of memory
steps its micro-batch down. The choice is the rule every side-by-side timing uses
(:func:`~oomguard.engine.util.faster.fastest`): the most samples per second, a tie or a
difference within the measured spread of the rounds keeping the earlier configuration
(accumulation first); it is confirmed by one more real step, and one whose confirming step
runs out of memory gives way to the next choice among the rest. The micro-batches of a
priced step are those :func:`~oomguard.engine.util.rows.micro_batches` gives (the fewest at
most ``size`` rows, as equal as the rows allow), as accumulation and the integrations run
them.

A choice is remembered per model (weakly: it goes with the model) and per device, workload,
remedies and options: a later call for as many rows or fewer answers without measuring
(:func:`choose_remedy`; :func:`forget_remedies`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard.engine.core.execute.remedies import (
    ALLOC_CONF,
    EXPANDABLE,
    expandable_in_force,
    expandable_unavailable,
)
from oomguard.engine.core.memory.oom import gc_frozen
from oomguard.engine.core.recompute import checkpointed, repeated_blocks
from oomguard.engine.core.search.fit import step_down
from oomguard.engine.core.search.search import search, verify
from oomguard.engine.errors import (
    NoExecutableBatchSize,
    NoSizeFits,
    UsageError,
    check_positive_int,
)
from oomguard.engine.util.faster import fastest, spread
from oomguard.engine.util.rows import micro_batches, slice_rows
from oomguard.engine.util.units import fmt_bytes
from oomguard.engine.util.weakmap import WeakIdMap

log = logging.getLogger("oomguard.remedies")

REMEDY_NAMES = ("accumulate", "checkpoint", "bf16", "expandable_segments")
DEFAULT_REMEDIES = ("accumulate", "checkpoint")
# Rounds of timing, each a two-step trial of every configuration in turn; a configuration's
# time is its fastest timed step (other work on a shared machine only ever slows a step).
TIMED_ROUNDS = 2
# Times a timed step that ran out of memory is tried again at a smaller micro-batch.
STEP_DOWNS = 2
# Search options a caller may pass on; restore and max_size are the pricing's own, and trials
# of a closure over the user's model cannot run in another process (isolate, confirm).
# Trials per configuration's search unless the caller says otherwise: pricing needs each
# configuration's safe micro-batch, not its exact maximum (a search that stops here still
# recommends from the trials that ran).
MAX_TRIALS = 12
# The pricing's own defaults for its searches: MAX_TRIALS; trials forked as any search's on a
# Linux CPU (``fork=False``: in this process, each put back with restore=). In the process,
# under a process budget, what each configuration's search left shrank the next one's room:
# a Trainer's third configuration found 15.8 MiB of its 48 MiB left (BudgetError).
DEFAULTS: dict[str, Any] = {"max_trials": MAX_TRIALS}
SEARCH_OPTIONS = ("budget", "margin", "max_trials", "max_seconds", "ram_guard", "capacity_bytes",
                  "steps_per_trial", "trial_timeout", "fork")


def parse_remedies(value: Any, where: str = "remedies") -> tuple[str, ...]:
    """The remedy names of ``value`` (a sequence of names, or one string of names separated by
    commas, as the command line gives them), checked: a one-line :class:`UsageError` that
    starts with ``where`` for an unknown or repeated name or none at all."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"{where}: expected names like (\"accumulate\", \"checkpoint\"), got "
                         f"{value!r}; give such a tuple")
    names = tuple(n.strip() for n in names)
    if not names or not all(names):
        raise UsageError(f"{where}: no remedy named in {value!r}; name one or more of "
                         f"{', '.join(REMEDY_NAMES)}")
    for i, name in enumerate(names):
        if name not in REMEDY_NAMES:
            raise UsageError(f"{where}: unknown remedy {name!r}: use one or more of "
                             f"{', '.join(REMEDY_NAMES)}")
        if name in names[:i]:
            raise UsageError(f"{where}: {name!r} is given twice; name each remedy once")
    return names


@dataclass(frozen=True)
class Configuration:
    """One way to run a step: ``remedy`` the name it comes from; ``every`` checkpoint every
    ``every``-th block (0: none); ``autocast`` the dtype of an autocast region (None: none)."""

    name: str
    remedy: str
    every: int = 0
    autocast: str | None = None

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module, device: torch.device) -> Iterator[None]:
        """Run the ``with`` block in this configuration (the model is as before after it)."""
        with contextlib.ExitStack() as stack:
            if self.every:
                stack.enter_context(checkpointed(model, every=self.every))
            if self.autocast is not None:
                stack.enter_context(torch.autocast(device.type, dtype=getattr(torch, self.autocast)))
            yield


PLAIN = Configuration("accumulate", "accumulate")
CONFIGURATIONS: dict[str, tuple[Configuration, ...]] = {
    "accumulate": (PLAIN,),
    "checkpoint": (Configuration("checkpoint", "checkpoint", every=1),
                   Configuration("checkpoint every 2", "checkpoint", every=2)),
    "bf16": (Configuration("bf16", "bf16", autocast="bfloat16"),),
}


def configuration(name: str) -> Configuration:
    """The configuration named ``name`` (a :class:`Priced` row's ``configuration``)."""
    return next(c for group in CONFIGURATIONS.values() for c in group if c.name == name)


@dataclass
class Priced:
    """One configuration's row: ``status`` ``chosen``, ``measured``,
    ``failed its confirming step``, ``nothing fits``, ``not needed``, ``in force`` or
    ``skipped`` (``why`` says more). ``micro_batch`` (rows) is the recommendation of its search
    (``max_ok``, ``trials``: that search's); ``steps`` micro-batches make one effective step;
    ``peak_bytes`` and ``seconds`` are measured over the timed step, ``samples_per_second`` is
    the effective batch's rows (or the micro-batch where rows are not kept) over those seconds,
    ``spread`` the relative spread of its timed rounds (:func:`~oomguard.engine.util.faster.spread`);
    ``limit_bytes`` the peak its recommendation keeps under (the margin)."""

    configuration: str
    remedy: str
    status: str
    why: str = ""
    micro_batch: int | None = None
    steps: int | None = None
    max_ok: int | None = None
    trials: int = 0
    peak_bytes: int | None = None
    limit_bytes: int | None = None
    seconds: float | None = None
    samples_per_second: float | None = None
    spread: float | None = None


@dataclass
class RemedyChoice:
    """What :func:`choose_remedy` measured and chose. ``rows``: the effective batch (rows per
    optimizer step); ``table``: one :class:`Priced` per configuration, in the order measured;
    ``chosen``: the configuration to run (its ``micro_batch``); ``confirmation``: the chosen
    one's confirming step (``ok``, ``peak_bytes``, ``seconds``); ``seconds``: wall seconds the
    pricing took; ``keeps_rows`` False where a smaller micro-batch is a smaller batch
    (``@adaptive``)."""

    workload: str
    device: str
    rows: int
    remedies: tuple[str, ...]
    table: list[Priced]
    chosen: Configuration
    micro_batch: int
    confirmation: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    keeps_rows: bool = True

    @property
    def row(self) -> Priced:
        """The chosen configuration's row."""
        return next(r for r in self.table if r.configuration == self.chosen.name)

    def speedup(self, over: str = "accumulate") -> float | None:
        """The chosen configuration's samples per second over ``over``'s (None where either
        has no rate)."""
        other = next((r for r in self.table if r.configuration == over), None)
        mine = self.row.samples_per_second
        if other is None or not other.samples_per_second or mine is None:
            return None
        return mine / other.samples_per_second

    def applied(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """The chosen configuration around a ``with`` block (checkpointing, autocast)."""
        return self.chosen.applied(model, torch.device(self.device))

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "device": self.device, "rows": self.rows,
                "remedies": list(self.remedies), "chosen": self.chosen.name,
                "micro_batch": self.micro_batch, "keeps_rows": self.keeps_rows,
                "speedup_over_accumulate": self.speedup(), "confirmation": self.confirmation,
                "seconds": self.seconds, "table": [dataclasses.asdict(r) for r in self.table]}


# What choose_remedy remembers: per model (weakly), then per (device, workload, options).
_CHOSEN: WeakIdMap[torch.nn.Module, dict[tuple[tuple, int], RemedyChoice]] = WeakIdMap()


def forget_remedies(model: torch.nn.Module | None = None) -> None:
    """Drop the choices remembered for ``model`` (every model's when None)."""
    for known in [_CHOSEN.get(model)] if model is not None else _CHOSEN.values():
        if known is not None:
            known.clear()


def check_remedies(remedies: Any, model: Any, device: torch.device) -> tuple[str, ...]:
    """:func:`parse_remedies`, and each named remedy possible for ``model`` on ``device``: a
    one-line :class:`UsageError` for checkpointing without a module or its repeated blocks,
    and for bf16 where autocast cannot lower this model (not float32, or no bfloat16 autocast
    on the device); before any work."""
    names = parse_remedies(remedies)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"remedies: pricing needs the model (a torch.nn.Module), got "
                         f"{type(model).__name__}; pass params=model")
    if "checkpoint" in names and not repeated_blocks(model):
        raise UsageError(f"remedies: \"checkpoint\" needs repeated blocks and "
                         f"{type(model).__name__} has none; leave it out of remedies")
    if "bf16" in names:
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if dtypes != {torch.float32}:
            shown = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes)) or "none"
            raise UsageError(f"remedies: \"bf16\" autocast lowers float32 work and this model's "
                             f"parameters are {shown}; leave bf16 out of remedies")
        if not torch.amp.is_autocast_available(device.type) or (
                device.type == "cuda" and not torch.cuda.is_bf16_supported()):
            raise UsageError(f"remedies: \"bf16\" autocast is not available on {device}; "
                             "leave bf16 out of remedies")
    return names


def _device_of(model: Any, device: Any) -> torch.device:
    """``device``, else where ``model``'s first parameter is (the CPU for anything else)."""
    if device is not None:
        return torch.device(device)
    if not isinstance(model, torch.nn.Module):
        return torch.device("cpu")  # check_remedies refuses it
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def pricing_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a pricing's searches and timed steps: ``options`` (each one of
    :data:`SEARCH_OPTIONS`: a one-line :class:`UsageError` for any other, before any work)
    over :data:`DEFAULTS`, None values left out."""
    unknown = sorted(set(options) - set(SEARCH_OPTIONS))
    if unknown:
        raise UsageError(f"remedies: option(s) {', '.join(unknown)} do not apply to pricing; "
                         f"pass only {', '.join(SEARCH_OPTIONS)}")
    return DEFAULTS | {k: v for k, v in options.items() if v is not None}


def choose_remedy(step: Callable[[int], Any], rows: int, model: torch.nn.Module, *,
                  optimizer: torch.optim.Optimizer | None = None,
                  restore: Sequence[Any] | None = None,
                  remedies: Any = DEFAULT_REMEDIES, keeps_rows: bool = True,
                  name: str | None = None, device: Any = None,
                  clip: Callable[[], Any] | None = None, **options: Any) -> RemedyChoice:
    """Measure each configuration of ``remedies`` for one effective step of ``rows`` rows and
    choose the fastest whose peak keeps the margin (the module's docstring says how).

    ``step(n)``: forward and backward of ``n`` rows, adding to ``.grad``; ``optimizer``: stepped
    (and its gradients set to None) once per effective step, None where ``step`` does that
    itself; ``clip()``: called after an effective step's micro-batches, before the optimizer's
    step (a framework's gradient clipping, which a timed step then pays). ``keeps_rows``: an effective step is ``ceil(rows / m)`` calls of ``step`` at
    micro-batch ``m`` (True), or one call at ``m`` (False: a smaller micro-batch is a smaller
    batch, as for ``@adaptive``). ``restore``: what the trials put back (default the model and
    ``optimizer``). ``options``: :data:`SEARCH_OPTIONS` for every search and timed step
    (``budget``, ``margin``, ...). Remembered per model, device, ``name`` (default ``step``'s
    qualified name), remedies and options: a later call for as many rows or fewer returns the
    first's choice without measuring (run at most ``rows`` rows per micro-batch). Raises :class:`UsageError` (one line, before any work) for bad input
    and :class:`NoExecutableBatchSize` when no configuration fits.
    """
    check_positive_int("rows", rows)
    dev = _device_of(model, device)
    names = check_remedies(remedies, model, dev)
    opts = pricing_options(options)
    objects = tuple(restore) if restore is not None else (
        (model,) + ((optimizer,) if optimizer is not None else ()))
    workload = name or getattr(step, "__qualname__", None) or type(step).__name__
    key = (str(dev), workload, names, keeps_rows, clip is not None, tuple(sorted(
        (k, repr(v)) for k, v in opts.items())))
    known = _CHOSEN.get(model)
    if known is None:
        known = _CHOSEN[model] = {}
    # A choice for as many rows or more holds for these (an epoch's last, smaller batch).
    held = sorted((n, c) for (k, n), c in known.items() if k == key and n >= rows)
    if held:
        choice = held[0][1]
        log.info("%s: remedy %s at micro-batch %d (remembered for %d rows)", workload,
                 choice.chosen.name, choice.micro_batch, choice.rows)
        return choice
    pricing = _Pricing(step, rows, model, optimizer, objects, keeps_rows, workload, dev, opts,
                       clip)
    with gc_frozen():  # one collection for every search and timed step, not one each
        choice = pricing.run(names)
    known[(key, rows)] = choice
    return choice


def batch_remedy(step_fn: Callable[[Any], torch.Tensor], batch: Any, rows: int,
                 model: Any, *, backward: Callable[[torch.Tensor], Any],
                 optimizer: torch.optim.Optimizer | None = None, remedies: Any,
                 name: str, **options: Any) -> RemedyChoice:
    """:func:`choose_remedy` for :func:`~oomguard.engine.training.accumulate.accumulate`'s
    shape: ``step_fn(micro_batch)`` returns a loss, ``backward(loss)`` back-propagates it; a
    micro-batch of ``n`` rows is the first ``n`` rows of ``batch`` (``rows`` of them)."""
    def step(n: int) -> None:
        backward(step_fn(slice_rows(batch, 0, n)))

    return choose_remedy(step, rows, model, optimizer=optimizer, remedies=remedies, name=name,
                         **options)


class PricedCalls:
    """What ``@adaptive(remedies=...)`` adds to its calls: on the first, the remedies priced
    for the decorator's batch size (``rows``; the user's function is the whole step, so a
    smaller size is a smaller batch: ``keeps_rows=False``; the trials put ``model`` and
    ``optimizer`` back), the size controller started at the chosen size; every call runs in
    the chosen configuration. Checks the remedies and the model when built (one line)."""

    def __init__(self, remedies: Any, model: Any, optimizer: Any, rows: int, name: str,
                 device: Any = None) -> None:
        self.device = _device_of(model, device)
        self.names = check_remedies(remedies, model, self.device)
        self.model, self.rows, self.name = model, rows, name
        self.restore = (model,) + ((optimizer,) if optimizer is not None else ())
        self.choice: RemedyChoice | None = None

    def run(self, controller: Any, key: str, call: Callable[[int], Any]) -> Any:
        """``controller.run`` of ``call(size)`` in the chosen configuration, priced first."""
        if self.choice is None:
            self.choice = choose_remedy(call, self.rows, self.model, restore=self.restore,
                                        remedies=self.names, keeps_rows=False, name=self.name,
                                        device=self.device)
            controller.memory.sizes[key] = self.choice.micro_batch
        with self.choice.applied(self.model):
            return controller.run(lambda sizes: call(sizes[key]))


class _Pricing:
    """One pricing run: the searches, the timed steps, the choice and its confirmation."""

    def __init__(self, step: Callable[[int], Any], rows: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, restore: tuple[Any, ...],
                 keeps_rows: bool, workload: str, device: torch.device,
                 options: dict[str, Any], clip: Callable[[], Any] | None = None) -> None:
        self.step, self.rows, self.model, self.optimizer = step, rows, model, optimizer
        self.clip = clip
        self.keeps_rows, self.workload, self.device = keeps_rows, workload, device
        self.options = {**options, "device": device, "restore": restore}
        self.t0 = time.perf_counter()

    def effective(self, config: Configuration, first: int | None = None
                  ) -> Callable[[int], Any]:
        """One effective step in ``config`` at micro-batch ``size``: every micro-batch of
        :func:`~oomguard.engine.util.rows.micro_batches` (what accumulation runs), then the
        optimizer's step; with ``first``, only the first ``first`` micro-batches, each of
        ``size`` rows (the rest last): a search trial, whose peak is then the peak at ``size``.
        It runs as a trial runs it (on copies where trials are forked): what it measures
        comes back in the trial's record, not through this process's objects."""
        def run(size: int) -> None:
            with config.applied(self.model, self.device):
                if self.keeps_rows and first is not None:
                    for start in range(0, self.rows, size)[:first]:
                        self.step(min(size, self.rows - start))
                elif self.keeps_rows:
                    for rows in micro_batches(self.rows, size):
                        self.step(rows)
                else:
                    self.step(size)
                self._optimizer_step()
            if self.device.type == "cuda":  # the trial's clock stops when the work is done
                torch.cuda.synchronize(self.device)

        def warmup() -> None:
            # One micro-batch of one row: the kernels and thread pools a trial needs. The
            # default warm-up, run(1), would run the whole effective batch a row at a time in
            # every forked trial (a step that waits 80 ms a call, 128 rows: 10 s a trial).
            # No optimizer step (its state is the trial's to allocate); gradients the
            # warm-up created are dropped.
            had = {id(p) for p in self.model.parameters() if p.grad is not None}
            with config.applied(self.model, self.device):
                self.step(1)
            for p in self.model.parameters():
                if id(p) not in had:
                    p.grad = None

        run.name = f"{self.workload} [{config.name}]"  # type: ignore[attr-defined]
        run.warmup = warmup  # type: ignore[attr-defined]
        return run

    def _optimizer_step(self) -> None:
        if self.clip is not None:
            self.clip()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def run(self, names: tuple[str, ...]) -> RemedyChoice:
        configs = [c for n in names for c in CONFIGURATIONS.get(n, ())]
        table: list[Priced] = []
        searched: list[tuple[Configuration, Priced]] = []
        whole = False  # the plain step fits the whole effective batch
        for config in configs:
            if whole:
                table.append(Priced(config.name, config.remedy, "not needed",
                                    f"the plain step fits {self.rows} rows at one micro-batch"))
                continue
            row = self.searched(config)
            table.append(row)
            if row.micro_batch is not None:
                searched.append((config, row))
                whole = config is PLAIN and row.micro_batch >= self.rows
        if "expandable_segments" in names:
            table.append(self.expandable())
        self.timed(searched)
        return self.chosen(names, table, searched)

    def searched(self, config: Configuration) -> Priced:
        """``config``'s row with its largest safe micro-batch: its search's recommendation,
        whose peak the search measured under the margin's limit. A trial runs two
        micro-batches where one does not hold the effective batch (the second adds its
        gradients to those the first left, as accumulation does: a temporary as large as a
        gradient, which one micro-batch alone never holds), then the optimizer's step."""
        row = Priced(config.name, config.remedy, "measured")
        try:
            # From the whole effective batch: where it fits, one trial answers.
            result = search(self.effective(config, first=2), start=self.rows,
                            max_size=self.rows, **self.options)
        except NoSizeFits as exc:
            row.status, row.why = "nothing fits", str(exc)
            row.trials = len(exc.result.trials)
            return row
        rec = result.recommendation
        assert rec is not None
        row.max_ok, row.trials, row.limit_bytes = result.max_ok, len(result.trials), rec.limit_bytes
        row.micro_batch = rec.safe
        row.steps = math.ceil(self.rows / rec.safe) if self.keeps_rows else 1
        log.info("%s: %s fits micro-batch %d (maximum %s, %d trials)", self.workload,
                 config.name, rec.safe, result.max_ok, row.trials)
        return row

    def timed(self, searched: list[tuple[Configuration, Priced]]) -> None:
        """Time one effective step of each configuration at its micro-batch as a trial (the
        same limit) of two steps, the second timed (the first pays one-time costs: a new
        shape, autocast's casts), in :data:`TIMED_ROUNDS` rounds that take every
        configuration in turn, so that other work on the machine slows them alike; a
        configuration's seconds are its fastest timed step, its peak the highest."""
        seconds: dict[str, list[float]] = {config.name: [] for config, _ in searched}
        for _ in range(TIMED_ROUNDS):
            for config, row in searched:
                if row.status != "measured":
                    continue
                micro = row.micro_batch
                outcome = self.timed_step(config, row)
                if outcome is None:
                    continue
                if row.micro_batch != micro:  # stepped down: earlier rounds timed another size
                    seconds[config.name].clear()
                seconds[config.name].append(outcome["step_seconds"][-1])
                row.peak_bytes = max(row.peak_bytes or 0, outcome["peak_bytes"] or 0)
        for config, row in searched:
            if row.status != "measured":
                continue
            row.seconds = min(seconds[config.name])
            row.spread = spread(seconds[config.name])
            done = self.rows if self.keeps_rows else row.micro_batch
            row.samples_per_second = done / row.seconds if row.seconds > 0 else None  # type: ignore[operator]
            log.info("%s: %s at micro-batch %d: %s samples/s, peak %s", self.workload,
                     config.name, row.micro_batch, "-" if row.samples_per_second is None
                     else f"{row.samples_per_second:.1f}", fmt_bytes(row.peak_bytes))

    def timed_step(self, config: Configuration, row: Priced) -> dict[str, Any] | None:
        """One timed trial of ``config`` at its micro-batch: :func:`verify`'s record. Where it
        runs out of memory (the whole effective step can hold more than a search trial's two
        micro-batches), the micro-batch steps down (:func:`step_down`, at most
        :data:`STEP_DOWNS` times; the row says so); None where nothing ran."""
        for _ in range(STEP_DOWNS + 1):
            assert row.micro_batch is not None
            outcome = verify(self.effective(config), row.micro_batch, 2, **self.options)
            if outcome["ok"]:
                return outcome
            error = (outcome["error"] or "")[:200]
            if row.micro_batch == 1:
                break
            lower = step_down(row.micro_batch, None, 0, None)
            row.why = (f"stepped down from micro-batch {row.micro_batch}: its timed step ran "
                       f"out of memory ({error})")
            log.info("%s: %s %s", self.workload, config.name, row.why)
            row.micro_batch = lower
            row.steps = math.ceil(self.rows / lower) if self.keeps_rows else 1
        row.status, row.why = "nothing fits", f"its timed step ran out of memory ({error})"
        return None

    def expandable(self) -> Priced:
        """The ``expandable_segments`` row: why it is not priced apart, or that it is in force."""
        row = Priced("expandable_segments", "expandable_segments", "skipped")
        why = expandable_unavailable(self.device.type)
        if why is not None:
            row.why = why
        elif expandable_in_force():
            row.status, row.why = "in force", "every row above ran with it"
        else:
            row.why = (f"read when a process starts: price it in a fresh process started with "
                       f"{ALLOC_CONF}={EXPANDABLE}")
        return row

    def chosen(self, names: tuple[str, ...], table: list[Priced],
               searched: list[tuple[Configuration, Priced]]) -> RemedyChoice:
        """The row :func:`~oomguard.engine.util.faster.fastest` keeps (the most samples per
        second beyond the spread of the timings; a tie keeps the earlier), confirmed by one
        more real step; where a confirming step fails, the rule's choice among the rest."""
        left = [pair for pair in searched if pair[1].status == "measured"
                and pair[1].samples_per_second is not None]
        while left:
            best = fastest([row.samples_per_second for _, row in left],
                           [row.spread or 0.0 for _, row in left])
            assert best is not None  # every row left has a rate
            config, row = left.pop(best)
            confirmation = self.confirmed(config, row)
            if confirmation["ok"]:
                row.status = "chosen"
                choice = RemedyChoice(self.workload, str(self.device), self.rows, names, table,
                                      config, row.micro_batch, confirmation,  # type: ignore[arg-type]
                                      time.perf_counter() - self.t0, self.keeps_rows)
                log.info("%s: %s at micro-batch %d, %.1f samples/s (priced in %.1f s)",
                         self.workload, config.name, row.micro_batch, row.samples_per_second,
                         choice.seconds)
                return choice
            row.status, row.why = "failed its confirming step", confirmation["why"]
        reasons = "; ".join(f"{r.configuration}: {r.status}" + (f" ({r.why})" if r.why else "")
                            for r in table)
        raise NoExecutableBatchSize(self.workload, [], [], f"no remedy fits {self.rows} rows: "
                                    f"{reasons}")

    def confirmed(self, config: Configuration, row: Priced) -> dict[str, Any]:
        """One more real effective step of the chosen configuration, as a trial: ``ok`` where
        it ran (``why`` where not), its ``peak_bytes`` and ``seconds``, and ``within_limit``:
        whether that peak stayed under its recommendation's limit (None: no limit known)."""
        outcome = verify(self.effective(config), row.micro_batch, 1, **self.options)
        limit, peak = row.limit_bytes, outcome["peak_bytes"]
        done = {"ok": outcome["ok"], "peak_bytes": peak, "seconds": outcome["seconds"],
                "within_limit": None if limit is None or peak is None else peak <= limit}
        if not outcome["ok"]:
            done["why"] = f"out of memory: {(outcome['error'] or '')[:200]}"
        return done
