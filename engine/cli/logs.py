"""The one logging setup. Only the command line configures logging: library modules only ask for
loggers (``logging.getLogger("oomguard.<part>")``), so a program that imports oomguard keeps full
control of its own logging. The command line calls :func:`setup_logging` once; a job also writes
``job.log`` through :func:`log_to_file`, in its own process and in every metric's child.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER = "oomguard"
CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"
FILE_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
_MARK = "_oomguard_handler"  # what a handler of ours was added for: "console" or a path


def _add(handler: logging.Handler, mark: str, level: int, fmt: str) -> logging.Handler:
    root = logging.getLogger(LOGGER)
    for old in [h for h in root.handlers if getattr(h, _MARK, None) == mark]:
        root.removeHandler(old)
        old.close()
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter(fmt))
    setattr(handler, _MARK, mark)
    root.addHandler(handler)
    # The logger passes what the most talkative handler wants; each handler filters.
    root.setLevel(min(h.level for h in root.handlers if getattr(h, _MARK, None)))
    root.propagate = False  # our handlers print it; the root logger would print it again
    return handler


def setup_logging(level: int = logging.WARNING) -> None:
    """Log oomguard's records at ``level`` and above to stderr, one line each."""
    _add(logging.StreamHandler(sys.stderr), "console", level, CONSOLE_FORMAT)


class _FileHandler(logging.FileHandler):
    """A file handler that reports a failed write (a full disk) once, in one line, where
    logging's default prints a traceback for every record that fails."""

    reported = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if not self.reported:
            self.reported = True
            sys.stderr.write(f"oomguard: warning: cannot write {self.baseFilename}: "
                             f"{sys.exc_info()[1]}; its later records are lost\n")


def log_to_file(path: str | os.PathLike[str], level: int = logging.INFO) -> logging.Handler:
    """Also append oomguard's records at ``level`` and above to ``path`` (e.g. ``job.log``);
    per process, so safe in a child. :func:`stop_logging_to` removes the handler returned."""
    return _add(_FileHandler(path, encoding="utf-8"), os.fspath(path), level, FILE_FORMAT)


def stop_logging_to(handler: logging.Handler) -> None:
    """Remove a handler that :func:`log_to_file` added, and close its file."""
    logging.getLogger(LOGGER).removeHandler(handler)
    handler.close()
