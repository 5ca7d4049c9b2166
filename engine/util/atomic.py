"""The one atomic writer: a file is replaced whole and durably, or not at all.

:func:`atomic_write` writes a temporary file beside the target, ``fsync``s it, ``os.replace``s
the target and ``fsync``s the folder: a reader sees the old content or the new, also after a
crash.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.engine.util.jsonable import json_text

Content = bytes | str | Callable[[Path], Any]


def atomic_write(path: str | os.PathLike[str], content: Content, mode: int = 0o644) -> Path:
    """Replace ``path`` with ``content`` (bytes, UTF-8 text, or a callable ``write(tmp_path)``)
    atomically and durably; returns the path. On any error the old ``path`` is untouched;
    an ``OSError`` names ``path``."""
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                    suffix=f".tmp{target.suffix}")
    tmp = Path(tmp_name)
    try:
        if callable(content):
            os.close(fd)
            fd = -1  # closed: an error in content() must not close it again (EBADF hides it)
            content(tmp)
            fd = os.open(tmp, os.O_RDONLY)
        else:
            blob = content.encode("utf-8") if isinstance(content, str) else content
            view = memoryview(blob)
            while view:  # os.write may write less than asked (a file-size limit, a full disk)
                view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.chmod(tmp, mode)  # mkstemp makes 0600; results are for reading
        os.replace(tmp, target)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename in (None, tmp_name, str(tmp)):
            exc.filename = str(target)  # name the file the caller asked for (a full disk)
        raise
    with contextlib.suppress(OSError):  # platforms that cannot open or sync folders
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return target


def atomic_write_json(path: str | os.PathLike[str], value: Any) -> Path:
    """:func:`atomic_write` of ``value`` through the one JSON sanitiser (indented, sorted)."""
    return atomic_write(path, json_text(value))


def unused_path(path: str | os.PathLike[str]) -> Path:
    """``path`` if nothing is there, else the first of ``path-1``, ``path-2``, ... that is
    free: where to move a file aside (a corrupt cache, a stale result) without overwriting."""
    base = Path(path)
    n, candidate = 1, base
    while candidate.exists():
        candidate = base.with_name(f"{base.name}-{n}")
        n += 1
    return candidate
