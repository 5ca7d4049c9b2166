"""The budget's free-heap warning gives advice a user can act on, and an isolated child gives
none: the free heap it holds came from its forkserver (before, each isolated child printed
"... free heap chunks at budget entry ... for an exact budget run isolated (--isolate)")."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import pytest
from conftest import in_fresh_process

MiB = 1024**2


def _warnings_entering_a_budget(as_isolated_child: bool) -> list[str]:
    """In a fresh process: 6 MiB of free heap chunks walled in by live blocks (what imports can
    leave), then a 48 MiB budget; the warnings it logged."""
    import oomguard
    from oomguard.engine.core.memory.heap import (
        ISOLATED_MMAP_THRESHOLD_BYTES,
        return_freed_memory_to_os,
    )

    if as_isolated_child:  # what an isolated child does first
        return_freed_memory_to_os(ISOLATED_MMAP_THRESHOLD_BYTES)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    blocks = [libc.malloc(64 * 1024) for _ in range(192)]
    for block in blocks[::2]:
        libc.free(ctypes.c_void_p(block))
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("oomguard").addHandler(handler)
    with oomguard.budget(48 * MiB):
        pass
    return seen


@pytest.mark.slow
def test_the_free_heap_warning_advises_the_user_and_an_isolated_child_gives_none() -> None:
    user = in_fresh_process(_warnings_entering_a_budget, False)
    assert any("free heap chunks" in w and "MALLOC_MMAP_THRESHOLD_" in w for w in user), user
    assert not any("--isolate" in w for w in user), user
    assert in_fresh_process(_warnings_entering_a_budget, True) == []
