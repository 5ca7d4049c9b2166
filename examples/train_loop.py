"""A plain PyTorch training loop that survives out-of-memory errors without changing its maths.

- Training: every optimizer step sees the same effective batch (``--batch``
  rows). When it does not fit, :func:`accumulate` splits it into micro-batches
  and accumulates exact, sample-weighted gradients; the micro-batch size is
  found by halving and remembered.
- Evaluation: ``@oomguard.adaptive`` picks the largest evaluation batch that fits,
  starting at the whole validation set.

A CPU memory budget (``--budget``, default 32MiB; 0 for none) makes the OOMs
real on a machine without a GPU. Runs on CPU in a few seconds::

    python examples/train_loop.py --steps 20 --budget 32MiB --grow-after 5
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time

import torch

import oomguard


def make_data(n: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    return x, (torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=1024, help="effective batch, rows")
    parser.add_argument("--budget", default="32MiB",
                        help="CPU memory budget for the loop, e.g. 48MiB; 0 for none")
    parser.add_argument("--grow-after", type=int, default=None,
                        help="try a larger micro-batch after this many clean steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    torch.manual_seed(0)
    dim, hidden = 32, 4096  # wide and cheap: ~64 KiB of activations and gradients per row
    model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x_train, y_train = make_data(args.batch * args.steps, dim)
    x_val, y_val = make_data(4096, dim, seed=1)

    def step(mb: dict) -> torch.Tensor:  # the mean loss over the micro-batch's own rows
        return torch.nn.functional.mse_loss(model(mb["x"]).squeeze(-1), mb["y"])

    @oomguard.adaptive(batch_size=len(x_val))
    @torch.no_grad()
    def evaluate(batch_size: int) -> float:
        total = 0.0
        for i in range(0, len(x_val), batch_size):
            pred = model(x_val[i:i + batch_size]).squeeze(-1)
            total += float(((pred - y_val[i:i + batch_size]) ** 2).sum())
        return total / len(x_val)

    step({"x": x_train[:2], "y": y_train[:2]}).backward()  # warm-up before the budget
    model.zero_grad(set_to_none=True)  # accumulate adds to the gradients it finds
    nbytes = oomguard.memory.parse_size(args.budget) if args.budget not in ("0", "") else 0

    def limited() -> contextlib.AbstractContextManager:
        """The budget caps what forward and backward may add (weights and optimizer state
        live outside it), as a smaller accelerator would."""
        return oomguard.budget(nbytes, "cpu") if nbytes else contextlib.nullcontext()

    start = time.perf_counter()
    for i in range(args.steps):
        rows = slice(i * args.batch, (i + 1) * args.batch)
        with limited():
            loss = oomguard.accumulate(step, {"x": x_train[rows], "y": y_train[rows]}, params=model,
                              grow_after=args.grow_after)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {loss.item():.4f}")
    with limited():
        print(f"validation mse {evaluate():.4f}")
    print(f"{args.steps} steps of {args.batch} rows in {time.perf_counter() - start:.1f} s")
    print(oomguard.stats())


if __name__ == "__main__":
    main()
