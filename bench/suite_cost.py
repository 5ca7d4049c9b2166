#!/usr/bin/env python
"""Where the test suite's CPU goes: each test's machine-wide CPU-seconds, one test at a time.

Run it from the repository root on an otherwise idle Linux machine::

    python bench/suite_cost.py [--top N] [--json FILE] [PYTEST ARGS...]

It runs pytest in one process (``-n 0 -p no:randomly``, in file order, so two runs
compare), and records, around each test's setup, call and teardown, the CPU time of the
run's own processes: as root, a cgroup v1 ``cpuacct`` group that pytest enters first and
every process it starts inherits (commands, forkservers and their children, Ray,
torchrun), reaped or not, so other work on the machine does not count; else that of the
whole machine (``/proc/stat``: user, nice, system, irq, softirq and steal), which is exact
only on an idle machine. Either way a test's processes count for it, as its wall time
does not. Prints one table: the most expensive tests, then the totals: all tests, the top
``N``, the rest, and the share of the CPU spent in the kernel. Collection is not counted.
Linux only.

``--run`` instead runs the README's own command (``python -m pytest -q``, ``-n 2``,
shuffled; extra arguments passed on) in such a group and prints its wall seconds and the
CPU-seconds of its processes (user, kernel): how two trees compare on a busy machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


_CPUACCT = Path("/sys/fs/cgroup/cpuacct")  # cgroup v1's CPU accounting, where mounted


def machine_cpu() -> tuple[float, float]:
    """(busy, kernel) CPU-seconds of the whole machine since boot, from ``/proc/stat``."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK, system / _TICK


class RunGroup:
    """A cgroup v1 ``cpuacct`` group of this process and every process it starts from now on
    (they inherit it): :meth:`cpu` is their (busy, kernel) CPU-seconds so far, the dead
    ones' included. :meth:`enter` returns None where there is no such hierarchy or no right
    to make a group (not root)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def enter(cls) -> RunGroup | None:
        path = _CPUACCT / f"oomguard-suite-{os.getpid()}"
        try:
            path.mkdir()
        except OSError:
            return None
        try:
            (path / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            path.rmdir()
            return None
        return cls(path)

    def cpu(self) -> tuple[float, float]:
        user = int((self.path / "cpuacct.usage_user").read_text())
        system = int((self.path / "cpuacct.usage_sys").read_text())
        return (user + system) / 1e9, system / 1e9

    def leave(self) -> None:
        """Back to the parent group; the group removed once nothing is left in it (a
        process a test left running keeps it, and its name says whose it was)."""
        with contextlib.suppress(OSError):
            (_CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(50):  # the forkservers and resource trackers end just after pytest
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


class Recorder:
    """A pytest plugin: each test's node id, CPU-seconds (busy, kernel: ``cpu()``'s, the
    run's group or the machine) and wall seconds, setup to teardown."""

    def __init__(self, cpu: Callable[[], tuple[float, float]]) -> None:
        self.rows: list[dict] = []
        self.cpu = cpu

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        (busy, kernel), t0 = self.cpu(), time.monotonic()
        try:
            return (yield)
        finally:
            busy1, kernel1 = self.cpu()
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
    parser.add_argument("--run", action="store_true",
                        help="the README's command (-n 2, shuffled) in a group: wall and CPU")
    args, pytest_args = parser.parse_known_args(argv)
    if args.top <= 0:
        parser.error(f"--top must be a positive integer, got {args.top}")
    if not Path("/proc/stat").is_file():
        parser.error("this needs Linux's /proc/stat (machine-wide CPU time)")
    os.chdir(ROOT)
    group = RunGroup.enter()
    try:
        if args.run:
            return whole_run(group, pytest_args)
        return per_test(group, args, pytest_args)
    finally:
        if group is not None:
            group.leave()


def whole_run(group: RunGroup | None, pytest_args: list[str]) -> int:
    """The README's command in ``group``: its wall seconds, its processes' CPU-seconds."""
    if group is None:
        print("--run needs a cgroup of its own (root, cgroup v1 cpuacct)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "pytest", "-q", *pytest_args]).returncode
    wall = time.monotonic() - t0
    busy, kernel = group.cpu()
    print(f"the run: {wall:.0f} s wall, {busy:.0f} CPU-seconds of its processes "
          f"({busy - kernel:.0f} user, {kernel:.0f} kernel), pytest exit {code}")
    return code


def per_test(group: RunGroup | None, args: argparse.Namespace, pytest_args: list[str]) -> int:
    """Each test's CPU-seconds, one test at a time in file order, and the table."""
    recorder = Recorder(group.cpu if group is not None else machine_cpu)
    sys.path.insert(0, str(ROOT))  # as `python -m pytest` does: the tests import tests.conftest
    code = pytest.main(["-q", "-n", "0", "-p", "no:randomly", *pytest_args], plugins=[recorder])
    print("CPU of " + ("this run's processes (a cgroup)" if group is not None
                       else "the whole machine (/proc/stat): other work counts too"))
    if not recorder.rows:
        print(f"no test ran (pytest exit {int(code)}): see pytest's output above", file=sys.stderr)
        return int(code) or 1
    print(table(recorder.rows, args.top))
    if args.json:
        args.json.write_text(json.dumps(recorder.rows, indent=1), encoding="utf-8")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
