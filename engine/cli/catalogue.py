"""``oomguard metrics``: the catalogue of metrics, their knobs, and which models they support;
with ``--check``, whether each memory knob leaves the result alone."""

from __future__ import annotations

import argparse
from typing import Any

from oomguard.engine.cli.options import add_plugin_option, add_workload_options
from oomguard.engine.util.jsonable import json_text

CHECK_MODEL = "tiny-gpt2"  # --check's model where --model is not given
CHECK_SEQ_LEN = 16


def add_metrics(p: argparse.ArgumentParser) -> None:
    p.description = ("Every metric with its knobs (a few seconds). With --model, whether each "
                     "metric supports that model, and why not (from its config only: no "
                     "weights are built). With --check, each memory knob verified: the metric "
                     "run at two sizes of it on 3 rows of generated data, the results compared "
                     "(exit 1 if one differs beyond float rounding).")
    add_workload_options(p, model=(None, "say which metrics support it; with --check, the "
                                   f"model it runs on (default {CHECK_MODEL})"),
                         metric=(None, "with --check: only this one"),
                         seq_len=(None, f"with --check only; default {CHECK_SEQ_LEN}"))
    p.add_argument("--check", action="store_true",
                   help="verify that each memory knob does not change the result")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    add_plugin_option(p)
    p.set_defaults(func=cmd_metrics)


def cmd_metrics(args: argparse.Namespace) -> int:
    from oomguard.engine.errors import UsageError
    from oomguard.metrics.base import get_metric, load_all
    from oomguard.metrics.models import model_config

    if args.check:
        return _check(args)
    if args.seq_len is not None:
        raise UsageError("--seq-len is for --check (the data the knobs are checked on): add --check, "
                         "or drop --seq-len")
    table = load_all() if args.metric is None else {args.metric: get_metric(args.metric)}
    config = model_config(args.model) if args.model else None
    support = {name: (m.unsupported(config) if config is not None else None)
               for name, m in table.items()}
    if args.json:
        print(json_text({name: {"description": m.description, "knobs": list(m.knobs)}
                         | ({} if config is None else {"supported": support[name] is None,
                                                       "why_not": support[name]})
                         for name, m in table.items()}), end="")
        return 0
    for name, m in sorted(table.items()):
        if config is not None:
            status = f"not supported: {support[name]}" if support[name] else "supported"
            print(f"{name}: {status}")
            continue
        print(f"{name}: {m.description}")
        for k in m.knobs:
            tag = "memory (tuned)" if k.kind == "memory" else "result (fixed)"
            scale = f"; scales with {k.scales_with}" if k.scales_with else ""
            unit = f"; searched in multiples of {k.unit}" if k.unit else ""
            print(f"    {k.name:<22} {tag:<15} default {k.default}, min {k.minimum}{scale}{unit}")
    return 0


def _check(args: argparse.Namespace) -> int:
    """``--check``: a line per memory knob (:func:`~oomguard.metrics.knob_check.
    check_memory_knobs`) on ``--model`` with 3 generated rows; 1 if a knob changes a result."""
    from oomguard.engine.errors import UsageError
    from oomguard.metrics.base import get_metric, load_all
    from oomguard.metrics.knob_check import ROWS, check_memory_knobs
    from oomguard.metrics.models import build_model, check_seq_len, make_batch, model_config

    seq_len = CHECK_SEQ_LEN if args.seq_len is None else args.seq_len
    if seq_len <= 0:
        raise UsageError(f"--seq-len must be a positive integer, got {seq_len}; give one "
                         "such as 32")
    spec = args.model or CHECK_MODEL
    config = model_config(spec)
    check_seq_len(config, seq_len)
    table = load_all() if args.metric is None else {args.metric: get_metric(args.metric)}
    model = build_model(spec)
    data = make_batch(ROWS, seq_len, config.vocab_size)
    rows: list[dict[str, Any]] = []
    for name, m in sorted(table.items()):
        why = m.unsupported(config)
        verdicts = [] if why else check_memory_knobs(m, model, data)
        if why or not verdicts:
            rows.append({"metric": name, "knob": None, "status": "unchecked",
                         "detail": f"not supported: {why}" if why else "no memory knob"})
            line = f"{name}: unchecked ({rows[-1]['detail']})"
            if not args.json:
                print(line)
            continue
        for v in verdicts:
            rows.append(v.to_dict())
            if not args.json:
                print(v.line())
    if args.json:
        print(json_text(rows), end="")
    return 1 if any(r["status"] == "differs" for r in rows) else 0
