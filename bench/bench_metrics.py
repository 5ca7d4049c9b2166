"""Searched sizes against the seed's hand-tuned sizes, per metric, in one run.

For every metric on the default tiny model (tiny-gpt2, random weights), under
one CPU budget standing in for a small device: search each memory knob
(E10 routine, in-process), then time the metric at the seed's hand-tuned
sizes (``shared/seeds/000_*``: the H100 defaults) and at the searched safe
sizes, side by side. A hand-tuned size that runs out of memory under the
budget is what an overnight run would have died of.

    .venv/bin/python bench/bench_metrics.py [--budget 256MiB] [--samples 64] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from oomguard.engine.core.memory.budget import budget
from oomguard.engine.core.memory.heap import return_freed_memory_to_os
from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.core.search.search import NoSizeFits, search
from oomguard.engine.util.units import parse_size
from oomguard.metrics.base import load_all
from oomguard.metrics.workload import MetricTrial

# Result-defining parameters kept small so the whole table runs in minutes.
PARAMS: dict[str, dict[str, Any]] = {
    "integrated_gradients": {"n_steps": 8},
    "layer_attribution": {"n_steps": 8},
    "loss_landscape": {"grid": 5},
    "hessian_eigenvalues": {"k": 3, "iterations": 8},
    "ggn_eigenvalues": {"k": 3, "iterations": 8},
}


def _seconds(trial: MetricTrial, sizes: dict[str, int], repeats: int = 2) -> float | None:
    """Best wall seconds of ``repeats`` runs at ``sizes``; None if it ran out of memory."""
    metric = trial._metric()
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call_catching_oom(lambda: metric.run(trial._state["model"], trial._state["data"],
                                                   **{**trial.params, **sizes}))
        if isinstance(out, OOM):
            return None
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
    return best


def _best(a: float | None, b: float | None) -> float | None:
    """The smaller of two timings; an OOM (None) stays an OOM."""
    return b if a is None else a if b is None else min(a, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--only", nargs="*", help="metric names")
    args = parser.parse_args()
    nbytes = parse_size(args.budget)
    return_freed_memory_to_os()
    torch.manual_seed(0)
    rows = []
    for name, metric in sorted(load_all().items()):
        if args.only and name not in args.only:
            continue
        knobs = [k.name for k in metric.memory_knobs()]
        hand = {k.name: int(k.default) for k in metric.memory_knobs()}
        searched: dict[str, int] = {}
        trials = 0
        t_search = time.perf_counter()
        for knob in knobs:
            fixed = {**PARAMS.get(name, {}), **{k: v for k, v in hand.items() if k != knob}}
            trial = MetricTrial(name, knob=knob, n_samples=args.samples, seq_len=args.seq_len,
                                params=fixed)
            trial.warmup()
            bound = trial.max_size() or 4096
            try:
                res = search(trial, start=min(8, bound), size_step=8, max_size=bound, budget=nbytes,
                             max_trials=20)
            except NoSizeFits:
                searched[knob] = 0
                continue
            trials += len(res.trials)
            assert res.recommendation is not None
            searched[knob] = res.recommendation.safe
        t_search = time.perf_counter() - t_search
        timing = MetricTrial(name, knob=knobs[0], n_samples=args.samples, seq_len=args.seq_len,
                             params=PARAMS.get(name, {}))
        timing.warmup()
        with budget(nbytes):
            # Interleaved, best of 3 each: the first run of a shape pays one-off costs.
            s_hand = s_found = None
            for _ in range(3):
                s_hand = _best(s_hand, _seconds(timing, hand, repeats=1))
                if all(searched.values()):
                    s_found = _best(s_found, _seconds(timing, searched, repeats=1))
        rows.append((name, hand, searched, trials, t_search, s_hand, s_found))
        print(f"  {name}: done", flush=True)

    print(f"\n{args.samples} samples x {args.seq_len} tokens, tiny-gpt2 float32, CPU budget "
          f"{args.budget}; seconds are the best of 3 interleaved runs under the budget\n")
    head = ("metric", "hand-tuned sizes (seed)", "searched safe sizes", "search trials / s",
            "s at hand-tuned", "s at searched", "hand / searched")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, hand, found, n, ts, sh, sf in rows:
        fmt = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
        ratio = f"{sh / sf:.2f}" if sh and sf else ("hand-tuned OOM" if sf else "-")
        print(f"| {name} | {fmt(hand)} | {fmt(found)} | {n} / {ts:.1f} | "
              f"{'OOM' if sh is None else f'{sh:.2f}'} | {'OOM' if sf is None else f'{sf:.2f}'} | "
              f"{ratio} |")


if __name__ == "__main__":
    main()
