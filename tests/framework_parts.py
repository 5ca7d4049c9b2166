"""What the integration tests build on: a tiny GPT-2 without dropout, fixed token rows, and a
Lightning module and datamodule around them (imported where a test uses them)."""

from __future__ import annotations

from collections.abc import Callable

import torch

SEQ, VOCAB = 32, 1024  # logits of 1024 words: memory grows with the rows, compute stays small


def gpt2(dtype: torch.dtype = torch.float32, layers: int = 1) -> torch.nn.Module:
    """GPT-2 with ``layers`` layers (1: no repeated blocks to checkpoint), 32 wide, fixed
    random weights, no dropout (one batch and its parts then compute the same)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                        eos_token_id=None)
    return GPT2LMHeadModel(config).to(dtype)


def trained_under(budget: Callable[[], object], trainer: object) -> str:
    """``trainer.train()`` inside the context ``budget()`` makes: "ran", "oom" (an OOM as
    oomguard reads it) or the error's repr, for a test to assert."""
    import oomguard

    try:
        with budget():
            trainer.train()
    except Exception as exc:  # the OOM a budget causes, or anything else to report
        return "oom" if oomguard.is_oom(exc) else repr(exc)
    return "ran"


def token_ids(n: int, seed: int = 3) -> torch.Tensor:
    """``n`` rows of ``SEQ`` tokens."""
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def lightning_parts(rows: int, batch_size: int, dtype: torch.dtype,
                    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                    layers: int = 1) -> tuple[object, object]:
    """A LightningModule around :func:`gpt2` of ``layers`` layers (its ``rows`` list: the rows of every
    ``training_step`` of the fit) and a datamodule of ``rows`` shuffled token rows whose
    loader reads ``batch_size`` from the datamodule."""
    import lightning.pytorch as pl

    class Data(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = batch_size

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            data = torch.utils.data.TensorDataset(token_ids(rows))
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = gpt2(dtype, layers)
            self.rows: list[int] = []

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            self.rows.append(len(ids))
            return self.net(input_ids=ids, labels=ids).loss

        def on_train_start(self) -> None:
            self.rows = []  # a search's trials ran training_step too

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(list(self.parameters()))

    return Net(), Data()
