"""Device names, read in one place: ``cpu``, ``cuda``, ``cuda:N`` and ``mps``.

:func:`parse_device` needs no torch (``oomguard probe`` on a CPU answers without it);
:func:`resolve_device` gives the ``torch.device``, and with ``check`` whether this
machine has it, as a command checks before any work.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from oomguard.engine.errors import UsageError

if TYPE_CHECKING:
    import torch

_DEVICE = re.compile(r"^(?:(cpu|mps)|(cuda)(?::(\d+))?)$")


def parse_device(device: Any) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``; a ``torch.device`` is read through ``str``.

    Raises :class:`UsageError` (one line; a ``ValueError``) for anything but cpu, cuda,
    cuda:N and mps.
    """
    match = _DEVICE.match(str(device).strip())
    if match is None:
        raise UsageError(f"unknown device {str(device)!r}: use cpu, cuda, cuda:N or mps")
    plain, cuda, index = match.groups()
    return plain or cuda, None if index is None else int(index)


def resolve_device(device: Any = None, *, check: bool = False) -> torch.device:
    """The ``torch.device`` that ``device`` names.

    None means the current CUDA device where this process has a CUDA context, else the
    CPU; ``cuda`` without an index gets the current device's index where this process has
    a context (asking elsewhere would create one). With ``check``, a GPU this machine
    does not have is a :class:`UsageError` saying what to do, as is a name
    :func:`parse_device` refuses.
    """
    import torch  # why: parsing a name needs no torch; a device object does

    if device is None:
        return _current_cuda() or torch.device("cpu")
    kind, index = parse_device(device)
    if check:
        _check_present(kind, index, str(device))
    if kind == "cuda" and index is None:
        return _current_cuda() or torch.device("cuda")
    return torch.device(kind, index)


def _current_cuda() -> torch.device | None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _check_present(kind: str, index: int | None, name: str) -> None:
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA GPU is available here; use --device cpu")
        if index is not None and index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available here; use --device cpu")
