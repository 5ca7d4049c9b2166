#!/usr/bin/env python
"""Where the test suite's CPU goes, by kind of process, in the README's own run (``-n 2``).

Run it as root from the repository root on an otherwise idle Linux machine::

    python bench/suite_processes.py [PYTEST ARGS...]

It turns on the kernel's process accounting (``acct(2)``, which needs root: every process
that ends writes its user and kernel CPU time, its threads' included) for one run of
``python -m pytest -q`` (the README's command; extra arguments are passed on), and a
``sitecustomize`` on ``PYTHONPATH`` writes each Python interpreter's pid, parent and command
line as it starts. Prints one table: CPU-seconds (user, kernel) and process counts by
kind: the pytest workers, their forkservers and the children forked from those, commands
and scripts the tests start as a user would, spawned interpreters, Ray's processes, the
rest. ``bench/suite_cost.py`` gives the same CPU per test instead, one test at a time.
Linux only.
"""

from __future__ import annotations

import collections
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")  # struct acct_v3 (linux/acct.h), 64 bytes
_AHZ = 100  # acct_v3 times are in units of 1/AHZ s

_STARTS = '''import os
with open({log!r}, "a") as f:
    with open("/proc/self/cmdline", "rb") as c:
        cmd = c.read().replace(b"\\0", b" ").decode(errors="replace")
    f.write("%d %d %s\\n" % (os.getpid(), os.getppid(), cmd[:400].replace("\\n", " ")))
'''


def _comp(value: int) -> float:
    """A ``comp_t`` (13-bit mantissa, 3-bit base-8 exponent) in seconds."""
    return ((value & 0x1FFF) << (3 * (value >> 13))) / _AHZ


def read_accounting(path: Path) -> dict[int, dict]:
    """pid -> parent at exit, user and kernel CPU-seconds and command name, per record."""
    data, out = path.read_bytes(), {}
    for i in range(0, len(data) - _RECORD.size + 1, _RECORD.size):
        f = _RECORD.unpack_from(data, i)
        if f[1] != 3:
            raise SystemExit("process accounting is not in the v3 format this reads")
        out[f[6]] = {"ppid": f[7], "user": _comp(f[10]), "kernel": _comp(f[11]),
                     "comm": f[18].split(b"\0")[0].decode(errors="replace")}
    return out


def read_starts(path: Path) -> dict[int, tuple[int, str]]:
    """pid -> (parent at start, command line) of every Python interpreter started."""
    starts = {}
    for line in path.read_text(errors="replace").splitlines():
        pid, ppid, cmd = (line.split(" ", 2) + [""])[:3]
        if pid.isdigit() and ppid.isdigit():
            starts[int(pid)] = (int(ppid), cmd)
    return starts


def kind(pid: int, procs: dict[int, dict], starts: dict[int, tuple[int, str]]) -> str:
    """What a process was: from its command line, else from its parent's."""
    if pid in starts:
        cmd = starts[pid][1]
        for needle, name in (("multiprocessing.forkserver", "forkservers"),
                             ("exec(eval(sys.stdin", "pytest workers"),
                             ("spawn_main", "spawned interpreters (spawn)"),
                             ("resource_tracker", "resource trackers"), ("/ray/", "Ray's processes"),
                             ("-m pytest", "pytest (the run itself)"),
                             (" -m oomguard", "oomguard commands"), ("bin/oomguard", "oomguard commands")):
            if needle in cmd:
                return name
        return "other Python scripts and -c"
    parent = starts.get(procs[pid]["ppid"], (0, ""))[1]
    if "multiprocessing.forkserver" in parent:
        return "children forked by a forkserver"
    comm = procs[pid]["comm"]
    if comm.startswith(("ray::", "raylet", "gcs_server")):
        return "Ray's processes"
    return "other (forked children, tools)" if comm.startswith("python") else f"other: {comm}"


def table(procs: dict[int, dict], starts: dict[int, tuple[int, str]]) -> str:
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for pid, p in procs.items():
        row = rows[kind(pid, procs, starts) if p["user"] + p["kernel"] >= 0.05 or pid in starts
                   else "processes under 0.05 CPU-s"]
        row[0] += 1
        row[1] += p["user"]
        row[2] += p["kernel"]
    lines = ["| CPU s | user s | kernel s | processes | kind |", "|---:|---:|---:|---:|---|"]
    for name, (n, user, kernel) in sorted(rows.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        lines.append(f"| {user + kernel:.1f} | {user:.1f} | {kernel:.1f} | {n} | {name} |")
    user = sum(p["user"] for p in procs.values())
    kernel = sum(p["kernel"] for p in procs.values())
    lines += ["", f"{len(procs)} processes: {user + kernel:.0f} CPU-seconds "
                  f"({kernel:.0f} in the kernel, {kernel / max(user + kernel, 1e-9):.0%})"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not Path("/proc/self/cmdline").exists():
        raise SystemExit("this needs Linux")
    libc = ctypes.CDLL(None, use_errno=True)
    with tempfile.TemporaryDirectory() as tmp:
        acct, log = Path(tmp, "pacct"), Path(tmp, "starts.log")
        acct.touch()
        Path(tmp, "sitecustomize.py").write_text(_STARTS.format(log=str(log)), encoding="utf-8")
        if libc.acct(str(acct).encode()) != 0:
            raise SystemExit(f"acct(2) failed ({os.strerror(ctypes.get_errno())}): run as root")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [tmp, *filter(None, [os.environ.get("PYTHONPATH")])]))
        t0 = time.monotonic()
        try:
            code = subprocess.run([sys.executable, "-m", "pytest", "-q", *argv], cwd=ROOT,
                                  env=env).returncode
        finally:
            libc.acct(None)
        wall = time.monotonic() - t0
        print(table(read_accounting(acct), read_starts(log)))
        print(f"the run: {wall:.0f} s wall, pytest exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
