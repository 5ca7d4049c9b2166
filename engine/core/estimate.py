"""Estimate a workload's peak memory at given sizes without running the work.

``estimate(fn, [8, 32])`` runs ``fn`` under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`:
every tensor that would hold weights, activations, gradients or optimizer state is
a fake one (shape, dtype and device, no data, no memory), so a 7B model's step can be
estimated on a laptop for a GPU it does not have. A dispatch mode on top counts the
bytes of every tensor storage the work creates and frees (the same bookkeeping as
``torch.distributed._tools.mem_tracker.MemTracker``: a weak reference per storage),
and the estimate is the highest count: the peak *above what existed before the size's
run*, the quantity a search trial measures above the warmed-up process
(:func:`~oomguard.engine.core.trial.run_trial`). It is an estimate, never a measurement:
every :class:`Estimate` says so, with its method.

Data bookkeeping follows the real data: an operation whose inputs are all real tensors
(token ids, masks, labels, positions) and whose outputs are small (at most
:data:`REAL_LIMIT` bytes) runs for real, so control flow that depends on the data (which
samples are scored, how many tokens) takes the path the real run takes. A Python number
read from a fake tensor (``float(loss)``, ``bool(x.isfinite().all())``) has no value:
it reads as 1 (``True``), and the work goes on along that path.

A workload takes part in one of three ways:

- ``fn.estimate_peak(size, device) -> int``: its own estimate, used as it is;
- ``fn.for_estimate(device)``: a fresh copy of itself (nothing built) to set up under the
  fake mode; its ``warmup()`` then builds the model and the optimizer state as fake
  tensors, and ``copy(size)`` runs the step;
- anything else: ``fn.warmup()`` (if any) and ``fn(size)`` run under the fake mode as
  they are; tensors ``fn`` holds already (a real model in a closure) are not counted,
  as a trial does not count them either.

Not counted, on any device: memory an operator uses inside its kernel and frees before
it returns (workspaces), the allocator's rounding and caching beyond CUDA's 512-byte
blocks, and the device context (CUDA context, cuBLAS workspace, thread stacks).
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
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from oomguard.engine.errors import UsageError, check_positive_int

# An operation on real inputs runs for real when its outputs are integer or boolean (the
# data's bookkeeping: ids, masks, labels, positions, counts) of at most REAL_LIMIT bytes,
# or floating point of at most REAL_FLOAT_LIMIT bytes; larger ones (a batch's 4-D
# attention mask) stay fake, and are counted all the same.
REAL_LIMIT = 16 * 1024**2
REAL_FLOAT_LIMIT = 64 * 1024
# CUDA's caching allocator rounds every block up to 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize), as MemTracker does.
CUDA_BLOCK = 512
LABEL = "estimate, not measured"


@dataclass
class Estimate:
    """The estimated peak bytes of a workload at ``size`` on ``device``: the peak above
    what existed before the size's run (the units of a trial's measured ``peak_bytes``).
    ``method`` says how it was estimated; ``notes`` what it leaves out or changed
    (e.g. a CUDA estimate made on ``cpu``). An estimate, never a measurement."""

    size: int
    peak_bytes: int
    method: str
    device: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kind: str = LABEL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Counted:
    """The bytes counted for one storage (changes when the storage is resized)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of the tensor storages operations create while it is active.

    A storage an operation returns that no operation saw before is new: its bytes
    (rounded up to ``block`` bytes) are counted until it is freed (a weak reference's
    callback). Storages first seen as *inputs* existed before (weights, optimizer
    state) and count nothing, also when an operation writes into them. ``current`` and
    ``peak`` are bytes above where :meth:`start` left them.

    Inside a :class:`~torch._subclasses.fake_tensor.FakeTensorMode`, it also decides
    what runs for real (see the module docstring): ``fake_mode`` is that mode.
    """

    def __init__(self, fake_mode: Any | None = None, block: int = 1) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.block = block
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list[weakref.ref] = []
        self.current = 0
        self.peak = 0
        self.placeholders = 0

    def start(self) -> None:
        """Count from zero: everything alive now is what existed before."""
        self._known = WeakIdKeyDictionary()
        self._refs = []
        self.current = self.peak = self.placeholders = 0

    # -- counting ---------------------------------------------------------------------
    def _bytes(self, st: torch.UntypedStorage) -> int:
        n = st.nbytes()
        return n if self.block <= 1 else math.ceil(n / self.block) * self.block

    def _free(self, known: WeakIdKeyDictionary, counted: _Counted, _ref: weakref.ref) -> None:
        if known is self._known:  # a storage counted before start() is not ours to free
            self.current -= counted.nbytes

    def _see(self, tensors: list[torch.Tensor], new: bool) -> None:
        for t in tensors:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested: no one storage
                continue
            counted = self._known.get(st)
            if counted is None:
                counted = _Counted(self._bytes(st) if new else 0)
                self._known[st] = counted
                self._refs.append(weakref.ref(st, lambda r, k=self._known, c=counted:
                                              self._free(k, c, r)))
                self.current += counted.nbytes
            elif counted.nbytes and self._bytes(st) != counted.nbytes:  # resized in place
                self.current += self._bytes(st) - counted.nbytes
                counted.nbytes = self._bytes(st)
        self.peak = max(self.peak, self.current)

    # -- dispatch ---------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self._see(inputs, new=False)
        out = self._run(func, args, kwargs, inputs)
        self._see([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)], new=True)
        return out

    def _run(self, func: Any, args: Any, kwargs: Any, inputs: list[torch.Tensor]) -> Any:
        if self.fake_mode is None:
            return func(*args, **kwargs)
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
                return self._placeholder(func)
            except DynamicOutputShapeException as exc:
                raise UsageError(
                    f"cannot estimate without running: {func} has an output whose shape "
                    "depends on values computed from the model") from exc
        try:  # real (or no) inputs: the outputs' sizes first, from a fake run
            fake = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            fake = None  # e.g. nonzero, item: sizes follow the (real, small) data
        if fake is not None and not _small(fake):
            return fake
        with unset_fake_temporarily():
            return func(*args, **kwargs)

    def _placeholder(self, func: Any) -> Any:
        """The value a Python number read from a fake tensor takes: 1 (True for a bool)."""
        self.placeholders += 1
        kind = str(func._schema.returns[0].type) if func._schema.returns else ""
        return True if kind == "bool" else 1


def _small(out: Any) -> bool:
    """Whether fake outputs are small enough to compute for real (:data:`REAL_LIMIT`)."""
    limit = 0
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            cap = REAL_FLOAT_LIMIT if t.is_floating_point() or t.is_complex() else REAL_LIMIT
            limit += t.untyped_storage().nbytes() - cap
            if limit > 0:
                return False
    return True


def fake_module(build: Callable[[], torch.nn.Module],
                device: str | torch.device) -> torch.nn.Module:
    """``build()`` on the ``meta`` device (no memory, no initialisation work), then every
    parameter and buffer replaced by a fake tensor on ``device``: a model with no weights,
    for a workload's ``warmup`` under :func:`estimate`. Tied weights stay tied.

    Must run inside :func:`estimate` (it needs the active fake mode)."""
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
                        if t is None:
                            continue
                        if id(t) not in memo:
                            new = torch.empty_like(t, device=device)
                            if isinstance(t, torch.nn.Parameter):
                                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                            memo[id(t)] = new
                        table[name] = memo[id(t)]
    return module


def _resolve_device(device: str | torch.device) -> tuple[torch.device, list[str]]:
    """The device fake tensors can live on, and a note where it is not the one asked for."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"estimates are for cpu or cuda, got {str(device)!r}")
    if dev.type == "cuda" and not torch.backends.cuda.is_built():
        return torch.device("cpu"), [
            f"estimated on cpu for {dev}: this torch build has no CUDA, and fake CUDA tensors "
            "need one; tensor sizes are the same, CUDA's 512-byte block rounding is applied, "
            "but kernels may save different tensors on a GPU"]
    return dev, []


@contextlib.contextmanager
def _fake(counter: StorageCounter) -> Iterator[Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    counter.fake_mode = mode
    with mode, counter:
        yield mode


def estimate(fn: Callable[[int], Any], sizes: Sequence[int],
             device: str | torch.device = "cpu") -> list[Estimate]:
    """Estimate the peak bytes of ``fn(size)`` for each of ``sizes`` on ``device`` (cpu or
    cuda), without running the work (see the module docstring for how a workload takes
    part). Each :class:`Estimate` is the peak above what existed before that size's run,
    in bytes, labelled an estimate; sizes run in the order given, after one warm-up.

    Raises :class:`UsageError` for a size that is not a positive integer, a device
    other than cpu or cuda, or a workload whose memory depends on values only a real
    run computes (an output shape read from the model's outputs).
    """
    sizes = list(sizes)
    if not sizes:
        raise UsageError("give at least one size to estimate")
    for size in sizes:
        check_positive_int("size", size)
    dev, notes = _resolve_device(device)
    own = getattr(fn, "estimate_peak", None)
    if callable(own):
        method = f"{type(fn).__name__}.estimate_peak"
        out = []
        for size in sizes:
            start = time.perf_counter()
            out.append(Estimate(size, int(own(size, str(dev))), method, str(device), list(notes),
                                time.perf_counter() - start))
        return out
    block = CUDA_BLOCK if torch.device(device).type == "cuda" else 1
    counter = StorageCounter(block=block)
    method = ("FakeTensorMode (no data, no memory) + storage byte counter at dispatch; "
              "peak above the state before each size")
    out = []
    work = fn.for_estimate(str(dev)) if callable(getattr(fn, "for_estimate", None)) else fn
    with _fake(counter):
        warmup = getattr(work, "warmup", None)
        if callable(warmup):
            warmup()
        for size in sizes:
            start = time.perf_counter()
            counter.start()
            work(size)
            extra = list(notes)
            if counter.placeholders:
                extra.append(f"{counter.placeholders} number(s) read from estimated tensors "
                             "had no value and read as 1")
            out.append(Estimate(size, counter.peak, method, str(device), extra,
                                time.perf_counter() - start))
    return out
