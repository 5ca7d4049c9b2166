"""The host (CPU RAM) backend: what this process may still allocate, in bytes.

On Linux the smallest of ``MemAvailable``, the cgroup limit and ``RLIMIT_DATA`` wins, and
the snapshot says which; peaks are ``VmHWM``, reset through ``/proc/self/clear_refs``. macOS and
Windows (:mod:`oomguard.probes.host_os`) give total and available RAM (an *estimate* on macOS)
and a lifetime peak. A figure that cannot be read is None, never 0.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from oomguard.probes import host_os
from oomguard.probes.host_os import parse_vm_stat  # noqa: F401 - part of this module's face

try:
    import resource
except ImportError:  # Windows has no resource module
    resource = None  # type: ignore[assignment]

# Roots read at call time (never at import), so a test can hide them.
PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# A cgroup limit this large means "no limit" (v1 reports ~2**63).
_CGROUP_UNLIMITED = 1 << 60


def system() -> str:
    """The OS as :func:`platform.system` names it: ``Linux``, ``Darwin``, ``Windows``, ..."""
    return platform.system()


class DataSize:
    """Reads a process's data segment in bytes (``VmData``, what ``RLIMIT_DATA`` limits) cheaply
    enough to sample every millisecond, from ``/proc/<pid>/statm`` (default: this process);
    :meth:`read` returns None where there is none."""

    def __init__(self, pid: int | None = None) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        where = PROC / ("self" if pid is None else str(pid))
        try:
            self._fd: int | None = os.open(where / "statm", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._stack = proc_status("VmStk", pid) or 0

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 256, 0).split()[5]) * self._page - self._stack
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def proc_status(key: str, pid: int | None = None) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmData``, ``VmRSS``, ``VmHWM``), or of
    process ``pid``'s, in bytes; None where there is no procfs."""
    try:
        text = (PROC / ("self" if pid is None else str(pid)) / "status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in text.splitlines()
                 if line.startswith(key + ":")), None)


def shared_anonymous_bytes() -> int | None:
    """Anonymous bytes shared copy-on-write after a ``fork`` (a write copies them: a cgroup
    charges that, ``VmData`` does not), from ``/proc/self/smaps_rollup``; None without it."""
    try:
        text = (PROC / "self" / "smaps_rollup").read_text()
    except OSError:
        return None
    kib = {p[0].rstrip(":"): int(p[1]) for p in (line.split() for line in text.splitlines())
           if len(p) == 3 and p[1].isdigit()}
    if "Anonymous" not in kib:
        return None
    return max(0, kib["Anonymous"] - kib.get("Private_Dirty", 0)) * 1024


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is no procfs)."""
    out: dict[str, int] = {}
    try:
        for line in (PROC / "meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if not text.isdigit() else int(text)


def cgroup_limit() -> tuple[int | None, int | None]:
    """(limit, working set) in bytes of the memory cgroup that leaves this process the least
    room (limit minus working set), or None: its own group or any ancestor up to the root
    (cgroup v1 and v2), since a parent's limit binds its children too (Slurm and some
    container runtimes limit a parent and run the job in an unlimited child). The working set
    is the usage minus the inactive file pages, which the kernel reclaims before it kills a
    process of the group (the figure ``docker stats`` and the kubelet count)."""
    try:
        lines = (PROC / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    tightest: tuple[int, int | None] | None = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # cgroup v2 unified hierarchy
            root, files = CGROUP_ROOT, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            root, files = CGROUP_ROOT / "memory", ("memory.limit_in_bytes",
                                                   "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for base in _groups(root, rel):
            found = _group_limit(base, *files)
            if found is not None and (tightest is None or _room(found) < _room(tightest)):
                tightest = found
    return (None, None) if tightest is None else tightest


def _groups(root: Path, rel: str) -> list[Path]:
    """The folders of the group at ``rel`` under the hierarchy mounted at ``root`` and of each
    ancestor, the root last. In a container without a cgroup namespace ``rel`` names the host's
    path while ``root`` is the container's own group: the folders that do not exist are left
    out, so the walk starts where the mount does."""
    parts = [p for p in rel.split("/") if p and p not in (".", "..")]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)
            if root.joinpath(*parts[:n]).is_dir()]


def _group_limit(base: Path, limit_file: str, usage_file: str,
                 inactive: str) -> tuple[int, int | None] | None:
    """(limit, working set) of one cgroup folder in bytes; None where it sets no limit."""
    limit, usage = _read_int(base / limit_file), _read_int(base / usage_file)
    if limit is None or limit >= _CGROUP_UNLIMITED:
        return None
    reclaimable = _stat(base / "memory.stat").get(inactive, 0)
    return limit, None if usage is None else max(0, usage - reclaimable)


def _room(found: tuple[int, int | None]) -> int:
    """Bytes a (limit, working set) leaves; the whole limit where the usage is unknown."""
    return found[0] - (found[1] or 0)


def _stat(path: Path) -> dict[str, int]:
    """A cgroup's ``memory.stat`` (``name value`` lines, bytes); empty where unreadable."""
    try:
        pairs = (line.split() for line in path.read_text().splitlines())
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
    except OSError:
        return {}


def _rlimit(name: str) -> int | None:
    """The soft limit ``resource.<name>`` in bytes; None when unlimited or not on this OS."""
    if resource is None or not hasattr(resource, name):
        return None
    soft, _ = resource.getrlimit(getattr(resource, name))
    return None if soft == resource.RLIM_INFINITY else soft


def data_limit() -> int | None:
    """The soft ``RLIMIT_DATA`` in bytes, or None when unlimited or absent (Windows)."""
    return _rlimit("RLIMIT_DATA")


def host_budget_unavailable() -> str | None:
    """Why a CPU budget (``RLIMIT_DATA`` set to ``VmData`` + budget) cannot be enforced
    here, in one line; None where it can (Linux with ``/proc``)."""
    name = system()
    if resource is None or not hasattr(resource, "RLIMIT_DATA"):
        why = f"CPU budgets are not available on {name}: it has no RLIMIT_DATA"
    elif name == "Darwin":
        why = "CPU budgets are not available on macOS: RLIMIT_DATA there limits only sbrk, not malloc"
    elif name != "Linux":
        why = f"CPU budgets are enforced only on Linux, not {name}"
    elif proc_status("VmData") is None:
        why = f"CPU budgets need {PROC / 'self' / 'status'} (VmData), which is not readable here"
    else:
        return None
    return f"{why}; searches use the probed available RAM (estimated, not enforced)"


def resident_bytes() -> tuple[int | None, str]:
    """This process's resident bytes now, and where the figure came from (None: unknown)."""
    name = system()
    if name == "Windows":
        return host_os.windows_working_set()[0], "K32GetProcessMemoryInfo WorkingSetSize"
    rss = proc_status("VmRSS")
    if rss is not None:
        return rss, f"{PROC}/self/status VmRSS"
    rss = host_os.psutil_rss()
    if rss is not None:
        return rss, "psutil memory_info().rss"
    return host_os.ps_rss(), "ps -o rss="


@dataclass(frozen=True)
class EnforcedLimit:
    """A limit the kernel enforces on this process's memory (Linux): ``name`` ("cgroup" or
    "RLIMIT_DATA"), ``limit_bytes``, and ``room_bytes`` it leaves now (measured). Past an
    ``RLIMIT_DATA`` an allocation fails; past a cgroup's limit the kernel kills (SIGKILL)."""

    name: str
    limit_bytes: int
    room_bytes: int


def enforced_limits() -> list[EnforcedLimit]:
    """The cgroup memory limit and the soft ``RLIMIT_DATA`` in force on this process, with
    the room each leaves now; empty off Linux (elsewhere ``RLIMIT_DATA`` bounds only
    ``sbrk`` or does not exist) and where none is set."""
    if system() != "Linux":
        return []
    cg_limit, cg_used = cgroup_limit()
    out = []
    for name, limit, used in (("cgroup", cg_limit, cg_used),
                              ("RLIMIT_DATA", data_limit(), proc_status("VmData"))):
        if limit is not None and used is not None:
            out.append(EnforcedLimit(name, limit, max(0, limit - used)))
    return out


def physical_memory() -> tuple[int | None, int | None, dict[str, str]]:
    """(total, available) RAM of the host in bytes, whatever limits this process has, and
    where each figure came from (an "estimate" on macOS); None where it cannot be read."""
    name = system()
    if name == "Windows":
        total, free = host_os.windows_memory()
        return total, free, {"total": "GlobalMemoryStatusEx ullTotalPhys",
                             "free": "GlobalMemoryStatusEx ullAvailPhys"}
    if name == "Darwin":
        total, free = host_os.darwin_memory()
        return total, free, {"total": "sysctl hw.memsize",
                             "free": "estimate: vm_stat free + speculative + inactive pages"}
    info = meminfo()
    return info.get("MemTotal"), info.get("MemAvailable"), {
        "total": "/proc/meminfo MemTotal", "free": "/proc/meminfo MemAvailable"}


def host_memory() -> dict:
    """Bytes of the host as this process sees them: ``total``, ``free`` (the smallest of the
    available RAM and each enforced limit's room), ``process``, ``limited_by``, ``sources``
    ("estimate" where one is), ``budget`` and ``peak`` (how peaks are measured here)."""
    total, free, sources = physical_memory()
    limited_by = {"Windows": "available physical RAM",
                  "Darwin": "available physical RAM (estimated)"}.get(system(), "MemAvailable")
    labels = {"cgroup": ("cgroup memory limit", "cgroup limit - working set"),
              "RLIMIT_DATA": ("RLIMIT_DATA", "RLIMIT_DATA - VmData")}
    for lim in enforced_limits():
        if total is None or lim.limit_bytes < total:
            total, sources["total"] = lim.limit_bytes, labels[lim.name][0]
        if free is None or lim.room_bytes < free:
            free, sources["free"], limited_by = lim.room_bytes, labels[lim.name][1], lim.name
    for key, value in (("total", total), ("free", free)):
        if value is None:
            sources[key] = f"unknown: {sources[key]} could not be read"
    process, sources["process"] = resident_bytes()
    method = peak_method()
    return {"name": platform.processor() or platform.machine() or "cpu", "total": total,
            "free": free, "process": process,
            "limited_by": limited_by if free is not None else "unknown", "sources": sources,
            "budget": host_budget_unavailable(),
            "peak": method.source or f"unknown: {method.reason}"}


@dataclass(frozen=True)
class PeakMethod:
    """How CPU peaks are measured on this host: ``source`` (None where nothing can be read,
    with ``reason``) and ``resettable`` (Linux ``clear_refs``). Where it is not, a read is
    the process's lifetime peak: an upper bound for work below an earlier peak."""

    source: str | None
    resettable: bool
    reason: str | None = None


def peak_method() -> PeakMethod:
    """How :func:`read_peak` measures the resident high-water mark here."""
    name = system()
    if name == "Windows":
        if host_os.windows_working_set()[1] is None:
            return PeakMethod(None, False, "K32GetProcessMemoryInfo is not available")
        return PeakMethod("K32GetProcessMemoryInfo PeakWorkingSetSize (process lifetime)", False)
    if proc_status("VmHWM") is not None:
        return PeakMethod("VmHWM after clear_refs (resident)", True)
    if resource is None:
        return PeakMethod(None, False, "no /proc/self/status and no getrusage on this OS")
    unit = "bytes" if name == "Darwin" else "KiB"
    return PeakMethod(f"getrusage ru_maxrss ({unit}; process lifetime)", False)


def reset_peak() -> int | None:
    """Start a peak measurement (Linux: ``5`` to ``/proc/self/clear_refs``; where that is not
    allowed, later reads are upper bounds); return the resident bytes now (None: unknown)."""
    if system() != "Windows":
        try:
            with open(PROC / "self" / "clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    return resident_bytes()[0]


def read_peak() -> int | None:
    """The resident high-water mark in bytes (since :func:`reset_peak` where :func:`peak_method`
    says it is resettable); None where it cannot be measured, never 0 in its place."""
    name = system()
    if name == "Windows":
        return host_os.windows_working_set()[1]
    hwm = proc_status("VmHWM")
    if hwm is not None or resource is None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is bytes on Darwin and KiB on Linux and the BSDs.
    return int(maxrss) * (1 if name == "Darwin" else 1024)


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def memory_limits() -> dict[str, int]:
    """The memory limits in force on this process, by name, in bytes: ``RLIMIT_DATA``,
    ``RLIMIT_AS`` (soft) and ``cgroup memory limit``; empty when there is none.
    Linux only: elsewhere these rlimits do not bound malloc."""
    if system() != "Linux":
        return {}
    out = {name: v for name in ("RLIMIT_DATA", "RLIMIT_AS") if (v := _rlimit(name)) is not None}
    limit, _ = cgroup_limit()
    if limit is not None:
        out["cgroup memory limit"] = limit
    return out
