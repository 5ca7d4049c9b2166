"""Training checks of ``bench/gpu_check.py``: the size a search finds holds for the run on a
real GPU, the integrations keep the effective batch there, and the allocator's retries are
read as the early warning before an OOM.

Each check returns ``(passed, measured)``. Every OOM is real: the caching allocator refusing
an allocation above a ``set_per_process_memory_fraction`` cap (``oomguard.budget``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from gpu_check_budgets import _mib, clean

TRAIN_BUDGET = 1024**3  # bytes: small enough that the loop's maximum is well inside 1..MAX_ROWS
MAX_ROWS = 512
SEQ, VOCAB = 128, 4096
LOOP_STEPS = 50


def _model(dev: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ)).to(dev)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _rows(n: int, dev: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g).to(dev)


def _first_step(model: torch.nn.Module, opt: torch.optim.Optimizer, dev: torch.device) -> None:
    """One step on 2 rows before any budget, so that AdamW's state exists before it (the
    budget counts from what is allocated at its entry)."""
    _loop_step(model, opt, dev)(2)


def _loop_runs(dev: torch.device, size: int, steps: int) -> bool:
    """Whether ``steps`` optimizer steps of the plain loop at ``size`` rows run under the
    budget, from a fresh model and optimizer after :func:`_first_step`, as the search starts."""
    from oomguard.engine.core.memory.budget import budget

    clean(dev)
    model, opt = _model(dev)
    _first_step(model, opt, dev)  # as before the search: AdamW's state exists
    try:
        with budget(TRAIN_BUDGET, dev):
            for i in range(steps):
                ids = _rows(size, dev, i)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, opt
        clean(dev)


def _loop_max(dev: torch.device) -> int:
    """The plain loop's own maximum (3 steps, bisected over 1..MAX_ROWS, fresh state each)."""
    lo, hi = 0, MAX_ROWS + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _loop_runs(dev, mid, 3) else (lo, mid)
    return lo


def _loop_step(model: torch.nn.Module, opt: torch.optim.Optimizer, dev: torch.device
               ) -> Any:
    """One optimizer step of the loop at ``size`` rows (the same rows every step)."""
    def step(size: int) -> None:
        ids = _rows(size, dev)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    out += [v.clone() for s in opt.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]
    return out


def check_search_restore_holds(dev: torch.device) -> tuple[bool, str]:
    """``search(step, restore=(model, optimizer))`` of a whole AdamW step on a GPT-2 under a
    1 GiB budget: the model and optimizer bitwise as before, then ``LOOP_STEPS`` steps of the
    real loop at ``max_ok`` with 0 OOMs; ``max_ok`` against the loop's own maximum."""
    from oomguard.engine.core.memory.budget import budget
    from oomguard.engine.core.search.search import search

    clean(dev)
    model, opt = _model(dev)
    _first_step(model, opt, dev)
    before = _state(model, opt)

    step = _loop_step(model, opt, dev)
    t0 = time.perf_counter()
    found = search(step, restore=(model, opt), max_size=MAX_ROWS, device=dev,
                   budget=TRAIN_BUDGET)
    secs = time.perf_counter() - t0
    same = all(torch.equal(a, b) for a, b in zip(before, _state(model, opt), strict=True))
    ooms = 0
    with budget(TRAIN_BUDGET, dev):
        for _ in range(LOOP_STEPS):
            try:
                step(found.max_ok)
            except torch.OutOfMemoryError:
                ooms += 1
                opt.zero_grad(set_to_none=True)
    del model, opt, step, before
    m = _loop_max(dev)
    ok = same and ooms == 0 and found.max_ok >= 0.95 * m
    return ok, (f"max_ok {found.max_ok} in {len(found.trials)} trials ({secs:.1f} s), loop's own "
                f"max {m} (ratio {found.max_ok / m:.3f}); state after the search bitwise equal: "
                f"{same}; {LOOP_STEPS} loop steps at max_ok: {ooms} OOMs; budget "
                f"{_mib(TRAIN_BUDGET)}")


def check_trainer_largest(dev: torch.device) -> tuple[bool, str]:
    """``OomguardTrainer(oomguard_largest=True)`` on the GPU, 512 rows per step asked for under
    a 1 GiB budget: the split found, the effective batch kept, 10 optimizer steps, 0 OOMs."""
    from transformers import TrainingArguments

    from oomguard.engine.core.memory.budget import budget
    from oomguard.engine.integrations.hf_trainer import OomguardTrainer

    clean(dev)
    model, _ = _model(dev)
    rows = [{"input_ids": r, "labels": r} for r in _rows(MAX_ROWS * 10, torch.device("cpu"))]
    args = TrainingArguments(output_dir="/tmp/oomguard-gpu-trainer",
                             per_device_train_batch_size=MAX_ROWS, max_steps=10,
                             save_strategy="no", report_to=[], disable_tqdm=True,
                             logging_strategy="no", seed=0)
    trainer = OomguardTrainer(model=model, args=args, train_dataset=rows, oomguard_largest=True)
    t0 = time.perf_counter()
    try:
        with budget(TRAIN_BUDGET, dev):
            trainer.train()
        ooms = 0
    except torch.OutOfMemoryError:
        ooms = 1
    split: Any = trainer.oomguard_train
    a = trainer.args
    effective = a.per_device_train_batch_size * a.gradient_accumulation_steps
    ok = ooms == 0 and effective == MAX_ROWS and trainer.state.global_step == 10
    return ok, (f"split {split.micro_batch} x {split.accumulation} = {effective} rows (asked "
                f"{MAX_ROWS}), largest that ran {split.found}; {trainer.state.global_step} "
                f"steps, {ooms} OOMs, {time.perf_counter() - t0:.1f} s")


def check_alloc_retries_warning(dev: torch.device) -> tuple[bool, str]:
    """The early warning's source: under a 1 GiB cap, a cached 600 MiB block cannot serve a
    700 MiB request, so the allocator frees its cache and retries; ``num_alloc_retries``
    (``oomguard.probes.cuda.alloc_retries``) rises by one and no OOM is raised."""
    from oomguard.engine.core.memory.budget import budget
    from oomguard.probes import cuda

    clean(dev)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with budget(TRAIN_BUDGET, dev):
        before = cuda.alloc_retries(index)
        x = torch.empty(600 * 2**20, dtype=torch.uint8, device=dev)
        del x  # cached, not returned
        y = torch.empty(700 * 2**20, dtype=torch.uint8, device=dev)
        after = cuda.alloc_retries(index)
        del y
    clean(dev)
    return after == before + 1, f"num_alloc_retries {before} -> {after} (expect +1)"
