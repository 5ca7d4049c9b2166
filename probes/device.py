"""Device names, read in one place: ``cpu``, ``cuda``, ``cuda:N`` and ``mps``. Parsing
needs no torch (``oomguard probe`` on a CPU answers without it); resolving imports it."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from oomguard.engine.errors import UsageError

if TYPE_CHECKING:
    import torch

_DEVICE = re.compile(r"^(?:(cpu|mps)|(cuda)(?::(\d+))?)$")


def parse_device(device: Any) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``, a ``torch.device`` read through ``str``; a one-line
    :class:`UsageError` (a ``ValueError``) for anything but cpu, cuda, cuda:N and mps."""
    match = _DEVICE.match(str(device).strip())
    if match is None:
        raise UsageError(f"unknown device {str(device)!r}: use cpu, cuda, cuda:N or mps")
    plain, cuda, index = match.groups()
    return plain or cuda, None if index is None else int(index)


def resolve_device(device: Any = None, *, check: bool = False) -> torch.device:
    """The ``torch.device`` ``device`` names; None and ``cuda`` take the current CUDA device
    only where this process has a context (None: else the CPU). ``check``: a GPU this machine
    lacks is a one-line :class:`UsageError`."""
    import torch

    kind, index = parse_device(device) if device is not None else ("cuda", None)
    if check and kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is available here; use --device cpu")
    if check and kind == "cuda" and index is not None and index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s); "
                         f"give cuda:0 to cuda:{max(torch.cuda.device_count() - 1, 0)}")
    if check and kind == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {device}: MPS is not available here; use --device cpu")
    if kind == "cuda" and index is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu" if device is None else "cuda")
    return torch.device(kind, index)
