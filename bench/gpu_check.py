#!/usr/bin/env python
"""Exercise every GPU path of oomguard on a real GPU: the first command to run on one.

Run it unchanged on any CUDA machine or Mac, from the repository root or anywhere::

    python bench/gpu_check.py [--device cuda:0] [--json] [--only NAME,NAME]

CUDA checks: the NVML probe against ``torch.cuda.mem_get_info``; allocator peak
by ``PeakMeter``; the fraction budget (an allocation above it raises
``torch.OutOfMemoryError``); a budget entered over 3 GiB of cached blocks; a
real CUDA OOM caught by ``call_catching_oom`` with ``memory_allocated`` back
where it was; an ``Executor`` halving run; a ``search()`` under a budget; the
search against brute force, in-process and isolated; ``oomguard bench`` with the
default budget; an isolated search whose parent holds nothing on the GPU; the
peak, budget, OOM and search checks again under ``backend:cudaMallocAsync``; a
MIG slice where one is visible, and an OOM there whose NVML report the driver
refuses (recognised as an OOM); a budget round trip and an isolated search's
parent (no CUDA context) under ``backend:cudaMallocAsync``, each in a fresh
process; the memory usable after the context (``mem_get_info`` free); a soak of
1,000 steps of the built-in training step at the recommended size (0 OOMs, the
spread of step peaks); ``oomguard run`` on the example job on this GPU
(children started by forkserver, every metric ok); a search of a whole AdamW step with
``restore=`` (state bitwise restored, 50 loop steps at ``max_ok`` with 0 OOMs, ``max_ok``
against the loop's own maximum); ``OomguardTrainer`` at the largest size that ran; the
allocator's retry counter rising when its cache must be freed; the remedies table (accumulation,
checkpointing, bf16, expandable segments in a fresh process) for a GPT-2 step that one
micro-batch cannot hold; batches planned from a long tail of lengths (``search_shapes``: at
most 6 trials, an epoch with 0 OOMs, 3x the real tokens per batch of longest-length sizing).
On a Mac: the MPS probe,
budget, peak and isolated search.

Prints one table (check / passed / seconds / what was measured, against what)
and exits 1 if any check failed ("skip": nothing here to check). Without a GPU
it says "skipped: no CUDA" and exits 0.

Every OOM here is real: the allocator refusing an allocation above a
``set_per_process_memory_fraction`` cap, as on a smaller GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_check_budgets import (  # noqa: E402 - beside this file
    _mib,
    check_async_budget_round_trip,
    check_async_isolated_parent_no_context,
    check_budget_after_cached_blocks,
    check_cuda_malloc_async,
    check_default_budget_cli,
    check_isolated_parent_holds_nothing,
    check_search_vs_brute_force,
)
from gpu_check_budgets import clean as _clean  # noqa: E402
from gpu_check_devices import (  # noqa: E402
    check_mig,
    check_mig_nvml_oom,
    check_mps_probe_and_budget,
    check_mps_search_isolated,
)
from gpu_check_remedies import check_remedies_table  # noqa: E402
from gpu_check_shapes import check_shapes  # noqa: E402
from gpu_check_soak import check_soak_recommended, check_usable_memory  # noqa: E402
from gpu_check_training import (  # noqa: E402
    check_alloc_retries_warning,
    check_search_restore_holds,
    check_trainer_largest,
)

MiB = 1024**2
GiB = 1024**3


def check_nvml_vs_mem_get_info(dev: torch.device) -> tuple[bool, str]:
    from oomguard.probes import probe

    torch.zeros(1, device=dev)  # make sure our context exists before both readings
    snap = probe(dev)
    free, total = torch.cuda.mem_get_info(dev)
    if not snap.available:
        return False, f"probe unavailable: {snap.reason}"
    if not snap.sources.get("free", "").startswith("NVML"):
        return False, f"NVML not used: {snap.extra.get('nvml')}"
    # NVML and cudaMemGetInfo read the same driver counters; other processes may
    # allocate between the two reads, hence a tolerance rather than equality.
    tol = max(256 * MiB, 0.01 * total)
    ok = abs(snap.total_bytes - total) <= tol and abs(snap.free_bytes - free) <= tol
    return ok, (f"total {_mib(snap.total_bytes)} ({snap.sources.get('total')}) / cuda "
                f"{_mib(total)}; free nvml "
                f"{_mib(snap.free_bytes)} / cuda {_mib(free)} (tol {_mib(tol)}); mapped by "
                f"{snap.extra.get('nvml_mapped_by')}; this pid {_mib(snap.process_bytes)}, "
                f"others {_mib(snap.other_processes_bytes)}, pid matched "
                f"{snap.extra.get('pid_matched')}")


def check_peak_meter(dev: torch.device) -> tuple[bool, str]:
    from oomguard.probes import PeakMeter

    _clean(dev)
    meter = PeakMeter(dev)
    meter.reset()
    x = torch.ones(256 * MiB // 4, device=dev)
    y = x * 2  # a second 256 MiB block alive at the same time: peak 512 MiB
    del x, y
    peak = meter.read()
    ok = abs(peak - 512 * MiB) <= 0.10 * 512 * MiB
    return ok, f"peak {_mib(peak)} for 2 x 256 MiB live (expect 512 MiB +-10%)"


def check_fraction_budget(dev: torch.device) -> tuple[bool, str]:
    from oomguard.engine.core.memory.budget import budget, current_fraction
    from oomguard.engine.core.memory.oom import is_oom

    _clean(dev)
    before = current_fraction(dev)  # 1.0 for "no limit", also under cudaMallocAsync
    raised = None
    with budget(2 * GiB, dev) as b:
        fits = torch.empty(1 * GiB, dtype=torch.uint8, device=dev)
        try:
            torch.empty(3 * GiB, dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError as exc:
            raised = exc
        del fits
    is_real = raised is not None and is_oom(raised)
    raised = None  # drop the traceback before freeing
    _clean(dev)
    after = current_fraction(dev)
    restored = before == after
    return is_real and restored, (f"cap {_mib(b.limit)}: 1 GiB fits, 3 GiB raised OutOfMemoryError: "
                                  f"{is_real}; fraction restored {before} -> {after}: {restored}")


def check_call_catching_oom(dev: torch.device) -> tuple[bool, str]:
    from oomguard.engine.core.memory.budget import budget
    from oomguard.engine.core.memory.oom import OOM, call_catching_oom

    _clean(dev)
    base = torch.cuda.memory_allocated(dev)

    def step() -> float:
        held = torch.ones(512 * MiB // 4, device=dev)  # pinned by this frame's traceback
        more = torch.ones(2 * GiB // 4, device=dev)
        return float(held.sum() + more.sum())

    with budget(1 * GiB, dev):
        result = call_catching_oom(step, device=dev)
    after = torch.cuda.memory_allocated(dev)
    reserved = torch.cuda.memory_reserved(dev)
    ok = isinstance(result, OOM) and after == base
    return ok, (f"{'OOM caught' if isinstance(result, OOM) else 'no OOM'}; allocated "
                f"{_mib(base)} -> {_mib(after)}, reserved after {_mib(reserved)}")


def check_executor(dev: torch.device) -> tuple[bool, str]:
    from oomguard.engine.core.execute.executor import Executor
    from oomguard.engine.core.memory.budget import budget

    _clean(dev)

    def work(batch_size: int) -> float:
        a = torch.randn(batch_size, 8 * MiB // 4, device=dev)  # 8 MiB per sample
        return float((a * a).sum().item())  # a and a*a: 16 MiB per sample at peak

    ex = Executor(device=dev)
    with budget(1 * GiB, dev):
        ex.run(work, batch_size=256, name="gpu-halving")
    rec = ex.history[-1]
    sizes = [a["batch_size"] for a in rec.attempts]
    final = rec.final["batch_size"] if rec.final else None
    # 256 -> 4 GiB, 128 -> 2 GiB, 64 -> 1 GiB (no room for the context's extras): OOM;
    # 32 -> 512 MiB fits.
    ok = final is not None and rec.retries >= 2 and final * 16 * MiB <= 1 * GiB
    return ok, f"attempts {sizes}, final {final}, retries {rec.retries}"


def check_search(dev: torch.device) -> tuple[bool, str]:
    from oomguard.engine.core.search.search import search

    _clean(dev)

    def trial(size: int) -> float:
        x = torch.randn(size, 1024, 1024, device=dev)  # 4 MiB per item
        y = x * 2  # x and y alive together: 8 MiB per item at the peak
        return float(y.mean().item())

    t0 = time.perf_counter()
    res = search(trial, start=32, size_step=8, device=dev, budget=1 * GiB, max_trials=40)
    secs = time.perf_counter() - t0
    peaks_ok = all(t.peak_bytes and t.peak_bytes > 0 for t in res.trials if t.ok)
    # The bracket must be closed (adjacent) and the maximum must respect the budget;
    # a measured peak of 8 MiB per item confirms PeakMeter and the search agree.
    per_item = max((t.peak_bytes / t.size for t in res.trials if t.ok and t.peak_bytes), default=0)
    ok = (res.max_ok is not None and res.first_oom == res.max_ok + 1 and peaks_ok
          and res.max_ok * 8 * MiB <= 1 * GiB and 7 * MiB <= per_item <= 9 * MiB)
    return ok, (f"max_ok {res.max_ok}, first_oom {res.first_oom}, {len(res.trials)} trials in "
                f"{secs:.1f} s, safe {res.recommendation.safe if res.recommendation else '-'}"
                f" (ideal <= {GiB // (8 * MiB)}), peak/item {_mib(per_item)}")


def check_job_run(dev: torch.device) -> tuple[bool, str]:
    """``oomguard run`` on the example job with ``device`` set to this GPU, as a user runs it:
    every metric must finish in its (forkserver-started) child, which a fork after the
    parent touched CUDA would not."""
    import subprocess
    import tempfile

    from oomguard.engine.jobs.example import example_text
    from oomguard.engine.jobs.journal import replay

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.toml"
        job.write_text(example_text().replace('device = "cpu"', f'device = "{dev}"', 1),
                       encoding="utf-8")
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "oomguard", "run", str(job), "--out",
                               str(Path(tmp) / "out"), "--cache", str(Path(tmp) / "sizes.json"),
                               "--json"], capture_output=True, text=True, timeout=900)
        secs = time.perf_counter() - t0
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            return False, f"exit {done.returncode} in {secs:.0f} s: {tail[:200]}"
        summary = json.loads(done.stdout)
        methods = {e.get("start_method") for e in replay(Path(tmp) / "out" / "journal.jsonl")
                   if e["event"] == "start"}
    tasks = summary["tasks"]
    ok = all(t["status"] == "ok" for t in tasks.values()) and methods == {"forkserver"}
    return ok, (f"{len(tasks)} metrics ok in {secs:.0f} s, children by {sorted(methods)}, "
                + ", ".join(f"{k} peak {_mib(t.get('peak_bytes'))}" for k, t in tasks.items()))


Check = Callable[[torch.device], "tuple[bool | None, str]"]
CHECKS: list[tuple[str, Check]] = [
    ("nvml probe vs mem_get_info", check_nvml_vs_mem_get_info),
    ("allocator peak (PeakMeter)", check_peak_meter),
    ("fraction budget -> OOM", check_fraction_budget),
    ("budget over 3 GiB of cached blocks", check_budget_after_cached_blocks),
    ("call_catching_oom cleans up", check_call_catching_oom),
    ("executor halving", check_executor),
    ("search under budget", check_search),
    ("search vs brute force (in-process, isolated)", check_search_vs_brute_force),
    ("bench with the default budget", check_default_budget_cli),
    ("isolated search: parent holds nothing", check_isolated_parent_holds_nothing),
    ("backend:cudaMallocAsync", check_cuda_malloc_async),
    ("MIG slice", check_mig),
    ("MIG slice: OOM with NVML refused", check_mig_nvml_oom),
    ("cudaMallocAsync budget round trip", check_async_budget_round_trip),
    ("cudaMallocAsync isolated parent: no context", check_async_isolated_parent_no_context),
    ("usable memory after the context", check_usable_memory),
    ("soak: 1000 steps at the recommended size", check_soak_recommended),
    ("oomguard run (example job)", check_job_run),
    ("training: search(restore=) holds for the loop", check_search_restore_holds),
    ("training: OomguardTrainer at the largest", check_trainer_largest),
    ("allocator retries: the early warning", check_alloc_retries_warning),
    ("remedies priced by speed (table)", check_remedies_table),
    ("shapes: batches planned from the lengths", check_shapes),
]
MPS_CHECKS: list[tuple[str, Check]] = [
    ("mps probe, budget and peak", check_mps_probe_and_budget),
    ("mps search (isolated by default)", check_mps_search_isolated),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0", help="CUDA device to check (default cuda:0)")
    ap.add_argument("--json", action="store_true", help="print results as JSON")
    ap.add_argument("--only", default=None,
                    help="comma-separated check names (or their starts) to run, e.g. "
                         "'allocator peak,search under budget'")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        checks = CHECKS
        dev = torch.device(args.device)
        if dev.type != "cuda":
            print(f"--device must be a CUDA device, got {args.device!r}", file=sys.stderr)
            return 2
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        header = f"{torch.cuda.get_device_name(dev)} ({dev}), torch {torch.__version__}"
    elif torch.backends.mps.is_available():
        checks, dev = MPS_CHECKS, torch.device("mps")
        header = f"Apple MPS, torch {torch.__version__}"
    else:
        print(f"skipped: no CUDA (and no MPS) here (torch {torch.__version__}, cuda "
              f"{torch.version.cuda}): nothing to check")
        return 0
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        checks = [(n, f) for n, f in checks if any(n.startswith(w) for w in wanted)]
        if not checks:
            print(f"--only {args.only!r} names no check", file=sys.stderr)
            return 2
    torch.ones(4, 4).sum()  # CPU warm-up, as elsewhere
    rows = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            ok, measured = fn(dev)
        except Exception as exc:  # noqa: BLE001 - one broken path must not hide the others
            ok, measured = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            traceback.print_exc(file=sys.stderr)
        rows.append({"check": name, "passed": ok, "measured": measured,
                     "seconds": round(time.perf_counter() - t0, 2)})
    backend = (torch.cuda.get_allocator_backend() if dev.type == "cuda"
               and hasattr(torch.cuda, "get_allocator_backend") else None)
    if args.json:
        print(json.dumps({"device": header, "allocator_backend": backend, "checks": rows},
                         indent=2))
    else:
        print(header + (f", allocator {backend}" if backend else ""))
        w = max(len(r["check"]) for r in rows)
        print(f"{'check'.ljust(w)}  passed  seconds  measured")
        for r in rows:
            verdict = "skip" if r["passed"] is None else "yes" if r["passed"] else "NO"
            print(f"{r['check'].ljust(w)}  {verdict:6}  {r['seconds']:7.2f}  {r['measured']}")
    return 0 if all(r["passed"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
