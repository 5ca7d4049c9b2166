"""Child processes: how one starts, what it is given, how its result or its death comes
back. Isolated trials, the measured reference, job tasks and the tests all use :class:`Child`.

``fork`` only where no CUDA can have been initialised (:func:`start_method`), else a
forkserver that has imported torch, or ``spawn`` on macOS and Windows (:func:`server_method`:
a script needs ``if __name__ == "__main__":``).
The child runs a picklable ``fn(*args)``, may message the parent (:class:`ToParent`) and
sends what ``fn`` returned or raised; the parent reads that, or the death, as an
:class:`Ended`. Every child dies with its parent (:func:`die_with_parent`) and ignores
SIGINT: the command alone decides. One that runs user code may lead a process group of
its own, so that what it started and left running ends with it (:func:`kill_group`).

A death after ``started`` is an OOM only with evidence (:func:`oom_evidence`,
:class:`LimitWatch`): an allocation failure on stderr (a row of
:data:`~oomguard.engine.core.memory.oom_texts.OOM_TABLE`), SIGKILL under a memory limit,
or under a CPU budget a signal after the data segment came close to the limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from oomguard.engine.core.memory.oom_texts import stderr_oom
from oomguard.engine.errors import ChildCrashed, first_line
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import host

KILL_GRACE_S = 5.0  # seconds between SIGTERM and SIGKILL when a child is asked to stop
# The forkserver's imports (docs/measurements.md#isolated-children-start-up).
_SERVER_PRELOAD = ("oomguard.engine.core.in_forkserver", "torch", "torch._dynamo",
                   "oomguard.engine.core.search.isolate")
_preload: dict[str, None] = {}  # every module asked for so far, in order (a set)
PARENT_ENV = "OOMGUARD_FORKSERVER_PARENT"  # the pid that started a forkserver, for the server

# What a child sends (kind, payload), and how it ended (:attr:`Ended.how`).
STARTED, MESSAGE, RETURNED, RAISED = "started", "message", "returned", "raised"
DIED, TIMED_OUT, STOPPED = "died", "timed out", "stopped"


def server_method() -> str:
    """How children start where ``fork`` is not allowed: ``forkserver``, else ``spawn`` on
    Windows, on macOS (Apple's frameworks are not fork-safe: bpo-33725) and wherever
    multiprocessing has no forkserver. A spawned child imports torch itself (measured: a
    small CPU trial 1.1 s spawned, 0.05 s from the forkserver)."""
    if sys.platform in ("win32", "darwin") or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    return "forkserver"


def start_method(device: str, fork: bool = True) -> str:
    """How children start, the one place that decides: ``fork`` for CPU work on Linux when
    ``fork`` (the parent ran no torch code: a job's command line), else :func:`server_method`
    (``forkserver``; ``spawn`` on macOS and Windows)."""
    if fork and device == "cpu" and sys.platform.startswith("linux"):
        return "fork"
    return server_method()


def forkserver_context(preload: Iterable[str] = ()) -> Any:
    """The context of :func:`server_method`: the forkserver, ``preload`` named for the
    server, which is shared (it imports what every call named before it started); or spawn."""
    if server_method() == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    _preload.update(dict.fromkeys(_SERVER_PRELOAD + tuple(m for m in preload if m != "__main__")))
    ctx.set_forkserver_preload(list(_preload))  # no effect once the server runs
    return ctx


def start_forkserver(preload: Iterable[str] = ()) -> Any:
    """Start the forkserver in the background (docs/measurements.md#isolated-children-start-up)
    with SIGINT blocked (the mask survives ``exec``; a Ctrl-C meanwhile waits, not lost);
    the context to use."""
    ctx = forkserver_context(preload)
    if ctx.get_start_method() == "forkserver":
        # The server's parent, for the server: it exits if this process died while it started.
        os.environ[PARENT_ENV] = str(os.getpid())
        try:
            with _sigint_blocked():
                forkserver.ensure_running()  # spawns the server and returns
        finally:
            os.environ.pop(PARENT_ENV, None)
    return ctx


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT (and SIGUSR1, Slurm's stop: :func:`_enter`) blocked in this thread meanwhile,
    where ``signal.pthread_sigmask`` exists (Unix only: CPython's Windows ``signal`` has
    neither it nor ``SIG_BLOCK``)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def context(method: str = "forkserver", preload: Iterable[str] = ()) -> Any:
    """:func:`start_forkserver` (the forkserver, or spawn: :func:`server_method`), or
    ``fork`` with ``preload`` imported here, once for all."""
    if method != "fork":
        return start_forkserver(preload)
    for module in preload:
        with contextlib.suppress(ImportError):  # preloading is an optimisation only
            importlib.import_module(module)
    return mp.get_context("fork")


def pool(workers: int, preload: Iterable[str] = ()) -> ProcessPoolExecutor:
    """A ``ProcessPoolExecutor`` of ``workers`` processes started as :func:`context` starts
    every child here, each ending with its parent (:func:`die_with_parent`)."""
    return ProcessPoolExecutor(workers, mp_context=context(server_method(), preload),
                               initializer=die_with_parent)


def stop_children() -> None:
    """SIGKILL every child process this process started and wait for each to end (their own
    children die with them): after Ctrl-C, so that nothing a child was still writing
    follows the command's last word."""
    for proc in mp.active_children():
        proc.kill()
        proc.join(5)
        kill_group(proc.pid)


def kill_group(pid: int | None) -> None:
    """SIGKILL what is left of the process group a child (``own_group``: :class:`Child`)
    led: processes it started and left behind (a metric's ``subprocess.Popen``), which
    would otherwise outlive it. Call it once the child itself ended; nothing happens where
    ``pid`` led no group (then no group has that id)."""
    if pid is None or not hasattr(os, "killpg"):
        return
    with contextlib.suppress(OSError):  # none left (ESRCH), or the child never led one
        os.killpg(pid, signal.SIGKILL)


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent (the *thread* that started it)
    dies; exit now if the parent is no longer ``parent`` (it died before that)."""
    if not sys.platform.startswith("linux"):
        return
    expected = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != expected:
        os._exit(1)


_to_parent: Any = None  # in a child: its end of the pipe


class ToParent:
    """In a child: ``send(message)`` reaches the parent now (:attr:`Child.messages`)."""

    def send(self, message: Any) -> None:
        _to_parent.send((MESSAGE, message))


def _enter(conn: Any, parent: int | None, stderr_path: str | None, fn: Callable[..., Any],
           args: tuple[Any, ...], stack_path: str | None = None, own_group: bool = False
           ) -> None:
    """Runs in the child: die with the parent, leave SIGINT to it, say it started, run.
    ``stack_path``: where its threads' stacks go when SIGTERM stops it; ``own_group``: lead
    a process group of its own (:class:`Child`)."""
    global _to_parent
    if own_group and hasattr(os, "setpgid"):
        # First, before it can start anything. A Ctrl-C at the terminal then reaches the
        # command only, which decides, as before (the child ignores SIGINT).
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    # Inherited objects are frozen: collections skip them and never copy fork-shared pages
    # (docs/measurements.md#gc-freeze, docs/measurements.md#cgroup-limits).
    gc.freeze()
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Slurm's USR1 before a time limit stops a job like Ctrl-C: the command alone decides.
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # A forked child inherits the parent's handler (a job's stop flag): SIGTERM must stop it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if stack_path is not None and hasattr(faulthandler, "register"):  # not on Windows
        # Written by the C handler, which then dies of SIGTERM as before: a stopped child
        # says where it was (a hang in a metric), even inside native code.
        stack = open(stack_path, "w", encoding="utf-8")  # noqa: SIM115 - kept for the handler
        faulthandler.register(signal.SIGTERM, file=stack, all_threads=True, chain=True)
    if hasattr(signal, "pthread_sigmask"):  # blocked by the parent around the fork (Child)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGUSR1})
    _to_parent = conn
    _send(conn, (STARTED, None))
    if stderr_path is not None:
        with contextlib.suppress(OSError):  # else the inherited stderr: nothing is lost
            sys.stderr.flush()
            fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
            os.dup2(fd, 2)
            os.close(fd)
    try:
        answer: tuple[str, Any] = (RETURNED, fn(*args))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        answer = (RAISED, _described(exc))
    if own_group:  # the multiprocessing workers fn left: its exit would wait for them
        stop_children()
    sys.stderr.flush()
    _send(conn, answer)
    conn.close()


def _send(conn: Any, answer: tuple[str, Any]) -> None:
    try:
        data = ForkingPickler.dumps(answer)
    except Exception as exc:  # noqa: BLE001 - a value or an exception that does not pickle
        data = ForkingPickler.dumps((RAISED, _described(exc)))
    with contextlib.suppress(OSError):  # the parent stopped listening (it was interrupted)
        conn.send_bytes(data)


def _described(exc: BaseException) -> tuple[bytes | None, str, str]:
    """The exception pickled (or None), its first line, its traceback."""
    try:
        pickled: bytes | None = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the exception itself may not pickle
        pickled = None
    summary = f"{type(exc).__name__}: {first_line(exc)}"
    return pickled, summary, "".join(traceback.format_exception(exc))


@dataclass
class Ended:
    """How a child ended (``how``): RETURNED ``value``, RAISED (:meth:`error`), DIED
    (``exitcode``: a code, or minus the signal), TIMED_OUT or STOPPED by the parent.
    ``started``: it reached ``fn``; ``seconds`` from start to end."""

    how: str
    started: bool
    exitcode: int | None
    seconds: float
    value: Any = None
    raised: tuple[bytes | None, str, str] | None = None
    stderr: str = ""
    messages: list[Any] = field(default_factory=list)
    stack: str = ""  # with ``stack_on_stop``: its Python stacks when it was stopped

    def error(self, where: str = "a child process") -> BaseException:
        """The child's exception (else a RuntimeError with its text), its traceback a note."""
        assert self.raised is not None
        pickled, summary, text = self.raised
        try:
            exc = pickle.loads(pickled) if pickled is not None else None
        except Exception:  # noqa: BLE001 - its class or arguments do not unpickle here
            exc = None
        if not isinstance(exc, BaseException):
            exc = RuntimeError(summary)
        exc.add_note(f"raised in {where}:\n{text}")
        return exc

    def result(self) -> Any:
        """What ``fn`` returned, or its exception raised, or :class:`ChildCrashed`."""
        if self.how == RETURNED:
            return self.value
        if self.how == RAISED:
            raise self.error()
        how = how_it_ended(self.exitcode) if self.how == DIED else (
            f"{self.how} after {self.seconds:.3g} s,")
        raise ChildCrashed(f"the child process {how} without a result")


def _temp_file(suffix: str) -> str:
    """An empty temporary file (its path) a child writes for its parent."""
    fd, path = tempfile.mkstemp(prefix="oomguard-child-", suffix=suffix)
    os.close(fd)
    return path


def _taken(path: str | None) -> str:
    """The text of a file :func:`_temp_file` made (``""`` where there is none or it cannot
    be read), the file removed."""
    text = ""
    if path is not None:
        with contextlib.suppress(OSError):
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        with contextlib.suppress(OSError):
            os.unlink(path)
    return text


class Child(contextlib.AbstractContextManager["Child"]):
    """``fn(*args)`` (picklable) in a child started now from ``ctx`` (:func:`context`);
    leaving the ``with`` block kills it if it still runs. ``capture_stderr``: its fd 2 goes
    to a file, copied to this stderr at its end and kept (:attr:`Ended.stderr`).
    ``stack_on_stop``: a child stopped by :meth:`stop` (a time limit) leaves its Python
    stacks at that moment (:attr:`Ended.stack`). ``own_group``: it leads a process group,
    and what it started and left running ends with it (:func:`kill_group`): for user code,
    such as a job's metric that starts a ``subprocess.Popen`` and returns."""

    def __init__(self, ctx: Any, fn: Callable[..., Any], *args: Any, name: str | None = None,
                 capture_stderr: bool = False, stack_on_stop: bool = False,
                 own_group: bool = False) -> None:
        self.conn, send = ctx.Pipe(duplex=False)
        self.stderr_path: str | None = None
        self.stack_path: str | None = None
        try:
            self.stderr_path = _temp_file(".stderr") if capture_stderr else None
            self.stack_path = _temp_file(".stack") if stack_on_stop else None
            self._start(ctx, send, fn, args, name, own_group)
        except BaseException:  # Ctrl-C or SIGTERM meanwhile: no `with` will clean up
            self._abandon()
            raise
        finally:
            send.close()

    def _start(self, ctx: Any, send: Any, fn: Callable[..., Any], args: tuple[Any, ...],
               name: str | None, own_group: bool) -> None:
        if ctx.get_start_method() == "forkserver":  # running from here on (a dead one restarts)
            start_forkserver()
            parent = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
        else:  # fork or spawn: this process is the child's parent
            parent = os.getpid()
        self.proc = ctx.Process(target=_enter, name=name,
                                args=(send, parent, self.stderr_path, fn, tuple(args),
                                      self.stack_path, own_group))
        self.own_group = own_group
        self.every: float | None = None
        self.started, self.messages = False, []
        self._answer: tuple[str, Any] | None = None
        self.t0 = time.monotonic()
        # A forked child runs at-fork hooks before _enter ignores SIGINT: blocked around the
        # fork, a Ctrl-C then cannot print a traceback from it; _enter unblocks them.
        with _sigint_blocked():
            self.proc.start()

    def _abandon(self) -> None:
        """After an interrupted start: the child killed if it started, the pipe closed, the
        temporary files removed (the command's Ctrl-C leaves none behind)."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.pid is not None:  # started
            proc.kill()
            proc.join()
        self.conn.close()
        for path in (self.stderr_path, self.stack_path):
            _taken(path)  # removed: nobody reads them now
        self.stderr_path = self.stack_path = None

    def __exit__(self, *exc: object) -> None:
        self.stop(0)
        self.conn.close()
        self._stderr()
        self._stack()

    def wait(self, timeout: float | None = None, tick: Callable[[Child], bool] | None = None,
             grace: float = 0.0) -> Ended:
        """The child's end. After ``timeout`` seconds from its start it is stopped
        (:meth:`stop` with ``grace``): TIMED_OUT. ``tick(child)`` runs every :attr:`every`
        seconds (None: never) and after each message; True stops it: STOPPED."""
        deadline = None if timeout is None else self.t0 + timeout
        how = None
        while how is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                how = TIMED_OUT
            elif self._receive(min((t for t in (left, self.every) if t is not None),
                                   default=None)):
                break
            elif tick is not None and tick(self):
                how = STOPPED
        if how is None:  # it answered or closed its pipe: it is ending by itself
            self.proc.join(30)
        self.stop(grace if how else 0)
        kind, payload = self._answer or (how or DIED, None)
        return Ended(kind, self.started, self.proc.exitcode, time.monotonic() - self.t0,
                     payload if kind == RETURNED else None, payload if kind == RAISED else None,
                     self._stderr(), self.messages, self._stack())

    def stop(self, grace: float = KILL_GRACE_S) -> None:
        """Stop the child if it runs: SIGTERM, SIGKILL ``grace`` seconds later (0: at once)."""
        if self.proc.is_alive() and grace > 0:
            self.proc.terminate()
            self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        if self.own_group:
            kill_group(self.proc.pid)

    def _receive(self, timeout: float | None) -> bool:
        """Read what came within ``timeout`` seconds; True once it answered or is gone."""
        try:
            if not self.conn.poll(timeout):
                return False
            kind, payload = self.conn.recv()
        except (EOFError, OSError):  # the child closed its end: it died, or ended
            return True
        if kind == STARTED:
            self.started = True
        elif kind == MESSAGE:
            self.messages.append(payload)
        else:
            self._answer = (kind, payload)
        return kind in (RETURNED, RAISED)

    def _stack(self) -> str:
        """The stacks the child wrote when stopped (``stack_on_stop``), once; the file removed."""
        path, self.stack_path = self.stack_path, None
        return _taken(path)

    def _stderr(self) -> str:
        """The child's captured stderr, once: also written to this process's stderr."""
        path, self.stderr_path = self.stderr_path, None
        if path is None:
            return ""
        text = _taken(path)
        sys.stderr.write(text)
        sys.stderr.flush()
        return text


# How close (bytes) to its limit a budgeted child's sampled data segment must come for a death
# by signal to count as an OOM (docs/measurements.md#crashes-at-the-limit).
NEAR_LIMIT_FRACTION = 1 / 16
NEAR_LIMIT_MIN = 4 * 1024**2


def oom_evidence(exitcode: int | None, stderr: str, budgeted: bool) -> str | None:
    """Why a child's death counts as running out of memory, or None when nothing says so.
    ``budgeted``: an oomguard budget applied in the child; limits inherited from the
    environment are read in this process (children share its cgroup)."""
    row = stderr_oom(stderr)
    if row is not None and not row.evidence:
        return f"it reported {row.text!r} on stderr"
    limits = (["the budget"] if budgeted else []) + list(host.memory_limits())
    if row is not None and limits:  # a text that means memory only under a limit
        return f"it reported {row.text!r} on stderr under {', '.join(limits)}"
    if killed_by_sigkill(exitcode) and limits:
        return f"under a memory limit: {', '.join(limits)}"
    return None


def killed_by_sigkill(exitcode: int | None) -> bool:
    """Whether a child's ``exitcode`` (minus the signal) says SIGKILL, as the kernel's OOM
    killer sends it. Never on Windows, whose ``signal`` has no ``SIGKILL``."""
    sigkill = getattr(signal, "SIGKILL", None)
    return sigkill is not None and exitcode == -sigkill


def how_it_ended(exitcode: int | None) -> str:
    """How a child process ended, in words: killed by which signal, or its exit code."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class LimitWatch:
    """A budgeted child's data segment (``VmData`` bytes), sampled every ``interval`` seconds
    once it told its limit: :meth:`Child.wait`'s tick. A child that died by a signal within
    ``near`` bytes of the limit ran out of memory (native code can SIGSEGV there instead of
    raising: docs/measurements.md#crashes-at-the-limit); one that died far from it crashed."""

    def __init__(self, budget: int) -> None:
        # Not at the top: it imports torch, which the forkserver imports after this module.
        from oomguard.probes.peak import DATA_INTERVAL_S

        self.interval = DATA_INTERVAL_S  # seconds between two samples
        self.near = max(NEAR_LIMIT_MIN, int(budget * NEAR_LIMIT_FRACTION))
        self.limit: int | None = None  # bytes, as the child told them
        self.peak: int | None = None
        self._data: Any = None

    def __call__(self, child: Child) -> bool:
        if self._data is None and child.messages and child.proc.pid is not None:
            self.limit, self._data = child.messages[0], host.DataSize(child.proc.pid)
            child.every = self.interval
        value = self._data.read() if self._data is not None else None
        if value is not None:
            self.peak = max(value, self.peak or 0)
        return False  # never stops the child

    def close(self) -> None:
        if self._data is not None:
            self._data.close()

    def evidence(self, exitcode: int | None) -> str | None:
        """Why the child's death was an OOM, or None: a signal, and the peak near the limit."""
        if exitcode is None or exitcode >= 0 or self.peak is None or self.limit is None:
            return None
        left = self.limit - self.peak
        if left > self.near:
            return None
        return (f"its data segment came within {fmt_bytes(max(left, 0))} of the budget's "
                f"limit, sampled every {self.interval * 1000:g} ms")
