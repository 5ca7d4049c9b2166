"""``probe(device)``: one memory snapshot, in bytes, with the source of each figure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from probes import host


@dataclass
class MemorySnapshot:
    """Memory of one device at one moment, in bytes.

    ``free_bytes`` is what a new allocation could still get (the smallest of
    the limits that apply). Figures that could not be measured are None, and
    ``sources`` names where each measured figure came from.
    """

    device: str
    name: str
    available: bool
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_bytes: int | None = None
    other_processes_bytes: int | None = None
    sources: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_snapshot() -> MemorySnapshot:
    mem = host.host_memory()
    return MemorySnapshot(
        device="cpu", name=mem["name"], available=True, total_bytes=mem["total"],
        free_bytes=mem["free"], process_bytes=mem["process"], sources=mem["sources"],
        extra={"limited_by": mem["limited_by"], "cpus": host.cpu_count()},
    )


def probe(device: str | torch.device = "cpu") -> MemorySnapshot:
    """Measure the memory of ``device`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``).

    Never raises for a missing GPU or driver: the snapshot has
    ``available=False`` and a ``reason``. Raises ``ValueError`` for a device
    string torch does not know.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda, cuda:N or mps") from exc
    if dev.type == "cpu":
        return _cpu_snapshot()
    return MemorySnapshot(device=str(dev), name="", available=False,
                          reason=f"no probe backend for {dev.type}")


def probe_all() -> list[MemorySnapshot]:
    """A snapshot of the host and of every GPU this process can see."""
    return [_cpu_snapshot()]


def format_table(snapshots: list[MemorySnapshot]) -> str:
    """A plain-text table of snapshots, sizes in GiB."""
    from engine.units import fmt_bytes

    rows = [("device", "name", "total", "free", "this process", "other processes", "note")]
    for s in snapshots:
        rows.append((s.device, s.name, fmt_bytes(s.total_bytes, "GiB"), fmt_bytes(s.free_bytes, "GiB"),
                     fmt_bytes(s.process_bytes, "GiB"), fmt_bytes(s.other_processes_bytes, "GiB"),
                     s.reason or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
