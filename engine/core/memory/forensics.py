"""Memory forensics at an out-of-memory error: the allocator's and the host's view.

Every OOM the size controller catches for a caller keeping a
:class:`~oomguard.engine.core.execute.retry.RunRecord` becomes an :class:`OomEvent`,
measured by :class:`OomWatch` *inside* the ``except`` block, before memory is released:

- Host: ``VmData``, resident bytes, glibc's free heap chunks, and an oomguard budget's
  limit and headroom.
- CUDA: ``memory_stats`` (reserved, allocated, ``num_alloc_retries``), fragmentation =
  (reserved - allocated) / reserved, and the largest ``inactive`` block of
  ``memory_snapshot()``: the largest request served without a new ``cudaMalloc``.
- With ``snapshot_dir``, a ``_dump_snapshot`` for https://pytorch.org/memory_viz.

Nothing is estimated: a figure is measured (a limit read) at the OOM, or None with
``sources`` saying why, never 0 for unknown. A failed reading never hides the OOM.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from oomguard.engine.core.memory import heap
from oomguard.engine.core.memory.budget import active_budget, current_fraction, headroom_bytes
from oomguard.engine.errors import size_list
from oomguard.engine.util.atomic import atomic_write
from oomguard.probes import host
from oomguard.probes.device import resolve_device
from oomguard.probes.peak import cuda_async_backend

# Alloc/free events kept for a snapshot (PyTorch's "Understanding GPU memory" guide's value).
HISTORY_MAX_ENTRIES = 100_000
_history: dict[str, Any] = {"on": False, "why_not": "no history recorded (start_history)"}
_CUDA = ("reserved_bytes", "allocated_bytes", "fragmentation", "num_alloc_retries",
         "largest_free_block_bytes")
_BUDGET = ("budget_bytes", "budget_limit_bytes", "budget_headroom_bytes")


@dataclass
class OomEvent:
    """One OOM: its sizes, ``action`` (``retried at <sizes>`` or ``gave up: <why>``), ``at``
    (Unix seconds) and memory then (bytes, measured; ``fragmentation`` a fraction).
    ``sources``: how each figure was measured, or why it is None."""

    sizes: dict[str, int]
    device: str
    at: float
    error: str = ""
    action: str = ""
    vm_data_bytes: int | None = None
    rss_bytes: int | None = None
    free_heap_bytes: int | None = None
    budget_bytes: int | None = None
    budget_limit_bytes: int | None = None
    budget_headroom_bytes: int | None = None
    reserved_bytes: int | None = None
    allocated_bytes: int | None = None
    fragmentation: float | None = None
    num_alloc_retries: int | None = None
    largest_free_block_bytes: int | None = None
    snapshot: str | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON types (``results.json``, a job's result files)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def settle(self, nxt: Mapping[str, int] | None, gave_up: str) -> OomEvent:
        """Say what was done: retried at the sizes ``nxt``, else gave up because ``gave_up``."""
        self.action = (f"retried at {size_list(nxt)}"
                       if nxt is not None else f"gave up: {gave_up}")
        return self

    def put(self, name: str, value: Any, source: str, missing: str) -> None:
        """Set figure ``name`` and say how: ``source`` when there is a value, else ``missing``."""
        setattr(self, name, value)
        self.sources[name] = source if value is not None else f"none: {missing}"


class OomWatch:
    """Measures OOMs: ``call_catching_oom(..., on_oom=watch.at(sizes))`` calls the hook
    while the failed attempt's tensors are alive; :meth:`take` hands the event over."""

    def __init__(self, name: str, device: Any = None,
                 snapshot_dir: str | os.PathLike[str] | None = None) -> None:
        self.name, self.device, self.snapshot_dir = name, device, snapshot_dir
        self.pending: OomEvent | None = None

    def at(self, sizes: Mapping[str, int]) -> Callable[[BaseException], None]:
        """The ``on_oom`` hook of an attempt at ``sizes``: measures memory when called."""
        self.pending = None

        def seen(exc: BaseException) -> None:
            self.pending = capture(sizes, self.device, self.snapshot_dir, self.name)
        return seen

    def take(self, error: str) -> OomEvent | None:
        """The event of the attempt that just ran out of memory, with its error message."""
        event, self.pending = self.pending, None
        if event is not None:
            event.error = error
        return event


def capture(sizes: Mapping[str, int], device: Any = None,
            snapshot_dir: str | os.PathLike[str] | None = None, name: str = "workload") -> OomEvent:
    """Measure memory now, at the OOM (the device's and the host's bytes); ``device`` None:
    as :func:`~oomguard.probes.device.resolve_device`. A failed reading is noted, not raised."""
    dev = resolve_device(device)
    ev = OomEvent(sizes=dict(sizes), device=str(dev), at=time.time())
    steps: list[tuple[tuple[str, ...], Callable[[], None]]] = [
        (_CUDA, lambda: _cuda(ev, dev)),  # first: the nearest to the failed allocation
        (("vm_data_bytes", "rss_bytes", "free_heap_bytes"), lambda: _host(ev)),
        (_BUDGET, lambda: _budget(ev, dev))]
    if snapshot_dir is not None:
        steps.append((("snapshot",), lambda: _snapshot(ev, dev, Path(snapshot_dir), name)))
    for names, step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - a failed reading must not hide the OOM
            for n in names:
                ev.sources.setdefault(n, f"none: reading failed ({type(exc).__name__}: {exc})")
    return ev


def _host(ev: OomEvent) -> None:
    ev.put("vm_data_bytes", host.proc_status("VmData"), "measured: /proc/self/status VmData",
           "no /proc/self/status on this OS")
    rss, where = host.resident_bytes()
    ev.put("rss_bytes", rss, f"measured: {where}", f"{where} unreadable")
    ev.put("free_heap_bytes", heap.free_heap_bytes(), "measured: glibc mallinfo2().fordblks",
           "no glibc >= 2.33 (mallinfo2)")


def _budget(ev: OomEvent, dev: torch.device) -> None:
    b = active_budget()
    key = str(dev) if dev.type == "cuda" else dev.type
    if b is None or b.device != key:
        for n in _BUDGET:
            ev.put(n, None, "", f"no oomguard budget in force on {key}")
        return
    ev.put("budget_bytes", b.nbytes, "set: the budget asked for", "")
    if dev.type == "cpu":
        limit, headroom = host.data_limit(), headroom_bytes(dev)
        ev.put("budget_limit_bytes", limit, "read: RLIMIT_DATA in force", "no RLIMIT_DATA")
        ev.put("budget_headroom_bytes", headroom, "measured: RLIMIT_DATA - VmData",
               "VmData unreadable")
        return
    if dev.type != "cuda":
        ev.put("budget_limit_bytes", b.limit, "read: the limit set at the budget's entry", "")
        ev.put("budget_headroom_bytes", None, "", f"not read on {dev.type}")
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    limit = int(current_fraction(dev) * total)
    ev.put("budget_limit_bytes", limit, "read: per-process memory fraction x total", "")
    # Not headroom_bytes(): on a GPU it empties the cache, which would change what is read.
    used, what = ((ev.allocated_bytes, "allocated") if cuda_async_backend()
                  else (ev.reserved_bytes, "reserved"))
    ev.put("budget_headroom_bytes", None if used is None else limit - used,
           f"measured: cap - {what} bytes (what the cap counts)", f"{what} bytes unknown")


def cuda_view(stats: Mapping[str, Any], segments: Sequence[Mapping[str, Any]] | None,
              index: int, async_backend: bool = False) -> dict[str, tuple[Any, str]]:
    """The CUDA figures from ``torch.cuda.memory_stats(index)`` and the segments of
    ``torch.cuda.memory_snapshot()`` (None: not available): ``{field: (value, source)}``,
    a value None with a source ``none: why``."""

    def stat(key: str) -> tuple[Any, str]:
        value = stats.get(key)
        return value, f"measured: memory_stats {key}" if value is not None else \
            f"none: memory_stats has no {key}"

    out = {"reserved_bytes": stat("reserved_bytes.all.current"),
           "allocated_bytes": stat("allocated_bytes.all.current"),
           "num_alloc_retries": (None, "none: always 0 under backend:cudaMallocAsync")
           if async_backend else stat("num_alloc_retries")}
    reserved, allocated = out["reserved_bytes"][0], out["allocated_bytes"][0]
    out["fragmentation"] = ((reserved - allocated) / reserved,
                            "measured: (reserved - allocated) / reserved") \
        if reserved and allocated is not None else (None, "none: nothing reserved")
    if segments is None:
        out["largest_free_block_bytes"] = (None, "none: no memory_snapshot (backend:"
                                           "cudaMallocAsync keeps no blocks)")
        return out
    free = [(int(b["size"]), seg.get("segment_type", "?"))
            for seg in segments if seg.get("device", index) == index
            for b in seg.get("blocks", ()) if b.get("state") == "inactive"]
    size, pool = max(free) if free else (0, "no")  # 0: measured, no free block at all
    out["largest_free_block_bytes"] = (
        size, f"measured: largest inactive block in memory_snapshot() ({pool} pool)")
    return out


def _cuda(ev: OomEvent, dev: torch.device) -> None:
    if dev.type != "cuda" or not torch.cuda.is_available():
        for n in _CUDA:
            ev.put(n, None, "", f"no CUDA allocator on {dev}")
        return
    async_backend = cuda_async_backend()
    stats = torch.cuda.memory_stats(dev)  # first: the allocator as the OOM left it
    segments = None
    if not async_backend:  # its snapshot() raises: the driver's pool has no blocks to show
        try:
            segments = torch.cuda.memory_snapshot(include_traces=False)
        except TypeError:  # an older torch: no include_traces
            segments = torch.cuda.memory_snapshot()
    for name, (value, source) in cuda_view(stats, segments, dev.index or 0, async_backend).items():
        setattr(ev, name, value)
        ev.sources[name] = source


def start_history(device: Any = None) -> str | None:
    """Start recording CUDA allocation history (stacks, alloc/free events) for snapshots at
    an OOM; once per process, left on. None when recording, else why no snapshot can be."""
    if not _history["on"]:
        why = _no_history(resolve_device(device))
        if why is None:
            try:
                torch.cuda.memory._record_memory_history(max_entries=HISTORY_MAX_ENTRIES)
                _history["on"] = True
            except (RuntimeError, AttributeError, TypeError) as exc:  # torch < 2.1: other API
                why = f"could not record history: {exc}"
        _history["why_not"] = why
    return None if _history["on"] else _history["why_not"]


def _no_history(dev: torch.device) -> str | None:
    if dev.type != "cuda":
        return f"PyTorch records allocation history for CUDA only, not {dev.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return "backend:cudaMallocAsync records no history" if cuda_async_backend() else None


def _snapshot(ev: OomEvent, dev: torch.device, folder: Path, name: str) -> None:
    why = _no_history(dev) or (None if _history["on"] else _history["why_not"])
    if why is not None:
        ev.sources["snapshot"] = f"none: {why}"
        return
    folder.mkdir(parents=True, exist_ok=True)
    stem, k = re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "workload", 1
    while (folder / f"{stem}-oom{k}.pickle").exists():
        k += 1
    path = atomic_write(folder / f"{stem}-oom{k}.pickle",
                        lambda tmp: torch.cuda.memory._dump_snapshot(str(tmp)))
    ev.snapshot = str(path)
    ev.sources["snapshot"] = "written: torch.cuda.memory._dump_snapshot (pytorch.org/memory_viz)"
