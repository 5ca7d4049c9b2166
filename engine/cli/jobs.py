"""``oomguard run`` and ``oomguard cache``: overnight jobs and the size cache.

``register(subparsers)`` adds both subcommands to an argparse parser; each
handler returns the exit code: 0 all metrics done, 1 some failed (listed),
2 a bad job file or arguments, 130/143 stopped by SIGINT/SIGTERM (what was
done is kept; run the same command again to resume).
``python -m oomguard.engine.cli.jobs ...`` runs them without the main CLI.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

RUN_HELP = """\
Run a job file: every metric on every model, sizes from the size cache, else a
bounded search, else defaults; an OOM retries at half; a failing metric is
recorded and the job goes on. Results are written as each metric finishes;
running the same command again resumes (finished metrics are kept).
Exit codes: 0 all done, 1 some metrics failed, 2 bad job file or arguments,
130/143 interrupted."""

CACHE_HELP = """\
Show or clear the size cache: the sizes that worked per device (name, total
memory, budget) and workload (model config, dtype, sequence length, metric,
result-defining parameters)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``run`` and ``cache`` to ``subparsers``; each sets ``func(args) -> int``."""
    run = subparsers.add_parser("run", help="run an overnight job file (resumable)",
                                description=RUN_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("job", nargs="?", help="the job file (TOML); see --example")
    run.add_argument("--example", action="store_true",
                     help="print a commented job file that runs as is, and exit")
    run.add_argument("--out", metavar="DIR", help="output folder (overrides the job's output)")
    run.add_argument("--cache", metavar="PATH",
                     help="size cache file (default: sizes.json in the user cache folder)")
    run.add_argument("--no-search", action="store_true",
                     help="never search: sizes from the cache, else the metric defaults")
    run.add_argument("--json", action="store_true",
                     help="print results.json to stdout when done")
    run.set_defaults(func=cmd_run)

    cache = subparsers.add_parser("cache", help="show or clear the size cache",
                                  description=CACHE_HELP)
    cache.add_argument("action", choices=("show", "clear"), help="show the entries, or remove all")
    cache.add_argument("--cache", metavar="PATH", help="size cache file (default: user cache)")
    cache.add_argument("--json", action="store_true", help="machine-readable output")
    cache.set_defaults(func=cmd_cache)


def _setup_logging() -> None:
    root = logging.getLogger("oomguard")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                               "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # the CLI's root handler would print every line twice


def _error(message: str) -> int:
    print(f"oomguard: error: {message}", file=sys.stderr)
    return 2


def cmd_run(args: argparse.Namespace) -> int:
    """Handler of ``oomguard run``."""
    from oomguard.engine.jobs.spec import EXAMPLE, JobError, load_job

    if args.example:
        print(EXAMPLE, end="")
        return 0
    if not args.job:
        return _error("run: give a job file (oomguard run JOB.toml), or --example")
    _setup_logging()
    from oomguard.engine.jobs.cache import CacheError
    from oomguard.engine.jobs.runner import format_outcome, run_job

    try:
        job = load_job(args.job, output=args.out)
        # This process has run no torch code (it parses, plans and waits): a plain
        # fork is safe and saves the forkserver's start (see oomguard.engine.jobs.runner.run_job).
        method = "fork" if sys.platform.startswith("linux") else "forkserver"
        outcome = run_job(job, cache_path=args.cache, search=not args.no_search,
                          start_method=method)
    except (JobError, CacheError) as exc:
        return _error(str(exc))
    if args.json:
        with open(f"{outcome.out}/results.json", encoding="utf-8") as fh:
            sys.stdout.write(fh.read())
    else:
        print(format_outcome(outcome))
    failed = outcome.failed()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return outcome.exit_code


def cmd_cache(args: argparse.Namespace) -> int:
    """Handler of ``oomguard cache show|clear``."""
    _setup_logging()
    from oomguard.engine.jobs.cache import CacheError, SizeCache, format_entries

    cache = SizeCache(args.cache)
    try:
        if args.action == "clear":
            n = cache.clear()
            print(json.dumps({"cleared": n, "path": str(cache.path)}) if args.json
                  else f"cleared {n} entries from {cache.path}")
            return 0
        entries = cache.entries()
    except CacheError as exc:
        return _error(str(exc))
    if args.json:
        print(json.dumps({"path": str(cache.path), "entries": entries}, indent=2, sort_keys=True))
    elif not entries:
        print(f"{cache.path}: empty")
    else:
        print(f"{cache.path}: {len(entries)} entries")
        print(format_entries(entries))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m oomguard.engine.cli.jobs run JOB.toml`` / ``cache show``: the two subcommands alone."""
    parser = argparse.ArgumentParser(prog="oomguard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on bad arguments, 0 for --help
        return int(exc.code or 0)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
