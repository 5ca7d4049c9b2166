"""oomguard: an adaptive, OOM-resilient execution engine for PyTorch.

The names users write against, re-exported from the packages that hold them::

    import oomguard
    oomguard.probe("cpu").free_bytes              # memory snapshot, bytes
    result = oomguard.search(step, start=32, size_step=8, budget=2 * 1024**3)
    plan = oomguard.search_shapes(step2, lengths)  # step2(batch, seq_len): batch per length
    oomguard.write_report(result, "out/")         # report.md, report.json, memory.png
    oomguard.Executor().run(step, batch_size=64)  # OOM -> retry at half

    @oomguard.adaptive(batch_size=64)             # inside a training script
    def train_step(batch_size): ...

    oomguard.accumulate(step_fn, batch, params=model)  # micro-batches, same gradients
    oomguard.micro_batch_for(64, 37)              # 32: 64 rows as 32 + 32 where 37 fit
    model, optimizer = oomguard.release_memory(model, optimizer)  # accelerate's call
    oomguard.free_memory("cuda")                  # gc, then the allocator's cache

The rest is in namespaces: ``strategies``, ``retry``, ``errors`` (the whole tree),
``results`` (what the calls return), ``memory`` and ``training``. Names are resolved on
first use (PEP 562): ``import oomguard`` and ``oomguard --help`` import no torch.
"""

from __future__ import annotations

# First, before anything else is imported: the `oomguard` command's Ctrl-C handler, so that
# a Ctrl-C while the command line loads waits for its `main` (a no-op in any other program).
from oomguard.engine.cli.interrupt import install_at_start as _install_at_start

_install_at_start()
del _install_at_start

import importlib  # noqa: E402 - after the handler, on purpose
from typing import TYPE_CHECKING, Any  # noqa: E402

__version__ = "0.1.0"

# public name -> the module that defines it; __all__ is its keys
_EXPORTS: dict[str, str] = {name: module for module, names in {
    "oomguard.probes": ("probe",),
    "oomguard.engine.core.memory.budget": ("budget",),
    "oomguard.engine.core.memory.oom": ("is_oom",),
    "oomguard.engine.training.release": ("free_memory", "release_memory"),
    "oomguard.engine.core.search.search": ("search", "verify"),
    "oomguard.engine.core.search.config": ("SearchConfig",),
    "oomguard.engine.core.shapes": ("search_shapes",),
    "oomguard.engine.core.estimate.estimate": ("estimate",),
    "oomguard.engine.core.execute.executor": ("Executor",),
    "oomguard.engine.training.adaptive": ("adaptive", "find_executable_batch_size"),
    "oomguard.engine.core.execute.stats": ("stats",),
    "oomguard.engine.training.accumulate": ("accumulate", "micro_batch_for"),
    "oomguard.reports": ("write_report",),
    # the errors a caller catches; the whole tree is oomguard.errors
    "oomguard.engine.errors": ("OomguardError", "UsageError", "ExecutionFailed",
                               "NoExecutableBatchSize", "SearchFailed"),
}.items() for name in names}
_NAMESPACES = ("errors", "memory", "results", "retry", "strategies", "training")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _NAMESPACES:
        return importlib.import_module(f"oomguard.{name}")  # the import binds it here too
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'oomguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_NAMESPACES))


if TYPE_CHECKING:  # static checkers and IDEs see the real names ("as": re-exported)
    from oomguard import errors as errors
    from oomguard import memory as memory
    from oomguard import results as results
    from oomguard import retry as retry
    from oomguard import strategies as strategies
    from oomguard import training as training
    from oomguard.engine.core.estimate.estimate import estimate as estimate
    from oomguard.engine.core.execute.executor import Executor as Executor
    from oomguard.engine.core.execute.stats import stats as stats
    from oomguard.engine.core.memory.budget import budget as budget
    from oomguard.engine.core.memory.oom import is_oom as is_oom
    from oomguard.engine.core.search.config import SearchConfig as SearchConfig
    from oomguard.engine.core.search.search import search as search
    from oomguard.engine.core.search.search import verify as verify
    from oomguard.engine.core.shapes import search_shapes as search_shapes
    from oomguard.engine.errors import ExecutionFailed as ExecutionFailed
    from oomguard.engine.errors import NoExecutableBatchSize as NoExecutableBatchSize
    from oomguard.engine.errors import OomguardError as OomguardError
    from oomguard.engine.errors import SearchFailed as SearchFailed
    from oomguard.engine.errors import UsageError as UsageError
    from oomguard.engine.training.accumulate import accumulate as accumulate
    from oomguard.engine.training.accumulate import micro_batch_for as micro_batch_for
    from oomguard.engine.training.adaptive import adaptive as adaptive
    from oomguard.engine.training.adaptive import (
        find_executable_batch_size as find_executable_batch_size,
    )
    from oomguard.engine.training.release import free_memory as free_memory
    from oomguard.engine.training.release import release_memory as release_memory
    from oomguard.probes import probe as probe
    from oomguard.reports import write_report as write_report
