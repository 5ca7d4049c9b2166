"""Ctrl-C and SIGTERM at any moment of a command's start-up: one line on stderr, exit 130
(SIGTERM: 143), never lost, never a traceback, no temporary file left.

The loops start the real console script as a user does and signal it at spread moments of
its first seconds. A signal that comes before the interpreter reached oomguard's first line
is Python's own start-up (``site``), which no package can handle: a moment is checked
once the command's handler is in place, which the kernel shows (``SigCgt`` in
``/proc/PID/status``: SIGTERM is caught). One more start is signalled the moment it is in
place (the command line is still importing): the loops fail on a command that never
installs it, and on any traceback, lost signal or second line after it did.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Started, in_fresh_process

SCRIPT = Path(sys.executable).with_name("oomguard")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/PID/status")


def _handler_installed(pid: int) -> bool:
    """Whether process ``pid`` catches SIGTERM (the command's handler is in place)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def _start(argv: list[str], tmp: Path) -> subprocess.Popen:
    """The console script with its own TMPDIR and cache, SIGINT at its default (a test
    process may ignore it, and Python then installs no handler in the command)."""
    env = dict(os.environ, TMPDIR=str(tmp), OOMGUARD_CACHE=str(tmp / "sizes.json"),
               PYTHONUNBUFFERED="1")  # what it printed is in the pipe as it prints it
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        return subprocess.Popen([str(SCRIPT), *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=tmp, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)


# What a command printed this soon after the signal it had printed as it got it (its last
# lines, the signal then ignored): a signal lost during an import shows the command's
# result only once the rest of its start-up ran, hundreds of milliseconds later.
READ_AFTER_S = 0.02


def _printed_so_far(proc: subprocess.Popen) -> tuple[str, str]:
    """What the command had written to stdout and stderr until now, read without blocking
    (``communicate`` reads the rest)."""
    got = []
    for stream in (proc.stdout, proc.stderr):
        fd, chunks = stream.fileno(), []
        os.set_blocking(fd, False)
        try:
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        os.set_blocking(fd, True)
        got.append(b"".join(chunks).decode(errors="replace"))
    return got[0], got[1]


def _left_in(tmp: Path) -> list[str]:
    """What a command left in its TMPDIR, also its folder (torch's compile cache is torch's
    own; the cache and ``out`` are the command's files, not temporary ones)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")
                  and p.name not in ("sizes.json", "out"))


def _signal_at_moments(tmp_path: Path, argv: list[str], moments: list[float | None],
                       sig: int = signal.SIGINT, together: int = 4) -> list[tuple]:
    """``argv`` started once per moment (``together`` at a time), ``sig`` sent that many
    seconds after its start (None: as soon as its handler is in place): per start (moment,
    handler in place when sent, exit code, stdout, stderr, files left in its TMPDIR, what it
    had printed when the signal was sent)."""
    results = []
    for first in range(0, len(moments), together):
        runs = []
        for k, moment in enumerate(moments[first:first + together], start=first):
            tmp = tmp_path / f"run{k}"
            tmp.mkdir()
            runs.append((moment, tmp, _start(argv, tmp), time.monotonic()))
        strict, early = {}, {}
        for moment, _, proc, t0 in sorted(runs, key=lambda r: r[3] + (r[0] or 0.0)):
            if moment is None:
                while not _handler_installed(proc.pid) and proc.poll() is None:
                    time.sleep(0.001)
            else:
                time.sleep(max(0.0, t0 + moment - time.monotonic()))
            strict[proc.pid] = _handler_installed(proc.pid)  # before: then it meets it
            proc.send_signal(sig)
            time.sleep(READ_AFTER_S)
            early[proc.pid] = _printed_so_far(proc)
        for moment, tmp, proc, _ in runs:
            out, err = proc.communicate(timeout=120)
            before_out, before_err = early[proc.pid]
            results.append((moment, strict[proc.pid], proc.returncode, before_out + out,
                            before_err + err, _left_in(tmp), before_out + before_err))
    return results


def _check(results: list[tuple], finished: tuple[int, str], code: int = 130,
           line: str = "oomguard: interrupted", progress: bool = False) -> None:
    """Each start that met the handler: ``code`` and ``line`` as stderr's last line, once
    (the only line, but after the command's progress lines with ``progress``), or it had
    finished (``finished``: its exit code, and a text it had printed by :data:`READ_AFTER_S`
    after the signal: a signal lost while the command still ran ends in that code too,
    but later);
    never a traceback, no temporary file. Some start met the handler (the one signalled as
    soon as it was in place, unless under load this test saw the command only once it
    ended)."""
    assert any(met for _, met, *_ in results), results
    for moment, met, rc, out, err, left, printed in results:
        if not met:  # Python's own start-up, before oomguard's first line
            continue
        what = (moment, rc, out[-300:], err[-2000:], left)
        lines = err.splitlines()
        assert "Traceback" not in err and "Error" not in err, what
        assert progress or len(lines) <= 1, what
        if rc == finished[0] and finished[1] in printed:
            continue  # it had finished before the signal came
        assert (rc, lines[-1:], err.count(line)) == (code, [line], 1), what
        assert left == [], what


def _moments(n: int, first: float, last: float, seed: int) -> list[float]:
    """``n`` moments spread evenly from ``first`` to ``last`` seconds, each moved by up to
    a quarter of the step between two (the same moments on every run)."""
    rng = random.Random(seed)
    step = (last - first) / (n - 1)
    return [max(0.0, first + i * step + rng.uniform(-step / 4, step / 4)) for i in range(n)]


@pytest.mark.slow
def test_ctrl_c_at_twenty_moments_of_start_up_while_torch_imports_is_one_line_and_130(
        tmp_path: Path):
    # The first 2 s of `metrics`: the interpreter, the command line, torch importing numpy
    # (which swallowed a Ctrl-C), the metrics' registry; it imports torch and not
    # transformers (the bench loop below covers those), so each start costs 1.5 CPU-s, not 4.
    results = _signal_at_moments(tmp_path, ["metrics"], [None, *_moments(20, 0.1, 2.0, seed=37)])
    _check(results, finished=(0, "micro_batch_size"))


@pytest.mark.slow
def test_ctrl_c_while_bench_imports_and_builds_is_one_line_and_130(tmp_path: Path):
    # bench imports transformers' model classes (which turned a Ctrl-C into a
    # ModuleNotFoundError traceback, 3 of 40 tries) and torch.distributed (whose C++ init
    # aborted on one: "terminate called", SIGABRT), then builds the model and trains.
    argv = ["bench", "--model", "tiny-gpt2", "--seq-len", "16", "--start", "1",
            "--max-size", "4", "--out", "out"]
    results = _signal_at_moments(tmp_path, argv, [None, *_moments(2, 0.8, 1.6, seed=7)])
    _check(results, finished=(0, "maximum batch size"), progress=True)


@pytest.mark.slow
@pytest.mark.parametrize("argv, finished", [
    (["probe"], (0, "cpu")),
    (["cache", "show"], (0, "")),
    (["show", "no-such-folder"], (2, "no such folder")),
], ids=["probe", "cache", "show"])
def test_ctrl_c_while_a_quick_command_starts_is_one_line_and_130(
        tmp_path: Path, argv: list[str], finished: tuple[int, str]) -> None:
    # These take about 0.1 s: the moments cover the interpreter's start, the imports and
    # the command, and run past its end.
    results = _signal_at_moments(tmp_path, argv,
                                 [None, *_moments(6, 0.0, 0.4, seed=len(argv))])
    _check(results, finished=finished)


def _wait_for_child_file(tmp: Path, proc: Started) -> None:
    """Until estimate's isolated child runs (its captured-stderr file is in ``tmp``)."""
    deadline = time.monotonic() + 300
    while not any(p.name.startswith("oomguard-child-") for p in tmp.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, line", [
    (signal.SIGTERM, 143, "oomguard: terminated"),
    (signal.SIGINT, 130, "oomguard: interrupted"),
], ids=["SIGTERM", "SIGINT"])
def test_estimate_stopped_while_it_replays_leaves_no_temporary_file(
        tmp_path: Path, sig: int, code: int, line: str) -> None:
    # The workspace replay runs in a child whose stderr goes to a temporary file, started
    # from a forkserver whose socket is in a temporary folder: both in TMPDIR. The command
    # runs forked from the worker's forkserver (its start-up is the loops' above; the
    # imports are not paid again), in a session of its own as a terminal starts it.
    proc = Started("estimate", "--sizes", "1,2", cwd=tmp_path,
                   env={"TMPDIR": str(tmp_path), "OOMGUARD_CACHE": str(tmp_path / "sizes.json")})
    try:
        _wait_for_child_file(tmp_path, proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err) == (code, line + "\n"), (out, err)
    assert _left_in(tmp_path) == []


def _interrupted_while_a_child_starts(tmp: str) -> tuple[str, list[str]]:
    """In a fresh process: a Child whose start meets a Ctrl-C (a real SIGINT to itself,
    sent as the process object is made); what was raised and what is left in ``tmp``."""
    import multiprocessing as mp
    import tempfile

    from oomguard.engine.core.child import Child

    tempfile.tempdir = tmp
    signal.signal(signal.SIGINT, signal.default_int_handler)  # children ignore it
    fork = mp.get_context("fork")

    class SignalledContext:  # the fork context, with a Ctrl-C as its process is made
        def __getattr__(self, name: str):
            return getattr(fork, name)

        def Process(self, *args, **kwargs):  # noqa: N802 - multiprocessing's name
            os.kill(os.getpid(), signal.SIGINT)
            return fork.Process(*args, **kwargs)

    try:
        Child(SignalledContext(), print, capture_stderr=True)
        raised = "nothing"
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    return raised, sorted(os.listdir(tmp))


@pytest.mark.slow
def test_a_child_whose_start_is_interrupted_leaves_no_temporary_file(tmp_path: Path):
    assert in_fresh_process(_interrupted_while_a_child_starts, str(tmp_path)) == (
        "KeyboardInterrupt", [])


def test_main_gives_back_the_signal_handlers_it_found(capsys: pytest.CaptureFixture[str]):
    from oomguard.engine.cli.main import main

    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)]
    assert main(["metrics"]) == 0
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)] == before


def _ctrl_c_inside_an_import(folder: str) -> tuple[bool, str, bool]:
    """In a fresh process, the command's handler armed: a module whose body gets a real
    SIGINT, then sleeps and ends; (whether its body ran to its end, where the
    KeyboardInterrupt came, whether a second SIGINT as it exits ended the process)."""
    import importlib
    import subprocess

    from oomguard.engine.cli.interrupt import Signals

    sys.path.insert(0, folder)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # children ignore it
    signals = Signals.install()
    assert signals is not None
    signals.arm()
    where = "nowhere"
    try:
        try:
            importlib.import_module("gets_ctrl_c")
        finally:
            finished = getattr(sys.modules.get("gets_ctrl_c"), "finished", False)
        time.sleep(1)  # raised at the next check, within RECHECK_S
    except KeyboardInterrupt:
        where = "after the import" if finished else "inside the import"
    signals.disarm()
    signals.restore()
    # Disarmed as the command exits: one Ctrl-C is ignored, a second one ends it.
    code = ("from oomguard.engine.cli.interrupt import Signals; import os, signal, time; "
            "s = Signals.install(); s.arm(); s.disarm(); os.kill(os.getpid(), signal.SIGINT); "
            "time.sleep(0.1); print('ignored', flush=True); os.kill(os.getpid(), signal.SIGINT); "
            "time.sleep(5); print('not ended')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    return finished, where, (done.returncode, done.stdout) == (-signal.SIGINT, "ignored\n")


@pytest.mark.slow
def test_ctrl_c_inside_an_import_is_raised_once_the_import_ended(tmp_path: Path) -> None:
    # What torch does to a Ctrl-C inside its import of numpy (its C code clears it) is why
    # the command waits: the import ends whole, then the Ctrl-C is raised.
    (tmp_path / "gets_ctrl_c.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.3)\n"
        "finished = True\n")
    assert in_fresh_process(_ctrl_c_inside_an_import, str(tmp_path)) == (
        True, "after the import", True)


@pytest.mark.slow
def test_a_program_that_imports_oomguard_keeps_its_signal_handlers() -> None:
    # Only the command installs its handler at import; a training script's Ctrl-C and
    # SIGTERM stay Python's (and a spawned child, handed the command's sys.argv, too).
    code = ("import sys; sys.argv[0] = 'oomguard'; import oomguard, signal; "
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
            "signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)")
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)  # as _start: Python's default
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, cwd="/")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (done.returncode, done.stdout) == (0, "True True\n"), done.stderr
