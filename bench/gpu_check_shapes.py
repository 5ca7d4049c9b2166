"""The shapes row of ``bench/gpu_check.py``: batches planned from the lengths on a real GPU.

A GPT-2 training step (4 layers, 256 wide, AdamW) at any ``(batch, length)`` shape, planned
with ``oomguard.search_shapes`` under a 2 GiB budget (``set_per_process_memory_fraction``)
from a long tail of 2,000 sample lengths (8 to 512 tokens, log-normal around 37: the
``long-tail`` distribution of ``oomguard bench --lengths``). Then a whole epoch of the plan's
batches runs under the same budget, each padded to its longest sample. Passes when the plan
took at most 6 real trials, the epoch met no OOM, and the plan moves at least 3x the real
tokens per batch of sizing every batch at the longest length (issue 39's goal). Returns
``(passed, measured)``.

Run alone: ``python bench/gpu_check_shapes.py [--device cuda:0]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUDGET = 2 * 1024**3  # bytes
SAMPLES, LONGEST, VOCAB = 2000, 512, 4096


def check_shapes(dev: torch.device) -> tuple[bool, str]:
    """Plan, then run the epoch; see the module's docstring."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import oomguard
    from oomguard.engine.core.length_batches import named_lengths

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB,
                                       n_positions=LONGEST, bos_token_id=0,
                                       eos_token_id=0)).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch_size: int, seq_len: int) -> float:
        ids = torch.randint(0, VOCAB, (batch_size, seq_len), device=dev)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    step(2, 8)  # kernels and AdamW's state before the budget, as a loop past its first step
    lengths = named_lengths("long-tail", SAMPLES, longest=LONGEST)
    t0 = time.perf_counter()
    plan = oomguard.search_shapes(step, lengths, restore=(model, optimizer), budget=BUDGET,
                                  device=dev)
    planned_s = time.perf_counter() - t0
    batches = plan.batches(lengths, shuffle=True, seed=0)
    ooms = 0
    t0 = time.perf_counter()
    with oomguard.budget(BUDGET, dev):
        for batch in batches:
            try:
                step(len(batch), max(lengths[i] for i in batch))
            except Exception as exc:  # noqa: BLE001 - counted, not hidden: an OOM is a result
                if not oomguard.is_oom(exc):
                    raise
                ooms += 1
    epoch_s = time.perf_counter() - t0
    at_longest = plan.max_batch(LONGEST)
    longest_batches = math.ceil(SAMPLES / max(1, at_longest))
    ratio = longest_batches / len(batches)  # real tokens per batch: the same tokens, fewer batches
    ok = plan.trials <= 6 and ooms == 0 and ratio >= 3
    shown = {n: plan.max_batch(n) for n in (32, 128, LONGEST)}
    return ok, (f"{plan.trials} trials in {planned_s:.1f} s, max_batch {shown}; epoch of "
                f"{len(batches)} batches in {epoch_s:.1f} s, {ooms} OOMs; {ratio:.2f}x the real "
                f"tokens per batch of {at_longest} rows at length {LONGEST}")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA here")
        return 0
    ok, measured = check_shapes(torch.device(args.device))
    print(("passed: " if ok else "FAILED: ") + measured)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
