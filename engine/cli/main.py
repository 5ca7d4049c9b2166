"""The ``oomguard`` command line.

Subcommands: ``probe`` (memory of every device), ``bench`` (maximum batch size
of the built-in GPT-2 training step, with a report), ``search`` (maximum safe
size of a metric's memory knobs), ``estimate`` (peak memory at given sizes,
estimated without running), ``metrics`` (what can be searched), ``run``
and ``cache`` (overnight jobs). Sizes are given with units (``2GiB``,
``512MiB``, ``2GB``) or in bytes.

One error policy: a :class:`~oomguard.engine.errors.UsageError` (bad input, checked
before any work) is one line on stderr and exit code 2; a search without an answer, or a
result that cannot be written (a full disk), one line and exit 1; Ctrl-C one line and
130; anything else is a bug and keeps its traceback.

Start-up: no torch or engine import at module level (``oomguard --help`` answers in well
under a second); each command imports what it needs, inside the command functions.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.engine.cli.devices import budget_free_limit, default_budget, resolve_device
from oomguard.engine.cli.logs import setup_logging
from oomguard.engine.core.units import fmt_bytes, parse_size
from oomguard.engine.errors import SearchFailed, UsageError
from oomguard.probes.probe import parse_device

if TYPE_CHECKING:
    import torch

    from oomguard.probes import MemorySnapshot

DEFAULT_STEP = 8  # the E10 routine's increment


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _strategy(args: argparse.Namespace, capacity: int | None, unit: int, max_size: int) -> Any:
    """The strategy the options name; for a knob whose memory changes only at multiples of
    ``unit``, ``--start``/``--step`` in whole units (at least one) and only multiples tried."""
    import math

    from oomguard.engine.core.strategies import E10, Doubling, Guided, LinearJump
    from oomguard.metrics.workload import in_units, in_whole_units

    # --step alone names the E10 routine (its increment); otherwise the default is guided.
    name = args.strategy or ("e10" if args.step is not None else "guided")
    if name != "e10" and args.step is not None:
        raise UsageError(f"--step is the e10 increment; --strategy {name} takes no "
                         "--step (guided predicts, doubling multiplies by 2, linear-jump fits)")
    align = getattr(args, "align", None)  # a Namespace built by hand may lack newer options
    if align and align > 1:  # tensor cores: sizes in multiples of 8
        unit = unit * align // math.gcd(unit, align)
    unit, start, step = in_whole_units(args.start, args.step or DEFAULT_STEP, unit, max_size)
    inner: Any = E10(start=start, step=step)
    if name == "guided":
        inner = Guided(start=start)
    elif name == "doubling":
        inner = Doubling(start=start)
    elif name == "linear-jump":
        if capacity is None:
            raise UsageError("--strategy linear-jump needs a --budget (or a GPU's free memory)")
        inner = LinearJump(capacity_bytes=capacity, start=start)
    return in_units(inner, unit)


def _search_config(args: argparse.Namespace, dev: torch.device, max_size: int,
                   unit: int = 1) -> Any:
    """Every search option checked before any model is built (a bad --margin fails first)."""
    from oomguard.engine.core.budget import check_budget
    from oomguard.engine.core.search import SearchConfig

    if args.start > max_size:
        raise UsageError(f"--start {args.start} is larger than --max-size {max_size}")
    nbytes = default_budget(dev, args.budget)
    if nbytes is not None:
        check_budget(nbytes, dev)
    capacity = nbytes
    if capacity is None and dev.type == "cuda" and args.strategy == "linear-jump":
        from oomguard.probes import probe

        capacity = probe(dev).free_bytes  # only where the strategy needs a number to aim at
    timeout = {} if args.trial_timeout is None else {"trial_timeout": args.trial_timeout}
    # MPS aborts the process on a tensor over 4 GiB instead of raising: a trial must not
    # take the search down with it.
    isolate = args.isolate or dev.type == "mps"
    return SearchConfig(strategy=_strategy(args, capacity, unit, max_size), max_size=max_size,
                        max_trials=args.max_trials, device=dev, budget=nbytes,
                        isolate=isolate, margin=args.margin,
                        steps_per_trial=getattr(args, "steps_per_trial", None),
                        verify_steps=getattr(args, "verify_steps", 0), **timeout)


def _progress(label: str) -> Any:
    """One line on stderr per trial: ``  batch     48  ok   peak 1.93 GiB  (5.60 s)``."""
    def show(trial: Any) -> None:
        # c10's "[enforce fail at alloc_cpu.cpp:127] err == 0." prefix says nothing to users.
        error = re.sub(r"\[enforce fail at [^\]]*\][^.]*\.\s*", "", trial.error or "")
        peak = f"peak {fmt_bytes(trial.peak_bytes)}" if trial.ok else error[:100]
        verdict = "ok " if trial.ok else "RAM guard" if trial.guarded else "OOM"
        print(f"  {label} {trial.size:>6}  {verdict}  {peak}  "
              f"({trial.seconds:.2f} s)", file=sys.stderr, flush=True)
    return show


def _search(workload: Any, config: Any, context: dict[str, Any]) -> Any:
    """Run one search planned (and checked) before; None (after one line) if no size fit."""
    from oomguard.engine.core.search import search
    from oomguard.engine.errors import NoSizeFits
    from oomguard.metrics.workload import snap_to_unit

    unit = getattr(config.strategy, "unit", 1)
    limit = fmt_bytes(config.budget) if config.budget is not None else budget_free_limit(
        config.device)
    print(f"oomguard: searching {workload.name} on {config.device} under "
          f"{limit} ({'isolated' if config.isolate else 'in-process'} trials"
          f"{f', sizes in multiples of {unit}' if unit > 1 else ''})", file=sys.stderr, flush=True)
    try:
        result = search(workload, config, on_trial=_progress(context.get("knob", "batch")))
    except NoSizeFits as exc:  # other knobs may still fit; TrialFailed goes to main()
        print(f"oomguard: {exc}", file=sys.stderr)
        return None
    snap_to_unit(result, unit)
    return result


def _report(args: argparse.Namespace, result: Any, context: dict[str, Any], out: Path) -> int:
    """Write the report into ``out`` and print the result; 0, or 1 and one line naming the
    path when something could not be written (a full disk): the result is still printed."""
    from oomguard.engine.core.jsonable import json_text
    from oomguard.reports import write_report

    paths: dict[str, Path] = {}
    failure = None  # the one error line, if any
    try:
        paths = write_report(result, out, context=context)
    except OSError as exc:
        failure = (f"cannot write the report to {exc.filename or out}: "
                   f"{exc.strerror or exc}; the result is on stdout")
    try:
        files = {k: str(v) for k, v in paths.items()}
        if args.json:
            print(json_text(result.to_dict() | {"files": files}), end="")
        else:
            what = f"maximum {context['knob']}" if "knob" in context else "maximum batch size"
            print(f"{what}: {result.max_ok} (first OOM: {result.first_oom}); recommended: "
                  f"{result.recommendation.safe}; {len(result.trials)} trials in "
                  f"{result.seconds:.1f} s")
            check = result.verification
            if check:
                print(f"verify: {check['steps']} steps at {check['size']}: "
                      + ("ok" if check["ok"] else f"OUT OF MEMORY ({(check['error'] or '')[:80]})"))
            if files:
                print(f"report: {files['markdown']}\nplot:   {files['png']}\njson:   {files['json']}")
        sys.stdout.flush()  # a full disk under a redirected stdout fails here, not at exit
    except OSError as exc:
        failure = f"cannot write to standard output: {exc.strerror or exc}"
    if failure is not None:
        print(f"oomguard: error: {failure}", file=sys.stderr)
        return 1
    return 0


def probe_table(snapshots: Sequence[MemorySnapshot]) -> str:
    """A plain-text table of memory snapshots, sizes in GiB."""
    rows = [("device", "name", "total", "free", "this process", "other processes", "note")]
    for s in snapshots:
        rows.append((s.device, s.name, fmt_bytes(s.total_bytes, "GiB"),
                     fmt_bytes(s.free_bytes, "GiB"), fmt_bytes(s.process_bytes, "GiB"),
                     fmt_bytes(s.other_processes_bytes, "GiB"), s.reason or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def cmd_probe(args: argparse.Namespace) -> int:
    from oomguard.engine.core.jsonable import json_text
    from oomguard.probes import probe, probe_all

    if args.device:
        try:
            parse_device(args.device)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    snaps = [probe(args.device)] if args.device else probe_all()
    if args.json:
        print(json_text([s.to_dict() for s in snaps]), end="")
    else:
        print(probe_table(snaps))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from oomguard.engine.jobs.output import check_output_folder
    from oomguard.metrics.models import check_seq_len, model_config
    from oomguard.metrics.train_step import TrainStep

    # Every input is checked before the model is built; the folder last (none left behind).
    dev = resolve_device(args.device)
    check_seq_len(model_config(args.model), args.seq_len)
    config = _search_config(args, dev, args.max_size)
    out = Path(args.out)
    check_output_folder(out)
    workload = TrainStep(model=args.model, seq_len=args.seq_len, device=args.device)
    if not config.isolate:
        # Warm up before the search probes free memory, so capacity excludes the model.
        # Isolated, this process keeps nothing on the device: children measure alone.
        workload.warmup()
    context = workload.describe()
    context["title"] = f"{args.model} training step: Maximum Batch Size Report"
    result = _search(workload, config, context)
    return 1 if result is None else _report(args, result, context, out)


def cmd_search(args: argparse.Namespace) -> int:
    from oomguard.engine.jobs.output import check_output_folder
    from oomguard.metrics.base import get_metric
    from oomguard.metrics.models import check_seq_len, model_config
    from oomguard.metrics.workload import MetricTrial

    metric = get_metric(args.metric)
    knobs = [k.name for k in metric.memory_knobs()]
    if args.knob and args.knob not in knobs:
        raise UsageError(f"metric {args.metric!r} has no memory knob {args.knob!r}: "
                         f"valid: {', '.join(knobs)}")
    dev = resolve_device(args.device)
    check_seq_len(model_config(args.model), args.seq_len)
    plans = []  # every knob's search planned (and checked) before the first one runs
    for knob in [args.knob] if args.knob else knobs:
        trial = MetricTrial(metric=args.metric, knob=knob, model=args.model, dtype=args.dtype,
                            device=args.device, n_samples=args.samples, seq_len=args.seq_len)
        max_size = min(trial.max_size() or args.max_size, args.max_size)
        out = Path(args.out) / knob if len(knobs) > 1 and not args.knob else Path(args.out)
        ns = argparse.Namespace(**vars(args) | {"start": min(args.start, max_size)})
        config = _search_config(ns, dev, max_size, trial.unit())
        plans.append((trial, config, trial.report_context(), out))
    for *_, out in plans:  # last, so a bad option leaves no folder behind
        check_output_folder(out)
    status = 0
    for trial, config, context, out in plans:
        result = _search(trial, config, context)
        if result is None:  # nothing fitted this knob; the others may still fit
            status = 1
            continue
        if _report(args, result, context, out):
            return 1  # nowhere to write (a full disk): the reports already written stay whole
    return status


def _add_search_options(p: argparse.ArgumentParser, start: int) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    p.add_argument("--budget", type=_size, default=None,
                   help="memory the trials may use above the warmed-up process, e.g. 2GiB, "
                        "512MiB, 2GB (default: 2GiB on a Linux CPU; none on CUDA: trials meet "
                        "the device's own limit; on MPS the recommended working set left)")
    p.add_argument("--start", type=_positive_int, default=start, help=f"first size (default {start})")
    p.add_argument("--step", type=_positive_int, default=None,
                   help=f"e10 increment (default {DEFAULT_STEP}; only with --strategy e10; "
                        "a knob with a unit steps in whole units, at least one)")
    p.add_argument("--max-size", type=_positive_int, default=65536, help="largest size to try")
    p.add_argument("--max-trials", type=_positive_int, default=40, help="trial limit (default 40)")
    p.add_argument("--strategy", choices=("guided", "e10", "doubling", "linear-jump"),
                   default=None,
                   help="guided: predict from measured peaks, verify, bracket (default; e10 "
                        "when --step is given); e10: +step then bisect; doubling; linear-jump")
    p.add_argument("--steps-per-trial", type=_positive_int, default=None, metavar="N",
                   help="steps each trial runs (default: the workload's own steps_per_trial, "
                        "else 1)")
    p.add_argument("--verify-steps", type=_nonnegative_int, default=0, metavar="N",
                   help="run N further steps at the recommended size and report any OOM")
    p.add_argument("--align", type=_positive_int, default=None, metavar="N",
                   help="try only multiples of N (8 for tensor cores)")
    p.add_argument("--margin", type=float, default=0.15,
                   help="fraction of capacity the recommended size keeps free (default 0.15)")
    p.add_argument("--isolate", action="store_true",
                   help="run each trial in a fresh child process (the faithful maximum)")
    p.add_argument("--trial-timeout", type=float, default=None, metavar="SECONDS",
                   help="kill an isolated trial still running after SECONDS; the search ends "
                        "with an error, not an OOM (default 600)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oomguard", description="Measure memory, find the largest safe batch, survive OOMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("probe", help="memory of every device (bytes measured now)",
                       description="Memory of the host and of every GPU, measured now (well "
                       "under a second).")
    p.add_argument("--device", default=None, help="one device only (cpu, cuda:N, mps)")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("bench", help="maximum batch size of the built-in GPT-2 training step",
                       description="Search the maximum batch size of a training step (forward, "
                       "backward, AdamW) of a small GPT-2 (random init, vocab 256) and write "
                       "report.md, report.json and memory.png: about 2 minutes on 2 CPU "
                       "cores with the defaults.")
    _add_search_options(p, start=32)
    p.add_argument("--model", default="tiny-gpt2",
                   help="built-in name, MODEL_TYPE:key=value,... or a local checkpoint dir")
    p.add_argument("--seq-len", type=_positive_int, default=512, help="sequence length (512)")
    p.add_argument("--out", default="oomguard-report", help="report folder (oomguard-report)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("search", help="maximum safe size of a metric's memory knobs",
                       description="The maximum safe size of each memory knob of a metric. "
                       "Each trial runs the whole metric (time grows with --samples and "
                       "--seq-len): --metric integrated_gradients takes about 13 minutes on 2 "
                       "CPU cores with the defaults. A knob with a unit (`oomguard metrics`) "
                       "is searched in multiples of it.")
    p.add_argument("--metric", required=True, help="metric name (see `oomguard metrics`)")
    p.add_argument("--knob", default=None, help="one memory knob (default: each in turn)")
    p.add_argument("--model", default="tiny-gpt2", help="model spec (default tiny-gpt2)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, float64")
    p.add_argument("--samples", type=_positive_int, default=64, help="samples (result-defining)")
    p.add_argument("--seq-len", type=_positive_int, default=128, help="sequence length (128)")
    _add_search_options(p, start=8)
    p.add_argument("--out", default="oomguard-report", help="report folder (oomguard-report)")
    p.set_defaults(func=cmd_search)

    from oomguard.engine.cli import catalogue
    from oomguard.engine.cli import estimate as estimate_cli
    from oomguard.engine.cli import jobs as jobs_cli

    catalogue.register(sub)
    estimate_cli.add_parser(sub)

    jobs_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``oomguard`` console script; returns the exit code. Ctrl-C
    anywhere (parser, imports, a search) is one line, ``oomguard: interrupted``, exit 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("oomguard: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # `run` reports its progress through the log; the other commands print results.
    quiet = logging.INFO if args.command == "run" else logging.WARNING
    setup_logging(logging.DEBUG if args.verbose else quiet)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"oomguard: error: {exc}", file=sys.stderr)
        return 2
    except SearchFailed as exc:  # the trials that ran are in exc.result (and any report)
        if exc.__cause__ is not None:  # a crash or a bug ended it: show where, then the summary
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"oomguard: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `oomguard probe --json | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
