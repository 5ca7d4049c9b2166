"""Training loops as users write them, under one CPU budget: the native tool against oomguard.

The client is a nanoGPT-style loop (a tiny GPT-2 from a config, AdamW, an effective batch of
``EFFECTIVE`` rows per optimizer step). Each variant runs in a fresh process: the warm-up,
then a real ``RLIMIT_DATA`` budget, then its search, then ``STEPS`` optimizer steps of the
real loop at what it found:

- **native**: accelerate's recipe, ``find_executable_batch_size`` around the whole loop
  (accelerate >= 1.9 multiplies the size by 0.9 after each OOM and restarts the loop); the
  batch it settles on is the effective batch, which therefore shrinks.
- **oomguard**: ``oomguard.search(step, restore=(model, optimizer))`` finds the largest
  micro-batch at which the whole step (forward, backward, ``optimizer.step()``) runs, and
  the loop runs ``oomguard.accumulate`` over ``EFFECTIVE`` rows at that micro-batch, so the
  effective batch is kept exactly.

Columns: the micro-batch found, the search's trials (restarts for the native tool), the
OOMs during the ``STEPS`` steps after it, the effective batch of those steps, seconds to the
answer (also over the trials times two optimizer steps of the loop it found, the goal
being at most 1) and in all (also as a ratio to the native tool's), and the micro-batch over the
loop's own maximum m: the largest size at which ``CHECK_STEPS`` steps of the plain loop run
in a fresh process (bisected, a fresh process per size).

    .venv/bin/python bench/clients.py [--steps 100]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from oomguard.engine.core.child import Child, start_forkserver

EFFECTIVE = 128  # rows per optimizer step
SEQ, VOCAB = 32, 2048
BUDGET = 160 * 1024**2
CHECK_STEPS = 3
PRELOAD = ("transformers",)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ, bos_token_id=0, eos_token_id=0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _rows(n: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _warm(model: torch.nn.Module) -> None:
    ids = _rows(1, -1)[:, :8]
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def _plain_steps(size: int, steps: int) -> bool:
    """Whether ``steps`` optimizer steps at batch ``size`` run under the budget (fresh process)."""
    import oomguard

    model, opt = _model()
    _warm(model)
    with oomguard.budget(BUDGET, "cpu"):
        try:
            for i in range(steps):
                ids = _rows(size, i)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        except RuntimeError as exc:
            if not oomguard.is_oom(exc):
                raise
            return False
    return True


def _native(steps: int) -> dict[str, Any]:
    import accelerate.utils

    import oomguard

    model, opt = _model()
    _warm(model)
    tried: list[int] = []
    t0 = time.perf_counter()
    answer: dict[str, Any] = {}

    @accelerate.utils.find_executable_batch_size(starting_batch_size=EFFECTIVE)
    def loop(batch_size: int) -> None:
        tried.append(batch_size)
        answer["found_at"] = time.perf_counter()
        for i in range(steps):
            ids = _rows(batch_size, i)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    with oomguard.budget(BUDGET, "cpu"):
        loop()
    end = time.perf_counter()
    return {"size": tried[-1], "trials": len(tried), "ooms": 0, "effective": tried[-1],
            "step_s": (end - answer["found_at"]) / steps,
            "search_s": answer["found_at"] - t0, "total_s": end - t0,
            "note": f"sizes tried {tried}; an OOM restarts the loop with fewer rows"}


def _oomguard(steps: int) -> dict[str, Any]:
    import oomguard

    model, opt = _model()
    _warm(model)

    def step(size: int) -> None:
        ids = _rows(size, 0)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    with oomguard.budget(BUDGET, "cpu"):
        result = oomguard.search(step, restore=(model, opt), max_size=EFFECTIVE)
        t_search = time.perf_counter()
        # The loop runs at the largest size that ran; an OOM there costs accumulate a retry at
        # the size its measured peaks predict, never a changed effective batch.
        micro = result.max_ok
        for i in range(steps):
            batch = {"input_ids": _rows(EFFECTIVE, i)}
            oomguard.accumulate(lambda mb: model(input_ids=mb["input_ids"],
                                                 labels=mb["input_ids"]).loss,
                                batch, micro, params=model, optimizer=opt,
                                name="bench-clients")
            opt.step()
            opt.zero_grad(set_to_none=True)
        ooms = oomguard.stats().ooms  # the accumulate calls' OOMs (the search's are trials)
    end = time.perf_counter()
    return {"size": micro, "trials": len(result.trials), "ooms": ooms, "effective": EFFECTIVE,
            "step_s": (end - t_search) / steps, "search_s": t_search - t0, "total_s": end - t0,
            "note": f"max_ok {result.max_ok} (recommended with the default margin: "
                    f"{result.size_to_use})"}


def _true_max(ctx: Any) -> int:
    """The loop's own maximum: the largest size whose plain steps run in a fresh process."""
    lo, hi = 1, EFFECTIVE + 1
    if _fresh(ctx, _plain_steps, EFFECTIVE, CHECK_STEPS):
        return EFFECTIVE
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fresh(ctx, _plain_steps, mid, CHECK_STEPS) else (lo, mid)
    return lo


def _fresh(ctx: Any, fn: Any, *args: Any) -> Any:
    with Child(ctx, fn, *args) as child:
        return child.wait().result()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps after the search")
    args = p.parse_args(argv)
    ctx = start_forkserver(PRELOAD)
    rows = {"native (accelerate)": _fresh(ctx, _native, args.steps),
            "oomguard": _fresh(ctx, _oomguard, args.steps)}
    m = _true_max(ctx)
    base = rows["native (accelerate)"]["total_s"]
    print(f"nanoGPT-style loop: GPT-2 2x128, seq {SEQ}, AdamW, effective batch {EFFECTIVE}, "
          f"CPU budget {BUDGET // 2**20} MiB, {args.steps} steps; loop's own maximum m = {m}")
    print(f"| variant | micro-batch | trials | OOMs in {args.steps} steps | effective batch "
          "| search s | search / (trials x 2 steps) | total s | total / native | micro / m |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['size']} | {r['trials']} | {r['ooms']} | {r['effective']}"
              f"{'' if r['effective'] == EFFECTIVE else ' (changed)'} | {r['search_s']:.1f} "
              f"| {r['search_s'] / (r['trials'] * 2 * r['step_s']):.2f} | {r['total_s']:.1f} | {r['total_s'] / base:.2f} | {r['size'] / m:.2f} |")
    for name, r in rows.items():
        print(f"- {name}: {r['note']}")


if __name__ == "__main__":
    main()
