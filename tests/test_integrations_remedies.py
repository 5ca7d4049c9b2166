"""``remedies=`` on the framework integrations: ``OomguardTrainer`` (``oomguard_options``) and
Lightning's ``BatchSizeCallback`` price each configuration of the effective batch
(engine/core/execute/priced.py), train to the end in the one chosen with the effective batch
kept, and undo it afterwards; bad input is one line before any work. The real Trainer and
Lightning on a tiny two-layer GPT-2 (tests/framework_parts.py), under real CPU budgets in
fresh processes (tests/conftest.py ``in_fresh_process``)."""

from __future__ import annotations

import pytest

from tests.conftest import budget_after_warmup, in_fresh_process
from tests.framework_parts import gpt2, lightning_parts, token_ids, trained_under

EFFECTIVE = 64  # rows per device and optimizer step, as configured
STEPS = 3
# Measured: one 64-row step of the two-layer model (logits of 1024 words) runs out of memory
# under it, a 32-row one does not; every configuration's search fits under it.
BUDGET = 32 * 1024**2
MAX_TRIALS = 5  # per configuration's search: enough for a safe size, and a short test


def _hf_trainer(cls: type, layers: int = 2, **options):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="/tmp/oomguard-test-hf-remedies", report_to=[],
                             per_device_train_batch_size=EFFECTIVE,
                             gradient_accumulation_steps=1, max_steps=STEPS, logging_steps=1,
                             save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    rows = [{"input_ids": r, "labels": r} for r in token_ids(EFFECTIVE * STEPS)]
    return cls(model=gpt2(layers=layers), args=args, train_dataset=rows, **options)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _checkpointed(model) -> bool:
    """Whether the model's repeated blocks run checkpointed now (their forward replaced)."""
    from oomguard.engine.core.recompute import repeated_blocks

    return any("forward" in vars(b) for b in repeated_blocks(model))


def _trainer_with_remedies() -> dict:
    """The configured Trainer without a budget (the reference); OomguardTrainer with
    ``remedies=("checkpoint",)`` under the budget, what each training step ran in; the
    configured Trainer under the budget (must run out)."""
    from transformers import Trainer, TrainerCallback

    from oomguard.integrations import OomguardTrainer

    reference = _hf_trainer(Trainer)
    reference.train()
    out: dict = {"reference": _losses(reference)}

    seen: list[bool] = []

    class Probe(TrainerCallback):  # the configuration each optimizer step of training ran in
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(_checkpointed(model))

    ours = _hf_trainer(OomguardTrainer, callbacks=[Probe()], oomguard_options={
        "remedies": ("checkpoint",), "max_trials": MAX_TRIALS})
    with budget_after_warmup(BUDGET):
        ours.train()
    split, choice = ours.oomguard_train, ours.oomguard_remedy
    out.update(ours=_losses(ours), steps=ours.state.global_step, seen=seen,
               after=_checkpointed(ours.model), sizes=list(split.sizes),
               allowed=split.allowed, choice=choice.to_dict(), same=choice is split.remedy,
               args=(ours.args.per_device_train_batch_size,
                     ours.args.gradient_accumulation_steps))

    plain = _hf_trainer(Trainer)
    out["plain"] = trained_under(lambda: budget_after_warmup(BUDGET), plain)
    return out


@pytest.mark.slow  # three searches and six timed steps, forked: ~15 s on a busy 2-core CPU
def test_trainer_trains_in_the_configuration_priced_with_the_effective_batch_kept():
    from oomguard.training import micro_batches

    got = in_fresh_process(_trainer_with_remedies)
    choice, table = got["choice"], got["choice"]["table"]
    assert got["plain"] == "oom"  # the configured batch does not fit this budget plainly
    assert got["same"] and choice["rows"] == EFFECTIVE
    assert [r["configuration"] for r in table] == ["checkpoint", "checkpoint every 2"]
    chosen = next(r for r in table if r["status"] == "chosen")
    assert chosen["configuration"] == choice["chosen"] and choice["confirmation"]["ok"]
    assert all(r["samples_per_second"] for r in table if r["status"] in ("chosen", "measured"))
    # the split follows the chosen configuration's micro-batch; every step sees every row
    assert got["allowed"] == choice["micro_batch"] == chosen["micro_batch"]
    assert got["sizes"] == micro_batches(EFFECTIVE, got["allowed"])
    sizes = got["sizes"]
    assert got["args"] == ((sizes[0], len(sizes)) if len(set(sizes)) == 1 else (EFFECTIVE, 1))
    assert got["steps"] == STEPS  # trained to the end: no OOM
    assert got["seen"] == [True] * STEPS and not got["after"]  # checkpointed, then undone
    assert got["ours"] == pytest.approx(got["reference"], rel=1e-5)  # the same training


def _lightning_with_remedies() -> dict:
    """``BatchSizeCallback(remedies=("accumulate", "checkpoint"))`` fitting the module under the
    budget: the rows of each training step, what each ran in, and the table."""
    import lightning.pytorch as pl
    import torch

    from oomguard.integrations import BatchSizeCallback

    module, data = lightning_parts(EFFECTIVE * STEPS, EFFECTIVE, torch.float32,
                                   lambda p: torch.optim.AdamW(p, lr=1e-3), layers=2)
    seen: list[bool] = []

    class Probe(pl.Callback):  # the configuration each training step ran in
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(_checkpointed(pl_module))

    callback = BatchSizeCallback(remedies=("accumulate", "checkpoint"), max_trials=MAX_TRIALS)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1,
                         callbacks=[callback, Probe()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with budget_after_warmup(BUDGET):
        trainer.fit(module, data)
    split, choice = callback.split, callback.remedy
    return {"rows": module.rows, "steps": trainer.global_step, "seen": seen,
            "after": _checkpointed(module), "sizes": list(split.sizes),
            "allowed": split.allowed, "accumulate": trainer.accumulate_grad_batches,
            "choice": choice.to_dict(), "every": choice.chosen.every}


@pytest.mark.slow  # three searches and six timed steps, forked: ~15 s on a busy 2-core CPU
def test_lightning_fits_in_the_configuration_priced_with_the_effective_batch_kept():
    from oomguard.training import micro_batches

    got = in_fresh_process(_lightning_with_remedies)
    choice = got["choice"]
    rows = {r["configuration"]: r for r in choice["table"]}
    assert list(rows) == ["accumulate", "checkpoint", "checkpoint every 2"]
    # the whole batch does not fit at one plain micro-batch, so every configuration is priced
    assert rows["accumulate"]["micro_batch"] < EFFECTIVE and rows["accumulate"]["steps"] > 1
    assert all(r["status"] in ("chosen", "measured") and r["samples_per_second"]
               for r in rows.values()), choice
    assert rows[choice["chosen"]]["status"] == "chosen" and choice["confirmation"]["ok"]
    sizes = got["sizes"]
    assert got["allowed"] == choice["micro_batch"] and sizes == micro_batches(
        EFFECTIVE, got["allowed"])
    assert got["steps"] == STEPS and got["accumulate"] == len(sizes)
    assert got["rows"] == sizes * STEPS  # every optimizer step: every row of the batch
    # each training step ran in the configuration chosen, undone when the fit ended
    assert got["seen"] == [got["every"] > 0] * len(got["rows"]) and not got["after"]


@pytest.mark.slow  # builds Trainers (~1 s each)
def test_bad_remedies_on_the_trainer_are_one_line_when_it_is_built():
    from oomguard.engine.errors import UsageError
    from oomguard.integrations import OomguardTrainer

    cases = [
        ({"remedies": ("accumulate", "flash")}, 2, "unknown remedy 'flash'"),
        ({"remedies": ("checkpoint",)}, 1, "needs repeated blocks and GPT2LMHeadModel has none"),
        ({"remedies": ("accumulate",), "isolate": True}, 2, "do not apply to pricing"),
    ]
    for options, layers, words in cases:
        with pytest.raises(UsageError, match=words) as info:
            _hf_trainer(OomguardTrainer, layers=layers, oomguard_options=options)
        assert "\n" not in str(info.value)
    # no remedies: today's behaviour, nothing priced
    trainer = _hf_trainer(OomguardTrainer, oomguard_options={"max_trials": 3})
    assert trainer.oomguard_remedies is None and trainer.oomguard_remedy is None


@pytest.mark.slow  # the first Lightning import and Trainer take ~4 s
def test_bad_remedies_on_the_callback_are_one_line_before_any_work():
    import lightning.pytorch as pl
    import torch

    from oomguard.engine.errors import UsageError
    from oomguard.integrations import BatchSizeCallback

    for remedies, words in [(("flash",), "unknown remedy 'flash'"),
                            ("checkpoint,checkpoint", "given twice")]:
        with pytest.raises(UsageError, match=words):
            BatchSizeCallback(remedies=remedies)
    with pytest.raises(UsageError, match="do not apply to pricing"):
        BatchSizeCallback(remedies=("accumulate",), confirm=True)

    module, data = lightning_parts(16, 8, torch.float32, lambda p: torch.optim.SGD(p, lr=0.1))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False,
                         callbacks=[BatchSizeCallback(remedies=("checkpoint",))],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(UsageError, match="has none; leave it out of remedies") as info:
        trainer.fit(module, data)  # one layer: no repeated blocks
    assert "\n" not in str(info.value)
    assert module.rows == [] and not trainer.optimizers[0].state  # nothing ran
