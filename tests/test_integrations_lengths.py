"""The transformers Trainer grouping samples by length: ``OomguardTrainer`` plans its
micro-batches from the training samples' lengths (engine/integrations/length_steps.py).

A long tail of 96 samples (84 of 4-12 tokens, 12 of 32) and 48 rows per optimizer step,
searched under a real 32 MiB CPU budget (the search's own ``budget=``): about 37 rows fit at
length 32, all 48 at the short lengths. Each step's samples come as one batch (samples of
like length together), and ``training_step`` runs it in the micro-batches the plan allows at
their own length, each trimmed to its longest sample. After two SGD steps in float64 the
weights moved exactly as a plain Trainer's two whole 48-row steps over the same samples
moved them (the loss normalised by the step's tokens, ``num_items_in_batch``).
"""

from __future__ import annotations

import random
import tempfile

import pytest
import torch
from conftest import in_fresh_process

from tests.framework_parts import SEQ, VOCAB, gpt2

EFFECTIVE, STEPS = 48, 2
BUDGET = 32 * 1024**2
_rng = random.Random(0)
LENGTHS = [_rng.choice([4, 6, 8, 10, 12]) for _ in range(84)] + [SEQ] * 12
_rng.shuffle(LENGTHS)


def _samples(order: list[int]) -> list[dict[str, list[int]]]:
    out = []
    for i in order:
        ids = torch.randint(0, VOCAB, (LENGTHS[i],),
                            generator=torch.Generator().manual_seed(i)).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right padding to the batch's longest sample; padding's labels -100, its mask 0."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    for k, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[k, :n], mask[k, :n], labels[k, :n] = (torch.tensor(r["input_ids"]), 1,
                                                  torch.tensor(r["labels"]))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _args(out: str, strategy: str):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=EFFECTIVE,
                             max_steps=STEPS, optim="sgd", learning_rate=0.5, max_grad_norm=0.0,
                             lr_scheduler_type="constant", seed=0, report_to=[],
                             save_strategy="no", logging_strategy="no", use_cpu=True,
                             disable_tqdm=True, train_sampling_strategy=strategy)


def _moved(model: torch.nn.Module, before: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before,
                                                                   strict=True)])


def _array(t: torch.Tensor):
    return t.numpy()  # by value: a tensor from a child would come through shared memory


def planned_run() -> dict:
    """In a fresh process: OomguardTrainer by length; the weights' move, the plan's batches at
    a few lengths, the micro-batches each loss call saw (rows, columns) and the steps run."""
    from oomguard.engine.integrations.length_steps import StepSampler
    from oomguard.integrations import OomguardTrainer

    seen: list[tuple[int, int]] = []

    class Recording(OomguardTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.oomguard_train is not None:  # training, not the search's trials
                seen.append(tuple(inputs["input_ids"].shape))
            return super().compute_loss(model, inputs, *args, **kwargs)

    model = gpt2(torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as out:
        trainer = Recording(model=model, args=_args(out, "group_by_length"),
                            train_dataset=_samples(range(len(LENGTHS))), data_collator=collate,
                            oomguard_options={"budget": BUDGET})
        trainer.train()
        sampler = trainer.get_train_dataloader().batch_sampler  # a fresh one: epoch 0 again
        while not isinstance(sampler, StepSampler):  # accelerate's wrapper around it
            sampler = sampler.batch_sampler
        steps = list(sampler)[:STEPS]
    plan = trainer.oomguard_train.plan
    return {"moved": _array(_moved(model, before)), "seen": seen, "steps": steps,
            "max_batch": {n: plan.max_batch(n) for n in range(1, SEQ + 1)},
            "trials": plan.trials}


def whole_steps(steps: list[list[int]]) -> torch.Tensor:
    """A plain Trainer over the same steps' samples, each step one whole batch."""
    from transformers import Trainer

    model = gpt2(torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model=model, args=_args(out, "sequential"),
                          train_dataset=_samples([i for s in steps for i in s]),
                          data_collator=collate)
        trainer.train()
    return _moved(model, before)


@pytest.mark.slow
def test_trainer_by_length_runs_the_plans_micro_batches_and_moves_the_weights_as_whole_steps():
    got = in_fresh_process(planned_run)
    steps, seen, max_batch = got["steps"], got["seen"], got["max_batch"]
    assert got["trials"] <= 6
    assert max_batch[SEQ] < EFFECTIVE <= max_batch[4]  # the long samples do not fit whole
    assert [len(s) for s in steps] == [EFFECTIVE] * STEPS  # the effective batch kept
    # every micro-batch within the plan at its own (trimmed) length, a step's rows all run
    assert all(rows <= max_batch[cols] for rows, cols in seen), seen
    assert sum(rows for rows, _ in seen) == EFFECTIVE * STEPS
    assert len(seen) > STEPS  # a step with long samples ran in more than one micro-batch
    assert min(cols for _, cols in seen) < SEQ  # short micro-batches ran short, not padded
    reference = whole_steps(steps)
    moved = torch.from_numpy(got["moved"])
    assert float((moved - reference).norm() / reference.norm()) < 1e-6


def test_remedies_with_group_by_length_is_one_line_before_any_work() -> None:
    from oomguard.engine.errors import UsageError
    from oomguard.integrations import OomguardTrainer

    with tempfile.TemporaryDirectory() as out, pytest.raises(UsageError, match="drop one") as info:
        OomguardTrainer(model=gpt2(), args=_args(out, "group_by_length"),
                        train_dataset=_samples(range(4)), data_collator=collate,
                        oomguard_options={"remedies": ("accumulate",)})
    assert "\n" not in str(info.value)
