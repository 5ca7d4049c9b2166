#!/usr/bin/env python
"""Where the test suite's CPU goes: each test's machine-wide CPU-seconds, one test at a time.

Run it from the repository root on an otherwise idle Linux machine::

    python bench/suite_cost.py [--top N] [--json FILE] [PYTEST ARGS...]

It runs pytest in one process (``-n 0 -p no:randomly``, in file order, so two runs
compare), and records, around each test's setup, call and teardown, the CPU time of the
whole machine (``/proc/stat``: user, nice, system, irq, softirq and steal), so the
processes a test starts (commands, forkservers and their children, Ray, torchrun) count
for it, as its wall time does not. Prints one table: the most expensive tests, then
the totals: all tests, the top ``N``, the rest, and the share of the CPU spent in the kernel.
Collection is not counted. Linux only (``/proc/stat``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu() -> tuple[float, float]:
    """(busy, kernel) CPU-seconds of the whole machine since boot, from ``/proc/stat``."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK, system / _TICK


class Recorder:
    """A pytest plugin: each test's node id, machine CPU-seconds (busy, kernel) and wall
    seconds, setup to teardown."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        (busy, kernel), t0 = machine_cpu(), time.monotonic()
        try:
            return (yield)
        finally:
            busy1, kernel1 = machine_cpu()
            self.rows.append({"test": item.nodeid, "cpu_s": round(busy1 - busy, 2),
                              "kernel_s": round(kernel1 - kernel, 2),
                              "wall_s": round(time.monotonic() - t0, 2)})


def table(rows: list[dict], top: int) -> str:
    ranked = sorted(rows, key=lambda r: -r["cpu_s"])
    lines = ["| CPU s | kernel s | wall s | test |", "|---:|---:|---:|---|"]
    lines += [f"| {r['cpu_s']:.1f} | {r['kernel_s']:.1f} | {r['wall_s']:.1f} | {r['test']} |"
              for r in ranked[:top]]
    total = sum(r["cpu_s"] for r in rows)
    if not total:
        return "\n".join([*lines, "", f"{len(rows)} tests: no CPU time recorded"])
    head = sum(r["cpu_s"] for r in ranked[:top])
    kernel = sum(r["kernel_s"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    return "\n".join([
        *lines, "",
        f"{len(rows)} tests: {total:.0f} CPU-seconds ({kernel:.0f} in the kernel, "
        f"{kernel / total:.0%}), {wall:.0f} s wall one at a time",
        f"the top {min(top, len(rows))}: {head:.0f} CPU-seconds ({head / total:.0%}); "
        f"the other {max(0, len(rows) - top)}: {total - head:.0f}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30, help="tests to list (default 30)")
    parser.add_argument("--json", type=Path, help="also write every test's figures here")
    args, pytest_args = parser.parse_known_args(argv)
    if args.top <= 0:
        parser.error(f"--top must be a positive integer, got {args.top}")
    if not Path("/proc/stat").is_file():
        parser.error("this needs Linux's /proc/stat (machine-wide CPU time)")
    recorder = Recorder()
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))  # as `python -m pytest` does: the tests import tests.conftest
    code = pytest.main(["-q", "-n", "0", "-p", "no:randomly", *pytest_args], plugins=[recorder])
    if not recorder.rows:
        print(f"no test ran (pytest exit {int(code)}): see pytest's output above", file=sys.stderr)
        return int(code) or 1
    print(table(recorder.rows, args.top))
    if args.json:
        args.json.write_text(json.dumps(recorder.rows, indent=1), encoding="utf-8")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
