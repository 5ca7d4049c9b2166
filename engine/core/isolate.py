"""Isolated trials: each size runs in a fresh child process.

In-process trials inherit the caches, JIT kernels and heap fragments of every
earlier trial, so their headroom shrinks as a search runs (CPU-OOM-FACTS.md:
69 in-process against 100 in a fresh process on an LSTM). A fresh child per
trial measures the true maximum.

Children come from a ``forkserver`` that has already imported torch (and the
workload's ``preload`` modules), so a trial pays a fork and the workload's own
``warmup()``, not a 1.5-3 s interpreter start. In the child: ``warmup()``, then
the budget (if any), then one trial; the :class:`~oomguard.engine.core.trial.Trial` comes back
through a pipe. A non-OOM error in the child is re-raised in the parent.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from oomguard.engine.core.trial import Trial, run_trial
from oomguard.engine.errors import ChildCrashed

log = logging.getLogger("oomguard.isolate")

_BASE_PRELOAD = ("torch", "oomguard.engine.core.trial", "oomguard.engine.core.budget", "oomguard.probes.peak")


def _child(fn: Any, size: int, device: str, budget_bytes: int | None, conn: Any) -> None:
    """Runs in the child: warm up, apply the budget, run one trial, send it back."""
    try:
        if hasattr(fn, "warmup"):
            fn.warmup()
        if budget_bytes is not None:
            from oomguard.engine.core.budget import budget

            guard: AbstractContextManager[Any] = budget(budget_bytes, device)
        else:
            guard = nullcontext()
        with guard:
            trial = run_trial(fn, size, device)
        conn.send(("ok", trial))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        text = "".join(traceback.format_exception(exc))
        try:
            conn.send(("error", exc, text))
        except Exception:  # the exception itself may not pickle
            conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), text))
    finally:
        conn.close()


class IsolatedRunner:
    """Context manager; calling it with a size runs one isolated trial -> :class:`Trial`.

    ``fn`` must be picklable (a module-level function or a dataclass instance).
    ``budget`` bytes are applied in the child after ``fn.warmup()``.
    ``timeout`` seconds bound each trial (a hung child is killed and reported).
    """

    def __init__(self, fn: Callable[[int], Any], device: str | torch.device = "cpu",
                 budget: int | None = None, timeout: float = 600.0) -> None:
        self.fn, self.device, self.budget, self.timeout = fn, str(device), budget, timeout
        self.ctx = forkserver_context(tuple(getattr(fn, "preload", ())) + (type(fn).__module__,))

    def __enter__(self) -> IsolatedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, size: int) -> Trial:
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_child, args=(self.fn, size, self.device, self.budget, child),
                                daemon=True)
        start = time.perf_counter()
        proc.start()
        child.close()
        message = None
        if parent.poll(self.timeout):
            try:
                message = parent.recv()
            except EOFError:
                message = None
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        elapsed = time.perf_counter() - start
        if message is None:
            return self._crashed(size, proc.exitcode, elapsed)
        if message[0] == "error":
            _, exc, text = message
            log.error("isolated trial at size %d failed:\n%s", size, text)
            raise exc
        trial: Trial = message[1]
        trial.mode = "isolated"
        log.debug("isolated trial %d: %.2f s in the child, %.2f s in all", size, trial.seconds, elapsed)
        return trial

    def _crashed(self, size: int, exitcode: int | None, elapsed: float) -> Trial:
        how = (f"killed by {signal.Signals(-exitcode).name}" if exitcode and exitcode < 0
               else f"exit code {exitcode}")
        # Under a budget a child that dies (libgomp aborts when it cannot create
        # a thread) has run out of memory; without one it is a real failure.
        if self.budget is not None:
            return Trial(size=size, ok=False, peak_bytes=None, seconds=elapsed,
                         error=f"child process {how} under the memory budget", mode="isolated")
        raise ChildCrashed(f"isolated trial at size {size}: child process {how}")


_contexts: dict[tuple[str, ...], Any] = {}


def forkserver_context(preload: tuple[str, ...]) -> Any:
    """The forkserver context, started once per process with torch preloaded.

    The forkserver is shared by the whole process, so its preload list is the
    union of every workload's; modules named after it started are imported by
    each child instead (slower, still correct).
    """
    if sys.platform == "win32" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    wanted = tuple(dict.fromkeys(_BASE_PRELOAD + tuple(m for m in preload if m != "__main__")))
    if not _contexts:
        ctx.set_forkserver_preload(list(wanted))
    _contexts[wanted] = ctx
    return ctx
