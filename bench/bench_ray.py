"""One job in one process against the same job on Ray with two CPU workers.

Prints, for the same job (several metrics on the built-in tiny GPT-2, each searching its
sizes into a fresh cache): the wall time of ``run_job`` in one process and on a local Ray
instance with ``--workers`` CPUs (one task per CPU), their ratio, and where Ray's time
went per task, from the driver's journal (``ray-task`` events, measured on the worker
and the driver):

- the metric's process (model build, warm-up, search, run: ``total_seconds``);
- starting that process on the worker (a fork; on a worker's first task also importing
  transformers and the model's modules, which one process does once for all tasks);
- what the Ray worker added around it (device probe, hub calls, scratch cache, outputs);
- the driver writing the task's files and events.

Three runs: one process with torch's default threads (every core), one process with one
thread (one "device", as a GPU job in one process has one GPU), and Ray with ``--workers``
CPU workers, one thread each (Ray gives each task one CPU). Goal: with two workers, at
most 0.7 of the single-process wall time, and under 1 s added per task.

Run: ``python bench/bench_ray.py [--metrics a,b,...] [--models a,b] [--samples N]
[--seq-len N] [--workers N]`` (about 4 minutes with the defaults on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from oomguard.engine.jobs.journal import replay
from oomguard.engine.jobs.ray_job import OnRay, import_ray
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.spec import load_job

# Every metric on two models: what Ray is for (many tasks), each task of a size that
# occurs many times over, so the tasks share the workers evenly.
DEFAULT_METRICS = "loss,gradient_stats,fisher_diagonal,integrated_gradients,layer_attribution,cka"
DEFAULT_MODELS = "tiny-gpt2,tiny-llama"


def job_file(folder: Path, name: str, metrics: list[str], args: argparse.Namespace) -> Path:
    blocks = "".join(f'\n[[metrics]]\nname = "{m}"\n' for m in metrics)
    models = ", ".join(f'"{m}"' for m in args.models.split(","))
    path = folder / f"{name}.toml"
    path.write_text(f'output = "{folder / name}"\nmodels = [{models}]\n[data]\n'
                    f'seq_len = {args.seq_len}\nn_samples = {args.samples}\n{blocks}',
                    encoding="utf-8")
    return path


def _run(folder: Path, name: str, metrics: list[str], args: argparse.Namespace,
         **kw: object) -> tuple[float, object]:
    t0 = time.perf_counter()
    outcome = run_job(load_job(job_file(folder, name, metrics, args)),
                      cache_path=folder / f"{name}.json", progress=False, **kw)
    assert outcome.exit_code == 0, outcome.results
    return time.perf_counter() - t0, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", default=DEFAULT_METRICS)
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    metrics = args.metrics.split(",")
    ray = import_ray()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        default_s, default = _run(folder, "default", metrics, args)
        one_s, one = _run(folder, "one", metrics, args, threads=1)
        t0 = time.perf_counter()
        ray.init(address="local", num_cpus=args.workers, include_dashboard=False,
                 log_to_driver=False)
        init_s = time.perf_counter() - t0
        ray_s, on_ray = _run(folder, "ray", metrics, args, backend=OnRay())
        t0 = time.perf_counter()
        ray.shutdown()
        stop_s = time.perf_counter() - t0
        events = {e["task"]: e for e in replay(folder / "ray" / "journal.jsonl")
                  if e["event"] == "ray-task"}
    n = len(events)
    print(f"job: {n} tasks: {', '.join(metrics)} on {args.models}, {args.samples} samples x "
          f"{args.seq_len} tokens, sizes searched into a fresh cache; {args.workers} cores\n")
    print("| run | wall s | Ray's wall / this |")
    print("|---|---:|---:|")
    print(f"| one process, torch's default threads (all cores) | {default_s:.1f} | "
          f"{ray_s / default_s:.2f} |")
    print(f"| one process, 1 thread (one device's worth) | {one_s:.1f} | {ray_s / one_s:.2f} |")
    print(f"| Ray, {args.workers} CPU workers, 1 thread each | {ray_s:.1f} | 1.00 |")
    print(f"| Ray's instance: start {init_s:.1f} s, stop {stop_s:.1f} s (not in the rows above) "
          "| | |")
    print("\nper task, seconds: the metric's process (model build, search, run), and on Ray "
          "what came on top: starting that process (fork, and on a worker's first task the "
          "imports), the worker's own work (device probe, hub calls, its outputs reaching the "
          "hub)")
    print("| metric | one process, default | one process, 1 thread | Ray: process | "
          "Ray: start | Ray: worker |")
    print("|---|---:|---:|---:|---:|---:|")
    added = []
    for key, e in events.items():
        proc = on_ray.results[key].total_seconds or 0.0
        start = e["task_seconds"] - proc
        added.append(start + e["worker_seconds"])
        print(f"| {key} | {default.results[key].total_seconds:.2f} | "
              f"{one.results[key].total_seconds:.2f} | {proc:.2f} | {start:.2f} | "
              f"{e['worker_seconds']:.3f} |")
    print(f"\nRay adds per task (start + worker): median {statistics.median(added):.2f} s, "
          f"max {max(added):.2f} s, mean {statistics.mean(added):.2f} s")


if __name__ == "__main__":
    main()
