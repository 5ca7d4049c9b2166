"""Search strategies and trial modes, side by side in one run.

For two workloads under a CPU budget (the E10 report's memory line scaled to
1/100, and the tiny GPT-2 training step of ``oomguard bench``), run each
strategy in-process and isolated and print: trials, seconds, seconds per
trial, the maximum found, and the isolation overhead per trial (isolated
seconds per trial minus in-process seconds per trial; the goal is <= 1.5 s).

    .venv/bin/python bench/bench_search.py [--quick]

Each in-process search runs in its own fresh process so that no search
inherits another's caches.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from oomguard.engine.core.child import forkserver_context
from oomguard.engine.core.search.search import SearchConfig, search
from oomguard.engine.core.search.strategies import Doubling, ExpandBisect, LinearJump
from oomguard.metrics.synthetic import e10_line
from oomguard.metrics.train_step import TrainStep

MiB = 1024**2


def _workloads(quick: bool) -> dict[str, tuple[object, int]]:
    line = e10_line()
    seq = 128 if quick else 256
    return {
        "E10 line /100": (line, (line.bytes_at(114) + line.bytes_at(115)) // 2),
        f"GPT-2 step seq {seq}": (TrainStep(seq_len=seq), 512 * MiB),
    }


def _strategies(capacity: int) -> dict[str, object]:
    return {"e10": ExpandBisect(start=32, step=8), "doubling": Doubling(start=32),
            "linear-jump": LinearJump(capacity_bytes=capacity)}


def _one(name: str, strategy: str, isolate: bool, quick: bool) -> tuple[int, float, int | None]:
    workload, nbytes = _workloads(quick)[name]
    config = SearchConfig(strategy=_strategies(nbytes)[strategy], budget=nbytes, isolate=isolate)
    t0 = time.perf_counter()
    result = search(workload, config)
    return len(result.trials), time.perf_counter() - t0, result.max_ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter sequences")
    args = parser.parse_args()
    forkserver_context(TrainStep.preload)
    ctx = mp.get_context("forkserver")
    rows = []
    for name in _workloads(args.quick):
        for strategy in ("e10", "doubling", "linear-jump"):
            per_trial = {}
            for isolate in (False, True):
                if isolate:  # every trial is already a fresh process
                    n, secs, found = _one(name, strategy, isolate, args.quick)
                else:
                    with ctx.Pool(1, maxtasksperchild=1) as pool:
                        n, secs, found = pool.apply(_one, (name, strategy, isolate, args.quick))
                per_trial[isolate] = secs / n
                rows.append((name, strategy, "isolated" if isolate else "in-process", n, secs,
                             secs / n, found))
            rows[-1] = rows[-1] + (per_trial[True] - per_trial[False],)
    head = ("workload", "strategy", "mode", "trials", "seconds", "s/trial", "max_ok",
            "isolation overhead s/trial")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r[0], r[1], r[2], str(r[3]), f"{r[4]:.1f}", f"{r[5]:.2f}", str(r[6])]
        cells.append(f"{r[7]:.2f}" if len(r) > 7 else "")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
