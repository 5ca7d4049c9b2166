"""Shared fixtures: tiny models of two architectures, generated data, a CPU budget
entered after a warm-up (thread pools must exist first: docs/measurements.md#minimum-cpu-budget),
and fresh processes for tests that assert a memory boundary.

Order: pytest-randomly shuffles the tests on every run; ``-p no:randomly`` runs
them in file order and ``--reverse`` (with ``-p no:randomly``) in reverse file
order. The suite must pass in all three.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from oomguard.engine.core.child import RAISED, RETURNED, Child, forkserver_context, start_forkserver
from oomguard.engine.core.memory.budget import budget
from oomguard.engine.core.memory.heap import return_freed_memory_to_os
from oomguard.metrics.models import build_model, make_batch

# One torch thread in every test process and in every command, forkserver and child it
# starts (they inherit the variable): two test workers on a 2-core machine, each with a
# thread per core, oversubscribe it, and OpenMP's barriers then wait for descheduled
# threads. Measured beside other work: a whole `oomguard reference` run took 255 s with
# two threads and 41 s with one; the metric tests ran 10-17x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this process read it already

ARCHS = ("tiny-gpt2", "tiny-llama")


def pytest_configure(config: pytest.Config) -> None:
    # Budgets count virtual memory above the process's data size at entry. Free chunks that
    # glibc keeps in its heaps are part of that size and are reused without growing it; a
    # budget fills those of the thread that enters it, not other threads' arenas, so a test
    # process that ran big computations in other threads before its budget gets silently
    # more room (measured: 124 MiB in other threads' arenas against a 48 MiB budget, and a
    # search that found no OOM). Serving every allocation of 128 KiB and more with mmap for
    # the worker's whole life keeps the heaps small and the budgets exact, whatever ran
    # before. Here, not at import: the forkserver imports this module too, and its children
    # stand for a user's fresh process, with glibc's own thresholds.
    return_freed_memory_to_os()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reverse", action="store_true",
                     help="run the tests in reverse order (with -p no:randomly: reverse file order)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse"):
        items.reverse()
    _slow_first(config, items)
    _xdist_groups_seen(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    # This process's forkserver started now, where slow tests will run (they start fresh
    # children), with what this module preloads and nothing else: started by the first test
    # that needs it, it also preloaded what that test named (an isolated search's workload
    # module, a pool's), so what a fresh child holds depended on the order of the tests.
    # It imports torch in the background while the first tests run. Its stdout and stderr,
    # which its children inherit unless a test captures theirs, go to a file in the run's
    # temporary folder, not among pytest's lines.
    if not any(item.get_closest_marker("slow") is not None for item in session.items):
        return
    folder = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    name = f"forkserver-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.log"
    with open(folder / name, "ab") as log, _fds_to(log.fileno()):
        worker_forkserver()


@contextlib.contextmanager
def _fds_to(fd: int):
    """File descriptors 1 and 2 of this process point at ``fd`` inside the block."""
    saved = [os.dup(1), os.dup(2)]
    try:
        for target in (1, 2):
            os.dup2(fd, target)
        yield
    finally:
        for target, old in zip((1, 2), saved, strict=True):
            os.dup2(old, target)
            os.close(old)


def _slow_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, with pytest-randomly's shuffle: the tests marked slow
    first, then the rest, each part in its shuffled order (a stable sort on top of the
    shuffle, as pytest-randomly allows: the order still follows from the seed). The two
    workers take the next tests as they finish, each holding up to three ahead, so a run
    ends when the worker that drew the last long tests ends: with those first, the last
    ones are unit tests of milliseconds. Simulated on the suite's measured CPU-seconds per
    test over 300 seeds: the workers' ends 5.4 s apart on average (13 s in one run of 10,
    47 s at worst) in the shuffled order, 0.4 s with the slow tests first
    (docs/measurements.md#test-suite-cost). ``-p no:randomly`` keeps the file order."""
    if os.environ.get("PYTEST_XDIST_WORKER") and config.pluginmanager.has_plugin("randomly"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _xdist_groups_seen(items: list[pytest.Item]) -> None:
    """Let ``--dist loadgroup`` see the xdist_group marks again: pytest-xdist 3.8 (in a
    worker, before this hook) appends ``@group`` to ``item._nodeid``, which pytest 9.2 no
    longer reads (a node id comes from ``item._id``), so the marks were ignored and each
    worker started a Ray of its own. Where either side changes, this does nothing."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:
        return
    for item in items:
        grouped = getattr(item, "_nodeid", None)
        if isinstance(grouped, str) and "@" in grouped and grouped != item.nodeid:
            item._id = coerce_node_id(grouped)


# The fast layer (-m "not slow") stays fast only if what is slow says so: a test not marked
# slow fails when its call (fixtures excluded: a module's shared model is built once) takes
# over 5 s, against 0.01-1 s for the unit tests on an idle machine. On a loaded one a test
# waits for a core for most of its time (measured: 0.7 s tests took 6-11 s beside other
# suites), so the time the test thread spent runnable but not running (Linux schedstat)
# is not counted: what is left is what an idle machine would take.
UNMARKED_SECONDS = 5.0
_waited = pytest.StashKey[float]()


def _runqueue_seconds() -> float:
    """Seconds this thread has waited for a CPU so far (0 where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    before = _runqueue_seconds()
    try:
        return (yield)
    finally:
        item.stash[_waited] = _runqueue_seconds() - before


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if call.when != "call" or not report.passed or item.get_closest_marker("slow") is not None:
        return report
    seconds = call.duration - item.stash.get(_waited, 0.0)
    if seconds > UNMARKED_SECONDS:
        report.outcome = "failed"
        report.longrepr = (f"took {seconds:.1f} s ({call.duration:.1f} s with the waits for a "
                           f"CPU), over the {UNMARKED_SECONDS:g} s an unmarked test may take: "
                           "mark it @pytest.mark.slow or make it faster")
    return report


@pytest.fixture(autouse=True, scope="session")
def _frozen_gc():
    """Every trial and every retry starts with ``gc.collect()``, which took ~150 ms in a
    process that imported transformers; freezing what exists when the session starts
    (modules, classes) makes it ~1 ms. Objects made later are still collected."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _oomguard_logger_restored():
    """Records reach caplog, and whatever a test's ``main()`` set up on the ``oomguard``
    logger (the CLI's handlers, level, propagate) is undone after it, so no test
    depends on the order."""
    logger = logging.getLogger("oomguard")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    logger.propagate = True
    yield
    for handler in [h for h in logger.handlers if h not in saved[0]]:
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture(scope="session", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


def tiny_model(arch: str, dtype: str = "float64") -> torch.nn.Module:
    """A built-in model in ``dtype`` with fixed random weights."""
    return build_model(arch, dtype=dtype, seed=0)


def tiny_data(n: int = 8, seq_len: int = 16, vocab: int = 256, seed: int = 0) -> dict:
    """Padded causal-LM data (input_ids, attention_mask, labels)."""
    return make_batch(n, seq_len, vocab, seed=seed)


@contextlib.contextmanager
def budget_after_warmup(nbytes: int, warmup=None):
    """Run ``warmup()`` (or a small matmul) then enter a CPU budget of ``nbytes``."""
    (warmup or (lambda: torch.ones(64, 64).matmul(torch.ones(64, 64)).sum()))()
    with budget(nbytes, "cpu") as b:
        yield b


def in_fresh_process(fn, *args):
    """Run the module-level ``fn(*args)`` in a fresh child (forkserver, torch preloaded)
    and return its result.

    In-process results depend on the process's history (free heap chunks,
    caches), so tests that assert an exact memory boundary start from the
    same state every time: a new process.
    """
    return in_fresh_processes(fn, [args])[0]


# What the worker's forkserver imports once for every child it starts, whichever call starts
# it (a test's fresh process or an isolated search): pytest and this module too, which every
# test module a child takes its function from imports. Without them, a child that returns
# at once cost 0.09 CPU-seconds; with them, 0.03.
_SERVER_PRELOAD = ("transformers", "oomguard.metrics.train_step", "oomguard.metrics.synthetic",
                   "pytest", "conftest")
forkserver_context(_SERVER_PRELOAD)


def worker_forkserver() -> Any:
    """This worker's forkserver (started here if it runs not yet): the context every fresh
    child of the tests comes from."""
    return start_forkserver(_SERVER_PRELOAD)


def in_fresh_processes(fn, arg_lists, workers: int = 1):
    """``[fn(*args) for args in arg_lists]``, each call in a fresh child of its own (as
    :func:`in_fresh_process`), ``workers`` at a time: a budget is per process, so calls
    that each set their own (single-threaded) can share the cores. An exception in a child
    is raised here; a child that dies raises ChildCrashed."""
    ctx = worker_forkserver()
    arg_lists, results = [tuple(a) for a in arg_lists], []
    for i in range(0, len(arg_lists), workers):
        with contextlib.ExitStack() as running:
            children = [running.enter_context(Child(ctx, fn, *args))
                        for args in arg_lists[i:i + workers]]
            results += [child.wait().result() for child in children]
    return results


def oomguard_here(argv: list[str], cwd: str | None, env: dict[str, str],
                  missing: tuple[str, ...] = (), stderr_path: str | None = None
                  ) -> tuple[int, str, str]:
    """In a fresh child: ``oomguard ARGV`` in ``cwd`` with ``env`` added and the modules
    ``missing`` unimportable (as on a machine without them), its file descriptors 1 and 2
    (and so its own children's) captured: exit code, stdout, stderr (an exception ``main``
    raised: its traceback, and 1, as the interpreter ends a command on one). A ``TMPDIR`` in
    ``env`` holds its temporary files and folders as in a new interpreter (the forkserver's
    own choices, which a forked child inherits, are forgotten). ``stderr_path``: stderr goes
    to that file instead, which others can read while the command runs."""
    import multiprocessing
    import sys
    import tempfile
    import traceback

    from oomguard.engine.cli.main import main

    sys.modules.update(dict.fromkeys(missing))
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(env)
    if "TMPDIR" in env:
        tempfile.tempdir = None  # tempfile's cached folder: read again from TMPDIR
        multiprocessing.current_process()._config.pop("tempdir", None)  # the forkserver's socket
    files = [tempfile.TemporaryFile(mode="w+b"),
             tempfile.TemporaryFile(mode="w+b") if stderr_path is None
             else open(stderr_path, "w+b")]  # noqa: SIM115 - read back and closed with the process
    for fd, f in zip((1, 2), files, strict=True):
        os.dup2(f.fileno(), fd)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 2
    except Exception:  # as the console script ends on one: its traceback on stderr, exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
    return code, *texts


def cli_in_child(*argv: str, cwd: Any = None, env: dict[str, str] | None = None,
                 missing: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``oomguard ARGV`` as a command line runs it (a process of its own, its output
    captured), but forked from this worker's forkserver, which imported torch and
    transformers once: for tests that are not about the interpreter itself (exit codes
    of ``python -m``, signals, ``ulimit``, what a fresh process imports)."""
    code, out, err = in_fresh_process(oomguard_here, list(argv), None if cwd is None else str(cwd),
                                      env or {}, missing)
    return subprocess.CompletedProcess(["oomguard", *argv], code, out, err)


def _session_cli(argv: list[str], cwd: str | None, env: dict[str, str],
                 stderr_path: str | None = None) -> tuple[int, str, str]:
    """:func:`oomguard_here` in a session of its own: a signal sent to its process group
    reaches it and the processes it starts, and nothing else (as Slurm signals a job step).
    SIGINT at Python's default, as a terminal starts a command (children ignore it)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return oomguard_here(argv, cwd, env, (), stderr_path)


class Started:
    """``oomguard ARGV`` running in a fresh child of this worker's forkserver (as
    :func:`cli_in_child`: torch is not imported again), in a session of its own, for tests
    that signal a command while it runs. ``pid``, ``poll()``, ``send_signal(sig)`` and
    ``communicate(timeout)`` (stdout, stderr) as ``subprocess.Popen`` has them;
    ``returncode`` is the code ``main`` returned, or minus the signal that killed the
    process (its output then lost with it). A process killed for running past ``timeout``
    ends with minus that signal too. ``stderr_path``: its stderr goes to that file (which
    the test can read while it runs) and is what ``communicate`` returns."""

    def __init__(self, *argv: str, cwd: Any = None, env: dict[str, str] | None = None,
                 stderr_path: Any = None) -> None:
        self._child = Child(worker_forkserver(), _session_cli, list(argv),
                            None if cwd is None else str(cwd), env or {},
                            None if stderr_path is None else str(stderr_path))
        self.pid: int = self._child.proc.pid
        self.returncode: int | None = None
        self._output: tuple[str, str] | None = None

    def poll(self) -> int | None:
        if self._output is None and self._child.proc.exitcode is not None:
            self.communicate()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self._output is None:
            with self._child as child:  # leaving it reaps the child and closes its pipe
                ended = child.wait(None if timeout is None
                                   else time.monotonic() - child.t0 + timeout)
            if ended.how == RAISED:
                raise ended.error()
            if ended.how == RETURNED:
                self.returncode, out, err = ended.value
            else:
                self.returncode, out, err = ended.exitcode, "", ""
            self._output = (out, err)
        return self._output


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str,
                 compute: Callable[[], Any]) -> Any:
    """``compute()`` once per test run, shared by the pytest-xdist workers: the first
    worker to ask computes it (the others wait on a file lock) and leaves it pickled in
    the run's temporary folder. For session fixtures that start processes or calibrate
    budgets: computed once per worker, they cost a second core the same seconds."""
    import pickle

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    path = root / f"once-{name}.pickle"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return pickle.loads(path.read_bytes())
        value = compute()
        path.write_bytes(pickle.dumps(value))
        return value


@dataclass
class RaisesAt:
    """A workload that fits every size but raises ValueError (a bug, not memory) at
    ``size``. Module-level and picklable, so isolated children can run it too."""

    size: int
    name: str = "raises-at"

    def __call__(self, size: int) -> int:
        if size == self.size:
            raise ValueError(f"not a memory problem at {size}")
        return size


def numbers(summary: Any, prefix: str = "") -> dict[str, float]:
    """Every number of a metric's summary by path (``"groups.h.0.trace"``), recorded
    params excluded; ``"nan"`` (how the JSON sanitiser writes an undefined value) as NaN."""
    out: dict[str, float] = {}
    if isinstance(summary, dict):
        for key, value in summary.items():
            if key != "params":
                out.update(numbers(value, f"{prefix}{key}."))
    elif isinstance(summary, list):
        for i, value in enumerate(summary):
            out.update(numbers(value, f"{prefix}{i}."))
    elif summary == "nan":
        out[prefix.rstrip(".")] = math.nan
    elif isinstance(summary, (int, float)) and not isinstance(summary, bool):
        out[prefix.rstrip(".")] = float(summary)
    return out


def one_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``oomguard argv`` in this process: exit code 2, one line on stderr, nothing on
    stdout (bad input refused before any work); that line."""
    from oomguard.engine.cli.main import main

    code = main(argv)
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert code == 2 and len(lines) == 1 and not cap.out, (code, cap.err, cap.out)
    return lines[0]
