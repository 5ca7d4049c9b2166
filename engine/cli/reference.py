"""``oomguard reference``: every metric's maximum and safe size for every memory knob on this
device, measured (and cached, so a second run is instant), written as ``reference.md``,
``reference.json`` and a ready ``sizes.toml`` (:mod:`oomguard.engine.jobs.reference`).

No torch or engine import at module level: ``oomguard --help`` must stay fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from oomguard.engine.cli.options import (
    DEFAULT_SEQ_LEN,
    add_deprecated,
    add_plugin_option,
    add_search_options,
    add_workload_options,
    check_sizes,
    check_workload,
    size,
)
from oomguard.engine.errors import UsageError

DEFAULT_OUT = "oomguard-reference"


def add_reference(p: argparse.ArgumentParser) -> None:
    p.description = ("Search every memory knob of every metric in turn (the knobs before each at "
                     "their chosen sizes, the ones after it at their defaults, as a job sizes "
                     "them) on one model, dtype and sequence length, and write reference.md, "
                     "reference.json and sizes.toml (a ready [[metrics]] block for a job file, or "
                     "`oomguard run JOB --sizes-file sizes.toml`). Answers go in the size cache: a "
                     "second run reads them back without a trial, and a job with the same model, "
                     "dtype, sequence length, device and budget takes its sizes from there. With "
                     "the defaults (14 rows, 17 trials for the tiny GPT-2): 84 s on 2 idle CPU "
                     "cores (docs/benchmarks.md#how-long-the-commands-take).")
    work = add_workload_options(p, model="tiny-gpt2", dtype="float32", seq_len=DEFAULT_SEQ_LEN,
                                samples=(8, "default 8, as a job file's [data]"))
    work.add_argument("--metric", action="append", default=None, metavar="NAME[,NAME]",
                      help="only these metrics: repeat it, or give a comma list (default: "
                           "every one, see `oomguard metrics`)")
    add_deprecated(work, "--metrics", "--metric", "metric", append=True)
    p.add_argument("--cache", metavar="PATH",
                   help="size cache file (default: sizes.json in the user cache folder)")
    # a reference's rows have no verification; --device: cpu when measuring, cuda for --estimate
    add_search_options(p, verify_steps=False,
                       device=(None, "default: cpu; with --estimate, cuda"))
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output folder (default {DEFAULT_OUT})")
    est = p.add_argument_group(
        "estimated reference (no device, no weights)",
        "--estimate writes estimate-reference.md/.json instead: per metric and knob, the "
        "largest size whose *estimated* total (weights, data and the peak above them, from "
        "fake tensors on the config with 1, 2 and 3 layers, extrapolated to its depth) fits "
        "--gpu's memory (as its driver reports it) or --memory, less --margin; for cuda "
        "unless --device says otherwise. Estimates, not measurements.")
    est.add_argument("--estimate", action="store_true",
                     help="estimate instead of measuring (needs --gpu or --memory)")
    est.add_argument("--gpu", default=None, metavar="NAME",
                     help="a GPU tier's memory as its driver reports it: 'H100 80GB', 'A100 40GB', "
                          "'RTX 4090 24GB', 'V100 16GB' (estimated for cuda)")
    est.add_argument("--memory", type=size, default=None, metavar="BYTES",
                     help="the memory to fit, e.g. 24GiB (estimated for --device)")
    est.add_argument("--batches", default=None, metavar="N,N",
                     help="also a table of each metric's estimated memory at these batch "
                          "sizes, e.g. 1,8,32")
    est.add_argument("--measured", default=None, metavar="REFERENCE.json",
                     help="a measured reference.json for the same model, dtype, sequence "
                          "length and samples: show estimate against measurement")
    add_plugin_option(p)
    p.set_defaults(func=cmd_reference)


def cmd_reference(args: argparse.Namespace) -> int:
    """Measure the reference (or, with ``--estimate``, estimate it); exit 1 where nothing fits."""
    check_workload(args)
    if args.estimate:
        return cmd_estimate_reference(args)
    for option in ("gpu", "memory", "batches", "measured"):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option} is for --estimate: add --estimate, or leave it out")
    from oomguard.engine.cli.options import knob_search_config, search_config
    from oomguard.engine.jobs.output import check_output_folder
    from oomguard.engine.jobs.progress import Progress
    from oomguard.engine.jobs.reference import build_reference, sizes_toml
    from oomguard.metrics.models import check_seq_len, model_config
    from oomguard.probes.device import resolve_device
    from oomguard.reports.reference import render_reference_markdown

    names = _metric_names(args.metric)
    dev = resolve_device(args.device or "cpu", check=True)
    check_seq_len(model_config(args.model), args.seq_len)
    base = search_config(args, dev)  # every option checked now
    out = Path(args.out)
    check_output_folder(out)

    def config_for(trial: Any, cap: int) -> Any:
        return knob_search_config(base, args, trial.unit(), cap)

    def show(row: Any) -> None:
        what = f"maximum {row.max_ok}, safe {row.safe}" if row.max_ok is not None else row.note
        if row.capped_by:
            what += f" (capped by {row.capped_by} {row.cap}, not by memory)"
        rows.write(f"oomguard: {row.metric}.{row.knob}: {what} ({row.source}, {row.trials} "
                   f"trials)")
        rows.advance()

    lowered = args.lowered_budget  # search_config's reason where the default did not fit
    print(f"oomguard: reference of {len(names)} metrics on {dev} for {args.model} "
          f"({args.dtype}, seq_len {args.seq_len}, {args.samples} samples)"
          + (f"; {lowered}" if lowered else ""), file=sys.stderr, flush=True)
    rows = _rows(names, args)  # after the header: the bar stays below it
    with rows:
        ref = build_reference(args.model, str(dev), args.dtype, args.seq_len, args.samples,
                              budget_bytes=base.budget, cache_path=args.cache,
                              config_for=config_for, metrics=names, max_size=base.max_size,
                              on_trial=Progress("size", args.confirm), on_row=show)
    doc = ref.to_dict()
    missing = [f"{r.metric}.{r.knob}" for r in ref.rows if r.safe is None]
    return _write(out, {"reference.json": doc, "reference.md": render_reference_markdown(doc),
                        "sizes.toml": sizes_toml(ref)},
                  f"reference: {out / 'reference.md'} ({len(ref.rows)} rows, {ref.trials} "
                  f"trials, {ref.seconds:.1f} s)\nsizes:     {out / 'sizes.toml'}",
                  missing, "nothing fits for", args.json)


def cmd_estimate_reference(args: argparse.Namespace) -> int:
    """``oomguard reference --estimate``: write estimate-reference.md/.json (every figure an
    estimate); exit 1 where even the smallest size of a knob does not fit."""
    from oomguard.engine.cli.estimate import parse_sizes
    from oomguard.engine.jobs.reference_estimate import (
        ESTIMATE_MARGIN,
        build_estimate_reference,
        check_measured,
        gpu_memory,
    )
    from oomguard.engine.util.jsonable import read_json
    from oomguard.engine.util.units import fmt_bytes
    from oomguard.metrics.models import check_seq_len, model_config
    from oomguard.reports.reference_estimate import render_estimate_markdown

    if (args.gpu is None) == (args.memory is None):
        raise UsageError("--estimate needs one of --gpu NAME or --memory BYTES: give one, "
                         "such as --memory 24GiB")
    device = args.device or "cuda"
    if args.gpu is not None:
        if device.split(":")[0] != "cuda":
            raise UsageError(f"--gpu estimates for cuda, not --device {device}: use "
                             "--memory BYTES for another device")
        memory, memory_name = gpu_memory(args.gpu), args.gpu
    else:
        memory, memory_name = args.memory, fmt_bytes(args.memory)
    from oomguard.engine.core.search.config import SearchConfig

    margin = ESTIMATE_MARGIN if args.margin is None else args.margin
    if not isinstance(margin, float):
        raise UsageError("--margin for --estimate is a fraction in [0, 1) (nothing is "
                         "measured, so 'measured' has no spread to read); give one such as "
                         "0.05")
    names = _metric_names(args.metric)
    check_seq_len(model_config(args.model), args.seq_len)
    batches = parse_sizes(args.batches, "--batches") if args.batches else []
    check_sizes([("--batches:", b) for b in batches], args.seq_len)
    measured = None
    if args.measured:
        try:
            measured = read_json(args.measured)  # refuses hostile nesting
        except (OSError, ValueError) as exc:
            raise UsageError(f"--measured {args.measured}: cannot read a reference.json "
                             f"({getattr(exc, 'strerror', None) or exc}); give the reference.json "
                             "that `oomguard reference` wrote") from None
        check_measured(measured, model=args.model, dtype=args.dtype, seq_len=args.seq_len,
                       n_samples=args.samples)  # before any estimate, not after them all
    out = Path(args.out)

    def show(row: dict[str, Any]) -> None:
        what = "does not fit" if row["max_ok"] is None else f"largest {row['max_ok']}"
        rows.write(f"oomguard: {row['metric']}.{row['knob']}: {what} (estimated, "
                   f"{row['estimates']} estimates, {row['seconds']:.1f} s)")
        rows.advance()

    print(f"oomguard: estimated reference of {len(names)} metrics for {args.model} "
          f"({args.dtype}, seq_len {args.seq_len}, {args.samples} samples) in {memory_name} "
          f"less a {margin:.0%} margin", file=sys.stderr, flush=True)
    rows = _rows(names, args)  # after the header: the bar stays below it
    with rows:
        doc = build_estimate_reference(args.model, args.dtype, args.seq_len, args.samples,
                                       memory=memory, memory_name=memory_name,
                                       margin=margin, device=device, metrics=names,
                                       max_size=args.max_size or SearchConfig.max_size,
                                       batches=batches,
                                       measured=measured, on_row=show)
    missing = [f"{r['metric']}.{r['knob']}" for r in doc["rows"] if r["max_ok"] is None]
    return _write(out, {"estimate-reference.json": doc,
                        "estimate-reference.md": render_estimate_markdown(doc)},
                  f"estimated reference: {out / 'estimate-reference.md'} ({len(doc['rows'])} "
                  f"rows, {doc['estimates']} estimates, {doc['seconds']:.1f} s; estimates, not "
                  "measurements)",
                  missing, "estimated not to fit even at size 1:", args.json)


def _write(out: Path, files: dict[str, Any], done: str, missing: list[str], why: str,
           as_json: bool = False) -> int:
    """Write ``files`` (name: text, or a dict written as JSON) into ``out`` and print
    ``done`` (``as_json``: the first JSON file's content instead); the exit code: 1, after
    one line on stderr, when they cannot be written (a full disk) or some rows fit no size
    (``missing``, said after ``why``), else 0."""
    from oomguard.engine.util.atomic import atomic_write, atomic_write_json

    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            (atomic_write if isinstance(content, str) else atomic_write_json)(out / name, content)
    except OSError as exc:
        print(f"oomguard: cannot write {exc.filename or out}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    if as_json:
        from oomguard.engine.util.jsonable import json_text

        print(json_text(next(c for c in files.values() if not isinstance(c, str))), end="")
    else:
        print(done)
    if missing:
        print(f"oomguard: {why} {', '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


def _rows(names: list[str], args: argparse.Namespace) -> Any:
    """The reference's progress: one step per row (a memory knob of each metric), shown on
    stderr as ``--progress`` says (:func:`~oomguard.engine.jobs.progress.wanted`)."""
    from oomguard.engine.jobs.progress import Steps, wanted
    from oomguard.metrics.base import get_metric

    total = sum(len(get_metric(name).memory_knobs()) for name in names)
    return Steps(total, "rows", "reference", wanted(args.progress))


def _metric_names(given: list[str] | None) -> list[str]:
    """The metrics ``--metric`` names (repeated, or ``NAME,NAME``; each checked: a UsageError
    lists the valid ones), else every metric of the catalogue."""
    from oomguard.metrics.base import get_metric, load_all

    if given is None:
        return sorted(load_all())
    names = list(dict.fromkeys(m.strip() for text in given for m in text.split(",")
                               if m.strip()))
    if not names:
        raise UsageError("--metric names no metric: give NAME or NAME,NAME (see "
                         "`oomguard metrics`)")
    for name in names:
        get_metric(name)
    return names
