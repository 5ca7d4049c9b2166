"""``oomguard estimate``: the peak memory of a workload at given sizes, estimated without
running it (fake tensors: no weights, no activations; see
:mod:`oomguard.engine.core.estimate.estimate`). Every figure printed is an estimate, and says so.

No torch import at module level: ``oomguard estimate --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from oomguard.engine.cli.options import (
    DEFAULT_SEQ_LEN,
    add_deprecated,
    add_plugin_option,
    add_workload_options,
    check_sizes,
    check_workload,
)
from oomguard.engine.errors import UsageError

TRAIN_STEP = "train-step"


def add_estimate(p: argparse.ArgumentParser) -> None:
    p.description = ("Estimate the peak memory a workload adds at each size (above its "
                     "warmed-up state, as a search trial measures it) without running it: "
                     "the model is built with no weights and the step runs on fake tensors, "
                     "so a 7B model can be estimated on a laptop for a GPU it does not have. "
                     "Estimates, not measurements.")
    work = p.add_argument_group("workload")
    work.add_argument("--metric", default=TRAIN_STEP, metavar="train-step|METRIC",
                      help="train-step (forward, backward, AdamW; default) or a metric name "
                           "(see `oomguard metrics`)")
    add_deprecated(work, "--workload", "--metric", "metric")
    add_workload_options(p, group=work, knob=(None, "default: its first"),
                         model=("tiny-gpt2", "default tiny-gpt2; only its config is read"),
                         dtype="float32", seq_len=DEFAULT_SEQ_LEN,
                         samples=(None, "a metric's; default 64"))
    p.add_argument("--sizes", required=True,
                   help="comma-separated sizes (batch size, or the knob's value), e.g. 1,8,32")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda[:N]: the device the estimate is for (default cpu; on a "
                        "torch build without CUDA, a cuda estimate is made on cpu, and says so)")
    p.add_argument("--no-workspace", action="store_true",
                   help="do not measure the matrix multiplies' workspace (cpu): by default "
                        "they are replayed in a fresh process on this host, which takes a few "
                        "seconds, and the buffers their library keeps are included")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    add_plugin_option(p)
    p.set_defaults(func=cmd_estimate)


def parse_sizes(text: str, option: str = "--sizes") -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; UsageError (one line, naming ``option``) for anything
    but positive integers."""
    sizes = []
    for item in text.split(","):
        try:
            size = int(item.strip())
        except ValueError:
            raise UsageError(f"{option}: {item.strip()!r} is not an integer: give positive "
                             "integers separated by commas, e.g. 1,8,32") from None
        if size <= 0:
            raise UsageError(f"{option}: every size must be a positive integer, got {size}; "
                             "give 1 or more")
        sizes.append(size)
    return sizes


def build_workload(args: argparse.Namespace) -> Any:
    """The workload the options describe, every option checked (UsageError, one line)."""
    from oomguard.metrics.models import check_seq_len, model_config

    check_workload(args)
    if args.metric == TRAIN_STEP:
        for option, value in (("--knob", args.knob), ("--samples", args.samples)):
            if value is not None:
                raise UsageError(f"{option} is for metrics; {TRAIN_STEP} sizes are batch sizes: "
                                 f"drop {option}, or give --metric")
        from oomguard.metrics.train_step import TrainStep

        check_seq_len(model_config(args.model), args.seq_len)
        return TrainStep(model=args.model, seq_len=args.seq_len, dtype=args.dtype)
    from oomguard.metrics.base import get_metric
    from oomguard.metrics.workload import MetricTrial

    try:
        get_metric(args.metric)
    except UsageError as exc:
        raise UsageError(f"unknown metric {args.metric!r}: use {TRAIN_STEP} or a metric "
                         f"({str(exc).partition('use one of ')[2]})") from None
    check_seq_len(model_config(args.model), args.seq_len)
    # MetricTrial checks the knob and whether the metric supports the model, from its config.
    return MetricTrial(metric=args.metric, knob=args.knob, model=args.model,
                       dtype=args.dtype, n_samples=args.samples or 64, seq_len=args.seq_len)


def table(estimates: list[Any]) -> str:
    """A plain-text table: size, estimated peak (bytes and for people), the part of it that
    is the matrix multiplies' measured workspace ("-": not counted), kind."""
    from oomguard.engine.util.table import text_table
    from oomguard.engine.util.units import fmt_bytes

    rows = [("size", "estimated peak (bytes)", "estimated peak", "of which workspace", "")]
    rows += [(str(e.size), str(e.peak_bytes), fmt_bytes(e.peak_bytes),
              fmt_bytes(e.workspace_bytes), e.kind) for e in estimates]
    return text_table(rows, right=4)


def cmd_estimate(args: argparse.Namespace) -> int:
    """Print the estimates (a table, or JSON with ``--json``); 0."""
    from oomguard.engine.core.estimate.estimate import estimate, fake_device
    from oomguard.engine.util.jsonable import json_text

    sizes = parse_sizes(args.sizes)
    fake_device(args.device)  # a bad device fails before the model's config is read
    workload = build_workload(args)
    check_sizes([("--sizes:", size) for size in sizes], workload.seq_len)
    estimates = estimate(workload, sizes, device=args.device, workspace=not args.no_workspace)
    if args.json:
        print(json_text({"workload": workload.name, "describe": workload.describe(),
                         "estimates": [e.to_dict() for e in estimates]}), end="")
        return 0
    first = estimates[0]
    print(f"{workload.name} on {first.device} (estimated on {first.estimated_on}): "
          f"peak memory above the warmed-up state, estimated, not measured")
    print(table(estimates))
    print(f"method: {first.method}")
    for note in sorted({note for e in estimates for note in e.notes}):
        print(f"note: {note}")
    sys.stdout.flush()
    return 0
