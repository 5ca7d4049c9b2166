"""Out-of-memory classification and cleanup.

An OOM is decided by exception type first, then by a tested list of messages
that the allocators of CUDA, cuBLAS, cuDNN, MPS, ROCm and the CPU produce when
they run out. Everything else (illegal memory access, device-side asserts,
NCCL errors, shape mismatches) is *not* an OOM and must propagate.

Cleanup after an OOM must run once the ``except`` block has been left: while
the exception is alive its traceback pins the failed step's frames and every
tensor in them. :func:`call_catching_oom` is the one place that does this.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from oomguard.engine.core.budget import active_budget
from oomguard.probes import host

# Substrings that identify an allocation failure. Kept lower-case; matched
# case-insensitively. Each has a test with a real message in tests/test_oom.py.
OOM_MESSAGES: tuple[str, ...] = (
    "cuda out of memory",  # torch.OutOfMemoryError's text on CUDA
    "cuda error: out of memory",  # driver/runtime error surfaced by a kernel launch
    "cuda driver error: out of memory",  # expandable segments: cuMemCreate / cuMemMap
    "cuda runtime error (2) : out of memory",  # legacy THC wording
    "cuda failure 'out of memory'",  # NCCL's ncclUnhandledCudaError
    "triton error [cuda]: out of memory",
    "cublas_status_alloc_failed",  # cuBLAS workspace allocation
    "cudnn_status_alloc_failed",  # cuDNN < 9 allocation failure
    "cudnn_status_not_enough_workspace",
    "cufft_alloc_failed",
    "cusolver_status_alloc_failed",
    "mps backend out of memory",  # Apple MPS
    "hip out of memory",  # ROCm
    "xpu out of memory",  # Intel XPU
    "defaultcpuallocator: can't allocate memory",  # CPU, e.g. under RLIMIT_DATA
    "failed to allocate memory",  # c10 / oneDNN scratchpad
    "out of memory trying to allocate",
)

# oneDNN reports an allocation failure while it builds a kernel as this; the
# same text also means other things, so it only counts when memory is known to
# be the constraint (docs/measurements.md#onednn-primitive).
_ONEDNN_PRIMITIVE = "could not create a primitive"
# An RLIMIT_DATA that someone else set counts as "near" when the process's
# VmData is within this fraction of it.
_NEAR_LIMIT = 0.10


def memory_limit_near() -> bool:
    """True inside an oomguard budget, or when ``VmData`` is within 10% of an
    ``RLIMIT_DATA`` set by someone else (``ulimit -d``, a job scheduler)."""
    if active_budget() is not None:
        return True
    limit = host.data_limit()
    vm_data = host.proc_status("VmData")
    return limit is not None and vm_data is not None and vm_data >= limit * (1 - _NEAR_LIMIT)


def is_oom(exc: BaseException, *, memory_constrained: bool | None = None) -> bool:
    """Return True if ``exc`` is an out-of-memory error.

    An exception with an ``oomguard_is_oom`` attribute decides for itself
    (oomguard's own "gave up" errors say False). Otherwise decided by type
    (``torch.OutOfMemoryError``, ``MemoryError``) and then by
    the messages in :data:`OOM_MESSAGES`. ``memory_constrained`` says whether a
    memory limit is known to be near; when ``None`` it is :func:`memory_limit_near`.
    Only then does oneDNN's ``could not create a primitive`` count as an OOM.
    """
    verdict = getattr(exc, "oomguard_is_oom", None)  # an exception that says what it is
    if verdict is not None:
        return bool(verdict)
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    if any(msg in text for msg in OOM_MESSAGES):
        return True
    if _ONEDNN_PRIMITIVE in text:
        if memory_constrained is None:
            memory_constrained = memory_limit_near()
        return memory_constrained
    return False


def oom_summary(exc: BaseException) -> str:
    """One line describing an OOM, without keeping a reference to ``exc``."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}"


def release_memory(device: str | torch.device | None = None) -> None:
    """Return freed memory to the device: ``gc.collect()`` then the allocator cache.

    Call this only outside an ``except`` block, or the live traceback keeps the
    failed step's tensors alive.
    """
    gc.collect()
    kind = torch.device(device).type if device is not None else None
    if kind in (None, "cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if kind in (None, "mps") and getattr(torch.backends, "mps", None) is not None:
        if torch.backends.mps.is_available():
            torch.mps.empty_cache()


@dataclass(frozen=True)
class OOM:
    """The record of an OOM: what went wrong, with the exception itself dropped."""

    message: str


def call_catching_oom(
    fn: Callable[..., Any], *args: Any, device: str | torch.device | None = None, **kwargs: Any
) -> Any | OOM:
    """Call ``fn``; return its value, or an :class:`OOM` record if it ran out of memory.

    Any other exception propagates unchanged. After an OOM the exception and
    its traceback are gone before :func:`release_memory` runs, so the failed
    step's tensors are really freed.
    """
    failure: OOM | None = None
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - re-raised unless it is an OOM
        if not is_oom(exc):
            raise
        failure = OOM(oom_summary(exc))
    # Outside the except block: `exc` and its frames are unreachable now.
    release_memory(device)
    return failure
