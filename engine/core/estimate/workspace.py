"""Matrix-multiply workspace of an estimate, measured on this host.

The BLAS library packs a matrix multiply's operands into buffers it allocates at its first
call of a kind and keeps for the life of the process. An estimate records the distinct
matrix multiplies its fake run made (the warm-up's, then the size's); :func:`add_workspace`
replays them on zero tensors in an isolated child with this process's threads and counts
the resident bytes each keeps: what they add to the peak of a size after the warm-up alone
(after a larger size in one process it reads high by up to that). Too big to replay
cheaply (:data:`REPLAY_LIMIT`, :data:`REPLAY_MACS`): not counted, and the notes say so.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from oomguard.engine.errors import IsolationError, first_line

# Matrix multiplies whose workspace is measured (matmul, linear, attention and the in-place
# forms accumulators use), replayed only while none moves over REPLAY_LIMIT bytes and all
# take at most REPLAY_MACS float32 multiply-adds (a few CPU seconds); a bfloat16 or float16
# one counts SLOW_DTYPE times (measured ~50x slower: docs/measurements.md#estimate-error).
GEMMS = frozenset({"mm.default", "addmm.default", "bmm.default", "baddbmm.default",
                   "addmm_.default", "baddbmm_.default"})
REPLAY_LIMIT, REPLAY_MACS, SLOW_DTYPE = 256 * 1024**2, 2**35, 64


@dataclass
class WorkspaceReplay:
    """For an isolated child: ``warmup()`` replays a warm-up's matrix multiplies with ``threads``
    torch threads, a call one size's: the resident bytes each kept (``preload``: the workload's)."""

    warm: list[tuple]
    run: list[tuple]
    threads: int
    preload: tuple[str, ...] = ()

    def warmup(self) -> None:
        torch.set_num_threads(self.threads)
        self.replay(self.warm)

    def __call__(self, size: int) -> list[int]:
        return self.replay(self.run)

    @staticmethod
    def replay(gemms: Sequence[tuple]) -> list[int]:
        """Run each matrix multiply once on zero tensors of its arguments' shapes and strides;
        the resident bytes each left behind, its result freed (what its library keeps)."""
        from oomguard.probes.host import resident_bytes

        kept = []
        for name, specs, kwargs in gemms:
            args = [torch.zeros(1 + sum((n - 1) * st for n, st in zip(a[0], a[1], strict=True))
                                if all(a[0]) else 0, dtype=a[2]).as_strided(a[0], a[1])
                    if isinstance(a, tuple) else a for a in specs]
            before = resident_bytes()[0] or 0
            getattr(torch.ops.aten, name.split(".")[0])(*args, **dict(kwargs))  # result freed
            kept.append(max(0, (resident_bytes()[0] or 0) - before))
        return kept


def add_workspace(e: Any, fn: Any, warm: dict[tuple, tuple[int, int]],
                   run: dict[tuple, tuple[int, int]], segments: list[int]) -> None:
    """Raise ``e`` (an :class:`~oomguard.engine.core.estimate.estimate.Estimate`) by the workspace ``run``'s matrix multiplies keep on this host after
    ``warm``'s, measured in an isolated child, or note why not. Each one's buffers exist from
    its first call on: the peak is the highest ``segments[k]`` plus the first k's."""
    from oomguard.engine.core.search.isolate import IsolatedRunner
    from oomguard.engine.core.workload import preload_of

    start, calls = time.perf_counter(), [*run.values(), *warm.values()]
    why, threads = None, torch.get_num_threads()
    if not run.keys() - warm.keys():
        e.workspace_bytes = 0  # none, or each ran in the warm-up: its buffers exist already
    elif max(b for b, _ in calls) > REPLAY_LIMIT or sum(m for _, m in calls) > REPLAY_MACS:
        why = f"too big to replay ({sum(m for _, m in calls):.2g} float32 multiply-adds)"
    else:
        try:
            trial = IsolatedRunner(WorkspaceReplay(list(warm), list(run), threads,
                                                   preload_of(fn)), "cpu", timeout=600)(1)
            why = None if trial.ok else "OOM"
        except (IsolationError, RuntimeError) as exc:
            why = first_line(exc)
        if why is None:
            kept = [0, *itertools.accumulate(trial.value)]
            peak = max(seg + kept[k] for k, seg in enumerate(segments))
            e.workspace_bytes, e.peak_bytes = peak - e.peak_bytes, peak
            e.method += f" + matrix-multiply workspace replayed in a fresh process ({threads} threads)"
    if why is not None:
        e.notes.append(f"matrix-multiply workspace not counted: {why}")
    e.seconds += time.perf_counter() - start
