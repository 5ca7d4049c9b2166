"""The transformers Trainer, sized by oomguard in one line: ``OomguardTrainer`` for ``Trainer``.

A tiny GPT-2 (built from a config, random weights, no download) learns generated sequences.
The arguments ask for 512 rows per device and step (``--batch``), which do not fit the CPU
budget (``--budget``, default 40MiB; 0 for none, as a smaller GPU would). Before training,
``OomguardTrainer`` searches the Trainer's own step (forward, backward, clipping, AdamW's
step) and splits the 512 rows into the fewest micro-batches that fit, as equal as the rows
allow, so every optimizer step still sees 512 rows and the losses are those of the
configured run; the evaluation batch is sized the same way. Runs on CPU in seconds::

    python examples/trainer_script.py --steps 5 --budget 40MiB
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import oomguard
from oomguard.integrations import OomguardTrainer


def make_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences that step by a per-row stride (a rule the model can learn), labels = inputs."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, 64, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(32)) % 64
    return [{"input_ids": r, "labels": r} for r in ids]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--batch", type=int, default=512, help="per_device_train_batch_size")
    p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--budget", default="40MiB", help="CPU memory budget; 0 for none")
    p.add_argument("--output-dir", default="trainer-output")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("oomguard.integrations").setLevel(logging.INFO)

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum, per_device_eval_batch_size=args.batch,
        max_steps=args.steps, learning_rate=3e-3, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, prediction_loss_only=True, seed=0)
    effective = args.batch * args.accum
    trainer = OomguardTrainer(model=GPT2LMHeadModel(config), args=training,
                              train_dataset=make_rows(effective * args.steps, 0),
                              eval_dataset=make_rows(args.batch, 1))
    trainer.model(**trainer.data_collator(make_rows(2, 2))).loss.backward()  # warm-up, then
    trainer.model.zero_grad(set_to_none=True)  # the budget (thread pools exist before it)
    nbytes = oomguard.memory.parse_size(args.budget) if args.budget not in ("0", "") else 0
    with oomguard.budget(nbytes, "cpu") if nbytes else contextlib.nullcontext():
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    split = trainer.oomguard_train
    print(f"micro-batches {split.describe()} = {effective} rows per step (largest that ran: "
          f"{split.found}); eval batch {trainer.args.per_device_eval_batch_size}; losses "
          f"{' '.join(f'{x:.4f}' for x in losses)}; eval {eval_loss:.4f}")
    return {"sizes": list(split.sizes), "found": split.found, "losses": losses,
            "eval_loss": eval_loss}


if __name__ == "__main__":
    main()
