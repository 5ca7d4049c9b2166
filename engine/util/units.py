"""Byte sizes: parsing at the edges (CLI, job files) and formatting for humans.

Inside oomguard every size is an ``int`` of bytes; ``"2GiB"`` turns into bytes only here.
"""

from __future__ import annotations

import re

from oomguard.engine.errors import UsageError

# SI units are powers of 1000; binary units (KiB) and bare K/M/G/T powers of 1024.
_UNITS = {"": 1, "B": 1, **{f"{p}B": 1000**i for i, p in enumerate("KMGT", start=1)},
          **{f"{p}IB": 1024**i for i, p in enumerate("KMGT", start=1)},
          **{p: 1024**i for i, p in enumerate("KMGT", start=1)}}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a memory size into bytes: plain bytes (``"1048576"``), SI units (``"2GB"`` = 2 * 10**9
    bytes) or binary units (``"1.5GiB"``; bare ``K/M/G/T`` are binary). Anything else, or a size
    that is not positive, is a one-line :class:`~oomguard.engine.errors.UsageError`."""
    if isinstance(text, bool):
        raise UsageError(f"invalid size {text!r}: give bytes or a unit, e.g. 2GiB, 512MiB, 2GB")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise UsageError(f"invalid size {text!r}: give bytes or a number with a unit "
                             "(B, KB, MB, GB, KiB, MiB, GiB, TiB), e.g. 2GiB, 512MiB, 2GB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"invalid size {text!r}: a memory size must be greater "
                         "than 0 bytes; give one such as 2GiB")
    return value


def fmt_bytes(n: float | int | None, unit: str | None = None) -> str:
    """Format a byte count for people, e.g. ``1.50 GiB``; ``None`` gives ``-``."""
    if n is None:
        return "-"
    if unit is None:
        unit = "GiB" if abs(n) >= 1024**3 else "MiB" if abs(n) >= 1024**2 else "KiB"
    return f"{n / _UNITS[unit.upper()]:.2f} {unit}"


GiB = 1024**3
MiB = 1024**2
