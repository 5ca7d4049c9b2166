"""Estimate a workload's peak memory at given sizes without running the work.

``estimate(fn, [8, 32])`` runs ``fn`` under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`
(no data, no memory) while a dispatch mode counts the bytes of every tensor storage created
and freed; the estimate is the highest count above what existed before the size ran, as a
trial measures it. An operation on real inputs only (token ids, masks) runs for real when
its outputs are small (:data:`REAL_LIMIT`, :data:`REAL_FLOAT_LIMIT`); a Python number read
from a fake tensor reads as 1, and the notes count them.

Matrix-multiply workspace (CPU) is measured, not predicted
(:mod:`oomguard.engine.core.estimate.workspace`). Only the target device's memory counts:
host-side bookkeeping goes to :func:`host_device`.

Not counted: other operators' workspace, reused free heap, the allocator's cache and
rounding beyond CUDA's 512-byte blocks, cuBLAS's workspace, the device context. Measured
error: docs/measurements.md#estimate-error.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch._subclasses import fake_tensor as ft  # imported by torch itself: free
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from oomguard.engine.core.estimate.hooks import _RUNNING, _Running
from oomguard.engine.core.estimate.workspace import GEMMS, SLOW_DTYPE, add_workspace
from oomguard.engine.errors import UsageError, check_positive_int

# Bytes up to which outputs of an operation on real inputs are computed for real.
REAL_LIMIT = 16 * 1024**2
REAL_FLOAT_LIMIT = 64 * 1024
# Operations on real inputs whose fake run found their outputs small (they run for real),
# keyed by _real_key: a repeat skips the fake run (measured: about a third of an estimate's
# time, docs/measurements.md#estimate-reference). REAL_CACHE False: every one runs fake first.
REAL_CACHE = True
REAL_CACHE_SIZE = 65536
_RUNS_REAL: set[tuple] = set()
# CUDA's allocator rounds blocks up to 512 bytes (kMinBlockSize, CUDACachingAllocator.cpp)
CUDA_BLOCK = 512
LABEL = "estimate, not measured"
METHOD = "fake tensors (FakeTensorMode) + storage bytes counted at dispatch"


@dataclass
class Estimate:
    """The estimated peak bytes of a workload at ``size`` above what existed before, for
    ``device``, computed on ``estimated_on``; ``notes`` say what it left out or assumed;
    ``workspace_bytes`` (None: not counted) is measured on this host."""

    size: int
    peak_bytes: int
    method: str
    device: str
    estimated_on: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kind: str = LABEL
    workspace_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Counted:
    """What one storage counts: ``nbytes`` above where it started, ``seen`` its size last seen."""

    nbytes: int
    seen: int
    ref: weakref.ref | None = None


def _tensors(*objs: Any) -> list[torch.Tensor]:
    """The tensors in an operation's arguments or results (tensors, lists, tuples, dicts)."""
    out: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple, dict)):
            out.extend(_tensors(*(obj.values() if isinstance(obj, dict) else obj)))
    return out


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of the tensor storages that operations create while it is active.

    A storage an operation returns that no operation saw before is new: its bytes (rounded
    up to ``block``) count until it is freed. Storages first seen as *inputs* existed before
    and count only what a resize adds. ``current`` and ``peak``: bytes above where
    :meth:`start` left them. With a ``fake_mode`` it also decides what runs for real;
    without one it counts a real run. With ``device_type``, only that device type counts."""

    def __init__(self, fake_mode: Any | None = None, block: int = 1,
                 device_type: str | None = None) -> None:
        super().__init__()
        self.fake_mode, self.block, self.device_type = fake_mode, block, device_type
        self.start()

    def start(self) -> None:
        """Count from zero: every storage alive now existed before."""
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current = self.peak = self.placeholders = 0
        # Distinct matrix multiplies since start(): spec -> (bytes, multiply-adds); segments[k]
        # the peak count from the k-th to the next (add_workspace).
        self.gemms: dict[tuple, tuple[int, int]] = {}
        self.segments = [0]

    def _free(self, known: WeakIdKeyDictionary, counted: _Counted) -> None:
        if known is self._known:  # counted before start(): not in today's count
            self.current -= counted.nbytes

    def _see(self, tensors: list[torch.Tensor], new: bool) -> None:
        for t in tensors:
            if self.device_type is not None and t.device.type != self.device_type:
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested: no one storage
                continue
            size = -(-st.nbytes() // self.block) * self.block  # rounded up to whole blocks
            counted = self._known.get(st)
            if counted is None:
                counted = _Counted(size if new else 0, size)
                known = self._known
                counted.ref = weakref.ref(st, lambda _r, k=known, c=counted: self._free(k, c))
                known[st] = counted
                self.current += counted.nbytes
            elif size != counted.seen:  # resized in place (resize_, out= variants)
                counted.nbytes += size - counted.seen
                self.current += size - counted.seen
                counted.seen = size
        self.peak = max(self.peak, self.current)
        self.segments[-1] = max(self.segments[-1], self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        self._see(inputs, new=False)
        out = func(*args, **kwargs) if self.fake_mode is None else self._run(func, args, kwargs,
                                                                             inputs)
        outputs = _tensors(out)
        self._see(outputs, new=True)
        if func.__name__ in GEMMS:  # the last input is mat2 (batch2): [..., K, N]
            key = (func.__name__, tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(
                a, torch.Tensor) else a for a in args), tuple(kwargs.items()))  # to replay it
            if key not in self.gemms:
                self.segments.append(self.current)
                self.gemms[key] = (sum(t.nbytes for t in inputs + outputs), outputs[0].numel()
                                   * inputs[-1].shape[-2] * (1 if outputs[0].dtype in (
                                       torch.float32, torch.float64) else SLOW_DTYPE))
        return out

    def _run(self, func: Any, args: Any, kwargs: Any, inputs: list[torch.Tensor]) -> Any:
        if any(isinstance(t, ft.FakeTensor) for t in inputs):
            try:
                return func(*args, **kwargs)
            except ft.DataDependentOutputException:
                self.placeholders += 1
                returns = func._schema.returns
                return True if returns and str(returns[0].type) == "bool" else 1
            except ft.DynamicOutputShapeException as exc:
                indices = _real_mask_indices(func, args)
                if indices is not None:  # x[mask] with a real mask: its size is known
                    return func(args[0], indices, *args[2:], **kwargs)
                raise UsageError(
                    f"cannot estimate this workload without running it: {func} makes a tensor "
                    "whose shape depends on values computed from the model; run a search "
                    "instead (it measures)") from exc
        key = _real_key(func, args, kwargs) if REAL_CACHE else None
        if key is None or key not in _RUNS_REAL:
            try:  # real inputs (or none): the outputs' sizes first, from a fake run
                fake = func(*args, **kwargs)
            except (ft.DataDependentOutputException, ft.DynamicOutputShapeException):
                fake = None  # nonzero, item: the output follows the (real, small) data
            if fake is not None and (not _small(fake) or any(
                    t.device.type == "meta" for t in _tensors(fake))):
                return fake  # too big to compute, or on meta (the host's part, uncounted)
            if key is not None:
                if len(_RUNS_REAL) >= REAL_CACHE_SIZE:
                    _RUNS_REAL.clear()
                _RUNS_REAL.add(key)
        with ft.unset_fake_temporarily():
            return func(*args, **kwargs)


def _real_key(func: Any, args: Any, kwargs: Any) -> tuple | None:
    """What decides whether an operation on real inputs only runs for real: the operation,
    its tensors' shapes, strides, offsets, dtypes and devices and its other arguments
    (typed); None where an argument has no such key."""
    def key(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or type(obj) is not torch.Tensor:
                raise TypeError
            return (obj.shape, obj.stride(), obj.storage_offset(), obj.dtype, obj.device)
        if isinstance(obj, (list, tuple)):
            return (type(obj), *map(key, obj))
        if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device,
                                           torch.memory_format, torch.layout)):
            return (type(obj), obj)
        raise TypeError
    try:
        return (func, key(args), tuple((k, key(v)) for k, v in kwargs.items()))
    except TypeError:
        return None


def _real_mask_indices(func: Any, args: Any) -> list[Any] | None:
    """For ``x[mask]`` on a fake ``x`` with *real* boolean masks: the indices with each mask
    replaced by the positions it selects, so the output's size is known; else None."""
    aten = torch.ops.aten
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return None
    out: list[Any] = []
    for idx in args[1]:
        if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
            if isinstance(idx, ft.FakeTensor):
                return None  # a mask computed from the model: its size is unknown
            with ft.unset_fake_temporarily():
                out.extend(idx.nonzero().unbind(1))
        else:
            out.append(idx)
    return out


def _small(out: Any) -> bool:
    """Whether an operation's (fake) outputs are small enough to compute for real."""
    room = 0
    for t in _tensors(out):
        cap = REAL_FLOAT_LIMIT if t.is_floating_point() or t.is_complex() else REAL_LIMIT
        room += t.untyped_storage().nbytes() - cap
        if room > 0:
            return False
    return True


def fake_device(device: str | torch.device) -> tuple[torch.device, list[str]]:
    """The device fake tensors can live on for an estimate for ``device`` (cpu or cuda),
    with a note where it is not ``device`` itself; UsageError for other devices."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise UsageError(f"estimates are for cpu or cuda (cuda:N), got {str(device)!r}; "
                         "give one of those")
    if dev.type == "cuda" and not torch.backends.cuda.is_built():
        return torch.device("cpu"), [
            f"estimated on cpu for {dev}: this torch build has no CUDA, which fake CUDA tensors "
            "need; tensor sizes and CUDA's 512-byte blocks are the same, but GPU kernels may "
            "save other tensors, and the allocator's cache and CUDA context are not counted"]
    return dev, []


def estimate(fn: Callable[[int], Any], sizes: Sequence[int], device: str | torch.device = "cpu",
             workspace: bool = True, shortcuts: bool = True) -> list[Estimate]:
    """Estimate the peak bytes of ``fn(size)`` for each of ``sizes`` on ``device`` (cpu,
    cuda, cuda:N) without running the work (fake tensors, no weights; labelled estimates):
    one :class:`Estimate` per size, in order, after one warm-up. ``workspace`` (cpu):
    measure the matrix multiplies' workspace on this host; ``shortcuts``: allow
    :func:`shortcut`. :class:`UsageError` for bad sizes or devices, or a workload whose
    memory depends on values only a real run computes."""
    from oomguard.engine.core.workload import own_estimate  # why: it imports this module
    sizes = list(sizes)
    if not sizes:
        raise UsageError("give at least one size to estimate")
    own = own_estimate(fn)
    if own is None:
        return EstimateSession(fn, device, workspace, shortcuts).at(sizes)  # checks sizes
    dev, notes = fake_device(device)
    out = []
    for size in sizes:
        check_positive_int("size", size)
        start = time.perf_counter()
        out.append(Estimate(size, int(own(size, str(dev))), f"{type(fn).__name__}.estimate_peak",
                            str(device), str(dev), list(notes), time.perf_counter() - start))
    return out


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector off while a workload runs on fake tensors: when a cycle's
    tensors are freed would depend on the process's history. Off, they live to the end of
    the size, as they can in a real run: the same estimate in any process, never lower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class EstimateSession:
    """:func:`estimate` with the warm-up paid once: ``EstimateSession(fn, device).at(sizes)``
    estimates sizes as a search asks for them, each above the state the warm-up and the
    sizes before it left. Holds the fake model (no memory) until dropped."""

    def __init__(self, fn: Callable[[int], Any], device: str | torch.device = "cpu",
                 workspace: bool = True, shortcuts: bool = True) -> None:
        from oomguard.engine.core.workload import estimate_copy  # why: as in estimate()
        self.fn, self.device, self.workspace = fn, str(device), workspace
        self.dev, self.notes = fake_device(device)
        self.cpu = torch.device(device).type == "cpu"
        self.counter = StorageCounter(ft.FakeTensorMode(allow_non_fake_inputs=True),
                                      1 if self.cpu else CUDA_BLOCK, self.dev.type)
        self.work = estimate_copy(fn, str(self.dev))
        self.shortcuts = shortcuts
        self.warm: dict[tuple, tuple[int, int]] | None = None  # the warm-up's multiplies

    def at(self, sizes: Sequence[int]) -> list[Estimate]:
        """One :class:`Estimate` per size, in order (the warm-up first, on the first call)."""
        from oomguard.engine.core.workload import warm_up, worst_case_call  # why: as above
        sizes = list(sizes)
        for size in sizes:
            check_positive_int("size", size)
        # On the data a trial measures: its worst case where the workload has one.
        call = worst_case_call(self.work)
        counter, out = self.counter, []
        runs: list[tuple[dict[tuple, tuple[int, int]], list[int]]] = []
        target = torch.device(self.device).type
        cut: set[str] = set()
        running = _RUNNING.set(_Running(target, "meta" if self.dev.type != target else "cpu",
                                        cut if self.shortcuts else None,
                                        self.cpu and self.workspace))
        try:
            with counter.fake_mode, counter, _no_cycle_collection():
                if self.warm is None:
                    warm_up(self.work)
                    self.warm = dict(counter.gemms)
                for size in sizes:
                    start = time.perf_counter()
                    counter.start()
                    call(size)
                    extra = [*self.notes, *sorted(cut)]
                    if counter.placeholders:
                        extra.append(f"{counter.placeholders} Python number(s) read from fake "
                                     "tensors had no value and read as 1")
                    out.append(Estimate(size, counter.peak, METHOD, self.device, str(self.dev),
                                        extra, time.perf_counter() - start))
                    runs.append((dict(counter.gemms), counter.segments))
        finally:
            _RUNNING.reset(running)
        for e, (run, segments) in zip(out, runs, strict=True):
            if self.cpu and self.workspace:
                add_workspace(e, self.fn, self.warm, run, segments)
            else:
                e.notes.append("matrix-multiply workspace not counted" + (
                    " (cuBLAS's)" if not self.cpu else " (workspace=False: not replayed)"))
        return out
