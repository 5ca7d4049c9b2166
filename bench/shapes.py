"""Batches planned from the lengths against longest-length sizing and a fixed token budget: one
epoch of a tiny GPT-2 training step (AdamW) under a real CPU budget, per length distribution.

Three distributions of ``--samples`` (1,000) sample lengths from 8 to 256 tokens, drawn with a
fixed seed (each holds one sample of 256, so the longest length is the same for all):

- **uniform**: every length from 8 to 256 alike;
- **long tail**: log-normal around 37 tokens, clipped to 8..256 (text's long tail);
- **bimodal**: 70% around 24 tokens, 30% around 192 (short prompts and long documents).

Three ways to batch them, each epoch in a fresh process (the warm-up step, then the budget):

- **longest**: one batch size for the epoch, ``oomguard.search`` of the step at the longest
  length (what fits the worst case), the samples in a shuffled order, each batch padded to
  its longest sample;
- **tokens**: batches of sorted lengths up to a token cap (padded tokens: rows x the batch's
  longest length) of the longest-length size x the longest length, in a shuffled order;
- **plan**: ``oomguard.search_shapes(step, lengths, budget=..., restore=(model, opt))``, then
  ``plan.batches(lengths, shuffle=True, seed=0)``.

Columns: real (unpadded) and padded tokens per batch, batches in the epoch, the epoch's wall
and CPU seconds (the batches only: no search), the batches that ran out of memory under
``oomguard.budget(--budget, "cpu")`` over the whole epoch (each counted and skipped), and the
real tokens per batch over longest-length sizing's. Issue 39's goal: 3x or more on the long
tail, with no OOM.

    .venv/bin/python bench/shapes.py [--samples 1000] [--budget 160]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread: the cores are shared; ratios hold
# The swallowed-OOM detector wraps every operator under a CPU budget: off, the rows compare
# ways to batch, not it (as bench/clients.py).
os.environ.setdefault("OOMGUARD_SWALLOWED_OOMS", "off")
import torch  # noqa: E402 - after the thread count

from oomguard.engine.core.child import Child, start_forkserver  # noqa: E402
from oomguard.engine.core.length_batches import named_lengths  # noqa: E402

MiB = 1024**2
SHORTEST, LONGEST = 8, 256
PRELOAD = ("transformers",)
WAYS = ("longest", "tokens", "plan")


def lengths_of(kind: str, n: int, seed: int = 0) -> list[int]:
    """``n`` sample lengths (tokens) of distribution ``kind``, from 8 to 256, the last one 256
    (:func:`~oomguard.engine.core.length_batches.named_lengths`)."""
    return named_lengths(kind.replace(" ", "-"), n, seed, SHORTEST, LONGEST)


DISTRIBUTIONS = ("uniform", "long tail", "bimodal")


def _training(n: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    """(step(batch_size, seq_len, index=None), model, optimizer): the guide's tiny GPT-2 step
    with AdamW over ``n`` rows of tokens, warmed up before any budget as a user's script is.
    With ``index``, the rows are those samples, padded to ``seq_len`` (the padding's labels
    are -100: not in the loss)."""
    from oomguard.metrics.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny-gpt2").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    rows = torch.randint(0, vocab, (n, LONGEST), generator=torch.Generator().manual_seed(3))

    def step(batch_size: int, seq_len: int, index: list[int] | None = None,
             lengths: list[int] | None = None) -> float:
        ids = rows[:batch_size, :seq_len] if index is None else rows[index, :seq_len]
        labels = ids
        if index is not None and lengths is not None:
            real = torch.tensor([lengths[i] for i in index]).unsqueeze(1)
            labels = ids.masked_fill(torch.arange(seq_len).unsqueeze(0) >= real, -100)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    warm = rows[:2, :SHORTEST]
    model(input_ids=warm, labels=warm).loss.backward()
    model.zero_grad(set_to_none=True)
    return step, model, optimizer


def _longest_size(lengths: list[int], budget: int) -> int:
    """In a fresh process: the batch size ``oomguard.search`` finds at the longest length."""
    import oomguard

    torch.set_num_threads(1)
    step, model, optimizer = _training(len(lengths))
    longest = max(lengths)
    found = oomguard.search(lambda b: step(b, longest), budget=budget, device="cpu",
                            restore=(model, optimizer))
    return int(found.size_to_use)


def _token_batches(lengths: list[int], cap: int) -> list[list[int]]:
    """Sorted lengths cut into batches whose rows x longest length stay within ``cap``
    tokens, in a shuffled order (seed 0)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = [[]]
    for i in order:
        if batches[-1] and (len(batches[-1]) + 1) * lengths[i] > cap:
            batches.append([])
        batches[-1].append(i)
    random.Random(0).shuffle(batches)
    return batches


def _epoch(way: str, lengths: list[int], budget: int, size: int) -> dict[str, Any]:
    """In a fresh process: the batches of ``way`` (``size``: longest-length sizing's batch),
    then one epoch of them under the budget; OOMs counted and skipped."""
    import oomguard

    torch.set_num_threads(1)
    step, model, optimizer = _training(len(lengths))
    extra: dict[str, Any] = {}
    if way == "longest":
        order = list(range(len(lengths)))
        random.Random(0).shuffle(order)
        batches = [order[i:i + size] for i in range(0, len(order), size)]
    elif way == "tokens":
        batches = _token_batches(lengths, size * max(lengths))
    else:
        t0 = time.perf_counter()
        plan = oomguard.search_shapes(step, lengths, budget=budget, device="cpu",
                                      restore=(model, optimizer))
        extra = {"plan_s": time.perf_counter() - t0,
                 "trials": plan.trials,
                 "at_longest": plan.max_batch(max(lengths))}
        batches = plan.batches(lengths, shuffle=True, seed=0)
    ooms = 0
    wall, cpu = time.perf_counter(), time.process_time()
    with oomguard.budget(budget, "cpu"):
        for batch in batches:
            try:
                step(len(batch), max(lengths[i] for i in batch), batch, lengths)
            except Exception as exc:
                if not oomguard.is_oom(exc):
                    raise
                ooms += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return {"batches": len(batches), "real": sum(lengths) / len(batches),
            "padded": padded / len(batches), "wall_s": wall, "cpu_s": cpu, "ooms": ooms,
            "largest": max(len(b) for b in batches), **extra}


def _fresh(ctx: Any, fn: Any, *args: Any) -> Any:
    with Child(ctx, fn, *args) as child:
        return child.wait().result()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--samples", type=int, default=1000, help="samples per distribution")
    p.add_argument("--budget", type=int, default=160, help="the CPU budget, in MiB")
    p.add_argument("--distributions", default=",".join(DISTRIBUTIONS),
                   help=f"comma-separated, of {', '.join(DISTRIBUTIONS)} (default: all)")
    args = p.parse_args(argv)
    if args.samples < 2 or args.budget <= 0:
        p.error("give --samples of 2 or more and a positive --budget")
    kinds = [k for k in args.distributions.split(",") if k]
    if unknown := sorted(set(kinds) - set(DISTRIBUTIONS)):
        p.error(f"unknown distribution(s) {', '.join(unknown)}: give some of "
                f"{', '.join(DISTRIBUTIONS)}")
    budget = args.budget * MiB
    ctx = start_forkserver(PRELOAD)
    rows = []
    for kind in kinds:
        t0 = time.perf_counter()
        lengths = lengths_of(kind, args.samples)
        size = _fresh(ctx, _longest_size, lengths, budget)
        got = {way: _fresh(ctx, _epoch, way, lengths, budget, size) for way in WAYS}
        rows.append((kind, lengths, size, got))
        print(f"{kind}: {time.perf_counter() - t0:.0f} s; longest-length size {size}; " + "; ".join(
            f"{w} {g['batches']} batches {g['ooms']} OOMs" for w, g in got.items()), flush=True)
    print(f"\n{args.samples} samples of {SHORTEST} to {LONGEST} tokens a distribution; tiny-gpt2 "
          f"training step (AdamW) under a {args.budget} MiB CPU budget; one thread\n")
    print("| lengths (median) | batching | real tokens / batch | padded tokens / batch "
          "| batches | epoch wall s | epoch CPU s | OOMs in the epoch | real tokens / longest's |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, lengths, size, got in rows:
        first = f"{kind} ({sorted(lengths)[len(lengths) // 2]})"
        base = got["longest"]["real"]
        for way in WAYS:
            g = got[way]
            name = {"longest": f"longest length ({size} rows)",
                    "tokens": f"token budget ({size * max(lengths):,})",
                    "plan": "plan"}[way]
            print(f"| {first} | {name} | {g['real']:,.0f} | {g['padded']:,.0f} | {g['batches']} "
                  f"| {g['wall_s']:.1f} | {g['cpu_s']:.1f} | {g['ooms']} "
                  f"| {g['real'] / base:.1f}x |")
            first = ""
    for kind, _, _, got in rows:
        g = got["plan"]
        print(f"- {kind}, plan: {g['trials']} trials in {g['plan_s']:.1f} s; "
              f"max_batch at the longest length {g['at_longest']}; largest batch {g['largest']}")


if __name__ == "__main__":
    main()
