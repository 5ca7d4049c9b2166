"""``oomguard verify REPORT``: run further steps at the size a report recommends, as its
trials ran (same workload, device, budget and mode), and say whether any ran out of memory.

A search trial runs a few steps; a real run takes thousands, and the sizes peer tools
find most often fail later in the run. The workload is rebuilt from ``report.json``'s
``context.workload_spec``. No torch import at module level: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from oomguard.engine.cli.options import (
    add_plugin_option,
    add_progress_option,
    check_sizes,
    positive_int,
)
from oomguard.engine.errors import UsageError
from oomguard.engine.jobs.progress import CountedSteps, Steps, error_text, wanted
from oomguard.engine.util.jsonable import read_json
from oomguard.engine.util.units import fmt_bytes

DEFAULT_STEPS = 10
_KINDS = {"TrainStep": "oomguard.metrics.train_step", "MetricTrial": "oomguard.metrics.workload"}


def workload_spec(workload: Any) -> dict[str, Any]:
    """What rebuilds ``workload`` (a built-in TrainStep or MetricTrial): its class name and
    its public dataclass fields, for ``report.json``'s context."""
    fields = {f.name: getattr(workload, f.name) for f in dataclasses.fields(workload)
              if not f.name.startswith("_")}
    return {"kind": type(workload).__name__, "fields": fields}


def _rebuild(spec: Any, where: Path, plugins: Any = None) -> Any:
    """The workload ``spec`` describes; a UsageError naming ``where`` when it cannot be
    (and the ``plugins`` the search loaded, where its metric is not known here)."""
    import importlib

    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in _KINDS or not isinstance(spec.get("fields"), dict):
        raise UsageError(f"{where} does not describe a built-in workload oomguard can rebuild "
                         "(written by an older oomguard, or by write_report from your own "
                         "code): run search(..., verify_steps=N) to verify your own workload")
    cls = getattr(importlib.import_module(_KINDS[kind]), kind)
    try:
        return cls(**spec["fields"])
    except (TypeError, ValueError) as exc:
        if plugins and str(exc).startswith("unknown metric"):
            raise UsageError(f"{where}: its metric comes from a plugin: give "
                             f"{' '.join(f'--plugin {p}' for p in plugins)}") from None
        raise UsageError(f"{where}: its workload cannot be rebuilt ({exc}); run the search "
                         "again to write a fresh report") from None


def read_report(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """``(report.json's path, its content)`` from a report folder or the file itself; a
    one-line UsageError when it is missing or not an oomguard report."""
    p = Path(path)
    file = p / "report.json" if p.is_dir() else p
    if not file.is_file():
        raise UsageError(f"no report at {file}: give the folder `oomguard bench` or "
                         "`oomguard search` wrote (their --out), or its report.json")
    try:
        doc = read_json(file)  # refuses hostile nesting (a ValueError)
        doc["result"]["recommendation"]  # noqa: B018 - present in every search report
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{file} is not a readable oomguard report ({type(exc).__name__}: "
                         f"{exc}); run the search again to write it") from None
    return file, doc


def add_verify(p: argparse.ArgumentParser) -> None:
    p.description = ("Rebuild the workload a `bench` or `search` report searched and run "
                     "further steps at its recommended size (or --size), on the same device, "
                     "under the same budget and in the same mode as its trials. Prints what "
                     "happened in one line and writes verify.json beside the report; exit 0 "
                     "when every step fitted under the report's safe line (the capacity less "
                     "the margin) and, at the recommended size, under the limit the report held it "
                     "to; 1, saying by how much, on an out-of-memory or a peak over either, "
                     "and 1 when verify.json cannot be written (the result is then printed in "
                     "full on stdout). A report folder it cannot write is refused before any "
                     "step.")
    p.add_argument("report", help="the report folder (--out of bench/search) or its report.json")
    p.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS,
                   help=f"steps to run (default {DEFAULT_STEPS})")
    p.add_argument("--size", type=positive_int, default=None,
                   help="size to verify (default: the report's recommended size)")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    add_progress_option(p)
    add_plugin_option(p)
    p.set_defaults(func=cmd_verify)


def lines_of(doc: dict[str, Any]) -> dict[str, Any]:
    """The lines a report promised its recommended size keeps under, from report.json:
    ``capacity_bytes``, ``margin``, ``safe_line_bytes`` (the capacity less the margin's bytes,
    the line memory.png draws; for a report without it, capacity x (1 - margin)),
    ``margin_bytes`` (the capacity less the safe line) and ``limit_bytes`` with
    ``limit_against`` (the peak the recommended
    size was held under, where it is below the safe line); None where unknown. A report
    written before the summary held them gets the safe line from its result."""
    result, summary = doc["result"], doc.get("summary") or {}
    rec = result.get("recommendation") or {}
    cap, margin = result.get("capacity_bytes"), rec.get("margin")
    line = summary.get("safe_line_bytes")
    if line is None and cap and isinstance(margin, (int, float)):
        line = cap * (1 - margin)
    limit = summary.get("recommended_limit_bytes")
    tighter = limit is not None and (line is None or limit < line)
    return {"capacity_bytes": cap, "margin": margin, "safe_line_bytes": line,
            "margin_bytes": cap - line if cap and line is not None else None,
            "limit_bytes": limit if tighter else None,
            "limit_against": summary.get("recommended_limit_against") if tighter else None}


def judge(check: dict[str, Any], lines: dict[str, Any], recommended: bool
          ) -> tuple[str, float | None]:
    """What the steps' highest peak says against the report's lines, and the line it was
    held to (None: no line is known). The verdict: ``"ok"``, ``"out of memory"``, ``"over
    the safe line"`` or (at the recommended size only, where the report held it under a limit
    below the safe line) ``"margin not kept"``."""
    line, limit = lines["safe_line_bytes"], lines["limit_bytes"] if recommended else None
    if not check["ok"]:
        return "out of memory", None
    top = max(check.get("step_peaks") or [check.get("peak_bytes") or 0])
    if line is not None and top > line:
        return "over the safe line", line
    if limit is not None:
        return ("margin not kept" if top > limit else "ok"), limit
    return "ok", line


def _line(check: dict[str, Any], label: str) -> str:
    """The one line verify prints: what ran, the verdict and, against a line, by how much."""
    head = f"verify: {check['steps']} steps at {label} {check['size']}"
    verdict, lines, bound = check["verdict"], check["lines"], check["held_to_bytes"]
    if verdict == "out of memory":
        return f"{head}: OUT OF MEMORY ({error_text(check['error'])[:120]})"
    from oomguard.engine.core.search.fit import peaks_spread

    peaks = check["step_peaks"]
    top, keep, cap = max(peaks), lines["margin_bytes"], lines["capacity_bytes"]
    if verdict == "over the safe line":
        return (f"{head}: OVER THE SAFE LINE by {fmt_bytes(top - bound)}: peak {fmt_bytes(top)} "
                f"against the safe line {fmt_bytes(bound)} (capacity {fmt_bytes(cap)} less the "
                f"{fmt_bytes(keep)} margin); {fmt_bytes(cap - top)} of the capacity left free "
                f"where the report promised {fmt_bytes(keep)}")
    if verdict == "margin not kept":
        return (f"{head}: MARGIN NOT KEPT by {fmt_bytes(top - bound)}: peak {fmt_bytes(top)} "
                f"above {fmt_bytes(bound)}, the limit the report held the recommended size to "
                f"(the {fmt_bytes(keep)} margin below {fmt_bytes(bound + (keep or 0))}, "
                f"{lines['limit_against']})")
    spread = peaks_spread(peaks) or 0.0  # one step: no spread to show
    room = ("" if bound is None else
            f"; {fmt_bytes(bound - top)} under the report's line ({fmt_bytes(bound)})")
    return (f"{head}: ok, peak per step {fmt_bytes(min(peaks))} to {fmt_bytes(top)} "
            f"(spread {spread:.1%}; {check['seconds']:.1f} s){room}")


def _verify_counted(workload: Any, size: int, steps: int, show: bool, **options: Any
                    ) -> dict[str, Any]:
    """:func:`~oomguard.engine.core.search.search.verify`, with steps done and the estimated
    time left on stderr while ``show`` (each step counted where it runs, a fresh child too)."""
    import tempfile

    from oomguard.engine.core.search.search import verify

    if not show:
        return verify(workload, size, steps, **options)
    with tempfile.TemporaryDirectory(prefix="oomguard-verify-") as folder:
        counted = CountedSteps(workload, Path(folder) / "steps")
        with Steps(steps, "steps", "verify", show=True) as bar, counted.watching(bar):
            return verify(counted, size, steps, **options)


def cmd_verify(args: argparse.Namespace) -> int:
    from oomguard.engine.jobs.output import check_output_folder
    from oomguard.engine.util.atomic import atomic_write_json
    from oomguard.engine.util.jsonable import json_text
    from oomguard.probes.device import resolve_device

    file, doc = read_report(args.report)
    result = doc["result"]
    context = doc.get("context", {})
    workload = _rebuild(context.get("workload_spec"), file, context.get("plugins"))
    recommended = (result["recommendation"] or {}).get("safe")
    size = args.size or recommended
    if not isinstance(size, int) or size <= 0:
        raise UsageError(f"{file} recommends no size: give one with --size N")
    check_sizes([("--size", size)], workload.seq_len)
    dev = resolve_device(result["device"], check=True)
    # Before any step: a read-only or full folder would cost the whole run's result.
    check_output_folder(file.parent, fix=(
        "verify writes verify.json beside report.json: free space there, or copy the report "
        "folder somewhere writable and verify the copy"))
    label = (result.get("size_name") or "batch_size").replace("_", " ")
    budget = result.get("budget_bytes")
    mode = result.get("mode")
    isolate = mode in ("isolated", "confirmed")  # where the answer was found
    print(f"oomguard: verifying {workload.name}: {args.steps} steps at {label} {size} on {dev} "
          f"under {fmt_bytes(budget) if budget else 'no budget'} ({_where(mode)})",
          file=sys.stderr, flush=True)
    check = _verify_counted(workload, size, args.steps, wanted(args.progress), device=dev,
                            budget=budget, isolate=isolate)
    check["report"] = str(file)
    check["lines"] = lines_of(doc)
    check["verdict"], check["held_to_bytes"] = judge(check, check["lines"],
                                                     recommended=size == recommended)
    try:
        out = atomic_write_json(file.parent / "verify.json", check)
    except OSError as exc:  # the disk filled up (or went read-only) during the steps
        return _unwritten(check, label, exc, args.json)
    if args.json:
        print(json_text(check), end="")
    else:
        print(f"{_line(check, label)}\nwritten: {out}")
    return 0 if check["verdict"] == "ok" else 1


def _where(mode: str | None) -> str:
    """Where verify's steps run, against where the report's trials ran (its ``mode``)."""
    if mode in ("isolated", "confirmed"):
        return "isolated, as the report's trials ran"
    if mode == "forked":  # a run after the search is in the searching process, not a fork
        return "in this process, as a run after the search; the report's trials ran in forks"
    return "in-process, as the report's trials ran"


def _unwritten(check: dict[str, Any], label: str, exc: OSError, as_json: bool) -> int:
    """Exit code 1 when verify.json cannot be written after the steps ran: the measured
    result printed in full on stdout (the verdict line, then verify.json's content), so
    nothing measured is lost, and one line on stderr saying what to do."""
    from oomguard.engine.util.jsonable import json_text

    if not as_json:
        print(_line(check, label))
    print(json_text(check), end="")
    where = exc.filename or Path(check["report"]).parent / "verify.json"
    print(f"oomguard: cannot write {where} ({exc.strerror or exc}): the result is on stdout "
          "above, in full; save it from there, or free space and run verify again",
          file=sys.stderr)
    return 1
