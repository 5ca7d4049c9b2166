"""The transformers integration: ``OomguardTrainer`` with the real ``Trainer`` on a tiny GPT-2,
under a real CPU budget in a fresh process (tests/conftest.py ``in_fresh_process``)."""

from __future__ import annotations

import pytest

from tests.conftest import budget_after_warmup, in_fresh_process
from tests.framework_parts import trained_under

EFFECTIVE = 1024  # rows per device and optimizer step, as configured
STEPS = 3
BUDGET = 40 * 1024**2  # measured: the Trainer's step at 1024 rows needs more, at 256 less


def _data(n: int, seed: int) -> list[dict]:
    import torch

    ids = torch.randint(0, 64, (n, 32), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r} for r in ids]


def _trainer(cls: type, eval_batch: int = 8):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    # no dropout: its masks differ between one batch and its micro-batches
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    args = TrainingArguments(output_dir="/tmp/oomguard-test-hf", report_to=[],
                             per_device_train_batch_size=EFFECTIVE, gradient_accumulation_steps=1,
                             per_device_eval_batch_size=eval_batch, max_steps=STEPS,
                             logging_steps=1, save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0, prediction_loss_only=True)
    return cls(model=GPT2LMHeadModel(config), args=args,
               train_dataset=_data(EFFECTIVE * STEPS, 0), eval_dataset=_data(EFFECTIVE, 1))


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _train_three_ways() -> dict:
    """The configured Trainer without a budget (the reference), OomguardTrainer under the
    budget, and the configured Trainer under the same budget (must run out)."""
    from transformers import Trainer

    from oomguard.integrations import OomguardTrainer

    out: dict = {}
    reference = _trainer(Trainer, eval_batch=EFFECTIVE)
    reference.train()
    out["reference"] = _losses(reference)
    out["reference_eval"] = reference.evaluate()["eval_loss"]

    ours = _trainer(OomguardTrainer, eval_batch=EFFECTIVE)
    with budget_after_warmup(BUDGET):
        ours.train()
        out["eval"] = ours.evaluate()["eval_loss"]
    out["ours"] = _losses(ours)
    a, split = ours.args, ours.oomguard_train
    out["split"] = (list(split.sizes), a.per_device_train_batch_size,
                    a.gradient_accumulation_steps, split.search.size_to_use, split.found,
                    a.per_device_eval_batch_size)
    out["steps"] = ours.state.global_step

    plain = _trainer(Trainer)
    out["plain"] = trained_under(lambda: budget_after_warmup(BUDGET), plain)
    return out


@pytest.mark.slow
def test_trainer_finds_the_micro_batch_keeps_the_effective_batch_and_trains_the_same():
    from oomguard.training import micro_batches

    got = in_fresh_process(_train_three_ways)
    sizes, per_device, accumulation, fits, found, eval_batch = got["split"]
    assert got["plain"] == "oom"  # the configured batch does not fit this budget
    assert sizes == micro_batches(EFFECTIVE, fits) and len(sizes) > 1 and fits <= found
    # equal micro-batches are the Trainer's accumulation, unequal ones split in training_step
    equal = len(set(sizes)) == 1
    assert (per_device, accumulation) == ((sizes[0], len(sizes)) if equal else (EFFECTIVE, 1))
    assert got["steps"] == STEPS  # trained to the end: no OOM
    assert got["ours"] == pytest.approx(got["reference"], rel=1e-5)  # the same training
    assert eval_batch < EFFECTIVE  # the evaluation batch was sized too, and the loss kept
    assert got["eval"] == pytest.approx(got["reference_eval"], rel=1e-5)


def test_the_micro_batches_are_the_fewest_that_fit_as_equal_as_the_rows_allow():
    import oomguard
    from oomguard import integrations, training
    from oomguard.engine.errors import UsageError

    micro_batches = training.micro_batches
    assert micro_batches(64, 37) == [32, 32]  # not 37 + 27: the same passes, a lower peak
    assert micro_batches(64, 25) == [22, 21, 21]
    assert micro_batches(97, 96) == [49, 48]  # a prime: two passes, not 97 of one row
    assert micro_batches(97, 96, equal=True) == [1] * 97
    assert micro_batches(1024, 264) == [256] * 4 and micro_batches(64, 1000) == [64]
    for rows in range(1, 70):
        for most in range(1, 75):
            sizes = micro_batches(rows, most)
            assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1 and sizes[0] <= most
            assert len(sizes) == -(-rows // most)  # the fewest passes that fit
            equal = micro_batches(rows, most, equal=True)
            assert len(set(equal)) == 1 and sum(equal) == rows and equal[0] <= most
    assert oomguard.micro_batch_for(64, 37) == 32 and oomguard.micro_batch_for(64, 1000) == 64
    assert oomguard.micro_batch_for is training.micro_batch_for is integrations.micro_batch_for
    with pytest.raises(UsageError):
        oomguard.micro_batch_for(64, 0)


@pytest.mark.slow  # builds a Trainer (~1 s)
def test_a_training_set_without_a_length_is_one_usage_error_before_any_work():
    import torch

    from oomguard.engine.errors import UsageError
    from oomguard.integrations import OomguardTrainer

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_data(8, 0))

    trainer = _trainer(OomguardTrainer)
    trainer.train_dataset = Stream()
    with pytest.raises(UsageError, match="needs a dataset with a length"):
        trainer.train()
    assert trainer.optimizer is None  # nothing ran


def _evaluate_past_the_budget() -> dict:
    """The evaluation batch set above what fits (as if the search had answered on a lighter
    heap): ``evaluate()`` under the budget runs out of memory, halves and finishes, with the
    loss of an evaluation without a budget."""
    from transformers import Trainer

    from oomguard.engine.integrations.sizing import Split
    from oomguard.integrations import OomguardTrainer

    reference = _trainer(Trainer, eval_batch=EFFECTIVE).evaluate()["eval_loss"]
    ours = _trainer(OomguardTrainer, eval_batch=EFFECTIVE)
    ours.oomguard_eval = Split(EFFECTIVE, EFFECTIVE, 1, None)  # no search: the size as set
    with budget_after_warmup(BUDGET):
        loss = ours.evaluate()["eval_loss"]
    return {"reference": reference, "loss": loss, "batch": ours.args.per_device_eval_batch_size}


@pytest.mark.slow
def test_an_evaluation_that_runs_out_of_memory_halves_its_batch_and_finishes():
    got = in_fresh_process(_evaluate_past_the_budget)
    assert got["batch"] < EFFECTIVE  # it ran out of memory at least once
    assert got["batch"] in {EFFECTIVE >> k for k in range(1, 11)}
    assert got["loss"] == pytest.approx(got["reference"], rel=1e-5)
