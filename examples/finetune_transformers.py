"""Fine-tune a transformers causal LM with exact micro-batching when a batch does not fit.

A tiny GPT-2 is built from a config with random weights (no download) and
trained on generated, right-padded sequences that follow a learnable rule
(each token is the previous one plus a per-sequence step, modulo the vocab).
Every optimizer step sees the whole batch: when it runs out of memory,
:func:`accumulate` splits it into micro-batches and weights each micro-batch's
loss by its share of the *shifted* label tokens (``labels[..., 1:] != -100``),
which is exactly what the model's own mean loss averages over, so the update
equals the whole batch's. ``--grow-after N`` tries a larger micro-batch again
after N clean steps (off by default: bit-for-bit reproducible runs).

A CPU memory budget (``--budget``, default 32MiB; 0 for none) makes the OOMs
real without a GPU. Runs on CPU in well under a minute::

    python examples/finetune_transformers.py --steps 15 --budget 32MiB
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import oomguard

VOCAB, SEQ = 512, 64


def make_batch(n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``n`` right-padded sequences: input_ids, attention_mask, labels (-100 on padding)."""
    start = torch.randint(0, VOCAB, (n, 1), generator=generator)
    step = torch.randint(1, 8, (n, 1), generator=generator)
    ids = (start + step * torch.arange(SEQ)[None, :]) % VOCAB
    lengths = torch.randint(SEQ // 4, SEQ + 1, (n,), generator=generator)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # pad id 0
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--budget", default="32MiB",
                        help="CPU memory budget for forward+backward, e.g. 32MiB; 0 for none")
    parser.add_argument("--grow-after", type=int, default=None,
                        help="try a larger micro-batch after this many clean steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: exact
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(0)

    def step(micro: dict[str, torch.Tensor]) -> torch.Tensor:
        # The model's loss: the mean over this micro-batch's shifted label tokens.
        return model(**micro).loss

    model(**make_batch(2, data)).loss.backward()  # warm-up before any budget
    model.zero_grad(set_to_none=True)  # accumulate adds to the gradients it finds
    nbytes = oomguard.memory.parse_size(args.budget) if args.budget not in ("0", "") else 0

    def limited() -> contextlib.AbstractContextManager:
        """The budget caps what forward and backward add (weights and AdamW state live outside)."""
        return oomguard.budget(nbytes, "cpu") if nbytes else contextlib.nullcontext()

    start = time.perf_counter()
    for i in range(args.steps):
        batch = make_batch(args.batch, data)
        with limited():
            loss = oomguard.accumulate(step, batch, params=model, weight_by="causal-tokens",
                              grow_after=args.grow_after)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {loss.item():.4f}")
    print(f"{args.steps} steps of {args.batch} sequences in {time.perf_counter() - start:.1f} s")
    print(oomguard.stats())


if __name__ == "__main__":
    main()
