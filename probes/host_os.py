"""macOS and Windows memory readers for the host backend (:mod:`oomguard.probes.host`).

On macOS the ``sysctl``, ``vm_stat`` and ``ps`` tools (and psutil, a dependency there, for
the resident size); on Windows ``GlobalMemoryStatusEx`` and ``K32GetProcessMemoryInfo``
through ctypes. Every reader returns None where its source is absent or fails, never 0.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

_TOOL_TIMEOUT_S = 5


# --- macOS -----------------------------------------------------------------


def _tool(*args: str) -> str | None:
    """Stdout of a system tool (sysctl, vm_stat, ps), or None where it fails or is absent."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def parse_vm_stat(text: str) -> int | None:
    """Bytes macOS can give without swapping, estimated from ``vm_stat`` output: (free +
    speculative + inactive pages) x the page size its header states, the pages psutil's
    macOS ``available`` counts ("Pages free" excludes speculative pages, the read-ahead file
    cache reclaimed first). None when the text is not vm_stat's."""
    lines = text.splitlines()
    if not lines or "page size of" not in lines[0]:
        return None
    try:
        page = int(lines[0].split("page size of")[1].split()[0])
    except (IndexError, ValueError):
        return None
    pages: dict[str, int] = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        value = value.strip().rstrip(".")
        if value.isdigit():
            pages[key.strip()] = int(value)
    if "Pages free" not in pages:
        return None
    return page * sum(pages.get(k, 0) for k in ("Pages free", "Pages speculative",
                                                "Pages inactive"))


def darwin_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes on macOS: ``sysctl hw.memsize`` (measured) and
    :func:`parse_vm_stat` (estimated)."""
    out = _tool("sysctl", "-n", "hw.memsize")
    total = int(out.strip()) if out and out.strip().isdigit() else None
    out = _tool("vm_stat")
    return total, parse_vm_stat(out) if out else None


def psutil_rss() -> int | None:
    """This process's resident bytes from psutil (``task_info`` on macOS), None where
    psutil is not installed: it answers in microseconds where ``ps`` spawns a process."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        return int(psutil.Process().memory_info().rss)
    except (OSError, psutil.Error):
        return None


def ps_rss() -> int | None:
    """This process's resident bytes from ``ps -o rss=`` (KiB on macOS and BSD)."""
    out = _tool("ps", "-o", "rss=", "-p", str(os.getpid()))
    text = out.strip() if out else ""
    return int(text) * 1024 if text.isdigit() else None


# --- Windows ---------------------------------------------------------------


class _MemoryStatusEx(ctypes.Structure):
    # MEMORYSTATUSEX (sysinfoapi.h): DWORDs are 32-bit, DWORDLONGs 64-bit.
    _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32)] + [
        (name, ctypes.c_uint64) for name in (
            "ullTotalPhys", "ullAvailPhys", "ullTotalPageFile", "ullAvailPageFile",
            "ullTotalVirtual", "ullAvailVirtual", "ullAvailExtendedVirtual")]


class _ProcessMemoryCounters(ctypes.Structure):
    # PROCESS_MEMORY_COUNTERS (psapi.h).
    _fields_ = [("cb", ctypes.c_uint32), ("PageFaultCount", ctypes.c_uint32)] + [
        (name, ctypes.c_size_t) for name in (
            "PeakWorkingSetSize", "WorkingSetSize", "QuotaPeakPagedPoolUsage",
            "QuotaPagedPoolUsage", "QuotaPeakNonPagedPoolUsage", "QuotaNonPagedPoolUsage",
            "PagefileUsage", "PeakPagefileUsage")]


def _kernel32() -> object | None:
    try:
        return ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    except (AttributeError, OSError):  # not Windows
        return None


def windows_memory() -> tuple[int | None, int | None]:
    """(total, available) physical RAM in bytes from ``GlobalMemoryStatusEx``."""
    k32 = _kernel32()
    if k32 is None:
        return None, None
    status = _MemoryStatusEx()
    status.dwLength = ctypes.sizeof(_MemoryStatusEx)
    fn = k32.GlobalMemoryStatusEx
    fn.argtypes = [ctypes.POINTER(_MemoryStatusEx)]
    if not fn(ctypes.byref(status)):
        return None, None
    return int(status.ullTotalPhys), int(status.ullAvailPhys)


def windows_working_set() -> tuple[int | None, int | None]:
    """(working set, peak working set) of this process in bytes, or (None, None)."""
    k32 = _kernel32()
    if k32 is None:
        return None, None
    counters = _ProcessMemoryCounters()
    counters.cb = ctypes.sizeof(_ProcessMemoryCounters)
    k32.GetCurrentProcess.restype = ctypes.c_void_p
    fn = k32.K32GetProcessMemoryInfo
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_ProcessMemoryCounters), ctypes.c_uint32]
    if not fn(k32.GetCurrentProcess(), ctypes.byref(counters), counters.cb):
        return None, None
    return int(counters.WorkingSetSize), int(counters.PeakWorkingSetSize)
