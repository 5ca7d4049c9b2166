"""MIG and Apple MPS checks of ``bench/gpu_check.py``.

A check returns ``(passed, measured)``, or ``(None, why)`` when this machine has
nothing for it to check (no MIG slice visible): the table then says "skip".
"""

from __future__ import annotations

import torch
from gpu_check_budgets import _mib

MiB = 1024**2
GiB = 1024**3


def check_mig(dev: torch.device) -> tuple[bool | None, str]:
    """A MIG slice is probed as the slice (its own total, matched by its ``MIG-`` UUID),
    never as the whole card: against ``mem_get_info``, which CUDA answers for the slice."""
    from oomguard.probes import nvml, probe

    migs = nvml.mig_devices()
    if not migs:
        return None, "no MIG-enabled GPU on this machine (NVML reports none)"
    torch.zeros(1, device=dev)
    snap = probe(dev)
    free, total = torch.cuda.mem_get_info(dev)
    mapped = snap.extra.get("nvml_mapped_by")
    if snap.extra.get("mig_index") is None:
        # MIG is on, but this process sees a whole GPU that has none enabled, or no slice.
        return None, (f"{len(migs)} MIG slice(s) exist, {dev} is not one (mapped by {mapped}); "
                      "run with CUDA_VISIBLE_DEVICES=MIG-<uuid> to check a slice")
    tol = max(256 * MiB, 0.02 * total)
    ok = "mig uuid" in str(mapped).lower() and \
        abs(snap.total_bytes - total) <= tol and abs(snap.free_bytes - free) <= tol
    return ok, (f"slice {snap.extra.get('mig_profile')} ({snap.extra.get('mig_uuid')}) mapped by "
                f"{mapped}; total probe {_mib(snap.total_bytes)} / cuda {_mib(total)}; free probe "
                f"{_mib(snap.free_bytes)} / cuda {_mib(free)} (tol {_mib(tol)}); "
                f"sources {snap.sources.get('total')}")


def check_mig_nvml_oom(dev: torch.device) -> tuple[bool | None, str]:
    """A real OOM on a MIG slice is recognised: the caching allocator's OOM path asks NVML
    about the parent GPU's processes, which a non-root user may not query, and then raises
    ``NVML_SUCCESS == r INTERNAL ASSERT FAILED`` instead of ``OutOfMemoryError``."""
    from oomguard.engine.core.memory.budget import budget
    from oomguard.engine.core.memory.oom import is_oom
    from oomguard.probes import probe

    torch.zeros(1, device=dev)
    snap = probe(dev)
    if snap.extra.get("mig_index") is None:
        return None, f"{dev} is not a MIG slice (run with CUDA_VISIBLE_DEVICES=MIG-<uuid>)"
    raised = None
    with budget(256 * MiB, dev):
        try:
            torch.empty(1 * GiB, dtype=torch.uint8, device=dev)
        except RuntimeError as exc:
            raised = exc
    kind = type(raised).__name__ if raised is not None else "nothing"
    first = str(raised).splitlines()[0][:90] if raised is not None else ""
    recognised = raised is not None and is_oom(raised)
    raised = None
    torch.cuda.empty_cache()
    return recognised, (f"slice {snap.extra.get('mig_profile')}: 1 GiB under a 256 MiB budget "
                        f"raised {kind} ({first}); recognised as an OOM: {recognised}")


def check_mps_probe_and_budget(dev: torch.device) -> tuple[bool, str]:
    """On a Mac: the MPS probe, a 256 MiB budget (``torch.mps.set_per_process_memory_fraction``)
    that a 1 GiB tensor runs out of as a recognised OOM, the fraction restored after it,
    and a peak measured in the units that cap counts."""
    from oomguard.engine.core.memory.budget import budget, current_fraction
    from oomguard.engine.core.memory.oom import is_oom
    from oomguard.probes import PeakMeter, probe

    snap = probe("mps")
    before = current_fraction(dev)
    meter = PeakMeter(dev)
    meter.reset()
    x = torch.ones(256 * MiB // 4, device=dev)
    torch.mps.synchronize()
    peak = meter.read()
    del x
    raised = None
    with budget(256 * MiB, dev) as b:
        try:
            y = torch.ones(GiB // 4, device=dev)
            torch.mps.synchronize()
            del y
        except RuntimeError as exc:
            raised = exc
    real = raised is not None and is_oom(raised)
    first = str(raised).splitlines()[0][:80] if raised is not None else "nothing raised"
    raised = None
    torch.mps.empty_cache()
    after = current_fraction(dev)
    ok = snap.available and real and before == after and peak >= 200 * MiB
    return ok, (f"probe {_mib(snap.free_bytes)} free of {_mib(snap.total_bytes)}; cap "
                f"{_mib(b.limit)}: 1 GiB raised a recognised OOM: {real} ({first}); fraction "
                f"{before} -> {after}; peak {_mib(peak)} for 256 MiB (driver allocated)")


def check_mps_search_isolated(dev: torch.device) -> tuple[bool, str]:
    """``oomguard search --device mps`` runs isolated by default (a tensor over 4 GiB aborts
    an MPS process) under the default budget, and finds a size."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "oomguard", "search", "--metric", "loss", "--device", "mps",
             "--samples", "16", "--seq-len", "64", "--max-size", "16", "--out",
             str(Path(tmp) / "out"), "--json"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"exit {done.returncode}: {tail[:200]}"
    result = json.loads(done.stdout)
    ok = result["mode"] == "isolated" and result["max_ok"] is not None
    return ok, (f"mode {result['mode']}, max_ok {result['max_ok']}, budget "
                f"{_mib(result['budget_bytes'])}, {len(result['trials'])} trials")
