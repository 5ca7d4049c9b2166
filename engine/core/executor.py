"""The executor: run a workload at its sizes; on OOM retry at half, never lose the run.

Each call goes through the one size controller
(:class:`~oomguard.engine.core.controller.SizeController`): a retry policy
(:class:`~oomguard.engine.core.retry.Halve` by default,
:class:`~oomguard.engine.core.retry.ReduceWith` for any other rule) says what
the next sizes are, and tenacity's retry loop stops when the policy has nothing
smaller to offer. Only out-of-memory errors are retried; any other error
propagates at once, untouched. The OOM's exception and traceback are dropped
*before* memory is released, so the failed attempt's tensors are really freed
between attempts. Each OOM is recorded in the run's :class:`RunRecord`
(``events``), with memory as the allocator and the host saw it at the OOM
(:mod:`~oomguard.engine.core.forensics`).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from oomguard.engine.core.controller import (
    RunRecord,
    SizeAgreement,
    SizeController,
    SizeMemory,
)
from oomguard.engine.core.forensics import start_history
from oomguard.engine.core.retry import Halve, ReduceWith, RetryPolicy, Sizes
from oomguard.engine.core.weakmap import WeakIdMap
from oomguard.engine.errors import ExecutionFailed, NoExecutableBatchSize, check_positive_int

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
                 snapshot_on_oom: str | os.PathLike[str] | None = None) -> None:
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
    ) -> Any:
        """Run ``fn(batch_size)``, or ``fn(**sizes)`` for several tunable sizes.

        On OOM the sizes shrink by the policy and ``fn`` runs again; when they
        cannot shrink any more, :class:`~oomguard.engine.errors.ExecutionFailed`
        (a :class:`~oomguard.engine.errors.NoExecutableBatchSize`) names the
        workload and every size tried. Any error that is not an OOM propagates
        unchanged. Sizes must be positive integers (``ValueError`` otherwise).
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
        controller = SizeController(label, self._memory(fn, name, label, start),
                                    minimum=minimum, policy=self.policy,
                                    agreement=self.agreement, device=self.device, logger=log,
                                    snapshot_dir=self.snapshot_on_oom)
        record = RunRecord(workload=label)
        self.history.append(record)
        if positional:
            return controller.run(lambda s: fn(s["batch_size"]), cap=start, record=record)
        return controller.run(lambda s: fn(**s), cap=start, record=record)

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
