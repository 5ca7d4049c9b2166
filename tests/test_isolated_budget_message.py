"""A CPU budget counts every byte the code inside allocates, whatever free heap the process
carried in: free chunks of the entering thread's heap are filled at entry, and free chunks
that other threads hold, which it cannot fill, are named in a warning whose advice works.
(Before, a warm-up's free chunks served the code inside without counting, and each
isolated child was told to "run isolated (--isolate)".)"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

MiB, KiB = 1024**2, 1024


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _holes(blocks: int = 192) -> list[int]:
    """6 MiB of free 64 KiB chunks walled in by live ones, in the calling thread's arena
    (what a warm-up leaves); the live ones, for the caller to free or keep."""
    libc = _libc()
    taken = [libc.malloc(64 * KiB) for _ in range(blocks)]
    for block in taken[::2]:
        libc.free(block)
    return taken[1::2]


def _in_thread_or_here(fn: Callable[[], object], thread: bool) -> None:
    """``fn()`` in a new thread (its own glibc arena), or in this one."""
    if thread:
        worker = threading.Thread(target=fn)
        worker.start()
        worker.join()
    else:
        fn()


def _enter_budget(holes_in_thread: bool) -> dict:
    """Holes in this thread's heap or another thread's, then a 48 MiB budget inside which
    this thread takes 3 MiB of 60 KiB blocks: the warnings logged, and how much VmData grew
    for those blocks (bytes)."""
    import logging

    import oomguard
    from oomguard.probes.host import proc_status

    _in_thread_or_here(_holes, holes_in_thread)  # its live blocks kept for the process's life
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("oomguard").addHandler(handler)
    libc = _libc()
    with oomguard.budget(48 * MiB):
        before = proc_status("VmData")
        blocks = [libc.malloc(60 * KiB) for _ in range(51)]
        grew = proc_status("VmData") - before
    assert all(blocks)
    return {"warnings": seen, "grew": grew}


def _in_new_python(holes_in_thread: bool, **env: str) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from test_isolated_budget_message import _enter_budget; "
            "print(json.dumps(_enter_budget(sys.argv[2] == '1')))")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent),
                           "1" if holes_in_thread else "0"], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_free_chunks_of_the_entering_thread_are_filled_so_the_code_inside_counts_all() -> None:
    got = _in_new_python(holes_in_thread=False)
    # 51 blocks of 60 KiB: 3 MiB, all new heap (the 6 MiB of holes would have held them all).
    assert got["grew"] >= 3 * MiB - 64 * KiB, got
    assert got["warnings"] == [], got


@pytest.mark.slow
def test_another_threads_free_chunks_are_named_and_the_advice_given_removes_them() -> None:
    got = _in_new_python(holes_in_thread=True)
    assert len(got["warnings"]) == 1, got
    warning = got["warnings"][0]
    assert "free heap chunks in other threads'" in warning and "MALLOC_ARENA_MAX=1" in warning
    assert "--isolate" not in warning
    assert _in_new_python(holes_in_thread=True, MALLOC_ARENA_MAX="1")["warnings"] == []


def _plugged_in(thread: bool) -> tuple[int, int]:
    """6 MiB of holes made and plugged by the same thread (the main one, or another):
    the free heap bytes before and after the plugging."""
    from oomguard.engine.core.memory.heap import free_heap_bytes, plug_free_heap, unplug_heap

    got: list[int] = []

    def holes_then_plug() -> None:
        kept = _holes()
        before = free_heap_bytes()
        plugs = plug_free_heap()
        got.extend([before, free_heap_bytes()])
        unplug_heap(plugs)
        libc = _libc()
        for block in kept:
            libc.free(block)

    _in_thread_or_here(holes_then_plug, thread)
    return got[0], got[1]


@pytest.mark.parametrize("thread", [False, True], ids=["main thread", "another thread"])
def test_plugging_fills_the_calling_threads_holes(thread: bool) -> None:
    before, after = _plugged_in(thread)
    assert before - after > 5.5 * MiB, (before, after)
