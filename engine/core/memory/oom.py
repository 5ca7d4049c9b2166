"""Out-of-memory classification and cleanup.

An OOM is decided by exception type first (``torch.OutOfMemoryError``, ``MemoryError``),
then by :data:`OOM_TABLE`: the messages of the allocators of CUDA, cuBLAS, cuDNN, MPS,
ROCm, XPU, NPU, MLU, MUSA, HPU and the CPU when they run out, and the failures that mean
"out of memory" only while a memory limit is near. Everything else (illegal memory
access, device-side asserts, NCCL errors, shape mismatches) is *not* an OOM and propagates.

Cleanup after an OOM must run once the ``except`` block has been left: while the
exception is alive its traceback pins the failed step's frames and every tensor in them.
:func:`call_catching_oom` is the one place that does this; it is also where an OOM that the
called code caught itself is seen (:mod:`~oomguard.engine.core.memory.swallowed`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from oomguard.engine.core.memory.budget import active_budget
from oomguard.engine.core.memory.oom_texts import OOM_TABLE
from oomguard.engine.core.memory.swallowed import Witness
from oomguard.engine.errors import first_line
from oomguard.probes import host

_NEAR_LIMIT = 0.10  # a limit counts as near within this fraction of it


def memory_limit_near() -> bool:
    """True inside an oomguard budget, or when ``VmData`` is within 10% of an
    ``RLIMIT_DATA`` set by someone else (``ulimit -d``, a job scheduler)."""
    if active_budget() is not None:
        return True
    limit = host.data_limit()
    vm_data = host.proc_status("VmData")
    return limit is not None and vm_data is not None and vm_data >= limit * (1 - _NEAR_LIMIT)


def cuda_memory_near_limit() -> bool:
    """True when a CUDA device this process has a context on is within 10% of its limit
    (reserved bytes against the fraction's cap, or free bytes against the total), or its
    allocator met the limit since its last reported OOM
    (:func:`oomguard.probes.cuda.unreported_oom_retries`: a failing allocator frees its
    cache first, so a large failed request leaves reserved bytes far below the cap).
    Devices without a context, or that cannot be read, are no evidence."""
    # why: probes.cuda imports torch's CUDA helpers; only needed once a GPU row matched.
    from oomguard.probes import cuda

    if cuda.unavailable_reason() is not None:
        return False
    for i in range(cuda.device_count()):
        try:
            if not cuda.has_context(i):
                continue
            stats = cuda.allocator_stats(i)
            free, total = cuda.mem_get_info(i)
            if stats["reserved"] >= stats["fraction_cap"] * (1 - _NEAR_LIMIT) \
                    or free < total * _NEAR_LIMIT or cuda.unreported_oom_retries(i) > 0:
                return True
        except RuntimeError:  # a sticky CUDA error: the device cannot answer
            continue
    return False


def is_oom(exc: BaseException, *, memory_constrained: bool | None = None) -> bool:
    """Return True if ``exc`` is an out-of-memory error: by its ``oomguard_is_oom``
    attribute, its type, then a row of :data:`OOM_TABLE` (one of its types, its text in
    ``str(exc)``); a row marked ``evidence`` counts only while ``memory_constrained``, or
    when that is None while the row's limit is near."""
    verdict = getattr(exc, "oomguard_is_oom", None)  # an exception that says what it is
    if verdict is not None:
        return bool(verdict)
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    rows = [row for row in OOM_TABLE if isinstance(exc, row.types)]
    text = str(exc).lower() if rows else ""  # no str() of an exception no row can match
    matched = [row for row in rows if row.text in text]
    if not matched:
        return False
    if any(not row.evidence for row in matched):
        return True
    if memory_constrained is not None:
        return memory_constrained
    near = {"host": memory_limit_near, "cuda": cuda_memory_near_limit}
    return any(near[kind]() for kind in dict.fromkeys(row.near for row in matched))


def release_memory(device: str | torch.device | None = None) -> None:
    """Return freed memory to the device: ``gc.collect()`` then the allocator cache. Call it
    outside an ``except`` block, or the live traceback keeps the failed step's tensors."""
    gc.collect()
    kind = torch.device(device).type if device is not None else None
    if kind in (None, "cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if kind in (None, "mps") and torch.backends.mps.is_available():
        torch.mps.empty_cache()


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect garbage once, then ``gc.freeze`` every object alive now while the block runs,
    so :func:`release_memory` before each trial scans only what trials created (a measured
    ~200 ms collection becomes ~3 us: docs/measurements.md#gc-freeze). A freeze already in
    force is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class OOM:
    """The record of an OOM, the exception itself dropped. ``caught_by_workload``: the call's
    own code caught it (:mod:`~oomguard.engine.core.memory.swallowed`); an OOM all the same."""

    message: str
    caught_by_workload: bool = False


def oom_text(exc: BaseException) -> str | None:
    """``Type: first line`` of an OOM (at most 300 characters of the line), None for any
    other exception."""
    return f"{type(exc).__name__}: {first_line(exc)[:300]}" if is_oom(exc) else None


def call_catching_oom(fn: Callable[..., Any], *args: Any, device: str | torch.device | None = None,
                      on_oom: Callable[[BaseException], None] | None = None,
                      workload: str | None = None, **kwargs: Any) -> Any | OOM:
    """Call ``fn``; return its value, or an :class:`OOM` record if it ran out of memory
    (any other exception propagates), after :func:`release_memory` ran outside the
    ``except`` block. ``on_oom(exc)`` is called once, first, while the tensors are alive;
    an error it raises is ignored. A call whose own code caught an OOM is an OOM too: its
    record is flagged ``caught_by_workload`` and names ``workload`` (default: ``fn``'s name).
    """
    witness = Witness(oom_text, device, on_oom)
    try:
        with witness:
            value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - re-raised unless it is an OOM
        own = oom_text(exc)
        if own is None and not _after_caught_oom(exc, witness.seen):
            raise
        if on_oom is not None and not witness.reported:
            with contextlib.suppress(Exception):  # no room even to record: still the OOM
                on_oom(exc)
        failure = OOM(own) if own is not None else _caught(
            fn, workload, f"then raised {type(exc).__name__}: {first_line(exc)[:200]}",
            witness.seen)  # no reference to exc
    else:
        if witness.seen is None:
            return value
        del value  # a placeholder the workload returned instead of its result
        failure = _caught(fn, workload, "then returned normally", witness.seen)
    # Outside the except block: `exc` and its frames are unreachable now.
    release_memory(device)
    return failure


def _after_caught_oom(exc: BaseException, seen: str | None) -> bool:
    """Whether ``exc`` (not an OOM) is an error the code raised after catching the OOM
    ``seen``: then still an OOM. An interrupt (KeyboardInterrupt, SystemExit) or an error
    that says it is no OOM (oomguard's "gave up" errors) never is."""
    return (seen is not None and isinstance(exc, Exception)
            and getattr(exc, "oomguard_is_oom", None) is None)


def _caught(fn: Any, workload: str | None, then: str, seen: str | None) -> OOM:
    """The record of an OOM that ``fn``'s own code caught (``seen``: its text)."""
    who = workload or getattr(fn, "__qualname__", None) or type(fn).__name__
    return OOM(f"{who}: out of memory caught by its own code, which {then} ({seen})",
               caught_by_workload=True)
