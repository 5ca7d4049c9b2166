"""Estimate a workload's peak memory at given sizes without running the work.

``estimate(fn, [8, 32])`` runs ``fn`` under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`:
every tensor that would hold weights, activations, gradients or optimizer state is a
fake one (shape, dtype and device, no data, no memory), so a 7B model's training step
can be estimated on a laptop for a GPU it does not have. A dispatch mode on top counts
the bytes of every tensor storage the work creates and frees (the bookkeeping of
``torch.distributed._tools.mem_tracker.MemTracker``: a weak reference per storage,
which, unlike MemTracker, also counts the real tensors described below), and the
estimate is the highest count: the peak *above what existed before the size ran*, the
quantity a search trial measures above the warmed-up process
(:func:`~oomguard.engine.core.trial.run_trial`). It is an estimate, never a measurement:
every :class:`Estimate` says so, with its method.

The data's bookkeeping follows the real data: an operation whose inputs are all real
tensors (token ids, masks, labels, positions) runs for real when its outputs are small
(integer or boolean up to :data:`REAL_LIMIT`, floating point up to
:data:`REAL_FLOAT_LIMIT` bytes), so control flow that depends on the data (which samples
are scored, how many tokens) takes the path a real run takes; larger outputs stay fake.
A Python number read from a fake tensor (``float(loss)``) has no value: it reads as 1
(``True``), the work goes on along that path, and the estimate's notes count them.

A workload takes part in one of three ways:

- ``fn.estimate_peak(size, device) -> int``: its own estimate (bytes), used as it is;
- ``fn.for_estimate(device)``: a fresh copy of itself with nothing built, whose
  ``warmup()`` (run under the fake mode) builds its model with :func:`fake_module` (no
  weights) and runs its warm-up step on fake tensors; ``copy(size)`` runs the work;
- anything else: ``fn.warmup()`` (if any) and ``fn(size)`` run under the fake mode as
  they are; tensors ``fn`` already holds (a real model in a closure) are not counted,
  as a trial does not count them either.

Not counted, on any device: memory an operator takes besides the tensors it returns
(measured on CPU: ~0.8 MiB at the first matrix multiply of each new shape, ~2.5 MiB in
all for the tiny GPT-2, so metrics with peaks under ~50 MiB read up to 10% low), free heap left
by the warm-up that a real run reuses without growing (the other way), the allocator's
rounding beyond CUDA's 512-byte blocks, its cached or fragmented segments, and the
device context (CUDA context, cuBLAS workspace, thread stacks). On CPU, the tiny GPT-2's
training step came within 0.5% of the measured peaks (bench/bench_estimate.py).
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from oomguard.engine.errors import UsageError, check_positive_int

# Outputs of an operation on real inputs that are computed for real (see the module
# docstring); larger ones (a batch's 4-D attention mask) stay fake, counted all the same.
REAL_LIMIT = 16 * 1024**2
REAL_FLOAT_LIMIT = 64 * 1024
# CUDA's caching allocator rounds every block up to 512 bytes (kMinBlockSize in
# c10/cuda/CUDACachingAllocator.cpp), as MemTracker counts.
CUDA_BLOCK = 512
LABEL = "estimate, not measured"
METHOD = "fake tensors (FakeTensorMode) + storage bytes counted at dispatch"


@dataclass
class Estimate:
    """The estimated peak bytes of a workload at ``size``: the peak above what existed
    before that size ran (the units of a trial's measured ``peak_bytes``), for ``device``,
    computed with fake tensors on ``estimated_on``. ``method`` says how; ``notes`` what
    it left out or assumed. An estimate, never a measurement (``kind``)."""

    size: int
    peak_bytes: int
    method: str
    device: str
    estimated_on: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kind: str = LABEL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Counted:
    """What one storage counts: ``nbytes`` above where it started, ``seen`` its size last seen."""

    __slots__ = ("nbytes", "ref", "seen")

    def __init__(self, nbytes: int, seen: int) -> None:
        self.nbytes, self.seen = nbytes, seen
        self.ref: weakref.ref | None = None


def _tensors(*objs: Any) -> list[torch.Tensor]:
    """The tensors in an operation's arguments or results (tensors, lists, tuples, dicts)."""
    out: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            out.extend(_tensors(*obj))
        elif isinstance(obj, dict):
            out.extend(_tensors(*obj.values()))
    return out


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of the tensor storages that operations create while it is active.

    A storage an operation returns that no operation saw before is new: its bytes
    (rounded up to ``block``) count until it is freed (a weak reference's callback).
    Storages first seen as *inputs* existed before (weights, optimizer state) and count
    nothing, also when an operation writes into them, except by what a resize adds.
    ``current`` and ``peak`` are bytes above where :meth:`start` left them.

    With a ``fake_mode`` (inside it), it also decides what runs for real (module docstring);
    without one it counts a real run (a check of the fake one).
    """

    def __init__(self, fake_mode: Any | None = None, block: int = 1) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.block = block
        self.start()

    def start(self) -> None:
        """Count from zero: every storage alive now existed before."""
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current = self.peak = self.placeholders = 0

    # -- counting ---------------------------------------------------------------------
    def _bytes(self, st: torch.UntypedStorage) -> int:
        n = st.nbytes()
        return n if self.block <= 1 else math.ceil(n / self.block) * self.block

    def _free(self, known: WeakIdKeyDictionary, counted: _Counted) -> None:
        if known is self._known:  # counted before start(): not in today's count
            self.current -= counted.nbytes

    def _see(self, tensors: list[torch.Tensor], new: bool) -> None:
        for t in tensors:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested: no one storage
                continue
            size = self._bytes(st)
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

    # -- dispatch ---------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        self._see(inputs, new=False)
        out = func(*args, **kwargs) if self.fake_mode is None else self._run(func, args, kwargs,
                                                                             inputs)
        self._see(_tensors(out), new=True)
        return out

    def _run(self, func: Any, args: Any, kwargs: Any, inputs: list[torch.Tensor]) -> Any:
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
            FakeTensor,
            unset_fake_temporarily,
        )

        if any(isinstance(t, FakeTensor) for t in inputs):
            try:
                return func(*args, **kwargs)
            except DataDependentOutputException:
                self.placeholders += 1
                returns = func._schema.returns
                return True if returns and str(returns[0].type) == "bool" else 1
            except DynamicOutputShapeException as exc:
                indices = _real_mask_indices(func, args)
                if indices is not None:  # x[mask] with a real mask: its size is known
                    return func(args[0], indices, *args[2:], **kwargs)
                raise UsageError(
                    f"cannot estimate this workload without running it: {func} makes a tensor "
                    "whose shape depends on values computed from the model") from exc
        try:  # real inputs (or none): the outputs' sizes first, from a fake run
            fake = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            fake = None  # nonzero, item: the output follows the (real, small) data
        if fake is not None and not _small(fake):
            return fake
        with unset_fake_temporarily():
            return func(*args, **kwargs)


def _real_mask_indices(func: Any, args: Any) -> list[Any] | None:
    """For ``x[mask]`` (``index``, ``index_put``) on a fake ``x`` with *real* boolean masks:
    the indices with each mask replaced by the positions it selects (what ATen does
    itself), so the output's size is known; None for any other operation."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    aten = torch.ops.aten
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return None
    out: list[Any] = []
    for idx in args[1]:
        if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
            if isinstance(idx, FakeTensor):
                return None  # a mask computed from the model: its size is unknown
            with unset_fake_temporarily():
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


def fake_module(build: Callable[[], torch.nn.Module],
                device: str | torch.device) -> torch.nn.Module:
    """``build()`` on the ``meta`` device (no memory, no initialisation work), then every
    parameter and buffer replaced by a fake tensor on ``device``: the model with no
    weights, for a workload's ``warmup`` under :func:`estimate`. Tied weights stay tied
    (one fake tensor per meta tensor). Runs only inside :func:`estimate`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes() as modes:
        fake = next((m for m in modes if isinstance(m, FakeTensorMode)), None)
        if fake is None:
            raise RuntimeError("fake_module() runs only inside oomguard's estimate()")
        with torch.device("meta"):
            module = build()
        memo: dict[int, torch.Tensor] = {}
        with fake:
            for mod in module.modules():
                for table in (mod._parameters, mod._buffers):
                    for name, t in table.items():
                        if t is not None and id(t) not in memo:
                            new = torch.empty_like(t, device=device)
                            if isinstance(t, torch.nn.Parameter):
                                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                            memo[id(t)] = new
                        if t is not None:
                            table[name] = memo[id(t)]
    return module


def fake_device(device: str | torch.device) -> tuple[torch.device, list[str]]:
    """The device fake tensors can live on for an estimate for ``device`` (cpu or cuda),
    with a note where it is not ``device`` itself; UsageError for other devices."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise UsageError(f"estimates are for cpu or cuda (cuda:N), got {str(device)!r}")
    if dev.type == "cuda" and not torch.backends.cuda.is_built():
        return torch.device("cpu"), [
            f"estimated on cpu for {dev}: this torch build has no CUDA, and fake CUDA tensors "
            "need one; tensor sizes are the same and CUDA's 512-byte blocks are counted, but "
            "GPU kernels may save other tensors, and the allocator's cache and the CUDA "
            "context are not counted"]
    return dev, []


@contextlib.contextmanager
def _fake_mode(counter: StorageCounter) -> Iterator[None]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with counter.fake_mode, counter:
        yield


def estimate(fn: Callable[[int], Any], sizes: Sequence[int],
             device: str | torch.device = "cpu") -> list[Estimate]:
    """Estimate the peak bytes of ``fn(size)`` for each of ``sizes`` on ``device`` (cpu,
    cuda, cuda:N), without running the work (the module docstring says how a workload
    takes part). Each :class:`Estimate` is the peak above what existed before that size
    ran, in bytes, labelled an estimate with its method; sizes run in the order given,
    after one warm-up (``fn.warmup()``) on fake tensors.

    Raises :class:`UsageError` for no sizes, a size that is not a positive integer, a
    device other than cpu or cuda, or a workload whose memory depends on values only a
    real run computes (a tensor whose shape depends on the model's outputs).
    """
    sizes = list(sizes)
    if not sizes:
        raise UsageError("give at least one size to estimate")
    for size in sizes:
        check_positive_int("size", size)
    dev, notes = fake_device(device)
    own = getattr(fn, "estimate_peak", None)
    out = []
    if callable(own):
        for size in sizes:
            start = time.perf_counter()
            peak = int(own(size, str(dev)))
            out.append(Estimate(size, peak, f"{type(fn).__name__}.estimate_peak", str(device),
                                str(dev), list(notes), time.perf_counter() - start))
        return out
    counter = StorageCounter(block=CUDA_BLOCK if torch.device(device).type == "cuda" else 1)
    work = fn.for_estimate(str(dev)) if callable(getattr(fn, "for_estimate", None)) else fn
    with _fake_mode(counter):
        warmup = getattr(work, "warmup", None)
        if callable(warmup):
            warmup()
        for size in sizes:
            start = time.perf_counter()
            counter.start()
            work(size)
            extra = list(notes)
            if counter.placeholders:
                extra.append(f"{counter.placeholders} Python number(s) read from fake tensors "
                             "had no value and read as 1")
            out.append(Estimate(size, counter.peak, METHOD, str(device), str(dev), extra,
                                time.perf_counter() - start))
    return out
