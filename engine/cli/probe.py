"""``oomguard probe``: the memory of the host and of every GPU, measured now, with no
torch import on a CPU-only machine."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from oomguard.engine.util.table import text_table
from oomguard.engine.util.units import fmt_bytes

if TYPE_CHECKING:
    from oomguard.probes import MemorySnapshot


def add_probe(p: argparse.ArgumentParser) -> None:
    p.description = "Memory of the host and of every GPU, measured now (well under a second)."
    p.add_argument("--device", default=None, help="one device only (cpu, cuda:N, mps)")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=cmd_probe)


def probe_table(snapshots: Sequence[MemorySnapshot]) -> str:
    """A plain-text table of memory snapshots, sizes in GiB."""
    rows = [("device", "name", "total", "free", "this process", "other processes", "note")]
    for s in snapshots:
        sizes = (s.total_bytes, s.free_bytes, s.process_bytes, s.other_processes_bytes)
        rows.append((s.device, s.name, *(fmt_bytes(n, "GiB") for n in sizes), s.reason or ""))
    return text_table(rows)


def cmd_probe(args: argparse.Namespace) -> int:
    from oomguard.engine.util.jsonable import json_text
    from oomguard.probes import probe, probe_all

    snaps = [probe(args.device)] if args.device else probe_all()
    if args.json:
        print(json_text([s.to_dict() for s in snaps]), end="")
    else:
        print(probe_table(snaps))
    return 0
