"""Measurements of ``bench/gpu_check.py`` for the estimated reference: what a device
leaves usable, and whether the recommended size holds over a long run.

Each check returns ``(passed, measured)``. The figures are measured on the GPU that runs
them; the estimated reference's GPU tiers can be corrected from them.
"""

from __future__ import annotations

import statistics
import time

import torch
from gpu_check_budgets import _mib, clean

SOAK_STEPS = 1000
SOAK_BUDGET = 2 * 1024**3  # bytes: the search and the soak meet a real limit


def check_usable_memory(dev: torch.device) -> tuple[bool, str]:
    """What ``cudaMemGetInfo`` reports free once this process has its context: the memory
    a workload can use here, against the device's total and ``total_memory``."""
    clean(dev)
    torch.zeros(1, device=dev)  # the context, as any workload creates it
    free, total = torch.cuda.mem_get_info(dev)
    props = torch.cuda.get_device_properties(dev)
    held = torch.cuda.memory_reserved(dev)
    return free > 0, (f"free after the context {_mib(free)} of {_mib(total)} "
                      f"({100 * free / total:.1f}%); total_memory {_mib(props.total_memory)}; "
                      f"outside the free figure {_mib(total - free)} (context, other processes, "
                      f"{_mib(held)} reserved here); {props.name}")


def check_soak_recommended(dev: torch.device) -> tuple[bool, str]:
    """The built-in training step (tiny GPT-2) searched under a 2 GiB budget, then run
    ``SOAK_STEPS`` times at the recommended size under the same budget: no OOM, and how
    much the step's peak varies from step to step."""
    from oomguard.engine.core.memory.budget import budget
    from oomguard.engine.core.memory.oom import OOM, call_catching_oom
    from oomguard.engine.core.search.search import search
    from oomguard.metrics.train_step import TrainStep
    from oomguard.probes import PeakMeter

    clean(dev)
    step = TrainStep(model="tiny-gpt2", seq_len=128, device=str(dev))
    found = search(step, start=8, size_step=8, device=dev, budget=SOAK_BUDGET, max_size=8192)
    if found.recommendation is None:
        return False, f"no recommendation: max_ok {found.max_ok}"
    size = found.recommendation.safe
    meter = PeakMeter(dev)
    peaks, ooms = [], 0
    t0 = time.perf_counter()
    with budget(SOAK_BUDGET, dev):  # the search's warm-up left the model in place
        for _ in range(SOAK_STEPS):
            meter.reset()
            if isinstance(call_catching_oom(step, size, device=dev), OOM):
                ooms += 1
                continue
            peaks.append(meter.read())
    secs = time.perf_counter() - t0
    spread = (f"peaks min {_mib(min(peaks))}, median {_mib(statistics.median(peaks))}, max "
              f"{_mib(max(peaks))}" if peaks else "no step ran")
    return ooms == 0, (f"recommended {size} (max_ok {found.max_ok}, budget "
                       f"{_mib(SOAK_BUDGET)}); {SOAK_STEPS} steps in {secs:.0f} s, {ooms} OOMs; "
                       f"{spread}")
