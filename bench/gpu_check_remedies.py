"""The remedies table of ``bench/gpu_check.py``: remedies priced by speed on a real GPU.

A GPT-2 training step (4 layers, 256 wide, 128 tokens, AdamW) must take ``ROWS`` rows per
optimizer step under a 1 GiB budget (``set_per_process_memory_fraction``), which one
micro-batch cannot hold. ``choose_remedy`` prices accumulation, checkpointing (every block and
every other block), bf16 autocast and the allocator's expandable segments: the last in a fresh
process started with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the setting is read
when the allocator starts), where every row runs with it. Passes when both processes chose a
configuration whose confirming step ran, every configuration has a row, and each measured row
has a micro-batch, a peak and a rate. Returns ``(passed, measured)`` with the two tables.

Run alone: ``python bench/gpu_check_remedies.py [--device cuda:0]`` (``--child`` is the fresh
process's entry).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUDGET = 1024**3  # bytes: the effective batch below needs several micro-batches under it
ROWS = 256  # rows per optimizer step
SEQ, VOCAB = 128, 4096
REMEDIES = ("accumulate", "checkpoint", "bf16", "expandable_segments")
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def price(device: str) -> dict[str, Any]:
    """The priced record (``RemedyChoice.to_dict``) of the GPT-2 step on ``device``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from oomguard.engine.core.execute.priced import choose_remedy

    dev = torch.device(device)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ)).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0)).to(dev)

    def step(n: int) -> None:
        model(input_ids=ids[:n], labels=ids[:n]).loss.backward()

    step(2)  # AdamW's state exists before the budget, as in a loop past its first step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    choice = choose_remedy(step, ROWS, model, optimizer=optimizer, remedies=REMEDIES,
                           name="gpt2-step", device=dev, budget=BUDGET)
    return choice.to_dict()


def _fresh(device: str) -> dict[str, Any]:
    """:func:`price` in a fresh process whose allocator starts with expandable segments."""
    env = {**os.environ, ALLOC_CONF: "expandable_segments:True"}
    done = subprocess.run([sys.executable, __file__, "--child", "--device", device], env=env,
                          capture_output=True, text=True, timeout=540)
    if done.returncode != 0:
        raise RuntimeError(f"the expandable-segments process failed: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _problems(record: dict[str, Any]) -> list[str]:
    rows = {r["configuration"]: r for r in record["table"]}
    out = [f"no row for {name}" for name in ("accumulate", "checkpoint", "checkpoint every 2",
                                             "bf16", "expandable_segments") if name not in rows]
    if not record["confirmation"].get("ok"):
        out.append(f"the confirming step of {record['chosen']} failed")
    out += [f"{r['configuration']}: measured without micro-batch, peak or rate"
            for r in record["table"] if r["status"] in ("measured", "chosen")
            and None in (r["micro_batch"], r["peak_bytes"], r["samples_per_second"])]
    return out


def check_remedies_table(dev: torch.device) -> tuple[bool, str]:
    """Price the remedies here and in a fresh process with expandable segments."""
    from gpu_check_budgets import clean

    from oomguard.engine.util.table import text_table
    from oomguard.reports.remedies import chosen_line, remedy_rows

    clean(dev)
    here = price(str(dev))
    clean(dev)
    fresh = _fresh(str(dev))
    expandable = {r["configuration"]: r for r in fresh["table"]}["expandable_segments"]
    problems = _problems(here) + _problems(fresh)
    if expandable["status"] != "in force":
        problems.append(f"expandable_segments in its own process: {expandable['status']}")
    tables = "\n".join(f"{what}: {chosen_line(r)}\n{text_table(remedy_rows(r))}"
                       for what, r in (("default allocator", here),
                                       (f"{ALLOC_CONF}=expandable_segments:True", fresh)))
    return not problems, "; ".join(problems) + ("\n" if problems else "") + tables


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    if args.child:
        print(json.dumps(price(args.device)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    ok, measured = check_remedies_table(torch.device(args.device))
    print(("passed" if ok else "FAILED") + "\n" + measured)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
