"""Isolated trials: first-trial latency and reproducible answers, in one table.

Workload: one training step (forward, backward, Adam) of a byte-level GRU language model
(bench/peer_workloads.py ``RnnLmStep(cell="gru", seq_len=224, hidden=256)``), searched for
its largest batch under a 120 MiB CPU budget. Every number comes from fresh interpreters
(subprocesses of this script), so no measurement inherits another's forkserver or heap.

Rows:

- first trial, forkserver started on demand: the runner is built after the parent's own
  work (importing transformers and reading a model config, what ``oomguard bench`` does
  before its first trial), so the first trial waits for the forkserver to start and
  import torch; seconds from asking for the trial to its result (measured);
- first trial, forkserver started ahead: the same, with the runner built before that
  work, which starts the forkserver in the background;
- later trials: the same runner's second trial (fork, the child's warm-up, the step);
- the isolated search's answer (largest size that ran) in ``--runs`` fresh interpreters;
- the fresh-process answer ("brute force"): each size near those answers in a fresh
  interpreter of its own, ``--repeat`` times: oomguard's mmap threshold
  (``return_freed_memory_to_os()``), the warm-up, the budget, one step, no search
  machinery. Its maximum is the largest size that fitted every time with every smaller
  size of the window; the sizes that fitted in some runs and not others are listed, with
  the free heap (``mallinfo2``) at each budget entry.

    .venv/bin/python bench/bench_isolate.py [--runs 5] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

MiB = 1024**2
BUDGET = 120 * MiB
SIZE = 8  # the latency rows' trial size (small: the start-up is what they measure)


def _workload() -> Any:
    # bench/ is sys.path[0] when this file runs as a script, and forkserver children get
    # the same sys.path, so they unpickle the workload from the same module.
    from peer_workloads import RnnLmStep

    return RnnLmStep(cell="gru", seq_len=224, hidden=256)


def _parent_work() -> float:
    """What ``oomguard bench`` does before its first trial: import transformers and read
    the model's config. Seconds (measured)."""
    t0 = time.perf_counter()
    from oomguard.metrics.models import model_config

    model_config("tiny-gpt2")
    return time.perf_counter() - t0


def one_latency(ahead: bool) -> dict[str, Any]:
    """In this (fresh) interpreter: the first and second trial's seconds, with the
    runner built before (``ahead``) or after the parent's own work."""
    from oomguard.engine.core.search.isolate import IsolatedRunner

    workload = _workload()
    t0 = time.perf_counter()
    runner = IsolatedRunner(workload, budget=BUDGET) if ahead else None
    work = _parent_work()
    if runner is None:
        runner = IsolatedRunner(workload, budget=BUDGET)
    t1 = time.perf_counter()
    first = runner(SIZE)
    t2 = time.perf_counter()
    second = runner(SIZE)
    t3 = time.perf_counter()
    assert first.ok and second.ok, (first.error, second.error)
    return {"work": work, "first": t2 - t1, "second": t3 - t2, "total": t2 - t0,
            "second_in_child": second.seconds}


def one_search() -> dict[str, Any]:
    """In this (fresh) interpreter: one isolated search; its answer and trials."""
    import oomguard

    t0 = time.perf_counter()
    result = oomguard.search(_workload(), budget=BUDGET, isolate=True, max_size=4096)
    return {"max_ok": result.max_ok, "first_oom": result.first_oom,
            "trials": [[t.size, t.ok] for t in result.trials],
            "seconds": time.perf_counter() - t0}


def one_fresh(size: int) -> dict[str, Any]:
    """In this (fresh) interpreter: the threshold, the warm-up, the budget, one step."""
    from oomguard.engine.core.memory.budget import budget
    from oomguard.engine.core.memory.heap import free_heap_bytes, return_freed_memory_to_os
    from oomguard.engine.core.memory.oom import OOM, call_catching_oom

    return_freed_memory_to_os()  # before the warm-up, as search(budget=) and a child do
    workload = _workload()
    workload.warmup()
    with budget(BUDGET):
        free = free_heap_bytes()
        outcome = call_catching_oom(workload, size)
    return {"size": size, "ok": not isinstance(outcome, OOM), "free_heap_at_entry": free}


def _run(*args: str) -> dict[str, Any]:
    """This script with ``args`` in a fresh interpreter; the JSON on its last stdout line."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def brute_force(answers: list[int], repeat: int
                ) -> tuple[dict[int, list[bool]], int | None, list[int]]:
    """Each size from min(answers) - 1 to max(answers) + 1 (widened until a size fails
    every time), ``repeat`` fresh interpreters each: ``(outcomes by size, maximum, free
    heap bytes at each budget entry)``."""
    low, high = min(answers) - 1, max(answers) + 1
    outcomes: dict[int, list[bool]] = {}
    free: list[int] = []
    size = low
    while size <= high or any(outcomes[size - 1]):
        runs = [_run("--fresh", str(size)) for _ in range(repeat)]
        outcomes[size] = [bool(r["ok"]) for r in runs]
        free += [r["free_heap_at_entry"] for r in runs if r["free_heap_at_entry"] is not None]
        size += 1
        if size > high + 8:  # a workload that keeps fitting: stop looking
            break
    best = None
    for size in sorted(outcomes):
        if not all(outcomes[size]):
            break
        best = size
    return outcomes, best, free


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="isolated searches (5)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="fresh interpreters per brute-force size (2)")
    parser.add_argument("--latency-runs", type=int, default=3,
                        help="fresh interpreters per latency row (3)")
    args = parser.parse_args()
    lat: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(args.latency_runs):  # interleaved: machine load hits both rows alike
        for ahead in (False, True):
            lat[ahead].append(_run("--latency", "ahead" if ahead else "demand"))
    searches = [_run("--search") for _ in range(args.runs)]
    answers = [s["max_ok"] for s in searches]
    outcomes, best, free = brute_force(answers, args.repeat)

    def med(ahead: bool, key: str) -> str:
        return f"{_median([r[key] for r in lat[ahead]]):.2f}"

    fresh = "; ".join(f"{size}: " + "/".join("ok" if ok else "oom" for ok in oks)
                      for size, oks in sorted(outcomes.items()))
    top, count = Counter(answers).most_common(1)[0]
    varied = [size for size, oks in sorted(outcomes.items()) if len(set(oks)) > 1]
    rows = [
        ("parent's own work before the first trial, s", f"{med(False, 'work')} / "
         f"{med(True, 'work')}"),
        ("first trial, forkserver started on demand, s", med(False, "first")),
        ("first trial, forkserver started ahead, s", med(True, "first")),
        ("runner built to first result, on demand / ahead, s",
         f"{med(False, 'total')} / {med(True, 'total')}"),
        ("later trial (fork, warm-up, step), s; of it in the child",
         f"{med(True, 'second')}; {med(True, 'second_in_child')}"),
        (f"isolated search answer, {len(answers)} runs", " ".join(map(str, answers))),
        ("isolated search trials (size, ok), first run",
         " ".join(f"{s}{'+' if ok else 'x'}" for s, ok in searches[0]["trials"])),
        ("isolated search seconds, median", f"{_median([s['seconds'] for s in searches]):.1f}"),
        (f"fresh process per size ({args.repeat} each)", fresh),
        ("sizes whose fresh outcome varied", " ".join(map(str, varied)) or "none"),
        ("free heap at budget entry (fresh), MiB",
         f"{min(free) / MiB:.1f}-{max(free) / MiB:.1f}" if free else "unknown"),
        ("fresh-process maximum (brute force)", str(best)),
        ("verdict", f"{count}/{len(answers)} identical ({top}); "
         + ("equal to" if count == len(answers) and top == best else "NOT equal to")
         + " brute force"),
    ]
    print(f"GRU LM step (seq 224, hidden 256) under {BUDGET // MiB} MiB; medians of "
          f"{args.latency_runs} fresh interpreters for the latency rows")
    print("| measurement | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--latency":
        print(json.dumps(one_latency(sys.argv[2] == "ahead")))
    elif len(sys.argv) > 1 and sys.argv[1] == "--search":
        print(json.dumps(one_search()))
    elif len(sys.argv) > 1 and sys.argv[1] == "--fresh":
        print(json.dumps(one_fresh(int(sys.argv[2]))))
    else:
        main()
