"""The one place that chooses the limit a trial runs under, entered through :func:`limit_budget`:
a budget given, an enforced host limit (:class:`~oomguard.engine.core.memory.host_limit.HostLimit`:
a cgroup or an outer ``RLIMIT_DATA``; the work then runs under a budget at its room), or the RAM
guard (:class:`~oomguard.engine.core.search.ramguard.RamGuard`, estimated); the tightest wins.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from oomguard.engine.core.memory.budget import Budget, budget
from oomguard.engine.core.memory.host_limit import HostLimit
from oomguard.engine.core.search.ramguard import RamGuard
from oomguard.probes import host


def unbudgeted_limit(device: str | torch.device = "cpu", guard: RamGuard | None = None
                     ) -> HostLimit | RamGuard | None:
    """What bounds work on ``device`` without a budget, chosen now: on the CPU the enforced
    limit with the least room where that is below ``guard``'s limit (default
    :meth:`RamGuard.for_host`), else the guard; None on other devices or where nothing is known."""
    if torch.device(device).type != "cpu":
        return None
    guard = guard if guard is not None else RamGuard.for_host()
    limits = sorted(host.enforced_limits(), key=lambda lim: lim.room_bytes)
    if limits and (guard is None or limits[0].room_bytes < guard.limit_bytes):
        return HostLimit(limits[0].name, limits[0].limit_bytes, limits[0].room_bytes)
    return guard


def limit_budget(nbytes: int | None, device: str | torch.device,
                 limit: HostLimit | RamGuard | None) -> AbstractContextManager[Budget | None]:
    """The budget to enter after the warm-up: ``nbytes`` when given, else the one an enforced
    ``limit`` leaves room for (:meth:`HostLimit.enforced`), else none."""
    if nbytes is not None:
        return budget(nbytes, device)
    return limit.enforced() if isinstance(limit, HostLimit) else nullcontext()


def trial_limit(device: torch.device, budget_bytes: int | None,
                ram_guard: RamGuard | bool | None) -> RamGuard | HostLimit | None:
    """What bounds a search's trials beside a budget, from its ``budget`` and ``ram_guard``: on
    CPU the ``RamGuard`` given, a RAM guard beside a budget (``ram_guard=True``), else without a
    budget :func:`unbudgeted_limit`; None on other devices, with ``ram_guard=False``, and with
    a budget alone."""
    guarded = device.type == "cpu" and ram_guard is not False and (
        ram_guard is not None or budget_bytes is None)
    if not guarded:
        return None
    if isinstance(ram_guard, RamGuard):
        return ram_guard
    return RamGuard.for_host() if budget_bytes is not None else unbudgeted_limit(device)
