"""A nanoGPT-style training loop that picks its micro-batch by searching its own step.

The loop is the usual shape: a tiny GPT (written here), AdamW, a GradScaler, and an inner
``micro_step`` loop that accumulates ``--accum`` micro-batches of ``--batch`` rows before each
optimizer step. Two oomguard lines change it:

1. Before training, ``oomguard.search(step, restore=(model, optimizer))`` runs the whole step
   (two micro-steps of forward and backward, ``scaler.step``, ``zero_grad``; the first
   optimizer step allocates AdamW's state) at growing sizes, and puts the model and optimizer back as they were after
   every trial. The loop then keeps its effective batch (``--batch x --accum`` rows per
   optimizer step) and splits it into the fewest micro-batches that fit, as equal as the rows
   allow (``oomguard.training.micro_batches``: 480 rows where 130 fit run as 120 x 4).
2. Inside the ``micro_step`` loop, ``oomguard.accumulate(..., backward=...)`` runs the user's
   own backward (``scaler.scale(loss * rows / effective).backward()``, each micro-batch's
   share of the rows) and, should memory shrink
   mid-run, splits that micro-batch further with each row counted exactly once.

A CPU memory budget (``--budget``, default 28MiB; 0 for none) makes the OOMs real on a machine
without a GPU: the configured 480 rows per step do not fit in it. Runs on CPU in seconds::

    python examples/nanogpt_loop.py --iters 30 --budget 28MiB
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time

import torch
from torch import nn
from torch.nn import functional as F

import oomguard
from oomguard.training import micro_batches

VOCAB, BLOCK = 64, 32  # tokens, context length


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for y in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm blocks (attention, 4x MLP), a tied head."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 1) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(BLOCK, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(dim), "attn": SelfAttention(dim, heads), "ln2": nn.LayerNorm(dim),
            "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
        }) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        for p in self.parameters():  # small weights, as GPT-2 starts: a loss near ln(VOCAB)
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = x + block["attn"](block["ln1"](x))
            x = x + block["mlp"](block["ln2"](x))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))  # mean over tokens


def make_data(n_tokens: int, seed: int = 0) -> torch.Tensor:
    """A learnable stream: runs of tokens that step by a random stride, modulo the vocab."""
    g = torch.Generator().manual_seed(seed)
    stride = torch.randint(1, 5, (n_tokens // 16 + 1,), generator=g).repeat_interleave(16)
    return torch.cumsum(stride[:n_tokens], 0) % VOCAB


def get_batch(data: torch.Tensor, rows: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    ix = torch.randint(len(data) - BLOCK - 1, (rows,), generator=g)
    x = torch.stack([data[i:i + BLOCK] for i in ix.tolist()])
    y = torch.stack([data[i + 1:i + BLOCK + 1] for i in ix.tolist()])
    return {"x": x, "y": y}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch", type=int, default=480, help="configured micro-batch, rows")
    p.add_argument("--accum", type=int, default=1, help="configured micro-batches per step")
    p.add_argument("--budget", default="28MiB", help="CPU memory budget, e.g. 28MiB; 0 for none")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp16 on CUDA: enabled=True
    data, g = make_data(200_000), torch.Generator().manual_seed(1)
    effective = args.batch * args.accum  # rows per optimizer step: the training's maths
    probe = get_batch(data, effective, torch.Generator().manual_seed(2))

    def step(size: int) -> float:  # one whole optimizer step at ``size`` rows: what a trial runs
        # Two micro-steps where the loop accumulates, the second a row shorter: the gradients'
        # accumulation, and both shapes of near-equal micro-batches.
        for rows in (size,) if size >= effective else (size, max(1, size - 1)):
            loss = model(probe["x"][:rows], probe["y"][:rows])
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    model(probe["x"][:2], probe["y"][:2]).backward()  # warm-up before the budget
    model.zero_grad(set_to_none=True)
    nbytes = oomguard.memory.parse_size(args.budget) if args.budget not in ("0", "") else 0
    limited = (lambda: oomguard.budget(nbytes, "cpu")) if nbytes else contextlib.nullcontext
    with limited():
        found = oomguard.search(step, restore=(model, optimizer), max_size=effective)
    sizes = micro_batches(effective, found.size_to_use)  # rows of each micro-step
    logging.info("search: largest that ran %d, safe %d; micro-batches %s = %d rows per step",
                 found.max_ok, found.size_to_use, " + ".join(map(str, sizes)), effective)

    losses, start = [], time.perf_counter()
    with limited():
        for _ in range(args.iters):
            total = 0.0
            for rows in sizes:  # nanoGPT's micro_step loop, one micro-batch of `rows` each
                share = rows / effective  # of the step's loss: the micro-batches may differ
                batch = get_batch(data, rows, g)
                loss = oomguard.accumulate(
                    lambda mb: model(mb["x"], mb["y"]), batch, params=model, optimizer=optimizer,
                    backward=lambda loss, share=share: scaler.scale(loss * share).backward())
                total += float(loss) * share
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total)
    seconds = time.perf_counter() - start
    print(f"micro-batches {' + '.join(map(str, sizes))} = {effective} rows per step; loss "
          f"{losses[0]:.3f} -> {losses[-1]:.3f} (ln {VOCAB} = {math.log(VOCAB):.3f}) in "
          f"{seconds:.1f} s")
    return {"sizes": sizes, "found": found.max_ok, "safe": found.size_to_use, "losses": losses}


if __name__ == "__main__":
    main()
