"""Lightning with ``BatchSizeCallback(lengths=...)``: micro-batches planned from the training
samples' lengths (engine/integrations/lightning_callback.py, length_steps.py).

The Trainer test's long tail (tests/test_integrations_lengths.py: 96 samples of 4 to 32
tokens, 48 rows per optimizer step, a real 32 MiB search budget): each step's samples come as
one batch, the module's ``training_step`` runs in the plan's micro-batches at their own length,
each loss weighted by its share of the step's counted tokens (a causal LM's: all but each
row's first). After two SGD steps in float64 the weights moved as a plain fit over the same
steps, each one whole batch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import in_fresh_process
from test_integrations_lengths import BUDGET, EFFECTIVE, LENGTHS, STEPS, _array, _samples, collate

from oomguard.engine.errors import UsageError
from tests.framework_parts import SEQ, gpt2


def _parts(order: list[int], batch_size: int):
    import lightning.pytorch as pl

    class Data(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = batch_size

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(_samples(order), batch_size=self.batch_size,
                                               collate_fn=collate)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = gpt2(torch.float64)
            self.seen: list[tuple[int, int]] = []

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            self.seen.append(tuple(batch["input_ids"].shape))
            return self.net(**batch).loss

        def on_train_start(self) -> None:
            self.seen = []  # the plan's trials ran training_step too

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Net(), Data()


def _fit(module, data, callbacks) -> torch.Tensor:
    import lightning.pytorch as pl

    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                         callbacks=callbacks, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(module.parameters(), before,
                                                                   strict=True)])


def planned_fit() -> dict:
    """In a fresh process: the fit by length; the move, the micro-batches, the steps run."""
    import lightning.pytorch as pl

    from oomguard.engine.integrations.length_steps import StepSampler
    from oomguard.integrations import BatchSizeCallback

    pl.seed_everything(0, verbose=False)
    module, data = _parts(list(range(len(LENGTHS))), EFFECTIVE)
    callback = BatchSizeCallback(lengths=LENGTHS, weight_by="causal-tokens", budget=BUDGET)
    moved = _fit(module, data, [callback])
    plan = callback.split.plan
    sampler = StepSampler(LENGTHS, plan.max_batch, EFFECTIVE, seed=torch.initial_seed() % 2**31)
    return {"moved": _array(moved), "seen": module.seen, "steps": list(sampler)[:STEPS],
            "max_batch": {n: plan.max_batch(n) for n in range(1, SEQ + 1)},
            "trials": plan.trials, "restored": "training_step" not in vars(module)}


def whole_fit(steps: list[list[int]]) -> torch.Tensor:
    module, data = _parts([i for s in steps for i in s], EFFECTIVE)
    return _fit(module, data, [])


@pytest.mark.slow
def test_lightning_by_length_runs_the_plans_micro_batches_and_moves_the_weights_as_whole_steps():
    got = in_fresh_process(planned_fit)
    steps, seen, max_batch = got["steps"], got["seen"], got["max_batch"]
    assert got["trials"] <= 6 and got["restored"]
    assert max_batch[SEQ] < EFFECTIVE <= max_batch[4]  # the long samples do not fit whole
    assert [len(s) for s in steps] == [EFFECTIVE] * STEPS
    assert all(rows <= max_batch[cols] for rows, cols in seen), seen
    assert sum(rows for rows, _ in seen) == EFFECTIVE * STEPS
    assert len(seen) > STEPS and min(cols for _, cols in seen) < SEQ
    reference = whole_fit(steps)
    moved = torch.from_numpy(got["moved"])
    assert float((moved - reference).norm() / reference.norm()) < 1e-6


def test_lengths_bad_input_is_one_line_before_any_work() -> None:
    from oomguard.integrations import BatchSizeCallback

    for given, words in ((dict(lengths=[4, 0]), "lengths\\[1\\] is 0"),
                         (dict(lengths=[4], remedies=("accumulate",)), "give one of them"),
                         (dict(lengths=[4], weight_by="words"), "weight_by must be one of")):
        with pytest.raises(UsageError, match=words) as info:
            BatchSizeCallback(**given)
        assert "\n" not in str(info.value)
