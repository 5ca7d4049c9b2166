"""A transformers ``Trainer`` that finds its own micro-batch and keeps the effective batch.

A mixin, not a callback: the batch size must be set before ``Trainer.train`` builds its
dataloader, which comes before the first callback event (transformers 5.24 trainer.py).

``train()`` first creates the optimizer (``create_optimizer()``, which training reuses),
searches ``training_step``, the Trainer's gradient clipping and ``optimizer.step()`` on the
first rows of the training set (model, optimizer and RNG restored afterwards), then splits
``per_device_train_batch_size x gradient_accumulation_steps`` rows into the fewest
micro-batches that fit the recommended size, as equal as the rows allow
(:func:`~.sizing.split_for`). Equal micro-batches run as the Trainer's own gradient
accumulation. Unequal ones (64 rows where 25 fit: 22 + 21 + 21) run inside one
``training_step`` over the whole effective batch, each micro-batch's loss weighted by its
share of the rows, or by the tokens of the whole batch where the Trainer passes
``num_items_in_batch``; either way a step's gradients are the whole batch's within float
rounding. ``evaluate()`` first searches ``prediction_step`` up to ``per_device_eval_batch_size``.

Where the Trainer groups samples by length (``train_sampling_strategy="group_by_length"``),
``train()`` plans the micro-batches from the training samples' lengths instead
(:func:`fit_train_steps`): each optimizer step's samples, of like length, come as one batch of
the effective batch's rows, and ``training_step`` runs it in the micro-batches the plan allows
at their own longest length, each trimmed to it (:mod:`~.length_steps`); the loss is
normalised as above, so a step's gradients are the whole step's.

With ``oomguard_options={"remedies": ("accumulate", "checkpoint")}``, ``train()`` prices each
configuration instead of the one search (:func:`~.sizing.priced_split`): the fastest safe
one's micro-batch splits the effective batch, and its configuration (checkpointing the
model's repeated blocks) holds while ``train()`` runs and is undone when it returns.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import has_length
from transformers.utils import is_datasets_available

from oomguard.engine.core.execute.priced import RemedyChoice, check_remedies, pricing_options
from oomguard.engine.core.execute.retry import Halve
from oomguard.engine.core.memory.oom import is_oom
from oomguard.engine.core.shapes import search_shapes
from oomguard.engine.errors import UsageError
from oomguard.engine.integrations.length_steps import StepSampler, cut_step
from oomguard.engine.integrations.sizing import (
    STEPS_PER_TRIAL,
    Split,
    batch_rows,
    priced_split,
    search_step,
    size_found,
    split_for,
    training_trial,
)
from oomguard.engine.util.rows import micro_batches, slice_rows

log = logging.getLogger("oomguard.integrations")


def _dataset_and_collator(trainer: Trainer, dataset: Any, description: str) -> tuple[Any, Any]:
    """``dataset`` and the collator as the Trainer's dataloader uses them (unused columns
    removed)."""
    if not has_length(dataset):
        raise UsageError(f"sizing the {description.lower()} batch needs a dataset with a length "
                         f"(rows to try); got {type(dataset).__name__}")
    collator = trainer.data_collator
    if is_datasets_available() and isinstance(dataset, importlib.import_module("datasets").Dataset):
        dataset = trainer._remove_unused_columns(dataset, description=description)
    else:  # what Trainer._get_dataloader does for other datasets
        collator = trainer._get_collator_with_removed_columns(collator, description=description)
    return dataset, collator


def first_rows(trainer: Trainer, dataset: Any, n: int, description: str) -> dict[str, Any]:
    """The first ``n`` rows of ``dataset`` collated as the Trainer's dataloader collates them,
    on its device. Not drawn from the dataloader: its sampler would draw from the RNG."""
    dataset, collator = _dataset_and_collator(trainer, dataset, description)
    return trainer._prepare_inputs(collator([dataset[i] for i in range(min(n, len(dataset)))]))


def by_length(trainer: Trainer) -> bool:
    """Whether the Trainer groups its training samples by length (its
    ``train_sampling_strategy``, or the older ``group_by_length`` flag)."""
    args = trainer.args
    return (getattr(args, "train_sampling_strategy", None) == "group_by_length"
            or bool(getattr(args, "group_by_length", False)))


def dataset_lengths(trainer: Trainer, dataset: Any) -> list[int]:
    """Each training sample's length, as the Trainer's length-grouped sampler reads it: the
    ``length_column_name`` column of a ``datasets.Dataset``, else the length of each
    sample's first model input (``input_ids``)."""
    args = trainer.args
    column = getattr(args, "length_column_name", "length")
    if (is_datasets_available() and isinstance(dataset, importlib.import_module("datasets").Dataset)
            and column in dataset.column_names):
        return [int(n) for n in dataset[column]]
    names = getattr(trainer.processing_class, "model_input_names", None) or ["input_ids"]
    first = dataset[0]
    if not isinstance(first, Mapping) or names[0] not in first:
        raise UsageError(f"grouping by length needs each sample to hold {names[0]!r} (or a "
                         f"{column!r} column): give samples as dicts of token ids")
    return [len(sample[names[0]]) for sample in dataset]


def _cut_sample(sample: Mapping[str, Any], length: int, seq_len: int) -> dict[str, Any]:
    """``sample`` (a dict of per-token lists or tensors of ``length``) cut to ``seq_len``."""
    return {k: v[:seq_len] if hasattr(v, "__len__") and not isinstance(v, str)
            and len(v) == length else v for k, v in sample.items()}


def _training_parts(trainer: Trainer) -> tuple[torch.nn.Module, Any, Callable[[], None] | None]:
    """The model, the optimizer training reuses (created now) and the Trainer's gradient
    clipping before each optimizer step (None where it does not clip), for a search of its
    step; the Trainer's per-step accumulation count set as its loop sets it."""
    args = trainer.args
    model, optimizer = trainer.model, trainer.create_optimizer()
    if not hasattr(trainer, "current_gradient_accumulation_steps"):
        trainer.current_gradient_accumulation_steps = 1  # the loop sets it before each step

    def clip() -> None:  # what the Trainer's loop does before each optimizer step
        trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)

    return model, optimizer, clip if args.max_grad_norm > 0 else None


def fit_train_steps(trainer: Trainer, **options: Any) -> Split:
    """The Trainer's effective batch kept per optimizer step, its micro-batches planned from
    the training samples' lengths: a :func:`~oomguard.engine.core.shapes.search_shapes` of
    the Trainer's whole step (``training_step`` of two micro-batches, the gradient clipping,
    the optimizer's step) at shapes it chooses, on the longest sample cut to each length;
    model and optimizer restored. Returns the :class:`Split` holding the plan; the mixin's
    dataloader then yields each step's samples as one batch (:class:`StepSampler`) and its
    ``training_step`` runs it in the micro-batches the plan allows at their lengths
    (:func:`cut_step`). ``options`` go to ``search_shapes`` (``estimate`` off unless given:
    tracing the Trainer's step on fake tensors costs more than the real trials)."""
    args = trainer.args
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps
    dataset, collator = _dataset_and_collator(trainer, trainer.train_dataset, "Training")
    lengths = dataset_lengths(trainer, dataset)
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    model, optimizer, clipping = _training_parts(trainer)

    def step(size: int, seq_len: int) -> float:
        row = _cut_sample(dataset[longest], lengths[longest], seq_len)
        batch = trainer._prepare_inputs(collator([row] * size))
        return training_trial(lambda n: trainer.training_step(model, slice_rows(batch, 0, n)),
                              optimizer, effective, clipping)(size)

    step.__name__ = "trainer.training_step"  # type: ignore[attr-defined]
    options.setdefault("steps_per_trial", STEPS_PER_TRIAL)
    options.setdefault("max_size", effective)
    # The fake-tensor estimate traces the Trainer's whole step (accelerate's backward, the
    # loss kwargs): measured 10-28 s on a 1-layer GPT-2 where the 6 real trials take 3.7 s.
    options.setdefault("estimate", False)
    plan = search_shapes(step, lengths, restore=(model, optimizer), **options)
    split = Split(effective, effective, 1, None, plan=plan)
    use_train_split(trainer, split)
    log.info("Trainer: %d rows per device and step, micro-batches %s (%d real trials)",
             effective, split.describe(), plan.trials)
    return split


def fit_train_batch(trainer: Trainer, largest: bool = False,
                    remedies: Sequence[str] | None = None, **options: Any) -> Split:
    """Set ``trainer``'s per-device batch and accumulation steps so that each optimizer step
    still sees the effective batch (``per_device_train_batch_size x
    gradient_accumulation_steps`` rows); return the :class:`Split`. It creates the optimizer
    (which training reuses) and searches ``training_step``, the gradient clipping and
    ``optimizer.step()`` on the first rows of the training set, model and optimizer restored
    afterwards. The micro-batches are at most the recommended size (the largest safe one), or
    with ``largest`` the largest that ran. Equal micro-batches become the Trainer's own
    accumulation; unequal ones (only an :class:`OomguardTrainerMixin` runs them) a per-device
    batch of the whole effective batch, split in ``training_step``. ``options`` go to
    ``oomguard.search``. With ``remedies`` (checked: :func:`~oomguard.engine.core.execute.priced.check_remedies`),
    ``training_step`` and the optimizer's step are priced in each configuration instead
    (:func:`~.sizing.priced_split`; ``options`` are the pricing's): the split's ``remedy`` is
    the choice, whose configuration the caller runs training in (:meth:`OomguardTrainerMixin.train`
    does)."""
    args = trainer.args
    if trainer.train_dataset is None:
        raise UsageError("the Trainer has no train_dataset to size the micro-batch on; pass "
                         "train_dataset= to the Trainer")
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps
    batch = first_rows(trainer, trainer.train_dataset, effective, "Training")
    model, optimizer, clipping = _training_parts(trainer)

    def micro_step(size: int) -> torch.Tensor:
        return trainer.training_step(model, slice_rows(batch, 0, size))

    # DeepSpeed accumulates in its engine, which steps at its own boundaries: equal ones only.
    unequal = isinstance(trainer, OomguardTrainerMixin) and not trainer.is_deepspeed_enabled
    rows = min(effective, batch_rows(batch))
    if remedies is not None:
        split = priced_split(micro_step, effective, rows, model, optimizer,
                             check_remedies(remedies, model, args.device),
                             "trainer.training_step", "Trainer", largest, equal=not unequal,
                             clip=clipping, **options)
    else:
        step = training_trial(micro_step, optimizer, effective, clipping)
        result = _search_in_mode(model, False, step, rows, (model, optimizer),
                                 "trainer.training_step", **options)
        split = split_for(effective, result, largest, equal=not unequal)
    use_train_split(trainer, split)
    log.info("Trainer: micro-batches %s = %d rows per device and step (at most %d rows; "
             "largest that ran: %s)%s", split.describe(), effective, split.allowed, split.found,
             "" if split.remedy is None else f", in the configuration {split.remedy.chosen.name}")
    return split


def use_train_split(trainer: Trainer, split: Split) -> None:
    """Set ``trainer``'s arguments to run ``split``: equal micro-batches as its own gradient
    accumulation, unequal ones as one per-device batch of the effective batch, which an
    :class:`OomguardTrainerMixin`'s ``training_step`` runs in micro-batches (it must hold
    ``split`` as ``oomguard_train``)."""
    args = trainer.args
    if split.equal:
        args.per_device_train_batch_size = split.micro_batch
        args.gradient_accumulation_steps = split.accumulation
    else:
        args.per_device_train_batch_size = split.effective
        args.gradient_accumulation_steps = 1
    trainer._train_batch_size = args.train_batch_size


def fit_eval_batch(trainer: Trainer, eval_dataset: Any = None, largest: bool = False,
                   **options: Any) -> Split:
    """Set ``trainer``'s per-device evaluation batch to the recommended size (with
    ``largest``, the largest that ran) of a search of ``prediction_step`` up to
    ``per_device_eval_batch_size``; return the :class:`Split` (no accumulation)."""
    args = trainer.args
    dataset = eval_dataset if eval_dataset is not None else trainer.eval_dataset
    if dataset is None or isinstance(dataset, (dict, str)):
        raise UsageError("fit_eval_batch sizes one evaluation dataset; got "
                         f"{type(dataset).__name__}; pass one dataset as eval_dataset= "
                         "(call it once for each)")
    configured = args.per_device_eval_batch_size
    model = trainer.model
    batch = first_rows(trainer, dataset, configured, "Evaluation")

    def step(size: int) -> int:
        trainer.prediction_step(model, slice_rows(batch, 0, size), args.prediction_loss_only)
        return size

    result = _search_in_mode(model, True, step, min(configured, batch_rows(batch)), None,
                             "trainer.prediction_step", **options)
    size = size_found(result, largest)
    args.per_device_eval_batch_size = size
    log.info("Trainer: evaluation batch %d per device (configured %d, largest that ran: %d)",
             size, configured, result.max_ok)
    return Split(size, size, 1, result.max_ok, result)


def _search_in_mode(model: torch.nn.Module, evaluate: bool, *args: Any, **options: Any) -> Any:
    """:func:`~.sizing.search_step`, in eval mode with ``evaluate``; the model's mode kept."""
    was_training = model.training
    if evaluate:
        model.eval()
    try:
        return search_step(*args, **options)
    finally:
        model.train(was_training)


class OomguardTrainerMixin:
    """Put before a ``Trainer`` class: ``train()`` first sizes the micro-batch, the effective
    batch kept (:func:`fit_train_batch`), and ``evaluate()`` the evaluation batch
    (:func:`fit_eval_batch`). It composes with your own subclass:
    ``class MyTrainer(OomguardTrainerMixin, SFTTrainer)``. ``oomguard_options``
    (a dict given to ``__init__``) go to ``oomguard.search``; ``oomguard_largest=True``
    runs up to the largest size that ran instead of the recommended size. The splits chosen
    are ``self.oomguard_train`` and ``self.oomguard_eval``.

    ``oomguard_options["remedies"]`` (e.g. ``("accumulate", "checkpoint")``; default none):
    where the effective batch does not fit at one micro-batch, ``train()`` runs the fastest
    safe configuration, priced (:func:`fit_train_batch`); its table is
    ``self.oomguard_remedy``. The remedies, the model (repeated blocks for ``checkpoint``) and
    the options (the pricing's: ``budget``, ``margin``, ...) are checked here, in one line,
    before any work."""

    def __init__(self, *args: Any, oomguard_options: dict[str, Any] | None = None,
                 oomguard_largest: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = dict(oomguard_options or {})
        remedies = options.pop("remedies", None)
        self.oomguard_remedies: tuple[str, ...] | None = None
        if remedies is not None and by_length(self):
            raise UsageError("oomguard_options remedies= prices one micro-batch size, and "
                             "group_by_length plans one per length: drop one of them")
        if remedies is not None:
            self.oomguard_remedies = check_remedies(remedies, self.model, self.args.device)
            pricing_options(options)
        self.oomguard_options = options
        self.oomguard_largest = oomguard_largest
        self.oomguard_train: Split | None = None
        self.oomguard_eval: Split | None = None
        self._oomguard_share: float | None = None  # the running micro-batch's loss weight

    @property
    def oomguard_remedy(self) -> RemedyChoice | None:
        """The remedies' pricing of ``train()``: its table (``.table``, ``.to_dict()``) and the
        configuration chosen (None: no ``remedies``, or not trained yet)."""
        return None if self.oomguard_train is None else self.oomguard_train.remedy

    def train(self, *args: Any, **kwargs: Any) -> Any:
        if self.oomguard_train is None and by_length(self):
            self.oomguard_train = fit_train_steps(self, **self.oomguard_options)
        elif self.oomguard_train is None:
            self.oomguard_train = fit_train_batch(self, self.oomguard_largest,
                                                  self.oomguard_remedies,
                                                  **self.oomguard_options)
        remedy = self.oomguard_train.remedy
        # The chosen configuration (checkpointed blocks) while training runs, undone after.
        with contextlib.nullcontext() if remedy is None else remedy.applied(self.model):
            return super().train(*args, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's ``training_step`` on each micro-batch of an unequal split (every one
        but the last under ``no_sync``), each loss weighted by its share of ``inputs``' rows
        where the Trainer does not normalise it by ``num_items_in_batch`` itself; the sum of
        their losses. Equal splits and the search's trials pass straight through."""
        split = self.oomguard_train
        if split is None or split.equal:
            return super().training_step(model, inputs, num_items_in_batch)
        rows = batch_rows(inputs)
        weighted = not _loss_scaled_for_accumulation(self, num_items_in_batch)
        if split.plan is not None:  # a step of samples of like length: cut by their lengths
            pieces = cut_step(inputs, split.plan.max_batch)
        else:
            bounds = itertools.accumulate(micro_batches(rows, split.micro_batch), initial=0)
            pieces = [slice_rows(inputs, a, b) for a, b in itertools.pairwise(bounds)]
        total: torch.Tensor | None = None
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            self._oomguard_share = batch_rows(piece) / rows if weighted else None
            try:
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    loss = super().training_step(model, piece, num_items_in_batch)
            finally:
                self._oomguard_share = None
            total = loss if total is None else total + loss
        assert total is not None
        return total

    def get_train_dataloader(self) -> Any:
        """The Trainer's own, or where the micro-batches are planned from the lengths, one
        whose every batch is an optimizer step's samples (:class:`StepSampler`: shuffled each
        epoch from the Trainer's seed, whole steps per rank), prepared by accelerate as the
        Trainer prepares its own."""
        split = self.oomguard_train
        if split is None or split.plan is None:
            return super().get_train_dataloader()
        args = self.args
        dataset, collator = _dataset_and_collator(self, self.train_dataset, "Training")
        world = max(1, args.world_size)
        sampler = StepSampler(dataset_lengths(self, dataset), split.plan.max_batch,
                              split.effective, seed=args.data_seed or args.seed,
                              rank=args.process_index if world > 1 else 0, world_size=world)
        loader = self.accelerator.prepare(torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collator,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory))
        # accelerate shards a batch sampler across processes; this one is rank-aware already
        prepared = getattr(loader, "batch_sampler", None)
        if prepared is not None and getattr(prepared, "batch_sampler", None) is sampler:
            prepared.num_processes, prepared.process_index = 1, 0
        return loader

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any],
                     return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """The Trainer's loss, times the running micro-batch's share of the rows while
        :meth:`training_step` runs an unequal split (else unchanged)."""
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        share = self._oomguard_share
        if share is None:
            return out
        return (out[0] * share, *out[1:]) if return_outputs else out * share

    def evaluate(self, eval_dataset: Any = None, *args: Any, **kwargs: Any) -> Any:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if self.oomguard_eval is None and not isinstance(dataset, (dict, str)):
            with torch.no_grad():
                self.oomguard_eval = fit_eval_batch(self, eval_dataset, self.oomguard_largest,
                                                    **self.oomguard_options)
        while True:
            try:
                return super().evaluate(eval_dataset, *args, **kwargs)
            except Exception as exc:
                if not self._eval_batch_halved(exc):
                    raise

    def _eval_batch_halved(self, exc: BaseException) -> bool:
        """After an OOM in ``evaluate()``, halve the evaluation batch and say so; False where
        ``exc`` is no OOM or the batch is 1 already. Evaluation changes no state, so it reruns
        cleanly. The search can pass and the loop still fail: it runs later, on a heap the
        training left (measured once under a 40 MiB CPU budget)."""
        args = self.args
        smaller = Halve().shrink({"batch": args.per_device_eval_batch_size}, {"batch": 1})
        if not is_oom(exc) or smaller is None:
            return False
        log.warning("Trainer: evaluation ran out of memory at %d rows per device; again at %d",
                    args.per_device_eval_batch_size, smaller["batch"])
        args.per_device_eval_batch_size = smaller["batch"]
        return True


def _loss_scaled_for_accumulation(trainer: Trainer, num_items_in_batch: Any) -> bool:
    """Whether the Trainer takes each micro-batch's loss as already divided by the whole
    batch's ``num_items_in_batch`` (by the model or ``compute_loss_func``), as its
    ``training_step`` decides (transformers 5.24); else it divides by the accumulation steps."""
    told = getattr(trainer, "loss_is_scaled_for_ga", None)
    if told is not None:
        return bool(told)
    return bool((trainer.model_accepts_loss_kwargs and num_items_in_batch is not None)
                or trainer.compute_loss_func is not None)


class OomguardTrainer(OomguardTrainerMixin, Trainer):
    """``transformers.Trainer`` that sizes its micro-batch and evaluation batch; a drop-in
    for ``Trainer(...)`` (:class:`OomguardTrainerMixin`)."""
