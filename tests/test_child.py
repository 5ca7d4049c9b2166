"""The child-process launcher: a child's result, its exception, its death and its time
limit come back to the parent; every child dies with its parent and leaves Ctrl-C to it.

The unit tests fork their children (milliseconds each). The two slow tests run
``oomguard reference`` in a session of its own, as a terminal does, and kill it: with
``kill -9`` (no process it started may be left 2 s later) and with Ctrl-C (one line,
``oomguard: interrupted``, exit 130, no traceback).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import Started

from oomguard.engine.core.child import (
    DIED,
    RAISED,
    RETURNED,
    STOPPED,
    TIMED_OUT,
    Child,
    ToParent,
    context,
)
from oomguard.engine.errors import ChildCrashed

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="fork, prctl and /proc are Linux's")
pytestmark = linux_only

_PR_GET_PDEATHSIG = 2


def _add(a: int, b: int) -> int:
    return a + b


def _raises(text: str) -> None:
    raise ValueError(text)


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling")


def _raises_unpicklable() -> None:
    raise _Unpicklable("kept as text")


def _exits(code: int) -> None:
    os._exit(code)


def _kills_itself() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sleeps(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _tells_then_sleeps(message: str, seconds: float) -> None:
    ToParent().send(message)
    time.sleep(seconds)


def _writes_to_stderr(text: str) -> int:
    os.write(2, text.encode())
    return 0


def _its_signals() -> tuple[bool, int]:
    """Whether SIGINT is ignored here, and the signal asked for when the parent dies."""
    got = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(_PR_GET_PDEATHSIG, ctypes.byref(got), 0, 0, 0)
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN, got.value


@pytest.fixture(scope="module")
def ctx():
    return context("fork")


def test_a_childs_result_comes_back(ctx) -> None:
    with Child(ctx, _add, 2, 3) as child:
        ended = child.wait()
    assert (ended.how, ended.value, ended.exitcode, ended.started) == (RETURNED, 5, 0, True)
    with Child(ctx, _add, "a", "b") as child:
        assert child.wait().result() == "ab"


def test_an_exception_in_the_child_is_re_raised_with_its_traceback(ctx) -> None:
    with Child(ctx, _raises, "not here") as child:
        ended = child.wait()
    assert ended.how == RAISED and ended.raised[1] == "ValueError: not here"
    with pytest.raises(ValueError) as info:
        ended.result()
    assert str(info.value) == "not here"
    assert any("raise ValueError(text)" in note for note in info.value.__notes__)
    # An exception that does not pickle comes back as its text.
    with Child(ctx, _raises_unpicklable) as child, \
            pytest.raises(RuntimeError, match="_Unpicklable: kept as text"):
        child.wait().result()


def test_a_death_comes_back_with_its_exit_code_or_signal(ctx) -> None:
    with Child(ctx, _exits, 7) as child:
        ended = child.wait()
    assert (ended.how, ended.exitcode, ended.started) == (DIED, 7, True)
    with pytest.raises(ChildCrashed, match="^the child process exited with code 7 without"):
        ended.result()
    with Child(ctx, _kills_itself) as child, \
            pytest.raises(ChildCrashed, match="was killed by SIGKILL without a result"):
        child.wait().result()


def test_a_time_limit_stops_the_child_and_is_a_timeout_not_an_oom(ctx) -> None:
    t0 = time.monotonic()
    with Child(ctx, _sleeps, 60) as child:
        ended = child.wait(timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert (ended.how, ended.exitcode) == (TIMED_OUT, -signal.SIGKILL)
    with pytest.raises(ChildCrashed, match="timed out after .* s, without a result"):
        ended.result()
    # With a grace period, SIGTERM first (a job task's stop).
    with Child(ctx, _sleeps, 60) as child:
        assert child.wait(timeout=0.5, grace=5).exitcode == -signal.SIGTERM


def test_messages_reach_the_parent_while_it_runs_and_tick_can_stop_it(ctx) -> None:
    seen = []

    def tick(child: Child) -> bool:
        seen.append(list(child.messages))
        return bool(child.messages)

    with Child(ctx, _tells_then_sleeps, "hand-off", 60) as child:
        child.every = 0.05
        ended = child.wait(timeout=30, tick=tick)
    assert ended.how == STOPPED and ended.messages == ["hand-off"] and seen[-1] == ["hand-off"]


def test_captured_stderr_is_kept_and_passed_through(ctx, capfd) -> None:
    with Child(ctx, _writes_to_stderr, "libgomp: Thread creation failed\n",
               capture_stderr=True) as child:
        ended = child.wait()
    assert ended.stderr == "libgomp: Thread creation failed\n"
    assert "libgomp: Thread creation failed" in capfd.readouterr().err


def test_a_child_ignores_sigint_and_dies_with_its_parent(ctx) -> None:
    with Child(ctx, _its_signals) as child:
        assert child.wait().result() == (True, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_while_the_forkserver_starts_is_not_lost(monkeypatch) -> None:
    # A Ctrl-C that lands while the server is being started (every reference row asks for
    # it) must still stop this process: it once went unseen and the command exited 0.
    from multiprocessing import forkserver

    from oomguard.engine.core.child import start_forkserver

    real = forkserver.ensure_running

    def ctrl_c_meanwhile() -> None:
        real()
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(10**5))  # bytecodes in which a handler would run

    monkeypatch.setattr(forkserver, "ensure_running", ctrl_c_meanwhile)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            start_forkserver()
            sum(range(10**5))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    # The server's children still leave SIGINT to the command and die with it.
    with Child(start_forkserver(), _its_signals) as child:
        assert child.wait().result() == (True, signal.SIGKILL)


# ------------------------------------------------------------------ the command line


TINY = ["--model", "gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64", "--samples", "2",
        "--seq-len", "8"]


def _signal_masks(pid: int) -> dict[str, str]:
    """The signal masks /proc shows for ``pid`` (blocked, ignored, caught), in hex."""
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":\t", 1) for line in f if line.startswith(("SigBlk", "SigIgn",
                                                                          "SigCgt")))


def _left_after(sid: int, seconds: float) -> list[tuple[int, str]]:
    """The processes of session ``sid`` still alive ``seconds`` from now (sooner, once none
    is left)."""
    deadline = time.monotonic() + seconds
    while (left := _in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _in_session(sid: int) -> list[tuple[int, str]]:
    """Live processes of session ``sid`` (pid, command line); zombies are dead already."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append((int(pid), cmd))
    return found


def _reference_in_a_session(tmp_path: Path, *options: str) -> tuple[Started, Path]:
    """``oomguard reference`` started in a session of its own, stopped (SIGSTOP, the whole
    session) once its first trial ran: the caller sends what it tests, then SIGCONT. The
    command is forked from the worker's forkserver, with SIGINT at its default as a
    terminal starts it (the interpreter's own start-up is tests/test_interrupt_start.py's)."""
    err = tmp_path / "stderr.txt"
    err.touch()
    proc = Started("reference", *TINY, *options, "--cache", str(tmp_path / "sizes.json"),
                   "--out", str(tmp_path / "ref"), cwd=tmp_path, stderr_path=err)
    deadline = time.monotonic() + 300
    while "  size " not in err.read_text(errors="replace"):
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < deadline, err.read_text()
        time.sleep(0.05)
    # Stopped at once (the whole session): under load this test can be descheduled for
    # seconds, which the tiny reference needs to finish; the caller continues it.
    os.killpg(proc.pid, signal.SIGSTOP)
    return proc, err


@pytest.mark.slow
def test_no_process_is_left_two_seconds_after_kill_9_of_reference(tmp_path: Path) -> None:
    proc, err = _reference_in_a_session(tmp_path, "--isolate")
    try:
        # The command, a search's process (forked on a CPU), its forkserver, a trial...:
        # between two rows only the command and the next search's process may be there.
        assert len(_in_session(proc.pid)) >= 2, _in_session(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):  # the others, stopped, must still end
            os.killpg(proc.pid, signal.SIGCONT)        # by themselves once they run
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        assert _left_after(proc.pid, 2.0) == []
    finally:
        for pid, _ in _in_session(proc.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_in_reference_is_one_line_and_exit_130(tmp_path: Path) -> None:
    proc, err = _reference_in_a_session(tmp_path)
    try:
        before = len(err.read_bytes())
        signals = _signal_masks(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
        os.killpg(proc.pid, signal.SIGCONT)
        proc.communicate(timeout=60)
        assert proc.returncode == 130, (signals, err.read_text()[-3000:])
        text = err.read_text()
        after = text.encode()[before:].decode(errors="replace").splitlines()
        assert after[-1:] == ["oomguard: interrupted"], after
        assert text.count("oomguard: interrupted") == 1
        assert "Traceback" not in text and "Error" not in text, text
        assert _left_after(proc.pid, 2.0) == []
    finally:
        for pid, _ in _in_session(proc.pid):
            os.kill(pid, signal.SIGKILL)
