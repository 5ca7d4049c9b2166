"""``oomguard bench`` (the maximum batch size of the built-in GPT-2 training step) and
``oomguard search`` (the maximum safe size of each memory knob of a metric): a search
planned and checked before it runs, one progress line per trial, a report.

No torch import at module level: each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from oomguard.engine.cli.options import (
    DEFAULT_SEQ_LEN,
    REQUIRED,
    add_plugin_option,
    add_remedy_options,
    add_search_options,
    add_workload_options,
    budget_free_limit,
    check_workload,
    isolated,
    knob_search_config,
    remedy_names,
    search_config,
)
from oomguard.engine.cli.verify import workload_spec
from oomguard.engine.errors import UsageError
from oomguard.engine.jobs.progress import Progress, Steps, wanted
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes.device import resolve_device


def add_bench(p: argparse.ArgumentParser) -> None:
    p.description = ("Search the maximum batch size of a training step (forward, backward, AdamW) "
                     "of a small GPT-2 (random init, vocab 256) and write report.md, report.json "
                     "and memory.png. With the defaults: 12 trials, 137 s on 2 idle CPU cores "
                     "(docs/benchmarks.md#how-long-the-commands-take).")
    add_workload_options(p, model="tiny-gpt2", seq_len=DEFAULT_SEQ_LEN)
    add_search_options(p)
    add_remedy_options(p)
    p.add_argument("--lengths", default=None, metavar="FILE",
                   help="plan batches from a dataset's sample lengths (one integer a line; "
                        "or a distribution of 8 to 256 tokens, uniform, long-tail or "
                        "bimodal, NAME[:N] for N samples, 5,000 by default) too: searches at up to 3 lengths (the longest replaces --seq-len), "
                        "written as shapes.json, shapes.png, shapes.md and a section of "
                        "report.md; the plan is kept in the size cache, and a second run "
                        "with the same model, device, budget and searched lengths reads it "
                        "back without a trial")
    p.add_argument("--cache", metavar="PATH",
                   help="with --lengths: size cache file (default: sizes.json in the user "
                        "cache folder)")
    p.add_argument("--no-cache", action="store_true",
                   help="with --lengths: plan again even where the size cache has the plan, "
                        "and replace it there")
    p.add_argument("--out", default="oomguard-report", metavar="DIR",
                   help="report folder (default oomguard-report)")
    p.set_defaults(func=cmd_bench)


def add_search(p: argparse.ArgumentParser) -> None:
    p.description = ("The maximum safe size of each memory knob of a metric. Each trial runs "
                     "the whole metric (time grows with --samples and --seq-len): --metric "
                     "integrated_gradients took 35 s (4 trials) with the defaults on 2 idle CPU "
                     "cores (docs/benchmarks.md#how-long-the-commands-take). Knobs are sized as a "
                     "job sizes them: in turn, each with the ones before it at their found sizes. "
                     "A knob with a unit (`oomguard metrics`) is searched in multiples of it.")
    add_workload_options(p, metric=REQUIRED, knob=(None, "default: each in turn"),
                         model="tiny-gpt2", dtype="float32", samples=64, seq_len=DEFAULT_SEQ_LEN)
    add_search_options(p)
    p.add_argument("--out", default="oomguard-report", metavar="DIR",
                   help="report folder (default oomguard-report)")
    add_plugin_option(p)
    p.set_defaults(func=cmd_search)


def _search(workload: Any, config: Any, context: dict[str, Any], show: bool = False) -> Any:
    """Run one search planned (and checked) before; where no size fit, one line and the
    result with no maximum.
    ``show``: trials done and the estimated time left on stderr (:class:`Steps`)."""
    from oomguard.engine.core.search.search import trial_mode
    from oomguard.engine.errors import NoSizeFits
    from oomguard.engine.jobs.sizing import run_search

    unit = getattr(config.strategy, "unit", 1)
    limit = fmt_bytes(config.budget) if config.budget is not None else budget_free_limit(
        config.device, context.get("default_budget"))
    print(f"oomguard: searching {workload.name} on {config.device} under "
          f"{limit} ({trial_mode(config)} trials"
          f"{', the answer confirmed in fresh processes' if config.confirm else ''}"
          f"{f', sizes in multiples of {unit}' if unit > 1 else ''})", file=sys.stderr, flush=True)
    label = context.get("knob", "batch")
    with Steps(None, "trials", f"search {label}", show) as steps:
        progress = Progress(label, config.confirm, steps=steps if show else None, unit=unit,
                            max_size=config.max_size)
        try:
            return run_search(workload, config, progress)
        except NoSizeFits as exc:  # other knobs may still fit; TrialFailed goes to main()
            steps.write(f"oomguard: {exc}")
            return exc.result


def _report(args: argparse.Namespace, result: Any, context: dict[str, Any], out: Path) -> int:
    """Write the report into ``out`` and print the result; 0, or 1 and one line naming the
    path when something could not be written (a full disk): the result is still printed."""
    from oomguard.engine.util.jsonable import json_text
    from oomguard.reports import write_report

    failure = None  # the one error line, if any
    try:
        files = {k: str(v) for k, v in write_report(result, out, context=context).items()}
    except OSError as exc:
        files, failure = {}, (f"cannot write the report to {exc.filename or out}: "
                              f"{exc.strerror or exc}; the result is on stdout")
    try:
        if args.json:
            priced = {"remedies": context["remedies"]} if "remedies" in context else {}
            print(json_text(result.to_dict() | priced | {"files": files}), end="")
        else:
            what = f"maximum {context['knob']}" if "knob" in context else "maximum batch size"
            print(f"{what}: {result.max_ok} (first OOM: {result.first_oom}); recommended: "
                  f"{result.recommendation.safe}; {len(result.trials)} trials in "
                  f"{result.seconds:.1f} s")
            check = result.verification
            if check:
                print(f"verify: {check['steps']} steps at {check['size']}: "
                      + ("ok" if check["ok"] else f"OUT OF MEMORY ({(check['error'] or '')[:80]})"))
            if "remedies" in context:
                print(_remedies_text(context["remedies"]))
            if files:
                print(f"report: {files['markdown']}\nplot:   {files['png']}\njson:   {files['json']}")
        sys.stdout.flush()  # a full disk under a redirected stdout fails here, not at exit
    except OSError as exc:
        failure = f"cannot write to standard output: {exc.strerror or exc}"
    if failure is not None:
        print(f"oomguard: error: {failure}", file=sys.stderr)
    return 0 if failure is None else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from oomguard.engine.jobs.output import check_output_folder
    from oomguard.metrics.models import check_seq_len, model_config
    from oomguard.metrics.train_step import TrainStep

    # Every input is checked before the model is built; the folder last (none left behind).
    lengths = None
    if args.lengths is not None:
        from oomguard.engine.cli.shapes import check_shape_options, read_lengths

        lengths = read_lengths(args.lengths)
        check_shape_options(args)
    elif args.cache is not None or args.no_cache:
        raise UsageError("--cache and --no-cache are for --lengths (the plan is cached; "
                         "bench's own search is not): give --lengths FILE, or drop them")
        # The longest length bounds the model's positions and the sizes a device can hold.
        args.seq_len = max(lengths)
    check_workload(args)
    remedies = remedy_names(args)
    dev = resolve_device(args.device, check=True)
    if isolated(args, dev) or args.confirm:  # started now: imports overlap the checks
        from oomguard.engine.core.child import start_forkserver

        start_forkserver(TrainStep.preload + (TrainStep.__module__,))
    check_seq_len(model_config(args.model), args.seq_len)
    base = search_config(args, dev)
    config = knob_search_config(base, args, 1, base.max_size)
    out = Path(args.out)
    check_output_folder(out)
    workload = TrainStep(model=args.model, seq_len=args.seq_len, device=args.device)
    if not config.isolate:
        # Warm up before the search probes free memory, so capacity excludes the model.
        # Isolated, this process keeps nothing on the device: children measure alone.
        workload.warmup()
    if lengths is not None:
        from oomguard.engine.cli.shapes import bench_shapes

        return bench_shapes(args, workload, config, lengths, out)
    if remedies is not None:  # what the model allows (blocks, dtype), before the search
        from oomguard.engine.core.execute.priced import check_remedies

        check_remedies(remedies, workload._state["model"], dev)
    context = workload.describe() | {"workload_spec": workload_spec(workload)}
    context.update(_default_budget(args))
    context["title"] = f"{args.model} training step: Maximum Batch Size Report"
    result = _search(workload, config, context, wanted(args.progress))
    if result.max_ok is None:
        return 1
    if remedies is not None:
        context["remedies"] = _price(workload, remedies, args.effective_batch or 2 * result.max_ok,
                                     config, args)
    return _report(args, result, context, out)


def _price(workload: Any, remedies: tuple[str, ...], rows: int, config: Any,
           args: argparse.Namespace) -> dict[str, Any]:
    """The remedies of the built-in training step priced for ``rows`` rows (forward and
    backward per micro-batch, then AdamW's step), under the search's budget and margin
    (:func:`~oomguard.engine.core.execute.priced.choose_remedy`); its record."""
    from oomguard.engine.core.execute.priced import choose_remedy

    model, optimizer = workload._state["model"], workload._state["opt"]  # built by warmup()
    ids = workload.worst_case_batch(rows)

    def step(n: int) -> None:
        model(input_ids=ids[:n], labels=ids[:n]).loss.backward()

    print(f"oomguard: pricing {', '.join(remedies)} for {rows} rows per optimizer step",
          file=sys.stderr, flush=True)
    choice = choose_remedy(step, rows, model, optimizer=optimizer, remedies=remedies,
                           name=workload.name, device=config.device, budget=config.budget,
                           margin=config.margin, max_trials=args.max_trials)
    return choice.to_dict()


def _remedies_text(record: dict[str, Any]) -> str:
    """The priced remedies for the terminal: what was chosen, then the table."""
    from oomguard.engine.util.table import text_table
    from oomguard.reports.remedies import chosen_line, remedy_rows

    return f"remedies for {chosen_line(record)}\n{text_table(remedy_rows(record))}"


def _default_budget(args: argparse.Namespace) -> dict[str, str]:
    """``{"default_budget": why}`` for the report and the first line where no ``--budget`` was
    given and the default did not fit (:func:`lowered_default`, as
    :func:`~oomguard.engine.cli.options.search_config` found it); else empty."""
    why = getattr(args, "lowered_budget", None)
    return {} if why is None else {"default_budget": why}


def _check_knobs(trial: Any, knobs: list[str], isolate: bool) -> None:
    """Refuse (UsageError) a knob whose size changes the metric's result, before any search
    (:func:`~oomguard.metrics.knob_check.check_trial`); isolated, in a child, so this process
    builds no model."""
    from oomguard.metrics.knob_check import check_trial

    if not isolate:
        check_trial(trial, knobs)
        return
    from oomguard.engine.core.child import Child, start_forkserver

    with Child(start_forkserver(), check_trial, trial, knobs) as child:
        child.wait().result()


def cmd_search(args: argparse.Namespace) -> int:
    """Each memory knob sized as a job sizes it (:func:`~oomguard.engine.jobs.sizing.choose_sizes`):
    in the metric's order, each searched with the knobs before it at the sizes found (``--knob``:
    that one alone, the others at their defaults), a report per knob."""
    from oomguard.engine.core.search.record import record_of
    from oomguard.engine.jobs.output import check_output_folder
    from oomguard.engine.jobs.sizing import Request, choose_sizes
    from oomguard.metrics.base import get_metric
    from oomguard.metrics.models import check_seq_len, model_config
    from oomguard.metrics.workload import MetricTrial

    check_workload(args)
    metric = get_metric(args.metric)
    knobs = [k.name for k in metric.memory_knobs()]
    if args.knob and args.knob not in knobs:
        raise UsageError(f"metric {args.metric!r} has no memory knob {args.knob!r}: "
                         f"use one of {', '.join(knobs)}")
    dev = resolve_device(args.device, check=True)
    searched = [args.knob] if args.knob else knobs

    def trial_of(knob: str, sizes: dict[str, int]) -> Any:
        return MetricTrial(metric=args.metric, knob=knob, model=args.model, dtype=args.dtype,
                           device=args.device, n_samples=args.samples, seq_len=args.seq_len,
                           params={k: v for k, v in sizes.items() if k != knob})

    if isolated(args, dev) or args.confirm:  # started now: imports overlap the planning
        from oomguard.engine.core.child import start_forkserver
        from oomguard.engine.core.workload import workload_preload

        start_forkserver(workload_preload(trial_of(searched[0], {})))
    config = model_config(args.model)
    check_seq_len(config, args.seq_len)
    base = search_config(args, dev)  # every option checked before any model is built
    outs = {k: Path(args.out) / k if len(searched) > 1 else Path(args.out) for k in searched}
    _check_knobs(trial_of(searched[0], {}), searched, base.isolate)
    for out in outs.values():  # last, so a bad option leaves no folder behind
        check_output_folder(out)
    nothing_fits: list[str] = []

    def evaluate(knob: str, sizes: dict[str, int], unit: int, cap: int) -> Any:
        trial = trial_of(knob, sizes)
        context = (trial.report_context() | {"workload_spec": workload_spec(trial)}
                   | _default_budget(args))
        if args.plugin:  # what `oomguard verify` needs given again to rebuild the workload
            context["plugins"] = args.plugin
        result = _search(trial, knob_search_config(base, args, unit, cap), context,
                         wanted(args.progress))
        if result.max_ok is None:  # nothing fitted this knob; the others may still fit
            nothing_fits.append(knob)
        elif _report(args, result, context, outs[knob]):
            raise _NowhereToWrite  # a full disk: the reports already written stay whole
        return record_of(result, metric=args.metric, unit=unit)

    pinned = {k.name: int(k.default) for k in metric.memory_knobs() if k.name not in searched}
    request = Request(metric, {}, args.samples, config, base.max_size, pinned, "metric default")
    try:
        choose_sizes(request, evaluate=evaluate)
    except _NowhereToWrite:
        return 1
    return 1 if nothing_fits else 0


class _NowhereToWrite(Exception):
    """A report could not be written (its one line is out): no further knob is searched."""
