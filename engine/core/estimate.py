"""Estimate a workload's peak memory at given sizes without running the work.

``estimate(fn, [8, 32])`` runs ``fn`` under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`
(tensors with shape, dtype and device but no data or memory: a 7B model's training step is
estimated on a laptop for a GPU it does not have), and a dispatch mode counts the bytes of
every tensor storage the work creates and frees (MemTracker's bookkeeping). The estimate is
the highest count above what existed before the size ran: what a trial measures above the
warmed-up process (:func:`~oomguard.engine.core.trial.run_trial`). An operation on real
inputs only (token ids, masks) runs for real when its outputs are small (:data:`REAL_LIMIT`,
:data:`REAL_FLOAT_LIMIT`), so control flow follows the data; a Python number read from a
fake tensor (``float(loss)``) reads as 1, and the notes count them. A workload takes part
as ``fn.estimate_peak(size, device) -> int`` (its own estimate, bytes); as
``fn.for_estimate(device)``, a copy whose ``warmup()`` builds the model with
:func:`fake_module` (no weights) and whose ``copy(size)`` runs the work; or as it is.

Matrix-multiply workspace (CPU): the BLAS library packs a matrix multiply's operands into
buffers it allocates at its first call of a kind and keeps for the life of the process.
That is measured, not predicted: the distinct matrix multiplies the fake run recorded (the
warm-up's, then the size's) are replayed on zero tensors in an isolated child with this
process's threads, and the resident bytes each keeps count from its first call on
(``workspace_bytes``: what they add to the peak). That is a size's cost after the warm-up
alone (an isolated trial, a search's first; after a larger size in one process, it reads
high by up to that). Too big to replay cheaply (:data:`REPLAY_LIMIT`): not counted, noted.

Not counted: other operators' workspace, free heap a real run reuses (the other way), the
allocator's rounding beyond CUDA's 512-byte blocks and its cache, cuBLAS's workspace, the
device context. Measured error and sizes: docs/measurements.md#estimate-error.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch._subclasses import fake_tensor as ft  # imported by torch itself: free
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from oomguard.engine.errors import IsolationError, UsageError, check_positive_int

# Outputs of an operation on real inputs that are computed for real (see the module
# docstring); larger ones (a batch's 4-D attention mask) stay fake, counted all the same.
REAL_LIMIT = 16 * 1024**2
REAL_FLOAT_LIMIT = 64 * 1024
# CUDA's allocator rounds blocks up to 512 bytes (kMinBlockSize, CUDACachingAllocator.cpp)
CUDA_BLOCK = 512
LABEL = "estimate, not measured"
METHOD = "fake tensors (FakeTensorMode) + storage bytes counted at dispatch"
# Matrix multiplies whose workspace is measured (what matmul, linear and eager attention
# dispatch to), replayed only while none moves over REPLAY_LIMIT bytes and all take at most
# REPLAY_MACS float32 multiply-adds, a few seconds of CPU: the replay must stay cheap. Other
# than float32/64, each counts SLOW_DTYPE times: bfloat16 and float16 ran ~50 times slower
# on CPU (docs/measurements.md#estimate-error).
GEMMS = frozenset({"mm.default", "addmm.default", "bmm.default", "baddbmm.default"})
REPLAY_LIMIT, REPLAY_MACS, SLOW_DTYPE = 256 * 1024**2, 2**35, 64


@dataclass
class Estimate:
    """The estimated peak bytes of a workload at ``size``: the peak above what existed
    before that size ran (a trial's ``peak_bytes`` units), for ``device``, computed with fake
    tensors on ``estimated_on``. ``method`` says how; ``notes`` what it left out or assumed.
    An estimate (``kind``), but ``workspace_bytes`` (what the matrix multiplies' workspace adds
    to it; None: not counted) is measured on this host (module docstring)."""

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
        elif isinstance(obj, (list, tuple, dict)):
            out.extend(_tensors(*(obj.values() if isinstance(obj, dict) else obj)))
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
        # Each distinct matrix multiply since start(), in order: spec -> (bytes, multiply-adds);
        # segments[k]: the peak count from the k-th of them to the next (see _add_workspace).
        self.gemms: dict[tuple, tuple[int, int]] = {}
        self.segments = [0]

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
                    "whose shape depends on values computed from the model") from exc
        try:  # real inputs (or none): the outputs' sizes first, from a fake run
            fake = func(*args, **kwargs)
        except (ft.DataDependentOutputException, ft.DynamicOutputShapeException):
            fake = None  # nonzero, item: the output follows the (real, small) data
        if fake is not None and not _small(fake):
            return fake
        with ft.unset_fake_temporarily():
            return func(*args, **kwargs)


def _real_mask_indices(func: Any, args: Any) -> list[Any] | None:
    """For ``x[mask]`` (``index``, ``index_put``) on a fake ``x`` with *real* boolean masks:
    the indices with each mask replaced by the positions it selects (what ATen does
    itself), so the output's size is known; None for any other operation."""
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


def fake_module(build: Callable[[], torch.nn.Module],
                device: str | torch.device) -> torch.nn.Module:
    """``build()`` on the ``meta`` device (no memory, no initialisation work), then every
    parameter and buffer replaced by a fake tensor on ``device``: the model with no
    weights, for a workload's ``warmup`` under :func:`estimate`. Tied weights stay tied
    (one fake tensor per meta tensor). Runs only inside :func:`estimate`."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes() as modes:
        fake = next((m for m in modes if isinstance(m, ft.FakeTensorMode)), None)
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
            f"estimated on cpu for {dev}: this torch build has no CUDA, which fake CUDA tensors "
            "need; tensor sizes and CUDA's 512-byte blocks are the same, but GPU kernels may "
            "save other tensors, and the allocator's cache and CUDA context are not counted"]
    return dev, []


def _add_workspace(e: Estimate, fn: Any, warm: dict[tuple, tuple[int, int]],
                   run: dict[tuple, tuple[int, int]], segments: list[int]) -> None:
    """Raise ``e`` by the workspace ``run``'s matrix multiplies keep on this host after
    ``warm``'s, measured in an isolated child, or note why not. Each one's buffers exist from
    its first call on: the peak is the highest ``segments[k]`` plus the first k's."""
    from oomguard.engine.core.isolate import IsolatedRunner

    start, calls = time.perf_counter(), [*run.values(), *warm.values()]
    why, threads = None, torch.get_num_threads()
    if not run.keys() - warm.keys():
        e.workspace_bytes = 0  # none, or each ran in the warm-up: its buffers exist already
    elif max(b for b, _ in calls) > REPLAY_LIMIT or sum(m for _, m in calls) > REPLAY_MACS:
        why = f"too big to replay ({sum(m for _, m in calls):.2g} float32 multiply-adds)"
    else:
        try:
            trial = IsolatedRunner(WorkspaceReplay(list(warm), list(run), threads, tuple(
                getattr(fn, "preload", ()))), "cpu", timeout=600)(1)
            why = None if trial.ok else "OOM"
        except (IsolationError, RuntimeError) as exc:
            why = str(exc).splitlines()[0]
        if why is None:
            kept = [0, *itertools.accumulate(trial.value)]
            peak = max(seg + kept[k] for k, seg in enumerate(segments))
            e.workspace_bytes, e.peak_bytes = peak - e.peak_bytes, peak
            e.method += f" + matrix-multiply workspace replayed in a fresh process ({threads} threads)"
    if why is not None:
        e.notes.append(f"matrix-multiply workspace not counted: {why}")
    e.seconds += time.perf_counter() - start


def estimate(fn: Callable[[int], Any], sizes: Sequence[int], device: str | torch.device = "cpu",
             workspace: bool = True) -> list[Estimate]:
    """Estimate the peak bytes of ``fn(size)`` for each of ``sizes`` on ``device`` (cpu,
    cuda, cuda:N) without running the work (module docstring): per size, an
    :class:`Estimate` of the peak above what existed before it ran, in bytes; sizes run in
    order after one warm-up (``fn.warmup()``) on fake tensors. For cpu with ``workspace``,
    the matrix multiplies' workspace is measured on this host and included.

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
            out.append(Estimate(size, int(own(size, str(dev))), f"{type(fn).__name__}.estimate_peak",
                                str(device), str(dev), list(notes), time.perf_counter() - start))
        return out
    cpu = torch.device(device).type == "cpu"
    counter = StorageCounter(block=1 if cpu else CUDA_BLOCK)
    work = fn.for_estimate(str(dev)) if callable(getattr(fn, "for_estimate", None)) else fn
    runs: list[tuple[dict[tuple, tuple[int, int]], list[int]]] = []
    counter.fake_mode = ft.FakeTensorMode(allow_non_fake_inputs=True)
    with counter.fake_mode, counter:
        warmup = getattr(work, "warmup", None)
        if callable(warmup):
            warmup()
        warm = dict(counter.gemms)
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
            runs.append((dict(counter.gemms), counter.segments))
    for e, (run, segments) in zip(out, runs, strict=True):
        if cpu and workspace:
            _add_workspace(e, fn, warm, run, segments)
        else:
            e.notes.append("matrix-multiply workspace not counted" + (
                " (cuBLAS's)" if not cpu else " (workspace=False: not replayed)"))
    return out
