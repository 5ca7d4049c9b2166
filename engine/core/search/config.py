"""How a search runs: :class:`SearchConfig`, every option checked before any trial;
:func:`resolve` merges it with :func:`~oomguard.engine.core.search.search.search`'s options."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from oomguard.engine.core.search.fit import MEASURED
from oomguard.engine.core.search.ramguard import RamGuard
from oomguard.engine.core.search.strategies import (
    Doubling,
    ExpandBisect,
    Guided,
    LinearJump,
    Strategy,
    strategy_params,
)
from oomguard.engine.core.snapshot import check_restorable
from oomguard.engine.errors import UsageError, check_positive_int


@dataclass(frozen=True)
class SearchConfig:
    """How a search runs; a bad value is a one-line :class:`UsageError` when it is built.

    - ``strategy`` proposes sizes (None: ``Guided(32)``, or ``ExpandBisect(start, step)``
      from :func:`search`'s shorthand); its own fields are what runs.
    - ``max_size``, ``max_trials``, ``max_seconds`` (of trials, not the warm-up) bound the search.
    - ``device``: where trials run. ``budget``: bytes a trial may use above the warmed-up
      process (None: no cap).
    - ``isolate``: each trial in a fresh child process. ``confirm``: search in this process,
      then re-run the answer and the size above it in fresh children, going on there where
      they disagree (``Confirm``): the fresh-process maximum at close to in-process cost.
    - ``fork``: run each trial that is not isolated in a fork of this process, which works on
      copies and leaves this process as it was (Linux, CPU, no CUDA context; elsewhere in this
      process): :mod:`~oomguard.engine.core.search.forked`. False: in this process.
    - ``margin``: the fraction of what grows with the size (the usable bytes above the fixed
      part: weights, gradients, optimizer state) the recommended size keeps free, or
      ``"measured"`` (the default): twice the largest spread of a trial's steady step peaks,
      at least 3% of what grows (:func:`~oomguard.engine.core.search.fit.choose_margin`).
    - ``capacity_bytes``: what the recommendation scales against (None: the budget, else the
      free memory probed before the search).
    - ``trial_timeout``: seconds (finite, > 0) per isolated trial; a child still running then
      is killed and the search ends with :class:`TrialFailed`, never an OOM.
    - ``ram_guard`` bounds CPU trials without a budget by an estimated limit
      (:class:`~oomguard.engine.core.search.ramguard.RamGuard`): None at 80% of the RAM
      available after the warm-up, True always, False never, or the ``RamGuard`` given.
    - ``steps_per_trial``: workload calls per trial (None: the workload's own, else 1).
      ``verify_steps``: steps run at the recommended size after the search, any OOM
      reported (0: none).
    - ``restore``: what a whole training step changes, e.g. ``(model, optimizer)``. In-process
      trials start from a host :class:`~oomguard.engine.core.snapshot.Snapshot` taken before the
      warm-up, restored after every trial and at the end, however the search ends (objects and
      RNG states end as before); each runs at least 2 steps, the first allocating the optimizer's
      state (``steps_per_trial=1`` is refused). Isolated children work on their own copies.
    """

    strategy: Strategy | None = None
    max_size: int = 65536
    max_trials: int = 64
    max_seconds: float | None = None
    device: str | torch.device = "cpu"
    budget: int | None = None
    isolate: bool = False
    confirm: bool = False
    fork: bool = True
    margin: float | str = MEASURED
    capacity_bytes: int | None = None
    trial_timeout: float = 600.0
    ram_guard: RamGuard | bool | None = None
    steps_per_trial: int | None = None
    verify_steps: int = 0
    restore: tuple = ()

    def __post_init__(self) -> None:
        # frozen: the checked tuple replaces what was given (a list, one module)
        object.__setattr__(self, "restore", check_restorable(self.restore))
        if self.strategy is not None and not callable(getattr(self.strategy, "next", None)):
            raise UsageError(f"strategy must be Guided(), ExpandBisect(), Doubling(), LinearJump(capacity) or have "
                             f"next(trials, max_size); got {self.strategy!r}: pass one of those")
        check_positive_int("max_size", self.max_size)
        check_positive_int("max_trials", self.max_trials)
        for name in ("budget", "capacity_bytes"):  # "positive integer": None is the default
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        _require(self.max_seconds is None or is_positive_seconds(self.max_seconds),
                 f"max_seconds must be a positive number or None, got {self.max_seconds!r}"
                 "; give seconds such as 600, or None for no limit")
        _require(is_positive_seconds(self.trial_timeout), "trial_timeout must be a positive "
                 f"number of seconds, got {self.trial_timeout!r}; give one such as 300")
        _require(self.margin == MEASURED or (_is_number(self.margin) and math.isfinite(
            self.margin) and 0 <= self.margin < 1), f"margin must be a fraction in [0, 1) or "
                 f"{MEASURED!r}, got {self.margin!r}; give one such as 0.05")
        _require(self.ram_guard is None or isinstance(self.ram_guard, (bool, RamGuard)),
                 f"ram_guard must be None, True, False or a RamGuard, got {self.ram_guard!r}; "
                 "pass one of those")
        check_positive_int("steps_per_trial", self.steps_per_trial, optional=True)
        _require(not self.restore or self.steps_per_trial is None or self.steps_per_trial >= 2,
                 f"with restore=, each trial runs the first optimizer step (which allocates "
                 f"its state) and a steady one: steps_per_trial must be at least 2 or None, "
                 f"got {self.steps_per_trial!r}; give 2 or more")
        _require(_is_number(self.verify_steps) and isinstance(self.verify_steps, int)
                 and self.verify_steps >= 0,
                 f"verify_steps must be a whole number >= 0, got {self.verify_steps!r}; give 0 "
                 "to skip the check, or a number of steps such as 3")
        for name in ("isolate", "confirm", "fork"):
            _require(isinstance(getattr(self, name), bool),
                     f"{name} must be True or False, got {getattr(self, name)!r}; give "
                     "true or false")
        _require(not (self.isolate and self.confirm), "confirm re-runs an in-process search's "
                 "answer in fresh processes; with isolate every trial already runs in one: give "
                 "one of them")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise UsageError(f"unknown device {self.device!r}: use cpu, cuda, cuda:N or mps"
                             ) from None
        start = getattr(self.strategy, "start", None)
        if isinstance(start, int) and start > self.max_size:
            raise UsageError(f"start ({start}) is larger than max_size ({self.max_size})")

    def to_dict(self) -> dict[str, Any]:
        """What runs: the strategy's name and parameters, the limits and the margin."""
        strategy = self.strategy if self.strategy is not None else Guided()
        return {"strategy": strategy.name, **strategy_params(strategy), "max_size": self.max_size,
                "max_trials": self.max_trials, "max_seconds": self.max_seconds,
                "margin": self.margin, "steps_per_trial": self.steps_per_trial,
                "verify_steps": self.verify_steps,
                **({"restore": [type(o).__name__ for o in self.restore]} if self.restore else {})}

    def trial_steps(self, workload_steps: int) -> int:
        """Steps per trial: ``steps_per_trial``, else the workload's own (at least 2 with ``restore``)."""
        return self.steps_per_trial or max(workload_steps, 2 if self.restore else 1)

    @classmethod
    def from_options(cls, *, strategy: str | Strategy | None = None, start: int | None = None,
                     size_step: int | None = None, **fields: Any) -> SearchConfig:
        """The config from plain values (the command line, a job file's ``[search]``): ``strategy``
        by name (:func:`strategy_named`), every other field as is; None takes the field's default,
        so the API, the CLI and job files share one set of defaults."""
        unknown = sorted(set(fields) - set(_OPTIONS) - {"strategy"})
        if unknown:
            raise UsageError(f"unknown search option(s) {', '.join(unknown)}: options are "
                             f"strategy, start, size_step, {', '.join(_OPTIONS[1:])}")
        given = {k: v for k, v in fields.items() if v is not None}
        if not isinstance(strategy, str) and strategy is not None:
            return cls(strategy=strategy, **given)
        capacity = given.get("capacity_bytes", given.get("budget"))
        return cls(strategy=strategy_named(strategy, start, size_step, capacity,
                                           given.get("max_size", cls.max_size)), **given)


_OPTIONS = tuple(f.name for f in dataclasses.fields(SearchConfig))
# The strategies a name chooses (the command line's --strategy, a job file's strategy).
STRATEGIES: dict[str, type] = {"guided": Guided, "expand-bisect": ExpandBisect,
                               "doubling": Doubling, "linear-jump": LinearJump}
_RENAMED = {"e10": "expand-bisect"}  # old names, accepted for one release


def strategy_named(name: str | None, start: int | None = None, size_step: int | None = None,
                   capacity_bytes: int | None = None, max_size: int | None = None) -> Strategy:
    """The strategy called ``name`` (:data:`STRATEGIES`; None: ``guided``, or ``expand-bisect``
    where ``size_step`` is given) with its ``start`` and ``size_step`` (None: its defaults; a
    default start above ``max_size`` starts at ``max_size``: a LoRA run's effective batch of
    8 is below the default 32); ``linear-jump`` aims at ``capacity_bytes``.
    :class:`UsageError` for a bad name or option."""
    if name in _RENAMED:
        warnings.warn(f"strategy {name!r} is deprecated: use {_RENAMED[name]!r}", FutureWarning,
                      stacklevel=3)
        name = _RENAMED[name]
    name = name or ("expand-bisect" if size_step is not None else "guided")
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}: use one of {', '.join(STRATEGIES)}")
    if size_step is not None and name != "expand-bisect":
        raise UsageError(f"the size step (size_step, --size-step) is expand-bisect's increment; "
                         f"strategy {name} takes no size step (guided predicts, doubling "
                         "multiplies by 2, linear-jump fits a line); drop the size step, or use "
                         "strategy expand-bisect")
    default = getattr(STRATEGIES[name], "start", None)
    if start is None and max_size is not None and isinstance(default, int) and default > max_size:
        start = max_size
    params: dict[str, Any] = {"start": start} if start is not None else {}
    if size_step is not None:
        params["step"] = size_step
    if name == "linear-jump":
        if capacity_bytes is None:
            raise UsageError("strategy linear-jump needs a budget (or capacity_bytes) to aim at; "
                             "give --budget, or use another strategy")
        params["capacity_bytes"] = capacity_bytes
    return STRATEGIES[name](**params)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_positive_seconds(value: Any) -> bool:
    """A finite number > 0 (``inf`` would disable the limit it sets; ``nan`` compares false)."""
    return _is_number(value) and math.isfinite(value) and value > 0


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def resolve(config: SearchConfig | None, start: int | None, size_step: int | None,
            options: dict[str, Any]) -> SearchConfig:
    """The one SearchConfig that runs: ``config`` with ``options``; ``start`` and ``size_step``
    choose the strategy as the command line's ``--start`` and ``--size-step`` do
    (:func:`strategy_named`: guided from ``start``, expand-bisect where a size step is given)."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"search() got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"options are start, size_step, on_trial, {', '.join(_OPTIONS)}")
    if config is not None and not isinstance(config, SearchConfig):
        hint = f" (did you mean start={config!r}?)" if isinstance(config, int) else ""
        raise UsageError(f"search()'s second argument is a SearchConfig, got {config!r}{hint}; "
                         "pass config=SearchConfig(...) or leave it out")
    cfg = dataclasses.replace(config, **options) if config is not None else SearchConfig(**options)
    if start is None and size_step is None:
        return cfg if cfg.strategy is not None else dataclasses.replace(
            cfg, strategy=strategy_named(None, max_size=cfg.max_size))
    if cfg.strategy is not None:
        raise _shorthand_conflict(cfg.strategy, start, size_step)
    chosen = strategy_named(None, start, size_step, cfg.capacity_bytes or cfg.budget, cfg.max_size)
    return dataclasses.replace(cfg, strategy=chosen)


_OPTION_OF = {"start": "start", "step": "size_step"}  # a strategy's field -> search()'s option


def _shorthand_conflict(strategy: Strategy, start: int | None, size_step: int | None
                        ) -> UsageError:
    kind = type(strategy).__name__
    own = strategy_params(strategy)
    given = {k: v for k, v in (("start", start), ("step", size_step)) if v is not None}
    merged = own | {k: v for k, v in given.items() if k in own}
    lacking = [_OPTION_OF[k] for k in given if k not in own]
    note = f" ({kind} has no {' or '.join(lacking)})" if lacking else ""
    written = f"{kind}({', '.join(f'{k}={v!r}' for k, v in merged.items())})"
    return UsageError(f"start and size_step choose a strategy (guided, or expand-bisect with a "
                      f"size step) and do not apply beside strategy={kind}, which runs its own "
                      f"parameters: write strategy={written}{note}")
