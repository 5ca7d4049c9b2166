"""Ctrl-C and SIGTERM for the command line: never lost, never a traceback.

Python's own SIGINT handler raises :class:`KeyboardInterrupt` wherever the main thread is.
Inside an import that can be lost or worse: torch's C code imports numpy and clears any
exception that import raised (it then runs without numpy; the command ran on to exit 0,
or failed later with a numpy error), transformers turns it into a ModuleNotFoundError
traceback, and one raised while torch's C++ calls back into Python aborts the process
(SIGABRT, a C++ traceback). :class:`Signals` raises the signal at once outside imports;
inside one (:func:`_would_be_lost`) it records it and raises it as soon as the import is
over (checked every :data:`RECHECK_S` seconds with ``SIGALRM``), and at the latest when the
command returns or says its error line (:meth:`Signals.raise_pending`: a quick command
could end between two checks, and the signal was lost): importing torch takes 1-3 s on an
idle machine.
SIGTERM is raised as :class:`Terminated`, a ``KeyboardInterrupt``: the same ``finally``
blocks and ``with`` exits run (a child's captured-stderr file is removed, a forkserver's
socket folder too), then :func:`~oomguard.engine.cli.main.main` prints one line and
returns 130, or 143 for SIGTERM.

The console script and ``python -m oomguard`` install it when the ``oomguard`` package is
first imported (:func:`install_at_start`), before the rest of the command line is
imported, so that a Ctrl-C in those first milliseconds waits for ``main`` too; the window
left is Python's own start-up (``site``) before any oomguard code runs. ``main`` called
from a program or a test installs it for the call only and restores the handlers it found.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType

RECHECK_S = 0.02  # seconds between checks whether a deferred signal may be raised
# (docs/measurements.md#start-up-signals)
# Seconds a signal waits for an import to end before it is raised inside it anyway, so that
# an import that hangs (a plugin's) is still interrupted: torch's took up to 13 s on 2
# cores under a load of 12. A second Ctrl-C is raised at once.
DEFER_S = 30.0
_IMPORTING = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
HANDLED = (signal.SIGINT, signal.SIGTERM)
# What the interpreter runs as the command: the console script (pip's Windows launcher:
# an .exe), or the package with ``python -m``.
COMMAND_NAMES = ("oomguard", "oomguard.exe", "oomguard-script.py")


class Terminated(KeyboardInterrupt):
    """SIGTERM in the command, raised where Ctrl-C is, so the same cleanup runs."""


def _would_be_lost(frame: FrameType | None) -> bool:
    """Whether an exception raised at ``frame`` may be lost or abort: anywhere inside an
    import (importlib's bootstrap runs below it). Torch's C code imports numpy and clears
    what that import raised; torch's C++ calls back into Python while torch imports
    (``torch.distributed``'s ``_c10d_init``: a KeyboardInterrupt there is a C++ exception
    nothing catches, ``terminate called``, SIGABRT); importlib's own callbacks print
    "Exception ignored" and go on."""
    while frame is not None:
        if frame.f_code.co_filename in _IMPORTING:
            return True
        frame = frame.f_back
    return False


class Signals:
    """The command's SIGINT and SIGTERM handler (:data:`HANDLED`), installed by
    :meth:`install`, taken back by :meth:`restore`. A signal is raised only once
    :meth:`arm` ran (in ``main``'s ``try``) and until :meth:`disarm` (its ``except``):
    before, it is kept for ``arm``; after, the command's last line is out and it is ignored
    (a second one: the signal's default action). A second signal of a pending one is raised
    at once, even inside an import."""

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}
        self.pid = os.getpid()
        self.armed = False
        self.done = False  # disarmed after main began: the command is ending
        self.pending: int | None = None  # the signal recorded and not yet raised
        self.since = 0.0  # time.monotonic() of that signal
        self.alarm_previous: object = None  # SIGALRM's handler while a recheck is set

    @classmethod
    def install(cls) -> Signals | None:
        """A new instance handling SIGINT and SIGTERM where they are at Python's defaults
        (a SIGINT the shell ignores, in a background job, stays ignored); None where neither
        is, or off the main thread (only it may set handlers: ValueError elsewhere)."""
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        self = cls()
        try:
            for sig in HANDLED:
                if signal.getsignal(sig) is defaults[sig]:
                    self.previous[sig] = signal.signal(sig, self._handle)
        except ValueError:
            return None
        return self if self.previous else None

    @staticmethod
    def current() -> Signals | None:
        """The instance handling SIGINT or SIGTERM now in this process, if one is."""
        for sig in HANDLED:
            owner = getattr(signal.getsignal(sig), "__self__", None)
            if isinstance(owner, Signals) and owner.pid == os.getpid():
                return owner
        return None

    def restore(self) -> None:
        """The handlers found at :meth:`install` back, and no recheck left set."""
        self._cancel_recheck()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def arm(self) -> None:
        """From now on a signal is raised; one recorded before is raised now."""
        self.armed, self.done = True, False
        if self.pending is not None:
            self._raise_or_defer(sys._getframe(1))

    def raise_pending(self) -> None:
        """Raise a signal still recorded: one deferred while an import ran, where the command
        ended before the next check (:data:`RECHECK_S`) could raise it. Called as the command
        returns, so that it is never lost."""
        if self.armed and self.pending is not None:
            self._raise_or_defer(None, at_once=True)

    def disarm(self) -> None:
        """From now on a signal is not raised (the command is saying its last line, or
        exiting); a second one ends the process as the signal's default action does."""
        self.armed, self.pending, self.done = False, None, True
        self._cancel_recheck()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        again = self.pending is not None
        if os.getpid() != self.pid or (again and self.done):
            # A forked child before it set its own handlers, or a process asked twice to
            # stop as it exits (an exit that hangs): the signal's default action.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not again:
            self.pending, self.since = signum, time.monotonic()
        if self.armed:
            self._raise_or_defer(frame, at_once=again)

    def _recheck(self, signum: int, frame: FrameType | None) -> None:
        if self.armed and self.pending is not None:
            self._raise_or_defer(frame)

    def _raise_or_defer(self, frame: FrameType | None, at_once: bool = False) -> None:
        """Raise the pending signal, unless it would be lost there (and :data:`DEFER_S` has
        not passed): then check again in :data:`RECHECK_S` seconds."""
        assert self.pending is not None
        deferred = (not at_once and _would_be_lost(frame)
                    and time.monotonic() - self.since < DEFER_S and self._set_recheck())
        if deferred:
            return
        signum, self.pending = self.pending, None
        self._cancel_recheck()
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    def _set_recheck(self) -> bool:
        """SIGALRM in :data:`RECHECK_S` seconds calls :meth:`_recheck`; False where there
        is no ``setitimer`` (Windows): the signal is then raised at once."""
        if not hasattr(signal, "setitimer"):
            return False
        if self.alarm_previous is None:
            self.alarm_previous = signal.signal(signal.SIGALRM, self._recheck)
        signal.setitimer(signal.ITIMER_REAL, RECHECK_S)
        return True

    def _cancel_recheck(self) -> None:
        if self.alarm_previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.alarm_previous)
            self.alarm_previous = None


def install_at_start() -> None:
    """Install :class:`Signals` (not armed: a signal waits for ``main``) when this process
    is the ``oomguard`` command: the console script, or ``python -m oomguard``. Called by
    the ``oomguard`` package's ``__init__`` before anything else it imports; for any other
    program that imports oomguard it does nothing. Read from the interpreter's own command
    line (``sys.orig_argv``): a spawned child is handed its parent's ``sys.argv``."""
    argv = getattr(sys, "orig_argv", [])
    first = next((a for a in argv[1:] if not a.startswith("-")), "")  # script, or -m's module
    if os.path.basename(first) in COMMAND_NAMES and Signals.current() is None:
        Signals.install()
