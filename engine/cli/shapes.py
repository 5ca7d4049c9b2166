"""``oomguard bench --lengths FILE``: batches planned from a dataset's sample lengths
(:func:`oomguard.search_shapes` of the bench's training step), written as ``shapes.json``,
``shapes.png`` and ``shapes.md`` in the report folder.

The plan is stored in the size cache (:class:`~oomguard.engine.jobs.cache.SizeCache`, the
jobs' and ``oomguard reference``'s file) under the device (with its budget) and the workload
(:func:`plan_workload`: the model, dtype, search options and the lengths the plan searches,
not the whole distribution: batches are planned from each run's own lengths); a second run
reads it back without a trial, ``--no-cache`` searches again and replaces it.

No torch import at module level, as every command module.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from oomguard.engine.core.length_batches import DISTRIBUTIONS, named_lengths
from oomguard.engine.errors import UsageError

LENGTHS_FIX = ("give a file with one sample length (an integer > 0, in tokens) per line, or "
               f"a distribution: {', '.join(DISTRIBUTIONS)}[:N]")


def read_lengths(path: str) -> list[int]:
    """The lengths ``--lengths`` names: a distribution, ``NAME[:N]`` (``N`` samples, default
    5,000, of 8 to 256 tokens: :func:`~oomguard.engine.core.length_batches.named_lengths`)
    where no file of that name exists, else the text file ``path``, one integer > 0 per line
    (blank lines skipped); a one-line :class:`UsageError` saying what to do for a file that
    cannot be read, a line that is not an integer or a length <= 0."""
    name, _, count = path.partition(":")
    if name in DISTRIBUTIONS and not Path(path).exists():
        if count and not count.isdigit():
            raise UsageError(f"--lengths {path}: {count!r} is not a sample count; give "
                             f"{name}:N with N an integer > 0, or {name} for 5,000")
        return named_lengths(name, int(count) if count else 5000)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise UsageError(f"--lengths {path}: cannot read it ({why}); {LENGTHS_FIX}") from None
    lengths = []
    for number, line in enumerate(text.splitlines(), 1):
        word = line.strip()
        if not word:
            continue
        try:
            value = int(word)
        except ValueError:
            raise UsageError(f"--lengths {path} line {number}: {word[:40]!r} is not an integer; "
                             f"{LENGTHS_FIX}") from None
        if value <= 0:
            raise UsageError(f"--lengths {path} line {number}: length {value} is not above 0; "
                             f"drop empty samples and {LENGTHS_FIX}")
        lengths.append(value)
    if not lengths:
        raise UsageError(f"--lengths {path}: no lengths in it; {LENGTHS_FIX}")
    return lengths


class LengthStep:
    """The bench's training step (:class:`~oomguard.metrics.train_step.TrainStep`) at any
    length: ``step(batch_size, seq_len)``, as :func:`oomguard.search_shapes` calls it."""

    def __init__(self, workload: Any) -> None:
        self.workload = workload
        self.name = workload.name
        self.steps_per_trial = workload.steps_per_trial

    def __call__(self, batch_size: int, seq_len: int) -> float:
        return self.workload.at_length(batch_size, seq_len)

    def warmup(self) -> None:
        self.workload.warmup()

    def for_estimate(self, device: str) -> LengthStep:
        """The step on the workload's estimate copy (nothing built: fake tensors)."""
        return LengthStep(self.workload.for_estimate(device))


def plan_workload(workload: Any, config: Any, lengths: list[int]) -> dict[str, Any]:
    """The size cache's workload of a plan (:func:`~oomguard.engine.jobs.cache.entry_key`):
    the model's config hash (as a job's), dtype, the longest length as ``seq_len``, and in
    ``params`` the lengths the plan searches
    (:func:`~oomguard.engine.core.shapes.searched_lengths`: a plan depends on the
    lengths only through them), the search options that change an answer, the step's seed
    and how its trials run."""
    from oomguard.engine.cli.verify import workload_spec
    from oomguard.engine.core.search.search import trial_mode
    from oomguard.engine.core.shapes import searched_lengths
    from oomguard.engine.jobs.fingerprint import config_fingerprint

    fields = workload_spec(workload)["fields"]
    params = {k: v for k, v in fields.items() if k not in ("model", "dtype", "seq_len", "device")}
    return {"metric": "bench --lengths", "model_config": config_fingerprint(fields["model"]),
            "model": fields["model"], "dtype": fields.get("dtype"), "seq_len": max(lengths),
            "params": params | {"searched_lengths": searched_lengths(lengths),
                                "margin": config.margin, "max_size": config.max_size,
                                "steps_per_trial": config.steps_per_trial,
                                "trials": trial_mode(config)}}


def cached_plan(cache: Any, key: str) -> Any:
    """The :class:`~oomguard.engine.core.shapes.ShapePlan` the size cache holds under
    ``key``, or None: no entry, an entry the cache itself refuses (it warns), or one whose
    plan cannot be read back (a warning: the plan is searched again)."""
    import logging

    from oomguard.engine.core.shapes import ShapePlan

    entry = cache.get(key)
    if entry is None:
        return None
    try:
        return ShapePlan.from_dict(entry["plan"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logging.getLogger("oomguard.cache").warning(
            "size cache %s: entry %s ignored: its plan cannot be read (%s: %s); searching "
            "again", cache.path, key, type(exc).__name__, exc)
        return None


def check_shape_options(args: argparse.Namespace) -> None:
    """UsageError (one line) for options ``--lengths`` cannot honour, before any work: the
    plan runs its searches' trials from this process (forked on a Linux CPU)."""
    if args.isolate or args.confirm:
        raise UsageError("--lengths plans from this process's step; drop --isolate and "
                         "--confirm")
    if args.remedies is not None:
        raise UsageError("--lengths plans batches of unequal size, --remedies prices one "
                         "effective batch; give one of them")


def bench_shapes(args: argparse.Namespace, workload: Any, config: Any, lengths: list[int],
                 out: Path) -> int:
    """Plan batches of ``lengths`` for ``workload`` under ``config``'s budget (or read the plan
    from the size cache: :func:`cached_plan`) and write the plan's files into ``out``
    (shapes.json, shapes.png, shapes.md), and, where it searched, the longest length's search
    as bench's report (report.md with the plan's section, report.json, memory.png); 0, or 1
    and one line when no row fits or the files could not be written."""
    from oomguard.engine.cli.verify import workload_spec
    from oomguard.engine.core.shapes import search_shapes
    from oomguard.engine.errors import NoSizeFits
    from oomguard.engine.jobs.cache import SizeCache, entry_key
    from oomguard.engine.jobs.plan import identify_device
    from oomguard.engine.util.jsonable import json_text
    from oomguard.reports import write_report
    from oomguard.reports.shapes import report_summary, shapes_record, write_shapes

    # The plan starts its further lengths where it predicts (its own strategy) unless a
    # strategy or a size step was asked for.
    options: dict[str, Any] = {}
    if args.strategy is None and args.size_step is None:
        config = dataclasses.replace(config, strategy=None)
        if args.start is not None:
            options["start"] = args.start
    cache = SizeCache(args.cache)
    device = identify_device(str(config.device), config.budget, "bench --lengths")
    work = plan_workload(workload, config, lengths)
    key = entry_key(device, work)
    plan = None if args.no_cache else cached_plan(cache, key)
    if plan is not None:
        print(f"oomguard: the plan for {workload.name} on {config.device} from the size cache "
              f"({cache.path}); no trial ran (--no-cache searches again)", file=sys.stderr,
              flush=True)
    else:
        print(f"oomguard: planning batches of {len(lengths):,} samples of {min(lengths)} to "
              f"{max(lengths)} tokens: searches of {workload.name} at up to 3 lengths on "
              f"{config.device}", file=sys.stderr, flush=True)
        try:
            plan = search_shapes(LengthStep(workload), lengths, config=config, **options)
        except NoSizeFits as exc:
            print(f"oomguard: {exc}", file=sys.stderr)
            return 1
        stored = plan.to_dict() | {"results": []}  # the plan, not its searches' trials
        cache.put(key, {f"batch_size@{p.seq_len}": p.safe for p in plan.points},
                  source="bench --lengths", device=device, workload=work, plan=stored,
                  trials=plan.trials, finished=True)
    record = shapes_record(plan, lengths) | {"source": "search" if plan.results else "cache",
                                             "cache_key": key}
    # The longest length's search is the search `oomguard bench` runs at that length: its
    # report, with the plan as a section of it. A plan from the cache has no search.
    context = (workload.describe() | {"workload_spec": workload_spec(workload)}
               | {"title": f"{args.model} training step: Maximum Batch Size Report",
                  "shapes": report_summary(record)})
    why = getattr(args, "lowered_budget", None)  # as bench's report says it
    if why is not None:
        context["default_budget"] = why
    try:
        files = {k: str(v) for k, v in write_shapes(plan, lengths, out, record).items()}
        if plan.results:
            files |= {f"report_{k}": str(v)
                      for k, v in write_report(plan.results[-1], out, context=context).items()}
    except OSError as exc:
        print(f"oomguard: error: cannot write the plan to {exc.filename or out}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json_text(record | {"files": files}), end="")
    else:
        print(summary_line(record))
        print(f"plan:   {files['markdown']}, {files['png']}, {files['json']}\n"
              + (f"report: {files['report_markdown']} (the longest length's search and the "
                 "plan)" if plan.results else "report: none (the plan came from the size "
                 "cache: no search, no trial)"))
    return 0


def summary_line(record: dict[str, Any]) -> str:
    """``bench --lengths``'s line on stdout, from :func:`~oomguard.reports.shapes.shapes_record`:
    the planned batches' tokens against longest-length sizing's, and the searched lengths."""
    planned, fixed = record["planned"], record["longest_length_sizing"]
    ratio = record["tokens_ratio"]
    points = ", ".join(f"{p['safe']} rows at length {p['seq_len']}" for p in record["points"])
    return (f"planned {planned['batches']} batches of {planned['tokens_per_batch']:,.0f} real "
            f"tokens; at the longest length {fixed['batch']} rows, "
            f"{fixed['tokens_per_batch'] or 0:,.0f} tokens a batch"
            + (f" ({ratio:.2f}x the tokens per batch)" if ratio else "")
            + f"; searched: {points}; {record['trials']} trials"
            + (" (the plan from the size cache)" if record.get("source") == "cache"
               else f", {record['seconds']:.1f} s"))
