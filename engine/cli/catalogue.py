"""``oomguard metrics``: the catalogue of metrics, their knobs, and which models they support."""

from __future__ import annotations

import argparse

from oomguard.engine.cli.options import add_plugin_option, add_workload_options
from oomguard.engine.util.jsonable import json_text


def add_metrics(p: argparse.ArgumentParser) -> None:
    p.description = ("Every metric with its knobs (a few seconds). With --model, whether each "
                     "metric supports that model, and why not (from its config only: no "
                     "weights are built).")
    add_workload_options(p, model=(None, "say which metrics support it"))
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    add_plugin_option(p)
    p.set_defaults(func=cmd_metrics)


def cmd_metrics(args: argparse.Namespace) -> int:
    from oomguard.metrics.base import load_all
    from oomguard.metrics.models import model_config

    table = load_all()
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
