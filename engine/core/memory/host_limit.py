"""What bounds CPU work that was given no budget: a search, a job's task, a reference row.

Three limits can stop it, and each is met in its own way:

- **An RLIMIT_DATA someone else set** (``ulimit -d``, a batch scheduler): an allocation
  past it fails with a catchable error, a real OOM. The work runs under a budget at the
  room it leaves, so trials are measured in what it counts (``VmData``) and a search
  goes up to the limit.
- **A cgroup memory limit** (Docker, Kubernetes, Slurm): past it the kernel kills a
  process of the group (SIGKILL), and no exception is raised. The work runs under a
  budget (an ``RLIMIT_DATA``) just under the room the cgroup leaves when the budget is
  entered, so that running out is an exception, never a kill
  (docs/measurements.md#cgroup-limits).
- **Physical RAM**, which nothing enforces: one size past it makes the host swap. The
  RAM guard (:mod:`~oomguard.engine.core.search.ramguard`, 80% of the available RAM,
  estimated) stands in for a limit.

The tightest wins (:mod:`~oomguard.engine.core.search.limit` chooses). Results and reports
name the limit that bound.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from oomguard.engine.core.memory.budget import MIN_CPU_BUDGET, Budget, budget
from oomguard.engine.core.memory.heap import free_heap_bytes
from oomguard.engine.errors import BudgetError
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import host

# A cgroup also charges what VmData does not count: page tables, kernel stacks, file pages a
# trial touches, and the copy of each page a fork left shared that the process writes to. The
# budget stays this far under the room; in a process whose garbage collector scans what the
# fork left shared (it is not frozen, as it is in every child oomguard starts), also that far
# under (it writes to every object it scans) (docs/measurements.md#cgroup-limits).
CGROUP_SLACK_FRACTION = 0.02
CGROUP_SLACK_MIN = 16 * 1024**2


@dataclass(frozen=True)
class HostLimit:
    """An enforced limit that binds CPU work without a budget:
    ``name`` "cgroup" or "RLIMIT_DATA", ``limit_bytes``, and ``room_bytes`` it left when it
    was chosen (measured)."""

    name: str
    limit_bytes: int
    room_bytes: int

    @contextmanager
    def enforced(self) -> Iterator[Budget | None]:
        """A CPU budget at the room this limit leaves now (a cgroup's less its slack),
        measured on entry: enter it after the warm-up, as any budget. :class:`BudgetError`
        where the room is below the smallest budget, before any work."""
        room = next((lim.room_bytes for lim in host.enforced_limits() if lim.name == self.name),
                    None)
        if room is None:  # the limit was lifted since it was chosen
            yield None
            return
        slack = 0
        if self.name == "cgroup":
            scanned = 0 if gc.get_freeze_count() else host.shared_anonymous_bytes() or 0
            slack = max(CGROUP_SLACK_MIN, int(room * CGROUP_SLACK_FRACTION)) + scanned
        if room - slack < MIN_CPU_BUDGET:
            raise BudgetError(f"the {self.name} limit of {fmt_bytes(self.limit_bytes)} leaves "
                              f"{fmt_bytes(room)} to this work, and a budget under it needs "
                              f"{fmt_bytes(MIN_CPU_BUDGET + slack)}: give the container or "
                              "job more memory")
        # The budget charges the free heap chunks present at entry to itself (budget.py); the
        # kernel's limit does not, so they are given back: the work may use the whole room.
        with budget(room - slack + (free_heap_bytes() or 0), "cpu") as b:
            yield b

    def describe(self) -> str:
        """The limit in words, for the search's first line and its report."""
        if self.name == "cgroup":
            return (f"cgroup memory limit {fmt_bytes(self.limit_bytes)} ({fmt_bytes(self.room_bytes)}"
                    " left; enforced: each trial ran under an RLIMIT_DATA just under the room "
                    "it left, so running out was an exception, not a kill)")
        return (f"RLIMIT_DATA {fmt_bytes(self.limit_bytes)} set on this process "
                f"({fmt_bytes(self.room_bytes)} left; enforced: allocations past it fail)")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "enforced": True, "limit_bytes": self.limit_bytes,
                "room_bytes": self.room_bytes, "description": self.describe()}
