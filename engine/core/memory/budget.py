"""Memory budgets: real out-of-memory errors below the hardware limit.

A budget caps what the code inside it may allocate (bytes), so the OOM a smaller device
would give happens here, with the allocator's own error:

- CPU: ``RLIMIT_DATA`` at the current ``VmData`` plus the budget, large allocations served
  by ``mmap`` so frees go back to the kernel (docs/measurements.md#return-freed-memory).
- CUDA: ``set_per_process_memory_fraction((held + budget) / total)`` (:func:`gpu_held_bytes`).
- MPS: ``torch.mps.set_per_process_memory_fraction((driver allocated + budget) /
  recommended_max_memory)``.

Each budget counts bytes *above what the process holds when it is entered*
(:func:`tighten_active_budget`); the previous limit is restored on exit. Host budgets need
``RLIMIT_DATA`` (Linux); elsewhere :class:`BudgetError`.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from oomguard.engine.core.memory.heap import (
    free_heap_bytes,
    freed_memory_returned,
    heap_plugged,
)
from oomguard.engine.errors import BudgetError, UsageError
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import cuda, host
from oomguard.probes.device import resolve_device
from oomguard.probes.peak import held_bytes as gpu_held_bytes

try:
    import resource
except ImportError:  # Windows: no RLIMIT_DATA, so no host budgets (check_budget says so)
    resource = None  # type: ignore[assignment]

log = logging.getLogger("oomguard.budget")

# Below this, libgomp cannot even create its threads (docs/measurements.md#minimum-cpu-budget).
MIN_CPU_BUDGET = 24 * 1024**2
# A cgroup also charges what VmData does not (page tables, file pages, copied fork-shared
# pages): a budget stays this far under the room it leaves, and under an unfrozen gc also
# the shared bytes it would copy (docs/measurements.md#cgroup-limits).
CGROUP_SLACK_FRACTION = 0.02
CGROUP_SLACK_MIN = 16 * 1024**2


@dataclass(frozen=True)
class Budget:
    """An active budget: ``nbytes`` for ``device``, enforced by ``mechanism``."""

    nbytes: int
    device: str
    mechanism: str
    limit: int  # the absolute limit set at entry: RLIMIT_DATA bytes, or the GPU cap in bytes


_active: list[Budget] = []
# The fraction last set per GPU ("cuda:N", "mps"), which torch cannot always read back.
_fractions: dict[str, float] = {}
# MPSAllocator.mm's default high-watermark ratio and the largest fraction torch.mps accepts.
MPS_DEFAULT_FRACTION = 1.7
MPS_MAX_FRACTION = 2.0


def active_budget() -> Budget | None:
    """The innermost budget in force in this process, or None."""
    return _active[-1] if _active else None


def host_budgets_available() -> bool:
    """Whether this OS can cap the host memory of a process (``RLIMIT_DATA`` over ``VmData``:
    Linux with /proc; on macOS RLIMIT_DATA limits only sbrk, not malloc)."""
    return resource is not None and host.host_budget_unavailable() is None


def tighten_active_budget() -> None:
    """Keep an active budget at ``nbytes`` above the *smallest* usage seen (``VmData`` on
    CPU, :func:`gpu_held_bytes` on a GPU), before each trial: baseline memory released after
    entry would enlarge it (docs/measurements.md#free-heap-at-budget-entry). Never raised."""
    b = active_budget()
    if b is not None and b.device != "cpu":
        dev = torch.device(b.device)
        fraction = (gpu_held_bytes(dev) + b.nbytes) / _gpu_size(dev)
        if fraction < current_fraction(dev):
            set_memory_fraction(fraction, dev)
    elif b is not None and (room := headroom_bytes("cpu")) is not None and room > b.nbytes:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)  # soft - room: VmData now
        resource.setrlimit(resource.RLIMIT_DATA, (soft - room + b.nbytes, hard))


def headroom_bytes(device: str | torch.device) -> int | None:
    """Bytes the limit in force on ``device`` leaves this process now (measured): a CPU
    budget's ``RLIMIT_DATA`` minus ``VmData``; a GPU budget's cap minus the bytes held (cache
    emptied); else CUDA's free memory once this process has a context. None: no limit known."""
    dev = torch.device(device)
    b = active_budget()
    if b is not None and b.device == ("cpu" if dev.type == "cpu" else _key(dev)):
        if dev.type == "cpu":
            limit, vm_data = host.data_limit(), host.proc_status("VmData")
            return None if limit is None or vm_data is None else limit - vm_data
        return b.limit - gpu_held_bytes(dev)
    # has_context: cudaMemGetInfo would create a context (~0.5 GiB).
    if dev.type == "cuda" and torch.cuda.is_available() and cuda.has_context(_cuda_index(dev)):
        return int(torch.cuda.mem_get_info(dev)[0])
    return None


def cgroup_slack(room: int) -> int:
    """Bytes a CPU budget keeps under the ``room`` (bytes) a cgroup leaves, for what the cgroup
    charges and ``VmData`` does not (:data:`CGROUP_SLACK_FRACTION`, at least
    :data:`CGROUP_SLACK_MIN`, plus the fork-shared pages an unfrozen gc would copy)."""
    scanned = 0 if gc.get_freeze_count() else host.shared_anonymous_bytes() or 0
    return max(CGROUP_SLACK_MIN, int(room * CGROUP_SLACK_FRACTION)) + scanned


def cgroup_budget_room() -> tuple[int, int] | None:
    """(bytes, limit): the largest CPU budget the tightest memory cgroup of this process (its
    own group or an ancestor's) lets it enter now without the kernel's kill (the room it leaves
    less :func:`cgroup_slack`, possibly negative), and that cgroup's limit in bytes; None where
    no cgroup limits this process."""
    lim = next((lim for lim in host.enforced_limits() if lim.name == "cgroup"), None)
    if lim is None:
        return None
    return lim.room_bytes - cgroup_slack(lim.room_bytes), lim.limit_bytes


def check_budget(nbytes: int, device: str | torch.device = "cpu") -> torch.device:
    """Raise :class:`BudgetError` unless ``nbytes`` can be a budget on ``device`` now; return
    the device. The checks :func:`budget` makes on entry, and on the CPU also that a memory
    cgroup leaves room for it (:func:`cgroup_budget_room`: past it the kernel would kill, not
    fail an allocation), for callers that check before any work and apply the budget later or
    elsewhere (an isolated trial's child process)."""
    dev = _check(nbytes, device)
    room = cgroup_budget_room() if dev.type == "cpu" else None
    if room is not None and nbytes > room[0]:
        raise BudgetError(f"budget {fmt_bytes(nbytes)} is more than the "
                          f"{fmt_bytes(max(0, room[0]))} the cgroup memory limit of "
                          f"{fmt_bytes(room[1])} leaves this process (past it the kernel kills "
                          "it): choose a smaller --budget, or --budget none (budget=None) to run "
                          "to the limit")
    return dev


def _check(nbytes: int, device: str | torch.device) -> torch.device:
    """:func:`check_budget`'s checks of the number and the device, made again on entry."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise BudgetError(f"a budget must be a positive number of bytes, got {nbytes!r}; "
                          "give one such as 2 << 30")
    try:
        dev = resolve_device(device)
    except UsageError as exc:  # a budget's bad input is a BudgetError, whatever it is
        raise BudgetError(str(exc)) from None
    if dev.type == "cpu":
        if not host_budgets_available():
            why = host.host_budget_unavailable() or ("host memory budgets are unavailable on "
                                                     "this OS (no RLIMIT_DATA)")
            raise BudgetError(f"{why}: run without --budget, or on Linux")
        if nbytes < MIN_CPU_BUDGET:
            raise BudgetError(f"a CPU budget of {fmt_bytes(nbytes)} is too small: thread pools "
                              f"need ~20 MiB of headroom; use at least {fmt_bytes(MIN_CPU_BUDGET)}")
        avail = host.meminfo().get("MemAvailable")
        if avail is not None and nbytes > avail:
            raise BudgetError(f"budget {fmt_bytes(nbytes)} is more than the {fmt_bytes(avail)} "
                              "this host has available; choose a smaller --budget")
        return dev
    if dev.type == "mps":
        return _check_mps(nbytes, dev)
    if not torch.cuda.is_available():
        raise BudgetError("no CUDA device is available here: use --device cpu")
    total = _gpu_size(dev)
    if nbytes > total:
        raise BudgetError(f"budget {fmt_bytes(nbytes)} is more than {_key(dev)}'s "
                          f"{fmt_bytes(total)}; choose a smaller --budget")
    return dev


@contextmanager
def budget(nbytes: int, device: str | torch.device = "cpu") -> Iterator[Budget]:
    """Cap the memory the code inside may allocate to ``nbytes`` bytes above what the
    process holds now (a CUDA memory fraction; on a Linux CPU ``RLIMIT_DATA`` above
    ``VmData``). On CPU, enter it after one warm-up step so one-off thread pools are not
    charged. Raises :class:`BudgetError` as :func:`check_budget`. Nested budgets only shrink."""
    dev = _check(nbytes, device)
    manager = _cpu_budget(nbytes) if dev.type == "cpu" else _gpu_budget(nbytes, dev)
    with manager as b:  # the limit is set: the budget is in force until it is restored
        _active.append(b)
        try:
            yield b
        finally:
            _active.remove(b)


@contextmanager
def _cpu_budget(nbytes: int) -> Iterator[Budget]:
    # Inside, and for the warm-up op below, large frees leave the heap
    # (docs/measurements.md#return-freed-memory).
    with freed_memory_returned():
        yield from _cpu_limit(nbytes)


def _cpu_limit(nbytes: int) -> Iterator[Budget]:
    """:func:`_cpu_budget`'s ``RLIMIT_DATA``, set for the length of the generator."""
    # Baseline after garbage is gone and the OpenMP pool exists, else its ~8 MiB of thread
    # stacks are charged to the budget (docs/measurements.md#minimum-cpu-budget).
    gc.collect()
    torch.ones(1 << 20).sum()  # an op large enough that torch parallelises it: its threads
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    # Free chunks already in the heap count in VmData, yet would serve the code inside
    # without growing it: a warm-up's leftovers (30 MiB measured) made a step of 52 fit
    # where 40 does from an empty heap. Filled first, every byte the code allocates counts.
    with heap_plugged():
        vm_data = host.proc_status("VmData")
        if vm_data is None:
            raise BudgetError("CPU budgets need Linux /proc/self/status (VmData); run "
                              "without a budget here")
        limit = vm_data + nbytes
        if soft != resource.RLIM_INFINITY:  # finite: also within the hard limit (soft <= hard)
            limit = min(limit, soft)
        limit = _under_cgroup(limit, vm_data, nbytes)
        _warn_unplugged(nbytes)
        b = Budget(nbytes=nbytes, device="cpu", mechanism="RLIMIT_DATA", limit=limit)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        try:
            yield b
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _under_cgroup(limit: int, vm_data: int, nbytes: int) -> int:
    """``limit`` (an ``RLIMIT_DATA`` in bytes, ``VmData`` now ``vm_data``) lowered to the room a
    memory cgroup leaves (:func:`cgroup_budget_room`), with a warning: a budget that fitted when
    it was checked, before a warm-up or in another process, must not reach the kernel's kill.
    :class:`BudgetError` where that room is below :data:`MIN_CPU_BUDGET`."""
    room = cgroup_budget_room()
    if room is None or vm_data + room[0] >= limit:
        return limit
    if room[0] < MIN_CPU_BUDGET:
        raise BudgetError(f"the cgroup memory limit of {fmt_bytes(room[1])} leaves "
                          f"{fmt_bytes(max(0, room[0]))} for a budget here, and a budget needs "
                          f"{fmt_bytes(MIN_CPU_BUDGET)}: give the container or job more memory")
    if limit - (vm_data + room[0]) > CGROUP_SLACK_MIN:  # not a budget set at the room just now
        log.warning("the %s budget is lowered to %s: the cgroup memory limit of %s leaves no "
                    "more room to this process now", fmt_bytes(nbytes), fmt_bytes(room[0]),
                    fmt_bytes(room[1]))
    return vm_data + room[0]


def _warn_unplugged(nbytes: int) -> None:
    """Say so when other threads' arenas hold free chunks the budget cannot fill (bytes)."""
    slack = free_heap_bytes()
    if slack is not None and slack > max(nbytes // 20, 4 * 1024**2):
        log.warning("%s of free heap chunks in other threads' memory arenas can be reused "
                    "without counting against the %s budget; for an exact budget start the "
                    "process with MALLOC_ARENA_MAX=1 (docs/measurements.md#free-heap-at-budget-entry)",
                    fmt_bytes(slack), fmt_bytes(nbytes))


def _cuda_index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _gpu_size(dev: torch.device) -> int:
    """What a fraction multiplies: the CUDA device's total, or MPS's recommended
    working-set size (torch 2.13 torch/mps/__init__.py)."""
    if dev.type == "mps":
        return int(torch.mps.recommended_max_memory())
    return int(torch.cuda.get_device_properties(_cuda_index(dev)).total_memory)


def _key(dev: torch.device) -> str:
    return "mps" if dev.type == "mps" else f"cuda:{_cuda_index(dev)}"


def current_fraction(dev: torch.device) -> float:
    """The fraction in force on ``dev``: torch's answer where it has one (CUDA, torch >= 2.6),
    else the last one set through oomguard, else the default (CUDA 1.0; MPS
    ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` or 1.7, where 0.0 means unlimited)."""
    if dev.type == "cuda":
        read = cuda.memory_fraction(_cuda_index(dev))  # 1.0 for cudaMallocAsync's "no limit"
        return read if read is not None else _fractions.get(_key(dev), 1.0)
    if "mps" in _fractions:
        return _fractions["mps"]
    try:
        return float(os.environ.get("PYTORCH_MPS_HIGH_WATERMARK_RATIO", MPS_DEFAULT_FRACTION))
    except ValueError:
        return MPS_DEFAULT_FRACTION


def set_memory_fraction(fraction: float, device: str | torch.device = "cuda") -> None:
    """Set the per-process fraction of a GPU and remember it, so that a budget restores it
    on exit even where torch cannot read it back (CUDA on torch < 2.6, MPS): a fraction
    set directly with torch there comes back as the default after a budget."""
    dev = resolve_device(device)
    if dev.type == "mps":
        torch.mps.set_per_process_memory_fraction(float(fraction))
    elif dev.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(float(fraction), _cuda_index(dev))
    else:
        raise BudgetError(f"a memory fraction applies to cuda and mps, not {dev.type!r}; "
                          "give a budget in bytes instead")
    _fractions[_key(dev)] = float(fraction)


def _check_mps(nbytes: int, dev: torch.device) -> torch.device:
    if not torch.backends.mps.is_available():
        raise BudgetError("no MPS device is available here: use --device cpu")
    if getattr(torch.mps, "recommended_max_memory", None) is None:
        raise BudgetError(f"MPS budgets need torch.mps.recommended_max_memory (torch >= 2.5), "
                          f"not torch {torch.__version__}: run without --budget")
    most = int(MPS_MAX_FRACTION * _gpu_size(dev))
    if nbytes > most:
        raise BudgetError(f"budget {fmt_bytes(nbytes)} is more than MPS allows ({fmt_bytes(most)}, "
                          "twice the recommended working set); choose a smaller --budget")
    return dev


@contextmanager
def _gpu_budget(nbytes: int, dev: torch.device) -> Iterator[Budget]:
    size = _gpu_size(dev)
    held = gpu_held_bytes(dev)
    name = "MPS's recommended working set" if dev.type == "mps" else f"{_key(dev)}'s total"
    most = MPS_MAX_FRACTION * size if dev.type == "mps" else size
    if held + nbytes > most:
        raise BudgetError(f"budget {fmt_bytes(nbytes)} plus the {fmt_bytes(held)} this process "
                          f"already holds is more than {name} of {fmt_bytes(size)} allows; "
                          "choose a smaller --budget")
    previous = current_fraction(dev)
    remembered = _fractions.get(_key(dev))
    fraction = (held + nbytes) / size
    if previous > 0:  # MPS: 0.0 is "unlimited", never a tighter cap
        fraction = min(fraction, previous)
    b = Budget(nbytes=nbytes, device=_key(dev), limit=int(fraction * size),
               mechanism=f"torch.{dev.type}.set_per_process_memory_fraction")
    set_memory_fraction(fraction, dev)
    try:
        yield b
    finally:
        set_memory_fraction(previous, dev)
        if remembered is None:
            _fractions.pop(_key(dev), None)
