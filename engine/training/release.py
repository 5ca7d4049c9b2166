"""Giving memory back: :func:`release_memory` takes accelerate's call (``a, b =
release_memory(a, b)``); :func:`free_memory` returns a device's freed memory to it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from oomguard.engine.core.memory import oom

if TYPE_CHECKING:
    import torch

_UNSET: Any = object()


def free_memory(device: str | torch.device | None = None) -> None:
    """Return freed memory to ``device`` (None: every device): ``gc.collect()``, then its
    allocator's cache. Call it outside an ``except`` block (the traceback keeps tensors)."""
    oom.release_memory(device)


def release_memory(*objects: Any, device: Any = _UNSET) -> Any:
    """accelerate's ``release_memory``: drop the references given, collect garbage and empty
    the device caches; returns ``[None] * len(objects)``, to assign back::

        model, optimizer = release_memory(model, optimizer)

    Deprecated, for one release: a single ``str`` or :class:`torch.device` argument (or
    ``device=``) is a device, as before; that call is :func:`free_memory` now, and says so
    (a ``FutureWarning``)."""
    if device is not _UNSET or (len(objects) == 1 and _is_device(objects[0])):
        if device is _UNSET:
            device = objects[0]
        elif objects:
            raise TypeError("release_memory() takes objects or device=, not both")
        warnings.warn("release_memory(device) is deprecated: use free_memory(device); "
                      "release_memory(*objects) now takes accelerate's call", FutureWarning,
                      stacklevel=2)
        free_memory(device)
        return None
    released: list[Any] = list(objects)
    for i in range(len(released)):  # the caller's references go when it assigns these back
        released[i] = None
    del objects
    oom.release_memory(None)
    return released


def _is_device(value: Any) -> bool:
    if isinstance(value, str):
        return True
    import torch

    return isinstance(value, torch.device)
