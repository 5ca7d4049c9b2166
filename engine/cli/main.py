"""The ``oomguard`` command line.

Subcommands: ``probe`` (memory of every device), ``bench`` (maximum batch size
of the built-in GPT-2 training step, with a report), ``search`` (maximum safe
size of a metric's memory knobs), ``estimate`` (peak memory at given sizes,
estimated without running), ``verify`` (further steps at a report's recommended
size), ``metrics`` (what can be searched), ``run``
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
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.engine.cli.devices import budget_free_limit, resolve_device
from oomguard.engine.cli.logs import error_text, setup_logging
from oomguard.engine.cli.options import (
    add_search_options,
    confirmed,
    isolated,
    positive_int,
    search_config,
)
from oomguard.engine.cli.verify import workload_spec
from oomguard.engine.errors import SearchFailed, UsageError
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes.probe import parse_device

if TYPE_CHECKING:

    from oomguard.probes import MemorySnapshot

@dataclass(frozen=True)
class Progress:
    """One line on stderr per trial: ``  batch     48  ok   peak 1.93 GiB  (5.60 s)``;
    ``mark_fresh``: end the lines of trials run in a fresh child with ``fresh``. A class,
    not a closure, so that a search run in another process can take it along."""

    label: str
    mark_fresh: bool = False

    def __call__(self, trial: Any) -> None:
        error = error_text(trial.error)
        peak = f"peak {fmt_bytes(trial.peak_bytes)}" if trial.ok else error[:100]
        verdict = "ok " if trial.ok else "RAM guard" if trial.guarded else "OOM"
        fresh = "  fresh" if self.mark_fresh and trial.mode == "isolated" else ""
        print(f"  {self.label} {trial.size:>6}  {verdict}  {peak}  "
              f"({trial.seconds:.2f} s){fresh}", file=sys.stderr, flush=True)


def _search(workload: Any, config: Any, context: dict[str, Any]) -> Any:
    """Run one search planned (and checked) before; None (after one line) if no size fit."""
    from oomguard.engine.core.search.search import search
    from oomguard.engine.errors import NoSizeFits
    from oomguard.metrics.workload import snap_to_unit

    unit = getattr(config.strategy, "unit", 1)
    limit = fmt_bytes(config.budget) if config.budget is not None else budget_free_limit(
        config.device)
    print(f"oomguard: searching {workload.name} on {config.device} under "
          f"{limit} ({'isolated' if config.isolate else 'in-process'} trials"
          f"{', the answer confirmed in fresh processes' if config.confirm else ''}"
          f"{f', sizes in multiples of {unit}' if unit > 1 else ''})", file=sys.stderr, flush=True)
    try:
        result = search(workload, config, on_trial=Progress(context.get("knob", "batch"),
                                                               config.confirm))
    except NoSizeFits as exc:  # other knobs may still fit; TrialFailed goes to main()
        print(f"oomguard: {exc}", file=sys.stderr)
        return None
    snap_to_unit(result, unit)
    return result


def _report(args: argparse.Namespace, result: Any, context: dict[str, Any], out: Path) -> int:
    """Write the report into ``out`` and print the result; 0, or 1 and one line naming the
    path when something could not be written (a full disk): the result is still printed."""
    from oomguard.engine.util.jsonable import json_text
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
    from oomguard.engine.util.jsonable import json_text
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
    if isolated(args, dev) or confirmed(args):  # started now: imports overlap the checks
        from oomguard.engine.core.child import start_forkserver

        start_forkserver(TrainStep.preload + (TrainStep.__module__,))
    check_seq_len(model_config(args.model), args.seq_len)
    config = search_config(args, dev, args.max_size)
    out = Path(args.out)
    check_output_folder(out)
    workload = TrainStep(model=args.model, seq_len=args.seq_len, device=args.device)
    if not config.isolate:
        # Warm up before the search probes free memory, so capacity excludes the model.
        # Isolated, this process keeps nothing on the device: children measure alone.
        workload.warmup()
    context = workload.describe() | {"workload_spec": workload_spec(workload)}
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
    if isolated(args, dev) or confirmed(args):  # started now: imports overlap the planning
        from oomguard.engine.core.child import start_forkserver, workload_preload

        first = MetricTrial(metric=args.metric, knob=args.knob or knobs[0], model=args.model)
        start_forkserver(workload_preload(first))
    check_seq_len(model_config(args.model), args.seq_len)
    plans = []  # every knob's search planned (and checked) before the first one runs
    for knob in [args.knob] if args.knob else knobs:
        trial = MetricTrial(metric=args.metric, knob=knob, model=args.model, dtype=args.dtype,
                            device=args.device, n_samples=args.samples, seq_len=args.seq_len)
        max_size = min(trial.max_size() or args.max_size, args.max_size)
        out = Path(args.out) / knob if len(knobs) > 1 and not args.knob else Path(args.out)
        ns = argparse.Namespace(**vars(args) | {"start": min(args.start, max_size)})
        config = search_config(ns, dev, max_size, trial.unit())
        plans.append((trial, config, trial.report_context() | {"workload_spec": workload_spec(trial)},
                      out))
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
    add_search_options(p, start=32)
    p.add_argument("--model", default="tiny-gpt2",
                   help="built-in name, MODEL_TYPE:key=value,... or a local checkpoint dir")
    p.add_argument("--seq-len", type=positive_int, default=512, help="sequence length (512)")
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
    p.add_argument("--samples", type=positive_int, default=64, help="samples (result-defining)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="sequence length (128)")
    add_search_options(p, start=8)
    p.add_argument("--out", default="oomguard-report", help="report folder (oomguard-report)")
    p.set_defaults(func=cmd_search)

    from oomguard.engine.cli import catalogue
    from oomguard.engine.cli import estimate as estimate_cli
    from oomguard.engine.cli import jobs as jobs_cli
    from oomguard.engine.cli import reference as reference_cli
    from oomguard.engine.cli import verify as verify_cli

    catalogue.register(sub)
    estimate_cli.add_parser(sub)
    verify_cli.add_parser(sub)
    reference_cli.add_parser(sub)

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
