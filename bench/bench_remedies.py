#!/usr/bin/env python
"""Remedies priced by speed, side by side: where checkpointing beats accumulation, by how much,
and where it does not.

Each row prices one workload with ``choose_remedy`` (accumulation, checkpointing every block
and every other block) in a fresh process under a real CPU budget (``RLIMIT_DATA``): each
configuration's largest safe micro-batch is searched, then one optimizer step of each is
timed in interleaved rounds in that one run. The row shows accumulation's micro-batch and
rate, the best checkpointing's, what was chosen and the chosen rate over accumulation's.

- ``loader`` and ``costly``: the two workloads of tests/test_remedies_priced.py (a fixed
  wait per micro-batch with a large embedding; a wait in each block's forward with a wide
  head); their waits decide the outcome whatever the load on the machine.
- ``gpt2``: a small GPT-2 training step (transformers, random init; 4 layers, 64 wide, 128
  tokens, vocabulary 8192, AdamW) with no wait at all: what this machine's cores make of it.

Run from the repository root::

    python bench/bench_remedies.py [--only loader,costly,gpt2] [--json]
    python bench/bench_remedies.py --recompute   # what checkpointing costs per block
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test workloads, one definition for both

MiB = 1024**2
GPT2 = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 8192, "n_positions": 128}
GPT2_ROWS, GPT2_BUDGET = 48, 96 * MiB


def gpt2_priced() -> dict[str, Any]:
    """The GPT-2 step priced at ``GPT2_ROWS`` rows under ``GPT2_BUDGET``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from oomguard.engine.core.execute.priced import choose_remedy

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2, bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, GPT2["vocab_size"], (GPT2_ROWS, GPT2["n_positions"]))

    def step(n: int) -> None:
        model(input_ids=ids[:n], labels=ids[:n]).loss.backward()

    step(2)  # AdamW's state before the budget, as in a loop past its first step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return choose_remedy(step, GPT2_ROWS, model, optimizer=optimizer, budget=GPT2_BUDGET,
                         name="gpt2").to_dict()


def row(kind: str) -> dict[str, Any]:
    """One workload priced in this (fresh) process: its record and the wall seconds."""
    t0 = time.perf_counter()
    if kind == "gpt2":
        record = gpt2_priced()
    else:
        from test_remedies_priced import priced

        record = priced(kind, 28 if kind == "loader" else 24)["choice"]
    return {"kind": kind, "record": record, "seconds": time.perf_counter() - t0}


def summary(result: dict[str, Any]) -> list[str]:
    rows = {r["configuration"]: r for r in result["record"]["table"]}
    plain = rows["accumulate"]
    ckpt = max((r for n, r in rows.items() if n.startswith("checkpoint")
                and r["samples_per_second"]), key=lambda r: r["samples_per_second"], default=None)

    def cell(r: dict[str, Any] | None) -> str:
        if r is None or r["samples_per_second"] is None:
            return "-"
        micro = f"{r['micro_batch']}" + (f" x {r['steps']}" if r["steps"] and r["steps"] > 1 else "")
        return f"{micro} @ {r['samples_per_second']:,.1f}/s"

    ratio = (ckpt["samples_per_second"] / plain["samples_per_second"]
             if ckpt and plain["samples_per_second"] else None)
    return [result["kind"], str(result["record"]["rows"]), cell(plain),
            (ckpt["configuration"] + " " + cell(ckpt)) if ckpt else "-",
            "-" if ratio is None else f"{ratio:.2f}x", result["record"]["chosen"],
            f"{result['seconds']:.0f}"]


def _first(out: Any) -> Any:
    """A block's output tensor (some transformers versions return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def _best_ms(fn: Any, repeats: int) -> float:
    """The fewest CPU milliseconds this process spent in one of ``repeats`` calls of ``fn``
    (after one untimed): with one thread, the work done, whatever else the machine runs."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times) * 1000


def _costs(model: Any, ids: Any, repeats: int) -> tuple[float, float, float]:
    """Milliseconds of a plain step, a checkpointed step, and one block's forward."""
    import torch

    from oomguard.engine.core.recompute import checkpointed

    blocks, hidden = model.transformer.h, model.transformer.wte(ids).detach()

    def plain() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def recomputed() -> None:
        with checkpointed(model):
            model(input_ids=ids, labels=ids).loss.backward()

    def forward() -> None:
        with torch.no_grad():
            h = hidden
            for block in blocks:
                h = _first(block(h))

    return (_best_ms(plain, repeats), _best_ms(recomputed, repeats),
            _best_ms(forward, repeats) / len(blocks))


def recompute_cost(repeats: int = 10) -> list[list[str]]:
    """What checkpointing every block costs per block per step (CPU time, fewest of
    ``repeats``, one thread, no budget): the step's extra milliseconds over the plain step,
    divided by the blocks, against one forward of a block (the forward of all blocks without gradients,
    divided by the blocks). Above one forward is the fixed cost of checkpointing a block."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    out = [["model", "rows", "plain step ms", "checkpointed step ms", "extra per block ms",
            "one block's forward ms", "extra / forward"]]
    for width in (64, 256):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(**{**GPT2, "n_embd": width}, bos_token_id=0,
                                           eos_token_id=0))
        for rows in (2, 16):
            ids = torch.randint(0, GPT2["vocab_size"], (rows, GPT2["n_positions"]))
            plain, recomputed, forward = _costs(model, ids, repeats)
            extra = (recomputed - plain) / len(model.transformer.h)
            out.append([f"gpt2 {len(model.transformer.h)} x {width} wide", str(rows),
                        f"{plain:.1f}", f"{recomputed:.1f}", f"{extra:.2f}", f"{forward:.2f}",
                        f"{extra / forward:.1f}x"])
            model.zero_grad(set_to_none=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="loader,costly,gpt2")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--recompute", action="store_true",
                    help="measure instead what checkpointing costs per block per step")
    args = ap.parse_args(argv)
    if args.recompute:
        from oomguard.engine.util.table import text_table

        print(text_table(recompute_cost()))
        return 0
    from conftest import in_fresh_process  # a fresh child per row, torch preloaded

    from oomguard.engine.util.table import text_table

    results = [in_fresh_process(row, kind) for kind in args.only.split(",")]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"remedies priced side by side (torch threads: {os.environ.get('OMP_NUM_THREADS')}; "
          f"checkpointing / accumulation: the best checkpointing's samples per second over "
          f"accumulation's, in one run)")
    print(text_table([["workload", "rows", "accumulation", "best checkpointing",
                       "checkpointing / accumulation", "chosen", "seconds"],
                      *(summary(r) for r in results)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
