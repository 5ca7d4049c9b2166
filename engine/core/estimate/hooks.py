"""What a workload may ask of a running estimate: whether one runs, for which device, and
what it may skip. Re-exported by :mod:`~oomguard.engine.core.workload`."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses import fake_tensor as ft  # imported by torch itself: free


@dataclass
class _Running:
    """The estimate in progress: the device type it is for, where host-side bookkeeping
    goes, the shortcuts' notes (None: shortcuts off), whether its matrix multiplies'
    workspace is replayed."""

    target: str
    host: str
    cuts: set[str] | None
    replay: bool = False


# A context variable, so an estimate changes it for its own run only.
_RUNNING: contextvars.ContextVar[_Running | None] = contextvars.ContextVar(
    "oomguard_estimate", default=None)


def fake_module(build: Callable[[], torch.nn.Module],
                device: str | torch.device) -> torch.nn.Module:
    """``build()`` on the ``meta`` device (no memory, no initialisation work), then every
    parameter and buffer replaced by a fake tensor on ``device`` (tied weights stay tied):
    the model with no weights, for a workload's ``warmup`` inside :func:`estimate`."""
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


def host_device() -> str:
    """Where a workload keeps host-side bookkeeping (a Lanczos basis): ``cpu``, except in an
    estimate for cuda on a torch build without CUDA (fake tensors then stand on cpu for
    cuda): ``meta``, uncounted."""
    running = _RUNNING.get()
    return "cpu" if running is None else running.host


def shortcut(why: str, devices: tuple[str, ...] = ("cpu", "cuda")) -> bool:
    """Whether the caller may run *once* a step it would repeat identically: True only inside
    an :func:`estimate` for a device type in ``devices``, and then ``why`` (one line) goes
    into the estimate's notes. Always False in a real run: results never change."""
    running = _RUNNING.get()
    if running is None or running.cuts is None or running.target not in devices:
        return False
    running.cuts.add(why)
    return True


def replays_workspace() -> bool:
    """Whether an :func:`estimate` is running whose matrix-multiply workspace is replayed (a
    cpu target, ``workspace=True``): its warm-up must then run as a trial's does, since the
    bytes a size's multiplies add to the BLAS buffers depend on the warm-up's (measured:
    docs/measurements.md#estimate-error). False in a real run and in other estimates."""
    running = _RUNNING.get()
    return running is not None and running.replay
