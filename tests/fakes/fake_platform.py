"""Windows and macOS as oomguard's code sees them, on a Linux test machine.

What each fake follows:

- Windows has no ``resource`` module: importing it raises ``ModuleNotFoundError:
  No module named 'resource'`` (CPython builds Modules/resource.c only on POSIX).
  ``platform.system()`` is ``"Windows"``, ``sys.platform`` ``"win32"``.
  :class:`FakeWinDLL` answers ``GlobalMemoryStatusEx`` (sysinfoapi.h: fills a
  MEMORYSTATUSEX whose ``dwLength`` the caller set, returns nonzero on success, 0
  otherwise), ``K32GetProcessMemoryInfo`` (psapi.h: fills PROCESS_MEMORY_COUNTERS,
  working sets in bytes, returns nonzero on success) and ``GetCurrentProcess``
  (the pseudo handle ``(HANDLE)-1``), as Microsoft's Win32 API reference
  documents them.
- macOS: ``resource`` exists with XNU's constants (bsd/sys/resource.h:
  ``RLIMIT_DATA`` 2, ``RLIMIT_AS`` 5, ``RLIM_INFINITY`` 2**63 - 1, ``RUSAGE_SELF``
  0), and ``getrusage().ru_maxrss`` is in *bytes* (Linux: KiB). The command-line
  tools print what macOS's print: ``sysctl -n hw.memsize`` the RAM in bytes;
  ``vm_stat`` a "Mach Virtual Memory Statistics: (page size of N bytes)" header
  then "Pages free:  123." lines (system_cmds vm_stat.c); ``ps -o rss= -p PID``
  the resident size in KiB.
- Windows' ``signal`` (:func:`windows_signal`) is CPython's as built there: the names
  MSVC's signal.h defines (SIGINT 2, SIGILL 4, SIGFPE 8, SIGSEGV 11, SIGTERM 15, SIGBREAK
  21, SIGABRT 22) and CTRL_C_EVENT 0, CTRL_BREAK_EVENT 1, in ``Signals`` (Lib/signal.py
  collects the ``SIG*`` and ``CTRL_*`` names the C module has); no SIGKILL, SIGHUP,
  SIGUSR1/2, SIGQUIT, SIGALRM, no ``pthread_sigmask`` or ``SIG_BLOCK`` ("Availability:
  Unix"). ``signal.signal`` takes only SIGABRT, SIGFPE, SIGILL, SIGINT, SIGSEGV, SIGTERM
  and SIGBREAK, else ``ValueError: invalid signal value`` (Modules/signalmodule.c under
  MS_WINDOWS; the docs: "On Windows, signal() can only be called with SIGABRT, SIGFPE,
  SIGILL, SIGINT, SIGSEGV, SIGTERM, or SIGBREAK. A ValueError will be raised in any other
  case."). multiprocessing's start methods there are ``["spawn"]``
  (Lib/multiprocessing/context.py reads ``sys.platform`` when asked).
- macOS: multiprocessing's default start method is ``spawn`` (Lib/multiprocessing/
  context.py: "bpo-33725: running arbitrary code after fork() is no longer reliable on
  macOS since macOS 10.14 (Mojave). Use spawn by default instead."), and
  ``get_all_start_methods()`` lists ``spawn`` first.
- Both: no ``/proc`` (``oomguard.probes.host.PROC`` points at an empty folder) and
  no glibc (``ctypes.util.find_library("c")`` returns None, as it does where no C
  library can be found).

Figures (RAM, resident bytes, peaks) are this Linux machine's real ones, in the
units each OS uses, so the numbers a fake OS reports are plausible.

Python's own modules that branch on ``sys.platform`` when imported (subprocess,
multiprocessing) would try to load Windows-only C modules; :func:`enter` therefore
imports every third-party and standard module oomguard needs under the real OS
first (multiprocessing's process launchers too: this Linux machine still starts the
children, with Linux's ``signal``), then drops oomguard's modules and imports them
again under the fake one. The children themselves are real Linux processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import importlib
import importlib.abc
import io
import json
import multiprocessing
import os
import pkgutil
import platform
import resource as _real_resource
import signal as _real_signal
import sys
import types
from pathlib import Path

SUBPACKAGES = ("engine", "metrics", "probes", "reports")
_PAGE = 16384  # Apple silicon's page size
_DARWIN_RLIM_INFINITY = (1 << 63) - 1


def _proc_kib(name: str, key: str) -> int:
    for line in Path("/proc", name).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class _HideModules(importlib.abc.MetaPathFinder):
    """Refuses ``names`` as an OS without them does: ``ModuleNotFoundError``."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


class _WinFunction:
    """One kernel32 export: callable, with the ``argtypes``/``restype`` ctypes sets."""

    def __init__(self, fn) -> None:
        self.fn, self.argtypes, self.restype = fn, None, None

    def __call__(self, *args):
        return self.fn(*args)


class FakeWinDLL:
    """``ctypes.WinDLL("kernel32")`` answering the three calls oomguard makes."""

    def __init__(self, name: str, use_last_error: bool = False) -> None:
        if name.lower() not in ("kernel32", "kernel32.dll"):
            raise OSError(f"[WinError 126] The specified module could not be found: {name!r}")
        self.GlobalMemoryStatusEx = _WinFunction(self._memory_status)
        self.K32GetProcessMemoryInfo = _WinFunction(self._process_memory)
        self.GetCurrentProcess = _WinFunction(lambda: (1 << 64) - 1)  # (HANDLE)-1

    @staticmethod
    def _memory_status(ref) -> int:
        status = ref._obj
        if status.dwLength != ctypes.sizeof(status):
            return 0  # ERROR_INVALID_PARAMETER: dwLength not set
        status.ullTotalPhys = _proc_kib("meminfo", "MemTotal") * 1024
        status.ullAvailPhys = _proc_kib("meminfo", "MemAvailable") * 1024
        return 1

    @staticmethod
    def _process_memory(handle: int, ref, cb: int) -> int:
        counters = ref._obj
        if cb < ctypes.sizeof(counters):
            return 0
        counters.WorkingSetSize = _proc_kib("self/status", "VmRSS") * 1024
        counters.PeakWorkingSetSize = _proc_kib("self/status", "VmHWM") * 1024
        return 1


# MSVC's signal.h, and the console events of wincon.h that CPython adds (CTRL_*_EVENT).
WINDOWS_SIGNALS = {"SIGINT": 2, "SIGILL": 4, "SIGFPE": 8, "SIGSEGV": 11, "SIGTERM": 15,
                   "SIGBREAK": 21, "SIGABRT": 22}
WINDOWS_EVENTS = {"CTRL_C_EVENT": 0, "CTRL_BREAK_EVENT": 1}
WINDOWS_MISSING = ("SIGKILL", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGALRM",
                   "pthread_sigmask", "SIG_BLOCK", "SIG_SETMASK")


def windows_signal() -> types.ModuleType:
    """Windows' ``signal`` module. Handlers of the signals Linux numbers alike (SIGINT,
    SIGILL, SIGFPE, SIGSEGV, SIGTERM) are this machine's real ones; SIGBREAK's and
    SIGABRT's (other numbers here) are only kept."""
    mod = types.ModuleType("signal")
    signals = enum.IntEnum("Signals", {**WINDOWS_SIGNALS, **WINDOWS_EVENTS})
    shared = {v for k, v in WINDOWS_SIGNALS.items() if getattr(_real_signal, k, None) == v}
    kept: dict[int, object] = {s: _real_signal.SIG_DFL for s in WINDOWS_SIGNALS.values()
                               if s not in shared}

    def valid(signalnum: int) -> int:
        if int(signalnum) not in WINDOWS_SIGNALS.values():
            raise ValueError("invalid signal value")
        return int(signalnum)

    def signal(signalnum: int, handler: object) -> object:
        num = valid(signalnum)
        if num in shared:
            return _real_signal.signal(num, handler)
        previous, kept[num] = kept[num], handler
        return previous

    def getsignal(signalnum: int) -> object:
        num = valid(signalnum)
        return _real_signal.getsignal(num) if num in shared else kept[num]

    mod.__dict__.update({k: signals[k] for k in {**WINDOWS_SIGNALS, **WINDOWS_EVENTS}})
    mod.__dict__.update(Signals=signals, Handlers=_real_signal.Handlers, NSIG=23,
                        SIG_DFL=_real_signal.SIG_DFL, SIG_IGN=_real_signal.SIG_IGN,
                        default_int_handler=_real_signal.default_int_handler,
                        signal=signal, getsignal=getsignal,
                        valid_signals=lambda: set(signals) - set(WINDOWS_EVENTS.values()),
                        strsignal=lambda n: signals(valid(n)).name)
    assert not any(hasattr(mod, name) for name in WINDOWS_MISSING)
    return mod


def darwin_resource() -> types.ModuleType:
    """macOS's ``resource`` module: XNU constants, ``ru_maxrss`` in bytes."""
    mod = types.ModuleType("resource")
    limits = {2: (_DARWIN_RLIM_INFINITY,) * 2, 5: (_DARWIN_RLIM_INFINITY,) * 2}

    def getrusage(who: int):
        real = _real_resource.getrusage(_real_resource.RUSAGE_SELF if who == 0 else who)
        return types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real)
                                        if k.startswith("ru_")} | {"ru_maxrss": real.ru_maxrss * 1024})

    def getrlimit(which: int) -> tuple[int, int]:
        if which not in limits:
            raise ValueError("invalid resource specified")
        return limits[which]

    def setrlimit(which: int, value: tuple[int, int]) -> None:
        soft, hard = value
        if which not in limits:
            raise ValueError("invalid resource specified")
        if soft > hard:
            raise ValueError("current limit exceeds maximum limit")
        limits[which] = (soft, hard)

    mod.__dict__.update(RLIMIT_DATA=2, RLIMIT_AS=5, RLIMIT_RSS=5, RLIM_INFINITY=_DARWIN_RLIM_INFINITY,
                        RUSAGE_SELF=0, getrusage=getrusage, getrlimit=getrlimit,
                        setrlimit=setrlimit, getpagesize=lambda: _PAGE, error=OSError)
    return mod


def darwin_tools(bin_dir: Path) -> None:
    """Write ``sysctl``, ``vm_stat`` and ``ps`` into ``bin_dir``, printing what macOS's print."""
    total = _proc_kib("meminfo", "MemTotal") * 1024
    avail_pages = _proc_kib("meminfo", "MemAvailable") * 1024 // _PAGE
    free, spec = avail_pages // 4, avail_pages // 8
    inactive = avail_pages - free - spec
    vm_stat = "\n".join([
        f"Mach Virtual Memory Statistics: (page size of {_PAGE} bytes)",
        f"Pages free:                               {free:>10}.",
        f"Pages active:                             {avail_pages // 2:>10}.",
        f"Pages inactive:                           {inactive:>10}.",
        f"Pages speculative:                        {spec:>10}.",
        "Pages throttled:                                   0.",
        f"Pages wired down:                         {avail_pages // 10:>10}.",
        f"Pages purgeable:                          {spec // 2:>10}.",
        '"Translation faults":                       37287533.',
    ])
    scripts = {
        "sysctl": f'[ "$*" = "-n hw.memsize" ] && echo {total} && exit 0\n'
                  'echo "sysctl: unknown oid \'$2\'" >&2; exit 1',
        "vm_stat": f"cat <<'EOF'\n{vm_stat}\nEOF",
        # ps reads the real resident size of the pid asked for, in KiB.
        "ps": 'pid="$4"; awk \'/^VmRSS:/ {printf "%6d\\n", $2}\' /proc/$pid/status',
    }
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body + "\n")
        path.chmod(0o755)


def _oomguard_modules() -> list[str]:
    """Every module of the package (``__main__`` runs the CLI, so not that one)."""
    import oomguard

    names = ["oomguard"]
    for sub in SUBPACKAGES:
        pkg = importlib.import_module(f"oomguard.{sub}")
        names.append(pkg.__name__)
        names += [n for _, n, _ in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    del oomguard
    return names


def enter(os_name: str, proc_root: Path, bin_dir: Path | None = None) -> list[str]:
    """Make this process look like ``os_name`` (``"Windows"`` or ``"Darwin"``) to oomguard;
    return the names of oomguard's modules (none imported yet under the fake OS)."""
    names = _oomguard_modules()
    for name in names:  # what they import stays loaded; themselves, not
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    for name in [m for m in sys.modules if m == "oomguard" or m.startswith("oomguard.")]:
        del sys.modules[name]
    # What starts and stops children on this machine, imported with Linux's signal
    # (popen_fork's kill() sends SIGKILL): the children are real Linux processes.
    for name in ("popen_fork", "popen_spawn_posix", "popen_forkserver", "forkserver",
                 "resource_tracker", "spawn"):
        importlib.import_module(f"multiprocessing.{name}")
    sys.modules.pop("resource", None)
    if os_name == "Windows":
        sys.meta_path.insert(0, _HideModules({"resource"}))
        ctypes.WinDLL = FakeWinDLL  # type: ignore[attr-defined]
        sys.modules["signal"] = windows_signal()
        sys.platform = "win32"
    else:
        sys.modules["resource"] = darwin_resource()
        darwin_tools(bin_dir)
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        sys.platform = "darwin"
        multiprocessing.set_start_method("spawn", force=True)  # macOS's default
    platform.system = lambda: os_name
    real_find = ctypes.util.find_library
    ctypes.util.find_library = lambda name: None if name == "c" else real_find(name)
    host = importlib.import_module("oomguard.probes.host")
    host.PROC = host.CGROUP_ROOT = proc_root
    return names


def run(os_name: str, proc_root: str, bin_dir: str | None = None) -> dict:
    """Under the fake ``os_name``: import every module, then ``oomguard probe --json`` and
    ``oomguard metrics``, then a small search without a budget; return what happened
    (failed imports, exit codes, outputs, the search's limit and peaks)."""
    names = enter(os_name, Path(proc_root), Path(bin_dir) if bin_dir else None)
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
            failed[name] = f"{type(exc).__name__}: {exc}"
    report: dict = {"failed_imports": failed}
    try:
        from oomguard.engine.cli.main import main
    except Exception as exc:  # noqa: BLE001
        report["cli"] = f"{type(exc).__name__}: {exc}"
        return report
    for key, argv in (("probe", ["probe", "--json"]), ("metrics", ["metrics"])):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except Exception as exc:  # noqa: BLE001
                code, err = -1, io.StringIO(f"{type(exc).__name__}: {exc}")
        report[key] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
    # What `oomguard bench` does on this OS: no budget, so a RAM guard bounds the trials.
    import torch

    from oomguard import search
    from oomguard.engine.cli.options import budget_free_limit, default_budget
    from oomguard.engine.core.search.strategies import Doubling

    result = search(lambda n: torch.ones(n, 1024, 1024).sum().item(),
                    strategy=Doubling(start=1), max_size=8,
                    budget=default_budget(torch.device("cpu"), None))
    report["search"] = {"limit": result.limit, "max_ok": result.max_ok,
                        "peaks": [t.peak_bytes for t in result.trials],
                        "first_line": budget_free_limit("cpu")}
    report["children"] = _children(os_name)
    from oomguard.probes import host

    method = host.peak_method()
    report["host"] = {"budget": host.host_budget_unavailable(), "peak_source": method.source,
                      "peak_resettable": method.resettable, "peak_reason": method.reason,
                      "reset": host.reset_peak(), "peak": host.read_peak()}
    return report


def _fits(n: int) -> float:
    """A trial's workload (module-level: a spawned child imports it from this file)."""
    import torch

    return torch.ones(n, 1024).sum().item()


def _dies(n: int) -> None:
    """A workload whose process dies: exit code 3, as the MSVC CRT's ``abort()`` ends one."""
    os._exit(3)


def _children(os_name: str) -> dict:
    """How children start here (jobs' tasks, reference rows: ``start_method``; isolated
    searches: their runner's context), a fitting isolated trial, and on Windows (whose
    ``signal`` has no SIGKILL) a dying one."""
    from oomguard.engine.core import child as launcher
    from oomguard.engine.core.search.isolate import IsolatedRunner

    out: dict = {"start_method": {d: launcher.start_method(d) for d in ("cpu", "mps", "cuda")},
                 "context": launcher.context(launcher.start_method("cpu")).get_start_method(),
                 "isolated": {d: IsolatedRunner(_fits, d).ctx.get_start_method()
                              for d in ("cpu", "mps")}}
    cases = [("fits", _fits)] + ([("dies", _dies)] if os_name == "Windows" else [])
    for key, fn in cases:
        try:
            with IsolatedRunner(fn, "cpu", timeout=120) as runner:
                trial = runner(4)
            out[key] = {"ok": trial.ok, "peak": trial.peak_bytes, "error": trial.error}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
            out[key] = {"raised": type(exc).__name__, "message": str(exc)}
    return out


if __name__ == "__main__":
    print("FAKE-REPORT " + json.dumps(run(*sys.argv[1:])))
