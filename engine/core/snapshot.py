"""A host copy of a training script's state, put back exactly: :class:`Snapshot`.

``search(step, restore=(model, optimizer))`` takes a :class:`Snapshot` before its first
trial and restores it after every trial and at the end, so each trial starts from the
user's state and the search leaves nothing behind.

What is copied, to the host (so a snapshot costs a GPU trial no device memory):

- every parameter and buffer of each module (written back in place into the module's own
  tensors, so optimizers, hooks and tied weights keep pointing at them), and each ``.grad``;
- each optimizer's ``state`` (an entry absent at :meth:`Snapshot.take` is absent again after
  :meth:`Snapshot.restore`) and its ``param_groups``;
- with ``rng``: torch's CPU and initialised CUDA generators, ``random``'s and numpy's.

:attr:`Snapshot.nbytes`: the host bytes held, counted exactly from the copies (parameters +
buffers + gradients + optimizer state + about 12 KiB of RNG state).

Not covered: LR schedulers, a ``GradScaler``'s scale, a data loader's position.

:class:`BufferCopy` is the cheap part a retry of a single step needs: the modules' buffers
only (BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``, which a
forward pass updates in place), cloned on their own device (no device-to-host copy, no
synchronisation), no parameters, gradients or optimizer state. Its :attr:`BufferCopy.nbytes`
is the buffers' size: 38 KiB for resnet18's 20 BatchNorm layers, 0 for GPT-2 in
transformers 5 (docs/measurements.md#buffer-copy).
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard.engine.errors import UsageError

Restorable = torch.nn.Module | torch.optim.Optimizer


def check_restorable(objects: Any) -> tuple[Restorable, ...]:
    """``objects`` (one, a sequence or None) as a tuple of modules and optimizers; a one-line
    :class:`UsageError` for anything else, and for an optimizer whose parameters are not
    those of the modules given."""
    if objects is None:
        return ()
    if isinstance(objects, (torch.nn.Module, torch.optim.Optimizer)):
        objects = (objects,)
    if isinstance(objects, (str, bytes)) or not isinstance(objects, Sequence):
        raise UsageError(f"restore= takes a tuple of torch.nn.Module and torch.optim.Optimizer "
                         f"objects, e.g. restore=(model, optimizer); got {_described(objects)}; "
                         "pass those")
    for obj in objects:
        if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            raise UsageError(f"restore= takes torch.nn.Module and torch.optim.Optimizer objects, "
                             f"e.g. restore=(model, optimizer); got {_described(obj)}; "
                             "pass only those")
    modules = [o for o in objects if isinstance(o, torch.nn.Module)]
    if modules:
        owned = {id(p) for m in modules for p in m.parameters()}
        for opt in (o for o in objects if isinstance(o, torch.optim.Optimizer)):
            params = [p for g in opt.param_groups for p in g["params"]]
            foreign = sum(id(p) not in owned for p in params)
            if foreign:
                raise UsageError(
                    f"restore=: {foreign} of the {len(params)} parameters that "
                    f"{type(opt).__name__} updates are not parameters of the module(s) given "
                    f"({', '.join(type(m).__name__ for m in modules)}): pass the model that "
                    f"optimizer steps, e.g. restore=(model, optimizer)")
    return tuple(objects)


def _described(obj: Any) -> str:
    text = repr(obj)
    return f"{type(obj).__name__} ({text[:60]}{'...' if len(text) > 60 else ''})"


def _host_copy(value: Any) -> Any:
    """A CPU copy of a tensor (its own storage), a deep copy of anything else."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def _tensor_bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _put_back(current: Any, saved: Any, device: torch.device | None) -> Any:
    """The value to hold after restore: ``current`` overwritten in place where it is a
    tensor of the same kind, else a new copy of ``saved`` on ``device``."""
    if not isinstance(saved, torch.Tensor):
        return copy.deepcopy(saved)
    if (isinstance(current, torch.Tensor) and current.shape == saved.shape
            and current.dtype == saved.dtype and current.device == device):
        with torch.no_grad():
            current.copy_(saved)
        return current
    return saved.to(device, copy=True)


@dataclass
class _Saved:
    """Values as at take: host copies, and the device each tensor was on."""

    values: dict[str, Any]
    devices: dict[str, torch.device | None]

    @classmethod
    def of(cls, entries: dict[str, Any], skip: str = "") -> _Saved:
        return cls({k: _host_copy(v) for k, v in entries.items() if k != skip},
                   {k: v.device if isinstance(v, torch.Tensor) else None
                    for k, v in entries.items() if k != skip})

    @property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(v) for v in self.values.values())

    def put_back(self, now: dict[str, Any]) -> dict[str, Any]:
        return {k: _put_back(now.get(k), v, self.devices[k]) for k, v in self.values.items()}


@dataclass
class _TensorSlot:
    """One entry of a module's ``_parameters`` or ``_buffers``: the object, its values and
    its gradient, each as at take (``data`` None: a tied tensor another slot restores)."""

    table: dict[str, Any]
    name: str
    tensor: torch.Tensor | None
    data: torch.Tensor | None = None
    grad: _Saved | None = None

    def restore(self) -> None:
        self.table[self.name] = self.tensor  # a module that swapped it gets its own back
        if self.tensor is None or self.data is None:
            return
        with torch.no_grad():
            self.tensor.copy_(self.data)
        if self.grad is None:
            if self.tensor.grad is not None:
                self.tensor.grad = None
        else:
            self.tensor.grad = self.grad.put_back({"grad": self.tensor.grad})["grad"]


def _slots(table: dict[str, Any], tables: set[int], tensors: set[int],
           copy_of: Callable[[torch.Tensor], torch.Tensor]) -> list[_TensorSlot]:
    """The slots of one ``_parameters`` or ``_buffers`` table, each tensor's values copied by
    ``copy_of``; none for a table already in ``tables`` (a shared submodule is copied once),
    no copy for a tensor already in ``tensors`` (tied: another slot restores it)."""
    if id(table) in tables:
        return []
    tables.add(id(table))
    slots = []
    for name, tensor in table.items():
        slot = _TensorSlot(table, name, tensor)
        if tensor is not None and id(tensor) not in tensors:
            tensors.add(id(tensor))
            slot.data = copy_of(tensor)
        slots.append(slot)
    return slots


def _device_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()


@dataclass(repr=False)
class BufferCopy:
    """The buffers of modules as at :meth:`take`, cloned on their device; :meth:`restore` puts
    them back in place (a buffer a module replaced gets its own object back). ``nbytes``:
    the bytes the clones hold on the buffers' devices (the buffers' exact size)."""

    slots: list[_TensorSlot] = field(default_factory=list)
    nbytes: int = 0

    @classmethod
    def take(cls, modules: Iterable[torch.nn.Module]) -> BufferCopy:
        """Clone every buffer of ``modules`` and their submodules (each once). A plain walk
        over ``_modules``: cheaper than ``modules()`` (docs/measurements.md#buffer-copy)."""
        copy_ = cls()
        tables: set[int] = set()
        tensors: set[int] = set()
        stack: list[torch.nn.Module | None] = list(modules)
        while stack:
            module = stack.pop()
            if module is None:
                continue
            if module._buffers:
                for slot in _slots(module._buffers, tables, tensors, _device_copy):
                    copy_.nbytes += _tensor_bytes(slot.data)
                    copy_.slots.append(slot)
            stack.extend(module._modules.values())
        return copy_

    def __repr__(self) -> str:
        return f"BufferCopy({len(self.slots)} buffers, nbytes={self.nbytes})"

    def restore(self) -> None:
        """Put every buffer back as it was at :meth:`take`; repeatable."""
        for slot in self.slots:
            slot.restore()


@dataclass
class _OptimizerCopy:
    """An optimizer's ``state`` (per parameter) and ``param_groups`` as at take."""

    optimizer: torch.optim.Optimizer
    state: list[tuple[torch.Tensor, _Saved]]
    groups: list[tuple[dict[str, Any], _Saved]]  # the group object, its values but params
    group_list: list[dict[str, Any]]

    @classmethod
    def take(cls, opt: torch.optim.Optimizer) -> _OptimizerCopy:
        state = [(param, _Saved.of(entry)) for param, entry in opt.state.items()]
        groups = [(g, _Saved.of(g, skip="params")) for g in opt.param_groups]
        return cls(opt, state, groups, list(opt.param_groups))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for _, s in self.state) + sum(s.nbytes for _, s in self.groups)

    def restore(self) -> None:
        opt = self.optimizer
        kept = {id(p): s for p, s in opt.state.items()}
        # Drop what the trials created first, so its memory returns before any write.
        opt.state.clear()
        for param, saved in self.state:
            opt.state[param] = saved.put_back(kept.get(id(param), {}))
        del kept
        opt.param_groups[:] = self.group_list  # a group added by add_param_group goes
        for group, saved in self.groups:
            params = group["params"]
            values = saved.put_back(group)
            group.clear()
            group.update(values)
            group["params"] = params


@dataclass
class _RngStates:
    """The generators' states at take: torch CPU, CUDA per device, ``random``, numpy."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    python: Any
    numpy: Any

    @classmethod
    def take(cls) -> _RngStates:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        np = sys.modules.get("numpy")
        return cls(torch.get_rng_state(), cuda, random.getstate(),
                   np.random.get_state() if np is not None else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)

    @property
    def nbytes(self) -> int:
        python = sys.getsizeof(self.python[1]) if self.python else 0
        numpy = getattr(self.numpy[1], "nbytes", 0) if self.numpy is not None else 0
        cuda = sum(_tensor_bytes(t) for t in self.cuda or ())
        return _tensor_bytes(self.cpu) + cuda + python + numpy


@dataclass(repr=False)
class Snapshot:
    """Modules' and optimizers' state (and the RNG states) copied to the host, put back
    exactly by :meth:`restore`. :attr:`nbytes`: host bytes the copies hold."""

    slots: list[_TensorSlot] = field(default_factory=list)
    optimizers: list[_OptimizerCopy] = field(default_factory=list)
    rng: _RngStates | None = None
    nbytes: int = 0

    @classmethod
    def take(cls, objects: Sequence[Restorable], rng: bool = True) -> Snapshot:
        """Copy ``objects`` (modules and optimizers, :func:`check_restorable`) to the host."""
        snap = cls()
        tables: set[int] = set()
        tensors: set[int] = set()
        for obj in check_restorable(objects):
            if isinstance(obj, torch.nn.Module):
                snap._take_module(obj, tables, tensors)
            else:
                snap.optimizers.append(_OptimizerCopy.take(obj))
                snap.nbytes += snap.optimizers[-1].nbytes
        if rng:
            snap.rng = _RngStates.take()
            snap.nbytes += snap.rng.nbytes
        return snap

    def _take_module(self, module: torch.nn.Module, tables: set[int],
                     tensors: set[int]) -> None:
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for slot in _slots(table, tables, tensors, _host_copy):
                    grad = slot.tensor.grad if slot.tensor is not None else None
                    if slot.data is not None and grad is not None:
                        slot.grad = _Saved.of({"grad": grad})
                        self.nbytes += slot.grad.nbytes
                    self.nbytes += _tensor_bytes(slot.data)
                    self.slots.append(slot)

    def __repr__(self) -> str:
        tensors = sum(slot.data is not None for slot in self.slots)
        return (f"Snapshot({tensors} tensors, {len(self.optimizers)} optimizer(s), "
                f"rng={self.rng is not None}, nbytes={self.nbytes})")

    def restore(self) -> None:
        """Put every object back as it was at :meth:`take` (optimizer state first, then
        parameters, buffers and gradients in place, then RNG states); repeatable."""
        for opt in self.optimizers:
            opt.restore()
        for slot in self.slots:
            slot.restore()
        if self.rng is not None:
            self.rng.restore()
