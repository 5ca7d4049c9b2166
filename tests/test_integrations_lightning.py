"""The Lightning integration: ``BatchSizeCallback`` with real Lightning on CPU, a tiny module and
datamodule, under a real CPU budget in a fresh process (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.conftest import budget_after_warmup, in_fresh_process

CONFIGURED = 1024  # batch_size rows, accumulate_grad_batches 1
STEPS = 3
BUDGET = 40 * 1024**2  # measured: a step at 1024 rows needs more, at 256 (x4) less


def _parts(batch_size: int):
    import lightning.pytorch as pl
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    class Data(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = batch_size
            g = torch.Generator().manual_seed(0)
            self.x = torch.randint(0, 64, (CONFIGURED * STEPS, 32), generator=g)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(self.x)
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
            self.net = GPT2LMHeadModel(config)
            self.rows, self.rows_per_step = 0, []

        def training_step(self, batch, batch_idx):
            (x,) = batch
            self.rows += len(x)
            loss = self.net(input_ids=x, labels=x).loss
            self.log("loss", loss)  # the search's trials must tolerate logging
            return loss

        def on_train_start(self) -> None:
            self.rows = 0  # the search's trials ran training_step too

        def on_before_optimizer_step(self, optimizer) -> None:
            self.rows_per_step.append(self.rows)
            self.rows = 0

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Net(), Data()


def _fit(callbacks: list) -> tuple:
    import lightning.pytorch as pl
    import torch

    torch.manual_seed(0)
    module, data = _parts(CONFIGURED)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with budget_after_warmup(BUDGET):
        trainer.fit(module, data)
    return module, data, trainer


def _fit_both_ways() -> dict:
    import oomguard
    from oomguard.integrations import BatchSizeCallback

    callback = BatchSizeCallback()
    module, data, trainer = _fit([callback])
    out = {"rows_per_step": module.rows_per_step, "steps": trainer.global_step,
           "batch_size": data.batch_size, "accumulate": trainer.accumulate_grad_batches,
           "found": callback.split.found, "fits": callback.split.search.size_to_use,
           "sizes": list(callback.split.sizes)}
    try:
        _fit([])
        out["plain"] = "ran"
    except Exception as exc:
        out["plain"] = "oom" if oomguard.is_oom(exc) else repr(exc)
    return out


@pytest.mark.slow
def test_callback_micro_batches_a_batch_that_does_not_fit_with_the_effective_batch_kept():
    from oomguard.training import micro_batches

    got = in_fresh_process(_fit_both_ways)
    assert got["plain"] == "oom"  # the configured batch does not fit this budget
    assert got["steps"] == STEPS  # the fit ran to the end: no OOM
    sizes = got["sizes"]
    assert sizes == micro_batches(CONFIGURED, got["fits"]) and len(sizes) > 1
    assert got["accumulate"] == len(sizes) and got["fits"] <= got["found"]
    # equal: Lightning's batch_size; unequal: the loader loads every row, handed out in parts
    assert got["batch_size"] == (sizes[0] if len(set(sizes)) == 1 else CONFIGURED)
    assert got["rows_per_step"] == [CONFIGURED] * STEPS  # every optimizer step: every row


@pytest.mark.slow  # the first Lightning import and Trainer take ~4 s
def test_callback_refuses_dataloaders_passed_to_fit_in_one_line():
    import lightning.pytorch as pl
    import torch

    from oomguard.engine.errors import UsageError
    from oomguard.integrations import BatchSizeCallback

    module, data = _parts(8)
    module.batch_size = 8
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False,
                         callbacks=[BatchSizeCallback()], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x[:8]))
    with pytest.raises(UsageError, match="dataloaders passed to fit"):
        trainer.fit(module, train_dataloaders=loader)
