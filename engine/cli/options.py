"""The options the commands share, each defined once: the workload options, the search options
and the one :class:`~oomguard.engine.core.search.config.SearchConfig` they become (checked
before any model is built), and argument types whose errors are one line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from oomguard.engine.errors import UsageError
from oomguard.engine.util.units import fmt_bytes, parse_size

if TYPE_CHECKING:
    import torch

DEFAULT_STEP = 8  # the expand-bisect increment
DEFAULT_START = 32  # SearchConfig's first size (Guided(32)), said in --help
DEFAULT_SEQ_LEN = 32  # every command's tokens per sample, as a job file's [data] seq_len
DEFAULT_CPU_BUDGET = "2GiB"
NO_BUDGET = "none"  # --budget none: no budget, the trials run to the limit that binds
REQUIRED = "required"  # a workload option's "default" when the command needs it given
STRATEGIES = ("guided", "expand-bisect", "doubling", "linear-jump")
# old spelling -> new, kept for one release (a deprecation line on stderr when used)
DEPRECATED_STRATEGIES = {"e10": "expand-bisect"}

# dest: (type, help); --seq-len and --samples are checked by check_workload, not by their
# type, so that a command whose default depends on the workload (estimate) says it as one line
_WORKLOAD: dict[str, tuple[Any, str]] = {
    "metric": (str, "metric name (see `oomguard metrics`)"),
    "knob": (str, "one memory knob of the metric"),
    "model": (str, "built-in name (tiny-gpt2, ...), MODEL_TYPE:key=value,... or a local "
                   "checkpoint folder"),
    "dtype": (str, "float32, bfloat16, float16 or float64"),
    "seq_len": (int, "tokens per sample"),
    "samples": (int, "samples the metric sees, result-defining"),
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number "
                                         "such as 16") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}; give 1 "
                                         "or more")
    return value


def nonnegative_int(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def margin(text: str) -> float | str:
    """``--margin``: a fraction in [0, 1), or ``measured`` (checked by SearchConfig)."""
    if text.strip().lower() == "measured":
        return "measured"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a fraction nor 'measured'; "
                                         "give one such as 0.05, or measured") from None


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def budget_size(text: str) -> int | str:
    """``--budget``: a size in bytes (``2GiB``, ``512MiB``), or :data:`NO_BUDGET` (``none``)."""
    if text.strip().lower() == NO_BUDGET:
        return NO_BUDGET
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or give 'none' for no budget") from None


def warn_deprecated(old: str, new: str) -> None:
    """The one line an old spelling prints on stderr (it still works, for one release)."""
    print(f"oomguard: warning: {old} is deprecated, use {new}", file=sys.stderr, flush=True)


class _Deprecated(argparse.Action):
    """An old option name kept for one release, hidden from ``--help``: one deprecation line
    per parse, then it does what the new option does (stores, or appends)."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "",
                 append: bool = False, **kwargs: Any) -> None:
        kwargs["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kwargs)
        self.new, self.append = new, append
        self._warned: set[int] = set()  # the namespaces (parses) already told

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if id(namespace) not in self._warned:
            self._warned.add(id(namespace))
            warn_deprecated(option_string or self.option_strings[0], self.new)
        if self.append:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def add_deprecated(p: argparse.ArgumentParser | Any, old: str, new: str, dest: str,
                   **kwargs: Any) -> None:
    """Accept ``old`` (renamed to ``new``, stored in ``dest``) for one release (:class:`_Deprecated`;
    ``append=True`` where ``new`` repeats; other keywords as ``add_argument`` takes them)."""
    p.add_argument(old, action=_Deprecated, new=new, dest=dest, default=argparse.SUPPRESS,
                   **kwargs)


def strategy_name(text: str) -> str:
    """``--strategy``'s value; a deprecated name (``e10``) becomes its new one after one line on
    stderr (argparse then checks it against :data:`STRATEGIES`)."""
    new = DEPRECATED_STRATEGIES.get(text)
    if new is None:
        return text
    warn_deprecated(f"--strategy {text}", f"--strategy {new}")
    return new


def add_remedy_options(p: argparse.ArgumentParser) -> None:
    """``--remedies NAMES`` and ``--effective-batch N``: price the ways to fit an effective
    batch that does not fit at one micro-batch (checked by :func:`remedy_names`)."""
    group = p.add_argument_group("remedies priced by speed")
    group.add_argument("--remedies", default=None, metavar="NAMES",
                       help="after the search, measure each named way to fit --effective-batch "
                            "rows (accumulate, checkpoint, bf16, expandable_segments; comma-"
                            "separated, e.g. accumulate,checkpoint) and report the fastest "
                            "whose peak keeps the margin; bf16 only when named")
    group.add_argument("--effective-batch", type=positive_int, default=None, metavar="N",
                       help="rows per optimizer step the remedies must fit (default: twice the "
                            "maximum batch size the search found, which one micro-batch "
                            "cannot hold)")


def remedy_names(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The ``--remedies`` names, checked (one line for a bad one), before any work; None
    without ``--remedies``. ``--effective-batch`` alone, or ``--remedies`` with trials in
    other processes, is one line too: pricing runs on this process's model."""
    from oomguard.engine.core.execute.priced import parse_remedies

    if args.remedies is None:
        if args.effective_batch is not None:
            raise UsageError("--effective-batch is the batch --remedies must fit; give "
                             "--remedies too (e.g. --remedies accumulate,checkpoint)")
        return None
    names = parse_remedies(args.remedies, "--remedies")
    if args.isolate or getattr(args, "confirm", False):
        raise UsageError("--remedies measures this process's model; drop --isolate and "
                         "--confirm to price remedies")
    return names


def add_progress_option(p: argparse.ArgumentParser) -> None:
    """``--progress``/``--no-progress``: steps done and the time left (an estimate) on
    stderr; by default only when stderr is a terminal."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show steps done and the estimated time left on stderr (default: "
                        "only when stderr is a terminal)")


def add_workload_options(p: argparse.ArgumentParser, group: Any = None, **defaults: Any) -> Any:
    """Add the workload options named by ``defaults``, each with its default:
    ``seq_len=32`` adds ``--seq-len``, default 32 (:data:`DEFAULT_SEQ_LEN`, every command's);
    :data:`REQUIRED` makes one required; ``(default, note)`` puts ``note`` in its help instead
    of the default. They go in ``group`` (the command's own "workload" group), else in a new
    one; the group is returned."""
    group = group if group is not None else p.add_argument_group("workload")
    for dest, default in defaults.items():
        kind, text = _WORKLOAD[dest]
        default, note = default if isinstance(default, tuple) else (default, f"default {default}")
        required = default == REQUIRED
        group.add_argument(f"--{dest.replace('_', '-')}", type=kind, required=required,
                           default=None if required else default,
                           help=text if required else f"{text} ({note})")
    return group


def add_plugin_option(p: argparse.ArgumentParser) -> None:
    """``--plugin FILE_OR_MODULE`` (repeatable): loaded by :func:`load_plugins` before the
    command runs, as a job file's ``plugins`` are."""
    p.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="import metrics from a .py file (relative to the current folder) or "
                        "a module, as a job file's plugins; repeat for several")


def load_plugins(specs: Sequence[str]) -> list[str]:
    """Import each ``--plugin`` as a job resolves its plugins (forkserver children too); the
    resolved plugins. UsageError (one line) for one that cannot be imported."""
    if not specs:
        return []
    from pathlib import Path

    from oomguard.engine.core.child import forkserver_context
    from oomguard.engine.jobs.plugins import PRELOAD, load_plugin

    loaded, defined = [], {}
    for spec in specs:
        try:
            loaded.append(load_plugin(spec, Path.cwd(), defined))
        except ValueError as exc:
            raise UsageError(f"--plugin {exc}") from None
    forkserver_context([PRELOAD])  # before the server starts: it imports them too
    return loaded


def check_workload(args: argparse.Namespace) -> None:
    """UsageError (one line), before any work, for a bad ``--seq-len`` or ``--samples``, a
    ``--start`` or ``--max-size`` no device holds (:func:`check_sizes`), or an unknown dtype."""
    for dest in ("seq_len", "samples"):
        value = getattr(args, dest, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{dest.replace('_', '-')} must be a positive integer, got "
                             f"{value}; give 1 or more")
    if getattr(args, "seq_len", None) is not None:
        from oomguard.engine.jobs.data import check_samples, check_seq_len_floor

        try:
            check_seq_len_floor(args.seq_len, "--seq-len")
            given = getattr(args, "samples", None)  # None: the command's default count
            check_samples(given or 1, args.seq_len, given and "--samples", "--seq-len")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        # the search options, as given (a search caps them at the knob's useful sizes)
        check_sizes([(f"--{dest.replace('_', '-')}", getattr(args, dest))
                     for dest in ("start", "max_size") if getattr(args, dest, None)],
                    args.seq_len)
    if getattr(args, "dtype", None) is not None:
        from oomguard.metrics.models import parse_dtype

        parse_dtype(args.dtype)


def check_sizes(sizes: Sequence[tuple[str, int]], seq_len: int) -> None:
    """UsageError (one line) for a size (``(option, value)``) whose batch of ``size x
    seq_len`` tokens no device holds (:func:`~oomguard.engine.jobs.data.check_size`)."""
    from oomguard.engine.jobs.data import check_size

    for option, value in sizes:
        try:
            check_size(value, seq_len, option)
        except ValueError as exc:
            raise UsageError(str(exc)) from None


def isolated(args: argparse.Namespace, dev: torch.device) -> bool:
    """Whether the search's trials run in fresh children: ``--isolate``, and always on MPS,
    which aborts the process on a tensor over 4 GiB instead of raising (a trial must not
    take the search down with it)."""
    return bool(args.isolate) or dev.type == "mps"


# The search options as SearchConfig names them; one not given (None) takes SearchConfig's default.
_SEARCH_OPTIONS = ("strategy", "start", "size_step", "max_size", "max_trials", "margin",
                   "steps_per_trial", "verify_steps", "trial_timeout", "fork")


def search_config(args: argparse.Namespace, dev: torch.device) -> Any:
    """The one :class:`~oomguard.engine.core.search.config.SearchConfig` the options describe,
    built as the API and a job file build it (:meth:`SearchConfig.from_options`: an option not
    given takes its default), every option checked before any model is built. Sets
    ``args.lowered_budget``: why the default CPU budget was dropped (:func:`lowered_default`),
    or None."""
    from oomguard.engine.core.memory.budget import check_budget
    from oomguard.engine.core.search.config import SearchConfig

    start, top = getattr(args, "start", None), getattr(args, "max_size", None)
    if start is not None and top is not None and start > top:
        raise UsageError(f"--start {start} is larger than --max-size {top}; lower --start "
                         "or raise --max-size")
    nbytes, args.lowered_budget = _default_budget(dev, args.budget)  # the first line says it
    if nbytes is not None:
        check_budget(nbytes, dev)
    capacity = None
    if nbytes is None and dev.type == "cuda" and args.strategy == "linear-jump":
        from oomguard.probes import probe

        capacity = probe(dev).free_bytes  # only where the strategy needs a number to aim at
    isolate = isolated(args, dev)
    return SearchConfig.from_options(
        **{name: getattr(args, name, None) for name in _SEARCH_OPTIONS}, device=dev,
        budget=nbytes, capacity_bytes=capacity, isolate=isolate,
        confirm=bool(getattr(args, "confirm", False)) and not isolate)


def knob_search_config(config: Any, args: argparse.Namespace, unit: int, cap: int) -> Any:
    """``config`` for one knob of granularity ``unit`` searched up to ``cap``, as a job sizes a
    knob (:func:`~oomguard.engine.jobs.sizing.knob_config`); ``--align N`` tries only multiples
    of N too."""
    import math

    from oomguard.engine.jobs.sizing import knob_config

    return knob_config(config, math.lcm(unit, getattr(args, "align", None) or 1), cap)


def default_budget(dev: torch.device, given: int | str | None) -> int | None:
    """The budget a search runs under (bytes): the one given (:data:`NO_BUDGET`: None); on CPU
    2 GiB, or None where the OS cannot cap host memory or the default does not fit the room
    this process has (:func:`lowered_default`: the trials then run to the limit that binds,
    as with ``--budget none``); on CUDA None, so trials meet the device's own limit, whatever
    the warm-up left free (a number probed before the warm-up counted the model twice); on MPS
    the probed recommended working set left, since MPS's default cap (1.7x that) lets a process
    swap before it runs out."""
    return _default_budget(dev, given)[0]


def _default_budget(dev: torch.device, given: int | str | None) -> tuple[int | None, str | None]:
    """:func:`default_budget`, and :func:`lowered_default`'s line where that decided it (read
    once, before any warm-up: the reason said is the one that chose)."""
    if given == NO_BUDGET:
        return None, None
    if given is not None:
        return int(given), None
    if dev.type == "cpu":
        from oomguard.engine.core.memory.budget import host_budgets_available

        if not host_budgets_available():
            return None, None
        why = lowered_default(dev)
        return (None, why) if why is not None else (parse_size(DEFAULT_CPU_BUDGET), None)
    if dev.type == "cuda":
        return None, None
    from oomguard.probes import probe

    return probe(dev).free_bytes, None


def lowered_default(dev: torch.device) -> str | None:
    """Why the default CPU budget (:data:`DEFAULT_CPU_BUDGET`) does not fit this process now,
    in words, for the search's first line and its report; None where it fits (or off the CPU).
    It does not fit past the room a memory cgroup leaves (its own or an ancestor's, less the
    slack a budget keeps under it: past it the kernel kills), an ``RLIMIT_DATA`` set around
    the process, or the RAM the host has available. Without it the trials run under a budget
    at the room the tightest enforced limit leaves when they start, else the RAM guard."""
    from oomguard.engine.core.memory.budget import cgroup_budget_room, host_budgets_available

    if dev.type != "cpu" or not host_budgets_available():  # no default budget to lower
        return None
    from oomguard.probes import host

    nbytes = parse_size(DEFAULT_CPU_BUDGET)
    cgroup = cgroup_budget_room()
    rooms = [] if cgroup is None else [
        (cgroup[0], f"the cgroup memory limit of {fmt_bytes(cgroup[1])} leaves")]
    rooms += [(lim.room_bytes, f"RLIMIT_DATA {fmt_bytes(lim.limit_bytes)} leaves")
              for lim in host.enforced_limits() if lim.name == "RLIMIT_DATA"]
    avail = host.meminfo().get("MemAvailable")
    if avail is not None:
        rooms.append((avail, "this host has available"))
    room, where = min(rooms, key=lambda r: r[0], default=(nbytes, ""))
    if room >= nbytes:
        return None
    return (f"the default {fmt_bytes(nbytes)} budget is more than the {fmt_bytes(max(0, room))} "
            f"{where}: lowered to the limit that binds; --budget BYTES sets another")


def budget_free_limit(device: str, why: str | None = None) -> str:
    """What limits trials without a budget, in words, for the search's first line: a GPU's own
    limit; on the host the enforced limit or the RAM guard that binds now, and why no budget
    (``why``, e.g. :func:`lowered_default`'s line, else found here)."""
    from oomguard.engine.core.search.limit import unbudgeted_limit
    from oomguard.probes import host

    if not str(device).startswith("cpu"):
        return "the device's own limit"
    limit = unbudgeted_limit(device)
    why = why or host.host_budget_unavailable() or "no budget given"
    if limit is None:
        return f"no budget ({why}; available RAM unknown: bounded by --max-size only)"
    return f"the {limit.describe()} ({why})"


def add_search_options(p: argparse.ArgumentParser, verify_steps: bool = True,
                       device: tuple[str | None, str] = ("cpu", "default: cpu")) -> None:
    """The search options, each with the one default every command shares; ``verify_steps``
    False where the command cannot verify its answers (``reference``): no ``--verify-steps``
    offered that the command would refuse. ``device``: ``--device``'s default and what its
    help says of it."""
    p.add_argument("--device", default=device[0], help=f"cpu, cuda, cuda:N or mps ({device[1]})")
    p.add_argument("--budget", type=budget_size, default=None,
                   help="memory the trials may use above the warmed-up process, e.g. 2GiB, "
                        "512MiB, 2GB, or 'none': trials run to the limit that binds, a "
                        "container's or job's cgroup included (default: 2GiB on a Linux CPU, "
                        "lowered to the room a cgroup, RLIMIT_DATA or the available RAM leaves; "
                        "none on CUDA: trials meet the device's own limit; on MPS the "
                        "recommended working set left)")
    p.add_argument("--start", type=positive_int, default=None,
                   help=f"first size (default {DEFAULT_START})")
    p.add_argument("--size-step", type=positive_int, default=None, metavar="N",
                   help=f"expand-bisect's size increment (default {DEFAULT_STEP}; only with "
                        "--strategy expand-bisect; a knob with a unit steps in whole units, at "
                        "least one)")
    add_deprecated(p, "--step", "--size-step", "size_step", type=positive_int)
    p.add_argument("--max-size", type=positive_int, default=None,
                   help="largest size to try (default 65536)")
    p.add_argument("--max-trials", type=positive_int, default=None,
                   help="trial limit (default 64)")
    p.add_argument("--strategy", type=strategy_name, choices=STRATEGIES, default=None,
                   metavar="{" + ",".join(STRATEGIES) + "}",
                   help="guided: predict from measured peaks, verify, bracket (default; "
                        "expand-bisect when --size-step is given); expand-bisect: +size-step "
                        "while it fits, then bisect; doubling; linear-jump")
    p.add_argument("--steps-per-trial", type=positive_int, default=None, metavar="N",
                   help="steps each trial runs (default: the workload's own steps_per_trial, "
                        "else 1)")
    if verify_steps:
        p.add_argument("--verify-steps", type=nonnegative_int, default=0, metavar="N",
                       help="run N further steps at the recommended size and report any OOM")
    p.add_argument("--align", type=positive_int, default=None, metavar="N",
                   help="try only multiples of N (8 for tensor cores)")
    p.add_argument("--margin", type=margin, default=None,
                   help="fraction of what grows with the size (the usable memory above the "
                        "fixed weights, gradients and optimizer state) the recommended size "
                        "keeps free, or 'measured' (default): twice the largest spread of a "
                        "trial's steady step peaks, at least 3%% of what grows")
    p.add_argument("--isolate", action="store_true",
                   help="run each trial in a fresh child process (the faithful maximum)")
    p.add_argument("--no-fork", dest="fork", action="store_const", const=False, default=None,
                   help="run the trials in this process, not in forks of it (the default on a "
                        "Linux CPU: what a trial leaves, such as a conv net's kernels for each "
                        "size, dies with its fork)")
    p.add_argument("--confirm", action="store_true",
                   help="search in this process, then confirm the answer in fresh child "
                        "processes and go on there where they disagree (the faithful "
                        "maximum, at close to in-process cost)")
    p.add_argument("--trial-timeout", type=float, default=None, metavar="SECONDS",
                   help="kill an isolated trial still running after SECONDS; the search ends "
                        "with an error, not an OOM (default 600)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    add_progress_option(p)
