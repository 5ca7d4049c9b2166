"""Lightning, sized by oomguard in one line: ``callbacks=[BatchSizeCallback()]``.

A tiny GPT-2 inside a ``LightningModule`` learns generated sequences from a
``LightningDataModule`` whose ``batch_size`` (``--batch``, 512 rows) does not fit the CPU
budget (``--budget``, default 40MiB; 0 for none). At the start of ``fit`` the callback
searches the module's training step with its optimizer, then runs the effective batch as the
fewest micro-batches that fit, as equal as the rows allow (``batch_size`` and
``accumulate_grad_batches``; unequal ones through a rebuilt DataLoader), so every optimizer
step still sees 512 rows. Runs on CPU in seconds::

    python examples/lightning_script.py --steps 5 --budget 40MiB

``--finder binsearch`` or ``--finder power`` runs Lightning's own ``BatchSizeFinder`` in that
mode instead, under the same budget, and prints the size it reports (``--finder largest``:
this callback, printing the exact maximum it found): run each in a fresh process to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import warnings

import lightning.pytorch as pl
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import oomguard
from oomguard.integrations import BatchSizeCallback


class Sequences(pl.LightningDataModule):
    def __init__(self, batch_size: int, rows: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, 64, (rows, 1), generator=g), torch.randint(1, 4, (rows, 1), generator=g)
        self.ids = (start + stride * torch.arange(32)) % 64

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.ids),
                                           batch_size=self.batch_size, shuffle=True)


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                              n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                              attn_pdrop=0.0))
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.net(input_ids=ids, labels=ids).loss
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs: dict, batch: list, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def fit(callback: pl.Callback | None, batch: int, steps: int, nbytes: int,
        rows: int | None = None) -> tuple:
    torch.manual_seed(0)
    module, data = TinyLM(), Sequences(batch, rows or batch * steps)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         callbacks=[callback] if callback else [], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir="lightning-output")
    module.net(input_ids=data.ids[:2], labels=data.ids[:2]).loss.backward()  # warm-up
    module.zero_grad(set_to_none=True)
    with oomguard.budget(nbytes, "cpu") if nbytes else contextlib.nullcontext():
        trainer.fit(module, data)
    return module, data, trainer


def finder(mode: str, batch: int, nbytes: int) -> int:
    """Lightning's BatchSizeFinder in ``mode`` under the budget: the size it reports."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    found = BatchSizeFinder(mode=mode, init_val=2, steps_per_trial=2, max_val=batch)
    with contextlib.suppress(Exception):  # the fit after it may still run out; its size stands
        fit(found, 2, 1, nbytes, rows=8 * batch)  # 8 x batch rows: it tries sizes up to batch
    return found.optimal_batch_size


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--batch", type=int, default=512, help="the datamodule's batch_size")
    p.add_argument("--budget", default="40MiB", help="CPU memory budget; 0 for none")
    p.add_argument("--finder", choices=("oomguard", "largest", "binsearch", "power"),
                   default="oomguard", help="oomguard's callback (at the recommended or the "
                   "largest size), or Lightning's BatchSizeFinder in that mode")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="lightning")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("oomguard.integrations").setLevel(logging.INFO)

    nbytes = oomguard.memory.parse_size(args.budget) if args.budget not in ("0", "") else 0
    if args.finder in ("binsearch", "power"):
        size = finder(args.finder, args.batch, nbytes)
        print(f"BatchSizeFinder(mode={args.finder!r}): {size}")
        return {"found": size}
    callback = BatchSizeCallback(largest=args.finder == "largest")
    module, data, trainer = fit(callback, args.batch, args.steps, nbytes)
    split = callback.split
    print(f"micro-batches {split.describe()} = {args.batch} rows per step (exact maximum: "
          f"{split.found}); {trainer.global_step} steps, last loss {module.losses[-1]:.4f}")
    return {"sizes": list(split.sizes), "accum": trainer.accumulate_grad_batches,
            "found": split.found, "steps": trainer.global_step}


if __name__ == "__main__":
    main()
