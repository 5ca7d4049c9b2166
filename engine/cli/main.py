"""The ``oomguard`` command line: the table of subcommands, one error policy.

A :class:`~oomguard.engine.errors.UsageError` (bad input, checked before any work) is one
line on stderr and exit code 2; a search without an answer, or a result that cannot be
written (a full disk), one line and exit 1; Ctrl-C one line and 130; anything else is a
bug and keeps its traceback. :data:`COMMANDS` names each subcommand's module, imported only
when that command runs: ``oomguard --help`` imports none of them (no torch). Sizes are
given with units (``2GiB``, ``512MiB``, ``2GB``) or in bytes.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from oomguard.engine.cli.interrupt import Signals, Terminated
from oomguard.engine.cli.logs import setup_logging
from oomguard.engine.errors import SearchFailed, UsageError

# command: (module:function in oomguard.engine.cli that adds its options and handler,
# its line in `oomguard --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "probe": ("probe:add_probe", "memory of every device (bytes measured now)"),
    "bench": ("search:add_bench", "maximum batch size of the built-in GPT-2 training step"),
    "search": ("search:add_search", "maximum safe size of a metric's memory knobs"),
    "metrics": ("catalogue:add_metrics", "list the metrics, their knobs and what they scale with"),
    "estimate": ("estimate:add_estimate",
                 "estimate peak memory at given sizes without running the work"),
    "verify": ("verify:add_verify",
               "run further steps at a report's recommended size and report any OOM"),
    "reference": ("reference:add_reference",
                  "measure every metric's safe sizes on this device (a quick reference)"),
    "run": ("jobs:add_run", "run an overnight job file (resumable)"),
    "cache": ("jobs:add_cache", "show or clear the size cache"),
    "show": ("show:add_show", "a job's table from its output folder, finished or interrupted"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (``oomguard search: error: argument --budget:
    ...``) and exit code 2, as every other bad input: the usage block it prints by default
    (17 lines for ``search``) buries the one line that says what is wrong. ``--help``
    still prints the usage. Subcommands' parsers are of this class too (argparse makes
    them with the parent's class).

    A value like ``-5GiB`` is read as a value (then refused by its type, in one line), not
    as an unknown option ("expected one argument"): the negative-number pattern of Python
    3.13's argparse (``-`` then a digit), where 3.10-3.12 take only plain numbers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command listed, the options of the one ``argv`` names
    (its first word that is not an option: the top level's options take no value) added
    from its module, imported now."""
    parser = _Parser(
        prog="oomguard", description="Measure memory, find the largest safe batch, survive OOMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"oomguard {_version()}",
                        help="print oomguard's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = next((word for word in argv if not word.startswith("-")), None)
    for name, (where, line) in COMMANDS.items():
        p = sub.add_parser(name, help=line, description=line)
        if name == command:
            module, function = where.split(":")
            getattr(importlib.import_module(f"oomguard.engine.cli.{module}"), function)(p)
    return parser


def _version() -> str:
    """The installed distribution's version (importlib.metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("oomguard")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``oomguard`` console script; returns the exit code. Ctrl-C
    anywhere (parser, imports, a search) is one line, ``oomguard: interrupted``, exit 130;
    SIGTERM ``oomguard: terminated``, 143. Neither is lost while torch imports, nor raised
    after the command's last line (:mod:`~oomguard.engine.cli.interrupt`). Called from a
    program, it takes SIGINT and SIGTERM for the call only."""
    # The command's handler, installed when the package was first imported; else ours now.
    signals = Signals.current()
    own = signals is None
    if own:
        signals = Signals.install()
    was_armed = signals is not None and signals.armed
    try:
        if signals is not None:
            signals.arm()  # a signal that came while the command line loaded is raised here
        code = _main(sys.argv[1:] if argv is None else list(argv))
        if signals is not None:
            signals.raise_pending()  # deferred in an import the command then finished
        return code
    except KeyboardInterrupt as exc:
        if signals is not None:
            signals.disarm()  # a second Ctrl-C cannot cut the cleanup and the line short
        if "multiprocessing" in sys.modules:  # children (they ignore SIGINT) end first
            from oomguard.engine.core.child import stop_children

            stop_children()
        terminated = isinstance(exc, Terminated)
        print(f"oomguard: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if signals is not None:
            if own:
                signals.restore()
            elif not was_armed:  # the console script's: ignored from here to the exit
                signals.disarm()
            else:  # main called inside main: the outer call's stays armed
                signals.arm()


def _main(argv: list[str]) -> int:
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as exc:  # argparse: 0 after --help, 2 for bad arguments (said on stderr)
        return int(exc.code or 0)
    # `run` reports its progress through the log; the other commands print results.
    quiet = logging.INFO if args.command == "run" else logging.WARNING
    setup_logging(logging.DEBUG if args.verbose else quiet)
    try:
        if "OOMGUARD_SWALLOWED_OOMS" in os.environ:  # a bad value: one line before any work
            from oomguard.engine.core.memory.swallowed import spotter_mode

            spotter_mode()
        if getattr(args, "plugin", None):  # the commands that take --plugin (options.py)
            from oomguard.engine.cli.options import load_plugins

            args.plugin = load_plugins(args.plugin)  # resolved, as a report records them
        return int(args.func(args) or 0)
    except UsageError as exc:
        _last_word()
        print(f"oomguard: error: {exc}", file=sys.stderr)
        return 2
    except SearchFailed as exc:  # the trials that ran are in exc.result (and any report)
        _last_word()
        if exc.__cause__ is not None:  # a crash or a bug ended it: show where, then the summary
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"oomguard: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `oomguard probe --json | head`
        sys.stderr.close()
        return 0


def _last_word() -> None:
    """The command is saying its last line: a Ctrl-C from here on is not raised (it would
    cut that line and add another). One that came before, still deferred, is raised now:
    the command ends as interrupted, in one line, never losing it."""
    signals = Signals.current()
    if signals is not None:
        signals.raise_pending()
        signals.disarm()


if __name__ == "__main__":
    sys.exit(main())
