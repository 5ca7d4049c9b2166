"""Estimated peak memory against measured peaks: the tiny GPT-2 training step and metrics.

For each workload and size: the estimate (:func:`oomguard.engine.core.estimate.estimate.estimate`:
fake tensors, nothing run, plus the matrix multiplies' workspace measured by replaying
them in a fresh process), the measured peak of an isolated search trial at that size (a
fresh process, ``warmup()``, then one step in ``run_trial``: resident ``VmHWM`` above the
warmed-up state), and the estimate's error, with and without the workspace, side by side
in one table. With ``--llama-7b``, first the time and resident memory an estimate of a 7B
LLaMA-like training step takes (nothing measured to compare with: the step needs
~100 GiB). docs/measurements.md#estimate-error records a run.

    .venv/bin/python bench/bench_estimate.py [--sizes 4,16,32] [--seq-len 256] [--samples 32]
        [--only train-step loss ...] [--llama-7b]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from oomguard.engine.core.estimate.estimate import estimate
from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.util.units import fmt_bytes
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


def compare(name: str, workload: Any, sizes: list[int]) -> list[tuple]:
    """Rows (workload, size, estimated, workspace, measured, estimate s, trial s)."""
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
        print(f"  {name} {e.size}: done", flush=True)
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
    parser.add_argument("--llama-7b", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.llama_7b:
        llama_7b([1, 8])
    workloads: dict[str, Any] = {"train-step": TrainStep(seq_len=args.train_seq_len)}
    for metric in ("loss", "gradient_stats", "fisher_diagonal"):
        workloads[metric] = MetricTrial(metric, n_samples=args.samples, seq_len=args.seq_len)
    rows = []
    for name, workload in workloads.items():
        if not args.only or name in args.only:
            rows += compare(name, workload, sizes)
    print(f"\ntiny-gpt2 float32 on CPU ({torch.get_num_threads()} torch threads); train-step: "
          f"{args.train_seq_len} tokens, batch = size; metrics: {args.samples} samples x "
          f"{args.seq_len} tokens, micro_batch_size = size. Measured: isolated trial (fresh "
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


if __name__ == "__main__":
    main()
