"""What bounds CPU work that was given no budget: a search, a job's task, a reference row.

- **An RLIMIT_DATA someone else set** (``ulimit -d``, a scheduler): the work runs under a
  budget at the room it leaves, so trials count ``VmData`` as the limit does.
- **A cgroup memory limit** (Docker, Slurm): past it the kernel SIGKILLs; the work runs
  under a budget just under the room it leaves, so running out is an exception
  (docs/measurements.md#cgroup-limits).
- **Physical RAM**: the RAM guard (:mod:`~oomguard.engine.core.search.ramguard`, 80% of the
  available RAM, estimated) stands in for a limit.

The tightest wins (:mod:`~oomguard.engine.core.search.limit` chooses).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from oomguard.engine.core.memory.budget import (  # noqa: F401 - CGROUP_SLACK_*: this module's face
    CGROUP_SLACK_FRACTION,
    CGROUP_SLACK_MIN,
    MIN_CPU_BUDGET,
    Budget,
    budget,
    cgroup_slack,
)
from oomguard.engine.errors import BudgetError
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import host


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
        slack = cgroup_slack(room) if self.name == "cgroup" else 0
        if room - slack < MIN_CPU_BUDGET:
            raise BudgetError(f"the {self.name} limit of {fmt_bytes(self.limit_bytes)} leaves "
                              f"{fmt_bytes(room)} to this work, and a budget under it needs "
                              f"{fmt_bytes(MIN_CPU_BUDGET + slack)}: give the container or "
                              "job more memory")
        with budget(room - slack, "cpu") as b:
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
