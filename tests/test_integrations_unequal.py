"""Unequal micro-batches keep the whole batch's step: 61 rows (a prime: any split of two or more
micro-batches is unequal) searched under a real 32 MiB budget (the search's own ``budget=``),
then trained without one. After two SGD steps in float64, the weights moved exactly as one
61-row step per optimizer step moved them: in the transformers Trainer (its loss normalised by
the batch's tokens, and weighted by rows where the model takes no ``num_items_in_batch``) and
in Lightning (a rebuilt ``DataLoader`` handing out the micro-batches)."""

from __future__ import annotations

import pytest
import torch

from tests.framework_parts import gpt2, lightning_parts, token_ids

EFFECTIVE = 61  # rows per optimizer step
STEPS = 2
SEARCH_BUDGET = 32 * 1024**2  # measured: a step at 61 rows needs more, at 30 less (float64 below)


def _moved(model: torch.nn.Module, before: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before,
                                                                   strict=True)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _trainer_update(ours: bool, loss_kwargs: bool) -> tuple[torch.Tensor, object]:
    """What two steps of a Trainer moved the weights by, and its split (None: the reference,
    a plain Trainer at one 61-row batch per step)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from oomguard.integrations import OomguardTrainer

    model = gpt2(torch.float64)  # no dropout: one batch and its parts agree
    before = [p.detach().clone() for p in model.parameters()]
    rows = [{"input_ids": r, "labels": r} for r in token_ids(EFFECTIVE * STEPS)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=EFFECTIVE,
                                 max_steps=STEPS, optim="sgd", learning_rate=0.5,
                                 max_grad_norm=0.0, lr_scheduler_type="constant", seed=0,
                                 report_to=[], save_strategy="no", logging_strategy="no",
                                 use_cpu=True, disable_tqdm=True)
        options = {"oomguard_options": {"budget": SEARCH_BUDGET}} if ours else {}
        trainer = (OomguardTrainer if ours else Trainer)(model=model, args=args,
                                                         train_dataset=rows, **options)
        trainer.model_accepts_loss_kwargs = loss_kwargs
        trainer.train()
    return _moved(model, before), getattr(trainer, "oomguard_train", None)


@pytest.mark.slow  # four Trainers, a search of twelve-odd trials: ~6 s on an idle machine
def test_trainer_unequal_micro_batches_move_the_weights_as_the_whole_batch():
    for loss_kwargs in (True, False):  # tokens of the whole batch; rows' shares of the loss
        reference, _ = _trainer_update(False, loss_kwargs)
        moved, split = _trainer_update(True, loss_kwargs)
        assert len(split.sizes) >= 2 and not split.equal and sum(split.sizes) == EFFECTIVE
        assert split.micro_batch <= split.allowed <= split.found
        assert _rel(moved, reference) < 1e-6, (loss_kwargs, split.sizes)


def _lightning_update(ours: bool) -> tuple[torch.Tensor, object, list[int]]:
    import lightning.pytorch as pl

    from oomguard.integrations import BatchSizeCallback

    module, data = lightning_parts(EFFECTIVE * STEPS, EFFECTIVE, torch.float64,
                                   lambda params: torch.optim.SGD(params, lr=0.5))
    callback = BatchSizeCallback(budget=SEARCH_BUDGET)
    torch.manual_seed(0)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                         callbacks=[callback] if ours else [], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    assert "backward" not in vars(module)  # the weighting is undone when the fit ends
    return _moved(module, before), callback.split if ours else None, module.rows


@pytest.mark.slow  # Lightning's first import and two fits with a search: ~6 s on an idle machine
def test_lightning_unequal_micro_batches_move_the_weights_as_the_whole_batch():
    reference, _, whole = _lightning_update(False)
    moved, split, rows = _lightning_update(True)
    assert whole == [EFFECTIVE] * STEPS
    assert len(split.sizes) >= 2 and not split.equal and sum(split.sizes) == EFFECTIVE
    assert rows == list(split.sizes) * STEPS  # each step: every row, in its micro-batches
    assert _rel(moved, reference) < 1e-6, split.sizes
