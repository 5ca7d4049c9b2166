"""Estimated peak memory against measured peaks: the tiny GPT-2 training step and metrics.

For each workload and size: the estimate (:func:`oomguard.engine.core.estimate.estimate.estimate`:
fake tensors, nothing run, plus the matrix multiplies' workspace measured by replaying
them in a fresh process), the measured peak of an isolated search trial at that size (a
fresh process, ``warmup()``, then one step in ``run_trial``: resident ``VmHWM`` above the
warmed-up state), and the estimate's error, with and without the workspace, side by side
in one table: the training step and every metric's every memory knob (``--all``, each at
the given sizes up to the knob's largest useful one; default: the training step and three
metrics' first knobs). With ``--llama-7b``, first the time and resident memory an estimate
of a 7B LLaMA-like training step takes (nothing measured to compare with: the step needs
~100 GiB). With ``--reference-7b``, the estimated reference of every metric of a 7B
LLaMA-like config (bf16, 4 samples x 64 tokens, 80 GiB, cuda), run three times side by
side in fresh processes: the previous version's path (the caches of engine/core/estimate
off, one process), the caches on in one process, and the caches on with the metrics in
parallel, one process per CPU: each one's seconds, and its rows checked equal to the stored
output of the code before the caches (tests/golden/estimate_reference_7b.json).
docs/measurements.md#estimate-error records a run.

    .venv/bin/python bench/bench_estimate.py [--sizes 4,16,32] [--seq-len 256] [--samples 32]
        [--only train-step loss ...] [--all] [--llama-7b] [--reference-7b]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from oomguard.engine.core.estimate.estimate import estimate
from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.util.units import fmt_bytes
from oomguard.metrics.base import get_metric, load_all
from oomguard.metrics.train_step import TrainStep
from oomguard.metrics.workload import MetricTrial
from oomguard.probes import host

LLAMA_7B = ("llama:hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,"
            "num_attention_heads=32,num_key_value_heads=32,vocab_size=32000,"
            "max_position_embeddings=4096")


def llama_7b(sizes: list[int]) -> None:
    """Time and resident memory of an estimate of a 7B training step (bf16, 2048 tokens)."""
    step = TrainStep(model=LLAMA_7B, seq_len=2048, dtype="bfloat16")
    base = host.reset_peak() or 0
    start = time.perf_counter()
    estimates = estimate(step, sizes)
    took = time.perf_counter() - start
    grown = (host.read_peak() or 0) - base
    print(f"7B LLaMA-like training step (bfloat16, AdamW, 2048 tokens), sizes {sizes}: "
          f"{took:.1f} s in all, resident peak of this process {fmt_bytes(host.read_peak())} "
          f"(+{fmt_bytes(grown)} during the estimate)")
    for e in estimates:
        print(f"  batch {e.size}: {fmt_bytes(e.peak_bytes)} above the warmed-up state "
              f"({e.kind}; {e.seconds:.1f} s)")
    for note in sorted({n for e in estimates for n in e.notes}):
        print(f"  note: {note}")
    print()


GOLDEN_7B = Path(__file__).resolve().parent.parent / "tests" / "golden" / "estimate_reference_7b.json"
# What a row's numbers are (its seconds are not)
FIGURES = ("metric", "knob", "largest", "next_size", "total_bytes", "peak_bytes",
           "next_total_bytes", "estimates")


# How the reference is made: before the real-operation cache (one process), with it (one
# process), and with it on one process per CPU (the metrics in parallel)
VERSIONS = {"previous": "previous (no cache, 1 process)", "cached": "cache, 1 process",
            "parallel": f"cache, {host.cpu_count()} processes"}


def reference_7b_run(version: str, out: str) -> None:
    """In this (fresh) process: the 7B estimated reference of every metric, as ``version``
    (:data:`VERSIONS`) makes it, written to ``out`` as JSON."""
    from oomguard.engine.core.estimate import estimate as module
    from oomguard.engine.jobs import reference_estimate
    from oomguard.engine.jobs.reference_estimate import build_estimate_reference

    module.REAL_CACHE = version != "previous"
    reference_estimate.WORKERS = None if version == "parallel" else 1
    doc = build_estimate_reference(LLAMA_7B, "bfloat16", 64, 4, memory=80 * 1024**3,
                                   memory_name="80GiB", margin=0.15, device="cuda")
    Path(out).write_text(json.dumps(doc))


def reference_7b() -> None:
    """The 7B estimated reference, the previous path and the new ones, side by side, each in
    a fresh process; wall seconds and equality with the stored output."""
    want = json.loads(GOLDEN_7B.read_text())
    rows = [{k: r.get(k) for k in FIGURES} for r in want["rows"]]
    print("7B LLaMA-like estimated reference, every metric (bf16, 4 x 64 tokens, 80 GiB, cuda):")
    for version, label in VERSIONS.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "ref.json")
            start = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--_reference-run", version, out],
                           check=True)
            took = time.perf_counter() - start
            got = json.loads(Path(out).read_text())
        same = [{k: r.get(k) for k in FIGURES} for r in got["rows"]] == rows
        print(f"  {label}: {took:.1f} s wall ({got['seconds']:.1f} s "
              f"estimating), {len(got['rows'])} rows, {got['estimates']} estimates, rows "
              f"{'equal to' if same else 'DIFFERENT from'} {GOLDEN_7B.name}", flush=True)
    print()


def workloads_of(args: argparse.Namespace) -> dict[str, Any]:
    """name -> workload: the training step, then each metric's knobs (all with ``--all``)."""
    out: dict[str, Any] = {"train-step": TrainStep(seq_len=args.train_seq_len)}
    names = sorted(load_all()) if args.all else ["loss", "gradient_stats", "fisher_diagonal"]
    for metric in names:
        knobs = get_metric(metric).memory_knobs()
        for knob in knobs if args.all else knobs[:1]:
            out[f"{metric}.{knob.name}"] = MetricTrial(metric, knob=knob.name,
                                                        n_samples=args.samples,
                                                        seq_len=args.seq_len)
    return out


def compare(name: str, workload: Any, sizes: list[int]) -> list[tuple]:
    """Rows (workload, size, estimated, workspace, measured, estimate s, trial s) at ``sizes``
    up to the workload's largest useful size."""
    top = getattr(workload, "max_size", lambda: None)()
    sizes = sorted({min(s, top) for s in sizes}) if top else sizes
    start = time.perf_counter()
    estimates = estimate(workload, sizes)
    seconds = time.perf_counter() - start
    runner = IsolatedRunner(workload, "cpu")
    rows = []
    for e in estimates:
        trial = runner(e.size)
        measured = trial.peak_bytes if trial.ok else None
        rows.append((name, e.size, e.peak_bytes, e.workspace_bytes, measured, e.seconds,
                     trial.seconds))
        print(f"  {name} {e.size}: estimated {e.peak_bytes}, measured {measured}: "
              f"{error(e.peak_bytes, measured)}%", flush=True)
    print(f"  {name}: estimates (warm-up and replays included) took {seconds:.1f} s", flush=True)
    return rows


def error(estimated: int, measured: int | None) -> str:
    """The estimate's error relative to the measured peak, in percent."""
    return "-" if not measured else f"{100 * (estimated - measured) / measured:+.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16,32")
    parser.add_argument("--seq-len", type=int, default=256, help="metrics' tokens per sample")
    parser.add_argument("--samples", type=int, default=32, help="metrics' samples")
    parser.add_argument("--train-seq-len", type=int, default=512)
    parser.add_argument("--only", nargs="*", help="train-step and/or metric names")
    parser.add_argument("--all", action="store_true", help="every metric and memory knob")
    parser.add_argument("--llama-7b", action="store_true")
    parser.add_argument("--reference-7b", action="store_true")
    parser.add_argument("--_reference-run", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._reference_run:
        reference_7b_run(*args._reference_run)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.reference_7b:
        reference_7b()
    if args.llama_7b:
        llama_7b([1, 8])
    rows = []
    for name, workload in workloads_of(args).items():
        if not args.only or name in args.only or name.split(".")[0] in args.only:
            rows += compare(name, workload, sizes)
    worst = max((abs(est - meas) / meas for _, _, est, _, meas, _, _ in rows if meas),
                default=0.0)
    print(f"\ntiny-gpt2 float32 on CPU ({torch.get_num_threads()} torch threads); train-step: "
          f"{args.train_seq_len} tokens, batch = size; metrics: {args.samples} samples x "
          f"{args.seq_len} tokens, size = the knob's value. Measured: isolated trial (fresh "
          "process, warm-up, one step, VmHWM above it). Workspace: measured by replay, "
          "included in the estimate.\n")
    head = ("workload", "size", "estimated bytes", "of which workspace", "measured bytes",
            "error %", "error % without workspace", "estimate s", "trial s")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, size, est, ws, meas, es, ms in rows:
        print(f"| {name} | {size} | {est} ({fmt_bytes(est)}) | {fmt_bytes(ws)} | "
              f"{'OOM' if meas is None else f'{meas} ({fmt_bytes(meas)})'} | "
              f"{error(est, meas)} | {error(est - (ws or 0), meas)} | {es:.2f} | {ms:.2f} |")
    print(f"\nlargest error: {100 * worst:.2f}% over {len(rows)} rows")


if __name__ == "__main__":
    main()
