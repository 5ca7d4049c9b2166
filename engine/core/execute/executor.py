"""The executor: run a workload at its sizes; on OOM retry at half, never lose the run.

Each call goes through the one size controller
(:class:`~oomguard.engine.core.execute.controller.SizeController`): a retry policy
(:class:`~oomguard.engine.core.execute.retry.Halve` by default,
:class:`~oomguard.engine.core.execute.retry.ReduceWith` for any other rule) says what
the next sizes are, and tenacity's retry loop stops when the policy has nothing
smaller to offer. Only out-of-memory errors are retried; any other error
propagates at once, untouched. The OOM's exception and traceback are dropped
*before* memory is released, so the failed attempt's tensors are really freed
between attempts. Each OOM is recorded in the run's :class:`RunRecord`
(``events``), with memory as the allocator and the host saw it at the OOM
(:mod:`~oomguard.engine.core.memory.forensics`). With ``on_oom`` the executor goes on past the
minimum through a ladder of remedies (lower precision, a fresh process with expandable
segments, the CPU), checking between attempts that memory came back
(:mod:`~oomguard.engine.core.execute.remedies`).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from oomguard.engine.core.execute.controller import (
    RunRecord,
    SizeAgreement,
    SizeController,
    SizeMemory,
)
from oomguard.engine.core.execute.remedies import Ladder, parse_on_oom, run_ladder
from oomguard.engine.core.execute.retry import Halve, ReduceWith, RetryPolicy, Sizes
from oomguard.engine.core.memory.forensics import start_history
from oomguard.engine.errors import (
    ExecutionFailed,
    NoExecutableBatchSize,
    UsageError,
    check_positive_int,
)
from oomguard.engine.util.weakmap import WeakIdMap

__all__ = ["ExecutionFailed", "Executor", "Halve", "NoExecutableBatchSize", "ReduceWith",
           "RetryPolicy", "RunRecord", "Sizes"]

log = logging.getLogger("oomguard.executor")

MAX_NAMES_KEPT = 1024  # named workloads whose sizes one executor remembers


class Executor:
    """Runs workloads; on OOM retries at smaller sizes; remembers what worked.

    ``policy`` decides the retry sizes (default :class:`Halve`); ``device`` is
    the one whose cache is emptied between attempts; ``agreement`` (default:
    none, one process) makes several processes take the same sizes.
    ``history`` holds a :class:`RunRecord` per call (the last 1024), each OOM
    in its ``events``. ``snapshot_on_oom``: a folder where every OOM writes a
    CUDA allocator snapshot (``<name>-oom<k>.pickle``, for pytorch.org/memory_viz;
    allocation history is recorded from the first run on, for the rest of the
    process). On another device the events say why there is none.

    ``on_oom`` (default None: retry at half only, as always) is a remedy ladder such as
    ``["halve", "bfloat16", "cpu"]`` (:func:`~oomguard.engine.core.execute.remedies.parse_on_oom`):
    after the minimum it tries each remedy in turn, and ``ladder`` holds what the last
    run's did (:class:`~oomguard.engine.core.execute.remedies.Ladder`). A lower precision needs a
    workload that declares ``tolerates_lower_precision = True`` and has
    ``at_precision(dtype)``; ``cpu`` needs ``on_device(device)``; both return the workload
    to call. ``fresh_process``: the caller can restart the run in a fresh process (a job's
    runner), so ``expandable_segments`` and memory that did not come back raise
    :class:`~oomguard.engine.errors.RestartNeeded` carrying the ladder to resume.

    What worked lives on this executor: per ``name=`` when one is given (the
    last 1024 names), else per function object while that object lives. A
    later call of the same workload starts at the remembered sizes when they
    are smaller than the sizes asked for. Two functions never share what was
    learnt, even with the same ``__qualname__``; a function created anew for
    every call needs a ``name=`` to be remembered.
    """

    def __init__(self, policy: RetryPolicy | None = None,
                 device: str | torch.device | None = None,
                 agreement: SizeAgreement | None = None,
                 snapshot_on_oom: str | os.PathLike[str] | None = None,
                 on_oom: Sequence[str] | None = None, fresh_process: bool = False) -> None:
        self.on_oom = parse_on_oom(on_oom) if on_oom is not None else None
        if self.on_oom is not None and agreement is not None:
            raise UsageError("on_oom runs in one process: it cannot be combined with an agreement")
        self.fresh_process = fresh_process
        self.ladder: Ladder | None = None
        self.policy = policy or Halve()
        self.snapshot_on_oom = snapshot_on_oom
        self.device = device
        self.agreement = agreement
        # Bounded: an executor called every training step must not grow forever.
        self.history: deque[RunRecord] = deque(maxlen=1024)
        self._named: OrderedDict[str, SizeMemory] = OrderedDict()
        self._unnamed: WeakIdMap[Any, SizeMemory] = WeakIdMap()

    def run(
        self,
        fn: Callable[..., Any],
        batch_size: int | None = None,
        *,
        sizes: Mapping[str, int] | None = None,
        minimum: Mapping[str, int] | None = None,
        name: str | None = None,
        ladder: Ladder | None = None,
    ) -> Any:
        """Run ``fn(batch_size)``, or ``fn(**sizes)`` for several tunable sizes.

        On OOM the sizes shrink by the policy and ``fn`` runs again; when they
        cannot shrink any more, :class:`~oomguard.engine.errors.ExecutionFailed`
        (a :class:`~oomguard.engine.errors.NoExecutableBatchSize`) names the
        workload and every size tried. Any error that is not an OOM propagates
        unchanged. Sizes must be positive integers (``ValueError`` otherwise).
        With ``on_oom``, the remedies follow the minimum; ``ladder`` resumes one that a
        :class:`~oomguard.engine.errors.RestartNeeded` carried out of another process.
        """
        if (batch_size is None) == (sizes is None):
            raise ValueError("give exactly one of batch_size or sizes")
        positional = sizes is None
        start: Sizes = {"batch_size": batch_size} if positional else dict(sizes)  # type: ignore[arg-type]
        for key, value in start.items():
            check_positive_int(key, value)
        label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        if self.snapshot_on_oom is not None:
            start_history(self.device)  # once per process: the snapshot needs the history
        record = RunRecord(workload=label)
        self.history.append(record)
        if self.on_oom is None and ladder is None:
            controller = self._controller(label, self._memory(fn, name, label, start), minimum,
                                          self.device)
            if positional:
                return controller.run(lambda s: fn(s["batch_size"]), cap=start, record=record)
            return controller.run(lambda s: fn(**s), cap=start, record=record)
        self.ladder = ladder or Ladder(self.on_oom or ("halve",))

        def run_rung(attempt: Callable[[Sizes], Any], sizes: Sizes, fresh: bool,
                     device: Any) -> Any:
            memory = SizeMemory.new(label, sizes) if fresh else self._memory(fn, name, label,
                                                                             start)
            return self._controller(label, memory, minimum, device).run(
                attempt, cap=sizes, record=record)

        return run_ladder(fn, start, self.ladder, run_rung=run_rung, record=record,
                          name=label, device=self.device, fresh_process=self.fresh_process,
                          positional=positional)

    def _controller(self, label: str, memory: SizeMemory, minimum: Mapping[str, int] | None,
                    device: Any) -> SizeController:
        return SizeController(label, memory, minimum=minimum, policy=self.policy,
                              agreement=self.agreement, device=device, logger=log,
                              snapshot_dir=self.snapshot_on_oom)

    def _memory(self, fn: Any, name: str | None, label: str, start: Sizes) -> SizeMemory:
        """What this executor learnt about the workload, or a new memory starting at ``start``."""
        if name is not None:
            memory = self._named.get(name)
            if memory is not None:
                self._named.move_to_end(name)
        else:
            memory = self._unnamed.get(fn)
        if memory is not None and memory.sizes.keys() == start.keys():
            return memory
        memory = SizeMemory.new(label, start)
        if name is not None:
            self._named[name] = memory
            if len(self._named) > MAX_NAMES_KEPT:
                self._named.popitem(last=False)
        else:
            try:
                self._unnamed[fn] = memory
            except TypeError:  # not weakly referenceable: nothing is remembered
                pass
        return memory
