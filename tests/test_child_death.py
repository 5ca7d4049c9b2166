"""A budgeted child that dies by a signal: out of memory near its limit, a crash far from it.

Some native code does not check what ``malloc`` returns, so an allocation refused at a
CPU budget's limit can kill the child with SIGSEGV instead of raising (an LSTM step's
backward did, at the size above its maximum). The parent samples the child's data segment
while it runs; these workloads fill the budget to a chosen distance from the limit and
then really segfault (a read of address 0), in a fresh child each.
"""

from __future__ import annotations

import ctypes
import resource
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.errors import ChildCrashed
from oomguard.probes import host

MiB = 1024**2
BUDGET = 64 * MiB

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="CPU budgets and /proc are Linux's")


@dataclass
class SegfaultsLeaving:
    """Maps all of the budget but ``leave_bytes``, holds it 50 ms, then reads address 0 (under
    a budget only: native code that crashes where an allocation fails near a limit)."""

    leave_bytes: int
    name: str = "segfaults-leaving"

    def __call__(self, size: int) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
        if soft == resource.RLIM_INFINITY:  # the child's warm-up call, before the budget
            return
        room = soft - (host.proc_status("VmData") or 0) - self.leave_bytes
        held = torch.empty(max(room, 0), dtype=torch.uint8)  # counted in VmData untouched
        time.sleep(0.05)  # the parent samples every 0.5 ms
        ctypes.string_at(0)
        del held


@pytest.mark.slow
def test_a_segfault_within_the_limits_reach_is_an_oom() -> None:
    trial = IsolatedRunner(SegfaultsLeaving(leave_bytes=1 * MiB), budget=BUDGET)(1)
    assert not trial.ok and "SIGSEGV" in trial.error, trial.error
    assert "of the budget's limit" in trial.error, trial.error


@pytest.mark.slow
def test_a_segfault_far_from_the_limit_is_a_crash() -> None:
    with pytest.raises(ChildCrashed, match="SIGSEGV.*no sign of running out of memory"):
        IsolatedRunner(SegfaultsLeaving(leave_bytes=40 * MiB), budget=BUDGET)(1)
