"""Out-of-memory errors that the workload's own code caught: a call during which one was raised
is not a success, even when it returned normally.

Analysis code often wraps its work in ``except Exception`` and returns a placeholder.
:class:`Witness` sees the OOM as it is raised, and
:func:`~oomguard.engine.core.memory.oom.call_catching_oom` then returns the
:class:`~oomguard.engine.core.memory.oom.OOM` record a raised OOM gets, flagged
``caught_by_workload``.

Two signals, one per kind of memory:

- **CUDA** (always on): the caching allocator's ``memory_stats()["num_ooms"]``, incremented
  right before it throws ``OutOfMemoryError``; a rise during the call on a device with a
  context is an OOM there, including the ones torch catches itself (cuDNN's algorithm
  search): a conservative answer at the edge. ``backend:cudaMallocAsync`` keeps no count:
  there the CPU's signal stands in under a budget.
- **CPU** (on under a budget): under ``RLIMIT_DATA`` torch raises a plain ``RuntimeError``
  out of the operator that allocated. A ``TorchDispatchMode`` (:class:`_Spotter`), active on
  this thread for the call only, runs each aten operator in ``try``/``except``, notes an
  exception that :func:`~oomguard.engine.core.memory.oom.is_oom` calls an OOM, and re-raises
  it unchanged. Backward operators are seen too: the autograd engine's threads run under
  the caller's ``ThreadLocalState``, which carries the dispatch modes (checked on an H200:
  bench/gpu_check_swallowed.py). Not seen: a ``MemoryError`` from Python or numpy, and
  operators on threads the call starts itself. Compiled regions stay compiled
  (``ignore_compile_internals``).

Cost without an OOM (measured, bench/bench_overhead.py): the spotter adds about 4 us per
aten operator (a tiny GPT-2 CPU step 1.77x, a matmul-heavy step within noise); off, a call
pays about 1 us, on a CUDA device about 40 us (the allocator's stats read twice). So in
``auto`` mode the spotter is on only where a budget is in force (``active_budget()``: search
trials, isolated children, a job's calls, an enforced host limit). ``OOMGUARD_SWALLOWED_OOMS``,
read at import and inherited by children, sets ``auto`` (default), ``on`` or ``off`` (the
CUDA counter stays on); :func:`set_spotter_mode` sets it for this process only. Python
3.12's ``sys.monitoring`` would be cheaper but 3.10 and 3.11 need the dispatch mode anyway.

Timing: a search trial's items per second come from its steps after the first, which run
with the spotter paused (:func:`spotter_paused`), so a size's rate is the workload's own and
not the spotter's (docs/measurements.md#throughput-without-the-detector). The first step,
which allocates everything (an optimizer's state included), keeps it; so does every step of
a workload whose own code catches its errors (``catches_own_errors``: the metrics, and so
the jobs), where a swallowed OOM would be a wrong result.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oomguard.engine.core.memory.budget import active_budget
from oomguard.engine.errors import UsageError

ENV = "OOMGUARD_SWALLOWED_OOMS"
_MODES = ("auto", "on", "off")


class _Thread(threading.local):
    """Per thread: the witnesses of the calls running on it, innermost last, and the spotter
    the outermost one pushed (it holds this list, so notes from autograd's threads reach the
    caller's witness). An OOM counts for the innermost call only."""

    spotter: _Spotter | None = None

    def __init__(self) -> None:
        self.frames: list[Witness] = []


_local = _Thread()


def _checked(mode: str) -> str | UsageError:
    mode = mode.strip().lower() or "auto"
    return mode if mode in _MODES else UsageError(
        f"{ENV} must be one of {', '.join(_MODES)}, got {mode!r}; set it to one of "
        "those, or unset it")


# Read once, at import (asked on every call); a bad value is said at the first call.
_mode: str | UsageError = _checked(os.environ.get(ENV, "auto"))


def set_spotter_mode(mode: str) -> None:
    """Set the CPU spotter's mode in this process (not in children already started):
    ``auto``, ``on`` or ``off`` (``auto``: on where an OOM can be seen as it is raised); :class:`UsageError` (one line) for
    anything else."""
    global _mode
    checked = _checked(mode)
    if isinstance(checked, UsageError):
        raise checked
    _mode = checked


def spotter_mode() -> str:
    """The CPU spotter's mode: ``auto``, ``on`` or ``off``; :class:`UsageError` (one line)
    when ``OOMGUARD_SWALLOWED_OOMS`` held anything else."""
    if isinstance(_mode, UsageError):
        raise _mode
    return _mode


class _Spotter(TorchDispatchMode):
    """Runs each aten operator, notes an OOM leaving it in the innermost :class:`Witness`,
    re-raises it unchanged."""

    # Higher-order operators (flex_attention, cond) run unchanged through __torch_dispatch__.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled regions stay compiled (torch.compile turns the mode off there)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in torch._disable_dynamo, which imports
        # torch._dynamo at the first operator (a MemoryError under a tight budget) and costs
        # time per operator; ignore_compile_internals keeps this mode out of compiled code.
        return False

    def __init__(self, frames: list[Witness]) -> None:
        super().__init__()
        self.frames = frames  # the pushing thread's, whichever thread runs an operator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        try:
            return func(*args, **(kwargs or {}))
        except BaseException as exc:
            if self.frames:
                self.frames[-1].saw(exc)
            raise


@contextlib.contextmanager
def spotter_paused() -> Iterator[None]:
    """Inside, this thread's CPU spotter is off, where an enclosing :class:`Witness` pushed one
    (an OOM raised inside is still the call's: it leaves through the witness); a witness
    entered inside may push its own. For steps timed for throughput, whose cost must not be
    the spotter's."""
    spotter = _local.spotter
    if spotter is None:
        yield
        return
    spotter.__exit__(None, None, None)
    _local.spotter = None
    try:
        yield
    finally:
        spotter.__enter__()
        _local.spotter = spotter


class Witness:
    """Whether an OOM was raised during a call, caught or not. Enter it around the call;
    afterwards :attr:`seen` is None, or the first OOM's text (``Type: first line``);
    :attr:`reported` says whether ``on_oom`` was already called with it.

    ``classify(exc)``: the text of an OOM, else None. ``on_oom(exc)`` is called once, at the
    first OOM the spotter sees, while the tensors are alive (its errors ignored). ``device``:
    the call's device (None: every CUDA device with a context)."""

    def __init__(self, classify: Callable[[BaseException], str | None],
                 device: str | torch.device | None = None,
                 on_oom: Callable[[BaseException], None] | None = None) -> None:
        self.classify, self.on_oom, self.device = classify, on_oom, device
        self.seen: str | None = None
        self.reported = False
        self._pushed: _Spotter | None = None
        self._ooms: dict[int, int] = {}

    def saw(self, exc: BaseException) -> None:
        """The spotter's note of an exception leaving an operator during the call."""
        if self.seen is not None:
            return
        text = self.classify(exc)
        if text is None:
            return
        self.seen = text
        if self.on_oom is not None:
            self.reported = True
            with contextlib.suppress(Exception):  # no room even to record: still the OOM
                self.on_oom(exc)

    def __enter__(self) -> Witness:
        self._ooms = _cuda_ooms(self.device)
        _local.frames.append(self)
        if _local.spotter is None and _wants_spotter():
            self._pushed = _local.spotter = _Spotter(_local.frames)
            self._pushed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pushed is not None:
            _local.spotter = None
            self._pushed.__exit__(None, None, None)
            self._pushed = None
        _local.frames.pop()
        if self.seen is None and torch.cuda.is_initialized():
            after = _cuda_ooms(self.device)
            rose = [i for i, n in after.items() if n > self._ooms.get(i, 0)]
            if rose:
                self.seen = (f"OutOfMemoryError: the CUDA caching allocator reported "
                             f"{sum(after[i] - self._ooms.get(i, 0) for i in rose)} OOM(s) on "
                             f"cuda:{rose[0]} (memory_stats num_ooms)")


def _wants_spotter() -> bool:
    """Whether the CPU signal is on for a call now."""
    mode = spotter_mode()
    if mode != "auto":
        return mode == "on"
    b = active_budget()
    if b is None:
        return False
    # Under a budget on a CUDA device the allocator's count answers, unless it keeps none.
    return not b.device.startswith("cuda") or _async_backend()


def _async_backend() -> bool:
    # why: probes.cuda imports torch's CUDA helpers; read only under a CUDA budget.
    from oomguard.probes import cuda

    return cuda.async_backend()


def _cuda_ooms(device: str | torch.device | None) -> dict[int, int]:
    """``num_ooms`` per CUDA device this call can run out on: ``device``'s, or every device
    with a context; none where CUDA is not initialised (reading would create a context) or
    the device is not CUDA."""
    if not torch.cuda.is_initialized():
        return {}
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return {}
    # why: as in _async_backend
    from oomguard.probes import cuda

    if dev is not None:
        index = dev.index if dev.index is not None else cuda.current_device()
        return {index: cuda.oom_count(index)} if cuda.has_context(index) else {}
    return {i: cuda.oom_count(i) for i in range(cuda.device_count()) if cuda.has_context(i)}
