"""The host (CPU RAM) backend: what this process may still allocate, in bytes.

Three limits can stop a CPU allocation: the memory the kernel says is
available (``MemAvailable``), the cgroup's ``memory.max`` (v2) or
``memory.limit_in_bytes`` (v1), and the process's ``RLIMIT_DATA``. The smallest
wins, and the snapshot says which one it was.

Peak tracking uses the kernel's high-water mark of resident memory: writing
``5`` to ``/proc/self/clear_refs`` resets ``VmHWM``, which is then read back
from ``/proc/self/status``. That is *measured* resident memory, not an estimate.
"""

from __future__ import annotations

import os
import platform
import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_UNLIMITED = resource.RLIM_INFINITY
# A cgroup limit this large means "no limit" (v1 reports ~2**63).
_CGROUP_UNLIMITED = 1 << 60


def _kib_field(text: str, key: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def proc_status(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmData``, ``VmRSS``, ``VmHWM``) in bytes."""
    try:
        return _kib_field(_STATUS.read_text(), key)
    except OSError:
        return None


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is no procfs)."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
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
    """(limit, current usage) of this process's memory cgroup in bytes, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # cgroup v2 unified hierarchy
            base = Path("/sys/fs/cgroup") / rel.lstrip("/")
            limit, usage = _read_int(base / "memory.max"), _read_int(base / "memory.current")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            limit = _read_int(base / "memory.limit_in_bytes")
            usage = _read_int(base / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < _CGROUP_UNLIMITED:
            return limit, usage
    return None, None


def data_limit() -> int | None:
    """The soft ``RLIMIT_DATA`` in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    return None if soft == _UNLIMITED else soft


def host_memory() -> dict:
    """Total, free and used bytes of the host as this process sees them.

    Returns a dict with ``total``, ``free``, ``process`` (this process's
    resident bytes), ``limited_by`` (which limit set ``free``) and ``sources``.
    """
    info = meminfo()
    total = info.get("MemTotal")
    free = info.get("MemAvailable")
    sources = {"total": "/proc/meminfo MemTotal", "free": "/proc/meminfo MemAvailable"}
    limited_by = "MemAvailable"
    cg_limit, cg_usage = cgroup_limit()
    if cg_limit is not None:
        cg_free = max(0, cg_limit - (cg_usage or 0))
        if total is None or cg_limit < total:
            total, sources["total"] = cg_limit, "cgroup memory limit"
        if free is None or cg_free < free:
            free, sources["free"], limited_by = cg_free, "cgroup limit - usage", "cgroup"
    rl = data_limit()
    if rl is not None:
        vm_data = proc_status("VmData") or 0
        rl_free = max(0, rl - vm_data)
        if total is None or rl < total:
            total, sources["total"] = rl, "RLIMIT_DATA"
        if free is None or rl_free < free:
            free, sources["free"], limited_by = rl_free, "RLIMIT_DATA - VmData", "RLIMIT_DATA"
    return {
        "name": platform.processor() or platform.machine() or "cpu",
        "total": total,
        "free": free,
        "process": proc_status("VmRSS"),
        "limited_by": limited_by,
        "sources": sources | {"process": "/proc/self/status VmRSS"},
    }


def reset_peak() -> int:
    """Reset the resident high-water mark; return the resident bytes now (the baseline).

    Writes ``5`` to ``/proc/self/clear_refs``. Where that is not allowed, the
    peak keeps its old value and later reads are upper bounds.
    """
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        pass
    return proc_status("VmRSS") or 0


def read_peak() -> int:
    """The resident high-water mark (``VmHWM``) in bytes since the last reset."""
    return proc_status("VmHWM") or 0


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def memory_limits() -> dict[str, int]:
    """The memory limits in force on this process, by name, in bytes: ``RLIMIT_DATA``,
    ``RLIMIT_AS`` (soft) and ``cgroup memory limit``; empty when there is none."""
    out: dict[str, int] = {}
    for name in ("RLIMIT_DATA", "RLIMIT_AS"):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != _UNLIMITED:
            out[name] = soft
    limit, _ = cgroup_limit()
    if limit is not None:
        out["cgroup memory limit"] = limit
    return out
