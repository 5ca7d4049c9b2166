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

``--conv`` prints another table: a conv net (conv-BN-ReLU residual blocks, AdamW, 32 x 32
images) whose training step is a closure, searched in its own process under an outer CPU
budget as a training script does it (``with oomguard.budget(...)``, then ``search(step)``,
then the loop at the answer in the same process and under the same budget). oneDNN keeps
compiled kernels for every input shape a trial ran, so trials in the process itself leave
them behind; forked trials (the default) leave nothing. Rows: the search's answer, trials,
seconds per trial, what it left in the process (``VmData``), the loop's OOMs in 10 steps at
the answer; the fresh-process maximum (a fresh interpreter per size: warm-up at 1, the budget,
10 optimizer steps; bisected); the same in-process search with oneDNN's cache off from the
start (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``, read once, at the first kernel) and with oneDNN
off (``torch.backends.mkldnn.enabled = False``), neither of which the user's loop runs.

    .venv/bin/python bench/bench_isolate.py --conv
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


CONV_BUDGET = 300 * MiB
CONV_STEPS = 10  # optimizer steps the fresh-process maximum runs


def _conv_step() -> Any:
    """The documented adoption for a conv net: a closure over its model and AdamW (one
    optimizer step of ``n`` generated 32 x 32 images per call)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, c_in: int, c_out: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.b1, self.b2 = nn.BatchNorm2d(c_out), nn.BatchNorm2d(c_out)
            self.c2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                       nn.BatchNorm2d(c_out))
                         if stride != 1 or c_in != c_out else nn.Identity())

        def forward(self, x: Any) -> Any:
            return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                          Block(32, 32, 1), Block(32, 64, 2), Block(64, 128, 2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(n: int) -> float:
        x, y = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _conv_start(mkldnn: bool = True) -> Any:
    """This interpreter as a training script starts: one thread, the threshold the search's
    budget sets, the model built and run once at 1."""
    import torch

    from oomguard.engine.core.memory.heap import return_freed_memory_to_os

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = mkldnn
    return_freed_memory_to_os()
    step = _conv_step()
    step(1)
    return step


def one_conv_search(mode: str, size_step: int) -> dict[str, Any]:
    """In this (fresh) interpreter: the outer budget, ``search(step)`` with trials ``mode``
    (``forked``, or ``in-process`` with ``fork=False``; ``mkldnn-off``: in-process with oneDNN
    off), then the loop at the answer; ``size_step`` 0: guided, else expand-bisect."""
    import oomguard
    from oomguard.engine.core.memory.oom import OOM, call_catching_oom
    from oomguard.probes import host

    step = _conv_start(mkldnn=mode != "mkldnn-off")
    with oomguard.budget(CONV_BUDGET):
        before = host.proc_status("VmData") or 0
        t0 = time.perf_counter()
        result = oomguard.search(step, fork=mode == "forked", size_step=size_step or None)
        seconds = time.perf_counter() - t0
        left = (host.proc_status("VmData") or 0) - before
        ooms = sum(isinstance(call_catching_oom(step, result.max_ok), OOM)
                   for _ in range(CONV_STEPS))
    return {"max_ok": result.max_ok, "trials": len(result.trials), "seconds": seconds,
            "per_trial": seconds / len(result.trials), "left": left, "ooms": ooms,
            "mode": result.mode}


def one_conv_fresh(size: int) -> dict[str, Any]:
    """In this (fresh) interpreter: the warm-up at 1, the budget, CONV_STEPS steps at ``size``;
    the index of the step that ran out of memory, or None."""
    import oomguard
    from oomguard.engine.core.memory.oom import OOM, call_catching_oom

    step = _conv_start()
    with oomguard.budget(CONV_BUDGET):
        for i in range(CONV_STEPS):
            if isinstance(call_catching_oom(step, size), OOM):
                return {"size": size, "failed_at": i}
    return {"size": size, "failed_at": None}


def one_conv_cost(rounds: int = 3) -> dict[str, Any]:
    """In this (fresh) interpreter, under the budget: the same sizes tried in this process and
    in forks, in turn, ``rounds`` times; CPU seconds (this process and its children) and wall
    seconds per trial, by (mode, size)."""
    import resource

    import torch

    import oomguard
    from oomguard.engine.core.memory.oom import gc_frozen
    from oomguard.engine.core.search.forked import ForkedRunner
    from oomguard.engine.core.search.trial import run_trial

    def cpu() -> float:
        own, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                           resource.RUSAGE_CHILDREN))
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    step = _conv_start()
    dev = torch.device("cpu")
    out: dict[str, list[list[float]]] = {}
    with gc_frozen(), oomguard.budget(CONV_BUDGET):
        runners = {"in-process": lambda n: run_trial(step, n, dev),
                   "forked": ForkedRunner(step, dev, None, 600.0)}
        for _ in range(rounds):
            for size in (16, 64):
                for mode, runner in runners.items():
                    c, t = cpu(), time.perf_counter()
                    assert runner(size).ok
                    out.setdefault(f"{mode} {size}", []).append(
                        [cpu() - c, time.perf_counter() - t])
    return out


def conv_table() -> None:
    """The conv-net table (``--conv``): searches and the fresh-process maximum, each in fresh
    interpreters."""
    runs = {(mode, size_step): _run("--conv-search", mode, str(size_step))
            for size_step in (0, 8) for mode in ("in-process", "forked")}
    off = _run("--conv-search", "in-process", "0", env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"})
    no_dnn = _run("--conv-search", "mkldnn-off", "0")
    low, high = min(r["max_ok"] for r in runs.values()) // 2, max(
        r["max_ok"] for r in runs.values()) + 16
    assert _run("--conv-fresh", str(low))["failed_at"] is None
    while _run("--conv-fresh", str(high))["failed_at"] is None:
        low, high = high, high * 2
    while high - low > 1:  # fitting is monotone in the size
        mid = (low + high) // 2
        low, high = (mid, high) if _run("--conv-fresh", str(mid))["failed_at"] is None else (
            low, mid)
    edge = _run("--conv-fresh", str(high))
    print(f"Conv net (3 residual blocks, 32 x 32, AdamW; a closure step) under "
          f"{CONV_BUDGET // MiB} MiB, one thread; the loop after the search: {CONV_STEPS} steps "
          f"at the answer, same process, same budget")
    print("| trials | strategy | answer | / fresh max | trials run | s per trial | left in "
          "the process, MiB | loop OOMs |\n|---|---|---|---|---|---|---|---|")
    for (mode, size_step), r in runs.items():
        print(f"| {mode} | {'expand-bisect +8' if size_step else 'guided'} | {r['max_ok']} | "
              f"{r['max_ok'] / low:.2f} | {r['trials']} | {r['per_trial']:.2f} | "
              f"{r['left'] / MiB:.1f} | {r['ooms']}/{CONV_STEPS} |")
    for name, r in (("in-process, oneDNN cache off from the start", off),
                    ("in-process, oneDNN off", no_dnn)):
        print(f"| {name} | guided | {r['max_ok']} | {r['max_ok'] / low:.2f} | {r['trials']} | "
              f"{r['per_trial']:.2f} | {r['left'] / MiB:.1f} | {r['ooms']}/{CONV_STEPS} |")
    print(f"| fresh process per size ({CONV_STEPS} steps) | bisected | {low} | 1.00 | | | | "
          f"{high} ran out at step {edge['failed_at']} |")
    cost = _run("--conv-cost")
    print("\nThe same sizes in this process and in forks, in turn (3 rounds; medians; the "
          "process's and its children's CPU)")
    print("| trial | CPU s | wall s |\n|---|---|---|")
    for key, rows in cost.items():
        print(f"| {key} rows | {_median([r[0] for r in rows]):.3f} | "
              f"{_median([r[1] for r in rows]):.3f} |")


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


def _run(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """This script with ``args`` in a fresh interpreter (``env`` added to its environment);
    the JSON on its last stdout line."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})
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
    elif len(sys.argv) > 1 and sys.argv[1] == "--conv-search":
        print(json.dumps(one_conv_search(sys.argv[2], int(sys.argv[3]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "--conv-fresh":
        print(json.dumps(one_conv_fresh(int(sys.argv[2]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "--conv-cost":
        print(json.dumps(one_conv_cost()))
    elif len(sys.argv) > 1 and sys.argv[1] == "--conv":
        conv_table()
    else:
        main()
