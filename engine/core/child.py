"""Child processes: how one starts, what it is given, how its result or its death comes
back. Isolated trials, the measured reference, a job's tasks and the tests' fresh
processes all start theirs here (:class:`Child`).

- Start: ``fork`` only where no CUDA can have been initialised ("Cannot re-initialize
  CUDA in forked subprocess"; :func:`start_method`), else a forkserver that has imported
  torch and the workload's modules. Its children re-run the parent's main module: a
  script must guard its work with ``if __name__ == "__main__":``.
- The child runs a picklable ``fn(*args)``, says ``started``, may :func:`tell_parent`
  things while it runs, and sends what ``fn`` returned or raised; the parent reads that
  or the death (exit code or signal, the OOM evidence) as an :class:`Ended`. A time
  limit stops the child and is a timeout, never an OOM.
- Every child and forkserver asks Linux for SIGKILL when its parent dies
  (:func:`die_with_parent`), and ignores SIGINT: Ctrl-C reaches the whole process group,
  and the command alone decides (it kills its children and prints one line).

A child that dies after it started is an OOM only with evidence (the module docstring of
:mod:`oomguard.engine.core.search.isolate` lists the kinds): an allocation failure reported
on its stderr, SIGKILL under a memory limit, or, under a CPU budget, death by a signal
after its data segment came close to the limit.
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

from oomguard.engine.errors import ChildCrashed
from oomguard.engine.util.units import fmt_bytes
from oomguard.probes import host

KILL_GRACE_S = 5.0  # seconds between SIGTERM and SIGKILL when a child is asked to stop
_PR_SET_PDEATHSIG = 1
# The forkserver imports these first: its parent-death signal, then torch (1.3-1.8 s that
# no child pays again), torch._dynamo, which building any torch.optim optimizer imports
# (1.5-3 s every child paid in its warm-up; docs/measurements.md#isolated-children-start-up),
# and what an isolated trial's child runs.
_SERVER_PRELOAD = ("oomguard.engine.core.in_forkserver", "torch", "torch._dynamo",
                   "oomguard.engine.core.search.isolate")
_preload: dict[str, None] = {}  # every module asked for so far, in order (a set)

# What a child sends (kind, payload), and how it ended (:attr:`Ended.how`).
STARTED, MESSAGE, RETURNED, RAISED = "started", "message", "returned", "raised"
DIED, TIMED_OUT, STOPPED = "died", "timed out", "stopped"


def start_method(device: str) -> str:
    """How a job's task processes start for ``device``, from a process that has run no
    torch code (the command line's): ``fork`` for CPU jobs on Linux (cheapest), else
    ``forkserver``: the parent probes the device before it starts any child."""
    return "fork" if device == "cpu" and sys.platform.startswith("linux") else "forkserver"


def workload_preload(fn: Any) -> tuple[str, ...]:
    """The modules a forkserver should import for ``fn``: its ``preload`` and its module."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return tuple(getattr(fn, "preload", ())) + (module,)


def forkserver_context(preload: Iterable[str] = ()) -> Any:
    """The forkserver context (spawn where there is none), with torch and ``preload`` named
    for the server to import. The server is shared by the whole process: it imports what
    every call named before it started; a module named later is imported by each child."""
    if sys.platform == "win32" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    _preload.update(dict.fromkeys(_SERVER_PRELOAD + tuple(m for m in preload if m != "__main__")))
    ctx.set_forkserver_preload(list(_preload))  # no effect once the server runs
    return ctx


def start_forkserver(preload: Iterable[str] = ()) -> Any:
    """Start the forkserver now, in the background, and return the context children come
    from. Call it as soon as children are planned: the server imports torch and ``preload``
    while this process goes on, and the first child waits only for what is left of that
    (docs/measurements.md#isolated-children-start-up). The server starts with SIGINT
    ignored (an ignored signal survives ``exec``, a handler does not), so its imports are
    never interrupted and every child it forks inherits that."""
    ctx = forkserver_context(preload)
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            forkserver.ensure_running()  # spawns the server and returns
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
    return ctx


def context(method: str = "forkserver", preload: Iterable[str] = ()) -> Any:
    """Where children come from: :func:`start_forkserver`, or ``fork`` with ``preload``
    imported here once, inherited by every child (:func:`start_method`)."""
    if method != "fork":
        return start_forkserver(preload)
    for module in preload:
        try:
            importlib.import_module(module)
        except ImportError:  # preloading is an optimisation only
            pass
    return mp.get_context("fork")


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans after kill -9);
    exit now if the parent is no longer ``parent`` (it died before the request took
    effect). The signal comes when the parent's *thread* that started this one ends."""
    if not sys.platform.startswith("linux"):
        return
    expected = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != expected:
        os._exit(1)


_to_parent: Any = None  # in a child: its end of the pipe


class ToParent:
    """In a child: ``send(message)`` (picklable) reaches the parent now, in
    :attr:`Child.messages`. Pass one to code that sends its parent messages."""

    def send(self, message: Any) -> None:
        _to_parent.send((MESSAGE, message))


tell_parent = ToParent().send


def _enter(conn: Any, parent: int | None, stderr_path: str | None, fn: Callable[..., Any],
           args: tuple[Any, ...]) -> None:
    """Runs in the child: die with the parent, leave SIGINT to it, say it started, run."""
    global _to_parent
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked child inherits the parent's handler (a job's stop flag): SIGTERM must stop it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _to_parent = conn
    _send(conn, (STARTED, None))
    if stderr_path is not None:
        try:
            sys.stderr.flush()
            fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
            os.dup2(fd, 2)
            os.close(fd)
        except OSError:  # keep the inherited stderr; nothing is lost
            pass
    try:
        answer: tuple[str, Any] = (RETURNED, fn(*args))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        answer = (RAISED, _described(exc))
    sys.stderr.flush()
    _send(conn, answer)
    conn.close()


def _send(conn: Any, answer: tuple[str, Any]) -> None:
    try:
        data = ForkingPickler.dumps(answer)
    except Exception as exc:  # noqa: BLE001 - a value or an exception that does not pickle
        data = ForkingPickler.dumps((RAISED, _described(exc)))
    try:
        conn.send_bytes(data)
    except OSError:  # the parent stopped listening (it was interrupted): nobody to tell
        pass


def _described(exc: BaseException) -> tuple[bytes | None, str, str]:
    """The exception pickled (None where it does not pickle), its first line, its traceback."""
    try:
        pickled: bytes | None = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the exception itself may not pickle
        pickled = None
    text = str(exc).strip()
    summary = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return pickled, summary, "".join(traceback.format_exception(exc))


@dataclass
class Ended:
    """How a child ended. ``how``: :data:`RETURNED` (``value``), :data:`RAISED`
    (:meth:`error`), :data:`DIED` (``exitcode``: a code, or minus the signal),
    :data:`TIMED_OUT` or :data:`STOPPED` (the parent ended it). ``started``: it got as far
    as running ``fn``; ``seconds`` from its start to its end; ``stderr`` when captured;
    ``messages``: what it told the parent meanwhile."""

    how: str
    started: bool
    exitcode: int | None
    seconds: float
    value: Any = None
    raised: tuple[bytes | None, str, str] | None = None
    stderr: str = ""
    messages: list[Any] = field(default_factory=list)

    def error(self, where: str = "a child process") -> BaseException:
        """The child's exception rebuilt here (a RuntimeError with its text where it cannot
        be), with the child's traceback as a note: "raised in ``where``"."""
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
        """What ``fn`` returned; its exception re-raised; :class:`ChildCrashed` for a child
        that died, ran out of time or was stopped."""
        if self.how == RETURNED:
            return self.value
        if self.how == RAISED:
            raise self.error()
        if self.how == DIED:
            raise ChildCrashed(f"the child process {how_it_ended(self.exitcode)} without a result")
        raise ChildCrashed(f"the child process {self.how} after {self.seconds:.3g} s, "
                           "without a result")


class Child:
    """A child process running ``fn(*args)`` (picklable), started at once from ``ctx``
    (:func:`context`). As a context manager, leaving the block kills it if it still runs.

    ``capture_stderr``: its fd 2 goes to a temporary file, copied to this process's stderr
    when it ends and kept in :attr:`Ended.stderr` (the OOM evidence). ``every`` (seconds,
    or None): how often :meth:`wait` calls its ``tick`` while it runs.
    """

    def __init__(self, ctx: Any, fn: Callable[..., Any], *args: Any, name: str | None = None,
                 capture_stderr: bool = False) -> None:
        self.conn, send = ctx.Pipe(duplex=False)
        self.stderr_path: str | None = None
        if capture_stderr:
            fd, self.stderr_path = tempfile.mkstemp(prefix="oomguard-child-", suffix=".stderr")
            os.close(fd)
        parent = os.getpid() if ctx.get_start_method() == "fork" else _server_pid()
        self.proc = ctx.Process(target=_enter, name=name,
                                args=(send, parent, self.stderr_path, fn, tuple(args)))
        self.every: float | None = None
        self.started, self.messages = False, []
        self._answer: tuple[str, Any] | None = None
        self.t0 = time.monotonic()
        self.proc.start()
        send.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)
        self.conn.close()
        self._stderr()

    def wait(self, timeout: float | None = None, tick: Callable[[Child], bool] | None = None,
             grace: float = 0.0) -> Ended:
        """Wait for the child's end. ``timeout`` seconds from its start (None: none): it is
        then stopped (:meth:`stop` with ``grace``), :data:`TIMED_OUT`. ``tick(child)`` is
        called every :attr:`every` seconds and after each message; if it returns True the
        child is stopped the same way, :data:`STOPPED`."""
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
        return Ended(how=kind, started=self.started, exitcode=self.proc.exitcode,
                     seconds=time.monotonic() - self.t0,
                     value=payload if kind == RETURNED else None,
                     raised=payload if kind == RAISED else None, stderr=self._stderr(),
                     messages=self.messages)

    def result(self, timeout: float | None = None) -> Any:
        """What ``fn`` returned (see :meth:`Ended.result`)."""
        return self.wait(timeout).result()

    def stop(self, grace: float = KILL_GRACE_S) -> None:
        """Stop the child if it runs: SIGTERM, SIGKILL ``grace`` seconds later (0: at once)."""
        if self.proc.is_alive() and grace > 0:
            self.proc.terminate()
            self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()

    def _receive(self, timeout: float | None) -> bool:
        """Read what the child sent within ``timeout`` seconds; True once it answered or is gone."""
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

    def _stderr(self) -> str:
        """The child's captured stderr, once: also written to this process's stderr."""
        path, self.stderr_path = self.stderr_path, None
        if path is None:
            return ""
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            os.unlink(path)
        except OSError:
            return ""
        sys.stderr.write(text)
        sys.stderr.flush()
        return text


def _server_pid() -> int | None:
    """The running forkserver's pid (its children's parent), or None if unknown."""
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


# Text a child writes on stderr when it dies for want of memory (lower-case). libgomp
# prints "libgomp: Thread creation failed: Resource temporarily unavailable" and exits
# with code 1 when a thread's stack does not fit (docs/measurements.md#minimum-cpu-budget).
ALLOCATION_FAILURES: tuple[str, ...] = (
    "libgomp: out of memory",  # gomp_malloc: "libgomp: Out of memory allocating N bytes"
    "libgomp: thread creation failed",
    "std::bad_alloc",  # a C++ allocation failure nothing caught (terminate, SIGABRT)
)
# oneDNN's text counts only under a memory limit (docs/measurements.md#onednn-primitive).
_ONEDNN_PRIMITIVE = "could not create a primitive"

# How close to its limit a budgeted child's sampled data segment must have come for its
# death by a signal to count as running out of memory: a sixteenth of the budget, at least
# 4 MiB. Crashed LSTM steps had come within 32 KiB and 1.86 MiB of a 32 MiB budget's limit;
# a sample every 0.5 ms can miss the last rise before the failing allocation
# (docs/measurements.md#crashes-at-the-limit).
NEAR_LIMIT_FRACTION = 1 / 16
NEAR_LIMIT_MIN = 4 * 1024**2


def oom_evidence(exitcode: int | None, stderr: str, budgeted: bool) -> str | None:
    """Why a child's death counts as running out of memory, or None when nothing says so.

    ``budgeted``: an oomguard budget applied in the child. Limits inherited from
    the environment are read in this process (children share its cgroup).
    """
    text = stderr.lower()
    for pattern in ALLOCATION_FAILURES:
        if pattern in text:
            return f"it reported {pattern!r} on stderr"
    limits = (["the budget"] if budgeted else []) + list(host.memory_limits())
    if _ONEDNN_PRIMITIVE in text and limits:
        return f"it reported {_ONEDNN_PRIMITIVE!r} on stderr under {', '.join(limits)}"
    if exitcode == -signal.SIGKILL and limits:
        return f"under a memory limit: {', '.join(limits)}"
    return None


def how_it_ended(exitcode: int | None) -> str:
    """How a child process ended, in words: killed by which signal, or its exit code."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class LimitWatch:
    """The parent's view of a budgeted child's data segment (``VmData``, what its
    ``RLIMIT_DATA`` counts), sampled every ``interval`` seconds while it runs: the
    ``tick`` of :meth:`Child.wait`, from the moment the child tells its limit (bytes).

    Some native code does not check what ``malloc`` returns: under a CPU budget, an
    allocation refused at the limit can then kill the child with SIGSEGV instead of
    raising. A LSTM step's backward did, 1 time in 40 at the size above the maximum,
    with glibc's 4 KiB mmap threshold (docs/measurements.md#crashes-at-the-limit). A
    child that died by a signal after its data segment came within ``near`` bytes of
    the limit (:data:`NEAR_LIMIT_FRACTION` of the budget, at least :data:`NEAR_LIMIT_MIN`)
    ran out of memory; one that died far from it crashed.
    """

    def __init__(self, budget: int) -> None:
        # Imported here: it imports torch, and the forkserver imports this module before
        # torch, to die with its parent from its first second.
        from oomguard.probes.peak import DATA_INTERVAL_S

        self.interval = DATA_INTERVAL_S  # seconds between two samples
        self.near = max(NEAR_LIMIT_MIN, int(budget * NEAR_LIMIT_FRACTION))
        self.limit: int | None = None
        self.peak: int | None = None
        self._data: Any = None

    def __call__(self, child: Child) -> bool:
        if self._data is None and child.messages and child.proc.pid is not None:
            self.limit, self._data = child.messages[0], host.DataSize(child.proc.pid)
            child.every = self.interval
        if self._data is not None:
            value = self._data.read()
            if value is not None and (self.peak is None or value > self.peak):
                self.peak = value
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
