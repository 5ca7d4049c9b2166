"""CUDA budget and search checks of ``bench/gpu_check.py``: what users rely on when they
search without knowing their GPU's memory.

Each check returns ``(passed, measured)``; ``measured`` says what was checked and
against what. Every OOM is real: the caching allocator refusing an allocation
above a ``set_per_process_memory_fraction`` cap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MiB = 1024**2
GiB = 1024**3
ROOT = Path(__file__).resolve().parents[1]


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def clean(dev: torch.device) -> None:
    """Drop cached blocks and peaks so each check starts from what it allocates itself."""
    import gc

    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)


@dataclass
class EightMiBPerItem:
    """A trial whose peak is 8 MiB per item (two live 4 MiB tensors); module-level and
    picklable, so isolated children run it too."""

    device: str
    name: str = "8MiB-per-item"

    def __call__(self, size: int) -> float:
        x = torch.randn(size, 1024, 1024, device=self.device)
        y = x * 2
        return float(y.mean().item())


def check_budget_after_cached_blocks(dev: torch.device) -> tuple[bool, str]:
    """A budget entered while 3 GiB of freed blocks sit in the cache must not grant them."""
    from oomguard.engine.core.memory.budget import budget
    from oomguard.engine.core.memory.oom import is_oom

    clean(dev)
    blocks = [torch.empty(256 * MiB, dtype=torch.uint8, device=dev) for _ in range(12)]
    del blocks
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    raised = None
    with budget(1 * GiB, dev) as b:
        allocated = torch.cuda.memory_allocated(dev)
        try:
            torch.empty(int(1.5 * GiB), dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError as exc:
            raised = exc
    real = raised is not None and is_oom(raised)
    raised = None
    clean(dev)
    ok = cached >= 3 * GiB - 64 * MiB and b.limit <= allocated + 1 * GiB + 2 * MiB and real
    return ok, (f"{_mib(cached)} cached at entry; cap {_mib(b.limit)} <= allocated "
                f"{_mib(allocated)} + 1 GiB + 2 MiB: {b.limit <= allocated + GiB + 2 * MiB}; "
                f"1.5 GiB under a 1 GiB budget raised OutOfMemoryError: {real}")


def check_search_vs_brute_force(dev: torch.device) -> tuple[bool, str]:
    """search() under a 1 GiB fraction budget, in-process and isolated, against every size
    from 1 up run in-process, and the isolated answer's boundary run in fresh children."""
    from oomguard.engine.core.memory.budget import budget
    from oomguard.engine.core.search.isolate import IsolatedRunner
    from oomguard.engine.core.search.search import search
    from oomguard.engine.core.search.trial import run_trial

    fn = EightMiBPerItem(str(dev))
    clean(dev)
    brute = 0
    with budget(1 * GiB, dev):
        for size in range(1, 1024):
            if not run_trial(fn, size, dev).ok:
                break
            brute = size
    clean(dev)
    t0 = time.perf_counter()
    here = search(fn, start=32, size_step=8, device=dev, budget=1 * GiB)
    t_here = time.perf_counter() - t0
    t0 = time.perf_counter()
    iso = search(fn, start=32, size_step=8, device=dev, budget=1 * GiB, isolate=True)
    t_iso = time.perf_counter() - t0
    with IsolatedRunner(fn, device=dev, budget=1 * GiB) as run:
        at_max, above = run(iso.max_ok).ok, run(iso.max_ok + 1).ok
    ok = here.max_ok == brute and at_max and not above and iso.first_oom == iso.max_ok + 1
    return ok, (f"brute force (every size from 1, in-process) {brute}; search in-process "
                f"{here.max_ok} ({len(here.trials)} trials, {t_here:.1f} s); isolated "
                f"{iso.max_ok} ({len(iso.trials)} trials, {t_iso:.1f} s); fresh children: "
                f"{iso.max_ok} {'fits' if at_max else 'OOM'}, {iso.max_ok + 1} "
                f"{'fits' if above else 'OOM'}")


def check_default_budget_cli(dev: torch.device) -> tuple[bool, str]:
    """``oomguard bench`` without --budget on this GPU: the default is measured after the
    warm-up, so an idle GPU must not refuse it (reserved + budget > total)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "oomguard", "bench", "--device", str(dev), "--max-size", "64",
             "--seq-len", "128", "--out", str(Path(tmp) / "out"), "--json"],
            capture_output=True, text=True, timeout=600, cwd=ROOT)
    first = next((ln for ln in done.stderr.splitlines() if "searching" in ln), "")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"exit {done.returncode}: {tail[:200]}"
    result = json.loads(done.stdout)
    ok = result.get("max_ok") is not None and "device's own limit" in first
    return ok, (f"exit 0, max_ok {result.get('max_ok')} of --max-size 64, budget "
                f"{result.get('budget_bytes')}; first line: {first.strip()[:120]}")


_PARENT_SCRIPT = """
import json, sys, torch
from oomguard.engine.core.search.search import search
from oomguard.metrics.train_step import TrainStep
step = TrainStep(model="tiny-gpt2", seq_len=128, device=sys.argv[1])
step.describe()  # as `oomguard bench --isolate` does: on the meta device
held = []
def look(trial):
    held.append(torch.cuda.memory_reserved() if torch.cuda.is_initialized() else 0)
res = search(step, start=4, size_step=4, max_size=16, device=sys.argv[1], isolate=True,
             on_trial=look)
print(json.dumps({"held": held, "initialized": torch.cuda.is_initialized(),
                  "max_ok": res.max_ok}))
"""


def check_isolated_parent_holds_nothing(dev: torch.device) -> tuple[bool, str]:
    """``bench --isolate``: while the children measure, the parent holds nothing on the GPU
    (no model, no optimizer state, no CUDA context)."""
    done = subprocess.run([sys.executable, "-c", _PARENT_SCRIPT, str(dev)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"exit {done.returncode}: {tail[:200]}"
    got = json.loads(done.stdout.strip().splitlines()[-1])
    ok = got["max_ok"] is not None and not any(got["held"])
    return ok, (f"parent reserved during {len(got['held'])} isolated trials: "
                f"{[_mib(h) for h in got['held']]}; CUDA initialised in the parent: "
                f"{got['initialized']}; max_ok {got['max_ok']}")


ASYNC_CHECKS = ("allocator peak", "fraction budget", "call_catching_oom", "search under budget")


def check_cuda_malloc_async(dev: torch.device) -> tuple[bool, str]:
    """The peak, budget, OOM and search checks again under
    ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``, whose cap counts bytes in use."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device",
                           str(dev), "--json", "--only", ",".join(ASYNC_CHECKS)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    try:
        got = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"exit {done.returncode}, no table: {tail[:200]}"
    rows = got["checks"]
    backend = got.get("allocator_backend")
    ok = backend == "cudaMallocAsync" and len(rows) == len(ASYNC_CHECKS) and all(
        r["passed"] for r in rows)
    return ok, f"backend {backend}: " + "; ".join(
        f"{r['check']} {'ok' if r['passed'] else 'FAILED'} ({r['measured'][:80]})" for r in rows)


_ASYNC_ROUND_TRIP = """
import json, sys, torch
from oomguard.engine.core.memory.budget import budget, current_fraction
dev = torch.device(sys.argv[1])
torch.zeros(1, device=dev)
out = {"backend": torch.cuda.get_allocator_backend(),
       "raw_before": torch.cuda.get_per_process_memory_fraction(dev)}
try:
    with budget(256 * 1024**2, dev):
        pass
    out["no_limit_after"] = current_fraction(dev)
    torch.cuda.set_per_process_memory_fraction(0.5, dev)  # the user's own, not through oomguard
    with budget(256 * 1024**2, dev):
        pass
    out["half_after"] = torch.cuda.get_per_process_memory_fraction(dev)
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

ASYNC_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}


def _json_child(script: str, dev: torch.device, env: dict[str, str]) -> dict | str:
    """Run ``script`` in a fresh Python with ``env`` added: its last stdout line as JSON,
    or why there is none."""
    done = subprocess.run([sys.executable, "-c", script, str(dev)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=dict(os.environ, **env))
    if done.returncode != 0 or not done.stdout.strip():
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"exit {done.returncode}: {tail[:200]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_async_budget_round_trip(dev: torch.device) -> tuple[bool, str]:
    """Under ``backend:cudaMallocAsync`` a budget gives the user's fraction back without an
    error: with no limit set (torch's getter says limit / total, about 2e8) and with 0.5."""
    got = _json_child(_ASYNC_ROUND_TRIP, dev, ASYNC_ENV)
    if isinstance(got, str):
        return False, got
    ok = (got["backend"] == "cudaMallocAsync" and "error" not in got
          and got.get("no_limit_after") == 1.0
          # the limit is int(0.5 * total) bytes: read back, a hair under 0.5
          and abs(got.get("half_after", 0.0) - 0.5) < 1e-6)
    return ok, (f"backend {got['backend']}; torch's fraction with no limit {got['raw_before']:.3g}; "
                f"after a budget: {got.get('no_limit_after')} (expect 1.0), user's 0.5 -> "
                f"{got.get('half_after')}" + (f"; {got['error']}" if "error" in got else ""))


_ASYNC_PARENT_SCRIPT = """
import json, sys, torch
from oomguard.engine.core.search.search import search
from oomguard.metrics.train_step import TrainStep
from oomguard.probes import probe
dev = torch.device(sys.argv[1])
index = dev.index or 0
context = lambda: bool(torch._C._cuda_hasPrimaryContext(index))
step = TrainStep(model="tiny-gpt2", seq_len=128, device=str(dev))
step.describe()
snap = probe(dev)  # what `oomguard bench --isolate` shows before it searches
seen = [context()]
res = search(step, start=4, size_step=4, max_size=16, device=str(dev), isolate=True,
             on_trial=lambda trial: seen.append(context()))
print(json.dumps({"context": seen, "max_ok": res.max_ok, "free": snap.free_bytes,
                  "backend": torch.cuda.get_allocator_backend()}))
"""


def check_async_isolated_parent_no_context(dev: torch.device) -> tuple[bool, str]:
    """Under ``backend:cudaMallocAsync`` an isolated search's parent, probe included, holds
    no CUDA context (torch's fraction getter would create one: ~0.5 GiB the children lack)."""
    got = _json_child(_ASYNC_PARENT_SCRIPT, dev, ASYNC_ENV)
    if isinstance(got, str):
        return False, got
    ok = got["backend"] == "cudaMallocAsync" and got["max_ok"] is not None and \
        not any(got["context"])
    return ok, (f"backend {got['backend']}; parent context after probe and each of "
                f"{len(got['context']) - 1} trials: {got['context']}; probe free "
                f"{_mib(got['free'])}; max_ok {got['max_ok']}")
