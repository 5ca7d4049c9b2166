"""Memory budgets: real out-of-memory errors below the hardware limit.

A budget caps what the code inside it may allocate, so that the OOM a user
would meet on a smaller device happens here, for real, with the allocator's own
error:

- CPU: ``RLIMIT_DATA`` set to the process's current ``VmData`` plus the budget.
  glibc is first told to serve allocations of 128 KiB and more with ``mmap``
  (``mallopt(M_MMAP_THRESHOLD)``) so freed tensors really go back to the kernel;
  without it the heap keeps fragments and the same size fits on one try and not
  the next (docs/measurements.md#return-freed-memory).
- CUDA: ``torch.cuda.set_per_process_memory_fraction((reserved + budget) / total)``.

On both, the budget counts bytes *above what the process holds when it is
entered* (virtual data size on CPU, allocator-reserved bytes on CUDA). The
previous limit is restored on exit, also after an error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from oomguard.engine.core.units import fmt_bytes
from oomguard.engine.errors import BudgetError
from oomguard.probes import host

log = logging.getLogger("oomguard.budget")

# Below this, libgomp cannot even create its threads (docs/measurements.md#minimum-cpu-budget).
MIN_CPU_BUDGET = 24 * 1024**2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024


@dataclass(frozen=True)
class Budget:
    """An active budget: ``nbytes`` for ``device``, enforced by ``mechanism``."""

    nbytes: int
    device: str
    mechanism: str
    limit: int  # the absolute limit set: RLIMIT_DATA bytes, or the CUDA cap in bytes


_active: list[Budget] = []


def active_budget() -> Budget | None:
    """The innermost budget in force in this process, or None."""
    return _active[-1] if _active else None


def tighten_active_budget() -> None:
    """Keep an active CPU budget at ``nbytes`` above the *smallest* usage seen.

    Memory counted in the baseline can be released after the budget starts
    (thread stacks of finished pools, trimmed malloc arenas), which would
    silently enlarge the budget (docs/measurements.md#free-heap-at-budget-entry).
    Called before each trial, this lowers the limit to ``VmData now + nbytes``
    when that is smaller. It never raises the limit, so memory that trials leave behind
    keeps counting, as it would on a device.
    """
    b = active_budget()
    if b is None or b.device != "cpu":
        return
    vm_data = host.proc_status("VmData")
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if vm_data is not None and soft != resource.RLIM_INFINITY and vm_data + b.nbytes < soft:
        resource.setrlimit(resource.RLIMIT_DATA, (vm_data + b.nbytes, hard))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def free_heap_bytes() -> int | None:
    """Bytes in free chunks inside glibc's heaps (all arenas; ``mallinfo2().fordblks``).

    They are counted in ``VmData`` yet can serve new allocations without growing
    it, so a CPU budget entered while they exist allows up to this much more
    than asked (docs/measurements.md#free-heap-at-budget-entry). None where
    glibc >= 2.33 is not available.
    """
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return int(fn().fordblks)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def return_freed_memory_to_os() -> bool:
    """Make glibc serve allocations >= 128 KiB with mmap so frees go back to the OS
    (docs/measurements.md#return-freed-memory).

    Returns False where there is no glibc (the budget still works, less
    deterministically).
    """
    libc = _libc()
    try:
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) if libc else False
    except AttributeError:
        return False


def trim_heap() -> bool:
    """Give the free memory at the top of glibc's heaps back to the OS (``malloc_trim(0)``).

    Returns False where there is no glibc.
    """
    libc = _libc()
    try:
        return bool(libc.malloc_trim(0)) if libc else False
    except AttributeError:
        return False


def _device_str(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BudgetError(f"unknown device {device!r}: use cpu, cuda, cuda:N or mps") from exc
    if dev.type not in ("cpu", "cuda"):
        raise BudgetError(f"budgets are supported on cpu and cuda, not {dev.type!r}")
    return dev


def check_budget(nbytes: int, device: str | torch.device = "cpu") -> torch.device:
    """Raise :class:`BudgetError` unless ``nbytes`` can be a budget on ``device``; return
    the device. The checks :func:`budget` makes on entry, for callers that apply the
    budget later or elsewhere (an isolated trial's child process)."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise BudgetError(f"a budget must be a positive number of bytes, got {nbytes!r}")
    dev = _device_str(device)
    if dev.type == "cpu":
        if nbytes < MIN_CPU_BUDGET:
            raise BudgetError(
                f"a CPU budget of {fmt_bytes(nbytes)} is too small: thread pools need "
                f"~20 MiB of headroom; use at least {fmt_bytes(MIN_CPU_BUDGET)}"
            )
        avail = host.meminfo().get("MemAvailable")
        if avail is not None and nbytes > avail:
            raise BudgetError(
                f"budget {fmt_bytes(nbytes)} is more than the {fmt_bytes(avail)} this host has "
                "available; choose a smaller --budget"
            )
        return dev
    if not torch.cuda.is_available():
        raise BudgetError("no CUDA device is available here: use --device cpu")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if nbytes > total:
        raise BudgetError(
            f"budget {fmt_bytes(nbytes)} is more than cuda:{index}'s {fmt_bytes(total)}; "
            "choose a smaller --budget"
        )
    return dev


@contextmanager
def budget(nbytes: int, device: str | torch.device = "cpu") -> Iterator[Budget]:
    """Cap the memory the code inside may allocate to ``nbytes`` bytes.

    On CPU the budget is on top of the process's current virtual data size
    (``VmData``); enter it after one small warm-up step so that thread pools
    and kernels that the step creates once are not charged to it. On CUDA it is
    a fraction of the device's total memory set to (reserved now + ``nbytes``)
    / total, so it too counts bytes above what the process holds. Raises :class:`BudgetError` if
    ``nbytes`` is not positive, below :data:`MIN_CPU_BUDGET` on CPU, or larger
    than the device can give. Nested budgets may only shrink the limit.
    """
    dev = check_budget(nbytes, device)
    if dev.type == "cpu":
        with _cpu_budget(nbytes) as b:
            yield b
    else:
        with _cuda_budget(nbytes, dev) as b:
            yield b


def _start_thread_pool() -> None:
    """Run one op large enough that torch parallelises it, creating its threads now."""
    torch.ones(1 << 20).sum()


@contextmanager
def _cpu_budget(nbytes: int) -> Iterator[Budget]:
    return_freed_memory_to_os()
    # Measure the baseline after what is already garbage is gone and after the
    # OpenMP pool exists: otherwise freed garbage becomes extra room and the
    # first parallel op inside charges ~8 MiB of thread stacks to the budget
    # (docs/measurements.md#minimum-cpu-budget).
    gc.collect()
    _start_thread_pool()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    vm_data = host.proc_status("VmData")
    if vm_data is None:
        raise BudgetError("CPU budgets need Linux /proc/self/status (VmData)")
    limit = vm_data + nbytes
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft)
    if hard != resource.RLIM_INFINITY and limit > hard:
        raise BudgetError(f"budget exceeds the hard RLIMIT_DATA of {fmt_bytes(hard)}")
    slack = free_heap_bytes()
    if slack is not None and slack > max(nbytes // 20, 4 * 1024**2):
        log.warning("%s of free heap chunks at budget entry can be reused without counting "
                    "against the %s budget; for an exact budget run isolated (--isolate) or "
                    "start the process with MALLOC_MMAP_THRESHOLD_=131072",
                    fmt_bytes(slack), fmt_bytes(nbytes))
    b = Budget(nbytes=nbytes, device="cpu", mechanism="RLIMIT_DATA", limit=limit)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    _active.append(b)
    try:
        yield b
    finally:
        _active.remove(b)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@contextmanager
def _cuda_budget(nbytes: int, dev: torch.device) -> Iterator[Budget]:
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    # Like the CPU budget, count bytes above what this process already holds.
    reserved = torch.cuda.memory_reserved(index)
    if reserved + nbytes > total:
        raise BudgetError(
            f"budget {fmt_bytes(nbytes)} plus the {fmt_bytes(reserved)} already reserved is more "
            f"than cuda:{index}'s {fmt_bytes(total)}; choose a smaller --budget"
        )
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = getter(index) if getter is not None else 1.0
    fraction = min((reserved + nbytes) / total, previous)
    b = Budget(nbytes=nbytes, device=f"cuda:{index}", mechanism="set_per_process_memory_fraction",
               limit=int(fraction * total))
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    _active.append(b)
    try:
        yield b
    finally:
        _active.remove(b)
        torch.cuda.set_per_process_memory_fraction(previous, index)
