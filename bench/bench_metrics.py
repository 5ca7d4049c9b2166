"""Searched sizes against the seed's hand-tuned sizes, per metric, in one run; and (with
``--recompute``) plain against recomputed metrics, as a job chooses between them.

For every metric on the default tiny model (tiny-gpt2, random weights), under
one CPU budget standing in for a small device: search each memory knob
(E10 routine, in-process), then time the metric at the seed's hand-tuned
sizes (the seed's H100 defaults) and at the searched safe
sizes, side by side. A hand-tuned size that runs out of memory under the
budget is what an overnight run would have died of.

``--recompute``: a job per budget on a deeper GPT-2 (8 blocks of 16 heads) runs the metrics that
can run recomputed (their blocks checkpointed); the job sizes each both ways, times each once at
its sizes in its own process, one after the other, and keeps the faster. The table is the jobs'
own record (results.json). A second table measures, in one fresh process, the peak and seconds
of a Hessian-vector product (the Lanczos metrics) and of integrated gradients, plain and with the
blocks checkpointed: why the Lanczos metrics do not declare recomputation.

    .venv/bin/python bench/bench_metrics.py [--budget 256MiB] [--samples 64] [--seq-len 128]
    .venv/bin/python bench/bench_metrics.py --recompute [--budgets 24MiB,64MiB]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from oomguard.engine.core.memory.budget import budget
from oomguard.engine.core.memory.heap import return_freed_memory_to_os
from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.core.search.search import NoSizeFits, search
from oomguard.engine.errors import size_list
from oomguard.engine.util.units import fmt_bytes, parse_size
from oomguard.metrics.base import get_metric, load_all
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
    metric = get_metric(trial.metric)
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


# --recompute: 8 blocks whose attention probabilities (16 heads x 128 x 128) are most of the
# activations, 8 samples, and the metrics' result parameters.
DEEP = ("gpt2:n_embd=32,n_head=16,n_layer=8,vocab_size=256,n_positions=512,bos_token_id=0,"
        "eos_token_id=0")
RECOMPUTED = {"integrated_gradients": {"n_steps": 8}, "layer_attribution": {"n_steps": 2}}


def _recompute_job(folder: Path, budget_text: str) -> dict[str, Any]:
    """Run the job of :data:`RECOMPUTED` on :data:`DEEP` under ``budget_text``; its tasks."""
    from oomguard.engine.jobs.runner import run_job
    from oomguard.engine.jobs.spec import load_job

    blocks = "".join(f'[[metrics]]\nname = "{name}"\nparams = {{ '
                     + ", ".join(f"{k} = {v}" for k, v in params.items()) + " }\n"
                     for name, params in RECOMPUTED.items())
    path = folder / "job.toml"
    path.write_text(f'output = "{folder / "out"}"\nmodels = ["{DEEP}"]\n'
                    f'budget = "{budget_text}"\n[data]\nseq_len = 128\nn_samples = 4\n'
                    f'[search]\nstart = 1\nmax_trials = 6\n{blocks}', encoding="utf-8")
    run_job(load_job(path), cache_path=folder / "sizes.json", progress=False, threads=1)
    return json.loads((folder / "out" / "results.json").read_text())["tasks"]


def _hvp_and_ig_peaks() -> dict[str, tuple[float, float]]:
    """In this (fresh) process: peak MiB and seconds of a Hessian- and a Gauss-Newton-vector
    product (what a Lanczos step runs) and of integrated gradients on :data:`DEEP`, 2 samples of 128 tokens,
    plain and with the blocks checkpointed; each warmed up once first."""
    from oomguard.engine.core.recompute import checkpointed
    from oomguard.metrics.common import mean_loss_hvp, trainable
    from oomguard.metrics.lanczos import mean_loss_ggnvp
    from oomguard.metrics.models import build_model, make_batch
    from oomguard.probes.peak import PeakMeter

    torch.set_num_threads(1)
    return_freed_memory_to_os()
    model = build_model(DEEP, seed=0)
    data = make_batch(2, 128, model.config.vocab_size, seed=0, pad=False)
    params = trainable(model)
    vec = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
           for i, p in enumerate(params)]
    ig = get_metric("integrated_gradients")
    work = {"Hessian-vector product (micro-batch 2)":
            lambda: mean_loss_hvp(model, data, 2, vec, params),
            "Gauss-Newton-vector product (micro-batch 2)":
            lambda: mean_loss_ggnvp(model, data, 2, vec, params),
            "integrated_gradients (8 rows per forward)":
            lambda: ig.run(model, data, n_steps=4, chunk_size=2, internal_batch_size=8)}
    out = {}
    for name, fn in work.items():
        for again in (False, True):
            def run(fn: Any = fn, again: bool = again) -> None:
                with checkpointed(model) if again else contextlib.nullcontext():
                    fn()
            run()
            meter = PeakMeter("cpu")
            meter.reset()
            t0 = time.perf_counter()
            run()
            out[f"{name} | {'checkpointed' if again else 'plain'}"] = (
                meter.read() / 2**20, time.perf_counter() - t0)
    return out


def recompute_tables(budgets: list[str]) -> None:
    """Print the two ``--recompute`` tables (Markdown)."""
    from oomguard.engine.core.child import Child, context

    print(f"jobs on {DEEP}, 4 samples x 128 tokens, float32, 1 thread; each configuration "
          "timed once at its sizes by the job itself\n")
    head = ("metric", "budget", "configuration", "sizes", "peak", "samples / s", "kept")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for budget_text in budgets:
        with tempfile.TemporaryDirectory() as tmp:
            tasks = _recompute_job(Path(tmp), budget_text)
        for name, task in tasks.items():
            if task.get("status") != "ok":
                print(f"| {name} | {budget_text} | {task.get('status')}: {task.get('reason')} |")
                continue
            for c in task["sizes"].get("configurations") or []:
                rate = c.get("samples_per_second")
                print(f"| {name} | {budget_text} | {c['configuration']} | "
                      f"{size_list(c.get('sizes')) or '-'} | {fmt_bytes(c.get('peak_bytes'))} | "
                      f"{'-' if rate is None else f'{rate:.2f}'} | "
                      f"{'**yes**' if c.get('chosen') else c.get('note') or 'no'} |")
    with Child(context("forkserver", ("transformers",)), _hvp_and_ig_peaks) as child:
        peaks = child.wait().result()
    print("\none fresh process, 2 samples x 128 tokens of the same model, each warmed up once\n")
    print("| work | blocks | peak (MiB) | seconds |\n|---|---|---:|---:|")
    for key, (mib, seconds) in peaks.items():
        print(f"| {key} | {mib:.1f} | {seconds:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--only", nargs="*", help="metric names")
    parser.add_argument("--recompute", action="store_true",
                        help="plain against recomputed metrics, as a job chooses")
    parser.add_argument("--budgets", default="24MiB,64MiB",
                        help="--recompute: a job per budget")
    args = parser.parse_args()
    if args.recompute:
        recompute_tables(args.budgets.split(","))
        return
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
