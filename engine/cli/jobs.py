"""``oomguard run`` (overnight jobs, exit codes in :data:`RUN_HELP`) and ``oomguard cache`` (the
size cache). A job's log records, from this process and every metric's, also go to
``<output>/job.log`` (:class:`JobLog`). Nothing heavy is imported at module level:
``oomguard --help`` and ``run --example`` must not load torch (docs/measurements.md#start-up-time).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from pathlib import Path
from typing import Any

from oomguard.engine.cli.logs import log_to_file, setup_logging, stop_logging_to
from oomguard.engine.cli.options import add_deprecated, add_progress_option
from oomguard.engine.errors import CacheError, UsageError
from oomguard.engine.jobs.example import example_text
from oomguard.engine.util.jsonable import json_text

RUN_HELP = """\
Run a job file: every metric on every model, sizes from the size cache, else a
bounded search, else defaults; an OOM retries at half; a failing metric is
recorded and the job goes on. Results are written as each metric finishes;
running the same command again resumes (finished metrics are kept).
A finished result is kept only while its inputs (model, checkpoint files, data
content, dtype, seed, metric parameters, oomguard version) are unchanged; a
stale one is moved to results/stale/ and rerun. An output folder belongs to one
job: another job's folder is refused unless --force.
Exit codes: 0 all done, 1 some metrics failed (or an output could not be
written), 2 bad job file or arguments, 130/143/138 stopped cleanly by
SIGINT/SIGTERM/SIGUSR1 (Slurm: sbatch --signal=USR1@90): what finished is kept,
the running metric is rerun by the same command.
Runtime: the example job took 11.2 s on 2 idle CPU cores
 (docs/benchmarks.md#how-long-the-commands-take)."""

CACHE_HELP = """\
Show or clear the size cache: the sizes that worked per device (name, total
memory, budget) and workload (model config, dtype, sequence length, metric,
result-defining parameters)."""


def add_run(p: argparse.ArgumentParser) -> None:
    p.description, p.formatter_class = RUN_HELP, argparse.RawDescriptionHelpFormatter
    p.add_argument("job", nargs="?", help="the job file (TOML); see --example")
    p.add_argument("--example", action="store_true",
                   help="print a commented job file that runs as is, and exit")
    p.add_argument("--out", metavar="DIR", help="output folder (overrides the job's output)")
    p.add_argument("--cache", metavar="PATH",
                   help="size cache file (default: sizes.json in the user cache folder)")
    p.add_argument("--sizes-file", metavar="FILE",
                   help="pin the sizes of a sizes.toml written by `oomguard reference` "
                        "(for the same model, dtype, seq_len, device and budget); sizes "
                        "the job file pins itself are kept")
    add_deprecated(p, "--sizes", "--sizes-file", "sizes_file", metavar="FILE")
    p.add_argument("--no-search", action="store_true",
                   help="never search: sizes from the cache, else the metric defaults")
    p.add_argument("--json", action="store_true", help="print results.json to stdout when done")
    p.add_argument("--snapshot-on-oom", action="store_true",
                   help="CUDA: record allocation history and write an allocator snapshot at each "
                        "OOM into <out>/snapshots/ (open it at pytorch.org/memory_viz); on CPU the "
                        "OOM events say none was possible")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run the metrics as Ray tasks, each on its own GPU (or CPU for a "
                        "cpu job), sized for the device it lands on: on a local Ray "
                        "instance with every GPU of this machine, or on the cluster at "
                        "ADDRESS (HOST:PORT, or auto); needs pip install 'oomguard[ray]'")
    p.add_argument("--force", action="store_true",
                   help="use an output folder that holds another job's results: move "
                        "them into <out>/moved-aside/ first")
    add_progress_option(p)
    p.set_defaults(func=cmd_run)


def add_cache(p: argparse.ArgumentParser) -> None:
    p.description = CACHE_HELP
    p.add_argument("action", choices=("show", "clear"), help="show the entries, or remove all")
    p.add_argument("--cache", metavar="PATH",
                   help="size cache file (default: sizes.json in the user cache folder)")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=cmd_cache)


class JobLog:
    """``log_setup`` for :func:`~oomguard.engine.jobs.runner.run_job`: append oomguard's
    records to ``<output>/job.log``. Picklable (a forkserver child gets a copy without the
    open file); called once per process, this one and every metric's."""

    def __init__(self, level: int = logging.INFO) -> None:
        self.level = level
        self.handler: logging.Handler | None = None

    def __call__(self, out: str | os.PathLike[str]) -> None:
        self.handler = log_to_file(Path(out) / "job.log", self.level)

    def __getstate__(self) -> dict[str, Any]:
        return {"level": self.level, "handler": None}

    def close(self) -> None:
        if self.handler is not None:
            stop_logging_to(self.handler)
            self.handler = None


def cmd_run(args: argparse.Namespace) -> int:
    if args.example:
        print(example_text(), end="")
        return 0
    if not args.job and args.ray and args.ray.endswith(".toml"):  # `run --ray JOB.toml`
        args.job, args.ray = args.ray, ""
    if not args.job:
        raise UsageError("run: give a job file (oomguard run JOB.toml), or --example")
    setup_logging(logging.INFO)
    # why: the runner imports torch and transformers (seconds); only a real run needs them.
    from oomguard.engine.core.child import start_method
    from oomguard.engine.jobs.runner import format_outcome, run_job
    from oomguard.engine.jobs.spec import load_job

    job_log = JobLog()
    try:
        job = load_job(args.job, output=args.out)
        if args.sizes_file:
            from oomguard.engine.jobs.plan import device_identity
            from oomguard.engine.jobs.reference import apply_sizes, load_sizes

            job = apply_sizes(job, load_sizes(args.sizes_file), device_identity(job),
                              search=not args.no_search)
        # This process runs no torch code (it parses, plans and waits): for a CPU job a
        # plain fork is safe and cheaper than a forkserver
        # (docs/measurements.md#fork-after-openmp); a GPU job never forks.
        backend = None
        if args.ray is not None:
            from oomguard.engine.jobs.ray_job import OnRay

            backend = OnRay(args.ray or None)
        outcome = run_job(job, cache_path=args.cache, search=not args.no_search,
                          start_method=start_method(job.device), log_setup=job_log,
                          force=args.force, snapshot_on_oom=args.snapshot_on_oom,
                          backend=backend, progress=args.progress)
    except OSError as exc:  # a full disk: what finished is on disk; say where it stopped
        print(f"oomguard: error: cannot write {exc.filename or 'the output'}: "
              f"{exc.strerror or exc}; results finished before this are kept", file=sys.stderr)
        return 1
    finally:
        job_log.close()
    if args.json:
        sys.stdout.write(Path(outcome.out, "results.json").read_text(encoding="utf-8"))
    else:
        print(format_outcome(outcome))
    failed = outcome.failed()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    if outcome.stopped_by:
        print(stopped_line(outcome), file=sys.stderr)
    return outcome.exit_code


def stopped_line(outcome: Any) -> str:
    """The one line after a job stopped on a signal: what is done, and how to resume."""
    done = sum(r.ok for r in outcome.results.values())
    return (f"oomguard: stopped on {outcome.stopped_by}: {done} of {len(outcome.results)} "
            f"metrics done, kept in {outcome.out}; to resume, run the same command again "
            f"(exit code {outcome.exit_code})")


def cmd_cache(args: argparse.Namespace) -> int:
    setup_logging(logging.INFO)
    # why: kept out of `oomguard --help`'s imports, like the runner's.
    from oomguard.engine.jobs.cache import SizeCache, format_entries

    cache = SizeCache(args.cache)  # a file it cannot read or write: main's one-line error
    try:  # a symbolic link loop "exists" for no one: without this, "cleared 0 entries"
        os.stat(cache.path)
    except OSError as exc:  # else nothing there, or a place the cache's own errors name
        if exc.errno == errno.ELOOP:
            raise CacheError(f"cannot read the size cache {cache.path}: {exc.strerror}; fix "
                             "the link or give another --cache PATH") from None
    if args.action == "clear":
        n = cache.clear()
        print(json_text({"cleared": n, "path": cache.path}, indent=None) if args.json
              else f"cleared {n} entries from {cache.path}")
        return 0
    entries = cache.entries()
    if args.json:
        print(json_text({"path": cache.path, "entries": entries}), end="")
    elif not entries:
        print(f"{cache.path}: empty")
    else:
        print(f"{cache.path}: {len(entries)} entries\n{format_entries(entries)}")
    return 0
