"""The one atomic writer: a file is replaced whole and durably, or not at all.

:func:`atomic_write` writes a temporary file beside the target, ``fsync``s it, ``os.replace``s
the target and ``fsync``s the folder: a reader sees the old content or the new, also after a
crash. The file gets the mode a new file of the user's gets (``0666`` less the umask).

:func:`inside` is where every name that reaches a path inside a folder a job writes (a task's
key, a metric's id, a job's name, a file a job record lists) is checked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.engine.util.jsonable import json_text

Content = bytes | str | Callable[[Path], Any]


def atomic_write(path: str | os.PathLike[str], content: Content) -> Path:
    """Replace ``path`` with ``content`` (bytes, UTF-8 text, or a callable ``write(tmp_path)``)
    atomically and durably; returns the path. The new file's mode is ``0666`` less the
    process's umask, as ``open(path, "w")`` would make it. On any error the old ``path`` is
    untouched; an ``OSError`` names ``path``."""
    target = Path(path)
    fd, tmp = _new_temporary(target)
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
        os.replace(tmp, target)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp)):
            exc.filename = str(target)  # name the file the caller asked for (a full disk)
        raise
    with contextlib.suppress(OSError):  # platforms that cannot open or sync folders
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return target


def _new_temporary(target: Path) -> tuple[int, Path]:
    """A new empty file beside ``target``, open for writing. Created with mode ``0666`` so that
    the kernel applies the umask: ``mkstemp`` makes ``0600``, and the chmod that must follow
    cannot know the umask without ``os.umask``, which sets it for every thread while it reads."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(
        os, "O_BINARY", 0)
    for _ in range(100):  # 32 random bits: a clash is a stale file from a crash, not a race
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp{target.suffix}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(target))


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


def path_part_problem(name: object) -> str | None:
    """Why ``name`` cannot be one file or folder name inside a folder (None: it can): empty,
    ``.`` or ``..``, or holding a separator (``/``, ``\\``) or a NUL, which would make it a
    path of its own (``../x``, ``/etc/x``) that leaves the folder."""
    if not isinstance(name, str) or not name:
        return "is empty"
    if name in (".", ".."):
        return f"{name!r} is not a name but a folder reference"
    bad = sorted({c for c in name if c in "/\\\0"})
    if bad:
        return f"{name!r} holds {' and '.join(repr(c) for c in bad)}, which make it a path"
    return None


def inside(folder: str | os.PathLike[str], rel: str) -> Path:
    """``folder / rel`` for a relative, ``/``-separated ``rel`` whose every part passes
    :func:`path_part_problem`: a path that stays under ``folder`` whatever names ``rel`` was
    built from. ValueError (one line) otherwise."""
    for part in str(rel).split("/"):
        if (why := path_part_problem(part)) is not None:
            raise ValueError(f"{rel!r} cannot be a path inside {folder}: its part {why}")
    return Path(folder, *str(rel).split("/"))
